"""Learner mode's machinery on a toy lesson: markers found, bodies stubbed (docstrings kept),
grading by exercise (passed / failed / blocked, a skip never a pass), planted bugs caught by
their own exercise and no other, malformed markers and bug specs named by file and line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
import unittest.mock
from pathlib import Path

from lessons import _exercises as ex
from lessons._prewarm import NO_PREWARM
from tests._course import REPO_ROOT

TOY_MAIN = '''\
"""A toy lesson."""


# exercise add (2 points): Add two numbers
# hint: use +
#   (really)
def add(a, b):
    """Return a + b."""
    return a + b


# exercise scale (3 points): Scale a list
def scale(values, factor):
    """Every value times `factor`."""
    out = [v * factor for v in values]
    return out


class Accumulator:
    """Keeps a running sum."""

    def __init__(self):
        self.total = 0

    # exercise add (continued)
    def push(self, value):
        """Add `value` to the total; return the new total."""
        self.total = add(self.total, value)
        return self.total


def untouched():
    return 42
'''

TOY_TEST = '''\
import importlib
import unittest

from lessons._testing import exercise

M = importlib.import_module("lessons.99_toy.main")


@exercise("add")
class TestAdd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):  # leaves a trace: a planted bug's hint runs a later class first
        open("add_was_set_up", "w").close()

    def test_add(self):
        self.assertEqual(M.add(2, 3), 5)

    def test_push(self):
        acc = M.Accumulator()
        acc.push(2)
        self.assertEqual(acc.push(3), 5)


@exercise("add")
class TestAddLater(unittest.TestCase):
    @classmethod
    def setUpClass(cls):  # leaves a trace: --first-failure must not set this class up
        open("add_later_was_set_up", "w").close()

    def test_add_again(self):
        self.assertEqual(M.add(1, 1), 2)


class TestScale(unittest.TestCase):
    @exercise("scale")
    def test_scale(self):  # leaves a trace per subTest: --first-failure stops at the first failing one
        for factor in (3, 4):
            with self.subTest(factor=factor):
                open(f"scaled_by_{factor}", "w").close()
                self.assertEqual(M.scale([1, 2], factor), [factor, 2 * factor])

    def test_untouched(self):
        self.assertEqual(M.untouched(), 42)

    @unittest.skip("needs a GPU")
    def test_gpu(self):
        pass
'''

FIXTURE_TEST = '''\
import importlib
import unittest

from lessons._testing import exercise

M = importlib.import_module("lessons.99_toy.main")


@exercise("scale")
class TestScaleFixture(unittest.TestCase):
    @classmethod
    def setUpClass(cls):  # the class's fixture calls the exercise: a stub fails it here
        cls.scaled = M.scale([1], 2)

    def test_fixture(self):
        self.assertEqual(self.scaled, [2])


@exercise("scale")
class TestScaleLater(unittest.TestCase):
    @classmethod
    def setUpClass(cls):  # leaves a trace: --first-failure must not set this class up
        open("scale_later_was_set_up", "w").close()

    def test_scale_later(self):
        self.assertEqual(M.scale([2], 2), [4])
'''


SKIPPED_CLASS_TEST = '''\
import importlib
import unittest

from lessons._testing import exercise

M = importlib.import_module("lessons.99_toy.main")


@exercise("scale")
class TestScaleOnTwoGPUs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):  # a class that skips itself in its fixture: blocked, not failed
        raise unittest.SkipTest("needs two GPUs")

    def test_scale_on_gpus(self):
        self.assertEqual(M.scale([1], 2), [2])


@exercise("add")
class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(M.add(2, 3), 5)
'''


def make_workspace(root: Path, main: str = TOY_MAIN, test: str = TOY_TEST) -> dict:
    """A course-shaped folder with the shared modules and one toy lesson; its catalog entry."""
    package = root / "lessons"
    package.mkdir(parents=True)
    for shared in (REPO_ROOT / "lessons").glob("*.py"):
        shutil.copy(shared, package / shared.name)
    lesson = package / "99_toy"
    (lesson / "tests").mkdir(parents=True)
    (lesson / "__init__.py").write_text("")
    (lesson / "tests" / "__init__.py").write_text("")
    (lesson / "main.py").write_text(main)
    (lesson / "tests" / "test_toy.py").write_text(test)
    return {"id": "99", "folder": "lessons/99_toy", "paths": {"tests": "lessons/99_toy/tests"}}


class TestMarkers(unittest.TestCase):
    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.tmp)
        make_workspace(self.tmp)
        self.main = self.tmp / "lessons" / "99_toy" / "main.py"

    def test_find_exercises(self):
        found = ex.find_exercises(self.main)
        self.assertEqual([(e.id, e.points, e.title) for e in found],
                         [("add", 2, "Add two numbers"), ("scale", 3, "Scale a list")])
        self.assertEqual(found[0].targets, ["add", "Accumulator.push"])
        self.assertEqual(found[0].hint, "use + (really)")

    def test_stubs_keep_signature_and_docstring(self):
        found = ex.find_exercises(self.main)
        stubbed = ex.stub_source(self.main.read_text(), found)
        namespace: dict = {}
        exec(compile(stubbed, "stubbed", "exec"), namespace)
        self.assertEqual(namespace["add"].__doc__, "Return a + b.")
        self.assertEqual(namespace["untouched"](), 42)
        with self.assertRaises(NotImplementedError) as caught:
            namespace["add"](1, 2)
        self.assertIn("exercise add: Add two numbers", str(caught.exception))
        with self.assertRaises(NotImplementedError):
            namespace["Accumulator"]().push(1)
        self.assertEqual(namespace["Accumulator"]().total, 0)  # __init__ is not an exercise
        with self.assertRaises(NotImplementedError):
            namespace["scale"]([1], 2)

    def test_only_one_exercise(self):
        found = ex.find_exercises(self.main)
        namespace: dict = {}
        exec(compile(ex.stub_source(self.main.read_text(), found, {"scale"}), "s", "exec"), namespace)
        self.assertEqual(namespace["add"](1, 2), 3)
        with self.assertRaises(NotImplementedError):
            namespace["scale"]([1], 2)

    def test_malformed_markers_are_named(self):
        bad = self.tmp / "bad.py"
        bad.write_text("# exercise lost (1 point): Nothing below\n\nx = 1\n")
        with self.assertRaisesRegex(ex.ExerciseError, r"bad.py:1: .*directly above a def"):
            ex.find_exercises(bad)
        bad.write_text("# exercise ghost (continued)\ndef f():\n    pass\n")
        with self.assertRaisesRegex(ex.ExerciseError, "before exercise 'ghost' is declared"):
            ex.find_exercises(bad)
        bad.write_text("# exercise twice (1 point): A\ndef f():\n    pass\n\n\n"
                       "# exercise twice (1 point): B\ndef g():\n    pass\n")
        with self.assertRaisesRegex(ex.ExerciseError, "declared twice"):
            ex.find_exercises(bad)


class TestGrading(unittest.TestCase):
    """Grades the toy lesson in workspaces: reference, untouched stubs, a planted bug."""

    def grade(self, root: Path, main: str, first_failure: bool = False) -> dict:
        from course.__main__ import grade_lesson
        lesson = make_workspace(root, main)
        with unittest.mock.patch.object(ex, "lesson_exercises",
                                        lambda folder: ex.find_exercises(root / "lessons/99_toy/main.py")):
            report = grade_lesson(lesson, root, timeout=120, first_failure=first_failure)
        return report["criteria"]

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.tmp)
        # the toy lesson launches no ranks: its grading processes need no forkserver
        patcher = unittest.mock.patch.dict("os.environ", {NO_PREWARM: "1"})
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_reference_untouched_and_planted_bug(self):
        reference = self.grade(self.tmp / "reference", TOY_MAIN)
        self.assertEqual({k: v["outcome"] for k, v in reference.items()},
                         {"add": "passed", "scale": "passed", "integration": "blocked"})
        self.assertEqual(reference["integration"]["message"], "needs a GPU")
        self.assertEqual((reference["add"]["points"], reference["scale"]["points"]), (2, 3))

        stubbed_main = ex.stub_source(TOY_MAIN, ex.find_exercises(self._write(TOY_MAIN)))
        untouched = self.grade(self.tmp / "untouched", stubbed_main)
        self.assertEqual(untouched["add"]["outcome"], "failed")
        self.assertEqual(untouched["scale"]["outcome"], "failed")
        self.assertIn("NotImplementedError: exercise add", untouched["add"]["message"])

        buggy = TOY_MAIN.replace("v * factor for v", "v * factor + 1 for v")
        planted = self.grade(self.tmp / "planted", buggy)
        self.assertEqual(planted["scale"]["outcome"], "failed")
        self.assertEqual(planted["add"]["outcome"], "passed")

    def test_first_failure_gives_the_same_outcomes_sooner(self):
        stubbed_main = ex.stub_source(TOY_MAIN, ex.find_exercises(self._write(TOY_MAIN)))
        full = self.grade(self.tmp / "full", stubbed_main)
        fast = self.grade(self.tmp / "fast", stubbed_main, first_failure=True)
        self.assertEqual({k: v["outcome"] for k, v in fast.items()},
                         {k: v["outcome"] for k, v in full.items()})
        self.assertEqual(fast["add"]["message"], full["add"]["message"])
        self.assertEqual((full["add"]["not_run"], fast["add"]["not_run"]), (0, 2))
        self.assertTrue((self.tmp / "full" / "add_later_was_set_up").exists())
        self.assertFalse((self.tmp / "fast" / "add_later_was_set_up").exists())
        self.assertEqual(fast["scale"]["message"], full["scale"]["message"])
        self.assertIn("(factor=3)", fast["scale"]["message"])
        self.assertTrue((self.tmp / "full" / "scaled_by_4").exists(), "without it every subTest runs")
        self.assertFalse((self.tmp / "fast" / "scaled_by_4").exists(),
                         "the first failing subTest ends the test")
        reference = self.grade(self.tmp / "reference", TOY_MAIN, first_failure=True)
        self.assertEqual(reference["add"]["outcome"], "passed")
        self.assertEqual(reference["add"]["not_run"], 0)

    def test_a_class_that_fails_to_set_up_ends_its_criterion(self):
        from course.__main__ import grade_lesson
        stubbed = ex.stub_source(TOY_MAIN, ex.find_exercises(self._write(TOY_MAIN)))
        reports = {}
        for name, first_failure in (("full", False), ("fast", True)):
            root = self.tmp / name
            lesson = make_workspace(root, stubbed, FIXTURE_TEST)
            with unittest.mock.patch.object(ex, "lesson_exercises",
                                            lambda folder, main=root / "lessons/99_toy/main.py":
                                            ex.find_exercises(main)):
                report = grade_lesson(lesson, root, timeout=120, first_failure=first_failure)
            reports[name] = report["criteria"]
        self.assertEqual([reports[name]["scale"]["outcome"] for name in ("full", "fast")],
                         ["failed", "failed"])
        self.assertIn("NotImplementedError", reports["fast"]["scale"]["message"])
        self.assertTrue((self.tmp / "full" / "scale_later_was_set_up").exists(),
                        "without it every class runs")
        self.assertFalse((self.tmp / "fast" / "scale_later_was_set_up").exists(),
                         "a class whose setUpClass raised ends its criterion under --first-failure")

    def test_a_class_that_skips_in_its_set_up_is_blocked_not_failed(self):
        from course.__main__ import grade_lesson
        for first_failure in (False, True):
            root = self.tmp / f"skipped-{first_failure}"
            lesson = make_workspace(root, TOY_MAIN, SKIPPED_CLASS_TEST)
            with unittest.mock.patch.object(ex, "lesson_exercises",
                                            lambda folder, main=root / "lessons/99_toy/main.py":
                                            ex.find_exercises(main)):
                criteria = grade_lesson(lesson, root, timeout=120, first_failure=first_failure)["criteria"]
            with self.subTest(first_failure=first_failure):
                self.assertEqual({key: entry["outcome"] for key, entry in criteria.items()},
                                 {"scale": "blocked", "add": "passed"})
                self.assertEqual(criteria["scale"]["message"], "needs two GPUs")

    def test_planted_bugs_graded_in_one_process_and_restored(self):
        from course.__main__ import grade_planted_bugs
        root = self.tmp / "bugs"
        lesson = make_workspace(root)
        folder = root / "lessons" / "99_toy"
        bugs = [{"id": "plus-one", "exercise": "scale", "file": "main.py",
                 "find": "v * factor for v", "replace": "v * factor + 1 for v",
                 "mistake": "an off-by-one in the scaling"},
                {"id": "harmless", "exercise": "add", "file": "main.py",
                 "find": "return a + b", "replace": "return b + a",
                 "mistake": "not a bug at all (a + b == b + a): must come back as passed"}]
        (folder / "bugs.json").write_text(json.dumps(bugs))
        results = grade_planted_bugs(lesson, root, timeout=120)
        self.assertEqual([(r["id"], r["outcome"]) for r in results],
                         [("plus-one", "failed"), ("harmless", "passed")])
        self.assertEqual((folder / "main.py").read_text(), TOY_MAIN)  # restored

    def test_a_planted_file_never_runs_its_originals_bytecode(self):
        """A workspace may hold compiled bytecode, which Python trusts while the source's size
        and modification second match: a bug of the same size planted within that second must
        still run, and afterwards the original's text, time and bytecode are back."""
        import importlib.util
        import os
        import py_compile

        from lessons._grading import planted
        module = self.tmp / "planted" / "m.py"
        module.parent.mkdir()
        module.write_text("VALUE = 1\n")
        py_compile.compile(str(module))
        cache = Path(importlib.util.cache_from_source(str(module)))
        before = (module.stat().st_mtime_ns, cache.read_bytes())

        def value() -> str:
            return subprocess.run([sys.executable, "-c", "import m; print(m.VALUE)"], cwd=module.parent,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True,
                                  text=True, timeout=60).stdout.strip()

        with planted({module: "VALUE = 2\n"}):
            os.utime(module, ns=(before[0], before[0]))  # as if written within the same second
            self.assertEqual(value(), "2", "the original's bytecode ran for the planted text")
        self.assertEqual(module.read_text(), "VALUE = 1\n")
        self.assertEqual((module.stat().st_mtime_ns, cache.read_bytes()), before)
        self.assertEqual(value(), "1")

    def test_a_bugs_hint_runs_its_test_first_and_write_hints_records_it(self):
        from course.__main__ import grade_planted_bugs
        root = self.tmp / "hints"
        lesson = make_workspace(root)
        folder = root / "lessons" / "99_toy"
        only_one = {"id": "one-plus-one", "exercise": "add", "file": "main.py", "find": "return a + b",
                    "replace": "return a + b + (a == 1)", "mistake": "wrong only when a == 1"}
        harmless = {"id": "harmless", "exercise": "scale", "file": "main.py", "find": "return out",
                    "replace": "return list(out)", "mistake": "not a bug"}
        (folder / "bugs.json").write_text(json.dumps([only_one, harmless]))
        proc = subprocess.run([sys.executable, "-m", "lessons._grading", "lessons/99_toy/tests",
                               "--planted-bugs", "--write-hints", "lessons", "--json", "out.json"],
                              cwd=root, capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("no hint for harmless", proc.stderr)
        first = json.loads((root / "out.json").read_text())["lessons"]["lessons/99_toy/tests"]
        self.assertEqual([(r["outcome"], r["caught_by"], r["hint"]) for r in first],
                         [("failed", "test_toy.TestAddLater.test_add_again", ""), ("passed", "", "")])
        self.assertTrue((root / "add_was_set_up").exists(), "without a hint TestAdd runs first")
        written = json.loads((folder / "bugs.json").read_text())
        self.assertEqual([spec.get("caught_by") for spec in written],
                         ["test_toy.TestAddLater.test_add_again", None])
        (root / "add_was_set_up").unlink()
        hinted = grade_planted_bugs(lesson, root, timeout=120)
        self.assertEqual([(r["outcome"], r["caught_by"]) for r in hinted],
                         [("failed", "test_toy.TestAddLater.test_add_again"), ("passed", "")])
        self.assertFalse((root / "add_was_set_up").exists(), "the hinted test failed first: TestAdd not run")
        written[0]["caught_by"] = "test_toy.TestAdd.test_add"  # stale: passes under this bug
        (folder / "bugs.json").write_text(json.dumps(written))
        stale = grade_planted_bugs(lesson, root, timeout=120)
        self.assertEqual([(r["outcome"], r["caught_by"]) for r in stale],
                         [("failed", "test_toy.TestAddLater.test_add_again"), ("passed", "")])

    def _write(self, text: str) -> Path:
        path = self.tmp / "main_copy.py"
        path.write_text(text)
        return path


class TestGraderMessages(unittest.TestCase):
    """What a learner reads when a test fails: the whole assertion (its own message too), the
    place in the lesson's code that raised an error, never a word cut in half."""

    def failure(self, fn) -> str:
        from lessons._grading import _first_failure
        try:
            fn()
        except BaseException:
            return _first_failure(sys.exc_info())
        self.fail("expected a failure")

    def test_a_list_comparison_keeps_the_tests_own_message(self):
        case = unittest.TestCase()
        message = self.failure(lambda: case.assertEqual([1, 2, 3], [1, 2, 4], "kept slots, ep=2"))
        self.assertIn("[1, 2, 3] != [1, 2, 4]", message)
        self.assertTrue(message.endswith(": kept slots, ep=2"), message)
        self.assertNotIn("\n", message)

    def test_an_error_names_where_the_lessons_code_raised_it(self):
        folder = Path(tempfile.mkdtemp()) / "lessons" / "99_toy"
        self.addCleanup(shutil.rmtree, folder.parent.parent)
        folder.mkdir(parents=True)
        (folder / "zero3.py").write_text("def unpack(saved):\n    return {}[saved]\n")
        namespace: dict = {}
        exec(compile((folder / "zero3.py").read_text(), str(folder / "zero3.py"), "exec"), namespace)
        message = self.failure(lambda: namespace["unpack"](2))
        self.assertEqual(message, "KeyError: 2 (in unpack, lessons/99_toy/zero3.py:2)")

    def test_a_long_message_is_shortened_at_a_word(self):
        from lessons._grading import MESSAGE_CHARS
        words = " ".join(f"word{i}" for i in range(400))
        message = self.failure(lambda: unittest.TestCase().fail(words))
        self.assertLessEqual(len(message), MESSAGE_CHARS)
        self.assertTrue(message.endswith(" [...]"), message[-40:])
        self.assertRegex(message[:-len(" [...]")], r"word\d+$")  # a whole word before the cut

    def test_a_failed_shared_launch_is_not_retried(self):
        from lessons._testing import SharedLaunchFailed, launch_once
        calls = []

        @launch_once
        def hung_launch(world):
            calls.append(world)
            raise TimeoutError(f"rank 1 hung at world {world}")

        with self.assertRaisesRegex(TimeoutError, "rank 1 hung at world 3"):
            hung_launch(3)
        with self.assertRaisesRegex(SharedLaunchFailed, r"hung_launch\(3,\) failed earlier .*rank 1 hung"):
            hung_launch(3)
        self.assertEqual(calls, [3], "the failed launch was run again")

        @launch_once
        def good_launch():
            calls.append("good")
            return {"ok": True}

        self.assertIs(good_launch(), good_launch())
        self.assertEqual(calls, [3, "good"])

    def test_a_torchrun_failure_shows_the_ranks_own_error(self):
        from lessons._testing import rank_error
        traceback_text = ("Traceback (most recent call last):\n  File \"main.py\", line 3\n"
                          "ValueError: Number of tensor splits not equal to group size\n")
        torchrun_summary = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                            "main.py FAILED\n")
        self.assertEqual(rank_error([traceback_text + torchrun_summary]),
                         "ValueError: Number of tensor splits not equal to group size")
        ours = "error: rank 1 failed: ValueError: Number of tensor splits not equal to group size\n"
        self.assertEqual(rank_error(["all good\n", traceback_text + ours + torchrun_summary]),
                         "rank 1 failed: ValueError: Number of tensor splits not equal to group size")
        # a peer that only saw rank 1 go away prints its line first: rank 1's own error is named
        peer = ("error: rank 0 failed: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
                "[127.0.0.1]:20909: Connection reset by peer.\n")
        self.assertEqual(rank_error([peer + ours]),
                         "rank 1 failed: ValueError: Number of tensor splits not equal to group size")


