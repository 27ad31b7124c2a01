"""Lesson 01: collective operations, built from point-to-point messages.

main.py, the bandwidth-optimal ring and what later lessons build on:
1. Chunks: a vector of S bytes in p pieces whose sizes differ by at most one element.
2. `exchange`, our one primitive: a step's sends and receives posted as one group (no ring
   can deadlock, on NCCL either); `Traffic` counts every byte a rank sends. Every function
   takes `group=None` as torch.distributed does: ranks are then ranks in that group.
3. The plain ring: reduce-scatter, all-gather, and all-reduce as their composition:
   2(p-1)/p * S bytes per rank (below 2S whatever p is), but 2(p-1) latencies.
4. The segmented ring, an optimisation: add piece i of a chunk while piece i+1 arrives.
5. All-to-all: block j of rank r's rows goes to rank j (Ulysses attention, MoE dispatch).
6. The formulas: bytes per rank, alpha-beta time, nccl-tests' algbw and busbw.
Then latency_optimal.py: binomial-tree broadcast and recursive doubling, log2 p latencies
for more bytes, and their byte counts.

The proof (every result against torch.distributed) is in checks.py, the benchmark in
bench.py. Run: `python lessons/01_collectives/main.py --world-size 5 --numel 1000`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

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
    sizes = chunk_sizes(numel, world_size)
    starts = [sum(sizes[:index]) for index in range(world_size)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


# ============================================================================ 2. the exchange


class Traffic:
    """Counts what this rank sends: bytes and messages (a message of 0 elements is not sent)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.messages = 0

    def record(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages += 1


Peers = list[tuple[torch.Tensor, int]]  # (tensor, peer rank) pairs
Group = dist.ProcessGroup | None  # a process group; None is the default group (every rank)


def start_exchange(sends: Peers, recvs: Peers, traffic: Traffic | None = None, *,
                   group: Group = None) -> list:
    """Post every send (tensor to rank) and receive (into tensor from rank) as ONE group
    (`dist.batch_isend_irecv`) and return its requests, not yet waited on. Peers are ranks in
    `group` (`dist.P2POp`'s group_peer; the global rank is dist.get_global_rank(group, peer)).

    One group is what makes a ring safe: if every rank first blocked in its send, nobody would
    reach its receive; NCCL, which runs a rank's sends and receives on one stream, needs them
    in one group to progress together. Empty tensors are skipped: both sides compute the same
    sizes, so they skip the same messages. Messages between two ranks in one direction match
    in posting order (NCCL ignores tags). Tensors must be contiguous, on the rank's device.
    """
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends if t.numel()]
    for op in ops if traffic is not None else []:
        traffic.record(op.tensor)
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs if t.numel()]
    return dist.batch_isend_irecv(ops) if ops else []


def exchange(sends: Peers, recvs: Peers, traffic: Traffic | None = None, *,
             group: Group = None) -> None:
    """`start_exchange`, then wait for every request: when it returns, every receive buffer
    holds its message. Cost of a step: alpha + n * beta for its largest message of n bytes."""
    for request in start_exchange(sends, recvs, traffic, group=group):
        request.wait()


# ============================================================================ 3. the plain ring


def ring_schedule(numel: int, world_size: int, rank: int, shift: int) -> list[tuple[slice, slice]]:
    """The ring's p-1 steps for rank r: at step s it sends chunk (r - s - shift) mod p to its
    right neighbour and receives chunk (r - s - shift - 1) mod p from its left one, as
    (send slice, receive slice) of the flat vector. Reduce-scatter uses shift 1, all-gather 0.
    What rank r receives at step s is what rank r-1 sends at step s: the chunks rotate."""
    bounds = chunk_bounds(numel, world_size)
    return [(slice(*bounds[(rank - step - shift) % world_size]),
             slice(*bounds[(rank - step - shift - 1) % world_size]))
            for step in range(world_size - 1)]


