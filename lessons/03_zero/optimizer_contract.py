"""Lesson 03, plumbing: what makes main.py's `ZeroStage1` a torch.optim.Optimizer on any group.

main.py teaches the ZeRO step; this file holds what lets a learner drop it into real code in
place of `torch.optim.Adam(model.parameters())`, with torch's ZeroRedundancyOptimizer's
contract `(params, optimizer_class, **defaults)`:

1. the parameters: `distinct_parameters` reads torch's param groups (a tied parameter counts
   once, named or not), `broadcast_from_first` starts every rank from the same values;
2. the hyperparameters: `sync_hyperparameters` copies every key but "params" between the
   exposed groups (full parameters, which an LR scheduler edits) and the inner optimizer's
   groups (the shards it steps), as ZeroRedundancyOptimizer's `_sync_param_groups` does;
3. `OptimizerContract`, the mixin ZeroStage1 inherits: `zero_grad`, GradScaler's unscaling
   (`unscale_gradients`), the ranks' agreement on which gradients exist
   (`gradient_presence`), global-norm clipping between backward and step
   (`clip_grad_norm_`), and `consolidate_state_dict(to)`, `state_dict()` and
   `load_state_dict()` in torch's own format (full-shape states), so a sharded run's state
   compares with, and loads into, a one-process optimizer or a ZeRO run on another number
   of ranks;
4. collectives on a process group (`reduce_scatter_sum`, `all_gather_flat`): lesson 01's
   rings over the world, where its `Traffic` counts every byte; on any other `group`
   torch's collectives over it (lesson 01's rings have no group), on rows padded to the
   largest of lesson 01's near-equal chunks, not counted;
5. `BackwardRounds`, ZeroStage2's bookkeeping of one backward (the fixed order of its
   reduce-scatters, the end of the backward).
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from itertools import chain

import torch
import torch.distributed as dist

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique


# ============================================================================ 1. parameters


def distinct_parameters(param_groups: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """[(name, parameter)] of torch's `param_groups`, each parameter once (the first time it
    appears: a tied weight listed twice is one parameter), in the order torch's
    Optimizer.state_dict numbers them. Names come from the groups' "param_names" (built from
    `model.named_parameters()`), else the parameter's number as a string."""
    named, seen = [], set()
    for group in param_groups:
        names = group.get("param_names", [None] * len(group["params"]))
        for name, param in zip(names, group["params"]):
            if id(param) not in seen:
                seen.add(id(param))
                named.append((name if name is not None else str(len(named)), param))
    return named


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of `group` (None: the world), in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite every tensor, in place, with group rank 0's values (DDP's constructor does the
    same for a model): the ranks start from one model. Psi elements, once."""
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.detach(), src=group_ranks(group)[0], group=group)


def sync_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """Copy every hyperparameter (every key but "params" and "param_names") of each source
    group into the matching target group."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k not in ("params", "param_names")})


# ============================================================================ 4. group collectives


