"""Lesson 01: collective operations, built from point-to-point messages.

The story, top to bottom:

1. Split a tensor of S bytes into p chunks (sizes differ by at most one element).
2. `exchange`: the only communication primitive we allow ourselves (isend + irecv), which
   also counts every byte a rank sends.
3. Ring reduce-scatter, ring all-gather, and ring all-reduce as their composition:
   2(p-1) steps, 2(p-1)/p * S bytes sent per rank, whatever p is.
4. Binomial-tree broadcast (ceil(log2 p) rounds) and recursive-doubling all-reduce
   (log2 p rounds of full-size exchanges) for comparison.
5. The formulas: bytes per rank, alpha-beta time, and nccl-tests' algbw / busbw.
6. The checks: every result against torch.distributed's own collective, the ring against an
   exact single-process sum in the ring's order, and every byte count against its formula.
7. `--bench`: our ring all-reduce next to torch's all_reduce, sizes 4 KiB to 64 MiB, and an
   alpha-beta model fitted to the measurements.

Run: `python lessons/01_collectives/main.py --world-size 5 --numel 1000`.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from lessons._launch import RankContext, choose_device, inject_fault, is_reporting_rank, launch
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    int_in,
    lesson_parser,
    merge_rank_checks,
    run_main,
)

LESSON = "01_collectives"
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
}

# ============================================================================ 1. chunks


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Split `numel` elements into `world_size` chunks whose sizes differ by at most one.

    The first numel % p chunks get one extra element: chunk_sizes(10, 4) == [3, 3, 2, 2].
    When numel < p the tail chunks are empty: chunk_sizes(2, 4) == [1, 1, 0, 0].
    """
    base, extra = divmod(numel, world_size)
    return [base + (1 if index < extra else 0) for index in range(world_size)]


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) offsets of each chunk of `chunk_sizes`: chunk_bounds(10, 4) ==
    [(0, 3), (3, 6), (6, 8), (8, 10)]."""
    bounds, start = [], 0
    for size in chunk_sizes(numel, world_size):
        bounds.append((start, start + size))
        start += size
    return bounds


# ============================================================================ 2. messages


SEGMENT_ELEMS = 1 << 18  # 1 MiB of float32 per message in the pipelined ring


class Traffic:
    """Counts what this rank sends: bytes and messages (a message of 0 elements is not sent)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.messages = 0

    def record(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages += 1


def exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
             traffic: Traffic | None = None) -> None:
    """Send `send` to rank `dst` while receiving into `recv` from rank `src`.

    Both are posted before either is waited on (isend + irecv), so a ring where every rank
    sends right and receives left cannot deadlock. Empty or None tensors are skipped: both
    sides compute the same chunk sizes, so they skip the same messages. Cost: alpha + n*beta.
    """
    for _ in exchange_segments(send, dst, recv, src, traffic, segment_elems=None):
        pass


def exchange_segments(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
                      traffic: Traffic | None = None, segment_elems: int | None = SEGMENT_ELEMS):
    """`exchange`, cut into segments of `segment_elems` elements (None: one message), that
    yields the slice of `recv` that just arrived, in order, while later ones are in flight.

    The caller reduces segment i while segment i+1 is still on the wire, which hides most of
    the reduction time behind the transfer (what gloo and NCCL do with their pipelined rings).
    Bytes sent are the same; messages go from 1 to ceil(n / segment_elems).
    """
    def pieces(tensor: torch.Tensor | None) -> list[slice]:
        if tensor is None or tensor.numel() == 0:
            return []
        step = segment_elems or tensor.numel()
        return [slice(i, min(i + step, tensor.numel())) for i in range(0, tensor.numel(), step)]

    receives = [(piece, dist.irecv(recv[piece], src)) for piece in pieces(recv)]
    sends = []
    for piece in pieces(send):
        sends.append(dist.isend(send[piece].contiguous(), dst))
        if traffic is not None:
            traffic.record(send[piece])
    for piece, request in receives:
        request.wait()
        yield piece
    for request in sends:
        request.wait()


