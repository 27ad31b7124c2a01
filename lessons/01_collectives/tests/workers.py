"""Functions that lesson 01's tests run on spawned ranks (importable by their dotted name).

One worker per exercise: each calls only its own exercise's function (of main.py or
latency_optimal.py) and checks it against torch.distributed (or an exact single-process
reference), so a mistake in one exercise never fails another's tests (the all-reduce, a
composition, uses both rings). The demo's worker (`suite_worker`) runs every check of
checks.py: the integration criterion."""

from __future__ import annotations

import hashlib
import importlib
import math

import torch
import torch.distributed as dist

M = importlib.import_module("lessons.01_collectives.main")  # the technique
L = importlib.import_module("lessons.01_collectives.latency_optimal")  # its log2 p algorithms
C = importlib.import_module("lessons.01_collectives.checks")  # the harness

# (numel or shape, dtype) cases the ring exercises run on every world size: lengths 0, 1,
# below p, not divisible by p; integers (exact) and floats (rounding); 2-D inputs
RING_CASES = [(0, "int64"), (1, "int64"), (2, "int32"), (7, "int64"), (1001, "int64"),
              ((6, 5), "int64"), (1000, "float32"), (257, "float64"), (37, "bfloat16")]


def _shape(case) -> tuple[int, ...]:
    return tuple(case) if isinstance(case, (tuple, list)) else (case,)


def _input(rank: int, shape: tuple[int, ...], dtype_name: str, seed: int, device) -> torch.Tensor:
    return C.make_input(rank, math.prod(shape), C.DTYPES[dtype_name], seed).to(device).reshape(shape)


def _tolerance(x: torch.Tensor, world: int):
    """Per-element bound on two float summation orders (None: exact, integers or <= 2 terms)."""
    if not x.dtype.is_floating_point or world <= 2:
        return None
    abs_sum = x.double().abs()
    dist.all_reduce(abs_sum)
    return C.sum_order_tolerance(abs_sum.reshape(-1), world, x.dtype)


def _check(ok_detail: tuple[bool, str]) -> list:
    return [bool(ok_detail[0]), ok_detail[1]]


def reduce_scatter_worker(ctx, cases: list) -> list[dict]:
    """`ring_reduce_scatter` against torch's reduce-scatter (exact for integers, the float
    bound otherwise), bit for bit against the ring-order reference, its bytes against
    `ring_bytes_sent`, and its input left alone."""
    rank, world = ctx.rank, ctx.world_size
    results = []
    for seed, (size, dtype_name) in enumerate(cases):
        shape = _shape(size)
        numel = math.prod(shape)
        x = _input(rank, shape, dtype_name, seed, ctx.device)
        before = x.clone()
        traffic = M.Traffic()
        ours = M.ring_reduce_scatter(x, traffic)
        theirs = C.torch_reduce_scatter(x.reshape(-1))
        start, end = M.chunk_bounds(numel, world)[rank]
        tolerance = _tolerance(x, world)
        inputs = [_input(r, shape, dtype_name, seed, ctx.device).reshape(-1) for r in range(world)]
        expected = M.ring_bytes_sent(numel, x.element_size(), world, rank)["reduce_scatter"]
        results.append({
            "case": f"shape {shape} {dtype_name}",
            "torch": _check(C.compare(ours, theirs, None if tolerance is None else
                                      tolerance[start:end])),
            "ring_order": _check(C.compare(ours, C.ring_order_sum(inputs)[start:end], None)),
            "bytes": [traffic.bytes_sent == expected,
                      f"{traffic.bytes_sent} B sent, S - |chunk r| = {expected} B expected"],
            "input_unchanged": [bool(torch.equal(x, before)), "the input was modified"],
        })
    return results


def all_gather_worker(ctx, cases: list) -> list[dict]:
    """`ring_all_gather` of chunks that torch's reduce-scatter made (so a wrong reduce-scatter
    cannot fail it) against torch's all-gather, exactly, with its bytes and input checked."""
    rank, world = ctx.rank, ctx.world_size
    results = []
    for seed, (size, dtype_name) in enumerate(cases):
        numel = math.prod(_shape(size))
        x = _input(rank, (numel,), dtype_name, seed, ctx.device)
        chunk = C.torch_reduce_scatter(x)
        before = chunk.clone()
        traffic = M.Traffic()
        ours = M.ring_all_gather(chunk, numel, traffic)
        theirs = C.torch_all_gather(chunk, numel)
        expected = M.ring_bytes_sent(numel, x.element_size(), world, rank)["all_gather"]
        results.append({
            "case": f"numel {numel} {dtype_name}",
            "torch": _check(C.compare(ours, theirs, None)),
            "bytes": [traffic.bytes_sent == expected,
                      f"{traffic.bytes_sent} B sent, S - |chunk r+1| = {expected} B expected"],
            "input_unchanged": [bool(torch.equal(chunk, before)), "the chunk was modified"],
        })
    return results


