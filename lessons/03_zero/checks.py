"""Lesson 03's proof: every ZeRO stage (main.py, and zero3.py for stage 3) against plain data
parallelism over the same ring, one process on the whole batch, torch's ZeroRedundancyOptimizer
and FSDP2 `fully_shard`; the bytes held and sent against the formulas; global-norm clipping on
shards against `torch.nn.utils.clip_grad_norm_`; the consolidated state dict against torch's;
ZeRO-3's mixed precision against FSDP2 with the same MixedPrecisionPolicy; the demo's check
table and the CLI (`--memory` is the paper's calculator).

Tolerances: the float64 runs differ from plain DP and from one process only in the order
gradients are summed (about 1e-16 per step); 1e-10 leaves room for a few optimizer steps,
while a wrong shard, a missed average, a stale parameter or a per-shard clipping factor is off
by more than 1e-4. The bf16 comparison with FSDP2 has its own bounds (`compare_mixed_precision`).
"""

from __future__ import annotations

import contextlib
import importlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from lessons._checks import max_abs_diff, sum_order_tolerance
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

collectives, contract = zero.collectives, zero.contract
data_parallel = importlib.import_module("lessons.02_data_parallel.main")  # its model and data
LESSON = "03_zero"
# Lesson 02's model with 3 outputs: Psi = 1,699 is odd (uneven shards for any p > 1), and a
# 3-element bias on 4 ranks leaves rank 3 owning nothing of it.
SIZES = {"d_in": 16, "hidden": 32, "d_out": 3}
TOLERANCE = 1e-10  # see the module docstring
CLIP_FRACTION = 0.5  # the clipping checks use max_norm = half the first step's gradient norm
MP_LR = 0.05  # SGD's learning rate in the mixed-precision comparison with FSDP2
# Each optimizer the checks shard: (class, hyperparameters); AdamW and SGD get decay /
# no-decay param groups (`param_groups`). foreach=False: the one-process reference loops too.
OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": zero.LR, "foreach": False}),
    "adamw": (torch.optim.AdamW, {"lr": zero.LR, "weight_decay": 0.1, "foreach": False}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "foreach": False}),
}


