"""Every planted bug of every lesson is caught by its own exercise, and a learner's untouched
workspace scores zero without hanging: only that exercise's tests run per bug, up to their
first failure (the test bugs.json names as catching it runs first), the lessons shared by two
grader processes side by side (torch and the forkserver start once in each, not once per
lesson), to keep CI short. (A real workspace
written by `course exercise` and graded by `course grade`: tests/test_exercises.py.)"""

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
    """Two grader processes grade every lesson once, in setUpClass: each lesson with every
    exercise stubbed (what a learner's untouched workspace scores), then each planted bug."""

    results: dict = {}
    untouched: dict = {}

    @classmethod
    def grade_part(cls, part: list[dict]) -> tuple[dict, dict]:
        """One grader process for these lessons, in a reference copy of every lesson of its own
        (a bug planted in lesson 01 changes the lessons that import it: the other process
        must not see it)."""
        workspace = Path(tempfile.mkdtemp(dir=cls.tmp))
        # with the compiled bytecode, where there is some (.ci/run compiles the course): copied
        # with their times, the copies stay valid, and no process compiles the lesson's files
        # again (the grader removes a changed file's bytecode while it is changed: planted())
        shutil.copytree(REPO_ROOT / "lessons", workspace / "lessons")
        untouched: dict = {}
        return grade_planted_bugs(part, workspace, timeout=900, untouched=untouched), untouched

    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp(prefix="dtfs-bugs-"))
        cls.chosen = lessons_with_exercises()
        try:
            with concurrent.futures.ThreadPoolExecutor(PROCESSES) as pool:
                for found, untouched in pool.map(cls.grade_part, split(cls.chosen, PROCESSES)):
                    cls.results.update(found)
                    cls.untouched.update(untouched)
        finally:
            shutil.rmtree(cls.tmp, True)

    def test_planted_bugs_are_caught_by_their_exercise(self):
        for lesson in self.chosen:
            bugs = ex.planted_bugs(REPO_ROOT / lesson["folder"])
            self.assertEqual([r["id"] for r in self.results[lesson["id"]]], [bug.id for bug in bugs])
            for result in self.results[lesson["id"]]:
                with self.subTest(lesson=lesson["id"], bug=result["id"]):
                    self.assertEqual(result["outcome"], "failed",
                                     f"{result['mistake']}: not caught by {result['exercise']}")

    def test_every_bugs_hint_names_the_test_that_catches_it(self):
        """bugs.json's caught_by runs first, so a bug costs one test, not every test before it
        (CI's time): a missing or stale hint fails here, with the command that rewrites them."""
        rewrite = ("in a copy of lessons/: python -m lessons._grading {tests} --planted-bugs "
                   "--write-hints COURSE/lessons --json /tmp/bugs.json")
        for lesson in self.chosen:
            for result in self.results[lesson["id"]]:
                with self.subTest(lesson=lesson["id"], bug=result["id"]):
                    command = rewrite.format(tests=lesson["paths"]["tests"])
                    self.assertEqual(result["hint"], result["caught_by"],
                                     f"{result['id']}: hint {result['hint']!r}, caught first by "
                                     f"{result['caught_by']!r}; {command}")

    def test_an_untouched_workspace_scores_zero_without_hanging(self):
        """Every exercise stubbed: each fails with the stub's NotImplementedError, in minutes
        at most (a stub never makes a rank wait out a deadline)."""
        for lesson in self.chosen:
            report = self.untouched[lesson["id"]]
            with self.subTest(lesson=lesson["id"]):
                for exercise in ex.lesson_exercises(REPO_ROOT / lesson["folder"]):
                    entry = report["criteria"].get(exercise.id, {"outcome": "no test ran", "message": ""})
                    self.assertEqual(entry["outcome"], "failed", f"{exercise.id}: {entry['message']}")
                    self.assertIn("NotImplementedError", entry["message"], exercise.id)
                self.assertLess(report["seconds"], 300, "the untouched workspace's grading took too long")


if __name__ == "__main__":
    unittest.main()
