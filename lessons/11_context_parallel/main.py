"""Lesson 11: context parallelism: attention by blocks, ring attention, zig-zag balance, Ulysses.

The story, top to bottom (1 in blockwise.py, 2-3 here, then ulysses.py and cost.py):

1. blockwise.py: attention by blocks (FlashAttention-2): attend a query tile to one key/value tile, keep its
   log-sum-exp (lse), merge partial results exactly; `blockwise_attention` is SDPA's
   f(q, k, v, is_causal) built from those tiles, query blocks outer and key blocks inner, the
   lse saved for backward (and returned on request), which recomputes each tile's probabilities
   from it, key blocks outer. No L x S matrix is ever kept.
2. The layouts: the sequence cut into 2 cp equal chunks; contiguous (rank r holds chunks 2r,
   2r+1) or zig-zag (chunks r and 2cp-1-r, Llama 3's causal balance), and the load balance:
   the unmasked (query chunk, key chunk) tiles per rank under a causal mask, and their FLOPs.
3. Ring attention: every rank keeps its queries; key/value blocks travel around the ring, one
   grouped send/receive per step, the next block in flight while this one is computed:
   cp - 1 exchange steps forward; in backward dK, dV travel with their block and go home.
4. ulysses.py: Ulysses (DeepSpeed): one all-to-all turns sequence shards into head shards,
   full-sequence attention per head group, one all-to-all back.
5. cost.py: the cost model: bytes per rank, FLOPs, when the ring's transfer hides behind its
   compute, the K/V buffers, activation memory per rank with and without CP.

The proof is in checks.py: `python lessons/11_context_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique
blockwise = importlib.import_module("lessons.11_context_parallel.blockwise")  # 1. attention by blocks
cost = importlib.import_module("lessons.11_context_parallel.cost")  # 5. the cost model
# the cost model's names that lesson 13 and ulysses.py import from here:
shard_bytes, Bytes, ring_bytes_per_rank = cost.shard_bytes, cost.Bytes, cost.ring_bytes_per_rank
activation_bytes_per_rank = cost.activation_bytes_per_rank

# ============================================================================ 2. the layouts

LAYOUTS = ("contiguous", "zigzag")


# exercise zigzag (2 points): The contiguous and zig-zag layouts and their causal tiles
# hint: chunk c covers positions [c * seq / (2 cp), (c + 1) * seq / (2 cp)); the query chunk c
#   sees key chunks 0..c under a causal mask (2 cp of them without one).
def chunk_ids(cp: int, rank: int, layout: str) -> tuple[int, int]:
    """The two of the 2 cp equal chunks of the sequence that `rank` holds, in its local order:
    contiguous (2r, 2r+1); zigzag (r, 2cp-1-r): an early and a late chunk."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    return (2 * rank, 2 * rank + 1) if layout == "contiguous" else (rank, 2 * cp - 1 - rank)


