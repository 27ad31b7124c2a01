"""Lesson 03: ZeRO-1/2/3, sharding what data parallelism replicates.

Data parallelism keeps N identical copies of the parameters, gradients and optimizer states.
ZeRO keeps one copy, cut into N shards (rank r owns shard r), and moves only what is needed,
when it is needed. In teaching order:

1. memory: bytes of model states per device for DP and ZeRO-1/2/3 (`zero_bytes_per_device`);
2. shards: lesson 01's near-equal chunks of every flattened parameter (`shard_bounds`), and
   the data-parallel average of my shard (`reduce_scatter_mean`);
3. ZeRO-1 (`ZeroStage1`): a torch.optim.Optimizer with ZeroRedundancyOptimizer's contract,
   `ZeroStage1(params, optimizer_class, **defaults)`; its step reduce-scatters the gradients,
   runs the inner optimizer on my shards and all-gathers the parameters;
4. what ZeRO-2 adds (`ZeroStage2`): each gradient is reduce-scattered as backward produces it;
5. global-norm gradient clipping on shards (`sharded_clip_grad_norm_`);
6. communication: 2 Psi per step for DP and ZeRO-1/2, 3 Psi for ZeRO-3.
zero3.py adds ZeRO-3 (`ZeroStage3`): a module sharded in place like FSDP2's fully_shard,
gathered just in time, with torch's MixedPrecisionPolicy. optimizer_contract.py holds the
plumbing that makes ZeroStage1 a drop-in torch optimizer (state dicts, param groups, groups).

Every collective is lesson 01's ring, whose `Traffic` counts the bytes (on a process group
other than the world, torch's). The proof is checks.py: `python lessons/03_zero/main.py
--world-size 4`, or `--memory --params 7.5e9 --dp 64`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique
contract = importlib.import_module("lessons.03_zero.optimizer_contract")  # the plumbing

LR = 0.01  # the demo's learning rate

# ============================================================================ 1. memory arithmetic

STAGES = ("baseline", "zero1", "zero2", "zero3")


# exercise zero-formulas (2 points): Memory and traffic per device of each ZeRO stage
# hint: Psi = num_params and N = dp; write each stage's line of the docstring as it stands,
#   dividing by N exactly the terms that stage shards (never the fp16 weights before ZeRO-3).
def zero_bytes_per_device(stage: str, num_params: float, dp: int, k: float = 12,
                          param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes of model states per device (ZeRO paper, Fig. 1), Psi = num_params, N = dp:

    baseline (2 + 2 + K) Psi;  zero1 (P_os) 2 Psi + 2 Psi + K Psi / N;
    zero2 (P_os+g) 2 Psi + (2 + K) Psi / N;  zero3 (P_os+g+p) (2 + 2 + K) Psi / N.
    K = 12 for mixed-precision Adam (fp32 master weights, momentum and variance); the 2s are
    the fp16 parameters and gradients (`param_bytes`, `grad_bytes`). What is not divided by N
    never shrinks, however many ranks join: ZeRO-1 keeps 4 Psi, ZeRO-2 2 Psi.
    Worked number: 7.5e9 parameters on N = 64 give 120, 31.4, 16.6 and 1.9 GB (1e9 bytes).
    With N = 1 every stage is 16 Psi. Any other `stage` raises ValueError naming STAGES.
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


# ============================================================================ 2. shards


# exercise zero1-step (5 points): The ZeRO-1 step: reduce-scatter, step my shard, all-gather
# hint: shard_bounds is lesson 01's chunk_bounds (`collectives.chunk_bounds`); average with
#   `contract.reduce_scatter_sum` / N, N the size of `group`; a gradient missing on this rank is zeros;
#   copy the gathered parameter into the live one (param.copy_); the verdict is one all-reduce.
def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s shard of a flattened parameter of `numel` elements:
    lesson 01's near-equal chunks (sizes differ by at most one, the first numel % N ranks own
    one more: shard_bounds(10, 4, r) for r = 0..3 is (0, 3), (3, 6), (6, 8), (8, 10)), so
    shard_bounds(3, 4, 3) == (3, 3): rank 3 owns nothing of a 3-element bias, and the ring
    simply skips empty chunks. The N shards tile [0, numel) in rank order, without overlap.
    `rank` and `world_size` are within the group that shards (group ranks, not global)."""
    return collectives.chunk_bounds(numel, world_size)[rank]


