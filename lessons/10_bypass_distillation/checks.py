"""Lesson 10's proof: the sweep (teachers shared through files, every rank training its blocks,
runs marked done, the sweep plan), the kill-and-resume demo, evaluation of the stitched
students against the teacher and an end-to-end baseline, the export and broken exports, and
the CLI. The technique itself is in main.py and resumable.py.

Everything the demo does runs inside one launch (`demo_worker`), with rank 0 doing the serial
parts between barriers and choosing the one runs directory every rank uses: so it runs the same
self-spawned and under torchrun.

Run: `python lessons/10_bypass_distillation/main.py` (this module's `main()` is what it runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessons._checks import fingerprint
from lessons._launch import RankContext, inject_fault, launch, under_torchrun
from lessons._report import Check, Report, check_args, finish, int_in, lesson_parser

from . import main as distillation
from . import resumable

LESSON = "10_bypass_distillation"
checkpointing = resumable.checkpointing  # lesson 06's technique (atomic writes, export)
RunConfig, TeacherConfig = resumable.RunConfig, distillation.TeacherConfig


# ============================================================================ the sweep


def load_or_train_teacher(config: TeacherConfig, teachers_dir: Path) -> tuple[nn.Module, bool]:
    """The teacher is a run too: trained once per fingerprint, exported (verified), reused.
    Returns (teacher, True if it was read from its file)."""
    path = teachers_dir / f"teacher-{fingerprint(config)}.safetensors"
    if path.exists():
        from safetensors.torch import load_file
        teacher = distillation.make_teacher(config)
        teacher.load_state_dict(load_file(path))
        return teacher.eval(), True
    teacher = distillation.train_teacher(config)
    teachers_dir.mkdir(parents=True, exist_ok=True)
    checkpointing.export_safetensors(teacher.state_dict(), path)
    return teacher, False


def sweep_plan(runs: list[RunConfig], runs_dir: Path) -> dict[str, str]:
    """What a sweep would do with each run, read from the runs directory alone: "finished",
    "resume: blocks at steps [...]" (each block's last checkpoint, its run length if done), or
    "new"."""
    plan = {}
    for run in runs:
        run_dir = runs_dir / run.fingerprint()
        if (run_dir / "done.json").exists():
            plan[run.fingerprint()] = "finished"
            continue
        steps = []
        for index in range(run.teacher.layers):
            directory = resumable.block_dir(run_dir, index)
            state = None if (directory / "done.json").exists() else resumable.load_block(directory)
            steps.append(run.steps if (directory / "done.json").exists() else
                         (state["step"] if state is not None else 0))
        plan[run.fingerprint()] = f"resume: blocks at steps {steps}" if max(steps) > 0 else "new"
    return plan


def finish_runs(runs: list[RunConfig], runs_dir: Path) -> list[str]:
    """After the ranks: a run whose every block is done gets its own done.json (atomically)."""
    finished = []
    for run in runs:
        run_dir = runs_dir / run.fingerprint()
        done = [resumable.block_dir(run_dir, i) / "done.json" for i in range(run.teacher.layers)]
        if all(path.exists() for path in done) and not (run_dir / "done.json").exists():
            blocks = [json.loads(path.read_text()) for path in done]
            summary = {"config": dataclasses.asdict(run),
                       "block_losses": [b["final_loss"] for b in blocks],
                       "block_sha256": [b["sha256"] for b in blocks]}
            checkpointing.atomic_write_bytes(run_dir / "done.json", json.dumps(summary, indent=1).encode())
            finished.append(run.fingerprint())
    return finished


class SimulatedKill(Exception):
    """Raised after a step, before its save: the rank stops its job at once, leaving on disk
    exactly what a killed process leaves (checkpoints up to the last save, nothing after)."""


def kill_hook(after: int | None, real: bool):
    """An `after_step` hook for train_block: after step `after`, SIGKILL this process (real)
    or raise SimulatedKill (the demo, which must go on afterwards)."""
    def hook(step: int) -> None:
        if step == after:
            if real:
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would
            raise SimulatedKill(step)
    return None if after is None else hook


def run_from(spec: dict) -> RunConfig:
    return RunConfig(**{**spec, "teacher": TeacherConfig(**spec["teacher"])})


def sweep_pass(ctx: RankContext, jobs: list[dict], teachers_dir: Path) -> list[dict]:
    """One pass of a sweep inside a process group. jobs: {"runs_dir", "run" (asdict of a
    RunConfig), "kill_after" (step or None), "real_kill"}. Rank 0 trains (or finds) each
    teacher and exports it; every rank reads it and trains its own blocks of every job (a
    finished run is skipped whole); then rank 0 marks the runs whose blocks are all done.
    Returns this rank's plain results, one per job."""
    runs = [(Path(job["runs_dir"]), run_from(job["run"])) for job in jobs]
    if ctx.rank == 0:
        for _, run in runs:
            load_or_train_teacher(run.teacher, teachers_dir)
    dist.barrier()
    out, io_cache, teachers = [], {}, {}
    for job, (runs_dir, run) in zip(jobs, runs):
        run_dir = runs_dir / run.fingerprint()
        if (run_dir / "done.json").exists():
            out.append({"fingerprint": run.fingerprint(), "status": "skipped", "blocks": []})
            continue
        if not distillation.owned_blocks(run.teacher.layers, ctx.rank, ctx.world_size):
            out.append({"fingerprint": run.fingerprint(), "status": "idle", "blocks": []})
            continue
        if run.teacher not in teachers:  # read each teacher file once per rank
            teachers[run.teacher] = load_or_train_teacher(run.teacher, teachers_dir)[0]
        hook = kill_hook(job.get("kill_after"), job.get("real_kill", False))
        try:
            blocks = resumable.train_rank_blocks(run, run_dir, teachers[run.teacher], ctx.rank,
                                                    ctx.world_size, io_cache, hook)
        except SimulatedKill as kill:
            out.append({"fingerprint": run.fingerprint(), "status": "killed", "step": kill.args[0],
                        "blocks": []})
            continue
        for result in blocks:
            result.pop("losses", None)
        out.append({"fingerprint": run.fingerprint(), "status": "ran", "blocks": blocks})
    dist.barrier()
    if ctx.rank == 0:
        for runs_dir, run in runs:
            finish_runs([run], runs_dir)
    dist.barrier()
    return out


def sweep_worker(ctx: RankContext, jobs: list[dict], teachers_dir: str, fault: str | None,
                 fault_rank: int) -> list[dict]:
    inject_fault(ctx, fault, fault_rank)
    return sweep_pass(ctx, jobs, Path(teachers_dir))


def job(runs_dir: Path, run: RunConfig, kill_after: int | None = None, real_kill: bool = False) -> dict:
    return {"runs_dir": str(runs_dir), "run": dataclasses.asdict(run), "kill_after": kill_after,
            "real_kill": real_kill}


def sweep(jobs: list[dict], teachers_dir: Path, world: int, timeout: float, fault: str | None = None,
          fault_rank: int = 0) -> list[list[dict]]:
    """One sweep pass on `world` self-spawned ranks (see `sweep_pass`); every rank's results."""
    return launch(sweep_worker, world, (jobs, str(teachers_dir), fault, fault_rank), device="cpu",
                  timeout_s=timeout)


def statuses(per_rank: list[list[dict]], index: int) -> list[str]:
    """The distinct statuses of job `index`'s blocks over every rank (or of the job itself, on
    the ranks that own blocks)."""
    return sorted({block["status"] for rank in per_rank for block in rank[index]["blocks"]}
                  or {rank[index]["status"] for rank in per_rank} - {"idle"})


# ============================================================================ evaluation


@torch.no_grad()
def evaluate(model: nn.Module, teacher: nn.Module, config: TeacherConfig, n_batches: int = 8) -> dict:
    """Held-out next-token loss, and KL(teacher || model) per token, over stream 2."""
    loss = kl = 0.0
    for tokens, targets in distillation.batches(config, n_batches, 2):
        logits, reference = model(tokens), teacher(tokens)
        loss += float(F.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1)))
        kl += float(F.kl_div(F.log_softmax(logits, -1).reshape(-1, config.vocab),
                             F.log_softmax(reference, -1).reshape(-1, config.vocab),
                             log_target=True, reduction="batchmean"))
    return {"loss": loss / n_batches, "kl": kl / n_batches}