# ============================================================================ 3. the ring


def ring_reduce_scatter(tensor: torch.Tensor, traffic: Traffic | None = None) -> torch.Tensor:
    """Sum `tensor` (same shape on every rank, flattened to S elements) across ranks and
    return this rank's chunk `rank` of the sum (sizes from `chunk_sizes`).

    p-1 steps; at step s rank r sends chunk (r-s-1) mod p to its right neighbour and adds
    the chunk (r-s-2) mod p arriving from its left. Chunk c's partial sum starts on rank c+1
    and travels once round the ring, gaining one term per hop, so it ends on rank c as
    x_c + (x_{c-1} + (... + x_{c+1})). Bytes sent per rank: S - |chunk r| = (p-1)/p * S
    when p divides S.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.reshape(-1).clone()
    bounds = chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty(max(chunk_sizes(flat.numel(), world)), dtype=flat.dtype,
                           device=flat.device)
    for step in range(world - 1):
        send_start, send_end = bounds[(rank - step - 1) % world]
        recv_start, recv_end = bounds[(rank - step - 2) % world]
        received = incoming[: recv_end - recv_start]
        target = flat[recv_start:recv_end]
        for piece in exchange_segments(flat[send_start:send_end], right, received, left, traffic):
            target[piece] += received[piece]  # reduce this piece while the next one arrives
    start, end = bounds[rank]
    return flat[start:end].clone()


def ring_all_gather(chunk: torch.Tensor, numel: int, traffic: Traffic | None = None) -> torch.Tensor:
    """Every rank contributes `chunk` (its chunk `rank` of a length-`numel` vector, sizes from
    `chunk_sizes`); every rank returns the whole vector.

    p-1 steps; at step s rank r forwards chunk (r-s) mod p to the right and receives chunk
    (r-s-1) mod p from the left, straight into place. Bytes sent per rank:
    S - |chunk r+1| = (p-1)/p * S when p divides S.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(numel, world)
    start, end = bounds[rank]
    if chunk.numel() != end - start:
        raise ValueError(f"rank {rank}: chunk has {chunk.numel()} elements, expected "
                         f"{end - start} for numel={numel} over {world} ranks")
    out = torch.empty(numel, dtype=chunk.dtype, device=chunk.device)
    out[start:end] = chunk.reshape(-1)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_start, send_end = bounds[(rank - step) % world]
        recv_start, recv_end = bounds[(rank - step - 1) % world]
        exchange(out[send_start:send_end], right, out[recv_start:recv_end], left, traffic)
    return out


def ring_all_reduce(tensor: torch.Tensor, traffic: Traffic | None = None) -> torch.Tensor:
    """All-reduce (sum) = ring reduce-scatter, then ring all-gather of the reduced chunks.

    2(p-1) steps of S/p bytes: each rank sends 2(p-1)/p * S bytes, independent of p for large
    p (bandwidth-optimal). Alpha-beta time: 2(p-1)*alpha + 2(p-1)/p * S * beta.
    Returns a new tensor of `tensor`'s shape; `tensor` is unchanged (dist.all_reduce works in
    place and also sums: averaging is the caller's job).
    """
    reduced_chunk = ring_reduce_scatter(tensor, traffic)
    return ring_all_gather(reduced_chunk, tensor.numel(), traffic).reshape(tensor.shape)


# ============================================================================ 4. tree and doubling


