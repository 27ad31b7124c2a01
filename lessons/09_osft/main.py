"""Lesson 09: OSFT (orthogonal subspace fine-tuning) and its kernels, single-process and sharded.

The story, top to bottom:

1. `svd_split`: W (N x M) = U S V^T; the top k = floor(min(N, M) x rank_ratio) singular
   directions are frozen (U_high, S_high, V_high), the rest are trainable (U_low, S_low, V_low).
2. `OSFTLinear`: the factorized forward, naive (four matmuls and an add) and fused (flatten to
   2D, mm, then addmm_ into the same output).
3. Projections that keep training orthogonal to the frozen subspace: the gradients before the
   step and the parameters after it (Adam's element-wise scaling rotates updates out), each in
   the Gram form (N x N and M x M matrices) and the factored form (k_low x k_high coefficients).
4. Sharded: rows split across ranks (dim 0, torch.chunk semantics, empty tail shards too). The
   U side contracts over the sharded N: local products are partial sums, one all-reduce (and one
   for every module at once, batched). The V side contracts over M, which is not sharded: local
   products are blocks of coefficients, and all-reducing them is WRONG; all-gathering V_high is
   right. Both are checked against one process.
5. `--bench`: the kernels timed side by side with their FLOP and byte counts.
6. Continual learning: a model trained on task A, then on task B by full fine-tuning and by
   OSFT; the forgetting of task A for both.

Run: `python lessons/09_osft/main.py --world-size 4` (add `--bench` for the timings).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessons._launch import RankContext, inject_fault, is_reporting_rank, launch, one_thread
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    lesson_parser,
    merge_rank_checks,
    run_main,
)

LESSON = "09_osft"
# float64 checks: the factored and Gram forms, fused and naive, sharded and single-process
# differ only in summation order (~1e-16 relative); a wrong projection is off by O(1).
TOLERANCE = 1e-10

# ============================================================================ 1. the SVD split


def max_abs(tensor: torch.Tensor) -> float:
    """max |x|, 0 for an empty shard."""
    return float(tensor.detach().abs().max()) if tensor.numel() else 0.0


def frozen_rank(n_rows: int, n_cols: int, rank_ratio: float) -> int:
    """k = floor(min(N, M) x rank_ratio), capped at min(N, M) - 1 so something stays trainable."""
    smallest = min(n_rows, n_cols)
    return min(int(math.floor(smallest * rank_ratio)), smallest - 1)


def svd_split(weight: torch.Tensor, rank_ratio: float) -> dict[str, torch.Tensor]:
    """W (N x M) -> U_high (N x k), S_high (k), V_high (k x M, rows), and the low parts with the
    remaining r = min(N, M) - k directions. The SVD runs in float64 here, fp32 in production."""
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    k = frozen_rank(*weight.shape, rank_ratio)
    dtype = weight.dtype
    return {"U_high": u[:, :k].to(dtype), "S_high": s[:k].to(dtype), "V_high": vh[:k].to(dtype),
            "U_low": u[:, k:].to(dtype), "S_low": s[k:].to(dtype), "V_low": vh[k:].to(dtype)}


# ============================================================================ 2. the layer


class OSFTLinear(nn.Module):
    """A linear layer stored as frozen high + trainable low singular parts.

    y = ((x V_high^T) * S_high) U_high^T + ((x V_low^T) * S_low) U_low^T + b
    x: (..., M) -> y: (..., N).
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


def osft_forward_naive(x, U_high, S_high, V_high, U_low, S_low, V_low, bias):
    """Four matmuls on the (..., M) input and an add of two (..., N) outputs."""
    high = ((x @ V_high.T) * S_high) @ U_high.T
    low = ((x @ V_low.T) * S_low) @ U_low.T
    out = high + low
    return out if bias is None else out + bias


def osft_forward_fused(x, U_high, S_high, V_high, U_low, S_low, V_low, bias):
    """Flatten to 2D; the high part is one mm (or addmm with the bias); the low part is added
    into the same output by addmm_: no second (..., N) tensor, no separate add."""
    x2 = x.reshape(-1, x.shape[-1])
    coeff_high = x2.mm(V_high.T) * S_high
    out = coeff_high.mm(U_high.T) if bias is None else torch.addmm(bias, coeff_high, U_high.T)
    out.addmm_(x2.mm(V_low.T) * S_low, U_low.T)
    return out.view(*x.shape[:-1], out.shape[-1])


