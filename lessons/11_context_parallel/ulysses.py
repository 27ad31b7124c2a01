"""Lesson 11, part 4: Ulysses (DeepSpeed), the other way to split attention's sequence.

Ring attention (main.py) moves the keys past the queries. Ulysses changes what is split
instead: one all-to-all turns q, k, v from sequence shards (all H heads, seq / cp positions)
into head shards (H / cp heads, every position); each rank runs ordinary attention for its head
group (blockwise.py's `blockwise_attention`, masked by the gathered positions, so either layout
works); one all-to-all turns the output back. In the order a learner meets it:

1. the all-to-all of equal row blocks over a group (lesson 01's grouped `exchange`, or torch's
   `all_to_all_single`) and the head-count refusal;
2. `seq_to_heads` and `heads_to_seq`, each the other's inverse and backward (`SequenceToHeads`);
3. `ulysses_attention`, this rank's shard in, this rank's shard out; with grouped-query
   attention the K/V heads split too, or are replicated when cp exceeds their count;
4. its cost: four all-to-alls each way, (cp - 1) / cp of a shard each, bounded whatever cp is.

The proof is in checks.py: `python lessons/11_context_parallel/main.py --variant ulysses`.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from . import blockwise  # attention by blocks
from . import main as context_parallel  # this lesson's layouts and shard bytes

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique

# ============================================================================ 1. the all-to-all


def check_heads(heads: int, kv_heads: int, cp: int) -> None:
    """Ulysses gives each rank heads / cp whole query heads and kv_heads / cp K/V heads, or one
    K/V head replicated when cp is a multiple of kv_heads (DeepSpeed's UlyssesSPAttentionHF);
    refuse the counts that do not split so. The limit is the query heads."""
    if heads % cp or heads % kv_heads or (kv_heads % cp and cp % kv_heads):
        raise ValueError(f"Ulysses needs heads divisible by cp, and kv heads dividing heads and "
                         f"divisible by cp (or dividing it): {heads} heads, {kv_heads} kv heads, "
                         f"{cp} ranks")


def all_to_all_rows(send: torch.Tensor, engine: str, traffic: collectives.Traffic,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Equal blocks of dim 0, block j to rank j of `group` (None: the default group), received
    blocks stacked by source rank: from lesson 01's grouped point-to-point `exchange` ("p2p",
    bytes counted, every message in one group) or torch's `dist.all_to_all_single` ("torch")."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    send = send.contiguous()
    out = torch.empty_like(send, memory_format=torch.contiguous_format)
    if engine != "p2p":
        dist.all_to_all_single(out, send, group=group)
        return out
    mine, theirs = send.chunk(cp), out.chunk(cp)
    theirs[rank].copy_(mine[rank])
    peers = {j: j if group is None else dist.get_global_rank(group, j) for j in range(cp) if j != rank}
    collectives.exchange([(mine[j], peer) for j, peer in peers.items()],
                         [(theirs[j], peer) for j, peer in peers.items()], traffic)
    return out


# ============================================================================ 2. shards of heads


# exercise ulysses (4 points): Ulysses: sequence shards to head shards and back
# hint: heads to seq: head group j of every local position goes to rank j of `group`, so send
#   (H, n, d) as cp blocks of H / cp heads; what arrives is (cp, H / cp, n, d) by source rank:
#   put the source ranks' positions one after the other. seq to heads is the inverse, and each
#   is the other's backward. cp is the size of `group`, not of the world.
def seq_to_heads(x: torch.Tensor, engine: str, traffic: collectives.Traffic,
                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(H, n, d) sequence-sharded over the cp ranks of `group` -> (H / cp, cp n, d): this rank's
    head group over every position, ordered by source rank (rank i's n positions, then rank
    i + 1's). One all-to-all_rows: (cp - 1) / cp of x's bytes leave the rank."""
    cp = dist.get_world_size(group)
    heads, n, d = x.shape
    received = all_to_all_rows(x, engine, traffic, group)
    return received.reshape(cp, heads // cp, n, d).transpose(0, 1).reshape(heads // cp, cp * n, d)


# exercise ulysses (continued)
def heads_to_seq(y: torch.Tensor, engine: str, traffic: collectives.Traffic,
                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of `seq_to_heads`: (H / cp, cp n, d) -> (H, n, d), heads in order."""
    cp = dist.get_world_size(group)
    heads, length, d = y.shape
    send = y.reshape(heads, cp, length // cp, d).transpose(0, 1).reshape(cp * heads, length // cp, d)
    return all_to_all_rows(send, engine, traffic, group)


class SequenceToHeads(torch.autograd.Function):
    """`seq_to_heads` forward, `heads_to_seq` of the gradient backward (and inverse=True the
    other way round): an all-to-all's adjoint is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, inverse: bool, engine: str, traffic, group):
        ctx.inverse, ctx.engine, ctx.traffic, ctx.group = inverse, engine, traffic, group
        return (heads_to_seq if inverse else seq_to_heads)(x, engine, traffic, group)

    @staticmethod
    def backward(ctx, grad):
        undo = seq_to_heads if ctx.inverse else heads_to_seq
        return undo(grad, ctx.engine, ctx.traffic, ctx.group), None, None, None, None


# ============================================================================ 3. the attention


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: int,
                      causal: bool = True, layout: str = "zigzag", engine: str = "p2p",
                      traffic: collectives.Traffic | None = None, block: int = 64,
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses on this rank's shard over the cp ranks of `group`: q (H, seq / cp, d),
    k and v (H_kv, seq / cp, d) -> out (H, seq / cp, d). K and V with fewer heads than cp are
    first replicated to cp heads (DeepSpeed's UlyssesSPAttentionHF). Three all-to-alls to head
    shards, `blockwise_attention` over the full sequence (grouped-query when H_kv < H; the mask
    from the gathered positions, so any layout works), one all-to-all back; backward the four
    reversed. Bytes per rank: `ulysses_bytes_per_rank`. Counts that do not split: ValueError."""
    cp, traffic = dist.get_world_size(group), traffic if traffic is not None else collectives.Traffic()
    check_heads(q.shape[0], k.shape[0], cp)
    if k.shape[0] < cp:  # each rank needs one K/V head: replicate
        k, v = (t.repeat_interleave(cp // t.shape[0], dim=0) for t in (k, v))
    positions = torch.cat([context_parallel.sequence_positions(seq, cp, r, layout)
                           for r in range(cp)]).to(q.device)
    qh, kh, vh = (SequenceToHeads.apply(t, False, engine, traffic, group) for t in (q, k, v))
    out = blockwise.blockwise_attention(qh, kh, vh, causal, enable_gqa=True, block_q=block,
                                        block_k=block, q_pos=positions, k_pos=positions)
    return SequenceToHeads.apply(out, True, engine, traffic, group)


# ============================================================================ 4. the cost


def ulysses_bytes_per_rank(seq: int, heads: int, head_dim: int, cp: int, itemsize: int,
                           kv_heads: int | None = None) -> context_parallel.Bytes:
    """Ulysses, bytes one rank sends: four all-to-alls each way, (cp - 1) / cp of a shard each.
    With B = H (seq / cp) d itemsize and as many K/V heads as query heads: 4 (cp - 1) / cp B
    forward and backward, from 2 B at cp = 2 toward 4 B: bounded, not constant, where the ring's
    2 (cp - 1) B grows with cp (`ring_bytes_per_rank`). With H_kv = kv_heads K/V heads
    (grouped-query attention), max(H_kv, cp) after replication: (2 + 2 max(H_kv, cp) / H)
    (cp - 1) / cp B each way."""
    kv = max(heads if kv_heads is None else kv_heads, cp)
    b, b_kv = (context_parallel.shard_bytes(seq, h, head_dim, cp, itemsize) for h in (heads, kv))
    sent = (cp - 1) * (2 * b + 2 * b_kv) // cp
    return context_parallel.Bytes(sent, sent)
