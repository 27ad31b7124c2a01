"""Functions that lesson 01's tests run on spawned ranks (importable by their dotted name).

One worker per exercise: each calls only its own exercise's function (of main.py or
latency_optimal.py) and checks it against torch.distributed (or an exact single-process
reference), so a mistake in one exercise never fails another's tests (the all-reduce, a
composition, uses both rings). The demo's worker (`suite_worker`) runs every check of
checks.py: the integration criterion.

Every exercise worker runs its cases once per group configuration of its launch (`CONFIGS`):
the default group (`group=None`, every rank), then subgroups (`group=` a process group that
is not the world), two of them at once where the configuration lists two, the other ranks idle.
Inputs follow the global rank, so concurrent groups hold different data; ranks inside a group
are the group's ranks, as torch.distributed counts them (`group_src`, split sizes). Each case
comes back as {"case": ..., "where": ..., check: [passed, detail]}; a detail names what was
expected and what came back.
"""

from __future__ import annotations

import hashlib
import importlib
import math

import torch
import torch.distributed as dist

from lessons._launch import phase

M = importlib.import_module("lessons.01_collectives.main")  # the technique
L = importlib.import_module("lessons.01_collectives.latency_optimal")  # its log2 p algorithms
C = importlib.import_module("lessons.01_collectives.checks")  # the harness

# world size -> its group configurations: None is the default group (group=None); a list of
# rank lists makes each a group, run at the same time (ranks in none of them stay idle)
CONFIGS = {
    3: [None, [[0, 2]]],
    5: [None, [[0, 2, 4], [1, 3]], [[1, 2, 3, 4]], [[0], [1], [2], [3], [4]]],
}

# (numel or shape, dtype) cases the ring exercises run on every group: lengths 0, 1, below p,
# not divisible by p; integers (exact) and floats (rounding); 2-D inputs
RING_CASES = [(0, "int64"), (1, "int64"), (2, "int32"), (7, "int64"), (1001, "int64"),
              ((6, 5), "int64"), (1000, "float32"), (257, "float64"), (37, "bfloat16")]


def hand_input(global_rank: int, numel: int) -> torch.Tensor:
    """The hand-worked cases' input of a rank: [1, 2, ..., numel] * 10**rank (int64), so every
    element and every rank differ and a sum over a group spells the group's ranks in its digits
    (ranks 0 and 2: 101, 202, ...)."""
    return torch.arange(1, numel + 1, dtype=torch.int64) * 10 ** global_rank


# ----------------------------------------------------------------------------- plumbing


def _shape(case) -> tuple[int, ...]:
    return tuple(case) if isinstance(case, (tuple, list)) else (case,)


def _input(rank: int, shape: tuple[int, ...], dtype_name: str, seed: int, device) -> torch.Tensor:
    return C.make_input(rank, math.prod(shape), C.DTYPES[dtype_name], seed).to(device).reshape(shape)


def _values(tensor: torch.Tensor, limit: int = 6) -> str:
    values = tensor.detach().reshape(-1)[:limit].tolist()
    return f"{values}{' ...' if tensor.numel() > limit else ''}"


def compare(ours, theirs: torch.Tensor, tolerance=None) -> list:
    """[passed, detail]: `ours` equals `theirs` (exactly, or within `tolerance` element by
    element); the detail names what was expected and what came back."""
    if not isinstance(ours, torch.Tensor):
        return [False, f"expected a tensor of shape {tuple(theirs.shape)}, got {type(ours).__name__}"]
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return [False, f"expected shape {tuple(theirs.shape)} {theirs.dtype}, got shape "
                       f"{tuple(ours.shape)} {ours.dtype}"]
    passed, detail = C.compare(ours, theirs, tolerance)
    if passed:
        return [True, detail]
    error = (ours.detach().double() - theirs.detach().double()).abs().reshape(-1)
    bound = torch.as_tensor(0.0 if tolerance is None else tolerance, dtype=torch.float64).reshape(-1)
    bad = int(torch.nonzero(error > bound)[0]) if bool((error > bound).any()) else 0
    return [False, f"element {bad}: expected {theirs.reshape(-1)[bad].item()}, got "
                   f"{ours.reshape(-1)[bad].item()} ({detail}); expected {_values(theirs)}, "
                   f"got {_values(ours)}"]


def _tolerance(x: torch.Tensor, world: int, group):
    """Per-element bound on two float summation orders (None: exact, integers or <= 2 terms)."""
    if not x.dtype.is_floating_point or world <= 2:
        return None
    abs_sum = x.double().abs()
    dist.all_reduce(abs_sum, group=group)
    return C.sum_order_tolerance(abs_sum.reshape(-1), world, x.dtype)


def _bytes(traffic, expected: int, formula: str) -> list:
    return [traffic.bytes_sent == expected,
            f"expected {expected} B sent ({formula}), got {traffic.bytes_sent} B"]


