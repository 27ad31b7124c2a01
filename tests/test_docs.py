"""Docs equal code: every function-like code span in a lesson README names something that
exists in that lesson's main.py, and every README has the contract's sections in order."""

from __future__ import annotations

import re
import unittest

from tests._course import REPO_ROOT, lesson_module, lessons

SECTIONS = ["The problem", "The idea", "The math", "Build it", "Verify it", "Run it",
            "In the real world", "Exercises", "Key terms", "Further reading"]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
CALL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\(")


def function_spans(markdown: str) -> list[str]:
    """Dotted names of inline code spans that look like calls: `ring_all_reduce(x)`."""
    prose = FENCE.sub("", markdown)
    return [m.group(1) for span in INLINE.findall(prose) if (m := CALL.match(span.strip()))]


def resolve(module, dotted: str) -> bool:
    """True when `dotted` resolves in the module's namespace (main.py's own names, and the
    modules it imports, such as dist.all_reduce)."""
    target = module
    for part in dotted.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return callable(target)


class TestDocsEqualCode(unittest.TestCase):
    def test_function_like_code_spans_exist_in_main(self):
        for lesson in lessons():
            module = lesson_module(lesson)
            names = function_spans((REPO_ROOT / lesson["paths"]["docs"]).read_text())
            self.assertGreater(len(names), 5, f"{lesson['folder']} README names few functions")
            missing = sorted({name for name in names if not resolve(module, name)})
            self.assertEqual(missing, [], f"{lesson['paths']['docs']} names functions that "
                                          f"main.py does not have")

    def test_the_checker_catches_an_invented_name(self):
        module = lesson_module(lessons()[0])
        names = function_spans("Call `bucketed_all_reduce(grads)` and `dist.all_reduce(x)`.\n"
                               "```python\nignored_in_fences()\n```")
        self.assertEqual(names, ["bucketed_all_reduce", "dist.all_reduce"])
        self.assertFalse(resolve(module, "bucketed_all_reduce"))
        self.assertTrue(resolve(module, "dist.all_reduce"))

    def test_sections_in_order_and_a_diagram(self):
        for lesson in lessons():
            text = (REPO_ROOT / lesson["paths"]["docs"]).read_text()
            headings = re.findall(r"^## +(.+?)\s*$", text, re.M)
            self.assertEqual([h for h in headings if h in SECTIONS], SECTIONS, lesson["folder"])
            self.assertIn("```mermaid", text, lesson["folder"])


if __name__ == "__main__":
    unittest.main()
