"""Lesson 03's proof: every ZeRO stage (main.py, and zero3.py for stage 3) against plain data
parallelism over the same ring, one process on the whole batch, torch's ZeroRedundancyOptimizer
and FSDP2 `fully_shard`; the bytes held and sent against the formulas; global-norm clipping on
shards against `torch.nn.utils.clip_grad_norm_`; the demo's check table and the CLI
(`--memory` is the paper's calculator).

Tolerances: every run is float64 (on CUDA too: TF32 applies to float32 only), so the stages
differ from plain DP and from one process only in the order gradients are summed (about 1e-16
per step); 1e-10 leaves room for a few Adam steps, while a wrong shard, a missed average, a
stale parameter or a per-shard clipping factor is off by more than 1e-4.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from lessons._checks import max_abs_diff
from lessons._launch import RankContext, inject_fault, is_reporting_rank
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

from . import main as zero
from . import zero3

collectives, data_parallel = zero.collectives, zero.data_parallel
LESSON = "03_zero"
# Lesson 02's model with 3 outputs: Psi = 1,699 is odd (uneven shards for any p > 1), and a
# 3-element bias on 4 ranks leaves rank 3 owning nothing of it.
SIZES = {"d_in": 16, "hidden": 32, "d_out": 3}
TOLERANCE = 1e-10  # see the module docstring
CLIP_FRACTION = 0.5  # the clipping checks use max_norm = half the first step's gradient norm


# ============================================================================ the baseline


class RingDataParallelAdam:
    """Plain data parallelism over lesson 01's ring, the baseline every stage must equal:
    all-reduce and average every gradient, Adam on the full parameters (states 2 Psi)."""

    def __init__(self, model: nn.Module, lr: float = zero.LR):
        self.model, self.traffic = model, collectives.Traffic()
        data_parallel.broadcast_parameters_and_buffers(model)
        self.named = list(model.named_parameters())
        self.optimizer = torch.optim.Adam([p for _, p in self.named], lr=lr, foreach=False)

    def step(self) -> None:
        for _, param in self.named:
            param.grad = collectives.ring_all_reduce(param.grad, self.traffic) / dist.get_world_size()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


TRAINERS = {0: RingDataParallelAdam, 1: zero.ZeroStage1, 2: zero.ZeroStage2, 3: zero3.ZeroStage3}


def expected_live_bytes(stage: int, num_params: int, shard_params: int, itemsize: int) -> dict[str, int]:
    """main.py's memory formula for one rank of the model at hand, exactly: full precision, plain
    Adam (no master copy, 2 states), Psi = num_params elements, Psi_r = shard_params the
    elements this rank owns (uneven shards make Psi_r differ from Psi / N).
    stage 0 (plain DP) or 1-3 -> bytes of {"params": Psi or Psi_r (stage 3), "grads": Psi or
    Psi_r (stages 2, 3), "optimizer": 2 Psi or 2 Psi_r (stages 1-3)} x itemsize."""
    params = shard_params if stage == 3 else num_params
    grads = shard_params if stage >= 2 else num_params
    states = 2 * (shard_params if stage >= 1 else num_params)
    return {"params": params * itemsize, "grads": grads * itemsize, "optimizer": states * itemsize}


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (views share one)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def live_bytes(trainer) -> dict[str, int]:
    """Bytes of parameters, gradients and Adam states `trainer` holds now, counted from the
    live tensors (Adam's scalar step counters left out). Under ZeRO-3 the freed full
    parameters and any copy regathered for backward are counted too: both must be empty."""
    full = [p for _, p in trainer.named]
    params = full
    if isinstance(trainer, zero3.ZeroStage3):
        params = trainer.shards + full + list(trainer.regathered.values())
    grads = [p.grad for p in full] + [s.grad for s in getattr(trainer, "shards", [])]
    states = [value for state in trainer.optimizer.state.values()
              for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads),
            "optimizer": storage_bytes(states)}


def full_parameters(trainer) -> torch.Tensor:
    """Every parameter, flattened and concatenated in named_parameters() order (ZeRO-3:
    all-gathered from the shards)."""
    if isinstance(trainer, zero3.ZeroStage3):
        return torch.cat([collectives.ring_all_gather(shard.detach(), shape.numel())
                          for shard, shape in zip(trainer.shards, trainer.shapes)])
    return data_parallel.flat_params(trainer.model)


# ============================================================================ the runs


def batch_on(ctx: RankContext, step: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step `step`'s global batch, on the rank's device."""
    x, y = data_parallel.global_batch(step, batch, seed, SIZES["d_in"], SIZES["d_out"])
    return (data_parallel.local_shard(x, ctx.rank, ctx.world_size).to(ctx.device),
            data_parallel.local_shard(y, ctx.rank, ctx.world_size).to(ctx.device))


def mean_over_ranks(ctx: RankContext, value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return total.item() / ctx.world_size


def train(ctx: RankContext, make_trainer, seed: int, steps: int, batch: int,
          max_norm: float | None = None) -> dict:
    """Train lesson 02's model with `make_trainer(model)` (a class of TRAINERS, or a broken one
    from the tests) on this rank's rows of every batch. Records the mean loss, the bytes sent
    and the global gradient norm (with `max_norm`) per step, and the bytes held: gradients at
    the end of the last backward (their peak), parameters and Adam states after the last step."""
    model = data_parallel.make_model(seed + ctx.rank, **SIZES).to(ctx.device)  # fixed by the broadcast
    trainer = make_trainer(model)
    losses, bytes_per_step, norms, memory = [], [], [], {}
    for step in range(steps):
        trainer.zero_grad()
        before = trainer.traffic.bytes_sent
        x, y = batch_on(ctx, step, batch, seed)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads_at_peak = live_bytes(trainer)["grads"]
        if max_norm is None:
            trainer.step()
        else:
            norms.append(trainer.step(max_norm=max_norm).item())
        bytes_per_step.append(trainer.traffic.bytes_sent - before)
        memory = dict(live_bytes(trainer), grads=grads_at_peak)
        losses.append(mean_over_ranks(ctx, loss.item()))
    numels = [shape.numel() for shape in getattr(trainer, "shapes", [p.shape for _, p in trainer.named])]
    bounds = [zero.shard_bounds(numel, ctx.world_size, ctx.rank) for numel in numels]
    return {"losses": losses, "params": full_parameters(trainer).tolist(), "memory": memory,
            "bytes_per_step": bytes_per_step, "norms": norms,
            "shard_params": sum(end - start for start, end in bounds), "numels": numels}


def train_single_process_adam(seed: int, steps: int, batch: int,
                              max_norm: float | None = None) -> dict:
    """One process on CPU, the whole batch, torch Adam (and torch.nn.utils.clip_grad_norm_
    with `max_norm`): the trajectory every stage must follow, on any device. Records every
    step's global gradient norm (before clipping)."""
    model = data_parallel.make_model(seed, **SIZES)
    optimizer = torch.optim.Adam(model.parameters(), lr=zero.LR, foreach=False)
    losses, norms = [], []
    for step in range(steps):
        x, y = data_parallel.global_batch(step, batch, seed, SIZES["d_in"], SIZES["d_out"])
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if max_norm is None:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": data_parallel.flat_params(model), "norms": norms}


@contextlib.contextmanager
def counting_broadcasts(counter: dict):
    """Count the elements of every dist.broadcast issued inside the block (ZeroRedundancy-
    Optimizer calls `dist.broadcast(tensor=...)` through the torch.distributed module)."""
    original = dist.broadcast

    def broadcast(tensor, *args, **kwargs):
        counter["broadcast"] += tensor.numel()
        return original(tensor, *args, **kwargs)

    dist.broadcast = broadcast
    try:
        yield
    finally:
        dist.broadcast = original


def counting_all_reduce_hook(counter: dict, bucket):  # no annotation: DDP checks it
    """A DDP comm hook: count the bucket's elements, then DDP's own all-reduce (average)."""
    counter["all_reduce"] += bucket.buffer().numel()
    return default_hooks.allreduce_hook(None, bucket)


def train_torch(ctx: RankContext, kind: str, seed: int, steps: int, batch: int) -> dict:
    """The same training with torch's ZeroRedundancyOptimizer (+ DDP, counting the elements
    DDP all-reduces and the optimizer broadcasts per step) or FSDP2 fully_shard."""
    # imported here: torch.distributed.fsdp and .optim take seconds to import, and the ranks
    # that the exercises' tests launch never need them
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = data_parallel.make_model(seed + ctx.rank, **SIZES).to(ctx.device)
    counter = {"all_reduce": 0, "broadcast": 0}
    if kind == "zero_redundancy":
        wrapped = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda"
                                          else None)
        wrapped.register_comm_hook(counter, counting_all_reduce_hook)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=zero.LR, foreach=False)
    elif kind == "fsdp2":
        data_parallel.broadcast_parameters_and_buffers(model)  # FSDP2 does not broadcast
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in (model.fc1, model.fc2, model.head):
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=zero.LR, foreach=False)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    losses, elements_per_step = [], []
    for step in range(steps):
        optimizer.zero_grad()
        counter.update(all_reduce=0, broadcast=0)
        x, y = batch_on(ctx, step, batch, seed)
        loss = F.mse_loss(wrapped(x), y)
        loss.backward()
        with counting_broadcasts(counter):
            optimizer.step()
        elements_per_step.append(dict(counter))
        losses.append(mean_over_ranks(ctx, loss.item()))
    if kind == "fsdp2":
        params = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    else:
        params = data_parallel.flat_params(model)
    return {"losses": losses, "params": params.tolist(), "elements_per_step": elements_per_step}


