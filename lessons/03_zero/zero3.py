"""Lesson 03, part 2: what ZeRO-3 adds, parameters sharded and gathered just in time.

main.py ends with ZeRO-2: every rank still holds the whole model (2 Psi bytes of fp16
weights); only the gradients and optimizer states are sharded. ZeRO-3 (`ZeroStage3`, here)
keeps only this rank's shard of each parameter (Psi_r elements) and lets a layer's full
weights exist only while the layer runs. Like FSDP2's `fully_shard` it shards a module in
place: afterwards the module's parameters ARE the shards (flat fp32 master weights), so
`torch.optim.AdamW(model.parameters())` steps the shards and `model.state_dict()` saves them;
it takes torch's own `MixedPrecisionPolicy`. Every module that owns parameters, and the root,
is a unit with four hooks, in the order a step meets them:

1. forward pre-hook (`ZeroStage3.gather_parameters_hook`): all-gather the unit's weights in
   `param_dtype` through `_GatherParameter` (an autograd Function whose backward
   reduce-scatters the gradient in `reduce_dtype` into the shard), swap them into the module
   in place of the shards, and make autograd save a recipe instead of a gathered weight;
2. forward hook (`ZeroStage3.free_parameters_hook`): swap the shards back (the full weights
   are freed) and hook the unit's outputs;
3. that hook (`ZeroStage3.regather_hook`): all-gather the weights again just before the
   unit's backward;
4. `_GatherParameter.backward`: reduce-scatter the gradient into the shard, drop the copy
   (a frozen weight's copy goes when autograd unpacks the last recipe that needs it).

Cost: 3 Psi (N-1)/N elements sent per step (two all-gathers and one reduce-scatter), 1.5x
ZeRO-1, in param_dtype for the gathers and reduce_dtype for the reduce-scatter (a frozen
parameter that backward does not need is gathered once and never reduced).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from . import main as zero  # this lesson's shards and reduce-scatter

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique
contract = zero.contract  # collectives on a group, the broadcast of rank 0's values


def cast_floating(dtype: torch.dtype | None, tree):
    """Every floating-point tensor of `tree` (args, kwargs, outputs) cast to `dtype` (None:
    unchanged); what FSDP2 does to a module's inputs (param_dtype) and outputs (output_dtype)."""
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, tree)


