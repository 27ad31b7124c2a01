"""Learner mode: the pieces of a lesson a learner writes, found by comment markers.

A lesson's technique files (`main.py`, and any other module of the lesson folder that marks
exercises, such as the capstone's `nd.py`) mark each exercise with comments directly above the
function or method a learner writes; the reference code below the marker is untouched:

    # exercise ring-reduce-scatter (3 points): Ring reduce-scatter
    # hint: at step s, rank r sends chunk (r - s - 1) mod p to the right and adds the
    #   chunk (r - s - 2) mod p that arrives from the left.
    def ring_reduce_scatter(tensor, traffic=None):
        \"\"\"The docstring stays in the workspace: it is the specification.\"\"\"
        ...

An exercise may span several functions: later ones carry `# exercise ring-reduce-scatter
(continued)`. `stub_source` replaces the body of every marked definition (everything after
its docstring) with `raise NotImplementedError(...)` naming the exercise; `write_workspace`
copies the lesson (and the earlier lessons and shared modules it imports) with those stubs.
Exercise ids are unique across a lesson's files.

Tests say which exercise they grade with the `exercise("id")` decorator of lessons/_testing.py
(on a test method or a TestCase class); an untagged test belongs to the lesson's
"integration" criterion (the demo, the CLI, the docs' numbers: everything together).
Planted bugs (`bugs.json` beside main.py) are the mistakes learners make, each a find/replace
in the reference solution with the exercise that must catch it and, as `caught_by`, the test of
that exercise that catches it (the grader runs it first).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
import time
from pathlib import Path

LESSONS_ROOT = Path(__file__).resolve().parent
REPO_ROOT = LESSONS_ROOT.parent
INTEGRATION = "integration"
_MARKER = re.compile(r"^\s*# exercise (?P<id>[a-z0-9][a-z0-9-]*) "
                     r"(?:\((?P<points>\d+) points?\): (?P<title>.+?)|\(continued\))\s*$")
_HINT = re.compile(r"^\s*# hint: (?P<text>.+?)\s*$")
_MORE = re.compile(r"^\s*#   (?P<text>.+?)\s*$")


class ExerciseError(ValueError):
    """A malformed marker or bug spec; the message names the file, the line and the problem."""


@dataclasses.dataclass
class Exercise:
    id: str
    title: str
    points: int
    hint: str
    targets: list[str]  # qualified names of the marked definitions, e.g. "BucketedDDP.no_sync"
    lines: list[int]  # first line (1-based) of each marked definition
    file: str = "main.py"  # the technique file that marks it, relative to the lesson folder


def _definitions(tree: ast.Module) -> dict[int, tuple[str, ast.AST]]:
    """Every function/class definition by the line of its `def`/`class` (decorators above it
    count as part of the definition: the marker goes above the decorators)."""
    found: dict[int, tuple[str, ast.AST]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found[first] = (name, child)
                visit(child, name + ".")
    visit(tree, "")
    return found


def find_exercises(path: Path) -> list[Exercise]:
    """The exercises marked in a technique file, in file order."""
    text = path.read_text()
    lines = text.splitlines()
    definitions = _definitions(ast.parse(text, filename=str(path)))
    exercises: dict[str, Exercise] = {}
    index = 0
    while index < len(lines):
        match = _MARKER.match(lines[index])
        if not match:
            index += 1
            continue
        marker_line = index + 1
        hint: list[str] = []
        index += 1
        while index < len(lines) and (_HINT.match(lines[index]) or (hint and _MORE.match(lines[index]))):
            hint.append((_HINT.match(lines[index]) or _MORE.match(lines[index])).group("text"))
            index += 1
        if index + 1 not in definitions:
            raise ExerciseError(f"{path}:{marker_line}: an exercise marker must stand directly "
                                f"above a def or class (and its hint lines)")
        name, _ = definitions[index + 1]
        exercise_id = match.group("id")
        if match.group("points") is not None:
            if exercise_id in exercises:
                raise ExerciseError(f"{path}:{marker_line}: exercise {exercise_id!r} is declared "
                                    f"twice (use '(continued)' on later definitions)")
            exercises[exercise_id] = Exercise(exercise_id, match.group("title"),
                                              int(match.group("points")), " ".join(hint), [], [],
                                              path.name)
        elif exercise_id not in exercises:
            raise ExerciseError(f"{path}:{marker_line}: '(continued)' before exercise "
                                f"{exercise_id!r} is declared")
        elif hint:
            exercises[exercise_id].hint += " " + " ".join(hint)
        exercises[exercise_id].targets.append(name)
        exercises[exercise_id].lines.append(index + 1)
    return list(exercises.values())


def stub_source(source: str, exercises: list[Exercise], only: set[str] | None = None) -> str:
    """`source` with the body of every marked definition (of the exercises in `only`, or all)
    replaced by `raise NotImplementedError(...)`; docstrings, signatures and decorators stay.
    A marked class keeps its docstring and loses every method body."""
    tree = ast.parse(source)
    definitions = _definitions(tree)
    lines = source.splitlines(keepends=True)
    cuts = []  # (first body line to drop, last line, indent, message)
    for exercise in exercises:
        if only is not None and exercise.id not in only:
            continue
        message = (f"exercise {exercise.id}: {exercise.title} - write it (the docstring is the "
                   f"spec; hint: {exercise.hint})" if exercise.hint else
                   f"exercise {exercise.id}: {exercise.title} - write it (the docstring is the spec)")
        for line in exercise.lines:
            _, node = definitions[line]
            functions = [node] if not isinstance(node, ast.ClassDef) else [
                child for child in node.body
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for function in functions:
                body = function.body
                start = body[1] if (len(body) > 1 and isinstance(body[0], ast.Expr) and
                                    isinstance(getattr(body[0], "value", None), ast.Constant) and
                                    isinstance(body[0].value.value, str)) else body[0]
                if start is body[0] and isinstance(body[0], ast.Expr) and \
                        isinstance(getattr(body[0], "value", None), ast.Constant) and len(body) == 1:
                    continue  # a docstring-only function has nothing to stub
                indent = " " * start.col_offset
                cuts.append((start.lineno, function.end_lineno, indent, message))
    for first, last, indent, message in sorted(cuts, reverse=True):
        lines[first - 1:last] = [f"{indent}raise NotImplementedError({message!r})\n"]
    return "".join(lines)


def lesson_dir(key: str) -> Path:
    """A lesson folder by id ("01"), folder name or slug."""
    for folder in sorted(LESSONS_ROOT.glob("[0-9][0-9]_*")):
        if key in (folder.name, folder.name[:2], folder.name[3:]):
            return folder
    raise ExerciseError(f"unknown lesson {key!r}")


def technique_files(folder: Path) -> list[Path]:
    """main.py first, then the folder's other modules in name order (those that mark nothing
    simply add no exercise)."""
    main = folder / "main.py"
    return ([main] if main.exists() else []) + sorted(
        path for path in folder.glob("*.py") if path.name not in ("main.py", "__init__.py"))


def lesson_exercises(folder: Path) -> list[Exercise]:
    """Every exercise the lesson's technique files mark, main.py's first."""
    exercises: list[Exercise] = []
    for path in technique_files(folder):
        for exercise in find_exercises(path):
            if any(exercise.id == known.id for known in exercises):
                raise ExerciseError(f"{path}: exercise {exercise.id!r} is also marked in "
                                    f"{next(k.file for k in exercises if k.id == exercise.id)}")
            exercises.append(exercise)
    return exercises


def _has_work(out: Path) -> bool:
    return out.exists() and any(out.iterdir())


def write_workspace(folder: Path, out: Path, only: set[str] | None = None,
                    stub: bool = True) -> list[Exercise]:
    """Write a learner workspace for the lesson in `folder` to `out`: the shared modules, every
    lesson's technique (earlier lessons are imported as references), the lesson itself with its
    tests, data and `main.py` stubbed (`stub=False`: the reference, as the planted-bug tests
    use). Refuses an `out` that already holds files."""
    folder = folder.resolve()  # compared with the lessons' absolute paths below
    exercises = lesson_exercises(folder)
    if not exercises:
        raise ExerciseError(f"{folder.name}: main.py marks no exercises")
    unknown = (only or set()) - {exercise.id for exercise in exercises}
    if unknown:
        raise ExerciseError(f"{folder.name}: no exercise {sorted(unknown)[0]!r} (known: "
                            + ", ".join(exercise.id for exercise in exercises) + ")")
    if _has_work(out):
        raise ExerciseError(f"{out} is not empty: it may hold your work; choose another --out")
    package = out / "lessons"
    package.mkdir(parents=True, exist_ok=True)
    for shared in LESSONS_ROOT.glob("*.py"):
        shutil.copy2(shared, package / shared.name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for other in sorted(LESSONS_ROOT.glob("[0-9][0-9]_*")):
        if other == folder:
            shutil.copytree(other, package / other.name, ignore=ignore)
        else:  # earlier lessons as references: technique and harness, not their tests
            shutil.copytree(other, package / other.name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tests"))
    if stub:
        for name in sorted({exercise.file for exercise in exercises}):
            path = package / folder.name / name
            path.write_text(stub_source(path.read_text(),
                                        [e for e in exercises if e.file == name], only))
    (out / "EXERCISES.md").write_text(workspace_readme(folder, exercises, only))
    (out / "EXERCISES.json").write_text(json.dumps({"only": sorted(only) if only else None,
                                                    "grades": {}}, indent=2) + "\n")
    return exercises


def _status(exercise: Exercise, only: set[str] | None, grades: dict[str, dict] | None) -> str:
    """An exercise's status column: given, to write, or its outcome in the last grade."""
    if only is not None and exercise.id not in only:
        return "given"
    entry = (grades or {}).get(exercise.id)
    if entry is None:
        return "to write"
    if entry["outcome"] == "passed":
        return f"passed ({exercise.points} points)"
    if "NotImplementedError" in entry.get("message", ""):
        return "to write (the stub is still there)"
    return entry["outcome"]


