"""Learner mode on the real lessons: every marked exercise is graded by at least one test, and
a workspace never overwrites work (an untouched workspace scoring 0 without hanging, and every
planted bug caught by its own exercise: tests/test_planted_bugs.py, one grader process per core
for every lesson).

The reference scoring full marks follows from the lessons' own suites passing (pytest runs
them) together with `test_every_exercise_is_graded`: every test belongs to an exercise or to
the lesson's integration criterion, and every exercise has tests.
"""

from __future__ import annotations

import shutil
import tempfile
import unittest
from pathlib import Path

from lessons import _exercises as ex
from lessons._grading import criterion_of
from tests._course import REPO_ROOT, lessons


def lessons_with_exercises() -> list[dict]:
    return [lesson for lesson in lessons() if ex.lesson_exercises(REPO_ROOT / lesson["folder"])]


def criteria_of_tests(lesson: dict) -> dict[str, list[str]]:
    suite = unittest.TestLoader().discover(str(REPO_ROOT / lesson["paths"]["tests"]),
                                           top_level_dir=str(REPO_ROOT))
    found: dict[str, list[str]] = {}
    stack = [suite]
    while stack:
        item = stack.pop()
        if isinstance(item, unittest.TestSuite):
            stack.extend(item)
        else:
            found.setdefault(criterion_of(item), []).append(item.id())
    return found


class TestExercisesAreGraded(unittest.TestCase):
    def test_some_lessons_have_exercises(self):
        self.assertGreater(len(lessons_with_exercises()), 0)

    def test_every_exercise_is_graded(self):
        for lesson in lessons_with_exercises():
            exercises = ex.lesson_exercises(REPO_ROOT / lesson["folder"])
            graded = criteria_of_tests(lesson)
            with self.subTest(lesson=lesson["id"]):
                self.assertTrue(2 <= len(exercises) <= 5, [e.id for e in exercises])
                for exercise in exercises:
                    self.assertIn(exercise.id, graded, f"no test grades {exercise.id}")
                unknown = set(graded) - {e.id for e in exercises} - {ex.INTEGRATION}
                self.assertEqual(unknown, set(), "tests tagged with unmarked exercises")
                self.assertGreaterEqual(len(ex.planted_bugs(REPO_ROOT / lesson["folder"])), 5)


class TestWorkspaces(unittest.TestCase):
    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dtfs-workspace-"))
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def test_workspace_refuses_to_overwrite_work(self):
        lesson = lessons_with_exercises()[0]
        workspace = self.tmp / "mine"
        ex.write_workspace(REPO_ROOT / lesson["folder"], workspace)
        with self.assertRaisesRegex(ex.ExerciseError, "is not empty"):
            ex.write_workspace(REPO_ROOT / lesson["folder"], workspace)


if __name__ == "__main__":
    unittest.main()
