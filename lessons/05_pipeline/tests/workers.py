"""Functions that lesson 05's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

M = importlib.import_module("lessons.05_pipeline.main")


def pipeline_checks(ctx, microbatches: int) -> dict:
    return M.pipeline_worker(ctx, 2, microbatches, None, 0)
