"""Helpers for the course-wide tests: the lessons listed in the catalog, and their modules."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def catalog() -> dict:
    return json.loads((REPO_ROOT / "catalog.json").read_text())


def lessons() -> list[dict]:
    return catalog()["lessons"]


def lesson_module(lesson: dict, name: str = "main"):
    """A lesson's main.py (or another of its modules), imported by its package name (never as
    a plain `main`)."""
    return importlib.import_module(lesson["folder"].replace("/", ".") + "." + name)


def lesson_modules(lesson: dict) -> list:
    """The technique file first, then the harness modules beside it (checks.py, bench.py, ...):
    the names a lesson's docs and quiz may use."""
    folder = REPO_ROOT / lesson["folder"]
    names = ["main"] + sorted(path.stem for path in folder.glob("*.py")
                              if path.stem not in ("main", "__init__"))
    return [lesson_module(lesson, name) for name in names]


def lookup(modules: list, dotted: str):
    """The object `dotted` names in the first module that has it (None if none does)."""
    for module in modules:
        target = module
        for part in dotted.split("."):
            if not hasattr(target, part):
                break
            target = getattr(target, part)
        else:
            return target
    return None