# exercise zigzag (continued)
def sequence_positions(seq: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """The global positions (int64, seq / cp of them) `rank` holds: its two chunks in order.
    seq not divisible by 2 cp: ValueError naming both (every chunk must be the same length).
    These are the positions everything per token must use (a mask, RoPE, position ids): under
    zig-zag a rank's tokens are not 0..seq/cp-1."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2 * cp = {2 * cp}")
    size = seq // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunk_ids(cp, rank, layout)])


# exercise zigzag (continued)
def tiles_per_rank(cp: int, layout: str, causal: bool = True) -> list[int]:
    """(query chunk, key chunk) tiles each rank computes, of the (2cp)^2: under a causal mask
    query chunk c needs key chunks 0..c (c + 1 tiles; the rest are skipped), else all 2 cp.
    Contiguous: rank r computes 4r + 3 (the last rank 4 cp - 1, the first 3);
    zig-zag: (r + 1) + (2cp - r) = 2 cp + 1 on every rank."""
    return [sum(c + 1 if causal else 2 * cp for c in chunk_ids(cp, rank, layout)) for rank in range(cp)]


def causal_work_per_rank(cp: int, layout: str) -> list[float]:
    """Causal FLOPs per rank in full-tile units, a diagonal tile counted 1/2 (a kernel that skips
    masked entries does half of it): query chunk c costs c + 1/2. Contiguous: 4r + 2 (the last
    rank 4cp - 2 against a mean of 2cp: 2 - 1/cp times the mean); zig-zag: 2cp on every rank."""
    return [sum(c + 0.5 for c in chunk_ids(cp, rank, layout)) for rank in range(cp)]


# ============================================================================ 3. ring attention


@dataclasses.dataclass
class RingStats:
    """What one rank did: bytes and messages sent (lesson 01's Traffic), exchange steps
    (grouped send/receive rounds) forward and backward, tiles computed forward."""

    traffic: collectives.Traffic = dataclasses.field(default_factory=collectives.Traffic)
    forward_steps: int = 0
    backward_steps: int = 0
    tiles: int = 0


def start_ring_pass(tensor: torch.Tensor, stats: RingStats,
                    group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, list]:
    """Send `tensor` to rank + 1 and receive its like from rank - 1 of `group` (None: the
    default group; a mesh's cp dimension in the capstone) as ONE grouped send/receive (safe
    under NCCL); returns (receive buffer, requests to wait on)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    after, before = (rank + 1) % cp, (rank - 1) % cp
    if group is not None:  # point-to-point messages name global ranks
        after, before = dist.get_global_rank(group, after), dist.get_global_rank(group, before)
    received = torch.empty_like(tensor)
    return received, collectives.start_exchange([(tensor, after)], [(received, before)], stats.traffic)


def finish(received: torch.Tensor, requests: list) -> torch.Tensor:
    for request in requests:
        request.wait()
    return received


# exercise ring-attention (5 points): Ring attention, forward and backward
# hint: at step s rank r of `group` holds the key/value block of rank (r - s) mod cp: start
#   passing it on (start_ring_pass) before computing on it, merge its tiles (tiles(...), masked
#   ones skipped) with merge_partials; backward: dK, dV accumulators travel WITH their block,
#   one last pass sends them home. cp - 1 forward steps; none at all for cp = 1.
class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries to the whole sequence, the sequence split over the cp
    ranks of `group` (None: the default group) by `layout` (sequence_positions).

    q (..., seq / cp, d) and k, v (..., seq / cp, d) with H / g of q's H heads on dim -3 (g > 1:
    grouped-query attention): this rank's shard. Returns out (..., seq / cp, d), the rows of
    full attention at this rank's positions. The tiles are blockwise.py's, two halves of the
    shard by two of the held block; the running out and lse and the backward's sum of dQ over
    the tiles are fp32 (fp64 for fp64 inputs), out and dQ rounded to q's dtype once, at the end.
    Forward: cp - 1 exchange steps, each sending the held K and V (2 B_kv bytes, B_kv =
    H_kv (seq / cp) d itemsize) to rank + 1 while the held block is computed: 2 (cp - 1) B_kv.
    Backward: the blocks go round again with their dK, dV accumulators (4 B_kv per step, in
    the inputs' dtype) and a last step takes dK, dV home: cp steps, (4 cp - 2) B_kv (none for
    cp = 1). Saves q, k, v, out, lse: no (seq / cp) x seq matrix.
    """

    @staticmethod
    def forward(ctx, q, k, v, seq: int, causal: bool, layout: str, stats: RingStats, group):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        wide, groups = torch.promote_types(q.dtype, torch.float32), q.shape[-3] // k.shape[-3]
        half = max(q.shape[-2] // 2, 1)
        q_pos = sequence_positions(seq, cp, rank, layout).to(q.device)
        out = q.new_zeros(q.shape, dtype=wide)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=wide)
        held = torch.stack([k, v])
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                incoming = start_ring_pass(held, stats, group)
                stats.forward_steps += 1
            k_pos = sequence_positions(seq, cp, (rank - step) % cp, layout).to(q.device)
            for qs, ks, mask in blockwise.tiles(q_pos, k_pos, causal, half, half):
                kv = [blockwise.expand_kv(t[..., ks, :], groups).to(wide) for t in held]
                part = blockwise.attend_block(q[..., qs, :].to(wide), *kv, mask)
                out[..., qs, :], lse[..., qs] = blockwise.merge_partials(out[..., qs, :], lse[..., qs], *part)
                stats.tiles += 1
            if step < cp - 1:
                held = finish(*incoming)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seq, ctx.causal, ctx.layout, ctx.stats, ctx.group = seq, causal, layout, stats, group
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, cp = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        wide, groups, half = lse.dtype, q.shape[-3] // k.shape[-3], max(q.shape[-2] // 2, 1)
        q_pos = sequence_positions(ctx.seq, cp, rank, ctx.layout).to(q.device)
        d_out = d_out.to(wide)
        delta = (d_out * out.to(wide)).sum(-1)
        dq = torch.zeros_like(q, dtype=wide)
        held, d_held = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(cp):
            k_pos = sequence_positions(ctx.seq, cp, (rank - step) % cp, ctx.layout).to(q.device)
            for qs, ks, mask in blockwise.tiles(q_pos, k_pos, ctx.causal, half, half):
                kv = [blockwise.expand_kv(t[..., ks, :], groups).to(wide) for t in held]
                a, b, c = blockwise.attend_block_backward(q[..., qs, :].to(wide), *kv, d_out[..., qs, :],
                                                          lse[..., qs], delta[..., qs], mask)
                dq[..., qs, :] += a
                d_held[0][..., ks, :] += blockwise.fold_kv(b, groups)
                d_held[1][..., ks, :] += blockwise.fold_kv(c, groups)
            if cp > 1:  # the gradients travel with their block; after the last step, home
                moving = torch.cat([held, d_held]) if step < cp - 1 else d_held
                moved = finish(*start_ring_pass(moving, ctx.stats, ctx.group))
                ctx.stats.backward_steps += 1
                held, d_held = (moved[:2], moved[2:]) if step < cp - 1 else (held, moved)
        return dq.to(q.dtype), d_held[0], d_held[1], None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: int, causal: bool = True,
                   layout: str = "zigzag", stats: RingStats | None = None,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`RingAttention` on this rank's shard of the cp ranks of `group` (see there); stats
    counts what it did."""
    return RingAttention.apply(q, k, v, seq, causal, layout, stats or RingStats(), group)


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
