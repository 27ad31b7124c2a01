"""Lesson 06's proof: the demo's runs on spawned (or torchrun) ranks, every kind of damage and a
crash at every point of the save protocol, a failing write, the exact-resume pieces that the
main run cannot see (the LR of the first resumed step, the GradScaler under fp16 overflow),
resharding against an unsharded reference, torch.distributed.checkpoint on the same state,
and the command line.

`python lessons/06_checkpointing/main.py` runs `main()` below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._checks import max_abs_diff
from lessons._launch import (
    RankContext,
    choose_device,
    device_for_extra_ranks,
    inject_fault,
    launch,
    one_thread,
    under_torchrun,
)
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    lesson_parser,
    world_size_of,
)

from . import atomic_file, exact_resume
from . import main as checkpointing
from .trainer import TrainConfig, data_parallel, reference_params, resume_unsharded, run_training

LESSON = "06_checkpointing"
MANIFEST, LATEST = checkpointing.MANIFEST, checkpointing.LATEST
# Resharding changes the summation order of the gradients (another world size), so a resharded
# run equals the unsharded reference to float64 rounding (~1e-16 per step), not bit for bit.
RESHARD_TOLERANCE = 1e-10
# Daly (2006), Figs. 3-5: save cost 5 min; MTBF 24 h, 6 h, 15 min -> optimum 117, 57, 9.1 min
# (in minutes, with half a unit of the last digit the paper prints).
DALY_EXAMPLES = ((5.0, 24 * 60.0, 117.0, 0.5), (5.0, 6 * 60.0, 57.0, 0.5), (5.0, 15.0, 9.1, 0.05))


def kept_steps(total_steps: int, save_every: int, keep: int) -> list[int]:
    """Which checkpoints survive `total_steps` steps saving every `save_every`, keeping `keep`
    (rotation by step number keeps the newest `keep` saves)."""
    return list(range(save_every, total_steps + 1, save_every))[-keep:]


# ============================================================================ crashes and failures


class SimulatedCrash(RuntimeError):
    """Raised at a named point of the save protocol, to test what a crash there leaves."""


class _OsRenameCrash:
    """`os` as atomic_file.py sees it, except that os.replace onto a file named `target`
    raises: the process 'dies' after the temporary file is written and fsynced, before the
    rename."""

    def __init__(self, target: str):
        self.target = target

    def __getattr__(self, name: str):
        return getattr(os, name)

    def replace(self, src, dst) -> None:
        if Path(dst).name == self.target:
            raise SimulatedCrash(f"before renaming {self.target}")
        os.replace(src, dst)

    rename = replace  # atomic on POSIX as well


def _fail_before_writing(target: str, exc: BaseException):
    """Patch main.py's atomic_write_bytes so that writing a file named `target` raises `exc`."""
    real = checkpointing.atomic_write_bytes

    def write(path: Path, data: bytes) -> None:
        if path.name == target:
            raise exc
        real(path, data)
    return mock.patch.object(checkpointing, "atomic_write_bytes", write)


def crash_at(point: str):
    """A context in which the save protocol 'crashes' at `point` (one of SAVE_CRASH_POINTS)."""
    shard = checkpointing.shard_name(0, 1)
    crash = SimulatedCrash(point)
    return {
        "shard written, before its rename": lambda: mock.patch.object(
            atomic_file, "os", _OsRenameCrash(shard)),
        "shard in place, before the manifest": lambda: _fail_before_writing(MANIFEST, crash),
        "manifest written, before its rename": lambda: mock.patch.object(
            atomic_file, "os", _OsRenameCrash(MANIFEST)),
        "manifest committed, before latest moves": lambda: _fail_before_writing(LATEST, crash),
        "latest written, before its rename": lambda: mock.patch.object(
            atomic_file, "os", _OsRenameCrash(LATEST)),
        "latest moved, before rotation": lambda: mock.patch.object(
            checkpointing, "rotate", mock.Mock(side_effect=crash)),
    }[point]()


SAVE_CRASH_POINTS = ("shard written, before its rename", "shard in place, before the manifest",
                     "manifest written, before its rename", "manifest committed, before latest moves",
                     "latest written, before its rename", "latest moved, before rotation")


def save_single(ckpt: Path, step: int, keep: int = 1, world: int = 1,
                fingerprint: str = "f") -> Path:
    """The save protocol without a process group: `world` tiny shards, then the commit."""
    step_dir = ckpt / checkpointing.step_dir_name(step)
    step_dir.mkdir(parents=True)
    entries = [checkpointing.write_shard(step_dir, rank, world, checkpointing.serialize(
        {"rank": rank, "step": step})) for rank in range(world)]
    checkpointing.commit(ckpt, step, world, entries, fingerprint, keep)
    return step_dir