class TestWorkspaceRecord(unittest.TestCase):
    def test_exercises_md_shows_the_last_grade(self):
        root = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, root)
        make_workspace(root)
        folder = root / "lessons" / "99_toy"
        exercises = ex.find_exercises(folder / "main.py")
        (root / "EXERCISES.md").write_text(ex.workspace_readme(folder, exercises, {"scale"}))
        (root / "EXERCISES.json").write_text(json.dumps({"only": ["scale"], "grades": {}}))
        with unittest.mock.patch.object(ex, "lesson_exercises", lambda _: exercises):
            ex.record_grade(root, folder, {"scale": {"outcome": "failed", "message":
                                                     "NotImplementedError: exercise scale"}})
            self.assertIn("| `scale` | Scale a list | 3 | `scale` | to write (the stub is still there) |",
                          (root / "EXERCISES.md").read_text())
            self.assertIn("| `add` | Add two numbers | 2 | `add`, `Accumulator.push` | given |",
                          (root / "EXERCISES.md").read_text())
            ex.record_grade(root, folder, {"scale": {"outcome": "passed", "message": ""},
                                           "integration": {"outcome": "passed", "message": ""}})
        text = (root / "EXERCISES.md").read_text()
        self.assertIn("| `scale` | Scale a list | 3 | `scale` | passed (3 points) |", text)
        self.assertIn("3 of 5 points", text)


