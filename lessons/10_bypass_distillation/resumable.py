"""Lesson 10, part 2: runs that survive being killed, and an export that cannot be silently wrong.

main.py is the distillation: a student block trained alone on its teacher block's input and
output (`distill_step`), the blocks dealt round robin over the ranks. Weeks of GPU time are
kept or lost by what sits around it, in the order a run meets it:

1. The run: `RunConfig` (which student, how it is trained, which teacher) and its fingerprint,
   the name of the run's directory: a changed setting is a new run. `initial_block` is the
   student block every run starts from.
2. Checkpoints per block: step-N.pt written atomically, THEN the `latest` pointer; a pointer
   to a missing or unreadable file is an error naming it, never a silent fresh start.
3. A block trained to the end (`train_block`), resuming from its checkpoint, bitwise where an
   uninterrupted run ends; one rank's share of a run (`train_rank_blocks`), the teacher's
   states computed once per step.
4. The stitched student loaded from the checkpoints, exported from the live modules with
   lesson 06's verified safetensors export.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from lessons._checks import fingerprint, tensor_digest  # the course's run names and weight digests

from . import main as distillation  # this lesson's teacher, students, loss and step

tiny_gpt = importlib.import_module("lessons.07_memory.tiny_gpt")  # lesson 07's TinyGPT, markov_batches
checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # lesson 06's technique

# ============================================================================ 1. the run


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One blockwise-distillation run: which student, how it is trained, and the teacher."""

    kind: str = "mlp1"
    steps: int = 60
    warmup: int = 6
    lr: float = 3e-3
    save_every: int = 20
    teacher: distillation.TeacherConfig = distillation.TeacherConfig()

    # exercise resumable-block (4 points): The resumable block run: fingerprint, checkpoint, resume
    # hint: fingerprint every field (lessons._checks.fingerprint of the whole dataclass); resume
    #   = load block, optimizer AND scheduler states and continue at the saved step, not at 0.
    def fingerprint(self) -> str:
        """The run's directory name: sha256 of the canonical JSON of every field, the teacher's
        included (16 hex digits). A changed setting is a new run."""
        return fingerprint(self)


def initial_block(run: RunConfig, teacher: tiny_gpt.TinyGPT, index: int) -> nn.Module:
    """Student block `index` as every run starts it (blockwise or end to end): its own seed,
    so it does not depend on which rank builds it or in which order."""
    torch.manual_seed(run.teacher.seed * 100 + index)
    return distillation.make_student_block(run.kind, teacher.layers[index], run.teacher.hidden,
                                           run.teacher.heads)


# ============================================================================ 2. checkpoints per block


def block_dir(run_dir: Path, block: int) -> Path:
    return run_dir / f"block-{block:03d}"


def save_block(directory: Path, step: int, block: nn.Module, optimizer, scheduler,
               losses: list[float]) -> None:
    """step-NNNNNN.pt written atomically, THEN the `latest` pointer replaced atomically: a crash
    at any moment leaves `latest` naming a complete checkpoint (or no pointer at all)."""
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"step": step, "block": block.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "losses": losses}, buffer)
    name = f"step-{step:06d}.pt"
    checkpointing.atomic_write_bytes(directory / name, buffer.getvalue())
    checkpointing.atomic_write_bytes(directory / "latest", name.encode())
    for old in directory.glob("step-*.pt"):  # keep only the newest: the one `latest` names
        if old.name != name:
            old.unlink()


def load_block(directory: Path) -> dict | None:
    """The checkpoint `latest` names, or None when there is none. A pointer to a missing or
    unreadable file is an error naming the file, never a silent fresh start."""
    pointer = directory / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = directory / name
    if not (name.startswith("step-") and path.is_file()):
        raise checkpointing.CheckpointError(f"{pointer}: names {name!r}, which is not a checkpoint file here")
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise checkpointing.CheckpointError(f"{path}: unreadable checkpoint ({exc})") from exc


# ============================================================================ 3. training, resumable


