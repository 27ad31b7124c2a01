"""Lesson 11, part 1: attention by blocks, FlashAttention-2's algorithm written in PyTorch.

Attention over the whole sequence is a fold over key blocks: attend a query tile to one
key/value tile, keep the output normalised within the tile and its log-sum-exp (lse), and merge
two partial results exactly (the online softmax; Milakov and Gimelshein, arXiv 1805.02867;
FlashAttention, arXiv 2205.14135 and 2307.08691). In the order a learner meets it:

1. `attend_block`, `merge_partials` and `attend_block_backward`: one tile forward, the merge,
   one tile's gradients from the full row's saved lse;
2. `tiles`: the grid of query blocks x key blocks, tiles a causal mask hides skipped;
3. `BlockwiseAttention` and `blockwise_attention`: SDPA's f(q, k, v, is_causal) from those
   tiles, query blocks outer and key blocks inner, the lse saved for backward (and returned on
   request), backward with key blocks outer; no L x S matrix is ever kept.

main.py's ring attention runs these tiles on blocks that travel between ranks; ulysses.py runs
`blockwise_attention` on a head group over the whole sequence. The proof is in checks.py.
"""

from __future__ import annotations

import itertools

import torch

# ============================================================================ 1. one tile


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(m, n) bool, True where the query at global position q_pos[i] may see the key at k_pos[j]
    (k_pos[j] <= q_pos[i]). Positions 0..L-1 and 0..S-1 give SDPA's is_causal, tril(ones(L, S)):
    aligned top left when L != S (FlashAttention >= 2.1 aligns bottom right)."""
    return k_pos[None, :] <= q_pos[:, None]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that saw no key yet) replaced by 0, so exp(x - lse) is 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


# exercise online-softmax (4 points): Attention by blocks: the log-sum-exp merge, forward and backward
# hint: attend_block: scores * scale, masked_fill(-inf), logsumexp, exp(scores - lse) @ v;
#   merge_partials: lse = logaddexp(a, b), weights exp(a - lse) and exp(b - lse);
#   attend_block_backward: P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - delta).
#   Guard rows whose lse is -inf (every key masked): they must give 0, never nan.
def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query tile to ONE key/value tile, normalised within the tile.

    q (..., m, d), k (..., n, d), v (..., n, dv), mask (m, n) bool (True = may attend) or None,
    scale (None: 1 / sqrt(d)). S = scale q k^T (masked entries -inf); returns out (..., m, dv) =
    softmax(S) v and lse (..., m) = log sum_j exp(S_ij), in q's dtype. A row with every key
    masked: lse = -inf and out = 0 (it adds nothing to a merge). Cost: 4 m n d FLOPs per head
    (2 for S, 2 for P V), m n scores alive (a tile, not L x S).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite(lse)[..., None]) @ v, lse


# exercise online-softmax (continued)
def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial attentions of the same queries over disjoint
    key sets A and B: exact, whatever order the blocks come in.

    out_* (..., m, dv), lse_* (..., m). lse = log(e^lse_a + e^lse_b) (torch.logaddexp);
    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b. Rows where both are -inf stay
    (out 0, lse -inf). Returns new tensors. Cost: O(m dv), no key is touched again.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)[..., None]
    return torch.exp(lse_a[..., None] - safe) * out_a + torch.exp(lse_b[..., None] - safe) * out_b, lse


# exercise online-softmax (continued)
def attend_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor,
                          lse: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor | None = None,
                          scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """One tile's share of the gradients, from the FULL row's saved lse (FlashAttention-2).

    q (..., m, d), d_out (..., m, dv); k (..., n, d), v (..., n, dv); lse, delta (..., m) where
    lse is the log-sum-exp over every key of the row and delta = rowsum(dO * O) for the full
    output O. With P = exp(S - lse) (this tile's probabilities under the full normaliser):
    dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ = scale dS K, dK = scale dS^T Q.
    Returns (dq (..., m, d), dk (..., n, d), dv (..., n, dv)): contributions to SUM over tiles.
    Cost: five matmuls (S, dP, dV, dQ, dK), 10 m n d FLOPs per head: 2.5x the forward's 4.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - _finite(lse)[..., None])
    d_scores = probs * (d_out @ v.transpose(-1, -2) - delta[..., None])
    return d_scores @ k * scale, d_scores.transpose(-1, -2) @ q * scale, probs.transpose(-1, -2) @ d_out


def tile_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> tuple[bool, torch.Tensor | None]:
    """One tile of query positions x key positions: (False, None) when a causal mask hides all
    of it (the tile is skipped), (True, None) when every entry is visible, else (True, mask)."""
    if not causal or int(k_pos.max()) <= int(q_pos.min()):
        return True, None
    if int(k_pos.min()) > int(q_pos.max()):
        return False, None
    return True, causal_mask(q_pos, k_pos)


def tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, block_q: int, block_k: int,
          keys_outer: bool = False):
    """(query slice, key slice, mask) for every tile of a block_q x block_k grid over the
    positions that has a visible entry (tile_mask); the last block of each side is short when
    the size does not divide. Query blocks outer (FlashAttention-2's forward), or key blocks
    outer (its backward: one key block's dK, dV finished before the next)."""
    grid = itertools.product(range(0, len(q_pos), block_q), range(0, len(k_pos), block_k))
    for q0, k0 in sorted(grid, key=lambda start: start[1]) if keys_outer else grid:
        qs, ks = slice(q0, q0 + block_q), slice(k0, k0 + block_k)
        visible, mask = tile_mask(q_pos[qs], k_pos[ks], causal)
        if visible:
            yield qs, ks, mask


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: (..., H / g, n, d) -> (..., H, n, d), K/V head j shared by query
    heads j g .. j g + g - 1 (SDPA's enable_gqa: repeat_interleave)."""
    return t.repeat_interleave(groups, dim=-3) if groups > 1 else t


def fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of `expand_kv`: the g query heads' gradients summed into their K/V head."""
    return t.unflatten(-3, (-1, groups)).sum(-3) if groups > 1 else t


# exercise flash-attention (3 points): FlashAttention-2's loops: the lse saved, backward from it
# hint: forward: fold every visible tile (tiles(...), query blocks outer) into a running out and
#   lse of `wide` dtype with attend_block and merge_partials; save q, k, v, out and lse.
#   Backward: delta = rowsum(dO * O) - d_lse (the lse is an output too: dS += P d_lse); add
#   each tile's attend_block_backward (key blocks outer) into dQ, dK, dV.
class BlockwiseAttention(torch.autograd.Function):
    """forward(q, k, v, q_pos, k_pos, causal, scale, block_q, block_k) -> (out, lse), one process.

    q (..., L, E); k (..., S, E) and v (..., S, Ev) with H / g heads on dim -3 where q has H
    (g = 1 without grouped-query attention); q_pos (L,), k_pos (S,) global positions (causal:
    key j visible to query i iff k_pos[j] <= q_pos[i]). out (..., L, Ev) in q's dtype, lse
    (..., L) = log sum_j exp(scale q_i k_j) in `wide` = fp32 (fp64 for fp64 inputs): every
    tile is computed from the inputs in `wide`, as FlashAttention keeps its accumulators and lse
    in fp32 (simplified: its kernel also rounds P to bf16 before P V). Tiles a causal mask hides
    are skipped. Saves q, k, v, out, lse: no L x S matrix. The lse is differentiable:
    d lse_i / d S_ij = P_ij, so its gradient joins delta. Cost per head: forward 4 L S E FLOPs
    (of the visible tiles), backward 10 L S E (attend_block_backward).
    """

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal: bool, scale: float, block_q: int, block_k: int):
        wide, groups = torch.promote_types(q.dtype, torch.float32), q.shape[-3] // k.shape[-3]
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=wide)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=wide)
        for qs, ks, mask in tiles(q_pos, k_pos, causal, block_q, block_k):
            kv = [expand_kv(t[..., ks, :], groups).to(wide) for t in (k, v)]
            part = attend_block(q[..., qs, :].to(wide), *kv, mask, scale)
            out[..., qs, :], lse[..., qs] = merge_partials(out[..., qs, :], lse[..., qs], *part)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos)
        ctx.args = causal, scale, block_q, block_k
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, q_pos, k_pos = ctx.saved_tensors
        causal, scale, block_q, block_k = ctx.args
        wide, groups = lse.dtype, q.shape[-3] // k.shape[-3]
        d_out = d_out.to(wide)
        delta = (d_out * out.to(wide)).sum(-1) - d_lse
        dq, dk, dv = (torch.zeros_like(t, dtype=wide) for t in (q, k, v))
        for qs, ks, mask in tiles(q_pos, k_pos, causal, block_q, block_k, keys_outer=True):
            kv = [expand_kv(t[..., ks, :], groups).to(wide) for t in (k, v)]
            a, b, c = attend_block_backward(q[..., qs, :].to(wide), *kv, d_out[..., qs, :],
                                            lse[..., qs], delta[..., qs], mask, scale)
            dq[..., qs, :] += a
            dk[..., ks, :] += fold_kv(b, groups)
            dv[..., ks, :] += fold_kv(c, groups)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                        scale: float | None = None, *, enable_gqa: bool = False, block_q: int = 64,
                        block_k: int = 64, return_lse: bool = False, q_pos: torch.Tensor | None = None,
                        k_pos: torch.Tensor | None = None):
    """SDPA's contract, F.scaled_dot_product_attention(q, k, v, is_causal=, scale=, enable_gqa=)
    with no attn_mask or dropout: q (..., L, E), k (..., S, E), v (..., S, Ev), the same leading
    dims (with enable_gqa, k and v may have H / g of q's H heads on dim -3) -> out (..., L, Ev);
    with return_lse=True (out, lse), lse (..., L) fp32 (FlashAttention's softmax_lse). is_causal:
    query i sees key j iff j <= i, SDPA's top-left alignment; q_pos, k_pos: other positions for
    the mask (the layouts of ring attention and Ulysses). Any block sizes >= 1.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    one_head = q.dim() == 2  # (L, E): one head
    q, k, v = (t[None] if one_head else t for t in (q, k, v))
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if q.shape[:-3] != k.shape[:-3] or heads % kv_heads or (heads != kv_heads and not enable_gqa):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: leading dims must match and "
                         "k's heads equal q's (or divide them, with enable_gqa=True)")
    q_pos = torch.arange(q.shape[-2], device=q.device) if q_pos is None else q_pos
    k_pos = torch.arange(k.shape[-2], device=k.device) if k_pos is None else k_pos
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = BlockwiseAttention.apply(q, k, v, q_pos, k_pos, is_causal, scale, block_q, block_k)
    out, lse = (out[0], lse[0]) if one_head else (out, lse)
    return (out, lse) if return_lse else out