def crash_during_save_checks(scratch: Path, points: tuple[str, ...] = SAVE_CRASH_POINTS,
                             load=None) -> list[Check]:
    """Commit step 1, then crash the save of step 2 at each of `points`: `latest` must then
    load step 1 (crash before `latest` moved) or step 2 (after), never a broken one. `load`
    (default main.py's load_latest) is called as load(ckpt, 1, False, "f") -> (_, shards)."""
    checks = []
    for index, point in enumerate(points):
        ckpt = scratch / f"crash-{index}"
        shutil.rmtree(ckpt, ignore_errors=True)
        save_single(ckpt, 1)
        crashed = False
        try:
            with crash_at(point):
                save_single(ckpt, 2)
        except SimulatedCrash:
            crashed = True
        expected = 2 if point == "latest moved, before rotation" else 1
        try:
            _, shards = (load or checkpointing.load_latest)(ckpt, 1, False, "f")
            loaded = shards[0]["step"]
            ok = crashed and loaded == expected
            detail = f"latest loads step {loaded}, expected {expected}" + ("" if crashed else
                                                                           "; NO crash happened")
        except checkpointing.CheckpointError as exc:
            ok, detail = False, str(exc)[:100]
        checks.append(Check(f"crash at '{point}' leaves a loadable checkpoint", ok, detail))
    return checks


@contextlib.contextmanager
def failing_write(step: int, rank: int, world: int):
    """Make this process's write of rank `rank`'s shard of step `step` raise OSError(ENOSPC)."""
    step_name, name = checkpointing.step_dir_name(step), checkpointing.shard_name(rank, world)
    real = checkpointing.atomic_write_bytes

    def write(path: Path, data: bytes) -> None:
        if path.name == name and path.parent.name == step_name:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        real(path, data)
    with mock.patch.object(checkpointing, "atomic_write_bytes", write):
        yield


def failed_save_run(ctx: RankContext, config: TrainConfig, ckpt: Path, save_every: int,
                    fail_rank: int, async_save: bool = True) -> dict:
    """Train with keep=1 while rank `fail_rank`'s write of the second save fails. Every rank
    must raise CheckpointError; `latest` must still name the first save, which verifies."""
    fail_step = 2 * save_every
    injected = (failing_write(fail_step, fail_rank, ctx.world_size) if ctx.rank == fail_rank
                else contextlib.nullcontext())
    try:
        with injected:
            run_training(ctx, config, ckpt, save_every, keep=1, async_save=async_save)
        error = None
    except checkpointing.CheckpointError as exc:
        error = str(exc)
    dist.barrier()
    try:
        latest = checkpointing.read_latest(ckpt)
        checkpointing.verify_checkpoint(latest, ctx.world_size)
        verified = latest.name
    except checkpointing.CheckpointError as exc:
        verified = f"broken: {exc}"
    return {"error": error, "latest": verified, "fail_step": fail_step,
            "committed": checkpointing.committed_steps(ckpt)}


def failed_save_check(results: list[dict], save_every: int, fail_rank: int) -> Check:
    errors = [r["error"] for r in results]
    first = checkpointing.step_dir_name(save_every)
    ok = (all(e is not None and f"rank {fail_rank}: OSError" in e for e in errors)
          and all(r["latest"] == first and r["committed"] == [save_every] for r in results))
    detail = (f"every rank raised; latest still {results[0]['latest']}, committed "
              f"{results[0]['committed']}" if ok else
              f"errors {[(e or 'none')[:60] for e in errors]}; latest {results[0]['latest'][:60]}")
    return Check(f"a failed write (rank {fail_rank}, step {results[0]['fail_step']}, async, keep 1)"
                 " commits nothing", ok, detail)


# ============================================================================ damage


