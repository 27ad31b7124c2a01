"""Lines of each lesson's `main.py`, and the share of them that is technique.

    python -m course.lines                 # the working tree
    python -m course.lines --before REV    # beside the same files at git revision REV

A line is technique when it belongs to the module's story docstring or to a top-level function,
class or constant defined in one of the lesson's technique files now (main.py and the technique
modules beside it: every .py file of the folder but the harness ones in HARNESS), with its
decorators and the comment lines right above it (exercise markers, hints). Everything else is
not: imports, section banners, blank lines between definitions, the `__main__` hand-off, and,
at an older revision, the checks, benchmarks and CLI that lived in main.py then. The rule is
the same for both columns, so the before/after comparison is fair; it is a measure, not a
judgement of any line.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from course import REPO_ROOT, load_catalog

HARNESS = {"__init__.py", "checks.py", "bench.py", "figures.py", "trainer.py", "torch_engines.py"}


def technique_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.py")
                  if p.name not in HARNESS and not p.name.endswith("_checks.py"))


def defined_names(node: ast.stmt) -> set[str]:
    """What a top-level statement defines: a function's or class's name, an assignment's names."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {t.id for t in targets if isinstance(t, ast.Name)}
    return set()


def top_level_names(source: str) -> set[str]:
    return set().union(*(defined_names(node) for node in ast.parse(source).body))


def technique_lines(source: str, names: set[str]) -> int:
    """How many lines of `source` are technique (module docstring + definitions in `names`)."""
    lines = source.splitlines()
    counted: set[int] = set()
    tree = ast.parse(source)
    for index, node in enumerate(tree.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            counted.update(range(node.lineno, node.end_lineno + 1))
            continue
        if not defined_names(node) & names:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        while first > 1 and lines[first - 2].lstrip().startswith("#") \
                and not lines[first - 2].lstrip().startswith("# ===="):
            first -= 1  # the comments right above: exercise markers and hints
        counted.update(range(first, node.end_lineno + 1))
    return len(counted)


def at_revision(rev: str, path: str) -> str | None:
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO_ROOT, capture_output=True,
                          text=True)
    return proc.stdout if proc.returncode == 0 else None


def measure(before: str | None) -> list[dict]:
    rows = []
    listing = [] if not before else subprocess.run(  # the lesson folders at `before`
        ["git", "ls-tree", "--name-only", f"{before}:lessons"], cwd=REPO_ROOT, capture_output=True,
        text=True).stdout.split()
    for lesson in load_catalog()["lessons"]:
        folder = REPO_ROOT / lesson["folder"]
        names = set().union(*(top_level_names(p.read_text()) for p in technique_files(folder)))
        source = (folder / "main.py").read_text()
        row = {"lesson": lesson["folder"].split("/")[-1], "lines": len(source.splitlines()),
               "technique": technique_lines(source, names)}
        if before:  # the same slug may have had another number then (11_capstone -> 13_capstone)
            old_folder = next((name for name in listing if name.split("_", 1)[-1] == lesson["slug"]),
                              None)
            old = at_revision(before, f"lessons/{old_folder}/main.py") if old_folder else None
            if old is not None:
                row.update(before_lines=len(old.splitlines()),
                           before_technique=technique_lines(old, names))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.lines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", metavar="REV", help="compare with main.py at this git revision")
    args = parser.parse_args(argv)
    if args.before and subprocess.run(["git", "rev-parse", "--verify", "-q", args.before],
                                      cwd=REPO_ROOT, capture_output=True).returncode:
        parser.error(f"--before {args.before}: not a git revision here")
    rows = measure(args.before)
    header = "| lesson | main.py lines | technique share |"
    if args.before:
        header = (f"| lesson | lines at {args.before} | technique share then | lines now | "
                  "technique share now |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for row in rows:
        now = f"{row['lines']} | {100 * row['technique'] / row['lines']:.0f}%"
        if args.before:
            then = (f"{row['before_lines']} | {100 * row['before_technique'] / row['before_lines']:.0f}%"
                    if "before_lines" in row else "- | -")
            print(f"| {row['lesson']} | {then} | {now} |")
        else:
            print(f"| {row['lesson']} | {now} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
