"""catalog.json: valid against its schema and true to the folders, both ways."""

from __future__ import annotations

import contextlib
import copy
import io
import subprocess
import sys
import unittest

from course import CatalogError, catalog_problems, select_lessons
from tests._course import REPO_ROOT, catalog, lesson_module, lessons


class TestCatalog(unittest.TestCase):
    def test_catalog_is_valid_and_matches_the_folders(self):
        self.assertEqual(catalog_problems(catalog()), [])

    def test_every_lesson_folder_is_listed(self):
        folders = sorted(p.name for p in (REPO_ROOT / "lessons").glob("[0-9][0-9]_*"))
        listed = [lesson["folder"].split("/")[-1] for lesson in catalog()["lessons"]]
        self.assertEqual(folders, listed)
        self.assertGreater(len(listed), 0)

    def test_schema_errors_name_the_json_path(self):
        broken = copy.deepcopy(catalog())
        del broken["lessons"][0]["summary"]
        broken["lessons"][0]["minutes"] = "ninety"
        problems = catalog_problems(broken)
        self.assertTrue(any("$.lessons[0]" in p and "summary" in p for p in problems), problems)
        self.assertTrue(any("$.lessons[0].minutes" in p for p in problems), problems)

    def test_cross_checks_catch_wrong_paths_counts_and_prerequisites(self):
        broken = copy.deepcopy(catalog())
        lesson = broken["lessons"][0]
        lesson["paths"]["notebook"] = "notebooks/missing.ipynb"
        lesson["questions"] += 1
        lesson["prerequisites"] = ["99"]
        problems = "\n".join(catalog_problems(broken))
        self.assertIn("paths.notebook: notebooks/missing.ipynb does not exist", problems)
        self.assertIn("questions:", problems)
        self.assertIn("'99' is not an earlier lesson", problems)

    def test_listed_exercises_must_match_the_markers(self):
        broken = copy.deepcopy(catalog())
        lesson = next(item for item in broken["lessons"] if item.get("exercises"))
        lesson["exercises"][0]["points"] += 1
        problems = "\n".join(catalog_problems(broken))
        self.assertIn(".exercises:", problems)
        self.assertIn("must match", problems)

    def test_a_listed_folder_that_does_not_exist_is_reported(self):
        broken = copy.deepcopy(catalog())
        ghost = copy.deepcopy(broken["lessons"][-1])
        ghost.update(id="98", slug="ghost", folder="lessons/98_ghost")
        broken["lessons"].append(ghost)
        self.assertIn("lessons/98_ghost is listed but missing", "\n".join(catalog_problems(broken)))

    def test_select_lessons(self):
        data = catalog()
        self.assertEqual(select_lessons(data, ["01"])[0]["slug"], "collectives")
        self.assertEqual(select_lessons(data, ["collectives"])[0]["id"], "01")
        with self.assertRaises(CatalogError):
            select_lessons(data, ["nope"])

    def test_course_catalog_command(self):
        proc = subprocess.run([sys.executable, "-m", "course", "catalog"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("Collective operations", proc.stdout)


class TestDefaultsAtEveryWorldSize(unittest.TestCase):
    """The guide: a lesson's defaults run at world sizes 1-4 without the learner picking other
    sizes. Each multi-rank lesson's own argument parser must accept --world-size 1..4 alone
    (lesson 04's 4 heads and 8 positions once refused 3 ranks); a one-process lesson, 1."""

    def test_each_lesson_accepts_its_world_sizes_with_defaults(self):
        for lesson in lessons():
            checks = lesson_module(lesson, "checks")
            worlds = range(1, 5) if lesson["hardware"]["default_ranks"] > 1 else (1,)
            for world in worlds:
                with self.subTest(lesson=lesson["id"], world=world), \
                        contextlib.redirect_stderr(io.StringIO()) as err:
                    try:
                        checks.parse_args(["--world-size", str(world)])
                    except SystemExit:
                        self.fail(f"{lesson['id']} at --world-size {world}: "
                                  f"{err.getvalue().strip().splitlines()[-1]}")


if __name__ == "__main__":
    unittest.main()
