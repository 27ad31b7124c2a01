"""Functions that lesson 01's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

M = importlib.import_module("lessons.01_collectives.main")



def suite_worker(ctx, cases: list[tuple[int, str]]) -> list[dict]:
    """Every check of `verify_collectives` for each (numel, dtype) case."""
    out = []
    for numel, dtype_name in cases:
        checks, _ = M.verify_collectives(numel, M.DTYPES[dtype_name], 7, ctx.device)
        out.append({"case": [numel, dtype_name], "checks": [vars(c) for c in checks]})
    return out


def broken_ring_worker(ctx) -> dict:
    """A ring that forgets one step must be caught by the comparison against torch."""
    x = M.make_input(ctx.rank, 12, torch.int64, 0)
    good = M.ring_all_reduce(x)
    theirs = x.clone()
    dist.all_reduce(theirs)
    bad = theirs.clone()
    bad[0] += 1  # one wrong element, as a skipped add would produce
    return {"good": M.compare(good, theirs, None)[0], "bad": M.compare(bad, theirs, None)[0]}


def wrong_chunk_worker(ctx) -> None:
    M.ring_all_gather(torch.zeros(ctx.rank + 5), numel=8)


def all_roots_worker(ctx) -> list[bool]:
    """Tree broadcast from every root equals torch's broadcast."""
    results = []
    for root in range(ctx.world_size):
        ours = M.make_input(ctx.rank, 9, torch.float32, root)
        theirs = ours.clone()
        M.tree_broadcast(ours, root)
        dist.broadcast(theirs, root)
        results.append(bool(torch.equal(ours, theirs)))
    return results
