"""Lesson 03: ZeRO-1/2/3, sharding what data parallelism replicates.

Data parallelism keeps N identical copies of the parameters, gradients and Adam states. ZeRO
keeps one copy, cut into N shards (rank r owns shard r), and moves only what is needed, when
it is needed. In teaching order:

1. memory: bytes of model states per device for DP and ZeRO-1/2/3 (`zero_bytes_per_device`);
2. shards: lesson 01's near-equal chunks of every flattened parameter (`shard_bounds`);
3. ZeRO-1 (`ZeroStage1`): Adam states sharded; the step reduce-scatters the gradients, runs
   Adam on my shard and all-gathers the parameters;
4. what ZeRO-2 adds (`ZeroStage2`): each gradient is reduce-scattered as backward produces it;
5. what ZeRO-3 adds (`ZeroStage3`, in zero3.py: its hooks are a story of their own):
   parameters sharded, gathered just before use, freed after; `ZeroAdam` builds any stage;
6. global-norm gradient clipping on shards (`sharded_clip_grad_norm_`);
7. communication: 2 Psi per step for DP and ZeRO-1/2, 3 Psi for ZeRO-3.

Every collective is lesson 01's ring, whose `Traffic` counts the bytes. The proof is checks.py:
`python lessons/03_zero/main.py --world-size 4`, or `--memory --params 7.5e9 --dp 64`.
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
data_parallel = importlib.import_module("lessons.02_data_parallel.main")  # lesson 02's technique

LR = 0.01

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


# exercise zero1-step (4 points): The ZeRO-1 step: reduce-scatter, Adam on my shard, all-gather
# hint: shard_bounds is lesson 01's chunk_bounds (`collectives.chunk_bounds`); the ring
#   collectives are `collectives.ring_reduce_scatter` and `collectives.ring_all_gather` (they
#   take and return 1-D tensors and count bytes in a `Traffic`); the average divides the sum by N.
def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s shard of a flattened parameter of `numel` elements:
    lesson 01's near-equal chunks (sizes differ by at most one, the first numel % N ranks own
    one more: shard_bounds(10, 4, r) for r = 0..3 is (0, 3), (3, 6), (6, 8), (8, 10)), so
    shard_bounds(3, 4, 3) == (3, 3): rank 3 owns nothing of a 3-element bias, and the ring
    simply skips empty chunks. The N shards tile [0, numel) in rank order, without overlap."""
    return collectives.chunk_bounds(numel, world_size)[rank]


# exercise zero1-step (continued)
def reduce_scatter_mean(grad: torch.Tensor, traffic: collectives.Traffic) -> torch.Tensor:
    """This rank's shard of the data-parallel average of `grad` (any shape, n elements, the
    same shape on every rank): lesson 01's ring reduce-scatter of the flattened gradient
    divided by N, shape (end - start,) with shard_bounds(n, N, rank). Sends (N-1)/N x n
    elements: half an all-reduce. `grad` is not modified. Formula: with g_j rank j's
    gradient, the result is (1/N) sum_j g_j.reshape(-1)[start:end]."""
    return collectives.ring_reduce_scatter(grad.reshape(-1), traffic) / dist.get_world_size()


# ============================================================================ 3. ZeRO-1


