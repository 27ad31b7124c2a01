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


def exercise_rows(markdown: str) -> dict[str, str]:
    """{exercise id: its row} of the table under "## Exercises" (rows start with "| `id` |")."""
    section = markdown.split("\n## Exercises", 1)[-1].split("\n## ", 1)[0]
    return {match.group(1): line for line in section.splitlines()
            if (match := re.match(r"^\|\s*`([a-z0-9-]+)`\s*\|", line))}


def written_calls(row: str) -> set[str]:
    """The functions a table row says the learner writes: its code spans written as calls."""
    return {m.group(1) for span in INLINE.findall(row) if (m := CALL.match(span.strip()))}


class TestExerciseTables(unittest.TestCase):
    """Each README's exercise table lists exactly what `course exercise` stubs: a row per
    exercise, naming every stubbed function, method or class (`name(...)`, `Class.name(...)`,
    `Class`), and no other function as a call (what a learner is told to write is what they
    get; other names may appear, not written as calls)."""

    def test_tables_list_exactly_the_stubs(self):
        from lessons._exercises import lesson_exercises
        for lesson in lessons():
            folder = REPO_ROOT / lesson["folder"]
            exercises = {e.id: e for e in lesson_exercises(folder)}
            rows = exercise_rows((REPO_ROOT / lesson["paths"]["docs"]).read_text())
            with self.subTest(lesson=lesson["folder"]):
                self.assertEqual(sorted(rows), sorted(exercises), "exercise rows against the markers")
                for exercise_id, row in rows.items():
                    stubs = exercises[exercise_id].targets
                    named = written_calls(row)
                    spans = {span.strip().split("(")[0] for span in INLINE.findall(row)}
                    accepted = {t for t in stubs} | {t.split(".")[-1] for t in stubs}
                    missing = [t for t in stubs if t not in spans and t.split(".")[-1] not in spans]
                    extra = sorted(named - accepted)
                    self.assertEqual((missing, extra), ([], []),
                                     f"`{exercise_id}`: (stubbed but not listed, listed but not stubbed)")


class TestGraderMessagesInSuites(unittest.TestCase):
    """A failing test tells the learner what was expected: no `assertTrue(x)` / `assertFalse(x)`
    without a message in a lesson's tests (unittest would say only "False is not true"), and no
    bare `assert` in the code the tests run on ranks (workers)."""

    def test_no_bare_truth_assertions(self):
        import ast
        found = []
        for path in sorted((REPO_ROOT / "lessons").glob("*/tests/*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                bare_call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                             and node.func.attr in ("assertTrue", "assertFalse") and len(node.args) < 2
                             and not any(k.arg == "msg" for k in node.keywords))
                if bare_call or (isinstance(node, ast.Assert) and node.msg is None):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
        self.assertEqual(found, [], "assertions that would fail with no message")


if __name__ == "__main__":
    unittest.main()
