"""Lesson 09's proof: single-process references for every kernel, the sharded projections on
p ranks against one process, the forgetting demo (with the right and with the wrong V
projection), and the CLI. The technique itself is in main.py; the timings in bench.py.

Run: `python lessons/09_osft/main.py` (this module's `main()` is what it runs).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessons._checks import max_abs_diff
from lessons._launch import RankContext, choose_device, inject_fault, one_thread
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    launch_checks,
    lesson_parser,
)

from . import main as osft

LESSON = "09_osft"
# Every check runs in float64 (on the CPU or a GPU: the same unit roundoff, 1.1e-16). The
# factored and Gram forms, fused and naive, sharded and single-process differ only in
# summation order, O(terms x eps x |values|) < 1e-13 at these sizes; a wrong projection is off
# by O(1). So 1e-10 separates the two by orders of magnitude on either device.
TOLERANCE = 1e-10
SHARD_SHAPES = [(6, 10), (9, 7), (16, 12)]  # on 4 ranks: empty tail chunks in the first two
WRONG_V_WORLD = 4  # ranks the forgetting demo emulates for the all-reduced V projection


# ============================================================================ single process


def train_orthogonal(steps: int, project_params: bool, seed: int = 0, n_rows: int = 24,
                     n_cols: int = 16, rank_ratio: float = 0.5, device: str | torch.device = "cpu") -> dict:
    """Adam on one OSFTLinear (float64) with projected gradients, with or without projecting
    the parameters after each step; the orthogonality error after `steps` steps. One thread:
    the matrices are tiny, and the README quotes the result."""
    with one_thread():
        return _train_orthogonal(steps, project_params, seed, n_rows, n_cols, rank_ratio, device)


def _train_orthogonal(steps: int, project_params: bool, seed: int, n_rows: int, n_cols: int,
                      rank_ratio: float, device: str | torch.device) -> dict:
    torch.manual_seed(seed)
    layer = osft.OSFTLinear(nn.Linear(n_cols, n_rows).double(), rank_ratio).to(device)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(n_rows, n_cols, generator=generator, dtype=torch.float64).to(device)
    for _ in range(steps):
        x = torch.randn(32, n_cols, generator=generator, dtype=torch.float64).to(device)
        loss = (layer(x) - x @ target.T).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        osft.project_module(layer, what="grad")
        optimizer.step()
        if project_params:
            osft.project_module(layer, what="param")
    return {"orthogonality_error": osft.orthogonality_error(layer), "loss": float(loss.detach())}


def single_process_checks(seed: int, device: str | torch.device = "cpu") -> tuple[list[Check], dict]:
    """The layer against nn.Linear, fused against naive, factored against Gram, and the
    orthogonality of the trainable factors after 300 Adam steps (float64, on `device`)."""
    torch.manual_seed(seed)
    linear = nn.Linear(16, 24).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    linear, x = linear.to(device), x.to(device)
    checks = []
    layer = osft.OSFTLinear(linear, 0.5)
    gap = max_abs_diff(layer(x), linear(x))
    checks.append(Check("at init the factorized layer reproduces the linear", gap <= TOLERANCE,
                        f"max |diff| {gap:.1e} (float64)"))
    naive = osft.OSFTLinear(linear, 0.5, fused=False)
    y_fused, y_naive = layer(x), naive(x)
    y_fused.square().sum().backward()
    y_naive.square().sum().backward()
    grad_gap = max(max_abs_diff(a.grad, b.grad) for a, b in zip(layer.parameters(), naive.parameters()))
    fwd_gap = max_abs_diff(y_fused, y_naive)
    checks.append(Check("fused forward == naive (output and every gradient)",
                        max(fwd_gap, grad_gap) <= TOLERANCE,
                        f"output {fwd_gap:.1e}, gradients {grad_gap:.1e}"))
    d_u, d_v = layer.U_low.grad, layer.V_low.grad
    u_high, v_high = layer.U_high, layer.V_high
    form_gap = max(max_abs_diff(osft.project_u_gram(d_u, u_high), osft.project_u_factored(d_u, u_high)),
                   max_abs_diff(osft.project_v_gram(d_v, v_high), osft.project_v_factored(d_v, v_high)))
    checks.append(Check("factored projection == Gram projection", form_gap <= TOLERANCE,
                        f"max |diff| {form_gap:.1e}"))
    with_params = train_orthogonal(300, True, seed, device=device)
    grads_only = train_orthogonal(300, False, seed, device=device)
    checks.append(Check("300 Adam steps: parameters stay orthogonal to the frozen subspace",
                        with_params["orthogonality_error"] <= TOLERANCE
                        and grads_only["orthogonality_error"] > 1e3 * TOLERANCE,
                        f"{with_params['orthogonality_error']:.1e} with the after-step projection, "
                        f"{grads_only['orthogonality_error']:.1e} with gradient projection only"))
    metrics = {"orthogonality_error": with_params["orthogonality_error"],
               "orthogonality_error_grads_only": grads_only["orthogonality_error"]}
    return checks, metrics


# ============================================================================ sharded


def reference_gradients(seed: int, shapes: list[tuple[int, int]], rank_ratio: float) -> list[dict]:
    """One process, on the CPU: OSFT layers of the given (N, M) shapes, one backward, their
    factors and projected gradients (the truth every rank compares its chunk with)."""
    torch.manual_seed(seed)
    out = []
    for n_rows, n_cols in shapes:
        layer = osft.OSFTLinear(nn.Linear(n_cols, n_rows).double(), rank_ratio)
        x = torch.randn(7, n_cols, dtype=torch.float64)
        layer(x).sin().sum().backward()
        out.append({"U_high": layer.U_high, "V_high": layer.V_high, "dU": layer.U_low.grad,
                    "dV": layer.V_low.grad,
                    "dU_projected": osft.project_u_factored(layer.U_low.grad, layer.U_high),
                    "dV_projected": osft.project_v_factored(layer.V_low.grad, layer.V_high)})
    return out


def all_reduced_v_projection(d_v: torch.Tensor, v_high: torch.Tensor, world: int) -> torch.Tensor:
    """What `sharded_project_v_wrong` computes on `world` ranks, emulated in one process: each
    rank's (padded) block dV_r V_high_r^T, summed as the all-reduce sums them, each rank's rows
    projected with its corner of that sum; the rows of every rank, concatenated (k_l, M)."""
    rows, cols = -(-d_v.shape[0] // world), -(-v_high.shape[0] // world)
    shards = [(osft.chunk_rows(d_v, r, world), osft.chunk_rows(v_high, r, world)) for r in range(world)]
    mixed = d_v.new_zeros(rows, cols)
    for d_v_r, v_high_r in shards:
        mixed[: d_v_r.shape[0], : v_high_r.shape[0]] += d_v_r @ v_high_r.T
    return torch.cat([d_v_r - mixed[: d_v_r.shape[0], : v_high_r.shape[0]] @ v_high_r
                      for d_v_r, v_high_r in shards])


def sharded_checks(ctx: RankContext, seed: int) -> tuple[list[Check], dict]:
    """The U side (one by one and batched) and the V side (right and wrong) on this rank's
    chunks, on ctx.device, against the single-process projection of the same gradients."""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    modules = reference_gradients(seed, SHARD_SHAPES, 0.5)

    def chunk(tensor: torch.Tensor) -> torch.Tensor:
        return osft.chunk_rows(tensor, rank, world).to(device)

    comm = osft.Collectives()
    u_gap = 0.0
    for module in modules:
        projected = osft.sharded_project_u(chunk(module["dU"]), chunk(module["U_high"]), comm)
        u_gap = max(u_gap, max_abs_diff(projected, chunk(module["dU_projected"])))
    per_module = comm.all_reduces
    comm = osft.Collectives()
    batched = osft.sharded_project_u_batched([(chunk(m["dU"]), chunk(m["U_high"])) for m in modules], comm)
    batch_gap = max(max_abs_diff(b, chunk(m["dU_projected"])) for b, m in zip(batched, modules))
    batched_calls = comm.all_reduces
    right_gap = wrong_gap = emulation_gap = 0.0
    for module in modules:
        k_low, k_high = module["dV"].shape[0], module["V_high"].shape[0]
        d_v, v_high = chunk(module["dV"]), chunk(module["V_high"])
        right = osft.sharded_project_v(d_v, v_high, comm, k_high)
        wrong = osft.sharded_project_v_wrong(d_v, v_high, comm, k_low, k_high)
        right_gap = max(right_gap, max_abs_diff(right, chunk(module["dV_projected"])))
        wrong_gap = max(wrong_gap, max_abs_diff(wrong, chunk(module["dV_projected"])))
        emulated = all_reduced_v_projection(module["dV"], module["V_high"], world)
        emulation_gap = max(emulation_gap, max_abs_diff(wrong, osft.chunk_rows(emulated, rank, world)))
    # the wrong form's error shows on some rank, the emulation must hold on all: agree on maxima
    gaps = torch.tensor([wrong_gap, emulation_gap], dtype=torch.float64, device=device)
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    wrong_any, emulation_any = gaps.tolist()
    sizes = [osft.chunk_rows(modules[0]["U_high"], r, world).shape[0] for r in range(world)]
    wrong_name = "V side: all-reducing local coefficient blocks is WRONG (detected)"
    checks = [
        Check("U side: all-reduce of partial sums == one process", u_gap <= TOLERANCE,
              f"max |diff| {u_gap:.1e}; {modules[0]['U_high'].shape[0]} rows as {sizes} on {world} rank(s)"),
        Check("U side batched: ONE all-reduce for every module, same result",
              batch_gap <= TOLERANCE and batched_calls == 1 and per_module == len(modules),
              f"{per_module} all-reduces -> {batched_calls}; max |diff| {batch_gap:.1e}"),
        Check("V side: all-gather V_high rows, then project == one process", right_gap <= TOLERANCE,
              f"max |diff| {right_gap:.1e}"),
        Check(wrong_name, (world == 1 or wrong_any > 1e6 * TOLERANCE) and emulation_any <= TOLERANCE,
              (f"max |diff| {wrong_any:.2e} from the single-process gradient; "
               if world > 1 else "1 rank: one block is the whole matrix (shown on p > 1); ")
              + f"one-process emulation of it matches to {emulation_any:.1e}"),
    ]
    return checks, {"u_gap": u_gap, "v_gap": right_gap, "v_wrong_gap": wrong_any,
                    "all_reduces_per_module": per_module, "all_reduces_batched": batched_calls}


# ============================================================================ forgetting demo


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
    """Labels from a random two-layer teacher on Gaussian inputs (float64): learnable, not
    trivial. Returns train x, y, then held-out x, y."""
    generator = torch.Generator().manual_seed(seed)
    w1 = torch.randn(inputs, 16, generator=generator, dtype=torch.float64)
    w2 = torch.randn(16, classes, generator=generator, dtype=torch.float64)
    x = torch.randn(n, inputs, generator=generator, dtype=torch.float64)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x[: n // 2], y[: n // 2], x[n // 2:], y[n // 2:]


@torch.no_grad()
def evaluate_task(model: TwoHeadNet, data: tuple, task: str) -> tuple[float, float]:
    """Held-out (accuracy, cross-entropy loss)."""
    logits = model(data[2], task)
    return float((logits.argmax(dim=1) == data[3]).double().mean()), float(F.cross_entropy(logits, data[3]))


@torch.no_grad()
def project_module_all_reduced_v(layer: osft.OSFTLinear, what: str = "grad",
                                 world: int = WRONG_V_WORLD) -> None:
    """`project_module` with the V side done as p ranks do it with the all-reduce bug
    (`all_reduced_v_projection`); the U side stays right."""
    target = layer.U_low.grad if what == "grad" else layer.U_low.data
    target.copy_(osft.project_u_factored(target, layer.U_high))
    target = layer.V_low.grad if what == "grad" else layer.V_low.data
    target.copy_(all_reduced_v_projection(target, layer.V_high, world))


def v_side_error(layer: osft.OSFTLinear) -> float:
    """max |V_low V_high^T|: the V half of `orthogonality_error`."""
    return float((layer.V_low @ layer.V_high.T).detach().abs().max())


# name -> (project the gradients with, project the parameters after the step with)
VARIANTS = {
    "full_ft": (None, None),
    "osft": (osft.project_module, osft.project_module),
    "osft_grads": (osft.project_module, None),  # as mini_trainer runs it: gradients only
    "osft_grads_wrong_v": (project_module_all_reduced_v, None),
}


def fit(model: TwoHeadNet, task: str, data: tuple, steps: int, lr: float, seed: int,
        project_grads=None, project_params=None) -> None:
    """Adam on mini-batches of 64; `project_grads(layer, what="grad")` runs on every trunk
    layer before the step, `project_params(layer, what="param")` after it (None: skip)."""
    x, y = data[0], data[1]
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, x.shape[0], (64,), generator=generator)
        loss = F.cross_entropy(model(x[batch], task), y[batch])
        optimizer.zero_grad()
        loss.backward()
        for layer in model.trunk if project_grads is not None else ():
            project_grads(layer, what="grad")
        optimizer.step()
        for layer in model.trunk if project_params is not None else ():
            project_params(layer, what="param")


def continual_learning(seed: int, steps: int, rank_ratio: float = 0.75,
                       variants: tuple[str, ...] = tuple(VARIANTS)) -> dict:
    """Train on task A; then on task B from that same start in each of `variants` (VARIANTS):
    full fine-tuning of the trunk; OSFT of the trunk (top singular directions frozen) with both
    projections; OSFT projecting gradients only; and the same with the V projection all-reduced
    as the bug does on 4 ranks. Head A is frozen. Forgetting = task-A accuracy before task B -
    after. Float64 on one thread: the README's numbers on any CPU."""
    with one_thread():
        return _continual_learning(seed, steps, rank_ratio, variants)


