"""Lesson 02, part 2: which parameters did a forward leave out? (torch DDP's
find_unused_parameters)

A model whose forward skips a layer on some steps (a branch, a mixture-of-experts router, a
frozen tower) leaves parameters with no gradient, so their bucket never fills and the reducer
would wait for ever. torch DDP, with find_unused_parameters=True, walks the autograd graph from
the forward's outputs after every synchronised forward, and marks the parameters it cannot
reach ready at once (reducer.cpp: search_unused_parameters). `BucketedDDP.forward` in main.py
does the same with `unused_parameters`. A layer that forward ran but whose output the loss
leaves out is reached, yet gets no gradient: `through_sink` makes autograd still run it, with
a None gradient, so its parameters' hooks fire (torch's _DDPSink).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten


# exercise find-unused (2 points): The parameters a forward left out
# hint: a stack of grad_fn nodes from every output tensor; follow node.next_functions (skip
#   None, visit each node once); a node with a `variable` attribute is a leaf's AccumulateGrad.
def unused_parameters(output, params: list[torch.Tensor]) -> list[int]:
    """Indices into `params` (ascending) of the parameters that the autograd graph of `output`
    cannot reach: they will get no gradient from a backward of it. What torch DDP's
    find_unused_parameters does after every synchronised forward (reducer.cpp,
    search_unused_parameters). `output`: a tensor, or lists, tuples and dicts of them at any
    depth (other values ignored, as are tensors without grad_fn). From each output's grad_fn,
    walk `node.next_functions` ((node or None, index) pairs); a parameter is reached when its
    AccumulateGrad node is (that node's `.variable` is the parameter). Cost: one visit per
    node of the graph, every synchronised forward. Nothing is computed or changed."""
    stack = [t.grad_fn for t in tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, reached = set(stack), set()
    while stack:
        node = stack.pop()
        if hasattr(node, "variable"):  # AccumulateGrad: the end of the path to a parameter
            reached.add(id(node.variable))
        for following, _ in node.next_functions:
            if following is not None and following not in seen:
                seen.add(following)
                stack.append(following)
    return [i for i, param in enumerate(params) if id(param) not in reached]


class _Sink(torch.autograd.Function):
    """Identity on forward's output tensors, whose backward passes their gradients through
    unchanged, None included: `set_materialize_grads(False)` keeps autograd from turning the
    missing gradient of an output the loss did not use into zeros. The layers behind that
    output still run backward, with None, down to their parameters' AccumulateGrad, so those
    parameters' post-accumulate-grad hooks fire with .grad None (torch DDP's _DDPSink)."""

    @staticmethod
    def forward(ctx, *outputs):
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return grads


def through_sink(output):
    """`output` (a tensor, or lists, tuples and dicts of them) with each tensor that has a
    grad_fn passed through `_Sink`: the same values and structure (other values untouched)."""
    leaves, spec = tree_flatten(output)
    routed = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for i, tensor in zip(routed, _Sink.apply(*(leaves[i] for i in routed)) if routed else ()):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)
