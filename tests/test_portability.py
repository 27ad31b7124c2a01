"""The numbers a lesson's docs and quiz quote do not depend on the CPU's vector kernels.

Each lesson keeps the tests that compare its README's and quiz's numbers with what its code
produces in a class named `TestDocNumbers`. Here they run again in a fresh process with
`ATEN_CPU_CAPABILITY=default`, PyTorch's plain (non-vectorised) CPU kernels: another x86-64 or
an arm64 CPU sums in other orders, and a quoted number must survive that (exactly, or within
the tolerance its test states). Numbers measured on the meta device (shapes and bytes, no CPU
kernel runs: lesson 07's TestDocNumbersOnMeta) are not rerun.
"""

from __future__ import annotations

import os
import subprocess
import sys
import unittest

from tests._course import REPO_ROOT, lessons


def doc_number_test_ids() -> list[str]:
    """unittest ids of every TestDocNumbers class in the lessons' suites."""
    loader = unittest.TestLoader()
    ids = []
    for lesson in lessons():
        suite = loader.discover(str(REPO_ROOT / lesson["paths"]["tests"]), top_level_dir=str(REPO_ROOT))
        stack = [suite]
        while stack:
            item = stack.pop()
            if isinstance(item, unittest.TestSuite):
                stack.extend(item)
            elif type(item).__name__ == "TestDocNumbers":
                ids.append(item.id())
    return sorted(ids)


class TestDocNumbersOnPlainKernels(unittest.TestCase):
    def test_every_lesson_has_doc_number_tests(self):
        ids = doc_number_test_ids()
        for lesson in lessons():
            prefix = lesson["paths"]["tests"].replace("/", ".") + "."
            with self.subTest(lesson=lesson["id"]):
                self.assertTrue(any(test_id.startswith(prefix) for test_id in ids),
                                f"{lesson['folder']} has no TestDocNumbers tests")

    def test_doc_numbers_hold_with_aten_cpu_capability_default(self):
        ids = doc_number_test_ids()
        self.assertTrue(ids)
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "COURSE_START_METHOD": "forkserver"}
        proc = subprocess.run([sys.executable, "-m", "unittest", *ids], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertRegex(proc.stderr, rf"Ran {len(ids)} tests?")


if __name__ == "__main__":
    unittest.main()
