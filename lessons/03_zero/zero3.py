"""Lesson 03, part 2: what ZeRO-3 adds, parameters sharded and gathered just in time.

main.py ends with ZeRO-2: every rank still holds the whole model (2 Psi bytes of fp16
weights), only the gradients and Adam states are sharded. ZeRO-3 (`ZeroStage3`, built on
main.py's `ZeroStage2`) keeps only this rank's shard of each parameter (Psi_r elements) and
lets a layer's full weights exist only while the layer runs. Four hooks do it, in the order a
step meets them:

1. forward pre-hook (`ZeroStage3.gather_parameters_hook`): all-gather the layer's weights
   through `_GatherParameter`, an autograd Function whose backward reduce-scatters the
   gradient, and make autograd save a recipe instead of the gathered weight;
2. forward hook (`ZeroStage3.free_parameters_hook`): drop the weights;
3. a tensor hook on the layer's output (`ZeroStage3.regather_hook`): all-gather them again
   just before the layer's backward;
4. `_GatherParameter.backward`: reduce-scatter the gradient into the shard and drop the copy.

Cost: 3 Psi (N-1)/N elements sent per step (two all-gathers and one reduce-scatter), 1.5x
ZeRO-1; after the step there is nothing to all-gather. `ZeroAdam(model, 3)` in main.py builds it.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from . import main as zero  # this lesson's stages 1 and 2

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique


# exercise zero3-hooks (5 points): ZeRO-3: gather before use, free after, regather for backward
# hint: forward is lesson 01's all-gather (detach the shard), backward `reduce_scatter_mean`
#   plus dropping `regathered[index]`; the forward pre-hook sets each attribute to
#   `self.gather(index)` and enters `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`,
#   pack matching a saved tensor to a gathered weight by `untyped_storage().data_ptr()`; the
#   forward hook leaves it, sets the attributes to None and registers `regather_hook` on the output.
class _GatherParameter(torch.autograd.Function):
    """shard (n_r,) -> full parameter (n,) by a ring all-gather. Backward: the full gradient
    (n,) is reduce-scattered and averaged into the shard's gradient, and the copy of the
    parameter gathered again for this layer's backward is dropped.
    forward(ctx, shard, numel, owner, index) -> lesson 01's ring all-gather of shard.detach()
    into (numel,), counted in owner.traffic (owner: the ZeroStage3 whose shard it is); keep
    owner and index on ctx.
    backward(ctx, grad_full (numel,)) -> (`reduce_scatter_mean(grad_full)` (n_r,), None, None,
    None), after removing entry `index` from owner.regathered (if present)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, numel: int, owner: ZeroStage3, index: int) -> torch.Tensor:
        ctx.owner, ctx.index = owner, index
        return collectives.ring_all_gather(shard.detach(), numel, owner.traffic)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.owner.regathered.pop(ctx.index, None)  # this layer's backward is done with it
        return zero.reduce_scatter_mean(grad_full, ctx.owner.traffic), None, None, None


class ZeroStage3(zero.ZeroStage2):
    """ZeRO-3 (P_os+g+p) = ZeRO-2 + sharded parameters: the modules keep only hooks, this rank
    keeps its shards (Psi_r elements), and a layer's full weights exist only while it runs:
    gathered before its forward, dropped after (autograd keeps a recipe, not the weight),
    gathered again when backward reaches the layer, dropped once the gather's backward has
    reduce-scattered the gradient. Sends 3 Psi (N-1)/N per step (two all-gathers and one
    reduce-scatter), 1.5x ZeRO-1; after the step there is nothing to all-gather."""

    def make_shard(self, param: nn.Parameter, start: int, end: int) -> nn.Parameter:
        """A standalone copy of elements [start, end): the full parameter is deleted."""
        return nn.Parameter(param.detach().reshape(-1)[start:end].clone())

    def install_hooks(self) -> None:
        self.shapes = [param.shape for _, param in self.named]
        index_of = {id(param): index for index, (_, param) in enumerate(self.named)}
        self.regathered: dict[int, torch.Tensor] = {}  # index -> full parameter, in backward
        self.saved_tensor_hooks: list = []  # a stack: modules with parameters may nest
        for module in self.model.modules():
            entries = [(attr, index_of[id(p)]) for attr, p in module.named_parameters(recurse=False)]
            for attr, _ in entries:  # the module keeps no parameter, only hooks
                del module._parameters[attr]
                setattr(module, attr, None)
            if entries:
                module.register_forward_pre_hook(self.gather_parameters_hook(entries))
                module.register_forward_hook(self.free_parameters_hook(entries))
        for _, param in self.named:  # the shards are copies: free the full parameters
            param.data = param.data.new_empty(0)

    def gather(self, index: int) -> torch.Tensor:
        """Parameter `index`, full and in its shape, differentiable through `_GatherParameter`."""
        full = _GatherParameter.apply(self.shards[index], self.shapes[index].numel(), self, index)
        return full.view(self.shapes[index])

    # exercise zero3-hooks (continued)
    def gather_parameters_hook(self, entries: list[tuple[str, int]]):
        """Forward pre-hook of a layer owning `entries` [(attribute, parameter index)]: set each
        attribute to `gather(index)` and enter saved-tensor hooks under which autograd saves a
        recipe (index, size, stride, offset) for any view of a gathered parameter instead of
        its bytes; activations are saved as usual. Sends (N-1)/N n per parameter.
        The hooks object goes on the stack `saved_tensor_hooks` (entered here, left by
        `free_parameters_hook`); unpack turns a recipe back into a view of regathered[index]
        by as_strided(size, stride, offset). Returns hook(module, args) -> None."""
        def hook(module: nn.Module, args) -> None:
            storages = {}
            for attr, index in entries:
                full = self.gather(index)
                setattr(module, attr, full)
                storages[full.untyped_storage().data_ptr()] = index

            def pack(tensor: torch.Tensor):
                index = storages.get(tensor.untyped_storage().data_ptr())
                if index is None:
                    return tensor  # an activation: keep it
                return index, tensor.size(), tensor.stride(), tensor.storage_offset()

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                index, size, stride, offset = saved
                return self.regathered[index].as_strided(size, stride, offset)

            self.saved_tensor_hooks.append(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            self.saved_tensor_hooks[-1].__enter__()
        return hook

    # exercise zero3-hooks (continued)
    def free_parameters_hook(self, entries: list[tuple[str, int]]):
        """Forward hook: leave the saved-tensor hooks, set the attributes back to None (the
        full weights are freed), and hook the layer's output so that backward regathers them:
        output.register_hook(`regather_hook(entries)`) when the output requires grad.
        Returns hook(module, args, output) -> None."""
        def hook(module: nn.Module, args, output: torch.Tensor) -> None:
            self.saved_tensor_hooks.pop().__exit__(None, None, None)
            for attr, _ in entries:
                setattr(module, attr, None)
            if output.requires_grad:  # fires when backward reaches this layer's output
                output.register_hook(self.regather_hook(entries))
        return hook

    # exercise zero3-hooks (continued)
    def regather_hook(self, entries: list[tuple[str, int]]):
        """Tensor hook on a layer's output, run just before the layer's backward: all-gather
        each of its parameters into `regathered[index]` (full shape, `gather(index)` detached:
        no second gradient path). Sends (N-1)/N n each. Returns hook(grad_output) -> None."""
        def hook(grad_output: torch.Tensor) -> None:
            for _, index in entries:
                self.regathered[index] = self.gather(index).detach()
        return hook

    def all_gather_parameters(self) -> None:
        """Nothing to do: the next forward gathers each layer just in time."""