class TestMutants(unittest.TestCase):
    """course/mutants.py on the toy lesson: mutmut's operators applied to the exercises' bodies
    only, each mutant graded like a planted bug, survivors reported unless explained."""

    def test_mutants_touch_only_the_exercises_and_are_graded(self):
        from course import mutants
        root = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, root)
        lesson = make_workspace(root)
        folder = root / "lessons" / "99_toy"
        specs = mutants.mutants_of(folder)
        described = [spec["mistake"] for spec in specs]
        self.assertIn("line 9: return a + b -> return a - b", described)
        self.assertTrue(all("untouched" not in spec["id"] and '"""' not in spec["mistake"] for spec in specs),
                        f"a mutant outside the exercises' bodies: {described}")
        self.assertEqual({spec["exercise"] for spec in specs}, {"add", "scale"})
        for spec in specs:  # each is a valid planted bug: its find occurs exactly once
            self.assertEqual((folder / spec["file"]).read_text().count(spec["find"]), 1, spec["id"])
        minus = next(spec for spec in specs if spec["mistake"].endswith("return a - b"))
        harmless = {**minus, "id": "add:harmless", "mistake": "a + b -> b + a",
                    "replace": minus["find"].replace("return a + b", "return b + a")}
        with unittest.mock.patch.dict("os.environ", {NO_PREWARM: "1"}):
            graded = mutants.run_mutants(lesson, [minus, harmless, harmless], 60, False, root=root)
        rows = mutants.classify([minus, harmless, {**harmless, "id": "add:explained"}], graded,
                                {"add:explained": "addition commutes"})
        self.assertEqual([row["outcome"] for row in rows], ["killed", "survived", "equivalent"])
        counts = mutants.summary(rows)
        self.assertEqual((counts["killed"], counts["survived"], counts["equivalent"]), (1, 1, 1))
        self.assertFalse(counts["explained"])
        self.assertEqual((folder / "main.py").read_text(), TOY_MAIN)  # the reference is untouched


