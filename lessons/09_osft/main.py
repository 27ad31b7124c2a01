"""Lesson 09: OSFT (orthogonal subspace fine-tuning): factorized kernels and their sharded projections.

The story, top to bottom:

1. `svd_split`: W (N x M) = U S V^T; the top k = floor(min(N, M) x rank_ratio) singular
   directions are frozen (U_high, S_high, V_high), the rest are trainable (U_low, S_low, V_low).
2. The layer, `OSFTLinear`: the naive forward (four matmuls and an add), then the fused one
   (flatten to 2D, mm, then addmm_ into the same output), which saves memory traffic.
3. Projections that keep training orthogonal to the frozen subspace: the gradients before the
   step and the parameters after it (Adam's element-wise scaling rotates updates out). First the
   Gram form (N x N and M x M matrices), then the factored form (k_low x k_high coefficients).
4. Sharded: rows split across ranks (dim 0, torch.chunk semantics, empty tail shards too). The
   U side contracts over the sharded N: local products are partial sums, one all-reduce (and one
   for every module at once, batched). The V side contracts over M, which is not sharded: local
   products are blocks of coefficients, and all-reducing them is WRONG; all-gathering V_high is
   right.
5. The cost model: FLOPs and bytes of each form, from which the benchmarks' ratios follow.

The proof (references, the forgetting demo, the CLI) is in checks.py; the timings in bench.py.
Run: `python lessons/09_osft/main.py --world-size 4` (add `--bench` for the timings).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn

# ============================================================================ 1. the SVD split


# exercise svd-split (2 points): The SVD split: top-k frozen, the rest trainable
# hint: k = min(floor(min(N, M) x ratio), min(N, M) - 1); torch.linalg.svd(full_matrices=False)
#   returns U, S and V^T (rows): slice columns of U, entries of S, rows of V^T at k.
def frozen_rank(n_rows: int, n_cols: int, rank_ratio: float) -> int:
    """k = floor(min(N, M) x rank_ratio), capped at min(N, M) - 1 so something stays trainable.
    frozen_rank(24, 16, 0.5) == 8; frozen_rank(24, 16, 1.0) == 15; frozen_rank(10, 7, 0.0) == 0."""
    smallest = min(n_rows, n_cols)
    return min(int(math.floor(smallest * rank_ratio)), smallest - 1)


# exercise svd-split (continued)
def svd_split(weight: torch.Tensor, rank_ratio: float) -> dict[str, torch.Tensor]:
    """W (N x M) -> U_high (N x k), S_high (k), V_high (k x M, rows), and the low parts with the
    remaining r = min(N, M) - k directions. The SVD runs in float64 here, fp32 in production.

    Returns {"U_high", "S_high", "V_high", "U_low", "S_low", "V_low"} in weight's dtype, with
    k = `frozen_rank(N, M, rank_ratio)`, singular values in descending order (so S_high >=
    S_low entrywise), orthonormal columns of U and rows of V, and
    (U_high * S_high) @ V_high + (U_low * S_low) @ V_low == W (to rounding)."""
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    k = frozen_rank(*weight.shape, rank_ratio)
    dtype = weight.dtype
    return {"U_high": u[:, :k].to(dtype), "S_high": s[:k].to(dtype), "V_high": vh[:k].to(dtype),
            "U_low": u[:, k:].to(dtype), "S_low": s[k:].to(dtype), "V_low": vh[k:].to(dtype)}


# ============================================================================ 2. the layer


def osft_forward_naive(x, U_high, S_high, V_high, U_low, S_low, V_low, bias):
    """y = ((x V_high^T) * S_high) U_high^T + ((x V_low^T) * S_low) U_low^T + b, as written:
    four matmuls on the (..., M) input, two (..., N) outputs, then an add (and the bias add)."""
    high = ((x @ V_high.T) * S_high) @ U_high.T
    low = ((x @ V_low.T) * S_low) @ U_low.T
    out = high + low
    return out if bias is None else out + bias


# exercise fused-forward (2 points): The fused forward: one output, addmm then addmm_
# hint: x2 = x.reshape(-1, M); out = (x2 V_high^T * S_high) U_high^T, with torch.addmm when
#   there is a bias; then out.addmm_(x2 V_low^T * S_low, U_low^T); view back to (..., N).
def osft_forward_fused(x, U_high, S_high, V_high, U_low, S_low, V_low, bias):
    """The same y with one (T, N) output tensor instead of three.

    x (..., M); U_high (N, k_h), S_high (k_h,), V_high (k_h, M); U_low (N, k_l), S_low (k_l,),
    V_low (k_l, M); bias (N,) or None. Returns y (..., N), equal to `osft_forward_naive` up to
    rounding. Flatten x to 2D (T = prod of the leading dims); the high part is one mm (or
    torch.addmm with the bias, which folds the bias into the GEMM); the low part is added into
    that same output by Tensor.addmm_. Same FLOPs as the naive form; it never writes the second
    (T, N) output, never re-reads both for the add, and never makes a pass for the bias: 2TN
    fewer elements moved, 4TN with a bias (`forward_cost`). Autograd works through both ops.
    """
    x2 = x.reshape(-1, x.shape[-1])
    coeff_high = x2.mm(V_high.T) * S_high
    out = coeff_high.mm(U_high.T) if bias is None else torch.addmm(bias, coeff_high, U_high.T)
    out.addmm_(x2.mm(V_low.T) * S_low, U_low.T)
    return out.view(*x.shape[:-1], out.shape[-1])


class OSFTLinear(nn.Module):
    """A linear layer stored as frozen high + trainable low singular parts.

    y = ((x V_high^T) * S_high) U_high^T + ((x V_low^T) * S_low) U_low^T + b
    x: (..., M) -> y: (..., N). The frozen factors are buffers; U_low, S_low, V_low and the
    bias are parameters.
    """

    def __init__(self, linear: nn.Linear, rank_ratio: float, fused: bool = True) -> None:
        super().__init__()
        parts = svd_split(linear.weight.detach(), rank_ratio)
        for name in ("U_high", "S_high", "V_high"):
            self.register_buffer(name, parts[name])  # frozen: not parameters
        self.U_low, self.S_low, self.V_low = (nn.Parameter(parts[n]) for n in ("U_low", "S_low", "V_low"))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (osft_forward_fused if self.fused else osft_forward_naive)(
            x, self.U_high, self.S_high, self.V_high, self.U_low, self.S_low, self.V_low, self.bias)

    def weight(self) -> torch.Tensor:
        """The dense weight this layer represents: U_high S_high V_high + U_low S_low V_low."""
        return (self.U_high * self.S_high) @ self.V_high + (self.U_low * self.S_low) @ self.V_low


# ============================================================================ 3. projections


# exercise projections (3 points): Project onto the complement: Gram form, then factored form
# hint: U side: subtract U_high (U_high^T dU), U_high on the left; V side (rows): subtract
#   (dV V_high^T) V_high, V_high on the right. Gram forms build U_high U_high^T / V_high^T V_high.
def project_u_gram(d_u: torch.Tensor, u_high: torch.Tensor) -> torch.Tensor:
    """dU - (U_high U_high^T) dU: builds an N x N matrix (2N^2 k_h FLOPs, then 2N^2 k_l).
    d_u (N, k_l), u_high (N, k_h) with orthonormal columns -> a new (N, k_l) tensor."""
    return d_u - (u_high @ u_high.T) @ d_u


# exercise projections (continued)
def project_v_gram(d_v: torch.Tensor, v_high: torch.Tensor) -> torch.Tensor:
    """dV - dV (V_high^T V_high): builds an M x M matrix. V_high is frozen, so this Gram matrix
    could be computed once and cached (M^2 numbers kept per module).
    d_v (k_l, M), v_high (k_h, M) with orthonormal rows -> a new (k_l, M) tensor."""
    return d_v - d_v @ (v_high.T @ v_high)


# exercise projections (continued)
def project_u_factored(d_u: torch.Tensor, u_high: torch.Tensor) -> torch.Tensor:
    """Remove from dU its component in the column span of U_high.

    d_u (N, k_l), u_high (N, k_h) with orthonormal columns -> (N, k_l):
    dU - U_high (U_high^T dU). The intermediate is the (k_h, k_l) coefficient matrix, never an
    N x N one: 4 N k_h k_l FLOPs instead of the Gram form's 2N^2 (k_h + k_l). Afterwards
    U_high^T result = 0 (to rounding)."""
    return d_u - u_high @ (u_high.T @ d_u)


# exercise projections (continued)
def project_v_factored(d_v: torch.Tensor, v_high: torch.Tensor) -> torch.Tensor:
    """Remove from dV's rows their component in the row span of V_high (V stored row-wise).

    d_v (k_l, M), v_high (k_h, M) with orthonormal rows -> (k_l, M): dV - (dV V_high^T) V_high.
    The intermediate is the (k_l, k_h) coefficient matrix: 4 M k_h k_l FLOPs instead of the
    Gram form's 2M^2 (k_h + k_l). Afterwards result V_high^T = 0 (to rounding)."""
    return d_v - (d_v @ v_high.T) @ v_high


