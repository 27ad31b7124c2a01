"""Rank functions for lesson 15's tests (spawned ranks import them by this module's name).

They return the raw trace events (`load_trace`: not an exercise), never a timeline: a learner's
unfinished `rank_timeline` must fail its own exercise's tests, not every test that needs a trace.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
import torch.distributed as dist

from lessons._launch import RankContext

M = importlib.import_module("lessons.15_profiling.main")


def traced_collectives(ctx: RankContext, out: str, steps: int) -> list[dict]:
    """Per profiled step: a matmul (compute), an async all-reduce on the world (waited for after
    more compute), and a blocking all-reduce on the subgroup {0, 2} (rank 1 is not a member and
    does not enter it). This rank's events."""
    sub = dist.new_group([0, 2]) if ctx.world_size >= 3 else None
    x = torch.randn(256, 256, device=ctx.device)
    buffer = torch.ones(10_000, device=ctx.device)

    def step(index: int) -> None:
        y = x @ x
        work = dist.all_reduce(buffer, async_op=True)
        y = y @ x
        work.wait()
        if sub is not None and ctx.rank in (0, 2):
            dist.all_reduce(buffer, group=sub)
        float(y.sum())

    path = Path(out) / f"collectives-rank{ctx.rank}.json"
    M.profile_steps(step, steps, path)
    return M.load_trace(path)
