"""Lesson 06, parts 5-7: what a checkpoint holds to resume exactly; resharding; how often to save.

The protocol (atomic_file.py, main.py) makes a checkpoint safe to write and to read. This file
decides what goes in it so that a resumed run cannot be told from one that never stopped, how
a state saved by N ranks loads into M, and how often to save:

5. Exact resume: besides weights and optimizer, the data cursor, the LR the schedule last
   wrote, the gradient scaler and this rank's RNG states.
6. Resharding: N saved slices of a tensor become M slices (lesson 03's `shard_bounds`).
7. How often to save: what a save costs (bytes / write bandwidth), Young / Daly.
"""

from __future__ import annotations

import importlib
import math
import random

import torch

zero = importlib.import_module("lessons.03_zero.main")  # lesson 03's technique: shard_bounds

# ============================================================================ 5. exact resume


class DataCursor:
    """Walks a dataset of `dataset` examples in a new order every epoch (randperm from a
    generator seeded by (seed, epoch)), `batch` indices at a time. State: (epoch, position)."""

    def __init__(self, dataset: int, batch: int, seed: int):
        if dataset % batch:
            raise ValueError(f"dataset {dataset} is not a multiple of batch {batch}")
        self.dataset, self.batch, self.seed = dataset, batch, seed
        self.epoch, self.position = 0, 0

    def next_indices(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.dataset, generator=generator)
        indices = order[self.position:self.position + self.batch]
        self.position += self.batch
        if self.position == self.dataset:
            self.epoch, self.position = self.epoch + 1, 0
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def cosine_with_warmup(warmup: int, total: int):
    """LR multiplier for LambdaLR: (step + 1) / warmup while step < warmup, then cosine decay
    0.5 (1 + cos(pi min(1, (step - warmup) / (total - warmup)))) to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


# exercise exact-resume (3 points): Exact resume: LR, scheduler, scaler, data cursor and RNG states
# hint: after scheduler.load_state_dict, write the saved LR into every param group: a fresh
#   scheduler holds factor(0) x base LR. Restore the RNG states last.
def rng_state(device: torch.device | str | None = None) -> dict:
    """This rank's generators: {"python": random.getstate(), "torch": torch.get_rng_state()}
    and, only when `device` is a CUDA device, "cuda": torch.cuda.get_rng_state(THAT device)
    (never get_rng_state_all, which reads every device's generator: the checkpoint would hold
    one state per GPU of the machine, and set_rng_state_all would fail on a box with fewer
    GPUs, torch/cuda/random.py)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


# exercise exact-resume (continued)
def set_rng_state(state: dict, device: torch.device | str | None = None) -> None:
    """Restore what `rng_state(device)` saved (the CUDA generator of `device` when present)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], torch.device(device))


# exercise exact-resume (continued)
def exact_resume_state(step: int, optimizer, scheduler, scaler, cursor: DataCursor,
                       device: torch.device | str | None = None) -> dict:
    """The small state exact resume needs besides the weights and the Adam moments: the step;
    the scheduler's state_dict AND the LR each param group holds now (a scheduler writes the
    LR after each step; a freshly built one holds factor(0) x base LR, so restoring only its
    state_dict runs ONE step at the initial LR: nanotron PR 245); the GradScaler's state (scale
    and growth tracker: they decide which fp16 steps overflow and are skipped), or None; the
    data cursor; this rank's RNG states. Plain data and CPU tensors: torch.load(weights_only).
    Returns {"step", "scheduler", "lr" (one float per param group), "scaler", "cursor", "rng"}."""
    return {"step": step, "scheduler": scheduler.state_dict(),
            "lr": [group["lr"] for group in optimizer.param_groups],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "cursor": cursor.state_dict(), "rng": rng_state(device)}


# exercise exact-resume (continued)
def restore_exact_resume_state(state: dict, optimizer, scheduler, scaler, cursor: DataCursor,
                               device: torch.device | str | None = None,
                               restore_rng: bool = True) -> int:
    """Inverse of `exact_resume_state`, in place; returns the step. Restores the scheduler's
    state_dict, then writes the saved LR into each param group (a different number of groups
    raises ValueError: zip(..., strict=True)), the scaler (skipped when `scaler` is None), the
    cursor and, unless `restore_rng=False` (the saved streams belong to another layout, when
    resharding), this rank's RNG states. Afterwards the next step runs exactly as it would
    have without the interruption: same LR, same loss scale, same batch, same random draws."""
    scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(optimizer.param_groups, state["lr"], strict=True):
        group["lr"] = lr
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    cursor.load_state_dict(state["cursor"])
    if restore_rng:
        set_rng_state(state["rng"], device)
    return int(state["step"])


# ============================================================================ 6. resharding


def reshard(slices: list[torch.Tensor], world: int, rank: int) -> torch.Tensor:
    """N saved slices of one flattened tensor (rank order, lesson 03's near-equal chunks) ->
    this rank's slice of an M-way split: cat, then `zero.shard_bounds(numel, M, rank)`. Valid
    for parameters and Adam's moments, which are element-wise. Cost: one full tensor in memory."""
    full = torch.cat([s.reshape(-1) for s in slices])
    start, end = zero.shard_bounds(full.numel(), world, rank)
    return full[start:end].clone()


# ============================================================================ 7. how often to save


def save_seconds(params: float, bytes_per_param: float, write_bytes_per_s: float) -> float:
    """What one save costs when writing is the bottleneck: the bytes that must reach storage
    (each byte once: replicated state is written by one rank only, as DCP's planner dedups it)
    over the aggregate write bandwidth of all writers. Mixed-precision Adam saves 14 B/param:
    16-bit weights 2 + fp32 master 4 + m 4 + v 4 (gradients are not saved)."""
    return params * bytes_per_param / write_bytes_per_s


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young (1974): the compute time between checkpoints that minimises the expected lost
    time, tau = sqrt(2 C M) for save cost C and mean time between failures M (first order,
    C << M). The time lost per unit of work is then about C/tau + tau/(2M) = sqrt(2C/M)."""
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly (2006), higher-order optimum: tau = sqrt(2CM) [1 + (1/3) sqrt(C/2M) + (1/9) (C/2M)]
    - C when C < 2M, else tau = M. Close to Young's when C << M."""
    if save_seconds >= 2.0 * mtbf_seconds:
        return mtbf_seconds
    ratio = save_seconds / (2.0 * mtbf_seconds)
    return young_interval(save_seconds, mtbf_seconds) * (
        1 + math.sqrt(ratio) / 3 + ratio / 9) - save_seconds
