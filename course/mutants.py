"""Mutation testing of the exercises: how many wrong versions of a learner's code do the
lesson's own tests catch? `python -m course mutants NN [--exercise ID] [--json PATH]`.

The planted bugs (bugs.json) are mistakes the course's authors thought of; a mutation tool
writes mistakes nobody chose. mutmut's operators (mutmut 3: `create_mutations`, the same
operators `mutmut run` uses: numbers +1, comparison and arithmetic operators swapped, `and`/`or`,
`True`/`False`, arguments dropped, assignments and return values replaced, ...) are applied, one
at a time, to the bodies of the functions each exercise marks (docstrings and code outside the
exercises are left alone). Each mutant is graded exactly as a learner's workspace is:
`course grade NN --exercise ID --first-failure`, i.e. that exercise's tests up to their first
failure, in a reference copy of the lessons (lessons/_grading.py --planted-bugs --bugs, one
process for all the mutants, every file restored after each).

A mutant is *killed* when its exercise fails (a hang past --mutant-timeout counts as killed),
*survived* when every test of the exercise passes. A survivor is a gap in the tests unless it
is *equivalent* (no test could tell it apart, because it computes the same thing, or changes
only what the specification leaves free). `lessons/NN_slug/equivalent_mutants.json` records
each equivalent survivor with the reason, by id ({"<id>": "why it cannot be told apart"}); a
mutant that only changes the text of an exception's message is classified as such
automatically. The exit code is 1 when a survivor is neither. Not run by CI: a lesson takes
minutes (each mutant is a grading run).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course import REPO_ROOT, load_catalog, select_lessons

EQUIVALENTS = "equivalent_mutants.json"
MESSAGE_ONLY = "changes only the text of an exception's message (the specification fixes its type)"


@dataclasses.dataclass
class Target:
    exercise: str
    qualname: str
    first: int  # first line of the definition (decorators included), 1-based
    last: int  # last line of the definition
    body: set[int]  # the lines mutants may touch: the body after the docstring


def targets_of(folder: Path, wanted: set[str] | None = None) -> dict[str, list[Target]]:
    """Per technique file: the functions each exercise marks, with their line spans."""
    from lessons._exercises import lesson_exercises

    found: dict[str, list[Target]] = {}
    for exercise in lesson_exercises(folder):
        if wanted and exercise.id not in wanted:
            continue
        tree = ast.parse((folder / exercise.file).read_text())
        nodes = _definitions(tree)
        for qualname in exercise.targets:
            node = nodes[qualname]
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                                     ast.Constant) \
                    and isinstance(body[0].value.value, str):
                body = body[1:]  # the docstring is the specification, not code
            lines = {line for stmt in body for line in range(stmt.lineno, stmt.end_lineno + 1)}
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.setdefault(exercise.file, []).append(
                Target(exercise.id, qualname, first, node.end_lineno, lines))
    return found


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    found: dict[str, ast.AST] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[prefix + child.name] = child
                visit(child, prefix + child.name + ".")
    visit(tree, "")
    return found


def _raise_nodes(module) -> set[int]:
    """ids of every libcst node inside a `raise` statement (its message included)."""
    import libcst as cst

    inside: set[int] = set()

    class Collect(cst.CSTVisitor):
        def visit_Raise(self, node) -> None:
            stack = [node]
            while stack:
                item = stack.pop()
                inside.add(id(item))
                stack.extend(item.children)
    module.visit(Collect())
    return inside


def mutants_of(folder: Path, wanted: set[str] | None = None) -> list[dict]:
    """Every mutant of the exercises' function bodies, as planted-bug specs (find: the whole
    original function, replace: the mutated one) with an id stable while the function is
    unchanged (qualname + a hash of the mutated function) and a one-line description."""
    from mutmut.mutation.file_mutation import create_mutations, deep_replace

    specs = []
    for file, targets in targets_of(folder, wanted).items():
        path = folder / file
        code = path.read_text()
        original = code.splitlines(keepends=True)
        covered = set().union(*(target.body for target in targets))
        module, mutations, _, _ = create_mutations(str(path), code, covered_lines=covered)
        in_raise = _raise_nodes(module)
        for mutation in mutations:
            mutated = deep_replace(module, mutation.original_node, mutation.mutated_node).code.splitlines(
                keepends=True)
            start = 0
            while start < min(len(original), len(mutated)) and original[start] == mutated[start]:
                start += 1
            if start == len(original) == len(mutated):
                continue  # renders the same (a no-op mutation)
            end = 0
            while end < min(len(original), len(mutated)) - start and original[-1 - end] == mutated[-1 - end]:
                end += 1
            target = next((t for t in targets if t.first - 1 <= start and len(original) - end <= t.last),
                          None)
            if target is None:
                continue
            grow = len(mutated) - len(original)
            find = "".join(original[target.first - 1:target.last])
            replace = "".join(mutated[target.first - 1:target.last + grow])
            before = " / ".join(line.strip() for line in original[start:len(original) - end])
            after = " / ".join(line.strip() for line in mutated[start:len(mutated) - end])
            digest = hashlib.sha1(replace.encode()).hexdigest()[:10]
            specs.append({"id": f"{target.qualname}:{digest}", "exercise": target.exercise, "file": file,
                          "find": find, "replace": replace, "line": start + 1,
                          "mistake": f"line {start + 1}: {before} -> {after}",
                          "message_only": id(mutation.original_node) in in_raise})
    return specs


def run_mutants(lesson: dict, specs: list[dict], timeout_s: float, progress: bool,
                root: Path = REPO_ROOT) -> list[dict]:
    """Grade every mutant in a reference copy of `root`'s lessons (one process for all)."""
    with tempfile.TemporaryDirectory(prefix="dtfs-mutants-") as tmp:
        workspace = Path(tmp)
        shutil.copytree(root / "lessons", workspace / "lessons",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        bugs = workspace / "mutants.json"
        bugs.write_text(json.dumps(specs))
        out = workspace / "graded.json"
        command = [sys.executable, "-m", "lessons._grading", lesson["paths"]["tests"], "--planted-bugs",
                   "--bugs", str(bugs), "--bug-timeout", str(timeout_s), "--json", str(out)]
        if progress:
            command.append("--progress")
        done = subprocess.run(command, cwd=workspace, stdout=subprocess.PIPE, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"mutant grading failed (exit {done.returncode}): {done.stdout[-1500:]}")
        return json.loads(out.read_text())["lessons"][lesson["paths"]["tests"]]


def classify(specs: list[dict], graded: list[dict], equivalents: dict[str, str]) -> list[dict]:
    rows = []
    for spec, result in zip(specs, graded):
        outcome = {"failed": "killed", "timeout": "killed (timeout)", "passed": "survived",
                   "blocked": "survived (blocked)"}.get(result["outcome"], result["outcome"])
        reason = ""
        if outcome.startswith("survived"):
            reason = equivalents.get(spec["id"]) or (MESSAGE_ONLY if spec["message_only"] else "")
            if reason:
                outcome = "equivalent"
        rows.append({"id": spec["id"], "exercise": spec["exercise"], "file": spec["file"],
                     "mutant": spec["mistake"], "outcome": outcome, "reason": reason,
                     "caught_by": result["message"] if outcome.startswith("killed") else "",
                     "seconds": result["seconds"]})
    return rows


def summary(rows: list[dict]) -> dict:
    counts = {"mutants": len(rows), "killed": 0, "equivalent": 0, "survived": 0}
    for row in rows:
        counts["killed" if row["outcome"].startswith("killed") else
               "equivalent" if row["outcome"] == "equivalent" else "survived"] += 1
    explained = counts["killed"] + counts["equivalent"]
    counts["score"] = round(counts["killed"] / max(counts["mutants"] - counts["equivalent"], 1), 4)
    counts["explained"] = explained == counts["mutants"]
    counts["seconds"] = round(sum(row["seconds"] for row in rows), 1)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ids", nargs="+", help="lesson ids (03), slugs or folders")
    parser.add_argument("--exercise", action="append", metavar="ID", help="only this exercise (repeatable)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every mutant's outcome")
    parser.add_argument("--mutant-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="a mutant whose grading takes longer is stopped and counts as killed")
    parser.add_argument("--list", action="store_true", help="list the mutants, grade nothing")
    parser.add_argument("--limit", type=int, metavar="N", help="only the first N mutants (a sample)")
    parser.add_argument("--quiet", action="store_true", help="no line per mutant while grading")
    args = parser.parse_args(argv)
    report = {}
    unexplained = False
    for lesson in select_lessons(load_catalog(), args.ids):
        folder = REPO_ROOT / lesson["folder"]
        specs = mutants_of(folder, set(args.exercise) if args.exercise else None)[:args.limit]
        if args.list:
            for spec in specs:
                print(f"{spec['id']:<48} {spec['exercise']:<20} {spec['mistake']}")
            print(f"{folder.name}: {len(specs)} mutants")
            continue
        equivalents_path = folder / EQUIVALENTS
        equivalents = json.loads(equivalents_path.read_text()) if equivalents_path.exists() else {}
        started = time.monotonic()
        rows = classify(specs, run_mutants(lesson, specs, args.mutant_timeout, not args.quiet),
                        equivalents)
        counts = summary(rows)
        counts["wall_seconds"] = round(time.monotonic() - started, 1)
        stale = sorted(set(equivalents) - {row["id"] for row in rows})
        report[lesson["id"]] = {"summary": counts, "mutants": rows, "stale_equivalents": stale}
        for row in rows:
            if row["outcome"] == "survived" or row["outcome"].startswith("survived"):
                print(f"SURVIVED {row['id']} ({row['exercise']}): {row['mutant']}")
        print(f"{folder.name}: {counts['mutants']} mutants, {counts['killed']} killed, "
              f"{counts['equivalent']} equivalent, {counts['survived']} survived "
              f"(score {counts['score']:.1%}) in {counts['wall_seconds']:.0f} s"
              + (f"; {len(stale)} entries of {EQUIVALENTS} match no mutant now" if stale else ""))
        unexplained |= counts["survived"] > 0
    if args.json and report:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
