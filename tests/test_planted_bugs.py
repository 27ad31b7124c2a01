"""Every planted bug of every lesson is caught by its own exercise: only that exercise's tests
run per bug, up to their first failure, all lessons in one grader process (torch and the
forkserver start once), to keep CI short. Its own file, so that pytest-xdist (`--dist
loadfile`) runs it beside the rest of tests/test_learner_mode.py."""

from __future__ import annotations

import shutil
import tempfile
import unittest
from pathlib import Path

from course.__main__ import grade_planted_bugs
from lessons import _exercises as ex
from tests._course import REPO_ROOT
from tests.test_learner_mode import lessons_with_exercises


class TestPlantedBugs(unittest.TestCase):
    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dtfs-bugs-"))
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def test_planted_bugs_are_caught_by_their_exercise(self):
        chosen = lessons_with_exercises()
        workspace = self.tmp / "bugs"  # a reference copy of every lesson, tests included
        shutil.copytree(REPO_ROOT / "lessons", workspace / "lessons",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        results = grade_planted_bugs(chosen, workspace, timeout=900)
        for lesson in chosen:
            bugs = ex.planted_bugs(REPO_ROOT / lesson["folder"])
            self.assertEqual([r["id"] for r in results[lesson["id"]]], [bug.id for bug in bugs])
            for result in results[lesson["id"]]:
                with self.subTest(lesson=lesson["id"], bug=result["id"]):
                    self.assertEqual(result["outcome"], "failed",
                                     f"{result['mistake']}: not caught by {result['exercise']}")



if __name__ == "__main__":
    unittest.main()
