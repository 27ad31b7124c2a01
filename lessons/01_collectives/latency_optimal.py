"""Lesson 01, part 2: collectives in log2 p rounds, for when latency dominates.

The ring of main.py is bandwidth-optimal (each rank sends below 2S) but pays 2(p-1)
latencies. For small messages or many ranks the alpha term wins, and libraries switch to
algorithms whose number of rounds grows like log2 p, paying with bytes:

1. Binomial-tree broadcast: the set of ranks holding the data doubles every round.
2. Recursive doubling all-reduce: in round k, rank r swaps its whole partial sum with rank
   r XOR 2^k; ranks above the largest power of two fold in first.
3. Their exact byte counts (the alpha-beta times are `alpha_beta_seconds` in main.py).

Both communicate only through main.py's `exchange`, so they are NCCL-safe by construction,
and both take `group=None` like main.py's collectives (ranks are then ranks in the group).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .main import Group, Traffic, exchange

# ============================================================================ 1. tree broadcast


# exercise tree-broadcast (3 points): Binomial-tree broadcast
# hint: relative ranks make every root look like rank 0; turn a relative rank back into a
#   real one by adding root (mod p). A rank receives exactly once: in the round k with
#   2^k <= v < 2^(k+1). Each round is one `exchange` (a send, a receive, or nothing).
def tree_broadcast(tensor: torch.Tensor, root: int, traffic: Traffic | None = None, *,
                   group: Group = None) -> int:
    """Binomial-tree broadcast of `tensor` (any shape, contiguous; the same shape and dtype on
    every rank) from `root`, in place: afterwards every rank's `tensor` holds the root's
    values. Returns the number of rounds, ceil(log2 p) on every rank (0 when p = 1). Over the
    p ranks of `group` (None: all), called by them only; `root` and rank r are ranks in it, as
    dist.broadcast(tensor, group=group, group_src=root) counts them.

    With relative rank v = (rank - root) mod p, in round k (k = 0, 1, ...) every rank with
    v < 2^k already has the data and sends it to v + 2^k (if that exists). The set of ranks
    holding the data doubles each round: ceil(log2 p) rounds, p-1 messages of S bytes in all.
    Every message goes through `exchange(..., traffic)`: the root sends ceil(log2 p) * S
    bytes, rank r `tree_broadcast_bytes_sent(S, p, root, r)`. Time: ceil(log2 p) *
    (alpha + S * beta).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    relative = (rank - root) % world
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    for k in range(rounds):
        span = 1 << k
        if relative < span and relative + span < world:
            exchange([(tensor, (relative + span + root) % world)], [], traffic, group=group)
        elif span <= relative < 2 * span:
            exchange([], [(tensor, (relative - span + root) % world)], traffic, group=group)
    return rounds


# ============================================================================ 2. recursive doubling


def recursive_doubling_all_reduce(tensor: torch.Tensor, traffic: Traffic | None = None, *,
                                  group: Group = None) -> torch.Tensor:
    """All-reduce (sum) over `group` by recursive doubling: in round k, rank r swaps its whole
    partial sum with rank r XOR 2^k and adds. log2(p) rounds when p is a power of two.

    Other p: with q = the largest power of two <= p, ranks q..p-1 first fold their data into
    ranks 0..p-q-1, the q ranks double, and the result is sent back. Every rank ends with
    bitwise-identical sums (a + b == b + a in IEEE arithmetic). Bytes per rank: log2(q) * S
    (+ S on a rank that folds or is folded into): latency-optimal, not bandwidth-optimal.
    Time (p a power of two): log2(p) * (alpha + S * beta). Returns a new tensor.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.reshape(-1).clone()
    power = 1 << (world.bit_length() - 1)
    partner_buffer = torch.empty_like(flat)
    if rank >= power:  # fold into rank - power, then wait for the answer
        exchange([(flat, rank - power)], [], traffic, group=group)
        exchange([], [(flat, rank - power)], traffic, group=group)
        return flat.reshape(tensor.shape)
    if rank + power < world:
        exchange([], [(partner_buffer, rank + power)], traffic, group=group)
        flat += partner_buffer
    span = 1
    while span < power:
        exchange([(flat, rank ^ span)], [(partner_buffer, rank ^ span)], traffic, group=group)
        flat += partner_buffer
        span <<= 1
    if rank + power < world:
        exchange([(flat, rank + power)], [], traffic, group=group)
    return flat.reshape(tensor.shape)


# ============================================================================ 3. their bytes


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