# ============================================================================ the checks


def gap(ours: dict, theirs: dict, key: str = "params") -> float:
    """max |diff| of two runs' losses and `key` (lists made float64 first: max_abs_diff would
    read a list of Python floats as float32)."""
    def f64(values):
        return torch.as_tensor(values, dtype=torch.float64)
    return max(max_abs_diff(f64(ours["losses"]), f64(theirs["losses"])),
               max_abs_diff(f64(ours[key]), f64(theirs[key])))


def verify_worker(ctx: RankContext, seed: int, steps: int, batch: int, fault: str | None,
                  fault_rank: int) -> dict:
    """Every check of the demo, on one rank (on ctx.device: CPU/gloo or CUDA/NCCL)."""
    inject_fault(ctx, fault, fault_rank)
    checks: list[Check] = []
    reference = train_single_process_adam(seed, steps, batch)
    runs = {stage: train(ctx, TRAINERS[stage], seed, steps, batch) for stage in (0, 1, 2, 3)}
    for stage in (1, 2, 3):
        vs_dp, vs_one = gap(runs[stage], runs[0]), gap(runs[stage], reference)
        checks.append(Check(f"ZeRO-{stage} trajectory == data-parallel Adam == one process",
                            max(vs_dp, vs_one) <= TOLERANCE,
                            f"max |diff| vs DP {vs_dp:.1e}, vs one process {vs_one:.1e}"))

    numels = runs[0]["numels"]
    psi, itemsize = sum(numels), 8
    for stage in (0, 1, 2, 3):
        counted = runs[stage]["memory"]
        expected = expected_live_bytes(stage, psi, runs[stage]["shard_params"], itemsize)
        name = "plain DP" if stage == 0 else f"ZeRO-{stage}"
        checks.append(Check(f"{name} live bytes (params, grads, Adam) == formula",
                            counted == expected,
                            f"{counted['params']}/{counted['grads']}/{counted['optimizer']} B "
                            f"counted, {expected['params']}/{expected['grads']}/"
                            f"{expected['optimizer']} B formula (Psi_r = "
                            f"{runs[stage]['shard_params']} of {psi})"))

    for stage in (0, 1, 2, 3):
        sent = runs[stage]["bytes_per_step"]
        expected = zero.expected_bytes_sent(stage, numels, itemsize, ctx.world_size, ctx.rank)
        elements = zero.zero_communication_elements("zero3" if stage == 3 else "zero1", psi)
        ideal = elements * itemsize * (ctx.world_size - 1) / ctx.world_size
        name = "plain DP" if stage == 0 else f"ZeRO-{stage}"
        checks.append(Check(f"{name} bytes sent per step == {3 if stage == 3 else 2} Psi (ring)",
                            all(s == expected for s in sent),
                            f"{sent[-1]} B counted, {expected} B by the exact ring formula "
                            f"(ideal {elements / psi:g} Psi x (p-1)/p x 8 B = {ideal:.0f} B)"))

    max_norm = CLIP_FRACTION * reference["norms"][0]  # so that clipping engages
    clipped_reference = train_single_process_adam(seed, steps, batch, max_norm)
    clipped_steps = sum(norm > max_norm for norm in clipped_reference["norms"])
    for stage in (1, 2, 3):
        clipped = train(ctx, TRAINERS[stage], seed, steps, batch, max_norm)
        diff = max(gap(clipped, clipped_reference), gap(clipped, clipped_reference, "norms"))
        checks.append(Check(f"ZeRO-{stage} sharded_clip_grad_norm_ == clip_grad_norm_ on one "
                            "process", diff <= TOLERANCE and clipped_steps > 0,
                            f"max |diff| {diff:.1e} (norms, losses, parameters); clipped "
                            f"{clipped_steps} of {steps} steps at max_norm {max_norm:.3f}"))

    theirs = train_torch(ctx, "zero_redundancy", seed, steps, batch)
    diff = gap(runs[1], theirs)
    checks.append(Check("ZeRO-1 == torch ZeroRedundancyOptimizer (same trajectory)",
                        diff <= TOLERANCE, f"max |diff| {diff:.1e}"))
    counts = theirs["elements_per_step"]
    checks.append(Check("torch ZeroRedundancyOptimizer + DDP moves 3 Psi per step (ours: 2 Psi)",
                        all(c == {"all_reduce": psi, "broadcast": psi} for c in counts),
                        f"DDP all-reduces {counts[-1]['all_reduce']} elements (2 Psi in the "
                        f"paper's accounting), the optimizer broadcasts {counts[-1]['broadcast']} "
                        f"(Psi); Psi = {psi}"))
    theirs = train_torch(ctx, "fsdp2", seed, steps, batch)
    diff = gap(runs[3], theirs)
    checks.append(Check("ZeRO-3 == torch FSDP2 fully_shard (same trajectory)", diff <= TOLERANCE,
                        f"max |diff| {diff:.1e}"))

    z1, z3 = runs[1]["bytes_per_step"][-1], runs[3]["bytes_per_step"][-1]
    metrics = {"psi": psi, "world_size": ctx.world_size, "device": ctx.device.type,
               "backend": ctx.backend,
               "bytes_per_step": {f"zero{s}": runs[s]["bytes_per_step"][-1] for s in (0, 1, 2, 3)},
               "zero3_over_zero1_bytes": z3 / z1 if z1 else None,
               "live_bytes": {f"zero{s}": runs[s]["memory"] for s in (0, 1, 2, 3)}}
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


