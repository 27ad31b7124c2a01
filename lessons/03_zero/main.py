"""Lesson 03: ZeRO-1/2/3 sharding, its memory arithmetic, and FSDP2.

The story, top to bottom:

1. The memory arithmetic of the ZeRO paper: bytes per device for plain data parallelism and
   ZeRO stages 1, 2 and 3, and a calculator (`--memory`).
2. Sharding: every parameter is cut into p near-equal pieces (lesson 01's chunks), so shards
   are uneven when p does not divide a parameter, and a rank may own nothing.
3. `ZeroAdam`, one class for the three stages, built on lesson 01's ring collectives:
   stage 1 shards the Adam states (reduce-scatter the gradient, step your shard, all-gather
   the parameters); stage 2 also shards gradients (each gradient is reduce-scattered by a hook
   the moment it is ready and then freed); stage 3 also shards parameters (hooks all-gather a
   layer's weights just before it runs, free them after, and gather them again for backward).
4. The checks: every stage trains exactly like plain data-parallel Adam and like one process;
   the bytes of parameters, gradients and optimizer states counted from the live tensors equal
   the formulas; the bytes sent per step equal 2 Psi (stages 1, 2) and 3 Psi (stage 3) over
   the ring; and torch's ZeroRedundancyOptimizer and FSDP2 `fully_shard` follow the same
   trajectory.

Run: `python lessons/03_zero/main.py --world-size 4`, or the calculator:
`python lessons/03_zero/main.py --memory --params 7.5e9 --dp 64`.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from lessons._launch import RankContext, inject_fault, launch
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

LESSON = "03_zero"
COLLECTIVES = importlib.import_module("lessons.01_collectives.main")  # ring collectives, chunks
DP = importlib.import_module("lessons.02_data_parallel.main")  # model, data, broadcast
LR = 0.01
# Lesson 02's model with 3 outputs: Psi = 1,699 is odd (uneven shards for any p > 1), and a
# 3-element bias on 4 ranks leaves rank 3 owning nothing of it.
SIZES = {"d_in": 16, "hidden": 32, "d_out": 3}
# float64: stages differ from one process only in the order gradients are summed (~1e-16);
# a wrong shard, a missed average or a stale parameter is off by more than 1e-4.
TOLERANCE = 1e-10

# ============================================================================ 1. memory arithmetic

STAGES = ("baseline", "zero1", "zero2", "zero3")


def zero_bytes_per_device(stage: str, num_params: float, dp: int, k: float = 12,
                          param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes per device for model states (ZeRO paper, Fig. 1), Psi = num_params, N = dp:

    baseline (2 + 2 + K) Psi;  zero1 (P_os) 2 Psi + 2 Psi + K Psi / N;
    zero2 (P_os+g) 2 Psi + (2 + K) Psi / N;  zero3 (P_os+g+p) (2 + 2 + K) Psi / N.
    K = 12 for mixed-precision Adam (fp32 master weights, momentum and variance); the 2s are
    the fp16 parameters and gradients (`param_bytes`, `grad_bytes`).
    """
    psi, n = num_params, dp
    if stage == "baseline":
        return (param_bytes + grad_bytes + k) * psi
    if stage == "zero1":
        return param_bytes * psi + grad_bytes * psi + k * psi / n
    if stage == "zero2":
        return param_bytes * psi + (grad_bytes + k) * psi / n
    if stage == "zero3":
        return (param_bytes + grad_bytes + k) * psi / n
    raise ValueError(f"unknown stage {stage!r}; use one of {STAGES}")


def memory_table_gb(num_params: float, dp: int, k: float = 12) -> dict[str, float]:
    """The four per-device figures in GB (1e9 bytes): `baseline_gb`, `zero1_gb`, ..."""
    return {f"{stage}_gb": zero_bytes_per_device(stage, num_params, dp, k) / 1e9 for stage in STAGES}