def padded_rows(flat: torch.Tensor, world: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(world, width) rows, row r = chunk r of `flat` (lesson 01's chunk_bounds) padded with
    zeros to the largest chunk's width: torch's collectives want equal pieces."""
    bounds = collectives.chunk_bounds(flat.numel(), world)
    width = max(end - start for start, end in bounds)
    rows = flat.new_zeros(world, width)
    for row, (start, end) in zip(rows, bounds):
        row[:end - start] = flat[start:end]
    return rows, bounds


def group_reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Lesson 01's `ring_reduce_scatter` (the sum, this rank's chunk) over `group`, by torch's
    reduce_scatter_single on padded rows. A new 1-D tensor of chunk_sizes(n, N)[rank]."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, bounds = padded_rows(flat, world)
    mine = rows.new_empty(rows.shape[1])
    if mine.numel():
        dist.reduce_scatter_single(mine, rows.reshape(-1), group=group)
    start, end = bounds[rank]
    return mine[:end - start].clone()


def group_all_gather(chunk: torch.Tensor, numel: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Lesson 01's `ring_all_gather` over `group` (chunk r of every rank r, n elements), by
    torch's all_gather_single on rows padded to the largest chunk."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, bounds = padded_rows(chunk.new_zeros(numel), world)
    start, end = bounds[rank]
    if chunk.numel() != end - start:
        raise ValueError(f"rank {rank} of the group: chunk has {chunk.numel()} elements, expected "
                         f"{end - start} for numel={numel} over {world} ranks")
    rows[rank, :end - start] = chunk.reshape(-1)
    if rows.numel():
        mine = rows[rank].clone()
        dist.all_gather_single(rows.reshape(-1), mine, group=group)
    return torch.cat([row[:stop - first] for row, (first, stop) in zip(rows, bounds)])


def reduce_scatter_sum(flat: torch.Tensor, traffic: collectives.Traffic | None,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Chunk `rank` of the sum over the ranks of `group` of `flat` (1-D, n elements, the
    same size on every rank): lesson 01's ring over the world (group None: `traffic` counts
    the bytes), `group_reduce_scatter` over any other group."""
    if group is None:
        return collectives.ring_reduce_scatter(flat, traffic)
    return group_reduce_scatter(flat, group)


def all_gather_flat(shard: torch.Tensor, numel: int, traffic: collectives.Traffic | None,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's shard of a flat tensor of `numel` elements, concatenated in rank order
    (1-D, the same on every rank of `group`): lesson 01's ring over the world,
    `group_all_gather` over any other group."""
    if group is None:
        return collectives.ring_all_gather(shard, numel, traffic)
    return group_all_gather(shard, numel, group)


# ============================================================================ 3. the mixin


def is_sharded_state(values: list, sizes: list[int]) -> bool:
    """A state entry is per-element (Adam's exp_avg, SGD's momentum_buffer) when every rank
    holds a 1-D tensor of its shard's size; anything else (Adam's 0-d `step`) is per-parameter."""
    return all(torch.is_tensor(v) and v.dim() == 1 and v.numel() == n for v, n in zip(values, sizes))


class OptimizerContract:
    """What ZeroStage1 inherits besides torch.optim.Optimizer. State dicts in torch's format,
    as torch's ZeroRedundancyOptimizer does it: `consolidate_state_dict(to)` (a collective)
    brings every rank's shard states to group rank `to`; there `state_dict()` returns
    {"state": {index: {key: value}}, "param_groups": [...]} with each per-element state
    all-gathered to its parameter's full shape (what torch's optimizer over the full
    parameters returns); `load_state_dict` takes that form on every rank and keeps its own
    slice, so it also loads a one-process optimizer's dict, or one saved by a run on another
    number of ranks. Uses the host's `named`, `bounds`, `shards`, `optimizer` (the inner
    one), `group`, `rank`, `world`."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the full gradients and the shards' gradients (to None, or to zeros)."""
        for _, param in self.named:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim.Optimizer's, while the optimizer is being built; refused afterwards."""
        if hasattr(self, "optimizer"):
            raise NotImplementedError("ZeroStage1 shards its parameters when it is built: build "
                                      "it with every param group")
        torch.optim.Optimizer.add_param_group(self, param_group)

    def unscale_gradients(self) -> None:
        """Under scaler.step(zero) (GradScaler sets `grad_scale` on this optimizer): divide this
        rank's full gradients by its scale (1/S in float64, rounded to float32, as
        GradScaler.unscale_ does) before they are averaged, so ranks whose scales differ (each
        GradScaler backs off on its own check) still average true gradients."""
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inverse = scale.double().reciprocal().float()
            for _, param in self.named:
                if param.grad is not None:
                    param.grad.mul_(inverse.to(param.grad.device, param.grad.dtype))

    def gradient_presence(self) -> list[bool]:
        """For each parameter of `named`: does at least one rank of the group hold a gradient
        for it? One all-reduce (max) of P flags, P = len(named): what DDP's
        find_unused_parameters=True pays each step so that ranks agree on which gradients to
        reduce (P x 4 bytes and one latency; torch's all-reduce, not counted in `traffic`)."""
        flags = torch.tensor([float(param.grad is not None) for _, param in self.named],
                             device=self.named[0][1].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(flag) for flag in flags.tolist()]

    consolidated: list | None = None  # every rank's shard states, on the rank that consolidated

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard states (CPU copies) on group rank `to`; call on every rank
        of the group. Cost: the optimizer states once over the network (K Psi bytes)."""
        mine = [{key: value.detach().cpu().clone() if torch.is_tensor(value) else value
                 for key, value in self.optimizer.state.get(shard, {}).items()}
                for shard in self.shards]
        everyone = [None] * self.world if self.rank == to else None
        dist.gather_object(mine, everyone, dst=group_ranks(self.group)[to], group=self.group)
        self.consolidated = everyone

    def state_dict(self) -> dict:
        """The whole optimizer state, in the form of torch.optim's state_dict over the full
        parameters, on the rank that last called consolidate_state_dict (the states are as of
        that call; the hyperparameters are current). Anywhere else: RuntimeError."""
        if self.consolidated is None:
            raise RuntimeError(f"rank {self.rank}: the optimizer state has not been consolidated "
                               f"on this rank: call consolidate_state_dict(to={self.rank}) on "
                               f"every rank first (as with ZeroRedundancyOptimizer)")
        packed = torch.optim.Optimizer.state_dict(self)  # torch's param_groups, indices as it numbers them
        state = {}
        for index, ((_, param), per_rank) in enumerate(zip(self.named, zip(*self.consolidated))):
            if not per_rank[0]:
                continue  # never stepped (frozen, or never had a gradient): torch keeps no state
            sizes = [end - start for start, end in collectives.chunk_bounds(param.numel(), self.world)]
            state[index] = {key: torch.cat([s[key] for s in per_rank]).view(param.shape)
                            if is_sharded_state([s[key] for s in per_rank], sizes) else per_rank[0][key]
                            for key in per_rank[0]}
        packed["state"] = state
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's form (from `state_dict()`, or from torch's optimizer over the full
        parameters), on every rank: the hyperparameters of each group, and of each state the
        slice [start, end) of this rank's shard (a tensor of the parameter's shape, but the 0-d
        `step`), in the shard's dtype and device, as torch casts on load."""
        groups, saved = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved) or any(len(g["params"]) != len(s["params"])
                                            for g, s in zip(groups, saved)):
            raise ValueError("loaded state dict does not match this optimizer's parameter groups "
                             f"({[len(s['params']) for s in saved]} parameters per group, this "
                             f"optimizer has {[len(g['params']) for g in groups]})")
        position = {id(param): index for index, (_, param) in enumerate(self.named)}
        param_of = dict(zip(chain.from_iterable(s["params"] for s in saved),
                            chain.from_iterable(g["params"] for g in groups)))
        state = defaultdict(dict)
        for key, entry in state_dict["state"].items():
            index = position[id(param_of[key])]
            (_, param), shard, (start, end) = self.named[index], self.shards[index], self.bounds[index]
            state[shard] = {name: value.reshape(-1)[start:end].to(shard.device, shard.dtype).clone()
                            if torch.is_tensor(value) and name != "step" and value.shape == param.shape
                            else (value.clone() if torch.is_tensor(value) else value)
                            for name, value in entry.items()}
        self.optimizer.state = state
        sync_hyperparameters(saved, groups)
        sync_hyperparameters(groups, self.optimizer.param_groups)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the averaged gradient, between backward and step (FSDP1's
        FullyShardedDataParallel.clip_grad_norm_ has this form): reduce-scatter first, then
        `sharded_clip_grad_norm_` on the shard gradients. Returns the norm before clipping.
        With a GradScaler, call scaler.unscale_(zero) before."""
        self.reduce_scatter_gradients()
        zero = importlib.import_module("lessons.03_zero.main")  # (imported when called: main imports us)
        grads = [s.grad for s in self.shards if s.grad is not None]
        empty = [self.shards[0].detach().new_zeros(0)]  # a rank with no gradient still joins
        return zero.sharded_clip_grad_norm_(grads or empty, max_norm, self.group)


class BackwardRounds:
    """ZeroStage2's bookkeeping of one backward (its hooks are in main.py): which parameters
    are `ready`, how many of `order` were reduce-scattered (`issued`), and the end of the
    backward. Uses the host's `named`, `shards`, `group`, `reduce_gradient`."""

    def start_backward(self) -> None:
        """A backward has begun (its first hook): fix this backward's `order`, clear `ready`
        and `issued`, remember which shards already hold a gradient, and ask autograd to run
        `finish_backward` when this backward ends (as FSDP and DDP do)."""
        self.in_backward, self.ready, self.issued = True, set(), 0
        self.order = [i for i in reversed(range(len(self.named))) if self.named[i][1].requires_grad]
        self.had_gradient = [shard.grad is not None for shard in self.shards]
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """End of backward: reduce what is left of `order` (this rank produced no gradient for
        it, or it waited behind one that did not come: zeros count in the average), then one
        all-reduce of P flags (`ready` on any rank); a parameter no rank produced a gradient
        for gets its shard's previous gradient back (None after zero_grad): skipped by step."""
        for index in self.order[self.issued:]:
            self.reduce_gradient(index)
        flags = torch.tensor([float(i in self.ready) for i in range(len(self.named))],
                             device=self.named[0][1].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        for index, present in enumerate(flags.tolist()):
            if not present and not self.had_gradient[index]:
                self.shards[index].grad = None
        self.in_backward = False
