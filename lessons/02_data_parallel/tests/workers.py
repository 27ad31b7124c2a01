"""Functions that lesson 02's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

data_parallel = importlib.import_module("lessons.02_data_parallel.main")
checks = importlib.import_module("lessons.02_data_parallel.checks")


def all_checks(ctx, seed: int, steps: int, batch: int) -> dict:
    return checks.verify_worker(ctx, seed, steps, batch, None, 0)


class BackwardsMLP(data_parallel.TinyMLP):
    """Applies head, then fc2, then fc1 (square layers): the gradients of fc1 (the LAST bucket)
    arrive first and those of head (bucket 0) last, the opposite of parameters() order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.relu(self.fc2(F.relu(self.head(x * self.input_scale)))))


def what_checks_catch(ctx, seed: int) -> dict:
    """Small runs on this rank: naive DDP without the broadcast (ranks stay different),
    gradients summed but not divided by p, BucketedDDP on a model whose gradients arrive in
    reverse bucket order (launches must still go 0, 1, 2, all after the last gradient), and one
    step of the benchmark on a 32-wide model (its plumbing, not its timings)."""
    x, y = checks.shard_of_step(ctx, 0, 4 * ctx.world_size, seed)
    model = data_parallel.make_model(seed + ctx.rank)  # no broadcast: every rank different
    optimizer = checks.make_optimizer(model)
    F.mse_loss(model(x), y).backward()
    data_parallel.naive_all_reduce_gradients(model)
    optimizer.step()
    no_broadcast = data_parallel.flat_params(model).tolist()

    model = data_parallel.make_model(seed)
    data_parallel.broadcast_parameters_and_buffers(model)
    F.mse_loss(model(x), y).backward()
    data_parallel.naive_all_reduce_gradients(model)
    summed = torch.cat([p.grad.reshape(-1) * ctx.world_size for p in model.parameters()]).tolist()

    events: list[tuple[str, int]] = []
    torch.manual_seed(seed)
    backwards = BackwardsMLP(d_in=8, hidden=8, d_out=8).double()
    for param in backwards.parameters():  # registered first: runs before BucketedDDP's hook
        param.register_post_accumulate_grad_hook(lambda p: events.append(("grad", -2)))
    wrapped = data_parallel.BucketedDDP(backwards, bucket_cap_bytes=100,
                                        on_event=lambda kind, bucket: events.append((kind, bucket)))
    bx, by = checks.shard_of_step(ctx, 1, 4 * ctx.world_size, seed, d_in=8, d_out=8)
    F.mse_loss(wrapped(bx), by).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in backwards.parameters()]).tolist()
    return {"no_broadcast": no_broadcast, "summed": summed, "buckets": wrapped.buckets,
            "events": [list(event) for event in events],
            "reordered_grads": grads,
            "bench": importlib.import_module("lessons.02_data_parallel.bench").bench_worker(
                ctx, 32, 1, [2048, 64 * 1024])}


def reference_gradient(seed: int, world_size: int) -> list[float]:
    """The single-process gradient of the global batch that `what_checks_catch` shards."""
    model = data_parallel.make_model(seed)
    x, y = data_parallel.global_batch(0, 4 * world_size, seed)
    F.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()


def reference_reordered_gradient(seed: int, world_size: int) -> list[float]:
    """The single-process gradient of BackwardsMLP on the global batch."""
    torch.manual_seed(seed)
    model = BackwardsMLP(d_in=8, hidden=8, d_out=8).double()
    x, y = data_parallel.global_batch(1, 4 * world_size, seed, d_in=8, d_out=8)
    F.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()