@torch.no_grad()
def block_report(student: nn.Module, teacher: nn.Module, config: TeacherConfig, n_batches: int = 4) -> dict:
    """Per block, on held-out batches, each block fed the teacher's input: the student's
    normalized MSE, the no-op baseline (the block skipped: y = x), and the student's error
    relative to the block's own change (`block_change_mse`)."""
    sums = {"student": [0.0] * config.layers, "skip": [0.0] * config.layers,
            "relative": [0.0] * config.layers}
    for tokens, _ in distillation.batches(config, n_batches, 2):
        states = distillation.teacher_block_io(teacher, tokens)
        for i, layer in enumerate(student.layers):
            x, t = states[i], states[i + 1]
            y = layer(x)
            sums["student"][i] += float(distillation.normalized_mse(y, t)) / n_batches
            sums["skip"][i] += float(distillation.normalized_mse(x, t)) / n_batches
            sums["relative"][i] += float(distillation.block_change_mse(y, x, t)) / n_batches
    return sums


def train_end_to_end(run: RunConfig, teacher: nn.Module) -> nn.Module:
    """The baseline for the same compute: the same student, the same initialisation, the same
    number of steps and LR schedule, trained on the teacher's logits (KL) end to end."""
    student = distillation.make_teacher(run.teacher)
    student.load_state_dict(teacher.state_dict())
    student.layers = nn.ModuleList(resumable.initial_block(run, teacher, index)  # the blockwise start
                                   for index in range(run.teacher.layers))
    for part in (student.embed, student.pos, student.norm):
        part.requires_grad_(False)  # blockwise training does not touch them either
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=run.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, checkpointing.cosine_with_warmup(run.warmup, run.steps))
    for tokens, _ in distillation.batches(run.teacher, run.steps, 1):
        with torch.no_grad():
            reference = F.log_softmax(teacher(tokens), -1)
        logits = student(tokens)
        loss = F.kl_div(F.log_softmax(logits, -1).reshape(-1, run.teacher.vocab),
                        reference.reshape(-1, run.teacher.vocab), log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return student.eval()


def broken_export_checks(student: nn.Module, scratch: Path) -> list[Check]:
    """What catches the production failure (an empty map exported after 25 hours) and two
    cousins: a truncated file and an export taken before training."""
    from safetensors.torch import save
    live = {k: v.detach().contiguous() for k, v in student.state_dict().items()}
    refused, empty = scratch / "refused.safetensors", scratch / "empty.safetensors"
    truncated, stale = scratch / "truncated.safetensors", scratch / "stale.safetensors"
    empty.write_bytes(save({}, metadata={"format": "pt"}))  # a header, no tensors
    truncated.write_bytes(save(live)[:-100])
    stale.write_bytes(save({k: torch.zeros_like(v) for k, v in live.items()}))
    attempts = [("exporting an empty map is refused", refused,
                 lambda: checkpointing.export_safetensors({}, refused))]
    for label, path in (("an export holding no tensors (metadata only)", empty),
                        ("a truncated file", truncated), ("weights that are not the live ones", stale)):
        attempts.append((label, path, lambda path=path: checkpointing.verify_export(live, path)))
    checks = []
    for label, path, attempt in attempts:
        try:
            attempt()
            message = "accepted"
        except checkpointing.CheckpointError as exc:
            message = str(exc)
        checks.append(Check(f"broken export caught: {label}", message.startswith(str(path)), message))
    return checks


# ============================================================================ the demo


def shared_directory(ctx: RankContext, out: str | None) -> Path:
    """One fresh directory for every rank: rank 0 creates it (under `out`, or the system's
    temporary directory) and broadcasts its path. Under torchrun each rank is its own process
    with its own temporary directory, so a directory chosen per rank would split the run."""
    chosen = [tempfile.mkdtemp(prefix="bld-", dir=out) if ctx.rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def demo_worker(ctx: RankContext, out: str | None, layers: int, steps: int, teacher_steps: int,
                fault: str | None, fault_rank: int) -> dict:
    """The whole demo inside one process group: two sweep passes (the first with a simulated
    kill), then rank 0 checks, evaluates and exports; every rank returns rank 0's report."""
    inject_fault(ctx, fault, fault_rank)
    scratch = shared_directory(ctx, out)
    try:
        report = demo(ctx, scratch, layers, steps, teacher_steps)
    finally:
        dist.barrier()  # nobody deletes the directory while a rank may still read it
        if ctx.rank == 0 and out is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return report


def demo(ctx: RankContext, scratch: Path, layers: int, steps: int, teacher_steps: int) -> dict:
    teacher_config = TeacherConfig(layers=layers, steps=teacher_steps)
    runs = [RunConfig(kind=kind, steps=steps, teacher=teacher_config) for kind in ("mlp1", "linear")]
    runs_dir, fresh_dir = scratch / "runs", scratch / "uninterrupted"
    kill_step = steps // 2 + 5  # between two checkpoints: the work since the last is lost
    first = sweep_pass(ctx, [job(runs_dir, runs[0], kill_step), job(runs_dir, runs[1]),
                             job(fresh_dir, runs[0])], runs_dir)
    plan_after_kill = sweep_plan(runs, runs_dir)
    second = sweep_pass(ctx, [job(runs_dir, run) for run in runs], runs_dir)
    plan_after_all = sweep_plan(runs, runs_dir)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"first": first, "second": second})
    result: list = [None]
    if ctx.rank == 0:
        result[0] = report(scratch, runs, teacher_config, kill_step, [g["first"] for g in gathered],
                           [g["second"] for g in gathered], plan_after_kill, plan_after_all, ctx.world_size)
    dist.broadcast_object_list(result, src=0)
    return result[0]