# exercise ring-reduce-scatter (3 points): Ring reduce-scatter
# hint: work on a flat copy; for each (send, recv) of ring_schedule(S, p, rank, shift=1),
#   exchange flat[send] to the right and a buffer from the left, then add the buffer into
#   flat[recv]; return a copy of chunk `rank` (chunk_bounds).
def ring_reduce_scatter(tensor: torch.Tensor, traffic: Traffic | None = None, *,
                        group: Group = None) -> torch.Tensor:
    """Sum `tensor` (same shape on every rank, flattened to S elements) across the p ranks of
    `group` and return this rank's chunk `rank` of the sum, a new 1-D tensor of
    chunk_sizes(S, p)[rank] elements (empty when S < p leaves it none), of `tensor`'s dtype
    and device. Only the group's ranks call it; p and `rank` are its size and our rank in it.

    p-1 steps (`ring_schedule`, shift 1): send one partial-sum chunk right (rank r+1 mod p),
    receive one from the left (rank r-1 mod p) and add it into our copy. Chunk c's partial
    sum starts on rank c+1 and travels once round the ring, gaining one term per hop, so it
    ends on rank c as x_c + (x_{c-1} + (... + x_{c+1})), bit for bit (`ring_order_sum` in
    checks.py adds in that order). Every message goes through `exchange(..., traffic)`, so
    `traffic` (when given) counts the bytes sent: S - |chunk r| = (p-1)/p * S when p divides
    S. Time: (p-1) alpha + (p-1)/p * S * beta. `tensor` is unchanged. p = 1: a copy.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.reshape(-1).clone()
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty(max(chunk_sizes(flat.numel(), world)), dtype=flat.dtype,
                           device=flat.device)
    for send, recv in ring_schedule(flat.numel(), world, rank, shift=1):
        received = incoming[: recv.stop - recv.start]
        exchange([(flat[send], right)], [(received, left)], traffic, group=group)
        flat[recv] += received  # the whole chunk has arrived: add it
    start, end = chunk_bounds(flat.numel(), world)[rank]
    return flat[start:end].clone()


# exercise ring-all-gather (3 points): Ring all-gather
# hint: check the chunk's size first (before any message); place it at chunk_bounds(numel,
#   p)[rank] of a new length-numel vector, then for each (send, recv) of ring_schedule(numel,
#   p, rank, shift=0) send out[send] to the right and receive out[recv] from the left.
def ring_all_gather(chunk: torch.Tensor, numel: int, traffic: Traffic | None = None, *,
                    group: Group = None) -> torch.Tensor:
    """Every rank of `group` (p, `rank`: as in `ring_reduce_scatter`) contributes `chunk` (its
    chunk `rank` of a length-`numel` vector, any shape with chunk_sizes(numel, p)[rank]
    elements; otherwise raise ValueError, before sending anything, with a message naming the
    rank: "rank 2: chunk has ..."); every rank returns
    the whole vector, a new 1-D tensor of `numel` elements of `chunk`'s dtype and device, chunk i at
    chunk_bounds(numel, p)[i]. `chunk` is unchanged.

    p-1 steps (`ring_schedule`, shift 0): forward the chunk received last step to the right,
    receive the next one from the left straight into place. Copies only, so the result is the
    same bits on every rank. Every message goes through `exchange(..., traffic)`; bytes sent:
    S - |chunk r+1| = (p-1)/p * S when p divides S. Time: (p-1) alpha + (p-1)/p * S * beta.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start, end = chunk_bounds(numel, world)[rank]
    if chunk.numel() != end - start:
        raise ValueError(f"rank {dist.get_rank()}: chunk has {chunk.numel()} elements, expected "
                         f"{end - start} for numel={numel} over {world} ranks")
    out = torch.empty(numel, dtype=chunk.dtype, device=chunk.device)
    out[start:end] = chunk.reshape(-1)
    right, left = (rank + 1) % world, (rank - 1) % world
    for send, recv in ring_schedule(numel, world, rank, shift=0):
        exchange([(out[send], right)], [(out[recv], left)], traffic, group=group)
    return out


# exercise ring-all-reduce (2 points): Ring all-reduce = reduce-scatter + all-gather
# hint: two calls, with the same `traffic`, then give the result `tensor`'s shape back.
def ring_all_reduce(tensor: torch.Tensor, traffic: Traffic | None = None, *,
                    group: Group = None) -> torch.Tensor:
    """All-reduce (sum) = `ring_reduce_scatter`, then `ring_all_gather` of the reduced chunks
    (both over `group`). Returns a new tensor of `tensor`'s shape and dtype holding the
    element-wise sum over ranks (in the ring's order: the same bits as `ring_order_sum`), the
    same bits on every rank; `tensor` is unchanged (dist.all_reduce works in place; both sum,
    and averaging is the caller's job). `traffic` counts both phases' bytes. 2(p-1) steps of
    S/p bytes: each rank sends 2(p-1)/p * S bytes, bounded by 2S and almost independent of p
    (bandwidth-optimal). But the time 2(p-1) alpha + 2(p-1)/p * S * beta has a latency term
    that grows linearly with p.
    """
    reduced_chunk = ring_reduce_scatter(tensor, traffic, group=group)
    gathered = ring_all_gather(reduced_chunk, tensor.numel(), traffic, group=group)
    return gathered.reshape(tensor.shape)