def workspace_readme(folder: Path, exercises: list[Exercise], only: set[str] | None,
                     grades: dict[str, dict] | None = None, graded_at: str = "") -> str:
    """The workspace's EXERCISES.md: what to write, and after `course grade --workspace` the
    last grade's outcome per exercise (`grades`: the grader's criteria, `graded_at`: when)."""
    rows = "\n".join(f"| `{e.id}` | {e.title} | {e.points} | " + ", ".join(f"`{t}`" for t in e.targets)
                     + f" | {_status(e, only, grades)} |" for e in exercises)
    if grades is not None:
        earned = sum(e.points for e in exercises if grades.get(e.id, {}).get("outcome") == "passed")
        rows += (f"\n\nLast graded {graded_at}: {earned} of {sum(e.points for e in exercises)} points"
                 + "".join(f"\n- `{e.id}`: {grades[e.id]['message']}" for e in exercises
                           if grades.get(e.id, {}).get("outcome") not in (None, "passed")))
    files = ", ".join(f"`lessons/{folder.name}/{name}`"
                      for name in dict.fromkeys(e.file for e in exercises))
    return (f"# Workspace: lesson {folder.name}\n\n"
            f"Write the stubbed pieces of {files} (each raises\n"
            f"NotImplementedError naming its exercise; its docstring is the specification).\n\n"
            f"| exercise | title | points | what | status |\n|---|---|---|---|---|\n{rows}\n\n"
            f"Grade yourself from the course repository:\n\n"
            f"    python -m course grade {folder.name[:2]} --workspace {'{this folder}'}\n\n"
            f"or here, with plain unittest: `python -m unittest discover`. The reference is\n"
            f"{files} in the course repository.\n")