class ZeroStage1:
    """ZeRO-1 (P_os): data-parallel Adam whose states are sharded.

    Every rank holds the whole model (rank 0's weights, broadcast at construction) and computes
    full gradients on its rows of the batch, but keeps Adam's exp_avg and exp_avg_sq only for
    its shard of each flattened parameter: 2 Psi_r elements instead of 2 Psi. Adam is
    element-wise, so a shard's update is exactly that slice of the full update.
    Attributes (lesson 06 relies on them): `named` [(name, parameter)] in named_parameters()
    order; `bounds` [(start, end)] this rank's slice of each (`shard_bounds`); `shards`
    [nn.Parameter of end - start elements], what Adam steps (here views into the parameters,
    so stepping a shard updates the model in place); `optimizer`, torch.optim.Adam over the
    shards; `traffic`, lesson 01's count of the bytes this rank sends.
    Use: zero.zero_grad(); loss.backward(); zero.step().
    """

    def __init__(self, model: nn.Module, lr: float = LR):
        self.model = model
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.traffic = collectives.Traffic()
        data_parallel.broadcast_parameters_and_buffers(model)  # every rank starts from rank 0's
        self.named = list(model.named_parameters())
        self.bounds = [shard_bounds(p.numel(), self.world, self.rank) for _, p in self.named]
        self.shards = [self.make_shard(p, start, end) for (_, p), (start, end)
                       in zip(self.named, self.bounds)]
        self.optimizer = torch.optim.Adam(self.shards, lr=lr, foreach=False)

    def make_shard(self, param: nn.Parameter, start: int, end: int) -> nn.Parameter:
        """Elements [start, end) of the flattened parameter, as a view (no copy)."""
        return nn.Parameter(param.detach().view(-1)[start:end])

    def step(self, scaler: torch.amp.GradScaler | None = None,
             max_norm: float | None = None) -> torch.Tensor | None:
        """The ZeRO step, after loss.backward(). Returns the global gradient norm (before
        clipping) when `max_norm` is given, else None."""
        self.reduce_scatter_gradients()  # full gradient (Psi) -> my averaged shard (Psi_r)
        norm = None
        if max_norm is not None:  # the norm of the whole gradient, not of my shard
            if scaler is not None:
                scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
            norm = sharded_clip_grad_norm_([s.grad for s in self.shards], max_norm)
        self.step_shards(scaler)  # Adam on my shard only: states 2 Psi_r
        self.all_gather_parameters()  # my updated shard -> the full parameters, on every rank
        return norm

    # exercise zero1-step (continued)
    def reduce_scatter_gradients(self) -> None:
        """For every parameter: shard.grad = `reduce_scatter_mean(param.grad)`, shape
        (end - start,), the data-parallel average of this rank's slice; then param.grad =
        None (what is left of it is other ranks' business). Sends (N-1)/N Psi elements in
        all. The full gradients (Psi) did all exist at the end of backward: ZeRO-1's peak."""
        for (_, param), shard in zip(self.named, self.shards):
            shard.grad = reduce_scatter_mean(param.grad, self.traffic)
            param.grad = None

    # exercise zero1-step (continued)
    def step_shards(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """Adam on this rank's shards: optimizer.step(), or scaler.step(optimizer), which
        unscales the shard gradients and skips the step on inf/nan. With N > 1 the skip must
        be the same on every rank: torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler
        all-reduces its inf/nan flag; a plain GradScaler judges this rank's shard only."""
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)

    # exercise zero1-step (continued)
    def all_gather_parameters(self) -> None:
        """For every parameter: lesson 01's ring all-gather of the N updated shards, copied
        into the full parameter (n elements, the same on every rank after the call): the
        slice [start, end) of rank r's copy comes from rank r's shard, every slice on every
        rank. In place (param keeps its tensor; no autograd). Sends (N-1)/N Psi elements."""
        for (_, param), shard in zip(self.named, self.shards):
            full = collectives.ring_all_gather(shard.detach(), param.numel(), self.traffic)
            with torch.no_grad():
                param.copy_(full.view_as(param))

    def zero_grad(self) -> None:
        for _, param in self.named:
            param.grad = None
        self.optimizer.zero_grad(set_to_none=True)


# ============================================================================ 4. what ZeRO-2 adds