def report(scratch: Path, runs: list[RunConfig], teacher_config: TeacherConfig, kill_step: int,
           first: list, second: list, plan_after_kill: dict, plan_after_all: dict, world: int) -> dict:
    """Rank 0: the demo's checks and metrics, as plain data."""
    runs_dir, fresh_dir, layers = scratch / "runs", scratch / "uninterrupted", teacher_config.layers
    last_save = resumable.resume_step(kill_step, runs[0].save_every)
    # a kill ends a rank's job: each rank's first block keeps its checkpoint, the rest never started
    expected_steps = [last_save if index < world else 0 for index in range(layers)]
    resumed_from = sorted({b["resumed_from"] for rank in second for b in rank[0]["blocks"]})
    summaries = {run.kind: json.loads((runs_dir / run.fingerprint() / "done.json").read_text())
                 for run in runs}
    fresh = json.loads((fresh_dir / runs[0].fingerprint() / "done.json").read_text())
    names = [run.fingerprint() for run in runs]
    same_config = RunConfig(**{**dataclasses.asdict(runs[0]), "teacher": teacher_config})
    checks = [
        Check("runs are named by a fingerprint of their configuration",
              same_config.fingerprint() == names[0] and names[0] != names[1],
              f"mlp1 -> {names[0]}, linear -> {names[1]}"),
        Check(f"pass 1: mlp1 stopped after step {kill_step} (a simulated kill); the plan says resume",
              statuses(first, 0) == ["killed"] and statuses(first, 1) == ["trained"]
              and plan_after_kill == {names[0]: f"resume: blocks at steps {expected_steps}",
                                      names[1]: "finished"},
              f"{plan_after_kill}"),
        Check("pass 2: mlp1 resumed from its last checkpoints, linear skipped",
              statuses(second, 0) == ["trained"] and statuses(second, 1) == ["skipped"]
              and resumed_from == sorted(set(expected_steps)),
              f"blocks resumed from steps {resumed_from}; linear {statuses(second, 1)}"),
        Check("afterwards the sweep plan skips every run",
              set(plan_after_all.values()) == {"finished"}, f"{plan_after_all}"),
        Check("killed + resumed == uninterrupted, bitwise (every block)",
              summaries["mlp1"]["block_sha256"] == fresh["block_sha256"],
              f"sha256 of block 0: {fresh['block_sha256'][0][:16]}... (same machine)"),
    ]
    teacher, _ = load_or_train_teacher(teacher_config, runs_dir)
    metrics = {"fingerprints": {run.kind: run.fingerprint() for run in runs},
               "block_losses": {k: v["block_losses"] for k, v in summaries.items()},
               "teacher": evaluate(teacher, teacher, teacher_config),
               "params_per_block": {"teacher": distillation.params_of(teacher.layers[0])},
               "teacher_block_forwards": distillation.teacher_block_forwards(layers, world)}
    for run in runs:
        student = resumable.load_student(run, runs_dir, teacher)
        metrics["params_per_block"][run.kind] = distillation.params_of(student.layers[0])
        metrics[f"stitched_{run.kind}"] = evaluate(student, teacher, teacher_config)
        metrics[f"blocks_{run.kind}"] = block_report(student, teacher, teacher_config)
    metrics["end_to_end_mlp1"] = evaluate(train_end_to_end(runs[0], teacher), teacher, teacher_config)
    losses = metrics["block_losses"]
    checks.append(Check("per-block losses reported for every block of every run",
                        all(len(v) == layers for v in losses.values()),
                        "; ".join(f"{k}: " + ", ".join(f"{x:.4f}" for x in v) for k, v in losses.items())))
    skip = metrics["blocks_mlp1"]["skip"]
    checks.append(Check("no-op baselines: skipping a block scores very differently by depth",
                        len(skip) < 2 or skip[0] > 5 * skip[-1],
                        "skip-the-block normalized MSE " + ", ".join(f"{x:.3f}" for x in skip)))
    stitched = metrics["stitched_mlp1"]
    checks.append(Check("stitched mlp1 student is closer to the teacher than the linear one (KL)",
                        stitched["kl"] < metrics["stitched_linear"]["kl"],
                        f"KL {stitched['kl']:.4f} vs {metrics['stitched_linear']['kl']:.4f}; "
                        f"end-to-end mlp1 KL {metrics['end_to_end_mlp1']['kl']:.4f}"))
    checks += export_checks(resumable.load_student(runs[0], runs_dir, teacher), teacher, teacher_config,
                            runs_dir / runs[0].fingerprint() / "student.safetensors", scratch, metrics)
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