def corrupt_and_expect(step_dir: Path, scratch: Path, world: int) -> list[Check]:
    """Copy a good checkpoint, damage it one way at a time, and check the load refuses it with
    an error that names the damaged file."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    first = manifest["files"][0]["name"]

    def edit_manifest(change):
        def apply(d: Path) -> None:
            data = json.loads((d / MANIFEST).read_text())
            change(data)
            (d / MANIFEST).write_text(json.dumps(data))
        return apply

    def flip_byte(d: Path) -> None:
        data = bytearray((d / first).read_bytes())
        data[len(data) // 2] ^= 0x01
        (d / first).write_bytes(bytes(data))

    def truncate(d: Path) -> None:
        (d / first).write_bytes((d / first).read_bytes()[:-10])

    def extra_rank(data: dict) -> None:
        data["files"].append(dict(data["files"][0], rank=world,
                                  name=checkpointing.shard_name(world, world)))

    cases = [
        ("a flipped byte", flip_byte, first, "sha256 mismatch"),
        ("a truncated shard", truncate, first, "truncated"),
        ("a missing shard", lambda d: (d / first).unlink(), first, "missing shard"),
        ("a duplicate rank", edit_manifest(lambda m: m["files"].append(dict(m["files"][0]))),
         MANIFEST, "duplicate rank"),
        ("an extra rank", edit_manifest(extra_rank), MANIFEST, "extra rank"),
        ("a path escaping the directory",
         edit_manifest(lambda m: m["files"][0].update(name="../../etc/passwd")), MANIFEST, "escapes"),
        ("an unknown format version", edit_manifest(lambda m: m.update(format_version=99)),
         MANIFEST, "format_version 99 is unknown"),
        ("no manifest (never committed)", lambda d: (d / MANIFEST).unlink(), MANIFEST,
         "never committed"),
    ]
    checks = []
    for label, damage, culprit, expected in cases:
        target = scratch / "damaged"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(step_dir, target)
        damage(target)
        message = _refusal(checkpointing.verify_checkpoint, target, world)
        checks.append(Check(f"load rejects {label}", expected in message and culprit in message,
                            message[:110]))
    message = _refusal(checkpointing.verify_checkpoint, step_dir, world + 1)
    checks.append(Check("load rejects a world-size mismatch without --reshard",
                        "pass --reshard" in message and MANIFEST in message, message[:110]))
    return checks


def _refusal(load, *args) -> str:
    """The CheckpointError message of `load(*args)`, or "accepted"."""
    try:
        load(*args)
    except checkpointing.CheckpointError as exc:
        return str(exc)
    return "accepted"


def metadata_only_export(path: Path, config: TrainConfig) -> Path:
    """The production failure, reproduced: an exporter that serialised an EMPTY in-memory map
    (the trained weights lived elsewhere) still writes a valid safetensors file, header and
    metadata only, that loads without error."""
    from safetensors.torch import save
    metadata = {"format": "pt", "run": config.fingerprint(), "step": str(config.steps),
                "dtype": "float64", "exported_by": "distillation export (empty map)"}
    path.write_bytes(save({}, metadata=metadata))
    return path


def empty_export_check(scratch: Path, config: TrainConfig, live: dict[str, torch.Tensor]) -> Check:
    """A naive check (the file exists, is non-empty and loads as safetensors) accepts the
    metadata-only file; verify_export against the live weights refuses it."""
    from safetensors.torch import load_file
    path = metadata_only_export(scratch / "empty.safetensors", config)
    naive = path.stat().st_size > 0 and isinstance(load_file(path), dict)
    message = _refusal(atomic_file.verify_export, live, path)
    return Check("a metadata-only export (the 200-byte file) loads, and is caught",
                 naive and "holds no tensors" in message, message[:110])


# ============================================================================ exact resume: the rest


def lr_of_first_resumed_step(restore_lr: bool, steps: int = 10, saved_at: int = 5) -> tuple[float, float]:
    """(LR the first resumed step uses, LR the uninterrupted run used at that step) for a
    LambdaLR(cosine_with_warmup) restored from its state_dict, with or without writing the
    saved LR back into the optimizer."""
    def build():
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=0.1)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(
            optimizer, exact_resume.cosine_with_warmup(3, steps))
    optimizer, scheduler = build()
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        if len(lrs) == saved_at:  # a checkpoint after step `saved_at`, as the trainer saves
            saved = (scheduler.state_dict(), [g["lr"] for g in optimizer.param_groups])
    optimizer, scheduler = build()
    scheduler.load_state_dict(saved[0])
    if restore_lr:
        optimizer.param_groups[0]["lr"] = saved[1][0]
    return optimizer.param_groups[0]["lr"], lrs[saved_at]


def lr_checks() -> list[Check]:
    """nanotron PR 245's bug: the scheduler's state_dict alone leaves the first resumed step at
    the initial LR (one step, not a restarted warmup); with the saved LR it is exact."""
    initial = 0.1 * exact_resume.cosine_with_warmup(3, 10)(0)
    wrong, expected = lr_of_first_resumed_step(restore_lr=False)
    right, _ = lr_of_first_resumed_step(restore_lr=True)
    return [Check("scheduler state alone: the first resumed step runs at the initial LR "
                  "(nanotron PR 245)", wrong == initial != expected and right == expected,
                  f"LR {wrong:.4g} instead of {expected:.4g}; with the saved LR: {right:.4g}")]


def scaler_run(dtype: torch.dtype, spikes: dict[int, float], growth_interval: int,
               steps: int = 8, save_at: int = 3, resume: dict | None = None,
               restore_scaler: bool = True,
               device: str = "cpu") -> tuple[torch.Tensor, dict | None, list[int]]:
    """A linear layer whose activations are cast to `dtype`, trained with a GradScaler (init
    scale 2^16, doubled after `growth_interval` clean steps), saved with `exact_resume_state`
    at `save_at` and, given `resume`, restored from it (without the scaler unless
    `restore_scaler`). `spikes[step]` shifts that step's targets (an injected loss spike: in
    fp16 the scaled gradient of the activations overflows). Returns the final weight, the
    saved state, and the steps that were skipped."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(0.1 * torch.randn(4, 16, dtype=torch.float32, device=device))
    optimizer = torch.optim.SGD([weight], lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**16,
                                  growth_interval=growth_interval)
    cursor = exact_resume.DataCursor(16 * steps, 16, seed=1)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(16 * steps, 16, generator=generator).to(device)
    targets = torch.randn(16 * steps, 4, generator=generator).to(device)
    step, saved, skipped = 0, None, []
    if resume is not None:
        with torch.no_grad():
            weight.copy_(resume["weight"])
        step = exact_resume.restore_exact_resume_state(
            resume["state"], optimizer, scheduler, scaler if restore_scaler else None, cursor, device)
    while step < steps:
        indices = cursor.next_indices().to(device)
        activations = F.linear(inputs[indices], weight).to(dtype)
        loss = F.mse_loss(activations.float(), targets[indices] + spikes.get(step, 0.0))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(step)
        scheduler.step()
        step += 1
        if step == save_at:
            saved = {"weight": weight.detach().clone(), "state": exact_resume.exact_resume_state(
                step, optimizer, scheduler, scaler, cursor, device)}
    return weight.detach().cpu(), saved, skipped


