"""Functions that lesson 06's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import dataclasses
import errno
import importlib
import types
from pathlib import Path
from unittest import mock

import torch.distributed as dist

M = importlib.import_module("lessons.06_checkpointing.main")
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


# (failing rank, asynchronous) of the full-stack failed saves; the agreement itself is tested for
# every rank and both modes by `checkpointer_votes`
FULL_STACK_FAILURES = ((0, False), (1, True))


def resume_resharded_then_fail_saves(ctx, config: dict, ckpt_dir: str, save_every: int) -> dict:
    """Resume the checkpoint in `ckpt_dir` on this world size; then, in fresh directories, a
    real training run whose write fails on one rank (FULL_STACK_FAILURES)."""
    resumed = resume_resharded(ctx, config, ckpt_dir)
    config = T.TrainConfig(**config)
    failed = [C.failed_save_run(ctx, config, Path(ckpt_dir) / f"fail-{fail_rank}-{async_save}",
                                save_every, fail_rank, async_save)
              for fail_rank, async_save in FULL_STACK_FAILURES]
    return {"resumed": resumed, "failed": failed}


class _Trainer:
    """What a Checkpointer needs of a trainer: a step, a config with a fingerprint, a state."""

    def __init__(self, rank: int):
        self.rank, self.step = rank, 0
        self.config = types.SimpleNamespace(fingerprint=lambda: "fp")

    def shard_state(self) -> dict:
        return {"rank": self.rank, "step": self.step}


# the subgroup the failure-safe save is also graded on: ranks {1, 2} of 3, global rank 0 idle
# (so group rank 0, who commits, is not global rank 0)
SUBGROUP = (1, 2)


def checkpointer_votes(ctx, ckpt_dir: str) -> dict:
    """The agreement graded on the world and on SUBGROUP (`Checkpointer(group=...)`):
    {"world": votes(...), "subgroup": votes(...) on its ranks, None on the idle rank}."""
    group = dist.new_group(list(SUBGROUP))  # every rank takes part in creating it
    world = _votes(ctx, Path(ckpt_dir) / "world", None)
    sub = _votes(ctx, Path(ckpt_dir) / "subgroup", group) if ctx.rank in SUBGROUP else None
    dist.barrier()
    return {"world": world, "subgroup": sub}


def _votes(ctx, ckpt_dir: Path, group) -> list[dict]:
    """Two saves (steps 1 and 2) through `Checkpointer`, synchronous and asynchronous, for each
    failure: none, the write of group rank r at step 2, group rank 0's commit at step 2. The
    shard writes and the commit are recorders (main.py's write_shard and commit patched), so
    only the agreement, `Checkpointer._commit_everywhere`, is graded. Per run: the commits this
    rank made and the CheckpointError message (or None) of each step."""
    results = []
    size = dist.get_world_size(group)
    for failure in [None, *[f"rank {r}" for r in range(size)], "commit"]:
        for async_save in (False, True):
            commits: list[dict] = []

            def write_shard(step_dir, rank, world, payload, failure=failure):
                if failure == f"rank {rank}" and Path(step_dir).name == M.step_dir_name(2):
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                return {"name": M.shard_name(rank, world), "rank": rank, "bytes": len(payload),
                        "sha256": "-"}

            def commit(ckpt, step, world, entries, fingerprint, keep, failure=failure,
                       commits=commits):
                if failure == "commit" and step == 2:
                    raise OSError(errno.EIO, "Input/output error (injected)")
                commits.append({"step": step, "world": world, "fingerprint": fingerprint,
                                "keep": keep, "ranks": [entry.get("rank") for entry in entries]})

            directory = ckpt_dir / f"{failure}-{async_save}".replace(" ", "")
            checkpointer = M.Checkpointer(directory, keep=2, save_every=1, async_save=async_save,
                                          group=group)
            trainer, errors = _Trainer(dist.get_rank(group)), []
            with mock.patch.object(M, "write_shard", write_shard), \
                    mock.patch.object(M, "commit", commit):
                for step in (1, 2):
                    trainer.step = step
                    try:
                        checkpointer.save(trainer)
                        if step == 2:
                            checkpointer.wait()  # asynchronous: step 2 commits here
                        errors.append(None)
                    except M.CheckpointError as exc:
                        errors.append(str(exc))
            results.append({"failure": failure, "async": async_save, "commits": commits,
                            "errors": errors, "group_rank": dist.get_rank(group), "size": size})
    return results