# exercise zero3-hooks (5 points): ZeRO-3: gather before use, free after, regather for backward
# hint: forward is `contract.all_gather_flat` of the detached shard cast to param_dtype;
#   backward `zero.reduce_scatter_mean` of the gradient cast to reduce_dtype, back in the
#   shard's dtype. The pre-hook puts `self.gather(index)` into module._parameters[attr] and
#   enters `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`, pack matching a saved
#   tensor to a gathered weight by `untyped_storage().data_ptr()`; the forward hook leaves it,
#   puts the shards back and hooks the outputs with `register_multi_grad_hook(..., mode="any")`.
class _GatherParameter(torch.autograd.Function):
    """shard (n_r,) -> full parameter (n,) in param_dtype, by the group's all-gather.
    forward(ctx, shard, owner, index) -> `contract.all_gather_flat` of shard.detach() cast to
    owner.param_dtype(shard), n = owner.shapes[index].numel(), counted in owner.traffic over
    owner.group (owner: the ZeroStage3 whose shard it is); keep owner and index on ctx.
    backward(ctx, grad_full (n,), param_dtype) -> (`zero.reduce_scatter_mean` of grad_full
    cast to owner.reduce_dtype(grad_full) over owner.group, cast back to the shard's dtype,
    shape (n_r,); None; None), after removing entry `index` from owner.regathered (if there):
    the copy gathered again for this unit's backward is dropped. Autograd adds the result to
    shard.grad (micro-batches accumulate)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, owner: ZeroStage3, index: int) -> torch.Tensor:
        ctx.owner, ctx.index, ctx.shard_dtype = owner, index, shard.dtype
        cast = shard.detach().to(owner.param_dtype(shard))
        return contract.all_gather_flat(cast, owner.shapes[index].numel(), owner.traffic, owner.group)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        owner = ctx.owner
        owner.regathered.pop(ctx.index, None)  # this unit's backward is done with it
        grad = grad_full.to(owner.reduce_dtype(grad_full))
        return zero.reduce_scatter_mean(grad, owner.traffic, owner.group).to(ctx.shard_dtype), None, None


class ZeroStage3:
    """ZeRO-3 (P_os+g+p): ZeroStage3(module, *, group=None, mp_policy=None) shards `module`
    over `group` in place, as FSDP2's fully_shard(module, mp_policy=...) does.

    Every rank starts from group rank 0's parameter values (broadcast at construction; buffers
    are left as they are, as FSDP2 leaves them). Each distinct parameter (a tied weight once)
    becomes its shard: nn.Parameter of this
    rank's shard_bounds slice of the flattened parameter, in the parameter's own dtype (the
    fp32 master weights), registered in the modules under the original names, so that
    `module.parameters()` / `named_parameters()` / `state_dict()` return the shards and a
    torch optimizer built from them keeps sharded states. A unit's full weights exist only
    while it runs: gathered (in `param_dtype`) before its forward and put in place of the
    shards, swapped back after (autograd keeps a recipe, not the weight), gathered again when
    backward reaches the unit, dropped once the gather's backward has reduce-scattered the
    gradient (in `reduce_dtype`) into the shard. mp_policy: torch's MixedPrecisionPolicy;
    param_dtype (None: the parameter's dtype) for the gathered weights and the compute,
    reduce_dtype (None: param_dtype) for the reduce-scatter, cast_forward_inputs (cast each
    unit's floating inputs to param_dtype), output_dtype (cast each unit's floating outputs).
    Attributes: `named` [(name, shard)], `shapes`, `bounds`, `shards`, `traffic`, `group`,
    `rank`, `world`, `regathered` {index: full weight held for a backward}; the module keeps
    `module.zero3` (this object), as an FSDP2 module keeps its state. Sends 3 Psi (N-1)/N per
    step; the optimizer step sends nothing."""

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None):
        self.module, self.group, self.traffic = module, group, collectives.Traffic()
        self.mp_policy = mp_policy  # read by attribute: importing torch's fsdp costs a second
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        named = list(module.named_parameters())  # each distinct parameter once
        contract.broadcast_from_first([param for _, param in named], group)
        index_of = {id(param): index for index, (_, param) in enumerate(named)}
        self.shapes = [param.shape for _, param in named]
        self.bounds = [zero.shard_bounds(p.numel(), self.world, self.rank) for _, p in named]
        self.shards = [nn.Parameter(p.detach().reshape(-1)[start:end].clone(),
                                    requires_grad=p.requires_grad)
                       for (_, p), (start, end) in zip(named, self.bounds)]
        self.named = [(name, shard) for (name, _), shard in zip(named, self.shards)]
        self.regathered: dict[int, torch.Tensor] = {}  # index -> full weight, in backward
        self.recipes: dict[int, int] = {}  # index -> recipes saved and not yet unpacked
        self.saved_tensor_hooks: list = []  # a stack: units may nest
        for unit in module.modules():
            entries = [(attr, index_of[id(p)]) for attr, p in unit._parameters.items() if p is not None]
            for attr, index in entries:  # the module now holds the shard, not the parameter
                unit._parameters[attr] = self.shards[index]
            if entries or unit is module:  # the root is a unit too (its casts), as in FSDP2
                unit.register_forward_pre_hook(self.gather_parameters_hook(entries), with_kwargs=True)
                unit.register_forward_hook(self.free_parameters_hook(entries))
        module.zero3 = self

    def policy(self, name: str, default=None):
        """mp_policy's field `name` (MixedPrecisionPolicy's defaults without a policy)."""
        return getattr(self.mp_policy, name, default)

    def param_dtype(self, shard: torch.Tensor) -> torch.dtype:
        return self.policy("param_dtype") or shard.dtype

    def reduce_dtype(self, grad: torch.Tensor) -> torch.dtype:
        return self.policy("reduce_dtype") or grad.dtype  # None: reduce in the compute dtype

    def gather(self, index: int) -> torch.Tensor:
        """Parameter `index`, full, in its shape and param_dtype, differentiable through
        `_GatherParameter`. Sends (N-1)/N n elements."""
        return _GatherParameter.apply(self.shards[index], self, index).view(self.shapes[index])

    # exercise zero3-hooks (continued)
    def gather_parameters_hook(self, entries: list[tuple[str, int]]):
        """Forward pre-hook of a unit owning `entries` [(attribute, parameter index)]: put
        `gather(index)` in module._parameters[attr] for each (the module computes with the
        full weight), and enter saved-tensor hooks under which autograd saves a recipe
        (index, size, stride, offset) for any tensor sharing a gathered weight's storage
        instead of its bytes (counted in recipes[index]); activations are saved as usual. The
        hooks object goes on the stack `saved_tensor_hooks` (entered here, left by
        `free_parameters_hook`); unpack turns a recipe back into a view of regathered[index]
        by as_strided(size, stride, offset), and drops regathered[index] once the last of
        its recipes is unpacked (recipes[index] back to 0): the copy dies with its last use.
        Returns hook(module, args, kwargs) -> (args, kwargs) with the floating inputs cast to
        param_dtype when mp_policy.cast_forward_inputs (`cast_floating`), else None."""
        def hook(module: nn.Module, args, kwargs):
            storages = {}
            for attr, index in entries:
                full = self.gather(index)
                module._parameters[attr] = full
                storages[full.untyped_storage().data_ptr()] = index

            def pack(tensor: torch.Tensor):
                index = storages.get(tensor.untyped_storage().data_ptr())
                if index is None:
                    return tensor  # an activation: keep it
                self.recipes[index] = self.recipes.get(index, 0) + 1
                return index, tensor.size(), tensor.stride(), tensor.storage_offset()

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                index, size, stride, offset = saved
                view = self.regathered[index].as_strided(size, stride, offset)
                self.recipes[index] -= 1
                if not self.recipes[index]:  # its last use: the view alone keeps it alive
                    del self.regathered[index]
                return view

            self.saved_tensor_hooks.append(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            self.saved_tensor_hooks[-1].__enter__()
            if self.policy("cast_forward_inputs", True) and self.policy("param_dtype"):
                return cast_floating(self.policy("param_dtype"), (args, kwargs))
            return None
        return hook

    # exercise zero3-hooks (continued)
    def free_parameters_hook(self, entries: list[tuple[str, int]]):
        """Forward hook: leave the saved-tensor hooks (pop them from the stack), put each shard
        back in module._parameters[attr] (the full weights are freed), and when some tensor of
        the output requires grad, register `regather_hook(entries)` on the output's tensors
        with torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any") (it runs
        once, when backward first reaches the unit's output). Returns the output, its floating
        tensors cast to mp_policy.output_dtype (`cast_floating`)."""
        def hook(module: nn.Module, args, output):
            self.saved_tensor_hooks.pop().__exit__(None, None, None)
            for attr, index in entries:
                module._parameters[attr] = self.shards[index]
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:  # fires when backward reaches this unit's output
                torch.autograd.graph.register_multi_grad_hook(tensors, self.regather_hook(entries),
                                                              mode="any")
            return cast_floating(self.policy("output_dtype"), output)
        return hook

    # exercise zero3-hooks (continued)
    def regather_hook(self, entries: list[tuple[str, int]]):
        """Hook run just before the unit's backward: all-gather each of its parameters into
        `regathered[index]` (full shape, param_dtype: `gather(index)` detached, so no second
        gradient path), except a frozen one (requires_grad False) that no recipe needs: nothing
        would use or drop it. Sends (N-1)/N n each. Returns hook(grad) -> None."""
        def hook(grad: torch.Tensor) -> None:
            for _, index in entries:
                if self.shards[index].requires_grad or self.recipes.get(index):
                    self.regathered[index] = self.gather(index).detach()
        return hook

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: the full parameter} in its own dtype and shape, all-gathered from the shards
        (a collective: every rank of the group calls it; not counted in `traffic`)."""
        return {name: contract.all_gather_flat(shard.detach(), shape.numel(), None, self.group)
                .view(shape) for (name, shard), shape in zip(self.named, self.shapes)}