def record_grade(workspace: Path, folder: Path, criteria: dict[str, dict],
                 graded: str | list[str] | None = None) -> None:
    """Rewrite the workspace's EXERCISES.md with the outcome of the grade just run (`criteria`
    from lessons/_grading.py; `graded`: the exercises that grade covered, None for all; the
    others keep the outcome they had). EXERCISES.json beside it keeps what the workspace was
    written with and the grades so far."""
    state_path = workspace / "EXERCISES.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"only": None, "grades": {}}
    wanted = None if graded is None else ({graded} if isinstance(graded, str) else set(graded))
    state["grades"].update({key: {"outcome": entry["outcome"], "message": entry.get("message", "")}
                            for key, entry in criteria.items() if wanted is None or key in wanted})
    only = None if state["only"] is None else set(state["only"])
    state_path.write_text(json.dumps(state, indent=2) + "\n")
    (workspace / "EXERCISES.md").write_text(workspace_readme(
        folder, lesson_exercises(folder), only, state["grades"],
        time.strftime("%Y-%m-%d %H:%M", time.localtime())))


# ----------------------------------------------------------------------------- planted bugs


@dataclasses.dataclass
class PlantedBug:
    id: str
    exercise: str
    file: str  # relative to the lesson folder
    find: str
    replace: str
    mistake: str  # the learner's mistake, in words
    # the test that failed first for this bug when the hints were last written (its id under the
    # lesson's tests/, "test_x.TestY.test_z"; `python -m lessons._grading TESTS --planted-bugs
    # --write-hints`): graded first, so a bug costs that test, not every test before it. A stale
    # hint costs only time: the exercise's other tests still run if it passes.
    caught_by: str = ""


def planted_bugs(folder: Path) -> list[PlantedBug]:
    """The lesson's planted bugs (bugs.json), checked: known exercise, text found exactly once."""
    path = folder / "bugs.json"
    if not path.exists():
        return []
    try:
        specs = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ExerciseError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    known = {exercise.id for exercise in lesson_exercises(folder)}
    bugs = []
    for index, spec in enumerate(specs if isinstance(specs, list) else []):
        where = f"{path}: [{index}]"
        missing = {"id", "exercise", "file", "find", "replace", "mistake"} - set(spec)
        if missing:
            raise ExerciseError(f"{where}: missing {sorted(missing)}")
        bug = PlantedBug(**{key: spec[key] for key in
                            ("id", "exercise", "file", "find", "replace", "mistake")},
                         caught_by=spec.get("caught_by", ""))
        if not isinstance(bug.caught_by, str):
            raise ExerciseError(f"{where}.caught_by: must be a test id (a string)")
        if bug.exercise not in known:
            raise ExerciseError(f"{where}.exercise: {bug.exercise!r} is not marked in the "
                                f"lesson's technique files")
        count = (folder / bug.file).read_text().count(bug.find)
        if count != 1:
            raise ExerciseError(f"{where}.find: found {count} times in {bug.file} (must be once)")
        bugs.append(bug)
    if not isinstance(specs, list):
        raise ExerciseError(f"{path}: must be a JSON list of bugs")
    return bugs


def plant(workspace: Path, folder_name: str, bug: PlantedBug) -> None:
    """Apply one planted bug to a reference workspace."""
    target = workspace / "lessons" / folder_name / bug.file
    text = target.read_text()
    target.write_text(text.replace(bug.find, bug.replace, 1))
