"""The course runner: `python -m course run|grade|catalog` (see course/__main__.py).

catalog.json is the index of lessons and the source of truth for the runner and the site.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from jsonschema import Draft202012Validator


def _import_lessons_without_a_forkserver() -> None:
    """`import lessons` starts the launcher's forkserver, which imports torch (lessons/_prewarm.py).
    The course commands run demos and grading in subprocesses and launch no ranks themselves,
    so they import the package with prewarming off; the environment their subprocesses inherit
    is restored (those still prewarm). Where `lessons` is already imported, nothing changes.
    The variable is lessons._prewarm.NO_PREWARM, spelled out: importing it would prewarm."""
    saved = os.environ.get("_DTFS_NO_PREWARM")
    os.environ["_DTFS_NO_PREWARM"] = "1"
    try:
        import lessons  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("_DTFS_NO_PREWARM", None)
        else:
            os.environ["_DTFS_NO_PREWARM"] = saved


_import_lessons_without_a_forkserver()

REPO_ROOT = Path(__file__).resolve().parent.parent
CATALOG_PATH = REPO_ROOT / "catalog.json"
CATALOG_SCHEMA_PATH = Path(__file__).resolve().parent / "catalog.schema.json"


class CatalogError(ValueError):
    """catalog.json is unusable; the message names the file and the JSON path."""


@lru_cache(maxsize=1)
def catalog_validator() -> Draft202012Validator:
    schema = json.loads(CATALOG_SCHEMA_PATH.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def catalog_problems(catalog: dict) -> list[str]:
    """Schema errors, then cross-checks against the repository: every path exists, ids unique
    and in order, prerequisites name earlier lessons, question counts match the quizzes, and
    every lesson folder is listed (both ways)."""
    problems = [f"catalog.json: {error.json_path}: {error.message}"
                for error in catalog_validator().iter_errors(catalog)]
    if problems:
        return problems
    lessons = catalog["lessons"]
    ids = [lesson["id"] for lesson in lessons]
    if ids != sorted(ids) or len(set(ids)) != len(ids):
        problems.append(f"catalog.json: $.lessons: ids must be unique and in order, got {ids}")
    for index, lesson in enumerate(lessons):
        where = f"catalog.json: $.lessons[{index}]"
        folder = f"lessons/{lesson['id']}_{lesson['slug']}"
        if lesson["folder"] != folder:
            problems.append(f"{where}.folder: {lesson['folder']!r}, expected {folder!r}")
        for key, rel in lesson["paths"].items():
            if not (REPO_ROOT / rel).exists():
                problems.append(f"{where}.paths.{key}: {rel} does not exist")
        for prereq in lesson["prerequisites"]:
            if prereq not in ids[:index]:
                problems.append(f"{where}.prerequisites: {prereq!r} is not an earlier lesson")
        problems += exercise_problems(lesson, where)
        quiz_path = REPO_ROOT / lesson["paths"]["quiz"]
        if quiz_path.exists():
            try:
                count = len(json.loads(quiz_path.read_text())["questions"])
            except (ValueError, KeyError, TypeError):
                problems.append(f"{where}.questions: {lesson['paths']['quiz']} is not a valid quiz")
            else:
                if count != lesson["questions"]:
                    problems.append(f"{where}.questions: {lesson['questions']} but the quiz has "
                                    f"{count}")
    listed = {lesson["folder"] for lesson in lessons}
    on_disk = {f"lessons/{p.name}" for p in REPO_ROOT.glob("lessons/[0-9][0-9]_*") if p.is_dir()}
    for folder in sorted(on_disk - listed):
        problems.append(f"catalog.json: $.lessons: folder {folder} is not listed")
    for folder in sorted(listed - on_disk):
        problems.append(f"catalog.json: $.lessons: {folder} is listed but missing")
    return problems


def exercise_problems(lesson: dict, where: str) -> list[str]:
    """The catalog's exercises of a lesson must be the ones marked in its technique files
    (main.py first; id, title, points, in order)."""
    from lessons._exercises import ExerciseError, lesson_exercises

    try:
        marked = [{"id": e.id, "title": e.title, "points": e.points}
                  for e in lesson_exercises(REPO_ROOT / lesson["folder"])]
    except ExerciseError as exc:
        return [f"{where}.exercises: {exc}"]
    listed = lesson.get("exercises", [])
    if listed != marked:
        return [f"{where}.exercises: {[e['id'] for e in listed]} but the technique files mark "
                f"{[e['id'] for e in marked]} (ids, titles and points must match)"]
    return []


def sync_exercises(catalog: dict) -> dict:
    """The catalog with each lesson's exercises taken from its technique files' markers."""
    from lessons._exercises import lesson_exercises

    for lesson in catalog["lessons"]:
        marked = [{"id": e.id, "title": e.title, "points": e.points}
                  for e in lesson_exercises(REPO_ROOT / lesson["folder"])]
        if marked:
            lesson["exercises"] = marked
        else:
            lesson.pop("exercises", None)
    return catalog


def load_catalog() -> dict:
    """The validated catalog, or CatalogError naming the first problem."""
    try:
        catalog = json.loads(CATALOG_PATH.read_text())
    except (OSError, ValueError) as exc:
        raise CatalogError(f"catalog.json: $: {exc}") from None
    problems = catalog_problems(catalog)
    if problems:
        raise CatalogError(problems[0])
    return catalog


def select_lessons(catalog: dict, keys: list[str]) -> list[dict]:
    """Lessons by id ("01"), slug or folder name; all of them when `keys` is empty."""
    if not keys:
        return list(catalog["lessons"])
    chosen = []
    for key in keys:
        match = [lesson for lesson in catalog["lessons"]
                 if key in (lesson["id"], lesson["slug"], lesson["folder"].split("/")[-1])]
        if not match:
            known = ", ".join(lesson["id"] for lesson in catalog["lessons"])
            raise CatalogError(f"unknown lesson {key!r} (known ids: {known})")
        chosen.extend(match)
    return chosen
