"""Functions that lesson 06's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

C = importlib.import_module("lessons.06_checkpointing.checks")
T = importlib.import_module("lessons.06_checkpointing.trainer")


def save_at(ctx, config: dict, ckpt_dir: str, stop_at: int) -> str:
    """Train a noise-free run to `stop_at`, saving there."""
    plain = dataclasses.replace(T.TrainConfig(**config), noise=False)
    return T.run_training(ctx, plain, Path(ckpt_dir), stop_at, 1, stop_at=stop_at)["sha256"]


def resume_resharded(ctx, config: dict, ckpt_dir: str) -> dict:
    plain = dataclasses.replace(T.TrainConfig(**config), noise=False)
    run = T.run_training(ctx, plain, Path(ckpt_dir), 0, 1, resume=True, reshard=True)
    return {"params": run["params"], "resumed_from": run["resumed_from"]}


def resume_resharded_then_fail_saves(ctx, config: dict, ckpt_dir: str, save_every: int) -> dict:
    """Resume the checkpoint in `ckpt_dir` on this world size; then, in fresh directories, a
    failing write on every rank in turn, synchronous and asynchronous."""
    resumed = resume_resharded(ctx, config, ckpt_dir)
    config = T.TrainConfig(**config)
    failed = [C.failed_save_run(ctx, config, Path(ckpt_dir) / f"fail-{fail_rank}-{async_save}",
                                save_every, fail_rank, async_save)
              for fail_rank in range(ctx.world_size) for async_save in (False, True)]
    return {"resumed": resumed, "failed": failed}
