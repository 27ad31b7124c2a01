"""Lesson 11: context parallelism: attention by blocks, ring attention, zig-zag balance, Ulysses.

The story, top to bottom (this file, then ulysses.py):

1. Attention by blocks (FlashAttention's online softmax): attend a query tile to one key/value
   block, keep its log-sum-exp, merge two partial results exactly; backward recomputes each
   tile's probabilities from the saved log-sum-exp. No s x s matrix is ever kept.
2. The layouts: the sequence cut into 2 cp equal chunks; contiguous (rank r holds chunks 2r,
   2r+1) or zig-zag (chunks r and 2cp-1-r, Llama 3's causal balance), and the load balance:
   the unmasked (query chunk, key chunk) tiles per rank under a causal mask.
3. Ring attention: every rank keeps its queries; key/value blocks travel around the ring, one
   grouped send/receive per step, the next block in flight while this one is computed:
   cp - 1 exchange steps forward; in backward dK, dV travel with their block and go home.
4. The cost model: the ring's bytes per rank, activation memory per rank with and without CP.
5. ulysses.py: Ulysses (DeepSpeed): one all-to-all turns sequence shards into head shards,
   full-sequence attention per head group, one all-to-all back; its bytes per rank.

The proof is in checks.py: `python lessons/11_context_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique
memory = importlib.import_module("lessons.07_memory.main")  # lesson 07's technique

# ============================================================================ 1. attention by blocks


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(m, n) bool, True where query at global position q_pos[i] may see key k_pos[j] (j <= i)."""
    return k_pos[None, :] <= q_pos[:, None]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that saw no key yet) replaced by 0, so exp(x - lse) is 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


# exercise online-softmax (4 points): Attention by blocks: the log-sum-exp merge, forward and backward
# hint: attend_block: scores, masked_fill(-inf), logsumexp, exp(scores - lse) @ v;
#   merge_partials: lse = logaddexp(a, b), weights exp(a - lse) and exp(b - lse);
#   attend_block_backward: P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - delta).
#   Guard rows whose lse is -inf (every key masked): they must give 0, never nan.
def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query tile to ONE key/value block, normalised within the block.

    q (H, m, d), k and v (H, n, d), mask (m, n) bool (True = may attend) or None.
    S = q k^T / sqrt(d) (masked entries -inf); returns out (H, m, d) = softmax(S) v and
    lse (H, m) = log sum_j exp(S_ij). A row with every key masked: lse = -inf and out = 0 (it
    adds nothing to a merge). Cost: 4 H m n d FLOPs, H m n scores alive (a tile, not s x s).
    """
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite(lse)[..., None]) @ v, lse


# exercise online-softmax (continued)
def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial attentions of the same queries over disjoint
    key sets A and B: exact, whatever order the blocks come in.

    out_* (H, m, d), lse_* (H, m). lse = log(e^lse_a + e^lse_b) (torch.logaddexp);
    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b. Rows where both are -inf stay
    (out 0, lse -inf). Returns new tensors. Cost: O(H m d), no key is touched again.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)[..., None]
    return torch.exp(lse_a[..., None] - safe) * out_a + torch.exp(lse_b[..., None] - safe) * out_b, lse


# exercise online-softmax (continued)
def attend_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor,
                          lse: torch.Tensor, delta: torch.Tensor,
                          mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One tile's share of the gradients, from the FULL row's saved lse (FlashAttention-2).

    q, d_out (H, m, d); k, v (H, n, d); lse, delta (H, m) where lse is the log-sum-exp over
    every key of the row and delta = rowsum(dO * O) for the full output O. With
    P = exp(S - lse) (this tile's probabilities under the full normaliser):
    dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
    Returns (dq (H, m, d), dk, dv (H, n, d)): contributions to SUM over tiles. Cost: 8 H m n d.
    """
    scale = q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - _finite(lse)[..., None])
    d_scores = probs * (d_out @ v.transpose(-1, -2) - delta[..., None])
    return d_scores @ k * scale, d_scores.transpose(-1, -2) @ q * scale, probs.transpose(-1, -2) @ d_out


class BlockwiseAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) [+ causal mask]) v over key/value blocks of `block` positions,
    one process. q (H, m, d), k, v (H, n, d); q_pos (m,), k_pos (n,) the global positions
    (causal: key j visible to query i iff k_pos[j] <= q_pos[i]). Saves q, k, v, out and lse
    (H, m): 3 H n d + H m d + H m elements, no H m n matrix; backward walks the blocks again."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal: bool, block: int):
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"))
        for start in range(0, k.shape[-2], block):
            cut = slice(start, start + block)
            mask = causal_mask(q_pos, k_pos[cut]) if causal else None
            out, lse = merge_partials(out, lse, *attend_block(q, k[..., cut, :], v[..., cut, :], mask))
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos)
        ctx.causal, ctx.block = causal, block
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, q_pos, k_pos = ctx.saved_tensors
        delta = (d_out * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start in range(0, k.shape[-2], ctx.block):
            cut = slice(start, start + ctx.block)
            mask = causal_mask(q_pos, k_pos[cut]) if ctx.causal else None
            a, b, c = attend_block_backward(q, k[..., cut, :], v[..., cut, :], d_out, lse, delta, mask)
            dq += a
            dk[..., cut, :] += b
            dv[..., cut, :] += c
        return dq, dk, dv, None, None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        block: int = 64, q_pos: torch.Tensor | None = None,
                        k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """`BlockwiseAttention` with positions 0..m-1 and 0..n-1 by default (self-attention)."""
    q_pos = torch.arange(q.shape[-2], device=q.device) if q_pos is None else q_pos
    k_pos = torch.arange(k.shape[-2], device=k.device) if k_pos is None else k_pos
    return BlockwiseAttention.apply(q, k, v, q_pos, k_pos, causal, block)


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
    seq not divisible by 2 cp: ValueError naming both (every chunk must be the same length)."""
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


def tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool):
    """The (query slice, key slice, mask) tiles of two local halves x two held halves that
    have any visible entry; mask None where the whole tile is visible."""
    half_q, half_k = q_pos.shape[0] // 2, k_pos.shape[0] // 2
    for qs in (slice(0, half_q), slice(half_q, None)):
        for ks in (slice(0, half_k), slice(half_k, None)):
            if not causal or k_pos[ks].max() <= q_pos[qs].min():
                yield qs, ks, None
            elif k_pos[ks].min() <= q_pos[qs].max():
                yield qs, ks, causal_mask(q_pos[qs], k_pos[ks])


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
# hint: at step s rank r holds the key/value block of rank (r - s) mod cp: start passing it on
#   (start_ring_pass) before computing on it, merge with merge_partials, skip masked tiles
#   (tiles()); backward: dK, dV accumulators travel WITH their block, one last pass sends them
#   home. cp - 1 forward steps; none at all for cp = 1.
class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries to the whole sequence, the sequence split over the cp
    ranks of `group` (None: the default group) by `layout` (sequence_positions).

    q, k, v (H, seq / cp, d): this rank's shard. Returns out (H, seq / cp, d) = the rows of
    full attention at this rank's positions. Forward: cp - 1 exchange steps, each sending the
    held K and V (2 B bytes, B = H (seq / cp) d itemsize) to rank + 1 while the held block is
    computed: 2 (cp - 1) B per rank. Backward: the blocks go round again with their dK, dV
    accumulators (4 B per step), and a last step takes dK, dV home: cp steps, (4 cp - 2) B
    (none for cp = 1). Saves q, k, v, out, lse: no (seq / cp) x seq matrix.
    """

    @staticmethod
    def forward(ctx, q, k, v, seq: int, causal: bool, layout: str, stats: RingStats, group):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        q_pos = sequence_positions(seq, cp, rank, layout).to(q.device)
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"))
        held = torch.stack([k, v])
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                incoming = start_ring_pass(held, stats, group)
                stats.forward_steps += 1
            k_pos = sequence_positions(seq, cp, (rank - step) % cp, layout).to(q.device)
            for qs, ks, mask in tiles(q_pos, k_pos, causal):
                part = attend_block(q[:, qs], held[0][:, ks], held[1][:, ks], mask)
                out[:, qs], lse[:, qs] = merge_partials(out[:, qs], lse[:, qs], *part)
                stats.tiles += 1
            if step < cp - 1:
                held = finish(*incoming)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seq, ctx.causal, ctx.layout, ctx.stats, ctx.group = seq, causal, layout, stats, group
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, cp = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        q_pos = sequence_positions(ctx.seq, cp, rank, ctx.layout).to(q.device)
        delta = (d_out * out).sum(-1)
        dq = torch.zeros_like(q)
        held, d_held = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(cp):
            k_pos = sequence_positions(ctx.seq, cp, (rank - step) % cp, ctx.layout).to(q.device)
            for qs, ks, mask in tiles(q_pos, k_pos, ctx.causal):
                a, b, c = attend_block_backward(q[:, qs], held[0][:, ks], held[1][:, ks],
                                                d_out[:, qs], lse[:, qs], delta[:, qs], mask)
                dq[:, qs] += a
                d_held[0][:, ks] += b
                d_held[1][:, ks] += c
            if cp > 1:  # the gradients travel with their block; after the last step, home
                moving = torch.cat([held, d_held]) if step < cp - 1 else d_held
                moved = finish(*start_ring_pass(moving, ctx.stats, ctx.group))
                ctx.stats.backward_steps += 1
                held, d_held = (moved[:2], moved[2:]) if step < cp - 1 else (held, moved)
        return dq, d_held[0], d_held[1], None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: int, causal: bool = True,
                   layout: str = "zigzag", stats: RingStats | None = None,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`RingAttention` on this rank's shard of the cp ranks of `group` (see there); stats
    counts what it did."""
    return RingAttention.apply(q, k, v, seq, causal, layout, stats or RingStats(), group)


# ============================================================================ 4. the cost model


def shard_bytes(seq: int, heads: int, head_dim: int, cp: int, itemsize: int) -> int:
    """B: bytes of one rank's shard of q, k or v: H (seq / cp) d itemsize."""
    return heads * (seq // cp) * head_dim * itemsize


class Bytes(NamedTuple):
    """Bytes one rank sends in the forward and in the backward pass."""

    forward: int
    backward: int


def ring_bytes_per_rank(seq: int, heads: int, head_dim: int, cp: int, itemsize: int) -> Bytes:
    """Ring attention, bytes one rank sends: forward 2 (cp - 1) B, backward (4 cp - 2) B
    (cp > 1; both 0 at cp = 1). Grows linearly with cp at a fixed shard."""
    b = shard_bytes(seq, heads, head_dim, cp, itemsize)
    return Bytes(2 * (cp - 1) * b, (4 * cp - 2) * b if cp > 1 else 0)


def activation_bytes_per_rank(seq: int, hidden: int, heads: int, cp: int = 1, batch: int = 1,
                              flash: bool = True) -> int:
    """Activation bytes one rank keeps per transformer layer, 16-bit: lesson 07's
    `activation_bytes_per_layer` (Korthikanti et al., s b h (34 + 5 a s / h)) split over cp
    ranks, (s / cp) b h (34 + 5 a s / h): each rank's s / cp queries against all s keys. With
    FlashAttention (flash=True) the 5 a s^2 b bytes of softmax output, dropout mask and
    dropout output are never kept: (s / cp) b h 34. Simplified: Korthikanti et al. count a
    GPT-style layer (4h GeLU MLP, dropout), not a Llama SwiGLU layer."""
    total = memory.activation_bytes_per_layer(seq, batch, hidden, heads)
    return (total - (5 * heads * seq * seq * batch if flash else 0)) // cp


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
