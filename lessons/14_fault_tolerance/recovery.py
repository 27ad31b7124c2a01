"""Lesson 14, part 4: recover. A failed rank ends the attempt; an elastic agent restarts it.

torchrun's agent (`--max-restarts`, `--nnodes=MIN:MAX`) stops every worker when one fails and
starts them all again, telling each its attempt (TORCHELASTIC_RESTART_COUNT); `elastic_agent`
is that loop for self-spawned ranks. Each attempt runs `train_resiliently(...)`: it resumes
from the latest verified checkpoint (lesson 06's protocol through lesson 13's `resume`), on the
same number of ranks (bitwise) or fewer (lesson 13's resharding), and trains with everything of
parts 2-3 switched on: the recorder and the watchdog (main.py), the SIGTERM grace, the replica
fingerprints and the straggler times (integrity.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import time
from pathlib import Path

import torch
from torch.distributed import distributed_c10d

from lessons._checks import tensor_digest
from lessons._launch import WorkerError

from . import integrity
from . import main as detection

capstone = importlib.import_module("lessons.13_capstone.main")  # the run: GPTTrainer, resume
checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # Checkpointer, load

# ============================================================================ 4. recover


def restart_count(attempt: int = 0) -> int:
    """Which attempt this process belongs to: torchrun's TORCHELASTIC_RESTART_COUNT (its agent
    sets it in every worker: 0 first, +1 at each restart), else `attempt` (our agent's)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", attempt))


def elastic_agent(start, world: int, max_restarts: int, min_world: int | None = None) -> dict:
    """torchrun's elastic agent reduced to its loop: run `start(world, attempt)` (it launches
    every rank and raises WorkerError when one fails); on failure, stop everything and start
    again, up to `max_restarts` times. With `min_world` set (torchrun's --nnodes=MIN:MAX), the
    failed rank's machine is taken as gone: the next attempt runs on one rank fewer, never
    below `min_world` (the ranks then reshard the checkpoint). Returns {"results" (the last
    attempt's), "attempts": [{"world", "error"}]}; re-raises the last WorkerError when no
    restart is left."""
    attempts = []
    for attempt in range(max_restarts + 1):
        try:
            results = start(world, attempt)
        except WorkerError as exc:
            attempts.append({"world": world, "error": str(exc)})
            if attempt == max_restarts:
                raise
            if min_world is not None and world > min_world:
                world -= 1
            continue
        attempts.append({"world": world, "error": None})
        return {"results": results, "attempts": attempts}
    raise AssertionError("unreachable")


@dataclasses.dataclass
class Resilience:
    """What `train_resiliently` does besides training: save every `save_every` steps (0:
    never), fingerprint the replicas every `check_every` steps (0: never; every save step is
    checked, so `latest` is always a state the replicas agreed on), a watchdog with
    `deadline` seconds (0: none), SIGTERM's `grace` seconds, and `after_step(trainer)` for the
    harness (fault injection)."""

    save_every: int = 2
    check_every: int = 1
    deadline: float = 0.0
    grace: float = 30.0
    keep: int = 2
    after_step: object = None


def train_resiliently(ctx, config, data: torch.Tensor, vocab: int, out: Path,
                      how: Resilience) -> dict:
    """One attempt of the capstone's run (lesson 13's GPTTrainer) that survives failures:
    resume from `out/checkpoints`'s latest verified checkpoint if there is one (resharding when
    the world size changed), then train to config.steps with the recorder and the watchdog on.
    Per step: every check_every steps compare the replicas (heal from a healthy replica when a
    majority exists and the last check was one step ago, so no corrupted weight fed a gradient
    yet; else roll back to `latest`), save, and stop together on SIGTERM (emergency save);
    then gather each rank's (work, wall) seconds of the whole step and name a straggler.
    Returns the weights' digest and what happened."""
    ckpt, events, steps, checks = out / "checkpoints", [], [], []
    preemption = integrity.Preemption(how.grace)
    preemption.install()
    with detection.CollectiveRecorder() as recorder:  # from the first collective, as torch's
        trainer = capstone.GPTTrainer(config, ctx.rank, ctx.world_size, ctx.device, vocab)
        resumed = capstone.resume(trainer, ckpt, reshard=True) if (ckpt / "latest").exists() else None
        checkpointer = checkpointing.Checkpointer(ckpt, keep=how.keep, save_every=how.save_every)
        recorder.step = last_check = trainer.step
        attempt = restart_count()
        watchdog = (detection.Watchdog(distributed_c10d._get_default_store(), ctx.rank,
                                       ctx.world_size, recorder, how.deadline,
                                       out / "diagnostics" / f"attempt{attempt}",
                                       prefix=f"hb/{attempt}/").start() if how.deadline else None)
        try:
            while trainer.step < config.steps:
                started, recorder.blocked = time.monotonic(), 0.0
                trainer.train_step(data)
                recorder.step = trainer.step
                if how.after_step is not None:
                    how.after_step(trainer)
                if how.check_every and trainer.step % how.check_every == 0:
                    checked = time.monotonic()
                    verdict = integrity.check_replicas(integrity.replica_state(trainer))
                    if verdict["suspects"]:  # exact only if no corrupted weight fed a gradient
                        exact = verdict["healthy"] is not None and trainer.step - last_check == 1
                        events.append({"kind": "sdc", "step": trainer.step,
                                       "suspects": verdict["suspects"],
                                       "healed": "replica" if exact else "checkpoint"})
                        if exact:
                            integrity.heal_from_replica(integrity.replica_state(trainer),
                                                        verdict["healthy"])
                        else:
                            recorder.step = capstone.resume(trainer, ckpt, reshard=False)
                    last_check = trainer.step
                    checks.append(time.monotonic() - checked)
                saving, saved = how.save_every and trainer.step % how.save_every == 0, time.monotonic()
                checkpointer.maybe_save(trainer)
                if saving:
                    preemption.save_seconds.append(time.monotonic() - saved)
                stop, left = preemption.stop_agreed(ctx.device)
                if stop:
                    events.append({"kind": "preempted", "step": trainer.step, "left": left,
                                   "saved": bool(saving) or preemption.emergency_save(
                                       checkpointer, trainer, left)})
                wall = time.monotonic() - started
                work, walls = integrity.gather_times(wall - recorder.blocked, wall, ctx.device)
                steps.append({"step": trainer.step, "work": work,
                              **integrity.name_straggler(work, walls)})
                if stop:
                    break
        finally:
            if watchdog is not None:
                watchdog.stop()
            checkpointer.wait()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return {"rank": ctx.rank, "sha256": tensor_digest(dict(trainer.named)), "step": trainer.step,
            "resumed_from": resumed, "events": events, "steps": steps, "check_seconds": checks,
            "params": (torch.cat([p.detach().reshape(-1) for _, p in trainer.named]).tolist()
                       if ctx.rank == 0 else None)}