def export_checks(student: nn.Module, teacher: nn.Module, teacher_config: TeacherConfig, path: Path,
                  scratch: Path, metrics: dict) -> list[Check]:
    size = resumable.export_student(student, path)
    from safetensors.torch import load_file
    reloaded = distillation.make_student(teacher, "mlp1", teacher_config)
    reloaded.load_state_dict(load_file(path))
    tokens = distillation.batches(teacher_config, 1, 2)[0][0]
    same = torch.equal(reloaded.eval()(tokens), student(tokens))
    payload = sum(t.numel() * t.element_size() for t in student.state_dict().values())
    metrics["export_bytes"] = size
    return [Check("export from the live student: size and round trip verified", same and size > payload,
                  f"{size:,} B = 8 + header + {payload:,} B of tensors; reloaded logits equal"),
            *broken_export_checks(student, scratch)]


# ============================================================================ the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Blockwise local distillation: per-block students trained in parallel, "
                           "resumable sweeps, stitched evaluation and a verified export.", world_size=2)
    parser.add_argument("--layers", type=int_in(1, 16), default=4, help="teacher blocks (default 4)")
    parser.add_argument("--steps", type=int_in(10, 100000), default=60,
                        help="training steps per student block (default 60)")
    parser.add_argument("--teacher-steps", type=int_in(1, 100000), default=100,
                        help="teacher training steps (default 100)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="keep the runs in a fresh directory under DIR (default: a temporary "
                             "directory, removed at the end); with torchrun on several nodes, DIR "
                             "must be on a filesystem every node shares")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        parser.error("--device cuda: this lesson trains its blocks on the CPU (no GPU path yet)")
    check_args(parser, args)
    if under_torchrun() and args.out is None and \
            os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]) != os.environ["WORLD_SIZE"]:
        parser.error("torchrun on several nodes: pass --out DIR on a filesystem every node shares")
    if args.quick:
        args.steps, args.teacher_steps = min(args.steps, 40), min(args.teacher_steps, 60)
    if args.steps < 2 * RunConfig.save_every:
        parser.error(f"--steps {args.steps} must be at least {2 * RunConfig.save_every} "
                     f"(two checkpoints of every {RunConfig.save_every} steps)")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    results = launch(demo_worker, args.world_size,
                     (None if args.out is None else str(args.out), args.layers, args.steps,
                      args.teacher_steps, args.fault, args.fault_rank),
                     device="cpu", timeout_s=args.timeout)
    result = results[0]
    checks = [Check(**c) for c in result["checks"]]
    metrics = result["metrics"]
    metrics["headline"] = (f"stitched KL to teacher: mlp1 {metrics['stitched_mlp1']['kl']:.4f}, "
                           f"linear {metrics['stitched_linear']['kl']:.4f}")
    return finish(Report(LESSON, "cpu", "gloo", len(results), checks, metrics), args.json, started)