def param_groups(named, optimizer: str) -> list[dict]:
    """Adam: one group; AdamW and SGD: matrices with weight decay, biases without (names kept,
    as torch.optim does with named_parameters())."""
    named = list(named)
    if optimizer == "adam":
        return [{"params": named}]
    return [{"params": [(n, p) for n, p in named if not n.endswith("bias")]},
            {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


# ============================================================================ the runs


class RingDataParallel:
    """Plain data parallelism over lesson 01's ring, the baseline every stage must equal:
    all-reduce and average every gradient, the optimizer on the full parameters."""

    def __init__(self, model: nn.Module, optimizer: str = "adam"):
        cls, kwargs = OPTIMIZERS[optimizer]
        self.model, self.traffic = model, collectives.Traffic()
        data_parallel.broadcast_parameters_and_buffers(model)  # rank 0's weights, as DDP
        self.named = list(model.named_parameters())
        self.optimizer = cls(param_groups(self.named, optimizer), **kwargs)

    def step(self) -> None:
        for _, param in self.named:
            param.grad = collectives.ring_all_reduce(param.grad, self.traffic) / dist.get_world_size()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class StageRun:
    """Stage `stage` over `model` with one of OPTIMIZERS: 0 plain DP (`RingDataParallel`), 1
    and 2 `ZeroStage1` / `ZeroStage2` built from model.named_parameters(), 3 `ZeroStage3`
    and the torch optimizer over the module's (sharded) parameters. `step(max_norm)` clips
    (the stage's way) and steps; `traffic` counts our ring's bytes."""

    def __init__(self, stage: int, model: nn.Module, optimizer: str = "adam",
                 group: dist.ProcessGroup | None = None):
        cls, kwargs = OPTIMIZERS[optimizer]
        self.stage, self.model, self.group = stage, model, group
        if stage == 0:
            self.runner = RingDataParallel(model, optimizer)
            self.optimizer, self.traffic = self.runner.optimizer, self.runner.traffic
        elif stage in (1, 2):
            zero_class = zero.ZeroStage1 if stage == 1 else zero.ZeroStage2
            self.runner = zero_class(param_groups(model.named_parameters(), optimizer), cls,
                                     group=group, **kwargs)
            self.optimizer, self.traffic = self.runner.optimizer, self.runner.traffic
        else:
            self.runner = zero3.ZeroStage3(model, group=group)
            self.optimizer = cls(param_groups(model.named_parameters(), optimizer), **kwargs)
            self.traffic = self.runner.traffic

    def zero_grad(self) -> None:
        (self.optimizer if self.stage == 3 else self.runner).zero_grad()

    def step(self, max_norm: float | None = None) -> torch.Tensor | None:
        norm = None
        if self.stage == 0:
            self.runner.step()
        elif self.stage in (1, 2):
            if max_norm is not None:
                norm = self.runner.clip_grad_norm_(max_norm)
            self.runner.step()
        else:
            if max_norm is not None:
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                norm = zero.sharded_clip_grad_norm_(grads, max_norm, self.group)
            self.optimizer.step()
        return norm

    def full_parameters(self) -> torch.Tensor:
        """Every parameter, flattened and concatenated in named_parameters() order (ZeRO-3:
        all-gathered from the shards)."""
        if self.stage == 3:
            return torch.cat([p.reshape(-1) for p in self.runner.full_state_dict().values()])
        return data_parallel.flat_params(self.model)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (views share one)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def live_bytes(run: StageRun) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer moments `run` holds now, counted from the
    live tensors (scalar step counters left out). Under ZeRO-3 the module's parameters are
    the shards, and any copy still regathered for backward is counted too (it must be none)."""
    params = list(run.model.parameters())
    grads = [p.grad for p in params]
    if run.stage == 3:
        params += list(run.runner.regathered.values())
    if run.stage in (1, 2):
        grads += [s.grad for s in run.runner.shards]
    states = [value for state in run.optimizer.state.values()
              for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads),
            "optimizer": storage_bytes(states)}


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


def batch_on(ctx: RankContext, step: int, batch: int, seed: int,
             dtype: torch.dtype = torch.float64,
             group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step `step`'s global batch (its share within `group`: rank and size
    of the group), on the rank's device."""
    x, y = data_parallel.global_batch(step, batch, seed, SIZES["d_in"], SIZES["d_out"], dtype)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return (data_parallel.local_shard(x, rank, world).to(ctx.device),
            data_parallel.local_shard(y, rank, world).to(ctx.device))


def mean_over_ranks(ctx: RankContext, value: float, group: dist.ProcessGroup | None = None) -> float:
    total = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(group)


def train(ctx: RankContext, stage: int, seed: int, steps: int, batch: int,
          max_norm: float | None = None, optimizer: str = "adam",
          group: dist.ProcessGroup | None = None) -> dict:
    """Train lesson 02's model at `stage` on this rank's rows of every batch, data parallel
    over `group` (None: the world; stages 1-3). Each rank builds it from its own seed: the
    stages' broadcast of group rank 0's values (seed `seed`), and the buffer's copy here, make
    them one. Records the mean loss, the bytes sent and the global
    gradient norm (with `max_norm`) per step, and the bytes held: gradients at the end of the
    last backward (their peak), parameters and optimizer states after the last step."""
    model = data_parallel.make_model(seed + dist.get_rank(group), **SIZES).to(ctx.device)
    model.input_scale.copy_(data_parallel.make_model(seed, **SIZES).input_scale)
    run = StageRun(stage, model, optimizer, group)
    numels = [p.numel() for p in model.parameters()] if stage != 3 else \
        [shape.numel() for shape in run.runner.shapes]
    losses, bytes_per_step, norms, memory = [], [], [], {}
    for step in range(steps):
        run.zero_grad()
        before = run.traffic.bytes_sent
        x, y = batch_on(ctx, step, batch, seed, group=group)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads_at_peak = live_bytes(run)["grads"]
        norm = run.step(max_norm)
        if norm is not None:
            norms.append(norm.item())
        bytes_per_step.append(run.traffic.bytes_sent - before)
        memory = dict(live_bytes(run), grads=grads_at_peak)
        losses.append(mean_over_ranks(ctx, loss.item(), group))
    bounds = [zero.shard_bounds(numel, dist.get_world_size(group), dist.get_rank(group))
              for numel in numels]
    return {"losses": losses, "params": run.full_parameters().tolist(), "memory": memory,
            "bytes_per_step": bytes_per_step, "norms": norms, "numels": numels,
            "shard_params": sum(end - start for start, end in bounds)}


def train_single_process(seed: int, steps: int, batch: int, max_norm: float | None = None,
                         optimizer: str = "adam") -> dict:
    """One process on CPU, the whole batch, the torch optimizer (and
    torch.nn.utils.clip_grad_norm_ with `max_norm`): the trajectory every stage must follow,
    on any device. Records every step's global gradient norm (before clipping) and the
    optimizer's state_dict at the end."""
    cls, kwargs = OPTIMIZERS[optimizer]
    model = data_parallel.make_model(seed, **SIZES)
    opt = cls(param_groups(model.named_parameters(), optimizer), **kwargs)
    losses, norms = [], []
    for step in range(steps):
        x, y = data_parallel.global_batch(step, batch, seed, SIZES["d_in"], SIZES["d_out"])
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if max_norm is None:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": data_parallel.flat_params(model), "norms": norms,
            "state_dict": opt.state_dict()}


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


def fully_shard_mlp(ctx: RankContext, model: nn.Module, mp_policy=None) -> None:
    """FSDP2 on lesson 02's MLP: each Linear, then the root (its input_scale buffer stays)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # slow import: here only

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def train_torch(ctx: RankContext, kind: str, seed: int, steps: int, batch: int,
                optimizer: str = "adam") -> dict:
    """The same training with torch's ZeroRedundancyOptimizer (+ DDP, counting the elements
    DDP all-reduces and the optimizer broadcasts per step) or FSDP2 fully_shard."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # slow import: here only

    cls, kwargs = OPTIMIZERS[optimizer]
    model = data_parallel.make_model(seed + ctx.rank, **SIZES).to(ctx.device)
    counter = {"all_reduce": 0, "broadcast": 0}
    if kind == "zero_redundancy":
        wrapped = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda"
                                          else None)
        wrapped.register_comm_hook(counter, counting_all_reduce_hook)
        groups = [dict(g, params=[p for _, p in g["params"]])  # it takes no (name, parameter)
                  for g in param_groups(model.named_parameters(), optimizer)]
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
    elif kind == "fsdp2":
        data_parallel.broadcast_parameters_and_buffers(model)  # FSDP2 does not broadcast
        fully_shard_mlp(ctx, model)
        wrapped = model
        opt = cls(param_groups(model.named_parameters(), optimizer), **kwargs)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    losses, elements_per_step = [], []
    for step in range(steps):
        opt.zero_grad()
        counter.update(all_reduce=0, broadcast=0)
        x, y = batch_on(ctx, step, batch, seed)
        loss = F.mse_loss(wrapped(x), y)
        loss.backward()
        with counting_broadcasts(counter):
            opt.step()
        elements_per_step.append(dict(counter))
        losses.append(mean_over_ranks(ctx, loss.item()))
    if kind == "fsdp2":
        params = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    else:
        params = data_parallel.flat_params(model)
    return {"losses": losses, "params": params.tolist(), "elements_per_step": elements_per_step}


