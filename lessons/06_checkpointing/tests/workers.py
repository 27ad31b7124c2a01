"""Functions that lesson 06's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

M = importlib.import_module("lessons.06_checkpointing.main")


def save_at(ctx, config: dict, ckpt_dir: str, stop_at: int) -> str:
    """Train a noise-free run to `stop_at`, saving there."""
    plain = dataclasses.replace(M.TrainConfig(**config), noise=False)
    return M.run_training(ctx, plain, Path(ckpt_dir), stop_at, 1, stop_at=stop_at)["sha256"]


def resume_resharded(ctx, config: dict, ckpt_dir: str) -> dict:
    plain = dataclasses.replace(M.TrainConfig(**config), noise=False)
    run = M.run_training(ctx, plain, Path(ckpt_dir), 0, 1, resume=True, reshard=True)
    return {"params": run["params"], "resumed_from": run["resumed_from"]}
