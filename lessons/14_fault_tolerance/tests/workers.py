"""Spawned ranks for lesson 14's exercise tests: one launch per exercise, each testing the whole
world (3 ranks) and a subgroup whose other rank stays out of it."""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

integrity = importlib.import_module("lessons.14_fault_tolerance.integrity")
checkpointing = importlib.import_module("lessons.06_checkpointing.main")
detection = importlib.import_module("lessons.14_fault_tolerance.main")


def replica_tensors(rank: int, flipped: int | None) -> dict[str, torch.Tensor]:
    """The same named tensors on every rank (an odd size, 7 x 5), one bit flipped on `flipped`."""
    generator = torch.Generator().manual_seed(7)
    named = {"param.w": torch.randn(7, 5, generator=generator, dtype=torch.float64),
             "exp_avg.w": torch.randn(3, generator=generator, dtype=torch.float64)}
    if rank == flipped:
        named["param.w"].view(-1).view(torch.int64)[11] ^= 1 << 3
    return named


def sdc_worker(ctx, flipped: int, subgroup: list[int], flipped_in_subgroup: int) -> dict:
    """The world votes on a state flipped on `flipped`, then heals; the subgroup does the same
    with its own flip while the rank outside it holds a different state it never compares."""
    result = {}
    named = replica_tensors(ctx.rank, flipped)
    verdict = integrity.check_replicas(named)
    if verdict["healthy"] is not None:
        integrity.heal_from_replica(named, verdict["healthy"])
    after = integrity.check_replicas(named)
    result["world"] = {"verdict": verdict, "after": after,
                       "equal_to_clean": all(torch.equal(named[k], v) for k, v in
                                             replica_tensors(-1, None).items())}
    group = dist.new_group(subgroup)  # every rank calls new_group
    if ctx.rank in subgroup:
        mine = replica_tensors(ctx.rank, flipped_in_subgroup)
        verdict = integrity.check_replicas(mine, group)
        result["subgroup"] = {"verdict": verdict}
    dist.barrier()
    return result


def preemption_worker(ctx, signalled: dict, subgroup: list[int], tmp: str) -> dict:
    """Ranks in `signalled` receive a real SIGTERM (grace: the value); all then agree. The
    subgroup agrees on its own. Then emergency saves that do and do not fit."""
    result = {}
    grace = signalled.get(str(ctx.rank))
    preemption = integrity.Preemption(grace if grace is not None else 100.0)
    preemption.install()
    try:
        if grace is not None:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while preemption.deadline is None and time.monotonic() < deadline:
                time.sleep(0.01)
        result["world"] = preemption.stop_agreed(ctx.device)
        group = dist.new_group(subgroup)
        if ctx.rank in subgroup:
            result["subgroup"] = preemption.stop_agreed(ctx.device, group)
        quiet = integrity.Preemption(100.0)  # nobody signalled
        result["quiet"] = quiet.stop_agreed(ctx.device)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ckpt = Path(tmp) / "ckpt"
    checkpointer = checkpointing.Checkpointer(ckpt, keep=3, save_every=1)
    trainer = Tiny(step=2, rank=ctx.rank)
    checkpointer.save(trainer)
    trainer.step = 3
    preemption.save_seconds = [1.0]  # the last save took 1 s: 2 s predicted with margin 2
    result["skipped"] = preemption.emergency_save(checkpointer, trainer, left=1.5)
    result["latest_after_skip"] = checkpointing.read_latest(ckpt).name
    result["saved"] = preemption.emergency_save(checkpointer, trainer, left=2.5)
    result["latest_after_save"] = checkpointing.read_latest(ckpt).name
    return result


@dataclasses.dataclass
class TinyConfig:
    def fingerprint(self) -> str:
        return "tiny"


@dataclasses.dataclass
class Tiny:
    """What lesson 06's Checkpointer needs: step, config.fingerprint(), shard_state()."""

    step: int
    rank: int
    config: TinyConfig = dataclasses.field(default_factory=TinyConfig)

    def shard_state(self) -> dict:
        return {"rank": self.rank, "step": self.step}


def straggler_worker(ctx, subgroup: list[int]) -> dict:
    """Every rank contributes (work, wall) = (0.1 x (rank + 1), 1.0 + rank); gathered over the
    world and over the subgroup (group order)."""
    result = {"world": integrity.gather_times(0.1 * (ctx.rank + 1), 1.0 + ctx.rank, ctx.device)}
    group = dist.new_group(subgroup)
    if ctx.rank in subgroup:
        result["subgroup"] = integrity.gather_times(0.1 * (ctx.rank + 1), 1.0 + ctx.rank,
                                                    ctx.device, group)
    return result


def recorded_collectives(ctx) -> list[dict]:
    group = dist.new_group([0, 2])
    with detection.CollectiveRecorder() as recorder:
        dist.all_reduce(torch.ones(7, 5))
        dist.all_reduce(torch.ones(3), async_op=True).wait()
        dist.broadcast(torch.ones(2), 0)
        if ctx.rank in (0, 2):
            dist.all_reduce(torch.ones(1), group=group)
    return recorder.dump()