# ============================================================================ mixed precision


def mixed_precision_step(ctx: RankContext, ours: bool, reduce_dtype: torch.dtype, seed: int,
                         steps: int, batch: int) -> dict:
    """Lesson 02's MLP in float32 (master weights) under MixedPrecisionPolicy(param_dtype=
    bf16, reduce_dtype, output_dtype=float32), ours (`ZeroStage3`) or FSDP2's fully_shard, SGD
    (lr MP_LR, momentum 0.9): each step's loss, the first step's averaged full gradients and
    the full parameters after the first update."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                  output_dtype=torch.float32)
    model = data_parallel.make_model(seed + ctx.rank, dtype=torch.float32, **SIZES).to(ctx.device)
    data_parallel.broadcast_parameters_and_buffers(model)
    if ours:
        sharded = zero3.ZeroStage3(model, mp_policy=policy)
        full = lambda: list(sharded.full_state_dict().values())  # noqa: E731
        full_grads = lambda: [contract.all_gather_flat(p.grad, shape.numel(), None).view(shape)  # noqa: E731
                              for p, shape in zip(model.parameters(), sharded.shapes)]
    else:
        fully_shard_mlp(ctx, model, policy)
        full = lambda: [p.full_tensor() for p in model.parameters()]  # noqa: E731
        full_grads = lambda: [p.grad.full_tensor() for p in model.parameters()]  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=MP_LR, momentum=0.9, foreach=False)
    losses, grads, params = [], [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch_on(ctx, step, batch, seed, torch.float32)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if step == 0:
            grads = [g.detach().cpu().double() for g in full_grads()]
        opt.step()
        if step == 0:
            params = [p.detach().cpu().double() for p in full()]
        losses.append(mean_over_ranks(ctx, loss.item()))
    return {"losses": losses, "grads": grads, "params": params}


def mirrored_bf16_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The bf16 gradients that MixedPrecisionPolicy(param_dtype=bf16, output_dtype=float32)
    computes on one rank for lesson 02's MLP (fp32 `model`, this rank's x, y), by hand with
    FSDP2's casts: the root's input to bf16 (times the fp32 buffer: float32), each Linear's
    input and weights to bf16, its output to float32. In named_parameters() order."""
    weights = [p.detach().to(torch.bfloat16).requires_grad_() for p in model.parameters()]
    w1, b1, w2, b2, w3, b3 = weights  # fc1, fc2, head
    h = x.to(torch.bfloat16) * model.input_scale
    for w, b, last in ((w1, b1, False), (w2, b2, False), (w3, b3, True)):
        h = F.linear(h.to(torch.bfloat16), w, b).float()
        h = h if last else F.relu(h)
    F.mse_loss(h, y).backward()
    return [w.grad for w in weights]