# exercise zero1-step (continued)
def reduce_scatter_mean(grad: torch.Tensor, traffic: collectives.Traffic,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's shard of the data-parallel average of `grad` over the N ranks of `group`
    (None: the world; any shape, n elements, the same shape on every rank):
    `contract.reduce_scatter_sum` of the flattened gradient divided by N = dist.get_world_size(group),
    shape (end - start,) with shard_bounds(n, N, group rank). Sends (N-1)/N x n elements: half
    an all-reduce. `grad` is not modified. Formula: with g_j group rank j's gradient, the
    result is (1/N) sum_j g_j.reshape(-1)[start:end]."""
    return contract.reduce_scatter_sum(grad.reshape(-1), traffic, group) / dist.get_world_size(group)


# ============================================================================ 3. ZeRO-1


class ZeroStage1(contract.OptimizerContract, torch.optim.Optimizer):
    """ZeRO-1 (P_os): any torch.optim optimizer whose states are sharded over `group`.

    ZeroStage1(params, optimizer_class, *, group=None, **defaults), as torch's
    ZeroRedundancyOptimizer(params, optimizer_class, **defaults): `params` are parameters,
    (name, parameter) pairs or param-group dicts; `param_groups` keep the full parameters as
    given (an LR scheduler works on them). Every rank holds the whole model (group rank 0's
    values, broadcast at construction) and its full gradients, but keeps optimizer states
    only for its shard of each flattened parameter: an inner `optimizer_class` over the
    shards, in matching groups (element-wise optimizers: exactly the slice of the full step).
    It averages the gradients itself: use it instead of DDP, not after it.
    Attributes (lessons 06 and 13 rely on them): `named` [(name, parameter)], a tied weight
    once; `bounds` [(start, end)], this rank's slice of each; `shards` [nn.Parameter],
    views of the live parameters (stepping a shard updates the model in place);
    `optimizer`, the inner optimizer; `traffic`, lesson 01's byte count; `group`, `rank`,
    `world`. Use: zero.zero_grad(); loss.backward(); zero.step() (or scaler.step(zero)).
    """

    _step_supports_amp_scaling = True  # a GradScaler lets step() unscale and skip (see step)

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None, **defaults):
        super().__init__(params, defaults)  # param_groups: the full parameters, as given
        self.group, self.traffic = group, collectives.Traffic()
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.named = contract.distinct_parameters(self.param_groups)
        contract.broadcast_from_first([param for _, param in self.named], group)
        self.bounds = [shard_bounds(p.numel(), self.world, self.rank) for _, p in self.named]
        self.shards = [self.make_shard(p, start, end) for (_, p), (start, end)
                       in zip(self.named, self.bounds)]
        shard_of = {id(param): shard for (_, param), shard in zip(self.named, self.shards)}
        self.optimizer = optimizer_class(  # the same groups, each parameter once, as shards
            [dict({k: v for k, v in g.items() if k not in ("params", "param_names")},
                  params=list({id(p): shard_of[id(p)] for p in g["params"]}.values()))
             for g in self.param_groups], **defaults)
        contract.sync_hyperparameters(self.optimizer.param_groups, self.param_groups)

    def make_shard(self, param: nn.Parameter, start: int, end: int) -> nn.Parameter:
        """Elements [start, end) of the flattened parameter, as a view (no copy)."""
        if not param.is_contiguous():
            raise ValueError(f"ZeRO shards views of contiguous parameters; one of shape "
                             f"{tuple(param.shape)} is not contiguous")
        return nn.Parameter(param.detach().view(-1)[start:end])

    @torch.no_grad()
    def step(self, closure=None):
        """The ZeRO step, after loss.backward(): closure (if any) -> `unscale_gradients` ->
        `reduce_scatter_gradients` -> unless `skip_step`: the inner optimizer on my shards
        (`step_shards`, with the current hyperparameters) -> `all_gather_parameters`. Under
        scaler.step(zero), GradScaler sets `grad_scale` and `found_inf` on this optimizer
        first (torch's protocol for optimizers that unscale themselves). Returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.unscale_gradients()  # a GradScaler's: my gradients / my scale, before averaging
        self.reduce_scatter_gradients()  # full gradients (Psi) -> my averaged shards (Psi_r)
        if not self.skip_step():  # the scaler's verdict, the same on every rank
            contract.sync_hyperparameters(self.param_groups, self.optimizer.param_groups)
            self.step_shards()  # the inner optimizer on my shards only: states K Psi_r
            contract.sync_hyperparameters(self.optimizer.param_groups, self.param_groups)
            self.all_gather_parameters()  # my updated shards -> the full parameters everywhere
        return loss

    # exercise zero1-step (continued)
    def reduce_gradient(self, index: int) -> None:
        """Parameter `index` of `named`: r = `reduce_scatter_mean` of its gradient over the
        group (zeros of the parameter's shape where this rank has no gradient: an unused
        parameter counts as zero in the average, as in DDP), shards[index].grad = r, or
        += r when it already holds one (micro-batches accumulate); then param.grad = None.
        Every rank of the group must call it for the same parameters in the same order."""
        param, shard = self.named[index][1], self.shards[index]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        reduced = reduce_scatter_mean(grad, self.traffic, self.group)
        shard.grad = reduced if shard.grad is None else shard.grad + reduced
        param.grad = None

    # exercise zero1-step (continued)
    def reduce_scatter_gradients(self) -> None:
        """`reduce_gradient` for every parameter that has a gradient on some rank of the group
        (`gradient_presence`), in `named` order. A parameter with a gradient on no rank
        (frozen, or unused in this step) is left alone: its shard keeps no gradient, so the
        inner optimizer skips it exactly as torch skips a parameter whose .grad is None (no
        state, no weight decay). Sends (N-1)/N of every reduced parameter; the full gradients
        (Psi) did all exist at the end of backward: ZeRO-1's peak."""
        for index, present in enumerate(self.gradient_presence()):
            if present:
                self.reduce_gradient(index)

    # exercise zero1-step (continued)
    def skip_step(self) -> bool:
        """GradScaler's inf/NaN verdict, the same on every rank of the group. Without a scaler
        (no attribute `found_inf` on this optimizer): False, nothing sent. Under
        scaler.step(zero): True when the scaler's own flag `found_inf` (its check of this
        rank's full gradients) is nonzero or a shard gradient holds an inf or a NaN, on ANY
        rank: one all-reduce (max) of one number over the group, as torch's ShardedGradScaler
        does, so that no rank steps (and all-gathers) while another skips."""
        flag = getattr(self, "found_inf", None)
        if flag is None:
            return False
        bad = float(flag) > 0 or any(not bool(torch.isfinite(s.grad).all())
                                     for s in self.shards if s.grad is not None)
        verdict = torch.tensor([float(bad)], device=self.named[0][1].device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.group)
        return bool(verdict.item())

    def step_shards(self) -> None:
        """The inner optimizer on this rank's shards (element-wise: my slice of the update)."""
        self.optimizer.step()

    # exercise zero1-step (continued)
    def all_gather_parameters(self) -> None:
        """For every parameter whose shard has a gradient (the others were not stepped): the
        group's all-gather of the N updated shards (`contract.all_gather_flat`, n elements), copied
        into the live parameter in place (param.copy_ under no_grad: the same tensor and the
        same storage, which the shards view and any other reference sees; never rebind
        param.data). Slice [start, end) of rank r's copy comes from rank r's shard. Sends
        (N-1)/N of every stepped parameter."""
        for (_, param), shard in zip(self.named, self.shards):
            if shard.grad is None:
                continue
            full = contract.all_gather_flat(shard.detach(), param.numel(), self.traffic, self.group)
            with torch.no_grad():
                param.copy_(full.view_as(param))


# ============================================================================ 4. what ZeRO-2 adds


class ZeroStage2(contract.BackwardRounds, ZeroStage1):
    """ZeRO-2 (P_os+g) = ZeRO-1 + sharded gradients. A post-accumulate-grad hook on every
    parameter reduce-scatters its gradient once backward has produced it and frees the full
    gradient: Psi_r gradient elements held instead of Psi. Every rank reduce-scatters in one
    fixed order (`order`: the parameters that require grad, last first), whatever order its
    backward took; at the end of each backward (`finish_backward`) what this rank never
    produced is reduced as zeros, and what no rank produced keeps no gradient. Same bytes as
    ZeRO-1; the step has no reduce-scatter left. It refuses a GradScaler (whose own check
    would find no gradient: backward freed them): use ZeroStage1 for loss scaling."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None, **defaults):
        super().__init__(params, optimizer_class, group=group, **defaults)
        self.order: list[int] = []  # this backward's reduce-scatter order (set by start_backward)
        self.ready: set[int] = set()  # parameters whose gradient this backward has produced
        self.issued = 0  # how many of `order` have been reduce-scattered in this backward
        self.in_backward = False
        self.install_hooks()

    # exercise zero2-hook (3 points): ZeRO-2: reduce-scatter each gradient as backward makes it
    # hint: `param.register_post_accumulate_grad_hook(hook)` runs hook(param) once param.grad
    #   is complete; bind `index` in a closure; mark it ready, then reduce (`reduce_gradient`)
    #   `order[issued]` while it is ready, advancing `issued`: the same sequence on every rank.
    def install_hooks(self) -> None:
        """Register `shard_gradient_hook(index)` as the post-accumulate-grad hook of parameter
        `index` of `named`, for every parameter that requires grad (a frozen one never gets a
        gradient; torch refuses a hook on it). Called once, by __init__."""
        for index, (_, param) in enumerate(self.named):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self.shard_gradient_hook(index))

    # exercise zero2-hook (continued)
    def shard_gradient_hook(self, index: int):
        """The hook of parameter `index`, hook(param) -> None, run by autograd once param.grad
        is complete. The first hook of a backward calls `start_backward()`. Then: add `index`
        to `ready`, and while `issued` < len(order) and order[issued] is ready, call
        `reduce_gradient(order[issued])` and advance `issued`. So every rank reduce-scatters
        the same parameters in the same order (that of `order`), each as soon as it and every
        parameter before it in `order` are ready; two backwards without a zero_grad add up in
        the shards. Sends (N-1)/N n per parameter reduced."""
        def hook(param: torch.Tensor) -> None:
            if not self.in_backward:
                self.start_backward()
            self.ready.add(index)
            while self.issued < len(self.order) and self.order[self.issued] in self.ready:
                self.reduce_gradient(self.order[self.issued])
                self.issued += 1
        return hook

    def unscale_gradients(self) -> None:
        """Refused: see the class docstring."""
        if getattr(self, "grad_scale", None) is not None or hasattr(self, "found_inf"):
            raise RuntimeError("ZeRO-2 frees every full gradient during backward, so a GradScaler's "
                               "own inf check finds none and its update() would fail: use "
                               "ZeroStage1 with a GradScaler (or ZeroStage3 with ShardedGradScaler)")

    def reduce_scatter_gradients(self) -> None:
        """Nothing left: every gradient was reduce-scattered during backward."""


# ============================================================================ 5. clipping shards


# exercise sharded-clip (3 points): Global-norm gradient clipping on shards
# hint: sum the squares locally, `dist.all_reduce` one number over `group` (the sum over its
#   ranks), take the square root; the scale is capped at 1, so small gradients are left alone.
def sharded_clip_grad_norm_(shard_grads: list[torch.Tensor], max_norm: float,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip by the global 2-norm when each rank of `group` holds only shards of the gradient.

    shard_grads: this rank's gradient shards (any shapes, empty ones allowed, at least one);
    across the group they partition the full gradient g, as ZeRO's shards do. The norm is not
    element-wise: ||g||^2 = sum over ranks of ||g_r||^2. Each rank sums its squares in
    float32 or wider (at least the gradients' own precision: float64 gradients in float64),
    one all-reduce of that one number over `group` gives every rank of it ||g||, and every
    rank scales its shards in place by the same c = min(1, max_norm / (||g|| + 1e-6)) (the
    formula of torch.nn.utils.clip_grad_norm_). Returns ||g|| before clipping (0-d, equal on
    every rank). Cost: one all-reduce of one element. Clipping each shard by its own norm
    would give each rank its own c: no longer the data-parallel update.
    """
    if not shard_grads:
        raise ValueError("sharded_clip_grad_norm_ needs this rank's shard gradients (empty ones too)")
    dtype = torch.promote_types(shard_grads[0].dtype, torch.float32)
    squares = torch.zeros(1, dtype=dtype, device=shard_grads[0].device)
    for grad in shard_grads:
        squares += grad.detach().to(dtype).pow(2).sum()
    dist.all_reduce(squares, group=group)  # sum over ranks: the whole gradient's ||g||^2
    norm = squares.sqrt()[0]
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in shard_grads:
        grad.detach().mul_(scale.to(grad.dtype))
    return norm


# ============================================================================ 6. communication


# exercise zero-formulas (continued)
def zero_communication_elements(stage: str, num_params: float) -> float:
    """Elements each rank moves per step in the paper's accounting (a reduce-scatter or an
    all-gather of Psi counts Psi): DP and stages 1-2 reduce-scatter the gradients and
    all-gather the parameters, 2 Psi; stage 3 all-gathers the parameters twice (forward and
    backward) and reduce-scatters the gradients, 3 Psi (1.5x)."""
    return (3 if stage == "zero3" else 2) * num_params


def expected_bytes_sent(stage: int, numels: list[int], itemsize: int, world: int, rank: int) -> int:
    """Bytes rank `rank` sends per step over lesson 01's ring, parameter by parameter (exact,
    uneven chunks included): stages 0-2 one reduce-scatter + one all-gather (= an all-reduce),
    stage 3 one reduce-scatter + two all-gathers."""
    total = 0
    for numel in numels:
        sent = collectives.ring_bytes_sent(numel, itemsize, world, rank)
        total += sent["all_reduce"] + (sent["all_gather"] if stage == 3 else 0)
    return total


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