def _continual_learning(seed: int, steps: int, rank_ratio: float, variants: tuple[str, ...]) -> dict:
    task_a, task_b = make_task(seed), make_task(seed + 1)
    torch.manual_seed(seed)
    base = TwoHeadNet().double()
    base.heads["B"].requires_grad_(False)
    fit(base, "A", task_a, steps, 3e-3, seed)
    before = evaluate_task(base, task_a, "A")[0]
    results = {"acc_A_before": before}
    for name in variants:
        project_grads, project_params = VARIANTS[name]
        model = TwoHeadNet().double()
        model.load_state_dict(base.state_dict())
        model.heads["A"].requires_grad_(False)
        model.heads["B"].requires_grad_(True)
        if project_grads is not None:
            model.trunk = nn.ModuleList(osft.OSFTLinear(layer, rank_ratio) for layer in model.trunk)
        fit(model, "B", task_b, steps, 3e-3, seed + 2, project_grads, project_params)
        results[f"acc_A_after_{name}"] = evaluate_task(model, task_a, "A")[0]
        results[f"acc_B_{name}"], results[f"loss_B_{name}"] = evaluate_task(model, task_b, "B")
        results[f"forgetting_{name}"] = before - results[f"acc_A_after_{name}"]
        if project_grads is not None:
            results[f"orthogonality_error_{name}"] = max(map(osft.orthogonality_error, model.trunk))
            results[f"v_side_error_{name}"] = max(map(v_side_error, model.trunk))
    return results