def zero_communication_elements(stage: str, num_params: float) -> float:
    """Elements each rank moves per step in the paper's accounting (a reduce-scatter or an
    all-gather of Psi counts Psi): DP and stages 1-2 reduce-scatter the gradients and
    all-gather the parameters, 2 Psi; stage 3 all-gathers the parameters twice (forward and
    backward) and reduce-scatters the gradients, 3 Psi (1.5x)."""
    return (3 if stage == "zero3" else 2) * num_params


# ============================================================================ 2. sharding


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s shard of a flattened parameter: lesson 01's near-equal
    chunks, so shard_bounds(3, 4, 3) == (3, 3): rank 3 owns nothing of a 3-element bias."""
    return COLLECTIVES.chunk_bounds(numel, world_size)[rank]


def ring_all_reduce_mean(tensor: torch.Tensor, traffic) -> torch.Tensor:
    """Plain data parallelism's gradient average, over lesson 01's ring (2(p-1)/p S bytes)."""
    return COLLECTIVES.ring_all_reduce(tensor, traffic) / dist.get_world_size()


class _GatherParameter(torch.autograd.Function):
    """shard (n_r,) -> full parameter (n,): a ring all-gather forward; in backward the full
    gradient is ring reduce-scattered and averaged, so each rank gets its shard's gradient,
    and the parameter gathered again for this layer's backward is freed."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, numel: int, zero: ZeroAdam, index: int) -> torch.Tensor:
        ctx.zero, ctx.index = zero, index
        return COLLECTIVES.ring_all_gather(shard.detach(), numel, zero.traffic)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.zero.regathered.pop(ctx.index, None)  # this layer's backward is done with it
        grad_shard = COLLECTIVES.ring_reduce_scatter(grad_full.contiguous(), ctx.zero.traffic)
        return grad_shard / dist.get_world_size(), None, None, None


# ============================================================================ 3. ZeRO


