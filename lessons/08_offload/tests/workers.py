"""Functions that lesson 08's tests run on a spawned process (importable by their dotted name)."""

from __future__ import annotations

import importlib

C = importlib.import_module("lessons.08_offload.checks")
CONFIG = {"vocab": 64, "hidden": 32, "heads": 2, "layers": 3, "seq": 16, "batch": 2,
          "chunk_numel": 8192, "device": "cpu"}


def quick_checks(ctx) -> dict:
    return C.verify_worker(ctx, 0, CONFIG, 3, None, 0.6, 1.10, True, None, 0)