# ============================================================================ 3. projections


def project_u_factored(d_u: torch.Tensor, u_high: torch.Tensor) -> torch.Tensor:
    """dU - U_high (U_high^T dU): N x k_high times k_high x k_low coefficients."""
    return d_u - u_high @ (u_high.T @ d_u)


def project_u_gram(d_u: torch.Tensor, u_high: torch.Tensor) -> torch.Tensor:
    """dU - (U_high U_high^T) dU: builds an N x N matrix."""
    return d_u - (u_high @ u_high.T) @ d_u


def project_v_factored(d_v: torch.Tensor, v_high: torch.Tensor) -> torch.Tensor:
    """dV - (dV V_high^T) V_high, V stored row-wise (k x M): k_low x k_high coefficients."""
    return d_v - (d_v @ v_high.T) @ v_high


def project_v_gram(d_v: torch.Tensor, v_high: torch.Tensor) -> torch.Tensor:
    """dV - dV (V_high^T V_high): builds an M x M matrix."""
    return d_v - d_v @ (v_high.T @ v_high)


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
    return max(max_abs(layer.U_high.T @ layer.U_low), max_abs(layer.V_low @ layer.V_high.T))


def train_orthogonal(steps: int, project_params: bool, seed: int = 0, n_rows: int = 24,
                     n_cols: int = 16, rank_ratio: float = 0.5) -> dict:
    """Adam on one OSFTLinear (float64) with projected gradients, with or without projecting
    the parameters after each step; the orthogonality error after `steps` steps."""
    torch.manual_seed(seed)
    layer = OSFTLinear(nn.Linear(n_cols, n_rows).double(), rank_ratio)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(n_rows, n_cols, generator=generator, dtype=torch.float64)
    for _ in range(steps):
        x = torch.randn(32, n_cols, generator=generator, dtype=torch.float64)
        loss = (layer(x) - x @ target.T).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        project_module(layer, what="grad")
        optimizer.step()
        if project_params:
            project_module(layer, what="param")
    return {"orthogonality_error": orthogonality_error(layer), "loss": float(loss.detach())}


def single_process_checks(seed: int) -> tuple[list[Check], dict]:
    torch.manual_seed(seed)
    linear = nn.Linear(16, 24).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    checks = []
    layer = OSFTLinear(linear, 0.5)
    gap = max_abs(layer(x) - linear(x))
    checks.append(Check("at init the factorized layer reproduces the linear", gap <= TOLERANCE,
                        f"max |diff| {gap:.1e} (float64)"))
    naive = OSFTLinear(linear, 0.5, fused=False)
    y_fused, y_naive = layer(x), naive(x)
    y_fused.square().sum().backward()
    y_naive.square().sum().backward()
    grad_gap = max(max_abs(a.grad - b.grad) for a, b in zip(layer.parameters(), naive.parameters()))
    fwd_gap = max_abs(y_fused - y_naive)
    checks.append(Check("fused forward == naive (output and every gradient)",
                        max(fwd_gap, grad_gap) <= TOLERANCE,
                        f"output {fwd_gap:.1e}, gradients {grad_gap:.1e}"))
    d_u, d_v = layer.U_low.grad, layer.V_low.grad
    form_gap = max(max_abs(project_u_gram(d_u, layer.U_high) - project_u_factored(d_u, layer.U_high)),
                   max_abs(project_v_gram(d_v, layer.V_high) - project_v_factored(d_v, layer.V_high)))
    checks.append(Check("factored projection == Gram projection", form_gap <= TOLERANCE,
                        f"max |diff| {form_gap:.1e}"))
    with_params = train_orthogonal(300, True, seed)
    grads_only = train_orthogonal(300, False, seed)
    checks.append(Check("300 Adam steps: parameters stay orthogonal to the frozen subspace",
                        with_params["orthogonality_error"] <= TOLERANCE
                        and grads_only["orthogonality_error"] > 1e3 * TOLERANCE,
                        f"{with_params['orthogonality_error']:.1e} with the after-step projection, "
                        f"{grads_only['orthogonality_error']:.1e} with gradient projection only"))
    metrics = {"orthogonality_error": with_params["orthogonality_error"],
               "orthogonality_error_grads_only": grads_only["orthogonality_error"]}
    return checks, metrics


# ============================================================================ 4. sharded