# ============================================================================ 4. the segmented ring

SEGMENT_ELEMS = 1 << 18  # 1 MiB of float32 per message (gloo's ring uses 1 MiB segments too)


def exchange_segments(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                      traffic: Traffic | None = None, segment_elems: int = SEGMENT_ELEMS, *,
                      group: Group = None):
    """`exchange` of one 1-D send and one 1-D receive, cut into pieces of `segment_elems`
    elements: a generator that yields the slice of `recv` that just arrived, in order, while
    the next piece is already in flight (two groups in flight at a time, each one piece's send
    and receive, so it is as NCCL-safe as `exchange`).

    What it buys: the caller adds piece i while piece i+1 crosses the wire, so within one
    ring step the reduction overlaps the reception instead of following it. Bytes sent are
    the same; messages per step go from 1 to ceil(n / segment_elems).
    """
    def start(i: int) -> list:  # piece i of both; a piece past a tensor's end is empty: skipped
        piece = slice(i * segment_elems, (i + 1) * segment_elems)
        return start_exchange([(send[piece], dst)], [(recv[piece], src)], traffic, group=group)

    count = math.ceil(max(send.numel(), recv.numel()) / segment_elems)
    in_flight = start(0)
    for i in range(count):
        following = start(i + 1) if i + 1 < count else []
        for request in in_flight:
            request.wait()
        yield slice(i * segment_elems, (i + 1) * segment_elems)  # added while i+1 arrives
        in_flight = following


