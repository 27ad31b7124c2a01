"""Every lesson test marked `@torchrun_demo` (lessons._testing), in one torchrun job: two
processes on one node run each lesson's demo in turn (lessons/_torchrun_demos.py) and each test's
own check reads its lesson's report. A torchrun job of its own per lesson costs its agent and two
interpreters importing torch and torch._dynamo: measured on this course's 2-core machine, the
ten demos took 116 CPU seconds as ten jobs and 29 as one. conftest.py leaves the lessons' own
copies of these tests out of a run that collects this one (run alone, a lesson's suite or the
grader runs its test with a torchrun job of its own)."""

from __future__ import annotations

import importlib
import unittest

from lessons._testing import lesson_script, run_demos_under_torchrun
from tests._course import REPO_ROOT, lessons


def torchrun_demo_tests() -> list[tuple[str, object]]:
    """(lesson test id, test function) of every lesson test marked @torchrun_demo, in
    lesson order."""
    found = []
    for lesson in lessons():
        tests_dir = REPO_ROOT / lesson["paths"]["tests"]
        for path in sorted(tests_dir.glob("test_*.py")):
            module = importlib.import_module(".".join(path.relative_to(REPO_ROOT).with_suffix("").parts))
            for cls in vars(module).values():
                if isinstance(cls, type) and issubclass(cls, unittest.TestCase) \
                        and cls.__module__ == module.__name__:
                    for name, fn in vars(cls).items():
                        if hasattr(fn, "torchrun_check"):
                            found.append((f"{module.__name__}.{cls.__name__}.{name}", fn))
    return found


class TestDemosUnderTorchrun(unittest.TestCase):
    def test_every_marked_demo_passes_its_lessons_check_in_one_job(self):
        tests = torchrun_demo_tests()
        self.assertGreaterEqual(len(tests), 10, [test_id for test_id, _ in tests])
        demos = [(lesson_script(fn.torchrun_check), fn.torchrun_args) for _, fn in tests]
        self.assertEqual(len({script for script, _ in demos}), len(demos), "one demo per lesson")
        reports, stopped, problem = run_demos_under_torchrun(demos)
        for number, ((test_id, fn), (script, args)) in enumerate(zip(tests, demos)):
            with self.subTest(test=test_id):
                demo = f"{script.relative_to(REPO_ROOT)} {' '.join(args)}"
                if script in reports:  # a report, passed or not: the lesson's own check reads it
                    fn.torchrun_check(self, reports[script])
                elif stopped is None:
                    self.fail(f"{demo}: the job passed but this demo wrote no --json report")
                elif number == stopped:
                    self.fail(f"{demo}: failed under torchrun: {problem}")
                else:
                    where = demos[stopped][0].relative_to(REPO_ROOT)
                    self.fail(f"{demo}: not run: the job stopped at {where}")


if __name__ == "__main__":
    unittest.main()
