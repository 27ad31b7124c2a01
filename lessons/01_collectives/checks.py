"""Lesson 01's proof: every collective of main.py and latency_optimal.py against
torch.distributed's own, the ring against an exact single-process sum in the ring's order,
every byte count against its formula, edge lengths, and the command line.

Comparisons are exact (copies, integers, the same additions in the same order) or bounded by
how far two float summation orders may differ: (p-1) eps sum|x_i|, element by element
(`lessons._checks.sum_order_tolerance`). The bound holds on a GPU too: every addition, in
our ring and in NCCL's kernels, is one correctly rounded IEEE add (Higham's bound assumes
nothing else), so `--device cuda` uses the same tolerance.
"""

from __future__ import annotations

import hashlib
import math
import time

import torch
import torch.distributed as dist

from lessons._checks import compare, sum_order_tolerance
from lessons._launch import RankContext, choose_device, inject_fault, under_torchrun
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    int_in,
    launch_checks,
    lesson_parser,
)

from . import latency_optimal
from . import main as collectives

LESSON = "01_collectives"
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
}

# ----------------------------------------------------------------------------- references


def make_input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank `rank`'s input: deterministic in (seed, rank), so any process can rebuild it.
    Floats ~ N(0, 1); integers uniform in [-1000, 1000). Built on the CPU (same values on any
    device), then moved by the caller."""
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=torch.float32).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=generator, dtype=dtype)


def ring_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Single-process reference that adds in exactly the ring's order: chunk c is
    x_c + (x_{c-1} + (... + (x_{c+2} + x_{c+1}))). Equal to `ring_all_reduce` bit for bit."""
    world = len(inputs)
    numel = inputs[0].numel()
    out = torch.empty_like(inputs[0])
    for c, (start, end) in enumerate(collectives.chunk_bounds(numel, world)):
        acc = inputs[(c + 1) % world][start:end].clone()
        for hop in range(2, world + 1):
            acc = inputs[(c + hop) % world][start:end] + acc
        out[start:end] = acc
    return out


def torch_reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch's reduce-scatter of a vector into `chunk_sizes` pieces over `group`. torch needs
    equal chunks, so uneven lengths use an all-reduce and keep our slice (same sums, torch's
    order)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start, end = collectives.chunk_bounds(flat.numel(), world)[rank]
    if flat.numel() % world == 0:
        out = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_single(out, flat.clone(), group=group)
        return out
    total = flat.clone()
    dist.all_reduce(total, group=group)
    return total[start:end].clone()


