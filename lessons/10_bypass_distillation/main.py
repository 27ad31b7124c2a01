"""Lesson 10: blockwise local ("bypass") distillation, in parallel, resumable, verified.

The story, top to bottom:

1. A teacher: a small GPT (lesson 07's layers) trained on lesson 07's synthetic language.
2. Students whose blocks are cheaper: a block with a 1h MLP instead of 4h (initialised from the
   teacher's first channels), or a single linear layer. Each student block is trained ALONE to
   map the teacher's input of that block to the teacher's output of that block, with the
   normalized MSE sum((y - t)^2) / (sum(t^2) + eps); blocks are owned by different ranks and
   train in parallel; warmup + cosine LR.
3. Engineering from the production engine: every run is named by a fingerprint of its
   configuration; per-block checkpoints with an atomically updated `latest` pointer; a sweep
   skips finished runs, resumes unfinished ones, and a resumed run ends bitwise where an
   uninterrupted one ends.
4. The stitched student (teacher's embeddings and head, student blocks) is evaluated end to end
   against the teacher (loss, KL) and against the same student trained end to end on the
   teacher's logits for the same number of steps.
5. Export from the live modules with lesson 06's verified safetensors export (size and
   round trip), and the checks that catch a broken export (the 200-byte empty file).

Run: `python lessons/10_bypass_distillation/main.py` (runs in a temporary directory; the
functions `sweep`, `sweep_plan` and `load_student` work on any runs directory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn as nn
import torch.nn.functional as F

from lessons._launch import RankContext, inject_fault, launch, one_thread
from lessons._report import Check, Report, check_args, finish, int_in, lesson_parser, run_main

LESSON = "10_bypass_distillation"
MEMORY = importlib.import_module("lessons.07_memory.main")  # TinyGPT, TransformerLayer, data
CKPT = importlib.import_module("lessons.06_checkpointing.main")  # atomic writes, LR, export
EPS = 1e-8

# ============================================================================ 1. the teacher


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    vocab: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 32
    batch: int = 8
    steps: int = 100
    lr: float = 3e-3
    seed: int = 0


def fingerprint(config: dict) -> str:
    """A run's name: the first 16 hex digits of sha256 over its canonical JSON (sorted keys,
    no whitespace). Equal configurations get equal names on every machine."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_teacher(config: TeacherConfig) -> MEMORY.TinyGPT:
    torch.manual_seed(config.seed)
    return MEMORY.TinyGPT(config.vocab, config.hidden, config.heads, config.layers, config.seq, dropout=0.0)


