"""Lesson 04, part 1: how a tensor-parallel layer talks to its peers.

Before any layer is split, two things: the ranks that share the layer, and the two operators
that Megatron-LM places at the edges of every parallel region. main.py's layers communicate
only through these:

1. `TensorParallelGroup`: the p ranks that share a layer and their three collectives
   (all-reduce, all-gather, reduce-scatter along the sequence), on lesson 01's rings (every
   byte counted) or on a torch.distributed sub-group;
2. Megatron's f (`CopyToTensorParallel`: identity forward, all-reduce backward) and g
   (`ReduceFromTensorParallel`: all-reduce forward, identity backward), a conjugate pair of
   autograd functions.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
import torch.distributed as dist

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique

# ============================================================================ 1. the group


@dataclasses.dataclass
class TensorParallelGroup:
    """The p ranks that share one layer: this rank's index `rank` in [0, size) and its `group`.

    The one place a layer finds its communication. group None: the default group through
    lesson 01's rings, every byte sent counted in `traffic`. A process group (a mesh's
    tensor-parallel dimension, or dist.group.WORLD): torch.distributed's collectives on it,
    not counted. Gathers and scatters work on dim 0, the sequence of (s, b, h) activations.
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    traffic: collectives.Traffic = dataclasses.field(default_factory=collectives.Traffic)

    @classmethod
    def join(cls, group: dist.ProcessGroup | None = None) -> TensorParallelGroup:
        """This rank's place in `group` (None: the default group, which must exist)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group, on every rank (a new tensor): 2(p-1)/p |x| bytes sent."""
        if self.group is None:
            return collectives.ring_all_reduce(x.contiguous(), self.traffic)
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (p n, ...), rank r's rows at [r n, (r+1) n): (p-1) |x|."""
        if self.group is None:
            full = collectives.ring_all_gather(x.contiguous().reshape(-1), x.numel() * self.size,
                                               self.traffic)
            return full.view(x.shape[0] * self.size, *x.shape[1:])
        out = x.new_empty(x.shape[0] * self.size, *x.shape[1:])
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(p n, ...) partial sums -> rows [r n, (r+1) n) of their sum: (p-1)/p |x| sent.
        A first dimension p does not divide: ValueError naming both (nothing sent)."""
        if x.shape[0] % self.size:
            raise ValueError(f"reduce-scatter along dim 0: {x.shape[0]} rows do not split "
                             f"over {self.size} ranks (the sequence must divide by p)")
        if self.group is None:
            part = collectives.ring_reduce_scatter(x.contiguous().reshape(-1), self.traffic)
            return part.view(x.shape[0] // self.size, *x.shape[1:])
        out = x.new_empty(x.shape[0] // self.size, *x.shape[1:])
        dist.reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out


# ============================================================================ 2. f and g


# exercise f-and-g (3 points): Megatron's f and g, the conjugate pair of autograd functions
# hint: f is the identity forward and an all-reduce backward, g the reverse; backward
#   returns one gradient per forward input (None for tp).
class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f, before a column-parallel layer (Shoeybi et al. 2019, section 3).

    forward(x, tp): x (..., h), the same on every rank -> x (identity, nothing sent).
    backward: rank r's dL/dx = dY_r A_r covers only its output features, a partial sum:
    all-reduce it (2(p-1)/p |x| bytes) so every rank holds the full dL/dx. Returns
    (dL/dx, None). Communicate through `tp` (`tp.all_reduce`: lesson 01's ring, counted).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.all_reduce(grad), None


# exercise f-and-g (continued)
class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g, after a row-parallel layer: the mirror image of f.

    forward(x, tp): x (..., h), this rank's partial sum -> the sum over the group (all-reduce,
    2(p-1)/p |x| bytes, through `tp.all_reduce`). backward: identity, (dL/dY, None), nothing
    sent: every rank already holds the same dL/dY, and summing it would count it p times.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
