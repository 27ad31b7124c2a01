"""Every planted bug of every lesson is caught by its own exercise: only that exercise's tests
run per bug, up to their first failure, the lessons shared by two grader processes side by
side (torch and the forkserver start once in each), to keep CI short. Its own file, so that
pytest-xdist (`--dist loadfile`) runs it beside the rest of tests/test_learner_mode.py."""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import unittest
from pathlib import Path

from course.__main__ import grade_planted_bugs
from lessons import _exercises as ex
from tests._course import REPO_ROOT
from tests.test_learner_mode import lessons_with_exercises

PROCESSES = 2  # grader processes at once, one per core (CI's machine has two)


def split(chosen: list[dict], parts: int) -> list[list[dict]]:
    """The lessons in `parts` groups of about as many planted bugs each (the heaviest first,
    each to the lightest group so far)."""
    groups: list[list[dict]] = [[] for _ in range(parts)]
    load = [0] * parts
    counts = {lesson["id"]: len(ex.planted_bugs(REPO_ROOT / lesson["folder"])) for lesson in chosen}
    for lesson in sorted(chosen, key=lambda item: -counts[item["id"]]):
        lightest = load.index(min(load))
        groups[lightest].append(lesson)
        load[lightest] += counts[lesson["id"]]
    return [group for group in groups if group]


class TestPlantedBugs(unittest.TestCase):
    def grade_part(self, part: list[dict]) -> dict:
        """One grader process for these lessons, in a reference copy of every lesson of its own
        (a bug planted in lesson 01 changes the lessons that import it: the other process
        must not see it)."""
        workspace = Path(tempfile.mkdtemp(dir=self.tmp))
        shutil.copytree(REPO_ROOT / "lessons", workspace / "lessons",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return grade_planted_bugs(part, workspace, timeout=900)

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dtfs-bugs-"))
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def test_planted_bugs_are_caught_by_their_exercise(self):
        chosen = lessons_with_exercises()
        results = {}
        with concurrent.futures.ThreadPoolExecutor(PROCESSES) as pool:
            for found in pool.map(self.grade_part, split(chosen, PROCESSES)):
                results.update(found)
        for lesson in chosen:
            bugs = ex.planted_bugs(REPO_ROOT / lesson["folder"])
            self.assertEqual([r["id"] for r in results[lesson["id"]]], [bug.id for bug in bugs])
            for result in results[lesson["id"]]:
                with self.subTest(lesson=lesson["id"], bug=result["id"]):
                    self.assertEqual(result["outcome"], "failed",
                                     f"{result['mistake']}: not caught by {result['exercise']}")



if __name__ == "__main__":
    unittest.main()