def scaler_checks(device: str = "cpu") -> list[Check]:
    """The GradScaler's state matters for exact resume only when the scale decides something.
    float64 activations, no overflow: scaling by a power of two is exact, so a resume that
    forgets the scaler is still bit-identical (the main run cannot detect the bug). fp16 with
    an injected overflow before the save (scale 2^16 -> 2^15) and a spike after it that
    overflows at 2^16 but not at 2^15: only the restored scaler reproduces the run."""
    checks = []
    full, saved, _ = scaler_run(torch.float64, {}, 1, device=device)
    forgot, _, _ = scaler_run(torch.float64, {}, 1, resume=saved, restore_scaler=False,
                              device=device)
    scale = saved["state"]["scaler"]["scale"]
    checks.append(Check("GradScaler, float64 without overflow: a resume that forgets it is still "
                        "bit-identical (undetectable)", torch.equal(full, forgot) and scale > 2**16,
                        f"saved scale 2^{math.log2(scale):g}, forgotten: 2^16; power-of-two "
                        "scaling is exact, so the main run cannot test the scaler"))
    # v = max |dL/dy| with 64 outputs: targets shifted by s give v ~ 2 s / 64. Overflow in fp16
    # iff scale x v > 65504: s = 96 (v ~ 3) overflows at 2^16 and 2^15, s = 48 (v ~ 1.5) at 2^16 only.
    spikes = {1: 96.0, 5: 48.0}
    full, saved, skipped = scaler_run(torch.float16, spikes, 10_000, device=device)
    restored, _, _ = scaler_run(torch.float16, spikes, 10_000, resume=saved, device=device)
    forgot, _, skipped_forgot = scaler_run(torch.float16, spikes, 10_000, resume=saved,
                                           restore_scaler=False, device=device)
    ok = skipped == [1] and torch.equal(full, restored) and skipped_forgot == [5] \
        and not torch.equal(full, forgot)
    checks.append(Check("GradScaler, fp16 with an injected overflow: restored == uninterrupted, "
                        "forgotten != (skips another step)", ok,
                        f"uninterrupted skipped {skipped}; scaler restored: equal "
                        f"{torch.equal(full, restored)}; forgotten: skipped {skipped_forgot}, "
                        f"max |diff| {max_abs_diff(full, forgot):.1e}"))
    return checks


