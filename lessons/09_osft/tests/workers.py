"""Functions that lesson 09's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

C = importlib.import_module("lessons.09_osft.checks")
B = importlib.import_module("lessons.09_osft.bench")


def sharded(ctx) -> dict:
    checks, metrics = C.sharded_checks(ctx, 0)  # the demo's seed: the README quotes it
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


def all_reduce_bench(ctx) -> list[dict]:
    return B.bench_all_reduce_worker(ctx, [(4, 64), (2, 256)], 1)