def _unchanged(tensor: torch.Tensor, before: torch.Tensor, name: str) -> list:
    changed = torch.ne(tensor, before).reshape(-1)
    return [not bool(changed.any()),
            f"expected {name} unchanged, but it was modified (now {_values(tensor)}, was "
            f"{_values(before)})"]


class Group:
    """Where a case runs: `group` (None or a process group), this rank's `rank` in it, its
    `size`, the `global_ranks` of its members in group order, and `where` (for messages)."""

    def __init__(self, group, where: str):
        self.group, self.where = group, where
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.global_ranks = [r if group is None else dist.get_global_rank(group, r)
                             for r in range(self.size)]


def run_configs(ctx, configs: list, body) -> list[dict]:
    """`body(where: Group)` -> cases, once per configuration this rank takes part in. Every
    rank creates every group of a configuration (dist.new_group is collective), in order.
    Each configuration is announced with `phase()`: a rank that fails or hangs is reported
    with the configuration it was running."""
    cases: list[dict] = []
    for config in configs:
        if config is None:
            where = Group(None, f"group=None (all {ctx.world_size} ranks)")
        else:
            groups = [dist.new_group(ranks) for ranks in config]
            mine = [(g, ranks) for g, ranks in zip(groups, config) if ctx.rank in ranks]
            if not mine:
                continue  # idle while the others run
            where = Group(mine[0][0], f"group=ranks {mine[0][1]} of {ctx.world_size}")
        phase(where.where)
        for case in body(where):
            cases.append({"where": where.where, **case})
    return cases


# ----------------------------------------------------------------------------- the rings


def ring_case(ctx, g: Group, seed: int, size, dtype_name: str):
    """One ring case on this rank of `g`: (shape, numel, input, a copy of it, every group
    rank's input flattened in group order for the ring-order reference)."""
    shape = _shape(size)
    x = _input(g.global_ranks[g.rank], shape, dtype_name, seed, ctx.device)
    inputs = [_input(r, shape, dtype_name, seed, ctx.device).reshape(-1) for r in g.global_ranks]
    return shape, math.prod(shape), x, x.clone(), inputs


def reduce_scatter_worker(ctx, configs: list, cases: list) -> list[dict]:
    """`ring_reduce_scatter` against torch's reduce-scatter (exact for integers, the float
    bound otherwise), bit for bit against the ring-order reference, its bytes against
    `ring_bytes_sent`, and its input left alone; then the hand-worked cases."""

    def body(g: Group) -> list[dict]:
        results = []
        for seed, (size, dtype_name) in enumerate(cases):
            shape, numel, x, before, inputs = ring_case(ctx, g, seed, size, dtype_name)
            traffic = M.Traffic()
            ours = M.ring_reduce_scatter(x, traffic, group=g.group)
            theirs = C.torch_reduce_scatter(x.reshape(-1), g.group)
            start, end = M.chunk_bounds(numel, g.size)[g.rank]
            tolerance = _tolerance(x, g.size, g.group)
            expected = M.ring_bytes_sent(numel, x.element_size(), g.size, g.rank)["reduce_scatter"]
            results.append({
                "case": f"shape {shape} {dtype_name}",
                "torch": compare(ours, theirs, None if tolerance is None else tolerance[start:end]),
                "ring_order": compare(ours, C.ring_order_sum(inputs)[start:end]),
                "bytes": _bytes(traffic, expected, "S - |chunk r|"),
                "input_unchanged": _unchanged(x, before, "the input"),
            })
        for numel in (5, 2):
            ours = M.ring_reduce_scatter(hand_input(g.global_ranks[g.rank], numel), group=g.group)
            results.append({"case": f"hand {numel}", "values": ours.tolist()})
        return results

    return run_configs(ctx, configs, body)