def tree_broadcast(tensor: torch.Tensor, root: int, traffic: Traffic | None = None) -> int:
    """Binomial-tree broadcast of `tensor` from `root`, in place. Returns the rounds used.

    With relative rank v = (rank - root) mod p, in round k (k = 0, 1, ...) every rank with
    v < 2^k already has the data and sends it to v + 2^k (if that exists). The set of ranks
    holding the data doubles each round: ceil(log2 p) rounds, p-1 messages of S bytes in all.
    The root sends ceil(log2 p) * S bytes. Time: ceil(log2 p) * (alpha + S * beta).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    relative = (rank - root) % world
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    for k in range(rounds):
        span = 1 << k
        if relative < span and relative + span < world:
            exchange(tensor, (relative + span + root) % world, None, -1, traffic)
        elif span <= relative < 2 * span:
            exchange(None, -1, tensor, (relative - span + root) % world, traffic)
    return rounds


def recursive_doubling_all_reduce(tensor: torch.Tensor, traffic: Traffic | None = None) -> torch.Tensor:
    """All-reduce (sum) by recursive doubling: in round k, rank r swaps its whole partial sum
    with rank r XOR 2^k and adds. log2(p) rounds when p is a power of two.

    Other p: with q = the largest power of two <= p, ranks q..p-1 first fold their data into
    ranks 0..p-q-1, the q ranks double, and the result is sent back. Every rank ends with
    bitwise-identical sums (a + b == b + a in IEEE arithmetic). Bytes per rank: log2(q) * S
    (+ S on a rank that folds or is folded into): latency-optimal, not bandwidth-optimal.
    Time (p a power of two): log2(p) * (alpha + S * beta).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.reshape(-1).clone()
    power = 1 << (world.bit_length() - 1)
    partner_buffer = torch.empty_like(flat)
    if rank >= power:  # fold into rank - power, then wait for the answer
        exchange(flat, rank - power, None, -1, traffic)
        exchange(None, -1, flat, rank - power, traffic)
        return flat.reshape(tensor.shape)
    if rank + power < world:
        exchange(None, -1, partner_buffer, rank + power, traffic)
        flat += partner_buffer
    span = 1
    while span < power:
        partner = rank ^ span
        exchange(flat, partner, partner_buffer, partner, traffic)
        flat += partner_buffer
        span <<= 1
    if rank + power < world:
        exchange(flat, rank + power, None, -1, traffic)
    return flat.reshape(tensor.shape)


# ============================================================================ 5. the formulas