def fsdp2_peak_worker(ctx: RankContext, hidden: int, layers: int) -> dict:
    """GPU only (the notebook runs it): train a stack of `layers` Linear(hidden, hidden) under
    FSDP2 with fp32 Adam and return torch.cuda.max_memory_allocated next to the ZeRO-3
    model-state formula 16 Psi / N bytes (4 params + 4 grads + 8 Adam). The peak also holds
    activations, one layer's gathered weights and allocator slack, so it sits above the
    formula. One warm-up step runs before the peak statistics are reset."""
    from torch.distributed.fsdp import fully_shard  # slow to import: only here and train_torch

    if ctx.device.type != "cuda":
        raise RuntimeError("fsdp2_peak_worker measures CUDA memory: run it with --device cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)]).to(ctx.device)
    mesh = init_device_mesh("cuda", (ctx.world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, hidden, device=ctx.device)
    for step in range(4):
        if step == 1:  # after the first step: Adam's states exist, the peak is the steady one
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    torch.cuda.synchronize(ctx.device)
    psi = layers * (hidden * hidden + hidden)
    return {"peak_bytes": torch.cuda.max_memory_allocated(ctx.device),
            "formula_bytes": 16 * psi / ctx.world_size, "psi": psi}


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("ZeRO-1/2/3 from scratch, checked against ZeroRedundancyOptimizer "
                           "and FSDP2; --memory is the paper's calculator.")
    parser.add_argument("--steps", type=int_in(1, 1000), default=3,
                        help="training steps (default 3; --quick: 2)")
    parser.add_argument("--batch", type=int_in(1, 1 << 16), default=24,
                        help="global batch, divisible by the world size (default 24)")
    parser.add_argument("--memory", action="store_true",
                        help="print the per-device memory of each stage and exit (no training)")
    parser.add_argument("--params", type=float_in(1.0, 1e15), default=7.5e9,
                        help="--memory: number of parameters Psi (default 7.5e9)")
    parser.add_argument("--dp", type=int_in(1, 1 << 20), default=64,
                        help="--memory: data-parallel degree N_d (default 64)")
    parser.add_argument("--k", type=float_in(0.0, 1000.0), default=12.0,
                        help="--memory: optimizer bytes per parameter K (default 12)")
    args = parser.parse_args(argv)
    world = check_args(parser, args)
    if not args.memory and args.batch % world:
        parser.error(f"--batch {args.batch} is not divisible by the world size {world}")
    if args.quick:
        args.steps = min(args.steps, 2)
    return args


def memory_report(args) -> Report:
    table = zero.memory_table_gb(args.params, args.dp, args.k)
    if is_reporting_rank():
        print(f"model states per device, Psi = {args.params:g} parameters, N_d = {args.dp}, "
              f"K = {args.k:g} (GB = 1e9 bytes)")
        for stage, label in zip(zero.STAGES, ("baseline DP", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)",
                                              "ZeRO-3 (P_os+g+p)")):
            print(f"  {label:<18} {table[f'{stage}_gb']:10.2f} GB")
    paper = zero.memory_table_gb(7.5e9, 64)
    expected = {"baseline_gb": 120.0, "zero1_gb": 31.4, "zero2_gb": 16.6, "zero3_gb": 1.9}
    ok = all(abs(paper[key] - value) < 0.05 for key, value in expected.items())
    check = Check("reproduces the ZeRO paper's example (7.5e9, 64): 120, 31.4, 16.6, 1.9 GB", ok,
                  ", ".join(f"{paper[key]:.2f}" for key in expected))
    metrics = dict(table, params=args.params, dp=args.dp, k=args.k,
                   headline=f"ZeRO-3 {table['zero3_gb']:.2f} GB vs baseline {table['baseline_gb']:.1f} GB")
    return Report(LESSON, "none", "none", 1, [check], metrics)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.memory:
        return finish(memory_report(args), args.json, started)
    results, checks = launch_checks(verify_worker, args, (args.seed, args.steps, args.batch))
    metrics = dict(results[0]["metrics"])
    metrics["memory_7_5e9_dp64"] = zero.memory_table_gb(7.5e9, 64)
    ratio = metrics["zero3_over_zero1_bytes"]
    metrics["headline"] = (f"ZeRO-3 sends {ratio:.2f}x ZeRO-1's bytes" if ratio else
                           "one rank: nothing to send")
    return finish(Report(LESSON, metrics["device"], metrics["backend"], len(results), checks,
                         metrics), args.json, started)