def interval_check() -> Check:
    """Our daly_interval against the optima Daly (2006) reports in his Figs. 3-5."""
    ours = [exact_resume.daly_interval(c, m) for c, m, _, _ in DALY_EXAMPLES]
    ok = all(abs(got - want) <= half_unit for got, (_, _, want, half_unit) in zip(ours, DALY_EXAMPLES))
    return Check("Daly's interval formula reproduces his published optima (117, 57, 9.1 min)", ok,
                 ", ".join(f"{got:.2f}" for got in ours) + " min (save cost 5 min; MTBF 24 h, 6 h, 15 min)")


# ============================================================================ torch.distributed.checkpoint


def full_state(shards: list[dict]) -> dict[str, torch.Tensor]:
    """A checkpoint's full flattened tensors (parameters and Adam moments) from every rank's
    slices: what DCP must reproduce after its own resharding."""
    state = {}
    for name in shards[0]["params"]:
        state[f"param.{name}"] = torch.cat([s["params"][name] for s in shards])
        for key in ("exp_avg", "exp_avg_sq"):
            if name in shards[0][key]:
                state[f"{key}.{name}"] = torch.cat([s[key][name] for s in shards])
    return state


def dcp_save(ctx: RankContext, state: dict[str, torch.Tensor], path: Path) -> None:
    """dcp.save of the same state: every tensor a DTensor sharded on dim 0 across this world;
    DCP writes a file per rank plus its own metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    dcp.save({name: distribute_tensor(t.to(ctx.device), mesh, [Shard(0)])
              for name, t in state.items()}, checkpoint_id=str(path))


def dcp_load(ctx: RankContext, sizes: dict[str, int], path: Path, sharded: bool) -> dict[str, torch.Tensor]:
    """dcp.load in place, into DTensors sharded across THIS world (`sharded`; it may differ from
    the saving one: DCP reshards at load time) or into plain full tensors. Returns full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    zeros = {name: torch.zeros(n, dtype=torch.float64, device=ctx.device) for name, n in sizes.items()}
    if sharded:
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        zeros = {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in zeros.items()}
    dcp.load(zeros, checkpoint_id=str(path))
    return {name: (t.full_tensor() if sharded else t).cpu() for name, t in zeros.items()}


def reshard_and_dcp(ctx: RankContext, config: TrainConfig, work: Path, in_process: bool) -> dict:
    """Resume the noise-free checkpoint of `work/e` on THIS world (resharding N -> M with the
    ZeRO trainer) or, `in_process`, in one process (N -> 1); load DCP's copy the same way and
    compare it with ours, tensor by tensor."""
    plain = dataclasses.replace(config, noise=False)
    if in_process:
        run = resume_unsharded(plain, work / "e")
    else:
        run = run_training(ctx, plain, work / "e", save_every=0, keep=1, resume=True, reshard=True)
    _, shards = checkpointing.load_latest(work / "e", None, True, plain.fingerprint())
    ours = full_state(shards)
    loaded = dcp_load(ctx, {n: t.numel() for n, t in ours.items()}, work / "dcp", not in_process)
    return {"params": run["params"], "resumed_from": run["resumed_from"], "tensors": len(ours),
            "dcp_equal": all(torch.equal(loaded[name], t) for name, t in ours.items())}


# ============================================================================ the demo's ranks


def shared_workdir(ctx: RankContext, workdir: str | None) -> Path:
    """The one directory every rank works in: the parent's (spawned ranks) or, under torchrun,
    a temporary directory rank 0 creates and broadcasts (never one per rank: rank 0's manifest
    and rank 1's shard would land in different places)."""
    chosen = [workdir]
    if workdir is None:
        if ctx.rank == 0:
            chosen[0] = tempfile.mkdtemp(prefix="lesson06-")
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def check_visible(ctx: RankContext, work: Path) -> None:
    """Every rank must see the directory rank 0 writes into, else all stop with one line."""
    visible: list = [None] * ctx.world_size
    dist.all_gather_object(visible, work.is_dir())
    if not all(visible):
        raise checkpointing.CheckpointError(
            f"{work}: not visible on rank(s) {[r for r, v in enumerate(visible) if not v]}: "
            "every rank must share the checkpoint directory (one node, or a shared filesystem)")


