"""Lesson 15, part 3: rooflines: which operations are limited by FLOPs, which by memory.

An operation that does F FLOPs while moving B bytes between memory and the cores has
arithmetic intensity I = F / B (FLOPs per byte). A device with peak P FLOP/s and memory
bandwidth W bytes/s runs it at most at min(P, I x W): below the ridge point P / W it waits for
memory (memory-bound), above it for arithmetic (compute-bound). How to Scale Your Model's
roofline chapter derives these and works them for the TPU v5e and the H100 (ridge
9.89e14 / 3.35e12 = 295 FLOPs per byte in bf16).

In reading order: `arithmetic_intensity`, `matmul_intensity` (about the token count when the
weights dominate), `ridge_point`, `attainable_flops`, `is_memory_bound`, and
`capstone_operations`: every operation of one capstone layer with its FLOPs and bytes.
"""

from __future__ import annotations

H100_SXM = {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12}  # NVIDIA's H100 SXM datasheet, dense


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte moved between memory and the cores: F / B."""
    return flops / bytes_moved


def matmul_intensity(m: int, k: int, n: int, itemsize: int) -> float:
    """(m, k) @ (k, n) -> (m, n): 2 m k n FLOPs over itemsize (m k + k n + m n) bytes (read both
    operands once, write the result once). With m tokens and k, n >> m (a weight matrix read
    for few tokens) it tends to 2m / itemsize: m in bf16, the token count."""
    return arithmetic_intensity(2 * m * k * n, itemsize * (m * k + k * n + m * n))


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity at which the roofline bends, P / W FLOPs per byte: below it an operation
    waits for memory, above it for arithmetic."""
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(P, I x W) FLOP/s, the best an operation of intensity I can reach."""
    return min(peak_flops, intensity * bandwidth)


def is_memory_bound(intensity: float, peak_flops: float, bandwidth: float) -> bool:
    """True when I is below the ridge point P / W (memory, not arithmetic, limits it)."""
    return intensity < ridge_point(peak_flops, bandwidth)


def capstone_operations(tokens: int, hidden: int, heads: int, seq: int, itemsize: int) -> list[dict]:
    """The forward operations of one capstone layer (lesson 07's TransformerLayer) on `tokens`
    = b s tokens: [{"name", "flops", "bytes"}], bytes as each operation moves them on its own
    (no fusion: every input read once and every output written once, itemsize bytes each).
    Matmuls: qkv (h -> 3h), out (h -> h), up (h -> 4h), down (4h -> h), each 2 t k n FLOPs
    over its activations and weight; attention per head: scores q k^T and values p v, 2 s s d
    FLOPs each per sequence and head (d = h / heads). Element-wise ones (the FLOPs are an
    estimate, the bytes are what matters): softmax over the s x s scores (about 5 FLOPs and a
    read and a write per score), LayerNorm (about 8 per element), GeLU (about 8 per element)."""
    d, sequences = hidden // heads, tokens // seq
    scores = sequences * heads * seq * seq

    def matmul(name: str, k: int, n: int) -> dict:
        return {"name": name, "flops": 2 * tokens * k * n,
                "bytes": itemsize * (tokens * k + k * n + tokens * n)}

    return [
        {"name": "layernorm", "flops": 8 * tokens * hidden, "bytes": 2 * itemsize * tokens * hidden},
        matmul("qkv", hidden, 3 * hidden),
        {"name": "scores q k^T", "flops": 2 * scores * d,
         "bytes": itemsize * (2 * sequences * heads * seq * d + scores)},
        {"name": "softmax", "flops": 5 * scores, "bytes": 2 * itemsize * scores},
        {"name": "values p v", "flops": 2 * scores * d,
         "bytes": itemsize * (scores + 2 * sequences * heads * seq * d)},
        matmul("out", hidden, hidden),
        matmul("up", hidden, 4 * hidden),
        {"name": "gelu", "flops": 8 * tokens * 4 * hidden, "bytes": 2 * itemsize * tokens * 4 * hidden},
        matmul("down", 4 * hidden, hidden),
    ]
