"""Functions that lesson 02's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

import torch

M = importlib.import_module("lessons.02_data_parallel.main")


def all_checks(ctx, seed: int, steps: int, batch: int) -> dict:
    return M.verify_worker(ctx, seed, steps, batch, None, 0)


def no_broadcast(ctx, seed: int) -> list[float]:
    """Naive DDP WITHOUT the initial broadcast: ranks start (and stay) different."""
    model = M.make_model(seed + ctx.rank)
    optimizer = M.make_optimizer(model)
    x, y = M.global_batch(0, 4 * ctx.world_size, seed)
    loss = torch.nn.functional.mse_loss(model(M.local_shard(x, ctx.rank, ctx.world_size)),
                                        M.local_shard(y, ctx.rank, ctx.world_size))
    loss.backward()
    M.naive_all_reduce_gradients(model)
    optimizer.step()
    return M.flat_params(model).tolist()


def sum_without_average(ctx, seed: int) -> list[float]:
    """Gradients summed but not divided by p: must differ from the reference."""
    model = M.make_model(seed)
    M.broadcast_parameters_and_buffers(model)
    x, y = M.global_batch(0, 4 * ctx.world_size, seed)
    loss = torch.nn.functional.mse_loss(model(M.local_shard(x, ctx.rank, ctx.world_size)),
                                        M.local_shard(y, ctx.rank, ctx.world_size))
    loss.backward()
    M.naive_all_reduce_gradients(model)
    return torch.cat([p.grad.reshape(-1) * ctx.world_size for p in model.parameters()]).tolist()
