"""Docs equal code: every function-like code span in a lesson README names something that
exists in that lesson's code (main.py first, then its harness modules such as checks.py), and
every README has the contract's sections in order."""

from __future__ import annotations

import re
import unittest

from course import lines
from tests._course import REPO_ROOT, lesson_modules, lessons, lookup

SECTIONS = ["The problem", "The idea", "The math", "Build it", "Verify it", "Run it",
            "In the real world", "Exercises", "Key terms", "Further reading"]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
CALL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\(")


def function_spans(markdown: str) -> list[str]:
    """Dotted names of inline code spans that look like calls: `ring_all_reduce(x)`."""
    prose = FENCE.sub("", markdown)
    return [m.group(1) for span in INLINE.findall(prose) if (m := CALL.match(span.strip()))]


def resolve(modules: list, dotted: str) -> bool:
    """True when `dotted` resolves to a callable in one of the lesson's modules (their own
    names, and the modules they import, such as dist.all_reduce)."""
    return callable(lookup(modules, dotted))


class TestMainIsTheTechnique(unittest.TestCase):
    """COURSE.md: a lesson's main.py is at most about 350 lines, at least two thirds technique
    (course/lines.py counts: the story docstring and the definitions that live in the lesson's
    technique files, with their exercise markers)."""

    def test_every_main_py_reads_in_one_sitting(self):
        for row in lines.measure(None):
            with self.subTest(lesson=row["lesson"]):
                self.assertLessEqual(row["lines"], 360)
                self.assertGreaterEqual(row["technique"] / row["lines"], 2 / 3)

    def test_the_count_follows_the_rule(self):
        source = ('"""The story."""\n\nimport torch\n\n\n# exercise ring (3 points)\n'
                  'def ring(x):\n    return x\n\n\ndef check_ring():\n    assert ring(1) == 1\n\n\n'
                  'LIMIT = 3\n\nif __name__ == "__main__":\n    check_ring()\n')
        # docstring 1 + marker and ring 3 + LIMIT 1; not the import, blanks, check_ring, __main__
        self.assertEqual(lines.technique_lines(source, {"ring", "LIMIT"}), 5)
        self.assertEqual(lines.technique_lines(source, set()), 1)
        self.assertEqual(lines.top_level_names(source), {"ring", "check_ring", "LIMIT"})


class TestDocsEqualCode(unittest.TestCase):
    def test_function_like_code_spans_exist_in_main(self):
        for lesson in lessons():
            modules = lesson_modules(lesson)
            names = function_spans((REPO_ROOT / lesson["paths"]["docs"]).read_text())
            self.assertGreater(len(names), 5, f"{lesson['folder']} README names few functions")
            missing = sorted({name for name in names if not resolve(modules, name)})
            self.assertEqual(missing, [], f"{lesson['paths']['docs']} names functions that "
                                          f"its code does not have")

    def test_the_checker_catches_an_invented_name(self):
        modules = lesson_modules(lessons()[0])
        names = function_spans("Call `bucketed_all_reduce(grads)` and `dist.all_reduce(x)`.\n"
                               "```python\nignored_in_fences()\n```")
        self.assertEqual(names, ["bucketed_all_reduce", "dist.all_reduce"])
        self.assertFalse(resolve(modules, "bucketed_all_reduce"))
        self.assertTrue(resolve(modules, "dist.all_reduce"))

    def test_sections_in_order_and_a_diagram(self):
        for lesson in lessons():
            text = (REPO_ROOT / lesson["paths"]["docs"]).read_text()
            headings = re.findall(r"^## +(.+?)\s*$", text, re.M)
            self.assertEqual([h for h in headings if h in SECTIONS], SECTIONS, lesson["folder"])
            self.assertIn("```mermaid", text, lesson["folder"])


if __name__ == "__main__":
    unittest.main()
