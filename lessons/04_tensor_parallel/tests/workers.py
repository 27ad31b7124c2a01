"""Functions that lesson 04's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

import torch

M = importlib.import_module("lessons.04_tensor_parallel.main")


def all_checks(ctx, seq: int, batch: int, hidden: int, heads: int) -> dict:
    return M.verify_worker(ctx, 3, seq, batch, hidden, heads, None, 0)


def sp_without_grad_all_reduce(ctx) -> float:
    """Sequence parallel WITHOUT reducing the replicated gradients: LayerNorm grads are wrong."""
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    _, grads = M.dense_reference(3, 16, 4, x)
    block = M.TensorParallelBlock(M.make_dense(3, 16, 4), ctx.rank, ctx.world_size, True)
    rows = 8 // ctx.world_size
    y = block(x[ctx.rank * rows:(ctx.rank + 1) * rows].clone().requires_grad_())
    weights = M.loss_weights(x.shape)[ctx.rank * rows:(ctx.rank + 1) * rows]
    (y * weights).sum().backward()
    return float((block.ln1.weight.grad - grads["ln1.weight"]).abs().max())