def demo_worker(ctx: RankContext, config: dict, workdir: str | None, save_every: int, keep: int,
                fault: str | None, fault_rank: int) -> dict:
    """Every run of the demo on every rank: uninterrupted (with export), resumed in a fresh
    trainer from an older checkpoint, asynchronous, a failing write, a noise-free run saved
    mid-training with our protocol and with DCP; rank 0 then damages copies of a checkpoint.
    Under torchrun (`workdir` None) the world size is fixed, so resharding runs N -> 1 here."""
    inject_fault(ctx, fault, fault_rank)
    config = TrainConfig(**config)
    work = shared_workdir(ctx, workdir)
    try:
        check_visible(ctx, work)
        result = _demo_runs(ctx, config, work, save_every, keep, in_process=workdir is None)
        dist.barrier()
    finally:
        if workdir is None and ctx.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _demo_runs(ctx: RankContext, config: TrainConfig, work: Path, save_every: int, keep: int,
               in_process: bool) -> dict:
    world, rank = ctx.world_size, ctx.rank
    full = run_training(ctx, config, work / "a", save_every, keep,
                        export_path=work / "model.safetensors")
    # What a crash after the oldest kept save leaves: `latest` names it; newer steps go.
    if rank == 0:
        shutil.copytree(work / "a", work / "b")
        oldest = checkpointing.committed_steps(work / "b")[0]
        checkpointing.atomic_write_bytes(work / "b" / LATEST,
                                         (checkpointing.step_dir_name(oldest) + "\n").encode())
    dist.barrier()
    resumed = run_training(ctx, config, work / "b", save_every, keep, resume=True)
    asynchronous = run_training(ctx, config, work / "c", save_every, keep, async_save=True)
    failure = failed_save_run(ctx, config, work / "f", save_every, fail_rank=world - 1)
    plain = dataclasses.replace(config, noise=False)
    run_training(ctx, plain, work / "e", save_every, keep, stop_at=save_every * 2)
    _, shards = checkpointing.load_latest(work / "e", world, False, plain.fingerprint())
    dcp_save(ctx, full_state(shards), work / "dcp")
    dist.barrier()
    result = {"full": full["sha256"], "resumed": resumed["sha256"],
              "resumed_from": resumed["resumed_from"], "async": asynchronous["sha256"],
              "failure": failure, "exported_bytes": full["exported_bytes"],
              "save_seconds": full["save_seconds"], "disk": None, "reshard": None}
    if rank == 0:
        result["disk"] = [dataclasses.asdict(c) for c in disk_checks(work, world, config,
                                                                       save_every, keep)]
    if in_process:
        result["reshard"] = reshard_and_dcp(ctx, config, work, in_process=True)
    return result


def disk_checks(work: Path, world: int, config: TrainConfig, save_every: int, keep: int) -> list[Check]:
    """Rank 0, after the runs: the async run's checkpoint verifies, rotation removed exactly
    the oldest saves, and every damaged copy of the latest checkpoint is refused."""
    latest_async = checkpointing.read_latest(work / "c")
    message = _refusal(checkpointing.verify_checkpoint, latest_async, world)
    saves = list(range(save_every, config.steps + 1, save_every))
    kept = checkpointing.committed_steps(work / "a")
    expected = kept_steps(config.steps, save_every, keep)
    removed = sorted(set(saves) - set(kept))
    checks = [
        Check("asynchronous saves: latest verifies", message == "accepted",
              f"latest {latest_async.name}" if message == "accepted" else message[:110]),
        Check(f"rotation removed the oldest, kept the newest {keep} by step number",
              kept == expected and len(removed) == len(saves) - keep > 0,
              f"saved {saves}, removed {removed}, kept {kept}"),
    ]
    scratch = Path(tempfile.mkdtemp(prefix="lesson06-damage-"))
    try:
        checks += corrupt_and_expect(checkpointing.read_latest(work / "a"), scratch, world)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return checks


def reshard_worker(ctx: RankContext, config: dict, workdir: str) -> dict:
    """On another number of ranks: resume the noise-free checkpoint with resharding, train to
    the end, and load DCP's checkpoint with load-time resharding."""
    return reshard_and_dcp(ctx, TrainConfig(**config), Path(workdir), in_process=False)


def run_worker(ctx: RankContext, config: dict, ckpt_dir: str, save_every: int, keep: int,
               resume: bool, reshard: bool, async_save: bool, sleep_per_step: float,
               fault: str | None, fault_rank: int) -> dict:
    """The CLI's training run (`--ckpt-dir`) on one rank."""
    inject_fault(ctx, fault, fault_rank)
    result = run_training(ctx, TrainConfig(**config), Path(ckpt_dir), save_every, keep, resume,
                          reshard, async_save, sleep_per_step=sleep_per_step,
                          export_path=Path(ckpt_dir) / "model.safetensors")
    result.pop("params")
    return result


