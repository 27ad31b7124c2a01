"""Lesson 11, part 2: Ulysses (DeepSpeed), the other way to split attention's sequence.

Ring attention (main.py) moves the keys past the queries. Ulysses changes what is split
instead: one all-to-all turns q, k, v from sequence shards (all H heads, seq / cp positions)
into head shards (H / cp heads, every position); each rank runs ordinary attention for its head
group (main.py's `blockwise_attention`, masked by the gathered positions, so either layout
works); one all-to-all turns the output back. In the order a learner meets it:

1. the all-to-all of equal row blocks (lesson 01's, or torch's `all_to_all_single`) and the
   head-count refusal (heads must divide by cp);
2. `seq_to_heads` and `heads_to_seq`, each the other's inverse and backward (`SequenceToHeads`);
3. `ulysses_attention`, this rank's shard in, this rank's shard out;
4. its cost: four all-to-alls each way, (cp - 1) / cp of a shard each, bounded whatever cp is.

The proof is in checks.py: `python lessons/11_context_parallel/main.py --variant ulysses`.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from . import main as context_parallel  # this lesson's blockwise attention, layouts, shard bytes

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique

# ============================================================================ 1. the all-to-all


def check_heads(heads: int, cp: int) -> None:
    """Ulysses gives each rank heads / cp whole heads: refuse a count that does not divide."""
    if heads % cp:
        raise ValueError(f"Ulysses needs heads divisible by cp: {heads} heads on {cp} ranks")


def all_to_all_rows(send: torch.Tensor, engine: str, traffic: collectives.Traffic) -> torch.Tensor:
    """Equal blocks of dim 0, block j to rank j, received blocks stacked by source rank:
    lesson 01's `all_to_all` built from point-to-point ("p2p", bytes counted) or torch's
    `dist.all_to_all_single` ("torch")."""
    cp = dist.get_world_size()
    counts = [send.shape[0] // cp] * cp
    if engine == "p2p":
        return collectives.all_to_all(send, counts, counts, traffic)
    send = send.contiguous()
    out = torch.empty_like(send, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, send, counts, counts)
    return out


# ============================================================================ 2. shards of heads


# exercise ulysses (4 points): Ulysses: sequence shards to head shards and back
# hint: heads to seq: head group j of every local position goes to rank j, so send (H, n, d)
#   as cp blocks of H / cp heads; what arrives is (cp, H / cp, n, d) by source rank: put the
#   source ranks' positions one after the other. seq to heads is the inverse, and each is the
#   other's backward.
def seq_to_heads(x: torch.Tensor, engine: str, traffic: collectives.Traffic) -> torch.Tensor:
    """(H, n, d) sequence-sharded -> (H / cp, cp n, d): this rank's head group over every
    position, ordered by source rank (rank i's n positions, then rank i + 1's). One
    all-to-all: (cp - 1) / cp of x's bytes leave the rank."""
    cp = dist.get_world_size()
    heads, n, d = x.shape
    received = all_to_all_rows(x.contiguous(), engine, traffic)
    return received.reshape(cp, heads // cp, n, d).transpose(0, 1).reshape(heads // cp, cp * n, d)


# exercise ulysses (continued)
def heads_to_seq(y: torch.Tensor, engine: str, traffic: collectives.Traffic) -> torch.Tensor:
    """The inverse of `seq_to_heads`: (H / cp, cp n, d) -> (H, n, d), heads in order."""
    cp = dist.get_world_size()
    group, length, d = y.shape
    send = y.reshape(group, cp, length // cp, d).transpose(0, 1).reshape(cp * group, length // cp, d)
    return all_to_all_rows(send, engine, traffic)


class SequenceToHeads(torch.autograd.Function):
    """`seq_to_heads` forward, `heads_to_seq` of the gradient backward (and inverse=True the
    other way round): an all-to-all's adjoint is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, inverse: bool, engine: str, traffic):
        ctx.inverse, ctx.engine, ctx.traffic = inverse, engine, traffic
        return (heads_to_seq if inverse else seq_to_heads)(x, engine, traffic)

    @staticmethod
    def backward(ctx, grad):
        undo = seq_to_heads if ctx.inverse else heads_to_seq
        return undo(grad, ctx.engine, ctx.traffic), None, None, None


# ============================================================================ 3. the attention


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: int,
                      causal: bool = True, layout: str = "zigzag", engine: str = "p2p",
                      traffic: collectives.Traffic | None = None, block: int = 64) -> torch.Tensor:
    """DeepSpeed-Ulysses on this rank's shard q, k, v (H, seq / cp, d) -> out (H, seq / cp, d).
    Three all-to-alls to head shards, `blockwise_attention` over the full sequence (the mask
    from the gathered positions, so any layout works), one all-to-all back; backward the four
    reversed. Bytes per rank: 4 (cp - 1) / cp B forward, the same backward (B as in
    main.py's `RingAttention`). heads % cp != 0: ValueError."""
    cp, traffic = dist.get_world_size(), traffic if traffic is not None else collectives.Traffic()
    check_heads(q.shape[0], cp)
    positions = torch.cat([context_parallel.sequence_positions(seq, cp, r, layout)
                           for r in range(cp)]).to(q.device)
    qh, kh, vh = (SequenceToHeads.apply(t, False, engine, traffic) for t in (q, k, v))
    out = context_parallel.blockwise_attention(qh, kh, vh, causal, block, positions, positions)
    return SequenceToHeads.apply(out, True, engine, traffic)



# ============================================================================ 4. the cost


def ulysses_bytes_per_rank(seq: int, heads: int, head_dim: int, cp: int,
                           itemsize: int) -> context_parallel.Bytes:
    """Ulysses, bytes one rank sends: four all-to-alls each way, (cp - 1) / cp B each:
    4 (cp - 1) / cp B forward and backward. Bounded by 4 B whatever cp is, where the ring's
    2 (cp - 1) B forward grows with cp (`ring_bytes_per_rank`): cp / 2 times Ulysses's."""
    b = context_parallel.shard_bytes(seq, heads, head_dim, cp, itemsize)
    return context_parallel.Bytes(4 * (cp - 1) * b // cp, 4 * (cp - 1) * b // cp)
