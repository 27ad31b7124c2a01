"""Lesson 13's harness: the run as a learner launches it, and the proof that it is right.

* `train_worker`: one rank's run of main.py's technique with the harness's extras: fault
  injection, a progress bar on rank 0, a real SIGKILL at --kill-at-step, the weights' digest,
  a text sample;
* the demo's checks: the shipped corpus, every rank ends with the same weights, the held-out
  loss fell, and a run resumed from the middle checkpoint ends bit for bit where the
  uninterrupted one did (two runs on the same machine: see the README on other CPUs);
* the MFU metric (null and a one-line warning on a GPU the peak table lacks), the loss plot
  and the CLI.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from lessons._checks import tensor_digest
from lessons._launch import RankContext, inject_fault, is_reporting_rank, launch, under_torchrun
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

from . import flops, nd, nd_checks, nd_model, planner_checks
from . import main as capstone

checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # lesson 06's technique

LESSON = "13_capstone"


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def sample(model: torch.nn.Module, tokenizer: capstone.CharTokenizer, prompt: str, chars: int,
           seq: int, seed: int, temperature: float = 0.8) -> str:
    """Continue `prompt` one character at a time (a fixed generator: the same text each run
    on one machine)."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt).tolist()
    for _ in range(chars):
        logits = model(torch.tensor([ids[-seq:]], device=device))[0, -1].float().cpu() / temperature
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    model.train()
    return tokenizer.decode(ids)