@torch.no_grad()
def project_module(layer: OSFTLinear, gram: bool = False, what: str = "grad") -> None:
    """Project U_low and V_low's gradients (what="grad", before the step) or the parameters
    themselves (what="param", after the step) onto the complement of the frozen subspace."""
    project_u = project_u_gram if gram else project_u_factored
    project_v = project_v_gram if gram else project_v_factored
    for param, project, high in ((layer.U_low, project_u, layer.U_high),
                                 (layer.V_low, project_v, layer.V_high)):
        target = param.grad if what == "grad" else param.data
        target.copy_(project(target, high))


def orthogonality_error(layer: OSFTLinear) -> float:
    """max(|U_high^T U_low|, |V_low V_high^T|): 0 when the trainable part stays orthogonal."""
    products = (layer.U_high.T @ layer.U_low, layer.V_low @ layer.V_high.T)
    return max(float(p.detach().abs().max()) if p.numel() else 0.0 for p in products)


# ============================================================================ 4. sharded


def chunk_rows(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's dim-0 chunk with torch.chunk semantics, as FSDP2 shards a factor: chunks of
    ceil(n/p) rows; trailing ranks may get an empty chunk, shaped (0, ...)."""
    pieces = torch.chunk(tensor, world, dim=0)
    if rank < len(pieces):
        return pieces[rank].clone()
    return tensor.new_empty((0, *tensor.shape[1:]))


class Collectives:
    """The two collectives the projections use, over `group` (the ranks the factors' rows are
    split over, as FSDP2's shard group; None: the world), counted, so batching can be seen."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.all_reduces = 0
        self.all_gathers = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.all_reduces += 1
        dist.all_reduce(tensor, group=self.group)
        return tensor

    # exercise sharded-v (4 points): The sharded V side: all-gather V_high, not all-reduce
    # hint: the contraction over M is complete on every rank, so nothing is a partial sum:
    #   gather V_high's k_h rows (pad to ceil(k_h / p), dist.all_gather, cat, trim), then
    #   project the local rows of dV with the whole V_high.
    def all_gather_rows(self, local: torch.Tensor, total_rows: int) -> torch.Tensor:
        """Every rank's dim-0 chunk, concatenated: pad to the chunk size, gather, trim.

        local (n_r, ...): this rank's `chunk_rows` chunk of a (total_rows, ...) tensor split over
        the p ranks of `self.group` (chunk index = this rank's rank in the group; n_r may be 0;
        torch.chunk semantics: chunks of ceil(total_rows / p) rows, trailing ones shorter or
        empty). dist.all_gather needs equal shapes, so pad every chunk to ceil(total_rows / p)
        rows, gather over the group, concatenate in group-rank order and drop the padding:
        returns the whole (total_rows, ...) tensor on every rank of the group. Counts one
        all-gather in `self.all_gathers`."""
        self.all_gathers += 1
        world = dist.get_world_size(self.group)
        chunk = -(-total_rows // world)
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(pieces, padded, group=self.group)
        return torch.cat(pieces)[:total_rows]


# exercise sharded-u (3 points): The sharded U side: all-reduce the partial coefficients (batched)
# hint: U_high_local^T dU_local is a partial sum over this rank's rows: comm.all_reduce it, then
#   project the local rows. Batched: flatten + torch.cat, one all-reduce, split in the same order.
def sharded_project_u(d_u_local: torch.Tensor, u_high_local: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """`project_u_factored` with the N rows of dU and U_high split across the p ranks of
    `comm.group` (the world when it is None).

    d_u_local (n_r, k_l), u_high_local (n_r, k_h): this rank's rows (n_r may be 0). The
    contraction U_high^T dU runs over N, the sharded dimension, so each rank's
    U_high_local^T dU_local (k_h, k_l) is a partial sum: one all-reduce (k_h k_l numbers) gives
    every rank the full coefficients. Returns this rank's rows of the projected dU, (n_r, k_l).
    Uses `comm.all_reduce` (counted) exactly once, on every rank, even when n_r = 0."""
    coefficients = comm.all_reduce(u_high_local.T @ d_u_local)
    return d_u_local - u_high_local @ coefficients


# exercise sharded-u (continued)
def sharded_project_u_batched(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                              comm: Collectives) -> list[torch.Tensor]:
    """`sharded_project_u` for many modules with ONE all-reduce.

    pairs: one (d_u_local (n_r, k_l), u_high_local (n_r, k_h)) per module, shapes differing
    between modules. Compute every module's partial coefficients U_high_local^T dU_local,
    flatten and concatenate them (sum of k_h k_l numbers), all-reduce once, split back in the
    same order and project each module's rows. Returns the projected rows, one per module,
    equal to calling `sharded_project_u` per module. Same bytes; one collective's latency
    instead of one per module (224 per step for Llama-8B). Exactly one `comm.all_reduce`."""
    partials = [u_high.T @ d_u for d_u, u_high in pairs]
    flat = comm.all_reduce(torch.cat([p.reshape(-1) for p in partials]))
    out, start = [], 0
    for (d_u, u_high), partial in zip(pairs, partials):
        coefficients = flat[start:start + partial.numel()].view_as(partial)
        start += partial.numel()
        out.append(d_u - u_high @ coefficients)
    return out


def sharded_project_v_wrong(d_v_local: torch.Tensor, v_high_local: torch.Tensor,
                            comm: Collectives, k_low: int, k_high: int) -> torch.Tensor:
    """The tempting bug: treat dV_local V_high_local^T like the U side and all-reduce it.
    The contraction (over M) is complete on every rank: each holds a different BLOCK of the
    k_low x k_high coefficient matrix, and the sum mixes unrelated blocks. (Blocks are padded
    to a common shape so the all-reduce can even run.)"""
    world = dist.get_world_size()
    rows, cols = -(-k_low // world), -(-k_high // world)
    block = d_v_local.new_zeros(rows, cols)
    local = d_v_local @ v_high_local.T
    block[: local.shape[0], : local.shape[1]] = local
    mixed = comm.all_reduce(block)[: local.shape[0], : local.shape[1]]
    return d_v_local - mixed @ v_high_local


# exercise sharded-v (continued)
def sharded_project_v(d_v_local: torch.Tensor, v_high_local: torch.Tensor, comm: Collectives,
                      k_high: int) -> torch.Tensor:
    """`project_v_factored` with the rows (singular directions) of dV and V_high split across
    the ranks of `comm.group`.

    d_v_local (l_r, M), v_high_local (h_r, M): this rank's rows; M is whole on every rank.
    This rank's rows of the projection need dV_local V_high^T with ALL k_h rows of V_high, so
    all-gather V_high (k_h M numbers; V_high is frozen, so the gathered copy could be cached
    across steps), then project locally. Returns (l_r, M). One `comm.all_gather_rows`, no
    all-reduce (each rank's dV_local V_high_local^T is a different BLOCK of the coefficients,
    not a partial sum: summing blocks is the bug `sharded_project_v_wrong` shows)."""
    v_high = comm.all_gather_rows(v_high_local, k_high)
    return d_v_local - (d_v_local @ v_high.T) @ v_high


# ============================================================================ 5. the cost model


def forward_cost(tokens: int, n_rows: int, n_cols: int, k_high: int, k_low: int,
                 bias: bool = True, bytes_per_element: int = 4) -> dict:
    """FLOPs are the same for both forwards: 2T(M + N)(k_h + k_l) + T(k_h + k_l) (scaling by S)
    + TN (the add). Traffic on (T, N) tensors differs. Naive: write high, write low, read both,
    write the sum (5TN), and with a bias read and write it once more (7TN). Fused: addmm writes
    the output with the bias folded in, addmm_ reads it (beta = 1) and writes it (3TN). Saved:
    2TN elements without a bias, 4TN with one."""
    flops = 2 * tokens * (n_cols + n_rows) * (k_high + k_low) + tokens * (k_high + k_low) + tokens * n_rows
    saved = (4 if bias else 2) * tokens * n_rows
    return {"flops": flops, "extra_elements_naive": saved,
            "extra_bytes_naive": saved * bytes_per_element}


def gram_projection_flops(n_rows: int, n_cols: int, k_high: int, k_low: int,
                          cached_gram: bool = False) -> int:
    """U_high U_high^T (2N^2 k_h) then times dU (2N^2 k_l); V likewise with M. With the frozen
    Gram matrices cached, only the products with dU and dV remain: 2N^2 k_l + 2M^2 k_l."""
    build = 0 if cached_gram else 2 * (n_rows ** 2 + n_cols ** 2) * k_high
    return build + 2 * (n_rows ** 2 + n_cols ** 2) * k_low


def factored_projection_flops(n_rows: int, n_cols: int, k_high: int, k_low: int) -> int:
    """U_high^T dU, then U_high times it: 4 N k_h k_l; V likewise with M."""
    return 4 * (n_rows + n_cols) * k_high * k_low


def projection_flops(n_rows: int, n_cols: int, k_high: int, k_low: int) -> dict:
    """Both forms and their ratio. For one side, Gram / factored = N (k_h + k_l) / (2 k_h k_l);
    for a square weight split whole (k_h + k_l = N) that is N^2 / (2 k_h k_l): 2 at k_h = k_l,
    larger as the split gets unbalanced (5.5 at rank_ratio 0.9, N = 1024)."""
    gram = gram_projection_flops(n_rows, n_cols, k_high, k_low)
    factored = factored_projection_flops(n_rows, n_cols, k_high, k_low)
    return {"gram": gram, "factored": factored, "ratio": gram / factored}


def v_side_received_elements(n_cols: int, k_high: int, world: int) -> dict:
    """Numbers one rank receives per module and step for the two correct V-side options (ring
    collectives): all-gather V_high, (p-1)/p x k_h M (none after the first step if the frozen
    gathered copy is cached), or all-reduce the Gram matrix V_high^T V_high, which IS a sum over
    the sharded rows, 2(p-1)/p x M^2 (also cacheable: V_high never changes)."""
    return {"all_gather_v_high": (world - 1) * k_high * n_cols // world,
            "all_reduce_gram": 2 * (world - 1) * n_cols * n_cols // world}


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
