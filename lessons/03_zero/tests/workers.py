"""Functions that lesson 03's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

import torch.nn.functional as F

M = importlib.import_module("lessons.03_zero.main")
DP = M.DP


def all_checks(ctx, seed: int, steps: int, batch: int) -> dict:
    return M.verify_worker(ctx, seed, steps, batch, None, 0)


def zero3_lifetimes(ctx) -> dict:
    """After forward no module holds a full weight; after backward nothing re-gathered is left."""
    model = DP.make_model(ctx.rank, **M.SIZES)
    zero = M.ZeroAdam(model, 3)
    x, y = DP.global_batch(0, 4 * ctx.world_size, 0, M.SIZES["d_in"], M.SIZES["d_out"])
    loss = F.mse_loss(model(DP.local_shard(x, ctx.rank, ctx.world_size)),
                      DP.local_shard(y, ctx.rank, ctx.world_size))
    after_forward = [getattr(m, name) is None for m in (model.fc1, model.fc2, model.head)
                     for name in ("weight", "bias")]
    registered = len(list(model.parameters()))
    loss.backward()
    return {"weights_dropped": all(after_forward), "registered_params": registered,
            "regathered_left": len(zero.regathered),
            "shard_sizes": [s.numel() for s in zero.shards]}


class SkipAllGather(M.ZeroAdam):
    """A broken ZeRO-1: steps its shard but never all-gathers, so ranks drift apart."""

    def step(self) -> None:
        for (_, param), shard in zip(self.named, self.shards):
            shard.grad = M.COLLECTIVES.ring_reduce_scatter(param.grad.reshape(-1)) / self.world
        self.optimizer.step()


def broken_zero1(ctx, seed: int) -> list[float]:
    model = DP.make_model(seed, **M.SIZES)
    zero = SkipAllGather(model, 1)
    for step in range(2):
        zero.zero_grad()
        x, y = DP.global_batch(step, 4 * ctx.world_size, seed, M.SIZES["d_in"], M.SIZES["d_out"])
        F.mse_loss(model(DP.local_shard(x, ctx.rank, ctx.world_size)),
                   DP.local_shard(y, ctx.rank, ctx.world_size)).backward()
        zero.step()
    return zero.full_parameters().tolist()