def shard_rows(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's dim-0 shard with torch.chunk semantics (chunks of ceil(n/p); trailing ranks may
    get an empty shard, shaped (0, ...))."""
    pieces = torch.chunk(tensor, world, dim=0)
    if rank < len(pieces):
        return pieces[rank].clone()
    return tensor.new_empty((0, *tensor.shape[1:]))


class Collectives:
    """Counts the collectives issued, so batching can be seen."""

    def __init__(self) -> None:
        self.all_reduces = 0
        self.all_gathers = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.all_reduces += 1
        dist.all_reduce(tensor)
        return tensor

    def all_gather_rows(self, local: torch.Tensor, total_rows: int) -> torch.Tensor:
        """Every rank's dim-0 shard, concatenated: pad to the chunk size, gather, trim."""
        self.all_gathers += 1
        world = dist.get_world_size()
        chunk = -(-total_rows // world)
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(pieces, padded)
        return torch.cat(pieces)[:total_rows]


def sharded_project_u(d_u_local: torch.Tensor, u_high_local: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """N is sharded: U_high_local^T dU_local is a partial sum of U_high^T dU; all-reduce it."""
    coefficients = comm.all_reduce(u_high_local.T @ d_u_local)
    return d_u_local - u_high_local @ coefficients


def sharded_project_u_batched(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                              comm: Collectives) -> list[torch.Tensor]:
    """The same for many modules with ONE all-reduce: concatenate every module's partial
    coefficients, reduce once, split."""
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


def sharded_project_v(d_v_local: torch.Tensor, v_high_local: torch.Tensor, comm: Collectives,
                      k_high: int) -> torch.Tensor:
    """Right: all-gather V_high's rows, then the factored projection on the local dV rows."""
    v_high = comm.all_gather_rows(v_high_local, k_high)
    return d_v_local - (d_v_local @ v_high.T) @ v_high


def reference_gradients(seed: int, shapes: list[tuple[int, int]], rank_ratio: float) -> list[dict]:
    """One process: OSFT layers of the given (N, M) shapes, one backward, their factors and
    projected gradients (the single-process truth every rank compares its shard with)."""
    torch.manual_seed(seed)
    out = []
    for n_rows, n_cols in shapes:
        layer = OSFTLinear(nn.Linear(n_cols, n_rows).double(), rank_ratio)
        x = torch.randn(7, n_cols, dtype=torch.float64)
        layer(x).sin().sum().backward()
        out.append({"U_high": layer.U_high, "V_high": layer.V_high, "dU": layer.U_low.grad,
                    "dV": layer.V_low.grad,
                    "dU_projected": project_u_factored(layer.U_low.grad, layer.U_high),
                    "dV_projected": project_v_factored(layer.V_low.grad, layer.V_high)})
    return out


SHARD_SHAPES = [(6, 10), (9, 7), (16, 12)]  # on 4 ranks: empty tail shards in the first two


def sharded_checks(ctx: RankContext, seed: int) -> tuple[list[Check], dict]:
    rank, world = ctx.rank, ctx.world_size
    modules = reference_gradients(seed, SHARD_SHAPES, 0.5)
    comm = Collectives()
    u_gap = 0.0
    for module in modules:
        projected = sharded_project_u(shard_rows(module["dU"], rank, world),
                                      shard_rows(module["U_high"], rank, world), comm)
        u_gap = max(u_gap, max_abs(projected - shard_rows(module["dU_projected"], rank, world)))
    per_module = comm.all_reduces
    comm = Collectives()
    shards = [(shard_rows(m["dU"], rank, world), shard_rows(m["U_high"], rank, world)) for m in modules]
    batched = sharded_project_u_batched(shards, comm)
    batch_gap = max(max_abs(b - shard_rows(m["dU_projected"], rank, world))
                    for b, m in zip(batched, modules))
    batched_calls = comm.all_reduces
    right_gap, wrong_gap = 0.0, 0.0
    for module in modules:
        k_low, k_high = module["dV"].shape[0], module["V_high"].shape[0]
        d_v, v_high = shard_rows(module["dV"], rank, world), shard_rows(module["V_high"], rank, world)
        expected = shard_rows(module["dV_projected"], rank, world)
        right = sharded_project_v(d_v, v_high, comm, k_high)
        wrong = sharded_project_v_wrong(d_v, v_high, comm, k_low, k_high)
        right_gap = max(right_gap, max_abs(right - expected))
        wrong_gap = max(wrong_gap, max_abs(wrong - expected))
    # the wrong form's error shows on some rank: agree on the largest
    wrong_any = torch.tensor([wrong_gap], dtype=torch.float64)
    dist.all_reduce(wrong_any, op=dist.ReduceOp.MAX)
    sizes = [shard_rows(modules[0]["U_high"], r, world).shape[0] for r in range(world)]
    checks = [
        Check("U side: all-reduce of partial sums == one process", u_gap <= TOLERANCE,
              f"max |diff| {u_gap:.1e}; {modules[0]['U_high'].shape[0]} rows as {sizes} on {world} rank(s)"),
        Check("U side batched: ONE all-reduce for every module, same result",
              batch_gap <= TOLERANCE and batched_calls == 1 and per_module == len(modules),
              f"{per_module} all-reduces -> {batched_calls}; max |diff| {batch_gap:.1e}"),
        Check("V side: all-gather V_high rows, then project == one process", right_gap <= TOLERANCE,
              f"max |diff| {right_gap:.1e}"),
    ]
    if world > 1:
        checks.append(Check("V side: all-reducing local coefficient blocks is WRONG (detected)",
                            float(wrong_any) > 1e6 * TOLERANCE,
                            f"max |diff| {float(wrong_any):.2e} from the single-process gradient"))
    else:
        checks.append(Check("V side: all-reducing local coefficient blocks is WRONG (detected)", True,
                            "1 rank: one block is the whole matrix (shown on p > 1)"))
    return checks, {"u_gap": u_gap, "v_gap": right_gap, "v_wrong_gap": float(wrong_any),
                    "all_reduces_per_module": per_module, "all_reduces_batched": batched_calls}


# ============================================================================ 5. continual learning


class TwoHeadNet(nn.Module):
    """A shared trunk (two linears) and one classification head per task."""

    def __init__(self, inputs: int = 32, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.trunk = nn.ModuleList([nn.Linear(inputs, hidden), nn.Linear(hidden, hidden)])
        self.heads = nn.ModuleDict({"A": nn.Linear(hidden, classes), "B": nn.Linear(hidden, classes)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        for layer in self.trunk:
            x = F.relu(layer(x))
        return self.heads[task](x)


def make_task(seed: int, n: int = 2048, inputs: int = 32, classes: int = 4) -> tuple:
    """Labels from a random two-layer teacher on Gaussian inputs: learnable, not trivial."""
    generator = torch.Generator().manual_seed(seed)
    w1 = torch.randn(inputs, 16, generator=generator)
    w2 = torch.randn(16, classes, generator=generator)
    x = torch.randn(n, inputs, generator=generator)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x[: n // 2], y[: n // 2], x[n // 2:], y[n // 2:]  # train, then held-out


def accuracy(model: TwoHeadNet, x: torch.Tensor, y: torch.Tensor, task: str) -> float:
    with torch.no_grad():
        return float((model(x, task).argmax(dim=1) == y).float().mean())


def fit(model: TwoHeadNet, task: str, data: tuple, steps: int, lr: float, osft: bool, seed: int) -> None:
    x, y = data[0], data[1]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, x.shape[0], (64,), generator=generator)
        loss = F.cross_entropy(model(x[batch], task), y[batch])
        optimizer.zero_grad()
        loss.backward()
        if osft:
            for layer in model.trunk:
                project_module(layer, what="grad")
        optimizer.step()
        if osft:
            for layer in model.trunk:
                project_module(layer, what="param")


def continual_learning(seed: int, steps: int, rank_ratio: float = 0.75) -> dict:
    """Train on task A; then on task B two ways from the same start: full fine-tuning of the
    trunk, or OSFT of the trunk (top singular directions frozen). Head A is frozen in both.
    Forgetting = task-A accuracy before task B - after. One thread: the same numbers on every
    machine's thread count (the README quotes them)."""
    with one_thread():
        return _continual_learning(seed, steps, rank_ratio)


def _continual_learning(seed: int, steps: int, rank_ratio: float) -> dict:
    task_a, task_b = make_task(seed), make_task(seed + 1)
    torch.manual_seed(seed)
    base = TwoHeadNet()
    base.heads["B"].requires_grad_(False)
    fit(base, "A", task_a, steps, 3e-3, False, seed)
    before = accuracy(base, task_a[2], task_a[3], "A")
    results = {"acc_A_before": before}
    for name in ("full_ft", "osft"):
        model = TwoHeadNet()
        model.load_state_dict(base.state_dict())
        model.heads["A"].requires_grad_(False)
        model.heads["B"].requires_grad_(True)
        if name == "osft":
            model.trunk = nn.ModuleList(OSFTLinear(layer, rank_ratio) for layer in model.trunk)
        fit(model, "B", task_b, steps, 3e-3, name == "osft", seed + 2)
        results[f"acc_A_after_{name}"] = accuracy(model, task_a[2], task_a[3], "A")
        results[f"acc_B_{name}"] = accuracy(model, task_b[2], task_b[3], "B")
        results[f"forgetting_{name}"] = before - results[f"acc_A_after_{name}"]
    return results


# ============================================================================ 6. the benchmark


def forward_cost(tokens: int, n_rows: int, n_cols: int, k_high: int, k_low: int) -> dict:
    """FLOPs are the same for both forwards: 2T(M + N)(k_high + k_low) + 2Tk + TN (the add).
    Bytes (fp32) differ: the naive form writes two T x N outputs and reads them back to add."""
    flops = 2 * tokens * (n_cols + n_rows) * (k_high + k_low) + tokens * (k_high + k_low) + tokens * n_rows
    return {"flops": flops, "extra_bytes_naive": 3 * tokens * n_rows * 4}


def gram_projection_flops(n_rows: int, n_cols: int, k_high: int, k_low: int) -> int:
    """U_high U_high^T (2N^2 k_high) then times dU (2N^2 k_low); V likewise with M."""
    return 2 * n_rows ** 2 * (k_high + k_low) + 2 * n_cols ** 2 * (k_high + k_low)


def factored_projection_flops(n_rows: int, n_cols: int, k_high: int, k_low: int) -> int:
    """U_high^T dU, then U_high times it: 4 N k_high k_low; V likewise with M."""
    return 4 * (n_rows + n_cols) * k_high * k_low


def projection_flops(n_rows: int, n_cols: int, k_high: int, k_low: int) -> dict:
    return {"gram": gram_projection_flops(n_rows, n_cols, k_high, k_low),
            "factored": factored_projection_flops(n_rows, n_cols, k_high, k_low)}


def _best(fn, repeats: int) -> float:
    """Best of `repeats` timings after one warm-up; on a GPU, kernels are waited for."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    best = math.inf
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def bench_kernels(n_rows: int, n_cols: int, tokens: int, rank_ratio: float, repeats: int) -> dict:
    """Naive vs fused forward and Gram vs factored projection, fp32, measured side by side."""
    torch.manual_seed(0)
    layer = OSFTLinear(nn.Linear(n_cols, n_rows), rank_ratio)
    args = (layer.U_high, layer.S_high, layer.V_high, layer.U_low, layer.S_low, layer.V_low, layer.bias)
    x = torch.randn(tokens, n_cols)
    k_high, k_low = layer.U_high.shape[1], layer.U_low.shape[1]
    with torch.no_grad():
        naive = _best(lambda: osft_forward_naive(x, *args), repeats)
        fused = _best(lambda: osft_forward_fused(x, *args), repeats)
    d_u, d_v = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
    gram = _best(lambda: (project_u_gram(d_u, layer.U_high), project_v_gram(d_v, layer.V_high)), repeats)
    factored = _best(lambda: (project_u_factored(d_u, layer.U_high),
                              project_v_factored(d_v, layer.V_high)), repeats)
    return {"shape": [n_rows, n_cols], "tokens": tokens, "k_high": k_high, "k_low": k_low,
            "naive_s": naive, "fused_s": fused, "gram_s": gram, "factored_s": factored,
            "speedup_fused_forward": naive / fused, "speedup_factored_projection": gram / factored,
            **forward_cost(tokens, n_rows, n_cols, k_high, k_low),
            "projection_flops": projection_flops(n_rows, n_cols, k_high, k_low)}


def bench_all_reduce_worker(ctx: RankContext, n_modules: int, numel: int, repeats: int) -> dict:
    """One all-reduce per module vs one batched all-reduce of every module's coefficients."""
    tensors = [torch.randn(numel) for _ in range(n_modules)]

    def per_module():
        for tensor in tensors:
            dist.all_reduce(tensor)

    def batched():
        flat = torch.cat(tensors)
        dist.all_reduce(flat)
        return flat.split(numel)

    for fn in (per_module, batched):  # warm up
        fn()
    times = {}
    for name, fn in (("per_module_s", per_module), ("batched_s", batched)):
        dist.barrier()
        best = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - started)
        times[name] = best
    return times


# ============================================================================ the demo


def verify_worker(ctx: RankContext, seed: int, cl_steps: int, fault: str | None, fault_rank: int) -> dict:
    inject_fault(ctx, fault, fault_rank)
    checks, metrics = single_process_checks(seed)
    shard_checks, shard_metrics = sharded_checks(ctx, seed)
    checks += shard_checks
    metrics["sharded"] = shard_metrics
    if ctx.rank == 0:
        metrics["continual"] = continual_learning(seed, cl_steps)
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("OSFT: factorized linears, orthogonal projections, and their sharded "
                           "all-reduce / all-gather, checked against one process.")
    parser.add_argument("--steps", type=int_in(10, 20000), default=400,
                        help="training steps per task in the continual-learning demo (default 400)")
    parser.add_argument("--bench", action="store_true",
                        help="time naive/fused forward, Gram/factored projection, per-module/"
                             "batched all-reduce")
    parser.add_argument("--bench-size", type=int_in(64, 8192), default=1024,
                        help="N = M of the benchmarked weight (default 1024)")
    parser.add_argument("--rank-ratio", type=float_in(0.0, 1.0), default=0.5,
                        help="fraction of singular directions frozen in the benchmark (default 0.5)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        parser.error("--device cuda: this demo runs on the CPU (the notebook benchmarks the kernels on CUDA)")
    check_args(parser, args)
    if args.quick:
        args.steps = min(args.steps, 150)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results = launch(verify_worker, args.world_size, (args.seed, args.steps, args.fault, args.fault_rank),
                     device="cpu", timeout_s=args.timeout)
    checks = merge_rank_checks([r["checks"] for r in results])
    metrics = dict(results[0]["metrics"])
    continual = metrics["continual"]
    metrics["forgetting_full_ft"] = continual["forgetting_full_ft"]
    metrics["forgetting_osft"] = continual["forgetting_osft"]
    if args.bench:
        size = 256 if args.quick else args.bench_size
        kernels = bench_kernels(size, size, 4 * size, args.rank_ratio, 3 if args.quick else 10)
        reduce = launch(bench_all_reduce_worker, args.world_size, (224, 4096, 5),
                        device="cpu", timeout_s=max(args.timeout, 300.0))[0]
        metrics["bench"] = {"kernels": kernels, "all_reduce": reduce}
        metrics["speedup_fused_forward"] = kernels["speedup_fused_forward"]
        metrics["speedup_factored_projection"] = kernels["speedup_factored_projection"]
        metrics["speedup_batched_all_reduce"] = reduce["per_module_s"] / reduce["batched_s"]
        if is_reporting_rank():
            print(f"forward   naive {kernels['naive_s'] * 1e3:8.2f} ms  "
                  f"fused {kernels['fused_s'] * 1e3:8.2f} ms"
                  f"  x{kernels['speedup_fused_forward']:.2f}  (same {kernels['flops']:.2e} FLOPs; "
                  f"naive moves {kernels['extra_bytes_naive'] / 1e6:.1f} MB more)")
            flops = kernels["projection_flops"]
            print(f"project   Gram  {kernels['gram_s'] * 1e3:8.2f} ms  "
                  f"factored {kernels['factored_s'] * 1e3:8.2f} ms"
                  f"  x{kernels['speedup_factored_projection']:.2f}  (FLOPs {flops['gram']:.2e} vs "
                  f"{flops['factored']:.2e})")
            print(f"all-reduce 224 x 4096 floats: per module {reduce['per_module_s'] * 1e3:.2f} ms, "
                  f"batched {reduce['batched_s'] * 1e3:.2f} ms  x{metrics['speedup_batched_all_reduce']:.2f}")
    metrics["headline"] = (f"forgetting of task A: full FT {metrics['forgetting_full_ft']:.1%}, "
                           f"OSFT {metrics['forgetting_osft']:.1%}")
    return finish(Report(LESSON, "cpu", "gloo", len(results), checks, metrics), args.json, started)


if __name__ == "__main__":
    run_main(main)