def segmented_ring_reduce_scatter(tensor: torch.Tensor, traffic: Traffic | None = None,
                                  segment_elems: int = SEGMENT_ELEMS, *,
                                  group: Group = None) -> torch.Tensor:
    """`ring_reduce_scatter` with each step's chunk sent in pieces (`exchange_segments`), the
    add of one piece overlapping the reception of the next. Same result bit for bit (the same
    additions in the same order), same bytes. It is not NCCL's pipelining, which also
    overlaps successive ring steps: here step s+1 starts when step s has finished."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.reshape(-1).clone()
    incoming = torch.empty_like(flat[: max(chunk_sizes(flat.numel(), world))])
    for send, recv in ring_schedule(flat.numel(), world, rank, shift=1):
        received, target = incoming[: recv.stop - recv.start], flat[recv]
        for piece in exchange_segments(flat[send], (rank + 1) % world, received,
                                       (rank - 1) % world, traffic, segment_elems, group=group):
            target[piece] += received[piece]
    start, end = chunk_bounds(flat.numel(), world)[rank]
    return flat[start:end].clone()


# ============================================================================ 5. all-to-all


# exercise all-to-all (4 points): All-to-all with uneven, unknown counts
# hint: validate the counts first; Tensor.split cuts `send` (and a new output) into blocks by
#   the counts; copy your own block locally and post every other block in ONE `exchange`
#   (block j to rank j, block i of the output from rank i). Unknown recv_counts: first an
#   all_to_all of one int64 count per rank.
def all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None,
               traffic: Traffic | None = None, *, group: Group = None) -> torch.Tensor:
    """Personalised exchange: rank r's rows are grouped by destination, and rank j receives
    block j of every rank, stacked in source-rank order (ranks and p: those of `group`).

    send: (sum(send_counts), *trailing), rows [o_j, o_j + send_counts[j]) go to rank j
    (o_j = sum of the counts before j); counts may be uneven or zero. Returns a new tensor
    (sum(recv_counts), *trailing) of send's dtype: recv_counts[i] rows from rank i, in rank
    order; `send` is unchanged. dtype and trailing shape must be equal on every rank.
    send_counts that are not p counts >= 0 summing to send.shape[0]: ValueError naming the
    rank ("rank 1: ..."), before any message. recv_counts None (the receiver does not know
    them, as in mixture-of-experts dispatch): they are exchanged first, an all-to-all of one
    int64 per pair. Same result as dist.all_to_all_single(out, send, recv_counts, send_counts).
    Own block: a local copy; the rest: one group of up to 2(p-1) messages. Bytes sent: sum
    over j != r of send_counts[j] * row bytes; with equal blocks of a send buffer of S bytes,
    (p-1)/p * S. Time: (p-1) alpha + (p-1)/p * S * beta (p-1 messages over the rank's link).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if len(send_counts) != world or min(send_counts) < 0 or sum(send_counts) != send.shape[0]:
        raise ValueError(f"rank {dist.get_rank()}: send_counts {send_counts} must be {world} counts >= 0 "
                         f"summing to send.shape[0] = {send.shape[0]}")
    if recv_counts is None:
        counts = torch.tensor(send_counts, dtype=torch.int64, device=send.device)
        recv_counts = all_to_all(counts, [1] * world, [1] * world, traffic, group=group).tolist()
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    blocks_out = send.contiguous().split(send_counts)
    blocks_in = out.split(recv_counts)
    blocks_in[rank].copy_(blocks_out[rank])
    others = [peer for peer in range(world) if peer != rank]
    exchange([(blocks_out[peer], peer) for peer in others],
             [(blocks_in[peer], peer) for peer in others], traffic, group=group)
    return out


# ============================================================================ 6. the formulas


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
    """Each rank sends 2(p-1)/p * S bytes in a ring all-reduce of S bytes: below 2S for
    every p (1.5 S at p = 4, 1.97 S at p = 64)."""
    return 2 * (world_size - 1) / world_size * size_bytes


def all_to_all_bytes_sent(send_counts: list[int], row_bytes: int, rank: int,
                          counts_exchanged: bool = False) -> int:
    """Bytes rank `rank` sends in `all_to_all`: every block but its own, plus 8 bytes to each
    other rank when the counts are exchanged first. Equal blocks of S bytes: (p-1)/p * S."""
    world = len(send_counts)
    payload = sum(count for peer, count in enumerate(send_counts) if peer != rank) * row_bytes
    return payload + (8 * (world - 1) if counts_exchanged else 0)


def alpha_beta_seconds(collective: str, size_bytes: float, world_size: int, alpha: float,
                       beta: float) -> float:
    """The alpha-beta model (alpha = seconds per message, beta = seconds per byte).

    ring_all_reduce: 2(p-1) a + 2(p-1)/p S b;  ring_reduce_scatter / ring_all_gather /
    all_to_all: (p-1) a + (p-1)/p S b;  and latency_optimal.py's recursive_doubling (p a
    power of two): log2(p) (a + S b);  tree_broadcast: ceil(log2 p) (a + S b).
    """
    p = world_size
    if collective == "ring_all_reduce":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * size_bytes * beta
    if collective in ("ring_reduce_scatter", "ring_all_gather", "all_to_all"):
        return (p - 1) * alpha + (p - 1) / p * size_bytes * beta
    if collective == "recursive_doubling":
        return math.log2(p) * (alpha + size_bytes * beta)
    if collective == "tree_broadcast":
        return math.ceil(math.log2(p)) * (alpha + size_bytes * beta)
    raise ValueError(f"unknown collective {collective!r}")


BUS_FACTORS = {"all_reduce": lambda p: 2 * (p - 1) / p, "broadcast": lambda p: 1.0,  # nccl-tests
               **dict.fromkeys(("reduce_scatter", "all_gather", "all_to_all"), lambda p: (p - 1) / p)}


def bus_bandwidth(collective: str, size_bytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """nccl-tests' definitions, in bytes/s: algbw = S / t, busbw = algbw * factor (all-reduce
    2(p-1)/p; reduce-scatter, all-gather, all-to-all (p-1)/p; broadcast 1). S is the size
    nccl-tests prints: the whole vector for reduce-scatter (its input) and all-gather (its
    output), not one rank's chunk; a rank's whole send buffer for all-to-all. busbw is what
    each rank's link carried, comparable to its per-direction peak whatever p is."""
    algbw = size_bytes / seconds
    return algbw, algbw * BUS_FACTORS[collective](world_size)


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
