"""Functions that lesson 01's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib
import math

import torch
import torch.distributed as dist

M = importlib.import_module("lessons.01_collectives.main")  # the technique
C = importlib.import_module("lessons.01_collectives.checks")  # the harness


def suite_worker(ctx, cases: list[tuple[int, str]]) -> dict:
    """One launch per world size serves the whole multi-process suite: every check of
    `verify_collectives` for each (numel, dtype) case, the all-to-all patterns, the tree
    broadcast from every root and the planted bugs."""
    dist.all_reduce(torch.zeros(1, device=ctx.device))  # NCCL: a first call with every rank
    out = []
    for numel, dtype_name in cases:
        checks, _ = C.verify_collectives(numel, C.DTYPES[dtype_name], 7, ctx.device)
        out.append({"case": [numel, dtype_name], "checks": [vars(c) for c in checks]})
    return {"cases": out, "all_to_all": all_to_all_worker(ctx), "roots": all_roots_worker(ctx),
            "planted": planted_bugs_worker(ctx)}


def all_to_all_worker(ctx) -> list[dict]:
    """Our all_to_all against torch's all_to_all_single for the shapes lessons 11 and 12 use:
    equal blocks with trailing dims (Ulysses), uneven blocks with zeros whose sizes the
    receiver does not know (MoE dispatch), every count zero, and one rank receiving all."""
    rank, world = ctx.rank, ctx.world_size

    def counts_of(pattern: str, sender: int) -> list[int]:
        if pattern == "equal":
            return [2] * world
        if pattern == "uneven":
            return [(sender * 7 + peer * 3) % 5 for peer in range(world)]
        if pattern == "empty":
            return [0] * world
        return [3 * (sender + 1) if peer == 0 else 0 for peer in range(world)]  # all to rank 0

    results = []
    for pattern, trailing, dtype, known in [
        ("equal", (2, 3), torch.float32, True), ("equal", (), torch.int64, False),
        ("uneven", (4,), torch.bfloat16, False), ("uneven", (), torch.int32, True),
        ("empty", (3,), torch.float64, False), ("to_rank_0", (2,), torch.float16, False),
    ]:
        send_counts = counts_of(pattern, rank)
        recv_counts = [counts_of(pattern, source)[rank] for source in range(world)]
        rows = sum(send_counts)
        send = C.make_input(rank, rows * math.prod(trailing), dtype,
                            len(results)).reshape(rows, *trailing)
        before = send.clone()
        traffic = M.Traffic()
        ours = M.all_to_all(send, send_counts, recv_counts if known else None, traffic)
        theirs = C.torch_all_to_all(send, send_counts, recv_counts)
        row_bytes = math.prod(trailing) * send.element_size()
        results.append({
            "case": f"{pattern} {trailing} {dtype} known={known}",
            "equal": bool(torch.equal(ours, theirs)) and ours.shape == theirs.shape,
            "shape": list(ours.shape) == [sum(recv_counts), *trailing],
            "input_unchanged": bool(torch.equal(send, before)),
            "bytes": traffic.bytes_sent == M.all_to_all_bytes_sent(send_counts, row_bytes, rank,
                                                                   counts_exchanged=not known),
        })
    try:  # counts that do not add up to the rows: a ValueError naming the rank, before any message
        M.all_to_all(torch.zeros(world + 1), [1] * world)
        results.append({"case": "bad counts", "raised": False})
    except ValueError as exc:
        results.append({"case": "bad counts", "raised": f"rank {rank}" in str(exc)})
    return results


def planted_bugs_worker(ctx) -> dict:
    """Planted bugs the checks must catch: a ring that skips its last reduce-scatter step, and
    a ring-order reference that adds in another order. The correct ring passes both."""
    x = C.make_input(ctx.rank, 12, torch.int64, 0)
    theirs = x.clone()
    dist.all_reduce(theirs)
    good = C.compare(M.ring_all_reduce(x), theirs, None)[0]
    schedule = M.ring_schedule
    try:  # drop the reduce-scatter's last step: chunk r then lacks one rank's term
        M.ring_schedule = lambda numel, world, rank, shift: schedule(numel, world, rank, shift)[
            : -1 if shift == 1 else None]
        skipped_step = C.compare(M.ring_all_reduce(x), theirs, None)[0]
    finally:
        M.ring_schedule = schedule
    return {"good": good, "skipped_step_passes": skipped_step}


def all_roots_worker(ctx) -> list[bool]:
    """Tree broadcast from every root equals torch's broadcast."""
    results = []
    for root in range(ctx.world_size):
        ours = C.make_input(ctx.rank, 9, torch.float32, root)
        theirs = ours.clone()
        M.tree_broadcast(ours, root)
        dist.broadcast(theirs, root)
        results.append(bool(torch.equal(ours, theirs)))
    return results


def wrong_chunk_worker(ctx) -> None:
    M.ring_all_gather(torch.zeros(ctx.rank + 5), numel=8)