def batches(config: TeacherConfig, steps: int, stream: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sentences of one synthetic language (lesson 07's, chosen by the seed): stream 0 trains
    the teacher, 1 the students, 2 is held out. A batch depends only on (seed, stream, step)."""
    return MEMORY.markov_batches(config.vocab, config.seq, config.batch, steps, config.seed,
                                 sample_seed=config.seed * 1000 + stream + 1)


def train_teacher(config: TeacherConfig) -> MEMORY.TinyGPT:
    teacher = make_teacher(config)
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=config.lr)
    for tokens, targets in batches(config, config.steps, 0):
        optimizer.zero_grad()
        teacher.loss(tokens, targets).backward()
        optimizer.step()
    return teacher.eval()


def load_or_train_teacher(config: TeacherConfig, teachers_dir: Path) -> tuple[MEMORY.TinyGPT, bool]:
    """The teacher is a run too: trained once per fingerprint, exported (verified), reused."""
    path = teachers_dir / f"teacher-{fingerprint(dataclasses.asdict(config))}.safetensors"
    if path.exists():
        from safetensors.torch import load_file
        teacher = make_teacher(config)
        teacher.load_state_dict(load_file(path))
        return teacher.eval(), True
    teacher = train_teacher(config)
    teachers_dir.mkdir(parents=True, exist_ok=True)
    CKPT.export_safetensors(teacher.state_dict(), path)
    return teacher, False


def embed(model: MEMORY.TinyGPT, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (b, s) -> the first block's input (s, b, h), exactly as TinyGPT.forward does."""
    return (model.embed(tokens) + model.pos.weight[: tokens.shape[1]]).transpose(0, 1)


@torch.no_grad()
def teacher_block_io(teacher: MEMORY.TinyGPT, tokens: torch.Tensor,
                     upto: int | None = None) -> list[torch.Tensor]:
    """The residual stream at the block boundaries: [input of block 0, output of block 0, ...,
    output of block `upto`] (default: every block)."""
    states = [embed(teacher, tokens)]
    for layer in teacher.layers[: None if upto is None else upto + 1]:
        states.append(layer(states[-1]))
    return states


# ============================================================================ 2. student blocks


class LinearBlock(nn.Module):
    """The cheapest replacement: x + W LN(x) (h^2 + 3h parameters instead of 12h^2 + 13h).
    W starts at zero, so the block starts as the identity (the residual stream passes)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


def make_student_block(kind: str, teacher_layer: MEMORY.TransformerLayer, hidden: int,
                       heads: int) -> nn.Module:
    """kind "mlp1": the teacher's attention and LayerNorms, its MLP cut from 4h to 1h channels
    (the first h of them, as Puzzle initialises a pruned child from its parent).
    kind "linear": LinearBlock."""
    if kind == "linear":
        return LinearBlock(hidden)
    if kind != "mlp1":
        raise ValueError(f"unknown student block kind {kind!r}: expected 'mlp1' or 'linear'")
    block = MEMORY.TransformerLayer(hidden, heads, dropout=0.0)
    block.load_state_dict({k: v for k, v in teacher_layer.state_dict().items()
                           if not k.startswith(("up.", "down."))}, strict=False)
    block.up, block.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
    with torch.no_grad():
        block.up.weight.copy_(teacher_layer.up.weight[:hidden])
        block.up.bias.copy_(teacher_layer.up.bias[:hidden])
        block.down.weight.copy_(teacher_layer.down.weight[:, :hidden])
        block.down.bias.copy_(teacher_layer.down.bias)
    return block


def make_student(teacher: MEMORY.TinyGPT, kind: str, teacher_config: TeacherConfig) -> MEMORY.TinyGPT:
    """A TinyGPT that shares (copies of) the teacher's embeddings, norm and head, with student
    blocks in place of the teacher's layers."""
    student = make_teacher(teacher_config)
    student.load_state_dict(teacher.state_dict())
    hidden, heads = teacher_config.hidden, teacher_config.heads
    student.layers = nn.ModuleList(make_student_block(kind, layer, hidden, heads) for layer in teacher.layers)
    return student


def initial_block(run: RunConfig, teacher: MEMORY.TinyGPT, index: int) -> nn.Module:
    """Student block `index` as every run starts it (blockwise or end to end): its own seed,
    so it does not depend on which rank builds it or in which order."""
    torch.manual_seed(run.teacher.seed * 100 + index)
    return make_student_block(run.kind, teacher.layers[index], run.teacher.hidden, run.teacher.heads)


def normalized_mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """sum((y - t)^2) / (sum(t^2) + eps): 0 is perfect, 1 is as bad as predicting zeros."""
    return (y - t).pow(2).sum() / (t.pow(2).sum() + EPS)


def params_of(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def teacher_block_params(hidden: int) -> int:
    """QKV 3h^2 + 3h, output h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h: 12h^2 + 13h."""
    return 12 * hidden ** 2 + 13 * hidden


def resume_step(killed_after: int, save_every: int) -> int:
    """The step a run killed after `killed_after` resumes from: its last checkpoint."""
    return (killed_after // save_every) * save_every


# ============================================================================ 3. runs, checkpoints


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One blockwise-distillation run: which student, how it is trained, and the teacher."""

    kind: str = "mlp1"
    steps: int = 60
    warmup: int = 6
    lr: float = 3e-3
    save_every: int = 20
    teacher: TeacherConfig = TeacherConfig()

    def fingerprint(self) -> str:
        return fingerprint(dataclasses.asdict(self))


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
    CKPT.atomic_write_bytes(directory / name, buffer.getvalue())
    CKPT.atomic_write_bytes(directory / "latest", name.encode())
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
        raise CKPT.CheckpointError(f"{pointer}: names {name!r}, which is not a checkpoint file here")
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise CKPT.CheckpointError(f"{path}: unreadable checkpoint ({exc})") from exc


def train_block(run: RunConfig, run_dir: Path, index: int, teacher: MEMORY.TinyGPT,
                stop_after: int | None = None, io_cache: dict | None = None) -> dict:
    """Train student block `index` on the teacher's input/output of that block, resuming from
    its latest checkpoint. stop_after: return right after that step without saving, as a
    killed process would (its progress since the last checkpoint is lost). io_cache: the
    teacher's block inputs/outputs by step, shared by the runs of one teacher on this rank."""
    directory = block_dir(run_dir, index)
    if (directory / "done.json").exists():
        return {"block": index, "status": "skipped", **json.loads((directory / "done.json").read_text())}
    block = initial_block(run, teacher, index)
    optimizer = torch.optim.AdamW(block.parameters(), lr=run.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CKPT.cosine_with_warmup(run.warmup, run.steps))
    state, start, losses = load_block(directory), 0, []
    if state is not None:
        block.load_state_dict(state["block"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start, losses = state["step"], list(state["losses"])
    data = batches(run.teacher, run.steps, 1)
    io_cache = {} if io_cache is None else io_cache
    teacher_name = fingerprint(dataclasses.asdict(run.teacher))
    for step in range(start, run.steps):
        key = (teacher_name, run.steps, step, index)
        if key not in io_cache:
            io_cache[key] = teacher_block_io(teacher, data[step][0], upto=index)
        states = io_cache[key]
        loss = normalized_mse(block(states[index]), states[index + 1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if stop_after is not None and step + 1 == stop_after:
            return {"block": index, "status": "killed", "step": step + 1, "resumed_from": start}
        if (step + 1) % run.save_every == 0 or step + 1 == run.steps:
            save_block(directory, step + 1, block, optimizer, scheduler, losses)
    summary = {"final_loss": sum(losses[-10:]) / len(losses[-10:]), "losses": losses,
               "sha256": tensor_digest(block.state_dict())}
    CKPT.atomic_write_bytes(directory / "done.json", json.dumps(summary).encode())
    return {"block": index, "status": "trained", "resumed_from": start, **summary}


def tensor_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name and bytes, in name order: equal iff bitwise equal."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def distill_worker(ctx: RankContext, jobs: list[dict], teachers_dir: str, fault: str | None,
                   fault_rank: int) -> list[dict]:
    """Every rank trains the blocks it owns (block i -> rank i mod world) of every job: a run
    (its configuration) in a runs directory, optionally killed after a step. A finished run
    (its done.json) is skipped whole. Plain results only."""
    inject_fault(ctx, fault, fault_rank)
    out, io_cache, teachers = [], {}, {}
    for job in jobs:
        spec = job["run"]
        run = RunConfig(**{**spec, "teacher": TeacherConfig(**spec["teacher"])})
        runs_dir = Path(job["runs_dir"])
        run_dir = runs_dir / run.fingerprint()
        if (run_dir / "done.json").exists():
            out.append({"fingerprint": run.fingerprint(), "status": "skipped", "blocks": []})
            continue
        if run.teacher not in teachers:  # read each teacher file once per rank
            teachers[run.teacher] = load_or_train_teacher(run.teacher, Path(teachers_dir))[0]
        teacher = teachers[run.teacher]
        blocks = [train_block(run, run_dir, index, teacher, job.get("stop_after"), io_cache)
                  for index in range(ctx.rank, run.teacher.layers, ctx.world_size)]
        for result in blocks:
            result.pop("losses", None)
        out.append({"fingerprint": run.fingerprint(), "status": "ran", "blocks": blocks})
    return out


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
            directory = block_dir(run_dir, index)
            state = None if (directory / "done.json").exists() else load_block(directory)
            steps.append(run.steps if (directory / "done.json").exists() else
                         (state["step"] if state is not None else 0))
        plan[run.fingerprint()] = f"resume: blocks at steps {steps}" if max(steps) > 0 else "new"
    return plan


def finish_runs(runs: list[RunConfig], runs_dir: Path) -> list[str]:
    """After the ranks: a run whose every block is done gets its own done.json (atomically)."""
    finished = []
    for run in runs:
        run_dir = runs_dir / run.fingerprint()
        done = [block_dir(run_dir, i) / "done.json" for i in range(run.teacher.layers)]
        if all(path.exists() for path in done) and not (run_dir / "done.json").exists():
            blocks = [json.loads(path.read_text()) for path in done]
            summary = {"config": dataclasses.asdict(run),
                       "block_losses": [b["final_loss"] for b in blocks],
                       "block_sha256": [b["sha256"] for b in blocks]}
            CKPT.atomic_write_bytes(run_dir / "done.json", json.dumps(summary, indent=1).encode())
            finished.append(run.fingerprint())
    return finished


def load_student(run: RunConfig, runs_dir: Path, teacher: MEMORY.TinyGPT) -> MEMORY.TinyGPT:
    """The stitched student: the teacher's embeddings and head, each block from its checkpoint."""
    student = make_student(teacher, run.kind, run.teacher)
    for index, layer in enumerate(student.layers):
        state = load_block(block_dir(runs_dir / run.fingerprint(), index))
        if state is None:
            raise CKPT.CheckpointError(f"{block_dir(runs_dir / run.fingerprint(), index)}: no checkpoint")
        layer.load_state_dict(state["block"])
    return student.eval()


# ============================================================================ 4. evaluation


@torch.no_grad()
def evaluate(model: MEMORY.TinyGPT, teacher: MEMORY.TinyGPT, config: TeacherConfig,
             n_batches: int = 8) -> dict:
    """Held-out next-token loss, and KL(teacher || model) per token, over stream 2."""
    loss = kl = 0.0
    for tokens, targets in batches(config, n_batches, 2):
        logits, reference = model(tokens), teacher(tokens)
        loss += float(F.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1)))
        kl += float(F.kl_div(F.log_softmax(logits, -1).reshape(-1, config.vocab),
                             F.log_softmax(reference, -1).reshape(-1, config.vocab),
                             log_target=True, reduction="batchmean"))
    return {"loss": loss / n_batches, "kl": kl / n_batches}


def train_end_to_end(run: RunConfig, teacher: MEMORY.TinyGPT) -> MEMORY.TinyGPT:
    """The baseline for the same compute: the same student, the same initialisation, the same
    number of steps and LR schedule, trained on the teacher's logits (KL) end to end."""
    student = make_teacher(run.teacher)
    student.load_state_dict(teacher.state_dict())
    student.layers = nn.ModuleList(initial_block(run, teacher, index)  # the blockwise runs' start
                                   for index in range(run.teacher.layers))
    for part in (student.embed, student.pos, student.norm):
        part.requires_grad_(False)  # blockwise training does not touch them either
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=run.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CKPT.cosine_with_warmup(run.warmup, run.steps))
    for tokens, _ in batches(run.teacher, run.steps, 1):
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


# ============================================================================ 5. export


def export_student(student: nn.Module, path: Path) -> int:
    """Export from the LIVE modules (not from a map filled elsewhere) with lesson 06's verified
    safetensors export: size = 8 + header + every tensor's bytes, and a round trip equal."""
    return CKPT.export_safetensors(dict(student.state_dict()), path)


def broken_export_checks(student: nn.Module, scratch: Path) -> list[Check]:
    """What catches the production failure (an empty map exported after 25 hours) and two
    cousins: a truncated file and an export taken before training."""
    from safetensors.torch import save
    live = {k: v.detach().contiguous() for k, v in student.state_dict().items()}
    refused, empty = scratch / "refused.safetensors", scratch / "empty.safetensors"
    truncated, stale = scratch / "truncated.safetensors", scratch / "stale.safetensors"
    empty.write_bytes(save({}))
    truncated.write_bytes(save(live)[:-100])
    stale.write_bytes(save({k: torch.zeros_like(v) for k, v in live.items()}))
    attempts = [("exporting an empty map is refused", refused, lambda: CKPT.export_safetensors({}, refused))]
    for label, path in (("an export holding no tensors", empty), ("a truncated file", truncated),
                        ("weights that are not the live ones", stale)):
        attempts.append((label, path, lambda path=path: CKPT.verify_export(live, path)))
    checks = []
    for label, path, attempt in attempts:
        try:
            attempt()
            message = "accepted"
        except CKPT.CheckpointError as exc:
            message = str(exc)
        checks.append(Check(f"broken export caught: {label}", message.startswith(str(path)), message))
    return checks


# ============================================================================ the demo


def sweep(jobs: list[tuple[Path, RunConfig, int | None]], teachers_dir: Path, world: int,
          timeout: float, fault: str | None = None, fault_rank: int = 0) -> list[list[dict]]:
    """One pass over (runs directory, run, kill step or None) jobs on `world` ranks; then every
    run whose blocks are all done is marked done. Returns every rank's results."""
    for _, run, _ in jobs:  # train (or find) each teacher once, here, not on every rank
        load_or_train_teacher(run.teacher, teachers_dir)
    specs = [{"runs_dir": str(runs_dir), "run": dataclasses.asdict(run), "stop_after": stop}
             for runs_dir, run, stop in jobs]
    per_rank = launch(distill_worker, world, (specs, str(teachers_dir), fault, fault_rank),
                      device="cpu", timeout_s=timeout)
    for runs_dir, run, _ in jobs:
        finish_runs([run], runs_dir)
    return per_rank


def statuses(per_rank: list[list[dict]], job: int) -> list[str]:
    """The distinct statuses of one job's blocks over every rank."""
    return sorted({block["status"] for rank in per_rank for block in rank[job]["blocks"]}
                  or {per_rank[0][job]["status"]})


def demo(args, runs_dir: Path, scratch: Path) -> tuple[list[Check], dict]:
    teacher_config = TeacherConfig(layers=args.layers, steps=args.teacher_steps)
    runs = [RunConfig(kind=kind, steps=args.steps, teacher=teacher_config) for kind in ("mlp1", "linear")]
    kill_step = args.steps // 2 + 5  # between two checkpoints: the work since the last is lost
    fresh_dir = scratch / "uninterrupted"
    first = sweep([(runs_dir, runs[0], kill_step), (runs_dir, runs[1], None), (fresh_dir, runs[0], None)],
                  runs_dir, args.world_size, args.timeout, args.fault, args.fault_rank)
    plan_after_kill = sweep_plan(runs, runs_dir)
    second = sweep([(runs_dir, run, None) for run in runs], runs_dir, args.world_size, args.timeout)
    plan_after_all = sweep_plan(runs, runs_dir)
    resumed_from = sorted({b["resumed_from"] for rank in second for b in rank[0]["blocks"]})
    last_save = resume_step(kill_step, RunConfig.save_every)
    summaries = {run.kind: json.loads((runs_dir / run.fingerprint() / "done.json").read_text())
                 for run in runs}
    fresh = json.loads((fresh_dir / runs[0].fingerprint() / "done.json").read_text())
    names = [run.fingerprint() for run in runs]
    same_config = RunConfig(**{**dataclasses.asdict(runs[0]), "teacher": teacher_config})
    checks = [
        Check("runs are named by a fingerprint of their configuration",
              same_config.fingerprint() == names[0] and names[0] != names[1],
              f"mlp1 -> {names[0]}, linear -> {names[1]}"),
        Check(f"pass 1: mlp1 killed after step {kill_step}; the sweep plan then says resume",
              statuses(first, 0) == ["killed"] and statuses(first, 1) == ["trained"]
              and plan_after_kill == {names[0]: f"resume: blocks at steps {[last_save] * args.layers}",
                                      names[1]: "finished"},
              f"{plan_after_kill}"),
        Check("pass 2: mlp1 resumed from its last checkpoint, linear skipped",
              statuses(second, 0) == ["trained"] and statuses(second, 1) == ["skipped"]
              and resumed_from == [last_save],
              f"resumed from step {resumed_from}; linear {statuses(second, 1)}"),
        Check("afterwards the sweep plan skips every run",
              set(plan_after_all.values()) == {"finished"}, f"{plan_after_all}"),
        Check("killed + resumed == uninterrupted, bitwise (every block)",
              summaries["mlp1"]["block_sha256"] == fresh["block_sha256"],
              f"sha256 of block 0: {fresh['block_sha256'][0][:16]}..."),
    ]
    teacher, _ = load_or_train_teacher(teacher_config, runs_dir)
    metrics = {"fingerprints": {run.kind: run.fingerprint() for run in runs},
               "block_losses": {k: v["block_losses"] for k, v in summaries.items()},
               "teacher": evaluate(teacher, teacher, teacher_config),
               "params_per_block": {"teacher": params_of(teacher.layers[0])}}
    for run in runs:
        student = load_student(run, runs_dir, teacher)
        metrics["params_per_block"][run.kind] = params_of(student.layers[0])
        metrics[f"stitched_{run.kind}"] = evaluate(student, teacher, teacher_config)
    end_to_end = train_end_to_end(runs[0], teacher)
    metrics["end_to_end_mlp1"] = evaluate(end_to_end, teacher, teacher_config)
    losses = metrics["block_losses"]
    checks.append(Check("per-block losses reported for every block of every run",
                        all(len(v) == teacher_config.layers for v in losses.values()),
                        "; ".join(f"{k}: " + ", ".join(f"{x:.4f}" for x in v) for k, v in losses.items())))
    stitched = metrics["stitched_mlp1"]
    checks.append(Check("stitched mlp1 student is closer to the teacher than the linear one (KL)",
                        stitched["kl"] < metrics["stitched_linear"]["kl"],
                        f"KL {stitched['kl']:.4f} vs {metrics['stitched_linear']['kl']:.4f}; "
                        f"end-to-end mlp1 KL {metrics['end_to_end_mlp1']['kl']:.4f}"))
    student = load_student(runs[0], runs_dir, teacher)
    path = runs_dir / runs[0].fingerprint() / "student.safetensors"
    size = export_student(student, path)
    from safetensors.torch import load_file
    reloaded = make_student(teacher, "mlp1", teacher_config)
    reloaded.load_state_dict(load_file(path))
    tokens = batches(teacher_config, 1, 2)[0][0]
    same = torch.equal(reloaded.eval()(tokens), student(tokens))
    payload = sum(t.numel() * t.element_size() for t in student.state_dict().values())
    checks.append(Check("export from the live student: size and round trip verified",
                        same and size > payload,
                        f"{size:,} B = 8 + header + {payload:,} B of tensors; reloaded logits equal"))
    checks += broken_export_checks(student, scratch)
    metrics["export_bytes"] = size
    return checks, metrics


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Blockwise local distillation: per-block students trained in parallel, "
                           "resumable sweeps, stitched evaluation and a verified export.", world_size=2)
    parser.add_argument("--layers", type=int_in(1, 16), default=4, help="teacher blocks (default 4)")
    parser.add_argument("--steps", type=int_in(10, 100000), default=60,
                        help="training steps per student block (default 60)")
    parser.add_argument("--teacher-steps", type=int_in(1, 100000), default=100,
                        help="teacher training steps (default 100)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        parser.error("--device cuda: this demo runs on the CPU (each rank trains its blocks on the CPU here)")
    check_args(parser, args)
    if args.quick:
        args.steps, args.teacher_steps = min(args.steps, 40), min(args.teacher_steps, 60)
    if args.steps < 2 * RunConfig.save_every:
        parser.error(f"--steps {args.steps} must be at least {2 * RunConfig.save_every} "
                     f"(two checkpoints of every {RunConfig.save_every} steps)")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="bld-"))  # the demo replays a kill: always fresh
    try:
        with one_thread():  # the teacher and the evaluation give the same numbers everywhere
            checks, metrics = demo(args, scratch / "runs", scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    metrics["headline"] = (f"stitched KL to teacher: mlp1 {metrics['stitched_mlp1']['kl']:.4f}, "
                           f"linear {metrics['stitched_linear']['kl']:.4f}")
    return finish(Report(LESSON, "cpu", "gloo", args.world_size, checks, metrics), args.json, started)


if __name__ == "__main__":
    run_main(main)