# ============================================================================ the command line


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Sharded, atomic, verified checkpoints with exact resume, "
                           "resharding and export; compared with torch.distributed.checkpoint.")
    parser.add_argument("--ckpt-dir", type=Path, help="train into this directory (without it: "
                        "the full demo in a temporary directory)")
    parser.add_argument("--steps", type=int_in(1, 100_000), default=10,
                        help="training steps (default 10)")
    parser.add_argument("--save-every", type=int_in(1), default=3, help="save every K steps (default 3)")
    parser.add_argument("--keep", type=int_in(1), default=2, help="keep the newest J checkpoints (default 2)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--reshard", action="store_true",
                        help="allow resuming with a different world size")
    parser.add_argument("--async-save", action="store_true", help="write shards in the background")
    parser.add_argument("--batch", type=int_in(1, 4096), default=24, help="global batch (default 24)")
    parser.add_argument("--sleep-per-step", type=float_in(0.0, 60.0), default=0.0,
                        help="slow training down, to kill it by hand and resume")
    parser.add_argument("--mtbf-hours", type=float_in(0.01, 1e6), default=24.0,
                        help="mean time between failures for the checkpoint-interval estimate "
                             "(default 24)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    world = world_size_of(args)
    if args.batch % world:
        parser.error(f"--batch {args.batch} is not divisible by the world size {world}")
    if 96 % args.batch:
        parser.error(f"--batch {args.batch} must divide the dataset size 96")
    if (args.resume or args.reshard) and args.ckpt_dir is None:
        parser.error("--resume and --reshard need --ckpt-dir")
    saves = args.steps // args.save_every
    if args.ckpt_dir is None and (saves <= args.keep or
                                  kept_steps(args.steps, args.save_every,
                                                           args.keep)[0] >= args.steps):
        parser.error(f"the demo needs more saves than --keep (rotation) and a kept save before "
                     f"the last step (resume): {saves} save(s) with --steps {args.steps} "
                     f"--save-every {args.save_every} --keep {args.keep}")
    return args


def train_cli(args, config: TrainConfig) -> Report:
    """`--ckpt-dir`: a real run. A bad checkpoint directory is refused here, before any rank
    starts, with one line."""
    world = world_size_of(args)
    if args.resume:
        step_dir = checkpointing.read_latest(args.ckpt_dir)
        checkpointing.verify_checkpoint(step_dir, world, args.reshard, config.fingerprint())
    else:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if (args.ckpt_dir / LATEST).exists():
            raise checkpointing.CheckpointError(
                f"{args.ckpt_dir}: already holds checkpoints; pass --resume to continue, or use "
                "a new directory")
    device, backend = choose_device(args.device, world)
    results = launch(run_worker, world,
                     (dataclasses.asdict(config), str(args.ckpt_dir), args.save_every, args.keep,
                      args.resume, args.reshard, args.async_save, args.sleep_per_step,
                      args.fault, args.fault_rank), device=args.device, timeout_s=args.timeout)
    manifest = checkpointing.verify_checkpoint(checkpointing.read_latest(args.ckpt_dir),
                                               len(results), False, config.fingerprint())
    steps = checkpointing.committed_steps(args.ckpt_dir)
    checks = [
        Check("every rank ends with the same parameters", len({r["sha256"] for r in results}) == 1,
              results[0]["sha256"][:16]),
        Check("latest checkpoint verifies (manifest, sizes, sha256)", True,
              f"step {manifest['step']}, {len(manifest['files'])} shard(s)"),
        Check(f"rotation keeps the newest {args.keep} by step", len(steps) <= args.keep
              and steps[-1] == manifest["step"], f"committed steps {steps}"),
        Check("export verified (size and round trip)", bool(results[0]["exported_bytes"]),
              f"{results[0]['exported_bytes']} bytes"),
    ]
    metrics = {"final_param_sha256": results[0]["sha256"],
               "resumed_from_step": results[0]["resumed_from"], "committed_steps": steps,
               "headline": f"step {results[0]['step']}, resumed from {results[0]['resumed_from']}"}
    return Report(LESSON, device, backend, len(results), checks, metrics)


def demo(args, config: TrainConfig) -> Report:
    """The self-checking demo: spawned ranks share the parent's temporary directory; under
    torchrun rank 0 chooses one and resharding runs N -> 1 in each process."""
    world = world_size_of(args)
    device, backend = choose_device(args.device, world)
    torchrun = under_torchrun()
    other_world = 2 if world != 2 else 3
    reshard_device = device_for_extra_ranks(args.device, other_world)
    with tempfile.TemporaryDirectory(prefix="lesson06-") as tmp:
        first = launch(demo_worker, world,
                       (dataclasses.asdict(config), None if torchrun else tmp, args.save_every,
                        args.keep, args.fault, args.fault_rank),
                       device=args.device, timeout_s=args.timeout)
        if torchrun:
            second = [r["reshard"] for r in first]
        else:
            second = launch(reshard_worker, other_world, (dataclasses.asdict(config), tmp),
                            device=reshard_device, timeout_s=args.timeout)
        r0 = first[0]
        checks = [
            Check("every rank ends with the same parameters",
                  len({r["full"] for r in first}) == 1, r0["full"][:16]),
            Check(f"crash after step {r0['resumed_from']}'s save, resumed: bit-identical",
                  all(r["resumed"] == r["full"] for r in first) and 0 < r0["resumed_from"] < config.steps,
                  f"resumed from step {r0['resumed_from']}; sha256 {r0['resumed'][:16]}"),
            Check("asynchronous saves: the same run", all(r["async"] == r["full"] for r in first),
                  r0["async"][:16]),
            failed_save_check([r["failure"] for r in first], args.save_every, world - 1),
        ]
        checks += [Check(**c) for c in r0["disk"]]
        checks.append(Check("export from the live model verified (size, round trip)",
                            bool(r0["exported_bytes"]), f"{r0['exported_bytes']} bytes"))
        with one_thread():
            reference = reference_params(dataclasses.replace(config, noise=False))
            checks.append(empty_export_check(Path(tmp), config, _live_weights(config)))
            checks += crash_during_save_checks(Path(tmp))
            checks += lr_checks()
            checks += scaler_checks("cuda" if device == "cuda" else "cpu")
        checks.append(interval_check())
    gap = max(max_abs_diff(r["params"], reference) for r in second)
    if torchrun:  # torchrun fixes the world size: reshard to one process, in each process
        resharded, loaded = f"{world} -> 1 process (each rank)", "into full tensors"
    else:
        resharded, loaded = f"{world} -> {other_world} ranks", f"on {other_world} ranks"
        if reshard_device != device:
            loaded += f" ({reshard_device}: {other_world} ranks need {other_world} GPUs)"
    checks.append(Check(f"resharded {resharded} == unsharded reference",
                        gap <= RESHARD_TOLERANCE and second[0]["resumed_from"] > 0,
                        f"resumed at step {second[0]['resumed_from']}; max |diff| {gap:.1e}"))
    checks.append(Check(f"dcp.save on {world} ranks, dcp.load {loaded} == our checkpoint",
                        all(r["dcp_equal"] for r in second), f"{second[0]['tensors']} tensors, bitwise"))
    save_s = statistics.median(r["save_seconds"] for r in first)
    mtbf = args.mtbf_hours * 3600.0
    metrics = {"final_param_sha256": r0["full"], "resumed_from_step": r0["resumed_from"],
               "exported_bytes": r0["exported_bytes"], "reshard_max_diff": gap,
               "save_seconds": save_s, "mtbf_hours": args.mtbf_hours,
               "young_interval_s": exact_resume.young_interval(save_s, mtbf),
               "daly_interval_s": exact_resume.daly_interval(save_s, mtbf),
               "headline": f"resume bit-exact from step {r0['resumed_from']}; "
                           f"{len(SAVE_CRASH_POINTS)} crash points safe; save {save_s * 1e3:.1f} ms "
                           f"-> checkpoint every {exact_resume.young_interval(save_s, mtbf):.0f} s "
                           f"at MTBF {args.mtbf_hours:g} h"}
    return Report(LESSON, device, backend, world, checks, metrics)


def _live_weights(config: TrainConfig) -> dict[str, torch.Tensor]:
    return dict(data_parallel.make_model(config.seed).named_parameters())


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    config = TrainConfig(seed=args.seed, steps=args.steps, batch=args.batch)
    try:
        report = train_cli(args, config) if args.ckpt_dir else demo(args, config)
    except checkpointing.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return finish(report, args.json, started)


if __name__ == "__main__":
    from lessons._report import run_main
    run_main(main)