class ZeroStage2(ZeroStage1):
    """ZeRO-2 (P_os+g) = ZeRO-1 + sharded gradients. A post-accumulate-grad hook on every
    parameter reduce-scatters its gradient the moment backward has produced it and frees the
    full gradient, so no whole-model gradient ever exists: Psi_r gradient elements held
    instead of Psi (in flight: one parameter's). Same bytes sent as ZeRO-1; the step has no
    reduce-scatter left to do."""

    def __init__(self, model: nn.Module, lr: float = LR):
        super().__init__(model, lr)
        self.install_hooks()

    # exercise zero2-hook (3 points): ZeRO-2: reduce-scatter each gradient as backward makes it
    # hint: `param.register_post_accumulate_grad_hook(hook)` runs hook(param) once param.grad
    #   is complete; bind `index` in a closure (a hook per parameter); reduce with
    #   `reduce_scatter_mean`, then free the full gradient with param.grad = None.
    def install_hooks(self) -> None:
        """Register `shard_gradient_hook(index)` as the post-accumulate-grad hook of parameter
        `index` of `named`, for every parameter (called once, by __init__)."""
        for index, (_, param) in enumerate(self.named):
            param.register_post_accumulate_grad_hook(self.shard_gradient_hook(index))

    # exercise zero2-hook (continued)
    def shard_gradient_hook(self, index: int):
        """The hook for parameter `index`, hook(param) -> None, run by autograd once
        param.grad (n elements) is complete: add `reduce_scatter_mean(param.grad)` to
        shards[index].grad (sum over micro-batches when accumulating: two backwards without a
        zero_grad leave the sum of both averages), then param.grad = None, so that after every
        backward no parameter holds a gradient. Sends (N-1)/N n elements per call."""
        def hook(param: torch.Tensor) -> None:
            grad = reduce_scatter_mean(param.grad, self.traffic)
            shard = self.shards[index]
            shard.grad = grad if shard.grad is None else shard.grad + grad
            param.grad = None  # the full gradient is freed at once
        return hook

    def reduce_scatter_gradients(self) -> None:
        """Nothing left: every gradient was reduce-scattered during backward."""


# ============================================================================ 5. ZeRO-3 (zero3.py); any stage


class ZeroAdam(ZeroStage1):
    """ZeRO-`stage` Adam over `model`: ZeroAdam(model, stage, lr) builds ZeroStage1, ZeroStage2
    or zero3.py's ZeroStage3 (the one name lesson 06 builds on; ZeroAdam.step is
    ZeroStage1.step)."""

    def __new__(cls, model: nn.Module, stage: int, lr: float = LR) -> ZeroStage1:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        # the object returned is not a ZeroAdam, so Python does not run __init__ again
        if stage == 3:  # zero3.py builds on ZeroStage2 above, so it is imported when asked for
            return importlib.import_module("lessons.03_zero.zero3").ZeroStage3(model, lr)
        return (ZeroStage1 if stage == 1 else ZeroStage2)(model, lr)


# ============================================================================ 6. clipping shards


# exercise sharded-clip (3 points): Global-norm gradient clipping on shards
# hint: sum the squares locally, `dist.all_reduce` one number (the sum over ranks), take the
#   square root; the scale is capped at 1, so small gradients are left alone.
def sharded_clip_grad_norm_(shard_grads: list[torch.Tensor], max_norm: float,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip by the global 2-norm when each rank of `group` holds only shards of the gradient.

    shard_grads: this rank's gradient shards (any shapes, empty ones allowed, at least one);
    across the group they partition the full gradient g, as ZeRO's shards do. The norm is not
    element-wise: ||g||^2 = sum over ranks of ||g_r||^2. Each rank sums its squares (in fp32 or
    wider), one all-reduce of that one number gives every rank ||g||, and every rank scales
    its shards in place by the same c = min(1, max_norm / (||g|| + 1e-6)) (the formula of
    torch.nn.utils.clip_grad_norm_). Returns ||g|| before clipping (0-d, equal on every rank).
    Cost: one all-reduce of one element. Clipping each shard by its own norm would give each
    rank its own c: no longer the data-parallel update.
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


# ============================================================================ 7. communication


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