def gradient_abs_sum(ctx: RankContext, seed: int, batch: int) -> list[torch.Tensor]:
    """sum over ranks of |g_r|, per element, for the first step of `mixed_precision_step`
    (each rank's `mirrored_bf16_grads`, summed in float64 over the world): what bounds the
    rounding error of a sum of these N gradients."""
    model = data_parallel.make_model(seed, dtype=torch.float32, **SIZES).to(ctx.device)
    x, y = batch_on(ctx, 0, batch, seed, torch.float32)
    sums = [g.double().abs() for g in mirrored_bf16_grads(model, x, y)]
    for tensor in sums:
        dist.all_reduce(tensor)
    return [s.cpu() for s in sums]


def compare_mixed_precision(ctx: RankContext, reduce_dtype: torch.dtype, seed: int,
                            batch: int) -> Check:
    """ZeRO-3 vs FSDP2, both MixedPrecisionPolicy(bf16, reduce_dtype). The same bf16 weights
    (cast from the same fp32 shards) and inputs give the same bf16 forward and local
    gradients, bit for bit: the first loss must be equal. The averaged gradients differ only
    by the order of the N-term reduction in reduce_dtype (our ring; gloo's or NCCL's order):
    |ours - theirs| <= B = sum_order_tolerance(sum_r |g_r|, N, reduce_dtype) / N + eps |g|
    (the division and casts round once more). SGD's first update moves a float32 parameter by
    lr x g: the parameters then differ by at most lr B + one float32 rounding of p. Later, a
    master weight that moved by a hair can round to the neighbouring bf16 value (one bf16 ulp,
    2^-8 relative): later losses are compared at 2^-7 relative (two such ulps), the measured
    value beside it."""
    steps = 3
    ours = mixed_precision_step(ctx, True, reduce_dtype, seed, steps, batch)
    theirs = mixed_precision_step(ctx, False, reduce_dtype, seed, steps, batch)
    sums = gradient_abs_sum(ctx, seed, batch)
    eps, eps32 = torch.finfo(reduce_dtype).eps, torch.finfo(torch.float32).eps
    grads = params = 0.0  # the largest |diff| / bound over every element
    for a, b, pa, pb, s in zip(ours["grads"], theirs["grads"], ours["params"], theirs["params"], sums):
        bound = sum_order_tolerance(s, ctx.world_size, reduce_dtype) / ctx.world_size + eps * b.abs()
        grads = max(grads, float(((a - b).abs() / (bound + 1e-30)).max()))
        params = max(params, float(((pa - pb).abs() / (MP_LR * bound + eps32 * pb.abs() + 1e-30)).max()))
    later = max_abs_diff(ours["losses"][1:], theirs["losses"][1:]) / max(theirs["losses"])
    first_equal = ours["losses"][0] == theirs["losses"][0]
    name = str(reduce_dtype).split(".")[-1]
    return Check(f"ZeRO-3 == FSDP2 with MixedPrecisionPolicy(bf16, reduce {name})",
                 first_equal and grads <= 1.0 and params <= 1.0 and later <= 2 ** -7,
                 f"first loss {'equal' if first_equal else 'DIFFERS'}; first gradients at "
                 f"{grads:.2f} and first update at {params:.2f} of their rounding bounds; later "
                 f"losses {later:.1e} relative (bound 2^-7)")


