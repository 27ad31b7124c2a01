"""Lesson 14, parts 4-6: preemption, silent data corruption and stragglers.

These failures do not kill a process. A scheduler's SIGTERM gives a grace period: the ranks
agree to stop at the same step and save if the save fits in what is left of it. A flipped bit
leaves every process running with different weights on one replica: fingerprints of the
replicated state, compared across replicas, find it, a majority names it, and the run heals
from a healthy replica or rolls back to the last checkpoint whose fingerprints agreed. A slow
rank makes every other one wait in the next collective: each rank's own work time, gathered
every step, names it, and the synchronous step costs the slowest rank's time, not the mean.
"""

from __future__ import annotations

import collections
import math
import signal
import time

import torch
import torch.distributed as dist

from lessons._checks import tensor_digest

# ============================================================================ 4. preemption


class Preemption:
    """A scheduler's notice: SIGTERM now, SIGKILL after `grace` seconds (SLURM's KillWait,
    torchrun's --shutdown-timeout, a cloud's preemption notice). `install()` (main thread)
    turns SIGTERM into a flag and a deadline; the training loop asks `stop_agreed()` at every
    step boundary and, when it says stop, calls `emergency_save(...)` and returns."""

    def __init__(self, grace: float):
        self.grace = grace
        self.deadline: float | None = None  # time.monotonic() at which SIGKILL is expected
        self.save_seconds: list[float] = []  # measured periodic saves: predict the next one

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.deadline is None:  # the first notice starts the clock
            self.deadline = time.monotonic() + self.grace

    def remaining(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    # exercise preemption (3 points): Stop together, save only if it fits
    # hint: one all_reduce(MAX) of [signalled, -remaining] tells every rank whether ANY rank was
    #   signalled and the SHORTEST time left; then every rank takes the same decision.
    def stop_agreed(self, device: torch.device, group=None) -> tuple[bool, float]:
        """Collective (every rank of `group` calls it at the same step boundary): (stop, left).
        stop is True on every rank iff ANY rank received SIGTERM (a scheduler may signal one
        node first); left is the SMALLEST remaining grace over the ranks, in seconds (math.inf
        when nobody was signalled). One all_reduce(MAX) of the float64 tensor
        [signalled (0 or 1), -min(remaining, 1e30)] on `device`: max of a negated value is the
        negated min. Cost: one 2-element all-reduce per step."""
        mine = torch.tensor([float(self.deadline is not None), -min(self.remaining(), 1e30)],
                            dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        stop, left = bool(mine[0] > 0), -float(mine[1])
        return stop, (math.inf if left >= 1e30 else left)

    # exercise preemption (continued)
    def emergency_save(self, checkpointer, trainer, left: float, margin: float = 2.0) -> bool:
        """Save `trainer` now with lesson 06's `checkpointer.save(trainer)` (collective) if it
        fits: if left > margin x the slowest save measured so far (`self.save_seconds`; with
        none measured, save). Every rank passes the same `left` (from stop_agreed), so every
        rank decides the same. Returns True if saved. A save that does not fit is not started:
        SIGKILL would cut it, and lesson 06's commit protocol would then keep the previous
        checkpoint as `latest` anyway; skipping keeps the grace for a clean exit."""
        predicted = max(self.save_seconds, default=0.0) * margin
        if left <= predicted:
            return False
        checkpointer.save(trainer)
        checkpointer.wait()
        return True


# ============================================================================ 5. silent data corruption


def replica_state(trainer) -> dict[str, torch.Tensor]:
    """What must be bit-identical on every data-parallel replica after a step: the parameters
    and AdamW's moments (by name)."""
    state = {f"param.{name}": p for name, p in trainer.named}
    for name, p in trainer.named:
        for key, value in trainer.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"{key}.{name}"] = value
    return state


# exercise sdc-vote (4 points): Fingerprint the replicas, vote, name the odd one out
# hint: all_gather_object the digests over `group`; the value more than half the replicas hold
#   is the healthy one; a tie (2 replicas that differ) has no majority.
def vote(fingerprints: list[str]) -> tuple[str | None, list[int]]:
    """Majority vote over replicas' fingerprints (index i = the i-th replica).
    Returns (healthy fingerprint, indices that differ from it). The healthy fingerprint is
    the one held by MORE than half of the replicas; if none is (e.g. two replicas that differ),
    returns (None, every index that is not unanimous: all of them). Unanimous: (fp, [])."""
    value, count = collections.Counter(fingerprints).most_common(1)[0]
    if count * 2 > len(fingerprints):
        return value, [i for i, fp in enumerate(fingerprints) if fp != value]
    return None, list(range(len(fingerprints)))


# exercise sdc-vote (continued)
def check_replicas(named: dict[str, torch.Tensor], group=None) -> dict:
    """Collective over the data-parallel `group` (None: the world): every rank fingerprints
    its copy (`tensor_digest(named)`: sha256 of every tensor's name, dtype, shape and bytes)
    and all_gather_objects it over `group`; `vote` decides. Returns {"fingerprints": [per
    group member], "suspects": [GLOBAL ranks that differ], "healthy": a GLOBAL rank holding
    the majority's fingerprint (the lowest), or None without a majority}. Group members are
    listed in group-rank order (dist.get_process_group_ranks). Cost: one read of the state
    and an all_gather of 64-character strings."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    fingerprints: list = [None] * len(ranks)
    dist.all_gather_object(fingerprints, tensor_digest(named), group=group)
    healthy_fp, suspects = vote(fingerprints)
    healthy = next((ranks[i] for i, fp in enumerate(fingerprints) if fp == healthy_fp), None)
    return {"fingerprints": fingerprints, "suspects": [ranks[i] for i in suspects],
            "healthy": healthy if healthy_fp is not None else None}


# exercise sdc-vote (continued)
def heal_from_replica(named: dict[str, torch.Tensor], healthy: int, group=None) -> None:
    """Overwrite every rank's tensors of `named` with the healthy rank's (GLOBAL rank
    `healthy`), in place: one broadcast per tensor, in sorted name order (the same order on
    every rank). Afterwards every replica is bitwise the healthy one. NCCL moves only CUDA
    tensors: a CPU one (AdamW's step counter) goes through a CUDA copy there."""
    staged = dist.get_backend(group) == "nccl"
    for name in sorted(named):
        tensor = named[name].data
        buffer = tensor.cuda() if staged and not tensor.is_cuda else tensor
        dist.broadcast(buffer, src=healthy, group=group)
        if buffer is not tensor:
            tensor.copy_(buffer)


# ============================================================================ 6. stragglers


# exercise straggler (2 points): Name the slow rank from its own work time
# hint: wall time is the same on every rank (they wait for each other); work = wall - blocked.
def name_straggler(work: list[float], wall: list[float], factor: float = 2.0,
                   floor: float = 0.05) -> dict:
    """One step's per-rank times (index = rank): `work` = seconds the rank computed (its wall
    time minus the time it sat blocked in collectives), `wall` = its step's wall time.
    The straggler is the rank with the largest work if that exceeds factor x the median of
    the OTHER ranks' work AND that median by at least `floor` seconds (noise), else None
    (one rank alone is nobody's straggler; with two, the other one is the reference). Also returns what the
    step cost: "seconds" = max(wall) (a synchronous step ends when the slowest rank is done),
    "mean_work", "max_work", and "waste" = seconds - mean_work, the time the average rank
    spent waiting. {"straggler", "seconds", "mean_work", "max_work", "waste"}."""
    slowest = max(range(len(work)), key=lambda r: work[r])
    others = sorted(w for r, w in enumerate(work) if r != slowest)
    named = None
    if others:
        half = len(others) // 2
        median = others[half] if len(others) % 2 else (others[half - 1] + others[half]) / 2
        if work[slowest] > factor * median and work[slowest] - median >= floor:
            named = slowest
    seconds, mean_work = max(wall), sum(work) / len(work)
    return {"straggler": named, "seconds": seconds, "mean_work": mean_work,
            "max_work": work[slowest], "waste": seconds - mean_work}


def gather_times(work: float, wall: float, device: torch.device, group=None) -> tuple[list, list]:
    """All-gather this step's (work, wall) seconds over `group`: per-rank lists in group order
    (one float64 all-gather of 2 numbers per rank, every step)."""
    mine = torch.tensor([work, wall], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [float(t[0]) for t in out], [float(t[1]) for t in out]