def continual_checks(result: dict) -> list[Check]:
    """What the forgetting demo must show: OSFT forgets less than full fine-tuning; with the
    V projection all-reduced, the task-B loss stays within 15% of the right run's (higher or
    lower: no signal, like the 0.924 vs 0.925 a throughput PR reports) while the V side leaves
    the orthogonal complement (more than 5x the right gradient-only run's error)."""
    right, wrong = "osft_grads", "osft_grads_wrong_v"
    loss_gap = abs(result[f"loss_B_{wrong}"] / result[f"loss_B_{right}"] - 1)
    return [
        Check("forgetting demo: OSFT forgets less of task A than full fine-tuning",
              result["forgetting_osft"] < result["forgetting_full_ft"]
              and result["orthogonality_error_osft"] <= TOLERANCE,
              f"forgetting {result['forgetting_osft']:.1%} vs {result['forgetting_full_ft']:.1%} "
              f"(CPU, float64); orthogonality error {result['orthogonality_error_osft']:.1e}"),
        Check(f"wrong V projection ({WRONG_V_WORLD} ranks, gradients only): the task-B loss does not "
              "reveal it, the V side leaves the allowed subspace",
              loss_gap < 0.15 and result[f"v_side_error_{wrong}"] > 5 * result[f"v_side_error_{right}"],
              f"held-out task-B loss {result[f'loss_B_{wrong}']:.3f} vs {result[f'loss_B_{right}']:.3f}; "
              f"max |V_low V_high^T| {result[f'v_side_error_{wrong}']:.2f} vs "
              f"{result[f'v_side_error_{right}']:.2f}; forgetting {result[f'forgetting_{wrong}']:.1%} "
              f"vs {result[f'forgetting_{right}']:.1%}"),
    ]