def all_gather_worker(ctx, configs: list, cases: list) -> list[dict]:
    """`ring_all_gather` of chunks that torch's reduce-scatter made (so a wrong reduce-scatter
    cannot fail it), some given as 2-D columns (any shape is allowed), against torch's
    all-gather, exactly, with its bytes and input checked; a chunk of the wrong size (every
    rank's, so nobody waits); the hand-worked cases."""

    def body(g: Group) -> list[dict]:
        results = []
        for seed, (size, dtype_name) in enumerate(cases):
            numel = math.prod(_shape(size))
            x = _input(g.global_ranks[g.rank], (numel,), dtype_name, seed, ctx.device)
            chunk = C.torch_reduce_scatter(x, g.group)
            if seed % 2:
                chunk = chunk.reshape(-1, 1)  # a column: "any shape" with the right count
            before = chunk.clone()
            traffic = M.Traffic()
            ours = M.ring_all_gather(chunk, numel, traffic, group=g.group)
            theirs = C.torch_all_gather(chunk, numel, g.group)
            expected = M.ring_bytes_sent(numel, x.element_size(), g.size, g.rank)["all_gather"]
            results.append({
                "case": f"numel {numel} {dtype_name}, chunk shape {tuple(chunk.shape)}",
                "torch": compare(ours, theirs),
                "bytes": _bytes(traffic, expected, "S - |chunk r+1|"),
                "input_unchanged": _unchanged(chunk, before, "the chunk"),
            })
        traffic = M.Traffic()
        numel = 2 * g.size + 1
        size = M.chunk_sizes(numel, g.size)[g.rank] + 1  # one element too many, on every rank
        try:
            M.ring_all_gather(torch.zeros(size, dtype=torch.int64), numel, traffic, group=g.group)
            raised = [False, f"expected ValueError naming the rank for a chunk of {size} "
                             f"elements (numel {numel}), got no error"]
        except Exception as exc:  # noqa: BLE001 - any other error is a wrong answer, not a crash
            raised = [isinstance(exc, ValueError) and f"rank {dist.get_rank()}" in str(exc)
                      and traffic.messages == 0,
                      f"expected ValueError('rank {dist.get_rank()}: ...') before any message, got "
                      f"{type(exc).__name__}: {str(exc)[:150]} after {traffic.messages} messages"]
        results.append({"case": "wrong chunk size", "value_error_naming_the_rank": raised})
        for numel in (5, 2):
            start, end = M.chunk_bounds(numel, g.size)[g.rank]
            chunk = torch.arange(start + 1, end + 1, dtype=torch.int64) + 10 * g.global_ranks[g.rank]
            results.append({"case": f"hand {numel}",
                            "values": M.ring_all_gather(chunk, numel, group=g.group).tolist()})
        return results

    return run_configs(ctx, configs, body)


def all_reduce_worker(ctx, configs: list, cases: list) -> list[dict]:
    """`ring_all_reduce` against dist.all_reduce (within the float bound), bit for bit against
    the ring-order reference and across ranks, shape kept, bytes = both rings', input kept;
    the hand-worked cases."""

    def body(g: Group) -> list[dict]:
        results = []
        for seed, (size, dtype_name) in enumerate(cases):
            shape, numel, x, before, inputs = ring_case(ctx, g, seed, size, dtype_name)
            traffic = M.Traffic()
            ours = M.ring_all_reduce(x, traffic, group=g.group)
            theirs = x.clone()
            dist.all_reduce(theirs, group=g.group)
            tolerance = _tolerance(x, g.size, g.group)
            raw = ours.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() \
                if isinstance(ours, torch.Tensor) else b""
            digest = torch.tensor([int.from_bytes(hashlib.sha256(raw).digest()[:7], "little")])
            lowest, highest = digest.clone(), digest.clone()
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=g.group)
            dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=g.group)
            expected = M.ring_bytes_sent(numel, x.element_size(), g.size, g.rank)["all_reduce"]
            results.append({
                "case": f"shape {shape} {dtype_name}",
                "torch": compare(ours, theirs, None if tolerance is None else tolerance.reshape(shape)),
                "ring_order": compare(ours, C.ring_order_sum(inputs).reshape(shape)),
                "same_bits_on_every_rank": [bool(lowest == highest),
                                            "expected the same bytes on every rank of the group, "
                                            "got different sha256 digests"],
                "bytes": _bytes(traffic, expected, "2(S - ...)"),
                "input_unchanged": _unchanged(x, before, "the input"),
            })
        ours = M.ring_all_reduce(hand_input(g.global_ranks[g.rank], 6).reshape(3, 2), group=g.group)
        results.append({"case": "hand (3, 2)", "values": ours.tolist()})
        return results

    return run_configs(ctx, configs, body)


# ----------------------------------------------------------------------------- tree, all-to-all


def broadcast_worker(ctx, configs: list) -> list[dict]:
    """`tree_broadcast` from every root of the group (last first: relative ranks matter there)
    against dist.broadcast(group_src=root), exactly, in place, with its rounds and bytes
    against the formulas; the hand-worked case."""

    def body(g: Group) -> list[dict]:
        rounds_expected = math.ceil(math.log2(g.size)) if g.size > 1 else 0
        results = []
        for root in reversed(range(g.size)):
            for seed, (shape, dtype_name) in enumerate([((9,), "float32"), ((3, 4), "int64"),
                                                        ((0,), "int64")]):
                ours = _input(g.global_ranks[g.rank], shape, dtype_name, 10 * root + seed, ctx.device)
                theirs = ours.clone()
                traffic = M.Traffic()
                rounds = L.tree_broadcast(ours, root, traffic, group=g.group)
                dist.broadcast(theirs, group=g.group, group_src=root)
                size_bytes = ours.numel() * ours.element_size()
                expected = L.tree_broadcast_bytes_sent(size_bytes, g.size, root, g.rank)
                results.append({
                    "case": f"root {root}, shape {shape} {dtype_name}",
                    "torch": compare(ours, theirs),
                    "rounds": [rounds == rounds_expected,
                               f"expected ceil(log2 p) = {rounds_expected} rounds, got {rounds}"],
                    "bytes": _bytes(traffic, expected, "tree_broadcast_bytes_sent"),
                })
        hand = hand_input(g.global_ranks[g.rank], 3)
        L.tree_broadcast(hand, g.size - 1, group=g.group)
        results.append({"case": "hand, root = last rank of the group", "values": hand.tolist()})
        return results

    return run_configs(ctx, configs, body)