def ring_bytes_sent(numel: int, itemsize: int, world_size: int, rank: int) -> dict[str, int]:
    """Exact bytes rank `rank` sends in our ring collectives on a vector of `numel` elements.

    reduce-scatter: every chunk but chunk r; all-gather: every chunk but chunk r+1.
    When p divides S these are (p-1)/p * S each and 2(p-1)/p * S for the all-reduce.
    """
    sizes = chunk_sizes(numel, world_size)
    total = numel * itemsize
    if world_size == 1:
        return {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    reduce_scatter = total - sizes[rank] * itemsize
    all_gather = total - sizes[(rank + 1) % world_size] * itemsize
    return {"reduce_scatter": reduce_scatter, "all_gather": all_gather,
            "all_reduce": reduce_scatter + all_gather}


def ring_all_reduce_bytes_formula(size_bytes: float, world_size: int) -> float:
    """REFERENCES.md: each rank sends 2(p-1)/p * S bytes in a ring all-reduce."""
    return 2 * (world_size - 1) / world_size * size_bytes


def tree_broadcast_bytes_sent(size_bytes: int, world_size: int, root: int, rank: int) -> int:
    """Bytes rank `rank` sends in `tree_broadcast`: S for every round k with v < 2^k and
    v + 2^k < p (v the relative rank). Summed over ranks: (p-1) * S."""
    relative = (rank - root) % world_size
    rounds = math.ceil(math.log2(world_size)) if world_size > 1 else 0
    sends = sum(1 for k in range(rounds) if relative < (1 << k) and relative + (1 << k) < world_size)
    return sends * size_bytes


def recursive_doubling_bytes_sent(size_bytes: int, world_size: int, rank: int) -> int:
    """Bytes rank `rank` sends in `recursive_doubling_all_reduce`: log2(q) * S for the q
    doubling ranks (q the largest power of two <= p), one more S for a rank that sends the
    result back to a folded rank, exactly S for a folded rank."""
    power = 1 << (world_size.bit_length() - 1)
    if rank >= power:
        return size_bytes
    sends = int(math.log2(power)) + (1 if rank + power < world_size else 0)
    return sends * size_bytes


def alpha_beta_seconds(collective: str, size_bytes: float, world_size: int, alpha: float,
                       beta: float) -> float:
    """The alpha-beta model (alpha = seconds per message, beta = seconds per byte).

    ring_all_reduce: 2(p-1) a + 2(p-1)/p S b;  ring_reduce_scatter / ring_all_gather:
    (p-1) a + (p-1)/p S b;  recursive_doubling (p a power of two): log2(p) (a + S b);
    tree_broadcast: ceil(log2 p) (a + S b).
    """
    p = world_size
    if collective == "ring_all_reduce":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * size_bytes * beta
    if collective in ("ring_reduce_scatter", "ring_all_gather"):
        return (p - 1) * alpha + (p - 1) / p * size_bytes * beta
    if collective == "recursive_doubling":
        return math.log2(p) * (alpha + size_bytes * beta)
    if collective == "tree_broadcast":
        return math.ceil(math.log2(p)) * (alpha + size_bytes * beta)
    raise ValueError(f"unknown collective {collective!r}")


BUS_FACTORS = {  # nccl-tests doc/PERFORMANCE.md
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
}


def bus_bandwidth(collective: str, size_bytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """nccl-tests definitions: algbw = S / t, busbw = algbw * factor (all-reduce: 2(p-1)/p).
    busbw is what each link carries, comparable to the link's per-direction peak. Bytes/s."""
    algbw = size_bytes / seconds
    return algbw, algbw * BUS_FACTORS[collective](world_size)


# ============================================================================ 6. the checks


def make_input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank `rank`'s input: deterministic in (seed, rank), so any process can rebuild it.
    Floats ~ N(0, 1); integers uniform in [-1000, 1000)."""
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
    for c, (start, end) in enumerate(chunk_bounds(numel, world)):
        acc = inputs[(c + 1) % world][start:end].clone()
        for hop in range(2, world + 1):
            acc = inputs[(c + hop) % world][start:end] + acc
        out[start:end] = acc
    return out


def float_tolerance(abs_sum: torch.Tensor, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """How far two float sums of the same p numbers may differ when added in different orders.

    Recursive summation of p terms errs by at most (p-1) u sum|x_i| (u = eps/2, the unit
    roundoff; Higham, Accuracy and Stability, eq. 4.4). Two orders can err in opposite
    directions: |ours - theirs| <= (p-1) * eps * sum|x_i|, element by element.
    """
    return (world_size - 1) * torch.finfo(dtype).eps * abs_sum


def compare(ours: torch.Tensor, theirs: torch.Tensor, tolerance: torch.Tensor | None) -> tuple[bool, str]:
    """Exact comparison (tolerance None) or element-wise |ours - theirs| <= tolerance."""
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False, f"shape/dtype {tuple(ours.shape)}/{ours.dtype} vs {tuple(theirs.shape)}/{theirs.dtype}"
    if ours.numel() == 0:
        return True, "empty"
    if tolerance is None:
        mismatches = int((ours != theirs).sum())
        return mismatches == 0, "exact" if mismatches == 0 else f"{mismatches} elements differ"
    error = (ours.double() - theirs.double()).abs()
    worst = float((error - tolerance.double()).max())
    max_error = float(error.max())
    return worst <= 0, f"max |diff| {max_error:.2e} within bound" if worst <= 0 else \
        f"max |diff| {max_error:.2e} exceeds the bound"


def torch_reduce_scatter(flat: torch.Tensor) -> torch.Tensor:
    """torch's reduce-scatter of a vector into `chunk_sizes` pieces. torch needs equal chunks,
    so uneven lengths use an all-reduce and keep our slice (same sums, torch's order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = chunk_bounds(flat.numel(), world)[rank]
    if flat.numel() % world == 0:
        out = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_single(out, flat.clone())
        return out
    total = flat.clone()
    dist.all_reduce(total)
    return total[start:end].clone()


def torch_all_gather(chunk: torch.Tensor, numel: int) -> torch.Tensor:
    """torch's all-gather of uneven chunks: equal chunks use all_gather_single; otherwise each
    rank places its chunk in zeros and torch all-reduces (x + 0 == x exactly)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if numel % world == 0:
        out = torch.empty(numel, dtype=chunk.dtype, device=chunk.device)
        dist.all_gather_single(out, chunk.contiguous())
        return out
    start, end = chunk_bounds(numel, world)[rank]
    out = torch.zeros(numel, dtype=chunk.dtype, device=chunk.device)
    out[start:end] = chunk
    dist.all_reduce(out)
    return out


def verify_collectives(numel: int, dtype: torch.dtype, seed: int,
                       device: torch.device) -> tuple[list[Check], dict]:
    """Run every collective once on this rank's input and check it. Returns (checks, metrics)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size_bytes = numel * itemsize
    x = make_input(rank, numel, dtype, seed).to(device)
    checks: list[Check] = []

    tolerance = None
    if dtype.is_floating_point and world > 2:  # 1 or 2 terms: every order gives the same sum
        abs_sum = x.double().abs()
        dist.all_reduce(abs_sum)
        tolerance = float_tolerance(abs_sum, world, dtype)

    # reduce-scatter, all-gather, all-reduce (ours, counted) vs torch
    traffic_rs, traffic_ag = Traffic(), Traffic()
    our_chunk = ring_reduce_scatter(x, traffic_rs)
    start, end = chunk_bounds(numel, world)[rank]
    ok, detail = compare(our_chunk, torch_reduce_scatter(x),
                         None if tolerance is None else tolerance[start:end])
    checks.append(Check("ring reduce-scatter == torch", ok, detail))

    ours_gathered = ring_all_gather(our_chunk, numel, traffic_ag)
    ok, detail = compare(ours_gathered, torch_all_gather(our_chunk, numel), None)
    checks.append(Check("ring all-gather == torch (exact: copies only)", ok, detail))

    traffic_ar = Traffic()
    ours_reduced = ring_all_reduce(x, traffic_ar)
    theirs_reduced = x.clone()
    dist.all_reduce(theirs_reduced)
    ok, detail = compare(ours_reduced, theirs_reduced, tolerance)
    checks.append(Check("ring all-reduce == torch all_reduce", ok, detail))

    inputs = [make_input(r, numel, dtype, seed).to(device) for r in range(world)]
    ok, detail = compare(ours_reduced, ring_order_sum(inputs), None)
    checks.append(Check("ring all-reduce == ring-order reference (bitwise)", ok, detail))

    raw = ours_reduced.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    digest = torch.tensor([int.from_bytes(hashlib.sha256(raw).digest()[:7], "little")],
                          dtype=torch.int64, device=device)
    lowest, highest = digest.clone(), digest.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    checks.append(Check("every rank holds identical all-reduce bytes", bool(lowest == highest),
                        "same hash on all ranks" if bool(lowest == highest) else "hashes differ"))

    expected = ring_bytes_sent(numel, itemsize, world, rank)
    counted = {"reduce_scatter": traffic_rs.bytes_sent, "all_gather": traffic_ag.bytes_sent,
               "all_reduce": traffic_ar.bytes_sent}
    checks.append(Check("ring bytes sent == formula", counted == expected,
                        f"all-reduce {counted['all_reduce']} B counted, {expected['all_reduce']} B "
                        f"formula; 2(p-1)/p*S = {ring_all_reduce_bytes_formula(size_bytes, world):g} B"))

    # binomial-tree broadcast from the last rank (exercises relative ranks)
    root = world - 1
    ours_bcast = x.clone()
    traffic_bc = Traffic()
    rounds = tree_broadcast(ours_bcast, root, traffic_bc)
    theirs_bcast = x.clone()
    dist.broadcast(theirs_bcast, root)
    ok, detail = compare(ours_bcast, theirs_bcast, None)
    checks.append(Check(f"tree broadcast from rank {root} == torch broadcast", ok, detail))
    bcast_expected = tree_broadcast_bytes_sent(size_bytes, world, root, rank)
    total_sent = torch.tensor([traffic_bc.bytes_sent], dtype=torch.int64, device=device)
    dist.all_reduce(total_sent)
    bcast_ok = (traffic_bc.bytes_sent == bcast_expected and int(total_sent) == (world - 1) * size_bytes
                and rounds == (math.ceil(math.log2(world)) if world > 1 else 0))
    checks.append(Check("tree broadcast bytes and rounds == formula", bcast_ok,
                        f"{rounds} rounds; {traffic_bc.bytes_sent} B sent here; "
                        f"{int(total_sent)} B in all = (p-1)*S"))

    # recursive doubling
    traffic_rd = Traffic()
    ours_doubling = recursive_doubling_all_reduce(x, traffic_rd)
    ok, detail = compare(ours_doubling, theirs_reduced, tolerance)
    checks.append(Check("recursive doubling == torch all_reduce", ok, detail))
    rd_expected = recursive_doubling_bytes_sent(size_bytes, world, rank)
    checks.append(Check("recursive doubling bytes sent == formula",
                        traffic_rd.bytes_sent == rd_expected,
                        f"{traffic_rd.bytes_sent} B counted, {rd_expected} B formula"))

    metrics = {"bytes_sent": counted["all_reduce"], "bytes_expected": expected["all_reduce"]}
    return checks, metrics


def verify_worker(ctx: RankContext, numel: int, dtype_name: str, seed: int, fault: str | None,
                  fault_rank: int) -> dict:
    """One rank of the demo: the main checks at `numel`, then edge lengths in int64."""
    inject_fault(ctx, fault, fault_rank)
    checks, metrics = verify_collectives(numel, DTYPES[dtype_name], seed, ctx.device)
    world = ctx.world_size
    edge_lengths = sorted({0, 1, max(world - 1, 0), world + 1, 2 * world + 3})
    edge_failures = []
    for length in edge_lengths:
        edge_checks, _ = verify_collectives(length, torch.int64, seed + 1, ctx.device)
        edge_failures += [f"numel={length}: {c.name}" for c in edge_checks if not c.passed]
    checks.append(Check(f"edge lengths {edge_lengths} (int64, every check above)",
                        not edge_failures, "; ".join(edge_failures) or "all exact"))
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


# ============================================================================ 7. the benchmark


def time_side_by_side(runs: dict, device: torch.device, min_seconds: float,
                      max_rounds: int = 30) -> dict[str, float]:
    """Median seconds of each callable in `runs`, measured in alternation (round after round
    of ours, theirs, ours, ...), so that both see the same machine load. Each timing starts
    after a barrier and is the MAX over ranks: a collective is as slow as its slowest rank."""
    def once(run) -> float:
        dist.barrier()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                               device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for run in runs.values():  # warm-up: connections, allocator
        once(run)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    while True:
        for name, run in runs.items():
            samples[name].append(once(run))
        rounds = len(samples[next(iter(runs))])
        spent = sum(sum(values) for values in samples.values())
        if rounds >= max_rounds or (rounds >= 5 and spent >= min_seconds):
            break
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_worker(ctx: RankContext, sizes_bytes: list[int], min_seconds: float) -> dict:
    """Time our ring all-reduce and torch's all_reduce on float32 vectors of each size.
    Both include one copy of the input (ours clones internally; torch works in place)."""
    rows = []
    world = ctx.world_size
    for size in sizes_bytes:
        x = torch.randn(size // 4, device=ctx.device)
        times = time_side_by_side({"ours": lambda x=x: ring_all_reduce(x),
                                   "torch": lambda x=x: dist.all_reduce(x.clone())},
                                  ctx.device, min_seconds)
        rows.append({"bytes": size, "ours_s": times["ours"], "torch_s": times["torch"],
                     "ours_busbw": bus_bandwidth("all_reduce", size, times["ours"], world)[1],
                     "torch_busbw": bus_bandwidth("all_reduce", size, times["torch"], world)[1]})
    return {"rows": rows}


def fit_alpha_beta(rows: list[dict], world_size: int, key: str = "ours_s") -> tuple[float, float]:
    """Least-squares fit of t = 2(p-1) alpha + 2(p-1)/p S beta to measured ring all-reduce
    times. Returns (alpha seconds, beta seconds per byte)."""
    p = world_size
    design = torch.tensor([[2.0 * (p - 1), 2.0 * (p - 1) / p * row["bytes"]] for row in rows],
                          dtype=torch.float64)
    times = torch.tensor([[row[key]] for row in rows], dtype=torch.float64)
    alpha, beta = torch.linalg.lstsq(design, times).solution.flatten().tolist()
    return alpha, beta


def print_bench(rows: list[dict], world_size: int, alpha: float, beta: float) -> None:
    print(f"\nring all-reduce vs torch.distributed.all_reduce, {world_size} ranks, float32")
    print(f"{'size':>9} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} {'busbw ours':>11} "
          f"{'busbw torch':>11} {'model ms':>9}")
    for row in rows:
        model = alpha_beta_seconds("ring_all_reduce", row["bytes"], world_size, alpha, beta)
        print(f"{_human(row['bytes']):>9} {row['ours_s'] * 1e3:9.3f} {row['torch_s'] * 1e3:9.3f} "
              f"{row['ours_s'] / row['torch_s']:10.2f} {row['ours_busbw'] / 1e9:8.2f} GB/s "
              f"{row['torch_busbw'] / 1e9:8.2f} GB/s {model * 1e3:9.3f}")
    print(f"fitted alpha = {alpha * 1e6:.1f} us per message, 1/beta = {1 / beta / 1e9:.2f} GB/s")


def _human(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Collectives from point-to-point messages, checked against "
                           "torch.distributed.")
    parser.add_argument("--numel", type=int_in(0, 1 << 28), default=4096,
                        help="elements per rank for the checks (default 4096)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--bench", action="store_true",
                        help="time ours vs torch all_reduce, 4 KiB to 64 MiB (--quick: to 1 MiB)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results = launch(verify_worker, args.world_size,
                     (args.numel, args.dtype, args.seed, args.fault, args.fault_rank),
                     device=args.device, timeout_s=args.timeout)
    world = len(results)
    checks = merge_rank_checks([r["checks"] for r in results])
    itemsize = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    size_bytes = args.numel * itemsize
    metrics = {
        "numel": args.numel, "dtype": args.dtype, "size_bytes": size_bytes,
        "bytes_sent_per_rank": [r["metrics"]["bytes_sent"] for r in results],
        "bytes_formula": ring_all_reduce_bytes_formula(size_bytes, world),
        "bytes_formula_exact_per_rank": [r["metrics"]["bytes_expected"] for r in results],
    }
    device, backend = choose_device(args.device, world)
    if args.bench:
        top = 20 if args.quick else 26  # 1 MiB or 64 MiB
        sizes = [1 << exponent for exponent in range(12, top + 1, 2)]
        bench = launch(bench_worker, args.world_size, (sizes, 0.2 if args.quick else 2.0),
                       device=args.device, timeout_s=max(args.timeout, 600.0))[0]["rows"]
        alpha, beta = fit_alpha_beta(bench, world)
        if is_reporting_rank():
            print_bench(bench, world, alpha, beta)
        metrics["bench"] = bench
        metrics["alpha_us"] = alpha * 1e6
        metrics["beta_gbps"] = 1 / beta / 1e9 if beta > 0 else None
        ratio_16 = [row["ours_s"] / row["torch_s"] for row in bench if row["bytes"] == 16 << 20]
        metrics["ratio_ours_torch_16MiB"] = ratio_16[0] if ratio_16 else None
    metrics["headline"] = (f"ring all-reduce: {metrics['bytes_sent_per_rank'][0]} B sent by rank 0 "
                           f"(2(p-1)/p*S = {metrics['bytes_formula']:g} B)")
    report = Report(LESSON, device, backend, world, checks, metrics)
    return finish(report, args.json, started)


if __name__ == "__main__":
    run_main(main)