class TestBugSpecs(unittest.TestCase):
    def test_stale_or_unknown_bug_specs_are_named(self):
        tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, tmp)
        make_workspace(tmp)
        folder = tmp / "lessons" / "99_toy"
        spec = {"id": "plus-one", "exercise": "scale", "file": "main.py",
                "find": "v * factor for v", "replace": "v * factor + 1 for v",
                "mistake": "an off-by-one in the scaling"}
        (folder / "bugs.json").write_text(json.dumps([spec]))
        self.assertEqual([bug.id for bug in ex.planted_bugs(folder)], ["plus-one"])
        (folder / "bugs.json").write_text(json.dumps([{**spec, "find": "not in the file"}]))
        with self.assertRaisesRegex(ex.ExerciseError, r"\[0\]\.find: found 0 times"):
            ex.planted_bugs(folder)
        (folder / "bugs.json").write_text(json.dumps([{**spec, "exercise": "nope"}]))
        with self.assertRaisesRegex(ex.ExerciseError, r"\[0\]\.exercise: 'nope'"):
            ex.planted_bugs(folder)
        (folder / "bugs.json").write_text(textwrap.dedent("[{oops"))
        with self.assertRaisesRegex(ex.ExerciseError, "invalid JSON"):
            ex.planted_bugs(folder)


if __name__ == "__main__":
    unittest.main()
