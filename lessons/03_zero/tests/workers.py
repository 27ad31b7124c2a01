"""Functions that lesson 03's tests run on spawned ranks (importable by their dotted name),
and the planted bugs the suite must catch: one per piece a learner writes."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

M = importlib.import_module("lessons.03_zero.main")  # the technique
C = importlib.import_module("lessons.03_zero.checks")  # the proof


def all_checks(ctx, seed: int, steps: int, batch: int) -> dict:
    return C.verify_worker(ctx, seed, steps, batch, None, 0)


class SkipAllGather(M.ZeroStage1):
    """A broken ZeRO-1 step: steps its shard but never all-gathers, so ranks drift apart."""

    def all_gather_parameters(self) -> None:
        pass


class KeepFullGradient(M.ZeroStage2):
    """A broken ZeRO-2 hook: reduce-scatters each gradient but keeps the full one too."""

    def shard_gradient_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self.shards[index].grad = M.reduce_scatter_mean(param.grad, self.traffic)
        return hook


class KeepGatheredWeights(M.ZeroStage3):
    """A broken ZeRO-3 forward hook: never drops the gathered weights after forward."""

    def free_parameters_hook(self, entries):
        def hook(module, args, output) -> None:
            self.saved_tensor_hooks.pop().__exit__(None, None, None)
            output.register_hook(self.regather_hook(entries))
        return hook


class LocalNormClip(M.ZeroStage1):
    """A broken clipping: each rank clips its shard by that shard's own norm."""

    def step(self, scaler=None, max_norm=None):
        self.reduce_scatter_gradients()
        norm = torch.nn.utils.clip_grad_norm_(self.shards, max_norm)
        self.step_shards(scaler)
        self.all_gather_parameters()
        return norm


def zero3_lifetimes(ctx, trainer_class) -> dict:
    """After forward no module holds a full weight; after backward nothing re-gathered is left."""
    model = C.data_parallel.make_model(ctx.rank, **C.SIZES)
    zero = trainer_class(model)
    x, y = C.batch_on(ctx, 0, 4 * ctx.world_size, 0)
    loss = F.mse_loss(model(x), y)
    after_forward = [getattr(m, name) is None for m in (model.fc1, model.fc2, model.head)
                     for name in ("weight", "bias")]
    registered = len(list(model.parameters()))
    loss.backward()
    return {"weights_dropped": all(after_forward), "registered_params": registered,
            "full_params_freed": all(p.numel() == 0 for _, p in zero.named),
            "regathered_left": len(zero.regathered),
            "shard_sizes": [s.numel() for s in zero.shards]}


def stages_and_planted_bugs(ctx) -> dict:
    """ZeroAdam's classes, ZeRO-3's lifetimes, and what each planted bug does to the checks."""
    batch = 24
    drifted = C.train(ctx, SkipAllGather, 0, 2, batch)
    kept = C.train(ctx, KeepFullGradient, 0, 2, batch)
    psi = sum(kept["numels"])
    max_norm = C.CLIP_FRACTION * C.train_single_process_adam(0, 1, batch)["norms"][0]
    reference = C.train_single_process_adam(0, 3, batch, max_norm)
    local = C.train(ctx, LocalNormClip, 0, 3, batch, max_norm)
    model = C.data_parallel.make_model(0, **C.SIZES)
    return {"classes": [type(M.ZeroAdam(model, stage)).__name__ for stage in (1, 2, 3)],
            "lifetimes": zero3_lifetimes(ctx, M.ZeroStage3),
            "kept_weights": zero3_lifetimes(ctx, KeepGatheredWeights),
            "drifted_params": drifted["params"],
            "kept_grads": kept["memory"]["grads"],
            "expected_grads": C.expected_live_bytes(2, psi, kept["shard_params"], 8)["grads"],
            "local_clip_gap": C.gap(local, reference)}
