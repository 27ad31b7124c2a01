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


def lesson_module(lesson: dict):
    """A lesson's main.py, imported by its package name (never as a plain `main`)."""
    return importlib.import_module(lesson["folder"].replace("/", ".") + ".main")