def torch_all_gather(chunk: torch.Tensor, numel: int,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch's all-gather of uneven chunks over `group`: equal chunks use all_gather_single;
    otherwise each rank places its chunk in zeros and torch all-reduces (x + 0 == x exactly)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if numel % world == 0:
        out = torch.empty(numel, dtype=chunk.dtype, device=chunk.device)
        dist.all_gather_single(out, chunk.reshape(-1).contiguous(), group=group)
        return out
    start, end = collectives.chunk_bounds(numel, world)[rank]
    out = torch.zeros(numel, dtype=chunk.dtype, device=chunk.device)
    out[start:end] = chunk.reshape(-1)
    dist.all_reduce(out, group=group)
    return out


def torch_all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)`,
    which gloo (CPU) and NCCL both implement for uneven and empty splits along dim 0."""
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out


def segmented_messages(numel: int, world_size: int, rank: int, segment_elems: int) -> int:
    """Exact messages rank `rank` sends in `segmented_ring_reduce_scatter`: ceil(|chunk| / segment)
    for each chunk it sends (every chunk but its own), against p-1 for the plain ring."""
    sizes = collectives.chunk_sizes(numel, world_size)
    return sum(math.ceil(size / segment_elems) for chunk, size in enumerate(sizes)
               if chunk != rank)


def uneven_counts(sender: int, world: int, numel: int) -> list[int]:
    """Rows rank `sender` sends to each rank in the uneven all-to-all check: a fixed pattern of
    0-3 units (zeros included), scaled by numel so that numel = 0 sends nothing at all.
    Rank j receives [uneven_counts(i, p, numel)[j] for i in range(p)]."""
    unit = math.ceil(numel / (2 * world * world))
    return [((sender * 5 + peer * 3 + 1) % 4) * unit for peer in range(world)]


# ----------------------------------------------------------------------------- the checks


def check_all_to_all(name: str, send: torch.Tensor, send_counts: list[int],
                     recv_counts: list[int], known: bool,
                     group: dist.ProcessGroup | None = None) -> list[Check]:
    """Our all_to_all against torch's on the same rows (exact: copies only) and its byte count
    against `all_to_all_bytes_sent`. known=False lets all_to_all exchange the counts first."""
    traffic = collectives.Traffic()
    ours = collectives.all_to_all(send, send_counts, recv_counts if known else None, traffic,
                                  group=group)
    ok, detail = compare(ours, torch_all_to_all(send, send_counts, recv_counts, group), None)
    expected = collectives.all_to_all_bytes_sent(send_counts, math.prod(send.shape[1:]) * send.element_size(),
                                                 dist.get_rank(group), counts_exchanged=not known)
    return [Check(f"{name} == torch all_to_all_single", ok, detail),
            Check(f"{name}: bytes sent == formula", traffic.bytes_sent == expected,
                  f"{traffic.bytes_sent} B counted, {expected} B formula")]


def verify_collectives(numel: int, dtype: torch.dtype, seed: int, device: torch.device,
                       group: dist.ProcessGroup | None = None) -> tuple[list[Check], dict]:
    """Run every collective once on this rank's input and check it, over `group` (None: every
    rank; else only its ranks call, and ranks are ranks in it). Inputs follow the global rank,
    so two groups checked at once hold different data. Returns (checks, metrics)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    global_ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(world)]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size_bytes = numel * itemsize
    x = make_input(global_ranks[rank], numel, dtype, seed).to(device)
    checks: list[Check] = []

    tolerance = None
    if dtype.is_floating_point and world > 2:  # 1 or 2 terms: every order gives the same sum
        abs_sum = x.double().abs()
        dist.all_reduce(abs_sum, group=group)
        tolerance = sum_order_tolerance(abs_sum, world, dtype)

    # the plain ring: reduce-scatter, all-gather, all-reduce (ours, counted) vs torch
    traffic_rs, traffic_ag = collectives.Traffic(), collectives.Traffic()
    our_chunk = collectives.ring_reduce_scatter(x, traffic_rs, group=group)
    start, end = collectives.chunk_bounds(numel, world)[rank]
    ok, detail = compare(our_chunk, torch_reduce_scatter(x, group),
                         None if tolerance is None else tolerance[start:end])
    checks.append(Check("ring reduce-scatter == torch", ok, detail))

    ours_gathered = collectives.ring_all_gather(our_chunk, numel, traffic_ag, group=group)
    ok, detail = compare(ours_gathered, torch_all_gather(our_chunk, numel, group), None)
    checks.append(Check("ring all-gather == torch (exact: copies only)", ok, detail))

    traffic_ar = collectives.Traffic()
    ours_reduced = collectives.ring_all_reduce(x, traffic_ar, group=group)
    theirs_reduced = x.clone()
    dist.all_reduce(theirs_reduced, group=group)
    ok, detail = compare(ours_reduced, theirs_reduced, tolerance)
    checks.append(Check("ring all-reduce == torch all_reduce", ok, detail))

    inputs = [make_input(r, numel, dtype, seed).to(device) for r in global_ranks]
    ok, detail = compare(ours_reduced, ring_order_sum(inputs), None)
    checks.append(Check("ring all-reduce == ring-order reference (bitwise)", ok, detail))

    raw = ours_reduced.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    digest = torch.tensor([int.from_bytes(hashlib.sha256(raw).digest()[:7], "little")],
                          dtype=torch.int64, device=device)
    lowest, highest = digest.clone(), digest.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    checks.append(Check("every rank holds identical all-reduce bytes", bool(lowest == highest),
                        "same hash on all ranks" if bool(lowest == highest) else "hashes differ"))

    expected = collectives.ring_bytes_sent(numel, itemsize, world, rank)
    counted = {"reduce_scatter": traffic_rs.bytes_sent, "all_gather": traffic_ag.bytes_sent,
               "all_reduce": traffic_ar.bytes_sent}
    formula = collectives.ring_all_reduce_bytes_formula(size_bytes, world)
    checks.append(Check("ring bytes sent == formula", counted == expected,
                        f"all-reduce {counted['all_reduce']} B counted, {expected['all_reduce']} B "
                        f"formula; 2(p-1)/p*S = {formula:g} B"))

    # the segmented ring: same bits and bytes as the plain one, more (smaller) messages
    segment = max(1, numel // (3 * world))  # about 3 pieces per chunk
    traffic_seg = collectives.Traffic()
    ours_segmented = collectives.segmented_ring_reduce_scatter(x, traffic_seg, segment, group=group)
    messages = segmented_messages(numel, world, rank, segment)
    seg_ok = (compare(ours_segmented, our_chunk, None)[0]
              and traffic_seg.bytes_sent == traffic_rs.bytes_sent
              and traffic_seg.messages == messages)
    checks.append(Check("segmented reduce-scatter == plain (bitwise), same bytes", seg_ok,
                        f"{traffic_seg.messages} messages of <= {segment} elements "
                        f"(formula {messages}) vs {traffic_rs.messages} plain"))

    # binomial-tree broadcast from the last rank (exercises relative ranks)
    root = world - 1
    ours_bcast = x.clone()
    traffic_bc = collectives.Traffic()
    rounds = latency_optimal.tree_broadcast(ours_bcast, root, traffic_bc, group=group)
    theirs_bcast = x.clone()
    dist.broadcast(theirs_bcast, group=group, group_src=root)
    ok, detail = compare(ours_bcast, theirs_bcast, None)
    checks.append(Check("tree broadcast from the last rank == torch broadcast", ok,
                        f"root {root}: {detail}"))
    bcast_expected = latency_optimal.tree_broadcast_bytes_sent(size_bytes, world, root, rank)
    total_sent = torch.tensor([traffic_bc.bytes_sent], dtype=torch.int64, device=device)
    dist.all_reduce(total_sent, group=group)
    bcast_ok = (traffic_bc.bytes_sent == bcast_expected and int(total_sent) == (world - 1) * size_bytes
                and rounds == (math.ceil(math.log2(world)) if world > 1 else 0))
    checks.append(Check("tree broadcast bytes and rounds == formula", bcast_ok,
                        f"{rounds} rounds; {traffic_bc.bytes_sent} B sent here; "
                        f"{int(total_sent)} B in all = (p-1)*S"))

    # recursive doubling
    traffic_rd = collectives.Traffic()
    ours_doubling = latency_optimal.recursive_doubling_all_reduce(x, traffic_rd, group=group)
    ok, detail = compare(ours_doubling, theirs_reduced, tolerance)
    checks.append(Check("recursive doubling == torch all_reduce", ok, detail))
    rd_expected = latency_optimal.recursive_doubling_bytes_sent(size_bytes, world, rank)
    checks.append(Check("recursive doubling bytes sent == formula",
                        traffic_rd.bytes_sent == rd_expected,
                        f"{traffic_rd.bytes_sent} B counted, {rd_expected} B formula"))

    # all-to-all: equal blocks of rows (Ulysses), then uneven blocks whose sizes the
    # receivers learn from a first exchange of counts (mixture-of-experts dispatch)
    equal = [numel // world] * world
    rows = make_input(global_ranks[rank], sum(equal) * 3, dtype, seed + 2).to(device).reshape(-1, 3)
    checks += check_all_to_all("all-to-all, equal blocks", rows, equal, equal, True, group)
    send_counts = uneven_counts(rank, world, numel)
    recv_counts = [uneven_counts(source, world, numel)[rank] for source in range(world)]
    rows = make_input(global_ranks[rank], sum(send_counts) * 2, dtype, seed + 3).to(device).reshape(-1, 2)
    checks += check_all_to_all("all-to-all, uneven blocks, counts exchanged", rows, send_counts,
                               recv_counts, False, group)

    metrics = {"bytes_sent": counted["all_reduce"], "bytes_expected": expected["all_reduce"]}
    return checks, metrics


def verify_worker(ctx: RankContext, numel: int, dtype_name: str, seed: int, fault: str | None,
                  fault_rank: int) -> dict:
    """One rank of the demo: the main checks at `numel`, then edge lengths in int64."""
    inject_fault(ctx, fault, fault_rank)
    # NCCL: the group's first communication must involve every rank (batch_isend_irecv's docs)
    dist.all_reduce(torch.zeros(1, device=ctx.device))
    checks, metrics = verify_collectives(numel, DTYPES[dtype_name], seed, ctx.device)
    world = ctx.world_size
    edge_lengths = sorted({0, 1, max(world - 1, 0), world + 1, 2 * world + 3})
    edge_failures = []
    for length in edge_lengths:
        edge_checks, _ = verify_collectives(length, torch.int64, seed + 1, ctx.device)
        edge_failures += [f"numel={length}: {c.name}" for c in edge_checks if not c.passed]
    checks.append(Check(f"edge lengths {edge_lengths} (int64, every check above)",
                        not edge_failures, "; ".join(edge_failures) or "all exact"))
    # subgroups: the even ranks and the odd ranks, each a group, checked at the same time
    halves = [list(range(world))[start::2] for start in (0, 1) if start < world]
    groups = [dist.new_group(ranks) for ranks in halves]  # every rank creates every group
    mine = next(g for g, ranks in zip(groups, halves) if ctx.rank in ranks)
    group_checks, _ = verify_collectives(numel, DTYPES[dtype_name], seed + 4, ctx.device, mine)
    group_failures = [c.name for c in group_checks if not c.passed]
    checks.append(Check(f"subgroups {halves} at once (every check above, group=...)",
                        not group_failures, "; ".join(group_failures) or "all pass"))
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


# ----------------------------------------------------------------------------- the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Collectives from point-to-point messages, checked against "
                           "torch.distributed.")
    parser.add_argument("--numel", type=int_in(0, 1 << 28), default=4096,
                        help="elements per rank for the checks (default 4096)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--bench", action="store_true",
                        help="time plain and segmented rings, all-to-all and torch's, 4 KiB to "
                             "64 MiB (--quick: to 1 MiB), and fit alpha and beta")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.bench and args.world_size < 2 and not under_torchrun():
        parser.error("--bench needs at least 2 ranks: nothing crosses a link on one")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results, checks = launch_checks(verify_worker, args, (args.numel, args.dtype, args.seed))
    world = len(results)
    itemsize = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    size_bytes = args.numel * itemsize
    metrics = {
        "numel": args.numel, "dtype": args.dtype, "size_bytes": size_bytes,
        "bytes_sent_per_rank": [r["metrics"]["bytes_sent"] for r in results],
        "bytes_formula": collectives.ring_all_reduce_bytes_formula(size_bytes, world),
        "bytes_formula_exact_per_rank": [r["metrics"]["bytes_expected"] for r in results],
    }
    device, backend = choose_device(args.device, world)
    if args.bench:
        from .bench import run_bench  # only when asked: the checks never need the benchmark

        metrics.update(run_bench(args.world_size, args.device, args.quick, args.timeout))
    metrics["headline"] = (f"ring all-reduce: {metrics['bytes_sent_per_rank'][0]} B sent by rank 0 "
                           f"(2(p-1)/p*S = {metrics['bytes_formula']:g} B)")
    report = Report(LESSON, device, backend, world, checks, metrics)
    return finish(report, args.json, started)