# ============================================================================ the checks


def gap(ours: dict, theirs: dict, key: str = "params") -> float:
    """max |diff| of two runs' losses and `key` (lists made float64 first: max_abs_diff would
    read a list of Python floats as float32)."""
    def f64(values):
        return torch.as_tensor(values, dtype=torch.float64)
    return max(max_abs_diff(f64(ours["losses"]), f64(theirs["losses"])),
               max_abs_diff(f64(ours[key]), f64(theirs[key])))


def state_dict_gap(ctx: RankContext, seed: int, steps: int, batch: int, optimizer: str) -> dict:
    """ZeroStage1's consolidated state_dict (on rank 0) against the one-process optimizer's:
    the same keys, per-parameter states of the full shapes, values within TOLERANCE; then
    that dict loaded into a ZeroStage1 and into torch's optimizer, both stepping once more,
    must still agree (a state dict from N ranks continues on any other number)."""
    cls, kwargs = OPTIMIZERS[optimizer]
    model = data_parallel.make_model(seed + ctx.rank, **SIZES).to(ctx.device)
    data_parallel.broadcast_parameters_and_buffers(model)
    zero_opt = zero.ZeroStage1(param_groups(model.named_parameters(), optimizer), cls, **kwargs)
    for step in range(steps):
        zero_opt.zero_grad()
        x, y = batch_on(ctx, step, batch, seed)
        F.mse_loss(model(x), y).backward()
        zero_opt.step()
    zero_opt.consolidate_state_dict(to=0)
    reference = train_single_process(seed, steps, batch, optimizer=optimizer)["state_dict"]
    if ctx.rank != 0:
        return {"diff": 0.0, "same_form": True}
    ours = zero_opt.state_dict()
    same_form = sorted(ours["state"]) == sorted(reference["state"]) and all(
        sorted(ours["state"][i]) == sorted(reference["state"][i]) and
        all(torch.as_tensor(ours["state"][i][k]).shape == torch.as_tensor(v).shape
            for k, v in reference["state"][i].items()) for i in reference["state"]) and \
        [{k: v for k, v in g.items()} for g in ours["param_groups"]] == \
        [{k: v for k, v in g.items()} for g in reference["param_groups"]]
    diff = max((max_abs_diff(torch.as_tensor(ours["state"][i][k]).double(), torch.as_tensor(v).double())
                for i in reference["state"] for k, v in reference["state"][i].items()), default=0.0)
    return {"diff": diff, "same_form": same_form}