class ZeroAdam:
    """Data-parallel Adam with ZeRO sharding, stage 0 (plain DP), 1, 2 or 3.

    Every parameter is flattened and sharded with `shard_bounds`; this rank runs
    torch.optim.Adam (element-wise, so a shard's update equals the full update's slice) on
    its shards only. Communication goes through lesson 01's ring collectives, whose
    `Traffic` counts every byte this rank sends.

    stage 0: all-reduce every gradient, Adam on full parameters (states 2 x Psi).
    stage 1: states sharded. After backward, reduce-scatter each gradient, step the shard
             (a view into the full parameter), all-gather the parameter.
    stage 2: + gradients sharded: a post-accumulate-grad hook reduce-scatters each gradient as
             soon as it is ready and frees the full gradient.
    stage 3: + parameters sharded: the model keeps only shards; a forward pre-hook all-gathers
             a layer's parameters just in time and a forward hook drops them; saved-tensor
             hooks keep autograd from holding them; a hook on the layer's output gathers them
             again just before the layer's backward; the gather's backward reduce-scatters the
             gradient and frees the re-gathered copy.
    """

    def __init__(self, model: nn.Module, stage: int, lr: float = LR):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        self.model, self.stage = model, stage
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.traffic = COLLECTIVES.Traffic()
        DP.broadcast_parameters_and_buffers(model)
        self.named = list(model.named_parameters())
        self.bounds = [shard_bounds(p.numel(), self.world, self.rank) for _, p in self.named]
        if stage == 0:
            self.shards = [p for _, p in self.named]
        elif stage in (1, 2):  # views: stepping a shard updates the full parameter in place
            self.shards = [nn.Parameter(p.detach().view(-1)[a:b]) for (_, p), (a, b)
                           in zip(self.named, self.bounds)]
        else:  # stage 3: standalone shards; the full parameters are deleted below
            self.shards = [nn.Parameter(p.detach().reshape(-1)[a:b].clone()) for (_, p), (a, b)
                           in zip(self.named, self.bounds)]
        self.optimizer = torch.optim.Adam(self.shards, lr=lr, foreach=False)
        if stage == 2:
            for index, (_, param) in enumerate(self.named):
                param.register_post_accumulate_grad_hook(self._reduce_scatter_hook(index))
        if stage == 3:
            self._shard_modules()

    # ---------------------------------------------------------------- stage 2
    def _reduce_scatter_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            shard_grad = COLLECTIVES.ring_reduce_scatter(param.grad.reshape(-1), self.traffic)
            shard_grad /= self.world
            shard = self.shards[index]
            shard.grad = shard_grad if shard.grad is None else shard.grad + shard_grad
            param.grad = None  # the full gradient is freed at once
        return hook

    # ---------------------------------------------------------------- stage 3
    def _shard_modules(self) -> None:
        """Replace every module's parameters by hooks that gather them just in time."""
        by_module: dict[nn.Module, list[tuple[str, int]]] = {}
        modules = dict(self.model.named_modules())
        for index, (name, _) in enumerate(self.named):
            owner, _, attr = name.rpartition(".")
            by_module.setdefault(modules[owner], []).append((attr, index))
        for module, entries in by_module.items():
            for attr, _ in entries:
                del module._parameters[attr]
                setattr(module, attr, None)
            module.register_forward_pre_hook(self._gather_hook(entries))
            module.register_forward_hook(self._release_hook(entries))
        self.shapes = [p.shape for _, p in self.named]
        self.regathered: dict[int, torch.Tensor] = {}  # index -> full parameter, in backward
        self._saved_hooks = None

    def _gather(self, index: int) -> torch.Tensor:
        numel = self.shapes[index].numel()
        full = _GatherParameter.apply(self.shards[index], numel, self, index)
        return full.view(self.shapes[index])

    def _gather_hook(self, entries):
        def hook(module: nn.Module, args) -> None:
            gathered = {attr: self._gather(index) for attr, index in entries}
            for attr, tensor in gathered.items():
                setattr(module, attr, tensor)
            storages = {t.untyped_storage().data_ptr(): index for (attr, index) in entries
                        for t in [gathered[attr]]}

            def pack(tensor: torch.Tensor):
                index = storages.get(tensor.untyped_storage().data_ptr())
                if index is None:
                    return tensor  # an activation: keep it
                # a gathered parameter (or a view of it): keep a recipe, not the bytes
                return ("gathered", index, tensor.size(), tensor.stride(), tensor.storage_offset())

            def unpack(saved):
                if not isinstance(saved, tuple):
                    return saved
                _, index, size, stride, offset = saved
                return self.regathered[index].as_strided(size, stride, offset)

            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            self._saved_hooks.__enter__()
        return hook

    def _release_hook(self, entries):
        def hook(module: nn.Module, args, output) -> None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
            for attr, _ in entries:
                setattr(module, attr, None)  # free the full parameters after use
            if output.requires_grad:  # fires when backward reaches this layer's output
                output.register_hook(self._regather_hook(entries))
        return hook

    def _regather_hook(self, entries):
        def hook(grad_output: torch.Tensor) -> None:
            with torch.no_grad():  # gather the whole layer again, just in time for backward
                for _, index in entries:
                    full = COLLECTIVES.ring_all_gather(self.shards[index].detach(),
                                                       self.shapes[index].numel(), self.traffic)
                    self.regathered[index] = full.view(self.shapes[index])
        return hook

    # ---------------------------------------------------------------- the step
    def step(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """Average the gradients the stage has not averaged yet, step Adam on this rank's
        shards (through `scaler.step` when a GradScaler is given: it unscales the shard
        gradients and skips the step on inf/nan), and bring full parameters back where the
        stage keeps them."""
        if self.stage == 0:
            for _, param in self.named:
                param.grad = ring_all_reduce_mean(param.grad, self.traffic).view_as(param)
        elif self.stage == 1:
            for (_, param), shard in zip(self.named, self.shards):
                shard.grad = COLLECTIVES.ring_reduce_scatter(param.grad.reshape(-1),
                                                             self.traffic) / self.world
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
        if self.stage in (1, 2):
            for (_, param), shard in zip(self.named, self.shards):
                full = COLLECTIVES.ring_all_gather(shard.detach(), param.numel(), self.traffic)
                with torch.no_grad():
                    param.copy_(full.view_as(param))

    def zero_grad(self) -> None:
        for _, param in self.named:
            param.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def full_parameters(self) -> torch.Tensor:
        """Every parameter, flattened and concatenated in `named_parameters()` order."""
        if self.stage < 3:
            return DP.flat_params(self.model)
        return torch.cat([COLLECTIVES.ring_all_gather(shard.detach(), shape.numel())
                          for shard, shape in zip(self.shards, self.shapes)])

    def live_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and Adam states this rank holds right now, counted
        from the live tensors (each storage once). Adam's scalar step counters are left out."""
        if self.stage == 3:
            params = self.shards
        else:
            params = [p for _, p in self.named]
        if self.stage <= 1:
            grads = [p.grad for _, p in self.named if p.grad is not None]
        else:
            grads = [s.grad for s in self.shards if s.grad is not None]
        states = [value for state in self.optimizer.state.values()
                  for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")]
        return {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
                "optimizer": _storage_bytes(states)}


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def expected_live_bytes(stage: int, num_params: int, shard_params: int, itemsize: int) -> dict[str, int]:
    """The formulas for the model at hand (full precision, no master copy: K = 2 Adam states):
    parameters Psi or Psi_r, gradients Psi or Psi_r, Adam states 2 Psi or 2 Psi_r elements,
    where Psi_r is the exact number of elements this rank owns."""
    params = shard_params if stage == 3 else num_params
    grads = shard_params if stage >= 2 else num_params
    states = 2 * (shard_params if stage >= 1 else num_params)
    return {"params": params * itemsize, "grads": grads * itemsize, "optimizer": states * itemsize}


def expected_bytes_sent(stage: int, numels: list[int], itemsize: int, world: int, rank: int) -> int:
    """Bytes this rank sends per step over the ring, parameter by parameter (lesson 01's exact
    per-rank formula): stages 0-2 one reduce-scatter + one all-gather (= an all-reduce),
    stage 3 one reduce-scatter + two all-gathers."""
    total = 0
    for numel in numels:
        sent = COLLECTIVES.ring_bytes_sent(numel, itemsize, world, rank)
        total += sent["all_reduce"] + (sent["all_gather"] if stage == 3 else 0)
    return total


# ============================================================================ 4. training and checks


def train_zero(ctx: RankContext, stage: int, seed: int, steps: int, batch: int) -> dict:
    """Train the lesson-02 model with ZeroAdam at `stage` on this rank's shard of each batch."""
    model = DP.make_model(seed + ctx.rank, **SIZES)  # different per rank: the broadcast must fix it
    zero = ZeroAdam(model, stage)
    losses, bytes_per_step = [], []
    memory = {}
    for step in range(steps):
        zero.zero_grad()
        before = zero.traffic.bytes_sent
        x, y = DP.global_batch(step, batch, seed, SIZES["d_in"], SIZES["d_out"])
        loss = F.mse_loss(model(DP.local_shard(x, ctx.rank, ctx.world_size)),
                          DP.local_shard(y, ctx.rank, ctx.world_size))
        loss.backward()
        zero.step()
        bytes_per_step.append(zero.traffic.bytes_sent - before)
        memory = zero.live_bytes()  # after the last step, gradients still held
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return {"losses": losses, "params": zero.full_parameters().tolist(), "memory": memory,
            "bytes_per_step": bytes_per_step,
            "shard_params": sum(b - a for a, b in zero.bounds),
            "numels": [p.numel() for _, p in zero.named] if stage < 3 else
            [s.numel() for s in zero.shapes]}


def train_single_process_adam(seed: int, steps: int, batch: int) -> dict:
    """One process, the whole batch, torch Adam: the trajectory every stage must follow."""
    model = DP.make_model(seed, **SIZES)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    losses = []
    for step in range(steps):
        x, y = DP.global_batch(step, batch, seed, SIZES["d_in"], SIZES["d_out"])
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": DP.flat_params(model)}


def train_torch(ctx: RankContext, kind: str, seed: int, steps: int, batch: int) -> dict:
    """The same training with torch's ZeroRedundancyOptimizer (+ DDP) or FSDP2 fully_shard."""
    model = DP.make_model(seed + ctx.rank, **SIZES)
    if kind == "zero_redundancy":
        wrapped = DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=LR, foreach=False)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        DP.broadcast_parameters_and_buffers(model)  # FSDP2 does not broadcast; ranks differ
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for layer in (model.fc1, model.fc2, model.head):
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = DP.global_batch(step, batch, seed, SIZES["d_in"], SIZES["d_out"])
        loss = F.mse_loss(wrapped(DP.local_shard(x, ctx.rank, ctx.world_size)),
                          DP.local_shard(y, ctx.rank, ctx.world_size))
        loss.backward()
        optimizer.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    if kind == "fsdp2":
        params = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    else:
        params = DP.flat_params(model)
    return {"losses": losses, "params": params.tolist()}


def verify_worker(ctx: RankContext, seed: int, steps: int, batch: int, fault: str | None,
                  fault_rank: int) -> dict:
    """Every check of the demo, on one rank."""
    inject_fault(ctx, fault, fault_rank)
    gap = DP.max_abs_diff
    checks: list[Check] = []
    reference = train_single_process_adam(seed, steps, batch)
    runs = {stage: train_zero(ctx, stage, seed, steps, batch) for stage in (0, 1, 2, 3)}
    for stage in (1, 2, 3):
        vs_dp = max(gap(runs[stage]["losses"], runs[0]["losses"]),
                    gap(runs[stage]["params"], runs[0]["params"]))
        vs_one = max(gap(runs[stage]["losses"], reference["losses"]),
                     gap(runs[stage]["params"], reference["params"]))
        checks.append(Check(f"ZeRO-{stage} trajectory == data-parallel Adam == one process",
                            max(vs_dp, vs_one) <= TOLERANCE,
                            f"max |diff| vs DP {vs_dp:.1e}, vs one process {vs_one:.1e}"))

    numels = runs[0]["numels"]
    psi = sum(numels)
    itemsize = 8
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
        expected = expected_bytes_sent(stage, numels, itemsize, ctx.world_size, ctx.rank)
        elements = zero_communication_elements("zero3" if stage == 3 else "zero1", psi)
        ideal = elements * itemsize * (ctx.world_size - 1) / ctx.world_size
        name = "plain DP" if stage == 0 else f"ZeRO-{stage}"
        checks.append(Check(f"{name} bytes sent per step == {3 if stage == 3 else 2} Psi (ring)",
                            all(s == expected for s in sent),
                            f"{sent[-1]} B counted, {expected} B by the exact ring formula "
                            f"(ideal {elements / psi:g} Psi x (p-1)/p x 8 B = {ideal:.0f} B)"))

    for kind, label in (("zero_redundancy", "torch ZeroRedundancyOptimizer"),
                        ("fsdp2", "torch FSDP2 fully_shard")):
        theirs = train_torch(ctx, kind, seed, steps, batch)
        stage = 1 if kind == "zero_redundancy" else 3
        diff = max(gap(runs[stage]["losses"], theirs["losses"]),
                   gap(runs[stage]["params"], theirs["params"]))
        checks.append(Check(f"ZeRO-{stage} == {label} (same trajectory)", diff <= TOLERANCE,
                            f"max |diff| {diff:.1e}"))
    z1, z3 = runs[1]["bytes_per_step"][-1], runs[3]["bytes_per_step"][-1]
    metrics = {"psi": psi, "world_size": ctx.world_size,
               "bytes_per_step": {f"zero{s}": runs[s]["bytes_per_step"][-1] for s in (0, 1, 2, 3)},
               "zero3_over_zero1_bytes": z3 / z1 if z1 else None,
               "live_bytes": {f"zero{s}": runs[s]["memory"] for s in (0, 1, 2, 3)}}
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


def fsdp2_peak_worker(ctx: RankContext, hidden: int, layers: int) -> dict:
    """GPU only: train a stack of `layers` Linear(hidden, hidden) under FSDP2 with fp32 Adam and
    return torch.cuda.max_memory_allocated next to the ZeRO-3 model-state formula
    16 Psi / N bytes (4 params + 4 grads + 8 Adam). The peak also holds activations, one
    layer's gathered weights and allocator slack, so it sits above the formula."""
    if ctx.device.type != "cuda":
        raise RuntimeError("fsdp2_peak_worker measures CUDA memory: run it with --device cuda")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)]).to(ctx.device)
    mesh = init_device_mesh("cuda", (ctx.world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, hidden, device=ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    psi = layers * (hidden * hidden + hidden)
    return {"peak_bytes": torch.cuda.max_memory_allocated(ctx.device),
            "formula_bytes": 16 * psi / ctx.world_size, "psi": psi}


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("ZeRO-1/2/3 from scratch, checked against ZeroRedundancyOptimizer "
                           "and FSDP2; --memory is the paper's calculator.")
    parser.add_argument("--steps", type=int_in(1, 1000), default=3, help="training steps (default 3)")
    parser.add_argument("--batch", type=int_in(1, 1 << 16), default=24,
                        help="global batch, divisible by --world-size (default 24)")
    parser.add_argument("--memory", action="store_true",
                        help="print the per-device memory of each stage and exit (no training)")
    parser.add_argument("--params", type=float_in(1.0, 1e15), default=7.5e9,
                        help="--memory: number of parameters Psi (default 7.5e9)")
    parser.add_argument("--dp", type=int_in(1, 1 << 20), default=64,
                        help="--memory: data-parallel degree N_d (default 64)")
    parser.add_argument("--k", type=float_in(0.0, 1000.0), default=12.0,
                        help="--memory: optimizer bytes per parameter K (default 12)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if not args.memory and args.batch % args.world_size:
        parser.error(f"--batch {args.batch} is not divisible by --world-size {args.world_size}")
    return args


def memory_report(args) -> Report:
    table = memory_table_gb(args.params, args.dp, args.k)
    print(f"model states per device, Psi = {args.params:g} parameters, N_d = {args.dp}, "
          f"K = {args.k:g} (GB = 1e9 bytes)")
    for stage, label in zip(STAGES, ("baseline DP", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)",
                                     "ZeRO-3 (P_os+g+p)")):
        print(f"  {label:<18} {table[f'{stage}_gb']:10.2f} GB")
    paper = memory_table_gb(7.5e9, 64)
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
    results = launch(verify_worker, args.world_size,
                     (args.seed, args.steps, args.batch, args.fault, args.fault_rank),
                     device="cpu", timeout_s=args.timeout)
    checks = merge_rank_checks([r["checks"] for r in results])
    metrics = dict(results[0]["metrics"])
    metrics["memory_7_5e9_dp64"] = memory_table_gb(7.5e9, 64)
    ratio = metrics["zero3_over_zero1_bytes"]
    metrics["headline"] = (f"ZeRO-3 sends {ratio:.2f}x ZeRO-1's bytes" if ratio else
                           "one rank: nothing to send")
    return finish(Report(LESSON, "cpu", "gloo", len(results), checks, metrics), args.json, started)


if __name__ == "__main__":
    run_main(main)
