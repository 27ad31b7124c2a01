"""Lesson 11, part 5: the cost model of context parallelism, per rank and per layer.

What a rank sends, computes and keeps, as formulas; the checks compare the bytes with what the
code counts, and the tests compare the memory with lesson 07's tracker:

1. bytes: `shard_bytes` (B, one rank's shard of q), `ring_bytes_per_rank` (Ulysses's are in
   ulysses.py);
2. FLOPs: `attention_flops` (forward 4, backward 10 per visible (query, key) pair, head and
   head dimension) and `causal_pairs` (the pairs a causal mask leaves a rank);
3. overlap: `ring_overlap_min_tokens`, the shortest shard whose compute hides the next block's
   transfer;
4. memory: `kv_buffer_bytes` (the ring's buffers against an all-gather's full K and V) and
   `activation_bytes_per_rank`.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

memory = importlib.import_module("lessons.07_memory.main")  # lesson 07's technique

# ============================================================================ 1. bytes


def shard_bytes(seq: int, heads: int, head_dim: int, cp: int, itemsize: int) -> int:
    """B: bytes of one rank's shard of q (or of k, v with as many heads): H (seq / cp) d itemsize."""
    return heads * (seq // cp) * head_dim * itemsize


class Bytes(NamedTuple):
    """Bytes one rank sends in the forward and in the backward pass."""

    forward: int
    backward: int


def ring_bytes_per_rank(seq: int, heads: int, head_dim: int, cp: int, itemsize: int,
                        kv_heads: int | None = None) -> Bytes:
    """Ring attention, bytes one rank sends: forward 2 (cp - 1) B_kv, backward (4 cp - 2) B_kv
    (cp > 1; both 0 at cp = 1), B_kv = H_kv (seq / cp) d itemsize with H_kv = kv_heads (None:
    heads; grouped-query attention sends H_kv / H of it). Grows linearly with cp at a fixed shard."""
    b_kv = shard_bytes(seq, heads if kv_heads is None else kv_heads, head_dim, cp, itemsize)
    return Bytes(2 * (cp - 1) * b_kv, (4 * cp - 2) * b_kv if cp > 1 else 0)


# ============================================================================ 2. FLOPs


def attention_flops(pairs: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of attention over `pairs` visible (query, key) pairs: forward
    S = Q K^T and P V, 2 + 2 per pair, head and head dim: 4 H d pairs; backward five matmuls
    (S again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q): 10 H d pairs, 2.5x the forward
    (flash-attention's benchmark counts it so). Non-causal L x S: pairs = L S."""
    return 4 * pairs * heads * head_dim, 10 * pairs * heads * head_dim


def causal_pairs(q_pos: torch.Tensor) -> int:
    """Visible (query, key) pairs of queries at global positions q_pos under a causal mask over
    the whole sequence: query i sees keys 0..i, so sum(q_pos + 1). What a kernel that skips every
    masked entry computes; any layout's positions (contiguous, zig-zag, striped)."""
    return int((q_pos.to(torch.int64) + 1).sum())


# ============================================================================ 3. overlap


def ring_overlap_min_tokens(heads: int, kv_heads: int, itemsize: int, flops_per_s: float,
                            link_bytes_per_s: float, causal_zigzag: bool = False) -> float:
    """The shortest shard n = seq / cp whose forward compute hides the next block's transfer.
    One ring step computes the n queries against the held n keys, 4 n^2 H d FLOPs, in
    4 n^2 H d / F seconds, while K and V of the next block, 2 n H_kv d itemsize bytes, cross the
    link in 2 n H_kv d itemsize / W: hidden iff n >= H_kv itemsize F / (2 H W) (d cancels).
    The sequence grows with cp because of memory; overlap only decides whether the ring adds
    time. Causal zig-zag: every step after the first computes 2 of its 4 half-tiles, so it
    needs twice the shard. Backward moves 4 n H_kv d itemsize for 10 n^2 H d FLOPs: 0.8 times
    the forward's bound."""
    tokens = kv_heads * itemsize * flops_per_s / (2 * heads * link_bytes_per_s)
    return 2 * tokens if causal_zigzag else tokens


# ============================================================================ 4. memory


class KVBuffers(NamedTuple):
    """Bytes of key/value-side buffers one rank holds at once, beside its own K and V shard."""

    ring_forward: int  # the held block and the incoming one: 2 x (K, V)
    ring_backward: int  # held and incoming, each K, V, dK, dV: 2 x 4 (dK, dV in the inputs' dtype)
    all_gather: int  # every rank's K and V: 2 cp


def kv_buffer_bytes(seq: int, kv_heads: int, head_dim: int, cp: int, itemsize: int) -> KVBuffers:
    """Ring (double-buffered: the next block arrives while this one is computed) against an
    all-gather of K and V (Llama 3's context parallelism), B_kv = H_kv (seq / cp) d itemsize:
    ring 4 B_kv forward and 8 B_kv backward whatever cp is; all-gather 2 cp B_kv, the whole
    sequence's K and V, small only because grouped-query attention makes B_kv small."""
    b_kv = shard_bytes(seq, kv_heads, head_dim, cp, itemsize)
    return KVBuffers(4 * b_kv, 8 * b_kv, 2 * cp * b_kv)


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