def verify_worker(ctx: RankContext, seed: int, steps: int, batch: int, fault: str | None,
                  fault_rank: int) -> dict:
    """Every check of the demo, on one rank (on ctx.device: CPU/gloo or CUDA/NCCL)."""
    inject_fault(ctx, fault, fault_rank)
    checks: list[Check] = []
    reference = train_single_process(seed, steps, batch)
    runs = {stage: train(ctx, stage, seed, steps, batch) for stage in (0, 1, 2, 3)}
    for stage in (1, 2, 3):
        vs_dp, vs_one = gap(runs[stage], runs[0]), gap(runs[stage], reference)
        checks.append(Check(f"ZeRO-{stage} trajectory == data-parallel Adam == one process",
                            max(vs_dp, vs_one) <= TOLERANCE,
                            f"max |diff| vs DP {vs_dp:.1e}, vs one process {vs_one:.1e}"))
    for optimizer in ("adamw", "sgd"):
        one = train_single_process(seed, steps, batch, optimizer=optimizer)
        diffs = [gap(train(ctx, stage, seed, steps, batch, optimizer=optimizer), one)
                 for stage in (1, 2, 3)]
        label = {"adamw": "AdamW (decay / no-decay groups)", "sgd": "SGD with momentum"}[optimizer]
        checks.append(Check(f"ZeRO-1/2/3 with {label} == one process", max(diffs) <= TOLERANCE,
                            "max |diff| " + ", ".join(f"{d:.1e}" for d in diffs)))

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
    clipped_reference = train_single_process(seed, steps, batch, max_norm)
    clipped_steps = sum(norm > max_norm for norm in clipped_reference["norms"])
    for stage in (1, 2, 3):
        clipped = train(ctx, stage, seed, steps, batch, max_norm)
        diff = max(gap(clipped, clipped_reference), gap(clipped, clipped_reference, "norms"))
        checks.append(Check(f"ZeRO-{stage} sharded_clip_grad_norm_ == clip_grad_norm_ on one "
                            "process", diff <= TOLERANCE and clipped_steps > 0,
                            f"max |diff| {diff:.1e} (norms, losses, parameters); clipped "
                            f"{clipped_steps} of {steps} steps at max_norm {max_norm:.3f}"))

    states = {opt: state_dict_gap(ctx, seed, steps, batch, opt) for opt in ("adam", "sgd")}
    checks.append(Check("ZeRO-1 consolidated state_dict == torch's on one process (Adam, SGD)",
                        all(s["same_form"] and s["diff"] <= TOLERANCE for s in states.values()),
                        ", ".join(f"{opt}: {'same form' if s['same_form'] else 'OTHER FORM'}, "
                                  f"max |diff| {s['diff']:.1e}" for opt, s in states.items())))

    diffs = {}
    for opt in ("adam", "sgd"):
        theirs = train_torch(ctx, "zero_redundancy", seed, steps, batch, opt)
        ours = runs[1] if opt == "adam" else train(ctx, 1, seed, steps, batch, optimizer=opt)
        diffs[opt] = gap(ours, theirs)
    checks.append(Check("ZeRO-1 == torch DDP + ZeroRedundancyOptimizer (Adam, SGD)",
                        max(diffs.values()) <= TOLERANCE,
                        ", ".join(f"{opt}: max |diff| {d:.1e}" for opt, d in diffs.items())))
    counts = theirs["elements_per_step"]
    checks.append(Check("torch ZeroRedundancyOptimizer + DDP moves 3 Psi per step (ours: 2 Psi)",
                        all(c == {"all_reduce": psi, "broadcast": psi} for c in counts),
                        f"DDP all-reduces {counts[-1]['all_reduce']} elements (2 Psi in the "
                        f"paper's accounting), the optimizer broadcasts {counts[-1]['broadcast']} "
                        f"(Psi); Psi = {psi}"))
    theirs = train_torch(ctx, "fsdp2", seed, steps, batch)
    diff = gap(runs[3], theirs)
    checks.append(Check("ZeRO-3 == torch FSDP2 fully_shard (float64, same trajectory)",
                        diff <= TOLERANCE, f"max |diff| {diff:.1e}"))
    for reduce_dtype in (torch.float32, torch.bfloat16):
        checks.append(compare_mixed_precision(ctx, reduce_dtype, seed, batch))

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