def all_reduce_worker(ctx, cases: list) -> list[dict]:
    """`ring_all_reduce` against dist.all_reduce (within the float bound), bit for bit against
    the ring-order reference and across ranks, shape kept, bytes = both rings', input kept."""
    rank, world = ctx.rank, ctx.world_size
    results = []
    for seed, (size, dtype_name) in enumerate(cases):
        shape = _shape(size)
        numel = math.prod(shape)
        x = _input(rank, shape, dtype_name, seed, ctx.device)
        before = x.clone()
        traffic = M.Traffic()
        ours = M.ring_all_reduce(x, traffic)
        theirs = x.clone()
        dist.all_reduce(theirs)
        tolerance = _tolerance(x, world)
        inputs = [_input(r, shape, dtype_name, seed, ctx.device).reshape(-1) for r in range(world)]
        raw = ours.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        digest = torch.tensor([int.from_bytes(hashlib.sha256(raw).digest()[:7], "little")])
        lowest, highest = digest.clone(), digest.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        expected = M.ring_bytes_sent(numel, x.element_size(), world, rank)["all_reduce"]
        results.append({
            "case": f"shape {shape} {dtype_name}",
            "torch": _check(C.compare(ours, theirs, None if tolerance is None else
                                      tolerance.reshape(shape))),
            "ring_order": _check(C.compare(ours, C.ring_order_sum(inputs).reshape(shape), None)),
            "same_bits_on_every_rank": [bool(lowest == highest), "ranks hold different bytes"],
            "bytes": [traffic.bytes_sent == expected,
                      f"{traffic.bytes_sent} B sent, 2(S - ...) = {expected} B expected"],
            "input_unchanged": [bool(torch.equal(x, before)), "the input was modified"],
        })
    return results


def broadcast_worker(ctx) -> list[dict]:
    """`tree_broadcast` from every root (last rank first: relative ranks matter there) against
    dist.broadcast, exactly, with its rounds and bytes against the formulas."""
    rank, world = ctx.rank, ctx.world_size
    rounds_expected = math.ceil(math.log2(world)) if world > 1 else 0
    results = []
    for root in reversed(range(world)):
        for seed, (shape, dtype_name) in enumerate([((9,), "float32"), ((3, 4), "int64"),
                                                    ((0,), "int64")]):
            ours = _input(rank, shape, dtype_name, 10 * root + seed, ctx.device)
            theirs = ours.clone()
            traffic = M.Traffic()
            rounds = L.tree_broadcast(ours, root, traffic)
            dist.broadcast(theirs, root)
            size_bytes = ours.numel() * ours.element_size()
            expected = L.tree_broadcast_bytes_sent(size_bytes, world, root, rank)
            results.append({
                "case": f"root {root}, shape {shape} {dtype_name}",
                "torch": _check(C.compare(ours, theirs, None)),
                "rounds": [rounds == rounds_expected,
                           f"returned {rounds} rounds, ceil(log2 p) = {rounds_expected}"],
                "bytes": [traffic.bytes_sent == expected,
                          f"{traffic.bytes_sent} B sent, {expected} B expected"],
            })
    return results


def all_to_all_worker(ctx) -> list[dict]:
    """Our all_to_all against torch's all_to_all_single for the shapes lessons 11 and 12 use:
    equal blocks with trailing dims (Ulysses), uneven blocks with zeros whose sizes the
    receiver does not know (MoE dispatch), every count zero, and one rank receiving all;
    then counts that do not add up (a ValueError naming the rank)."""
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
        expected = M.all_to_all_bytes_sent(send_counts, row_bytes, rank, counts_exchanged=not known)
        results.append({
            "case": f"{pattern} {trailing} {dtype} known={known}",
            "torch": _check(C.compare(ours, theirs, None)),
            "input_unchanged": [bool(torch.equal(send, before)), "send was modified"],
            "bytes": [traffic.bytes_sent == expected,
                      f"{traffic.bytes_sent} B sent, {expected} B expected"],
        })
    try:  # counts that do not add up to the rows: a ValueError naming the rank, before any message
        M.all_to_all(torch.zeros(world + 1), [1] * world)
        raised = [False, "no error for send_counts that do not sum to send.shape[0]"]
    except Exception as exc:  # noqa: BLE001 - any other error is a wrong answer, not a crash
        raised = [isinstance(exc, ValueError) and f"rank {rank}" in str(exc),
                  f"{type(exc).__name__}: {exc}"[:200]]
    results.append({"case": "bad counts", "value_error_naming_the_rank": raised})
    return results


def wrong_chunk_worker(ctx) -> None:
    M.ring_all_gather(torch.zeros(ctx.rank + 5), numel=8)


def suite_worker(ctx, cases: list[tuple[int, str]]) -> dict:
    """The demo's checks (`verify_collectives`, every collective of main.py) for each
    (numel, dtype) case: the integration criterion."""
    dist.all_reduce(torch.zeros(1, device=ctx.device))  # NCCL: a first call with every rank
    out = []
    for numel, dtype_name in cases:
        checks, _ = C.verify_collectives(numel, C.DTYPES[dtype_name], 7, ctx.device)
        out.append({"case": [numel, dtype_name], "checks": [vars(c) for c in checks]})
    return {"cases": out}