# exercise resumable-block (continued)
def train_block(run: RunConfig, run_dir: Path, index: int, teacher: tiny_gpt.TinyGPT,
                teacher_io: Callable[[int], list[torch.Tensor]] | None = None,
                after_step: Callable[[int], None] | None = None) -> dict:
    """Train student block `index` of `run` to the end, resuming where its checkpoints say.

    Directory block_dir(run_dir, index): `done.json` there means finished (returns status
    "skipped"). Otherwise start from `initial_block` and, if `latest` names a checkpoint, load
    the block, AdamW and LR-schedule (warmup + cosine) states and the step from it; then
    `distill_step` on each remaining step's teacher states (teacher_io(step) -> the residual
    stream list, default teacher_block_io of the step's batch), saving every run.save_every
    steps and at the end (`save_block`), then write done.json {final_loss (mean of the last 10
    losses), losses, sha256 (tensor_digest of the block)}. `after_step(step)` runs after each
    step, before its save (the checks kill runs there). Because the checkpoint holds every
    state that shapes later steps and each batch depends only on its step, a run killed at any
    point and resumed ends bitwise equal to an uninterrupted one (on the same machine).
    Returns {"block": index, "status": "trained", "resumed_from": the step it started at (0 for
    a fresh run), "final_loss", "losses" (every step's, the loaded ones included), "sha256"}."""
    directory = block_dir(run_dir, index)
    if (directory / "done.json").exists():
        return {"block": index, "status": "skipped", **json.loads((directory / "done.json").read_text())}
    block = initial_block(run, teacher, index)
    optimizer = torch.optim.AdamW(block.parameters(), lr=run.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, checkpointing.cosine_with_warmup(run.warmup, run.steps))
    state, start, losses = load_block(directory), 0, []
    if state is not None:
        block.load_state_dict(state["block"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start, losses = state["step"], list(state["losses"])
    if teacher_io is None:
        data = distillation.batches(run.teacher, run.steps, 1)

        def teacher_io(step: int) -> list[torch.Tensor]:
            return distillation.teacher_block_io(teacher, data[step][0], upto=index)
    for step in range(start, run.steps):
        states = teacher_io(step)
        x, t = states[index], states[index + 1]
        losses.append(distillation.distill_step(block, optimizer, scheduler, x, t))
        if after_step is not None:
            after_step(step + 1)
        if (step + 1) % run.save_every == 0 or step + 1 == run.steps:
            save_block(directory, step + 1, block, optimizer, scheduler, losses)
    summary = {"final_loss": sum(losses[-10:]) / len(losses[-10:]), "losses": losses,
               "sha256": tensor_digest(block.state_dict())}
    checkpointing.atomic_write_bytes(directory / "done.json", json.dumps(summary).encode())
    return {"block": index, "status": "trained", "resumed_from": start, **summary}


def train_rank_blocks(run: RunConfig, run_dir: Path, teacher: tiny_gpt.TinyGPT, rank: int, world: int,
                      io_cache: dict, after_step: Callable[[int], None] | None = None) -> list[dict]:
    """What rank `rank` of `world` does for one run: train its own blocks one after another.
    The teacher states of each step are computed once, up to the rank's last block, and kept in
    `io_cache` (shared by the runs of one teacher on this rank)."""
    owned = distillation.owned_blocks(run.teacher.layers, rank, world)
    if not owned:  # more ranks than blocks
        return []
    data, upto, name = distillation.batches(run.teacher, run.steps, 1), max(owned), fingerprint(run.teacher)

    def teacher_io(step: int) -> list[torch.Tensor]:
        key = (name, run.steps, step)
        if len(io_cache.get(key, ())) < upto + 2:
            io_cache[key] = distillation.teacher_block_io(teacher, data[step][0], upto=upto)
        return io_cache[key]
    return [train_block(run, run_dir, index, teacher, teacher_io, after_step) for index in owned]


def resume_step(killed_after: int, save_every: int) -> int:
    """The step a run killed after `killed_after` resumes from: its last checkpoint."""
    return (killed_after // save_every) * save_every


# ============================================================================ 4. stitched, exported


def load_student(run: RunConfig, runs_dir: Path, teacher: tiny_gpt.TinyGPT) -> tiny_gpt.TinyGPT:
    """The stitched student: the teacher's embeddings and head, each block from its checkpoint."""
    student = distillation.make_student(teacher, run.kind, run.teacher)
    for index, layer in enumerate(student.layers):
        directory = block_dir(runs_dir / run.fingerprint(), index)
        state = load_block(directory)
        if state is None:
            raise checkpointing.CheckpointError(f"{directory}: no checkpoint")
        layer.load_state_dict(state["block"])
    return student.eval()


def export_student(student: nn.Module, path: Path) -> int:
    """Export from the LIVE modules (not from a map filled elsewhere) with lesson 06's verified
    safetensors export: size = 8 + header + every tensor's bytes, and a round trip equal."""
    return checkpointing.export_safetensors(dict(student.state_dict()), path)