# ============================================================================ the demo and the CLI


def verify_worker(ctx: RankContext, seed: int, cl_steps: int, fault: str | None, fault_rank: int) -> dict:
    """Every rank: the single-process checks and the sharded checks on its device; ranks 0 and 1
    run the forgetting demo (CPU, float64), and every rank reports its checks."""
    inject_fault(ctx, fault, fault_rank)
    checks, metrics = single_process_checks(seed, ctx.device)
    shard_checks, shard_metrics = sharded_checks(ctx, seed)
    checks += shard_checks
    metrics["sharded"] = shard_metrics
    # ranks 0 and 1 share the forgetting demo's runs (rank 0 does all of them alone)
    parts = [("full_ft", "osft"), ("osft_grads", "osft_grads_wrong_v")]
    mine = parts if ctx.world_size == 1 else parts[ctx.rank: ctx.rank + 1] if ctx.rank < 2 else []
    gathered: list = [None] * ctx.world_size
    part = {}
    for variants in mine:
        part.update(continual_learning(seed, cl_steps, variants=variants))
    dist.all_gather_object(gathered, part)
    continual = {key: value for result in gathered for key, value in result.items()}
    metrics["continual"] = continual
    checks += continual_checks(continual)
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
    check_args(parser, args)
    if args.quick:
        args.steps = min(args.steps, 150)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    device, backend = choose_device(args.device, args.world_size)
    results, checks = launch_checks(verify_worker, args, (args.seed, args.steps))
    metrics = dict(results[0]["metrics"])
    continual = metrics["continual"]
    metrics["forgetting_full_ft"] = continual["forgetting_full_ft"]
    metrics["forgetting_osft"] = continual["forgetting_osft"]
    metrics["continual_device"] = "cpu"  # the forgetting demo's numbers are the README's, on any device
    if args.bench:
        from . import bench
        metrics["bench"] = bench.run(args, device)
    metrics["headline"] = (f"forgetting of task A: full FT {metrics['forgetting_full_ft']:.1%}, "
                           f"OSFT {metrics['forgetting_osft']:.1%}")
    return finish(Report(LESSON, device, backend, len(results), checks, metrics), args.json, started)