def all_to_all_worker(ctx, configs: list) -> list[dict]:
    """Our all_to_all against torch's all_to_all_single for the shapes lessons 11 and 12 use:
    equal blocks with trailing dims (Ulysses), uneven blocks with zeros whose sizes the
    receiver does not know (MoE dispatch), every count zero, and one rank receiving all;
    then counts that do not add up or are negative (a ValueError naming the rank); the
    hand-worked case."""

    def body(g: Group) -> list[dict]:
        world, rank = g.size, g.rank

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
            send = C.make_input(g.global_ranks[rank], rows * math.prod(trailing), dtype,
                                len(results)).reshape(rows, *trailing)
            before = send.clone()
            traffic = M.Traffic()
            ours = M.all_to_all(send, send_counts, recv_counts if known else None, traffic,
                                group=g.group)
            theirs = C.torch_all_to_all(send, send_counts, recv_counts, g.group)
            row_bytes = math.prod(trailing) * send.element_size()
            expected = M.all_to_all_bytes_sent(send_counts, row_bytes, rank, counts_exchanged=not known)
            results.append({
                "case": f"{pattern} {trailing} {dtype} counts {send_counts} known={known}",
                "torch": compare(ours, theirs),
                "input_unchanged": _unchanged(send, before, "send"),
                "bytes": _bytes(traffic, expected, "every block but our own"
                                + (", + 8 B per peer for the counts" if not known else "")),
            })
        for name, counts, rows in [("counts that do not sum to the rows", [1] * world, world + 1),
                                   ("a negative count", [2, -1] + [0] * (world - 2), 1),
                                   ("one count per rank missing", [1] * (world - 1), world - 1)]:
            if len(counts) != world and name != "one count per rank missing":
                continue  # a group of 1 rank has no room for a negative count beside a 2
            try:  # every rank of the group passes the same bad counts: nobody waits for a peer
                M.all_to_all(torch.zeros(rows), counts, [1] * world)
                raised = [False, f"expected ValueError naming the rank for {name} {counts}, "
                                 "got no error"]
            except Exception as exc:  # noqa: BLE001 - any other error is a wrong answer
                raised = [isinstance(exc, ValueError) and f"rank {dist.get_rank()}" in str(exc),
                          f"expected ValueError('rank {dist.get_rank()}: ...') for {name} "
                          f"{counts}, got {type(exc).__name__}: {str(exc)[:150]}"]
            results.append({"case": f"bad counts: {name}", "value_error_naming_the_rank": raised})
        # hand-worked: rank r sends (r + j) % 3 rows to group rank j (0, 1 or 2 rows), row k
        # of block j holding 100 * global rank + 10 * j + k
        send_counts = [(rank + j) % 3 for j in range(world)]
        send = torch.cat([torch.arange(n, dtype=torch.int64) + 100 * g.global_ranks[rank] + 10 * j
                          for j, n in enumerate(send_counts)])
        out = M.all_to_all(send, send_counts, group=g.group)
        results.append({"case": "hand", "values": out.tolist()})
        return results

    return run_configs(ctx, configs, body)


def suite_worker(ctx, cases: list[tuple[int, str]]) -> dict:
    """The demo's checks (`verify_collectives`, every collective of main.py) for each
    (numel, dtype) case, on every rank (group=None) and on two subgroups at once (the even
    and the odd ranks): the integration criterion."""
    dist.all_reduce(torch.zeros(1, device=ctx.device))  # NCCL: a first call with every rank
    halves = [list(range(ctx.world_size))[start::2] for start in (0, 1) if start < ctx.world_size]
    groups = [dist.new_group(ranks) for ranks in halves]
    mine = next(g for g, ranks in zip(groups, halves) if ctx.rank in ranks)
    out = []
    for numel, dtype_name in cases:
        for group, where in ((None, "group=None"), (mine, f"groups {halves} at once")):
            checks, _ = C.verify_collectives(numel, C.DTYPES[dtype_name], 7, ctx.device, group)
            out.append({"case": [numel, dtype_name, where], "checks": [vars(c) for c in checks]})
    return {"cases": out}