class ProgressBar:
    """A rich progress bar on rank 0 in a terminal; nothing otherwise."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=start, loss="-")

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False

    def advance(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=f"{loss:.3f}")


def train_worker(ctx: RankContext, config: dict, layout: dict | None, ckpt_dir: str, save_every: int,
                 keep: int, resume: bool, reshard: bool, kill_at: int | None, sample_chars: int,
                 fault: str | None, fault_rank: int) -> dict:
    """One rank: load and split the corpus (90% train), build a GPTTrainer (data parallel) or,
    given a `layout`, nd_checks.CorpusNDTrainer (DP x TP x PP x CP), resume if asked, train with
    checkpoints, and return plain data (rank 0 adds the curves and a sample)."""
    inject_fault(ctx, fault, fault_rank)
    config = capstone.GPTRunConfig(**config)
    text = capstone.load_text()
    tokenizer = capstone.CharTokenizer(text)
    data = tokenizer.encode(text)
    split = int(0.9 * data.numel())
    vocab = len(tokenizer.chars)
    trainer = (capstone.GPTTrainer(config, ctx.rank, ctx.world_size, ctx.device, vocab) if layout is None
               else nd_checks.CorpusNDTrainer(config, nd.Layout(**layout), ctx.device, vocab))
    resumed_from = capstone.resume(trainer, Path(ckpt_dir), reshard) if resume else None
    checkpointer = checkpointing.Checkpointer(Path(ckpt_dir), keep=keep, save_every=save_every)
    bar = ProgressBar(ctx.rank == 0 and sys.stdout.isatty(), config.steps, trainer.step)

    def after_step(trainer: capstone.GPTTrainer, loss: float) -> None:
        bar.advance(loss)
        if kill_at is not None and trainer.step == kill_at and ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # as an OOM killer or a node failure would

    with bar:
        run = capstone.train(trainer, data[:split], data[split:], checkpointer, after_step)
    if layout is None:
        model, n_matmul = trainer.model, flops.matmul_params(trainer.model)
        replica = {"key": "all", "sha256": tensor_digest(dict(trainer.named))}
    else:  # the ranks that differ only in dp or cp hold the same stage weights
        model = trainer.dense_model()
        n_matmul = count_params(model) - model.pos.weight.numel() - model.embed.weight.numel()
        replica = {"key": f"pp{trainer.coords['pp']} tp{trainer.coords['tp']}",
                   "sha256": tensor_digest(dict(trainer.stage.named_parameters()))}
    result = {"rank": ctx.rank, "param_sha256": tensor_digest(dict(model.named_parameters())),
              "replica": replica, "resumed_from": resumed_from}
    if layout is not None and ctx.rank == 0:  # the same model trained by one process
        result["one_process"] = nd_checks.one_process_gap(trainer, model, data[:split])
    if ctx.rank == 0:
        per_token = flops.flops_per_token(n_matmul, config.layers, config.hidden, config.seq)
        on_gpu = ctx.device.type == "cuda"
        result.update(run, params=count_params(model), vocab=vocab,
                      flops_per_token=per_token,
                      device_name=torch.cuda.get_device_name(ctx.device) if on_gpu else "cpu",
                      sample=sample(model, tokenizer, "MARCIUS:\n", sample_chars, config.seq,
                                    config.seed) if sample_chars else "")
    return result


def accumulation_worker(ctx: RankContext, accum: int, clips: tuple[float, ...]) -> dict[float, dict]:
    """One rank of the tests' multi-rank check of main.accumulation_step, once per clip norm
    in `clips` (one launch for all): {clip: accumulation_check(ctx, accum, clip)}."""
    return {clip: accumulation_check(ctx, accum, clip) for clip in clips}


def accumulation_check(ctx: RankContext, accum: int, clip: float) -> dict:
    """Lesson 02's BucketedDDP over every rank (a fresh model from the same seed), this rank's
    rows of a global batch of world x accum x 2 sequences (float64, SGD(lr=1): the update is
    the gradient), and the step of the whole batch in one process, computed here too. Returns
    {"weights": max |ours - one process|, "moved": max |update|, "loss": what the step
    returned, "expected_loss": the mean of this rank's micro-batches' losses}."""
    torch.manual_seed(0)
    model = capstone.tiny_gpt.TinyGPT(13, 12, 3, 1, 7, dropout=0.0).double()  # sizes 3 does not divide
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(5)
    rows = ctx.world_size * accum * 2
    tokens = torch.randint(0, 13, (rows, 7), generator=generator)  # every row differs
    targets = torch.randint(0, 13, (rows, 7), generator=generator)

    def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = net(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    mine = list(zip(tokens.chunk(ctx.world_size)[ctx.rank].chunk(accum),
                    targets.chunk(ctx.world_size)[ctx.rank].chunk(accum)))
    with torch.no_grad():
        expected_loss = sum(float(loss_of(reference, x, y)) for x, y in mine) / accum
    loss_of(reference, tokens, targets).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    with torch.no_grad():
        for param in reference.parameters():
            param -= param.grad
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = capstone.data_parallel.BucketedDDP(model, bucket_cap_mb=2048 / 2**20)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loss = capstone.accumulation_step(ddp, model, optimizer, scheduler, mine, clip)
    state, theirs = model.state_dict(), reference.state_dict()
    return {"weights": max(float((state[k] - theirs[k]).abs().max()) for k in state),
            "moved": max(float((state[k] - start[k]).abs().max()) for k in state),
            "loss": float(loss), "expected_loss": expected_loss}


def mfu_metric(tokens_per_s: float | None, per_token: int, world: int,
               device_name: str) -> tuple[float | None, str | None]:
    """(MFU, warning): MFU against the peak table on a listed GPU; None on CPU (no warning:
    there is no peak to divide by) and None with a one-line warning naming any other device."""
    peak = flops.peak_flops_for(device_name)
    warning = None
    if peak is None and device_name != "cpu":
        warning = (f"warning: no datasheet peak for {device_name!r} in DEVICE_PEAK_FLOPS: MFU is "
                   "null (add the device's dense bf16 peak, with its source, to report one)")
    if tokens_per_s is None:
        return None, warning
    return flops.mfu(tokens_per_s, per_token, world, peak), warning


def plot_losses(result: dict, path: Path) -> None:
    """Training loss (mean over ranks) per step and held-out loss, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    steps, losses = zip(*result["losses"])
    ax.plot(steps, losses, label="train (mean over ranks)")
    val_steps, val = zip(*result["val_losses"])
    ax.plot(val_steps, val, "o-", label="held out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("A character-level GPT trained with data parallelism, accumulation, "
                           "clipping, sharded checkpoints and exact resume; with --dp/--tp/--pp/--cp "
                           "on one DeviceMesh (nd.py); --plan lists the layouts that fit a cluster.",
                           world_size=2)
    defaults = capstone.GPTRunConfig()
    parser.add_argument("--steps", type=int_in(2, 10**7), default=defaults.steps,
                        help=f"optimizer steps (default {defaults.steps})")
    parser.add_argument("--layers", type=int_in(1, 64), default=defaults.layers)
    parser.add_argument("--hidden", type=int_in(8, 8192), default=defaults.hidden)
    parser.add_argument("--heads", type=int_in(1, 128), default=defaults.heads)
    parser.add_argument("--seq", type=int_in(2, 4096), default=defaults.seq, help="context (characters)")
    parser.add_argument("--global-batch", type=int_in(1), default=defaults.global_batch,
                        help="sequences per optimizer step over all ranks")
    parser.add_argument("--accum", type=int_in(1, 1024), default=defaults.accum,
                        help="micro-batches per rank per step (gradient accumulation)")
    parser.add_argument("--lr", type=float_in(1e-7, 10.0), default=defaults.lr)
    parser.add_argument("--warmup", type=int_in(0), default=defaults.warmup)
    parser.add_argument("--clip", type=float_in(1e-6, 1e6), default=defaults.clip,
                        help="max global gradient norm")
    parser.add_argument("--weight-decay", type=float_in(0.0, 1.0), default=defaults.weight_decay,
                        help="AdamW's decoupled decay of the 2-D tensors")
    parser.add_argument("--dropout", type=float_in(0.0, 0.9), default=defaults.dropout)
    parser.add_argument("--ddp", choices=("ours", "torch"), default=defaults.ddp,
                        help="the data-parallel run's engine: lesson 02's BucketedDDP or torch's "
                             "DistributedDataParallel")
    for dim, what in (("dp", "data parallel (ZeRO-1)"), ("tp", "tensor + sequence parallel"),
                      ("pp", "pipeline stages (1F1B)"), ("cp", "context parallel (ring attention)")):
        parser.add_argument(f"--{dim}", type=int_in(1, 64), default=None,
                            help=f"N-D run (nd.py): {what} degree; dp x tp x pp x cp ranks in all")
    parser.add_argument("--out", type=Path, default=None,
                        help="checkpoints, loss.png and metrics go here (default: a new temporary "
                             "directory, printed)")
    parser.add_argument("--save-every", type=int_in(1), default=None,
                        help="checkpoint every N steps (default: steps / 2)")
    parser.add_argument("--keep", type=int_in(1), default=2, help="checkpoints kept (default 2)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    parser.add_argument("--reshard", action="store_true",
                        help="allow resuming on a different number of ranks")
    parser.add_argument("--kill-at-step", type=int_in(1), default=None,
                        help="rank 0 SIGKILLs itself after this step (to try --resume)")
    parser.add_argument("--sample-chars", type=int_in(0, 100000), default=200)
    parser.add_argument("--no-resume-check", action="store_true",
                        help="skip the demo's check that resuming from the middle is bit-exact")
    planner_checks.add_plan_arguments(parser)
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.simulate and not args.plan:
        parser.error("--simulate checks the planner's layouts: use it with --plan")
    if args.plan:  # the planner prints and exits: no run to check
        try:
            args.plan_text = planner_checks.plan_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        return args
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    args.layout = layout_from(parser, args)
    world = world_size_of(args)
    if args.layout is not None:  # the batch splits over the data-parallel replicas only
        world = args.layout.dp
    try:
        capstone.micro_batch_size(args.global_batch, world, args.accum)
    except ValueError as exc:
        parser.error(f"--global-batch {args.global_batch}: {exc} (--accum {args.accum})")
    if args.out is None and (args.resume or args.kill_at_step is not None or under_torchrun()):
        parser.error("--out is required with --resume, --kill-at-step and under torchrun (every rank "
                     "must write its shard to the same directory)")
    if args.quick:
        args.steps = min(args.steps, 40)
    if args.save_every is None:
        args.save_every = max(1, args.steps // 2)
    return args


def layout_from(parser, args) -> nd.Layout | None:
    """The N-D layout the flags ask for (None: the data-parallel run), checked against the
    model and the world size with one line each; sets args.world_size to its ranks."""
    if all(getattr(args, dim) is None for dim in ("dp", "tp", "pp", "cp")):
        return None
    layout = nd.Layout(**{dim: getattr(args, dim) or 1 for dim in ("dp", "tp", "pp", "cp")})
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != layout.world:
        parser.error(f"layout {layout} needs {layout.world} ranks; torchrun started "
                     f"{os.environ['WORLD_SIZE']}")
    try:
        nd.check_layout(nd_config(args), layout)  # heads = --heads, microbatches = --accum, ...
    except ValueError as exc:
        parser.error(str(exc))
    if args.ddp != "ours":
        parser.error(f"--ddp {args.ddp} picks the data-parallel run's engine; the N-D run is nd.py's")
    args.world_size, args.dropout = layout.world, 0.0  # the layout sets the ranks; no dropout in N-D
    return layout


def nd_config(args):
    """The N-D model and run the flags describe (nd_model.GPTConfig; vocabulary: the corpus's)."""
    return nd_model.GPTConfig(
        hidden=args.hidden, heads=args.heads, layers=args.layers, seq=args.seq,
        global_batch=args.global_batch, microbatches=args.accum, steps=args.steps)


def config_from(args) -> capstone.GPTRunConfig:
    return capstone.GPTRunConfig(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
        global_batch=args.global_batch, accum=args.accum, steps=args.steps, lr=args.lr,
        warmup=args.warmup, clip=args.clip, weight_decay=args.weight_decay, dropout=args.dropout,
        seed=args.seed, ddp=args.ddp)


def run(args, config: capstone.GPTRunConfig, ckpt: Path, resume: bool, kill_at: int | None,
        sample_chars: int) -> list[dict]:
    layout = None if args.layout is None else dataclasses.asdict(args.layout)
    return launch(train_worker, args.world_size,
                  (dataclasses.asdict(config), layout, str(ckpt), args.save_every, args.keep, resume,
                   args.reshard, kill_at, sample_chars, args.fault, args.fault_rank),
                  device=args.device, timeout_s=max(args.timeout, 600.0))


def resume_from_middle(args, config: capstone.GPTRunConfig, ckpt: Path, scratch: Path) -> list[dict]:
    """Copy the checkpoints, point `latest` at the oldest kept one, resume to the end."""
    copy = scratch / "resume-check"
    shutil.copytree(ckpt, copy)
    middle = checkpointing.committed_steps(copy)[0]
    checkpointing.atomic_write_bytes(copy / checkpointing.LATEST,
                                     (checkpointing.step_dir_name(middle) + "\n").encode())
    return run(args, config, copy, True, None, 0)


def why_no_resume_check(args, device_name: str, ckpt: Path) -> str | None:
    """Why the demo cannot check a bitwise resume here (None: it can)."""
    if args.resume or args.no_resume_check:
        return "skipped: " + ("--resume" if args.resume else "--no-resume-check")
    if under_torchrun():
        return "skipped under torchrun (the check launches a second run; try --resume yourself)"
    if device_name != "cpu":
        return "skipped on CUDA (atomics-based kernels are not bitwise deterministic)"
    if len(checkpointing.committed_steps(ckpt)) < 2:
        return "skipped: fewer than 2 checkpoints kept"
    return None


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.plan:  # the plan, and with --simulate its layouts run on fake tensors
        return planner_checks.plan_main(args)
    config = config_from(args)
    scratch = Path(tempfile.mkdtemp(prefix="capstone-"))
    out = args.out if args.out is not None else scratch / "out"
    ckpt = out / "checkpoints"
    if not args.resume and ckpt.exists() and any(ckpt.iterdir()):
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"error: {ckpt} already holds checkpoints: pass --resume to continue them, or "
              "choose another --out", file=sys.stderr)
        return 2
    ckpt.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args, config, ckpt, args.resume, args.kill_at_step, args.sample_chars)
        first = results[0]
        checks = [Check("corpus verified (sha256 of the shipped text)", True,
                        f"{capstone.DATA.name}: {capstone.DATA.stat().st_size:,} bytes, "
                        f"{first['vocab']} characters")]
        replicas: dict[str, set] = {}
        for r in results:
            replicas.setdefault(r["replica"]["key"], set()).add(r["replica"]["sha256"])
        checks.append(Check("every rank ends with the same weights" if args.layout is None else
                            "the dp and cp replicas of each stage and tp piece end equal",
                            all(len(d) == 1 for d in replicas.values()),
                            f"{len(results)} rank(s) in {len(replicas)} group(s)"
                            + (f", layout {args.layout}" if args.layout else "")))
        start_val, end_val = first["val_losses"][0][1], first["val_losses"][-1][1]
        checks.append(Check("held-out loss went down", end_val < start_val - 0.3,
                            f"{start_val:.3f} -> {end_val:.3f} nats/char (uniform: "
                            f"{math.log(first['vocab']):.3f})"))
        gap = first.get("one_process")
        if gap is not None and gap["passed"] is not None:
            checks.append(Check(f"layout {args.layout} == one process (same model and batches)",
                                gap["passed"], gap["detail"]))
        resume_check = why_no_resume_check(args, first["device_name"], ckpt)
        if resume_check is None:
            resumed = resume_from_middle(args, config, ckpt, scratch)
            same = resumed[0]["param_sha256"] == first["param_sha256"]
            checks.append(Check("resume from the middle checkpoint == the uninterrupted run (bitwise)",
                                same, f"resumed at step {resumed[0]['resumed_from']} of {config.steps}: "
                                      f"{resumed[0]['param_sha256'][:16]}..."))
            resume_check = f"bitwise from step {resumed[0]['resumed_from']}"
        mfu, warning = mfu_metric(first["tokens_per_s"], first["flops_per_token"], len(results),
                                  first["device_name"])
        if is_reporting_rank():
            if warning:
                print(warning, file=sys.stderr)
            plot_losses(first, out / "loss.png")
            print(f"loss curve: {out / 'loss.png'}\n--- sample ---\n{first['sample']}\n--------------")
        metrics = {
            "final_param_sha256": first["param_sha256"], "tokens_per_s": first["tokens_per_s"],
            "mfu": mfu, "device_name": first["device_name"], "params": first["params"],
            "flops_per_token": first["flops_per_token"], "final_train_loss": first["losses"][-1][1]
            if first["losses"] else None, "final_val_loss": end_val, "val_losses": first["val_losses"],
            "resumed_from": first["resumed_from"], "resume_check": resume_check,
            "config": dataclasses.asdict(config), "out": str(out), "sample": first["sample"],
            "layout": None if args.layout is None else dataclasses.asdict(args.layout),
            "one_process": first.get("one_process"),
            "headline": f"held-out {start_val:.3f} -> {end_val:.3f} nats/char; "
                        f"{first['tokens_per_s'] or 0:,.0f} tokens/s"}
        device = first["device_name"]
        return finish(Report(LESSON, device, "nccl" if device != "cpu" else "gloo", len(results), checks,
                             metrics), args.json, started)
    finally:
        if args.out is None:
            # keep the loss curve where the learner can see it; drop the checkpoints
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(scratch / "resume-check", ignore_errors=True)
        else:  # everything kept is under --out: the scratch folder goes
            shutil.rmtree(scratch, ignore_errors=True)
