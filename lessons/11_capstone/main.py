"""Lesson 11, the capstone: a character-level GPT trained end to end with data parallelism.

Everything the course built, in one training run:

* the model: lesson 07's causal transformer layers in its TinyGPT (tied embeddings);
* data parallelism: lesson 02's BucketedDDP ("ours") or torch's DistributedDataParallel;
* gradient accumulation with no_sync, gradient clipping, AdamW, warmup + cosine LR (lesson 06's);
* bf16 autocast on a GPU (lesson 07);
* sharded checkpoints with lesson 06's Checkpointer and verified load (imported, not copied):
  each rank saves 1/p of the parameters and AdamW states, so resuming on another number of
  ranks works with --reshard and is refused without it;
* a progress bar on rank 0, a loss-curve PNG, tokens/s and MFU (6N + attention FLOPs against a
  table of device peaks; null on CPU), and a text sample at the end.

Run: `python lessons/11_capstone/main.py` (2 CPU ranks, a quick run), or on one GPU node
`torchrun --standalone --nproc-per-node=8 lessons/11_capstone/main.py --steps 2000 --out runs/gpt`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._launch import RankContext, inject_fault, is_reporting_rank, launch, under_torchrun
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    lesson_parser,
    run_main,
)

LESSON = "11_capstone"
MEMORY = importlib.import_module("lessons.07_memory.main")  # TinyGPT (causal layers)
DP = importlib.import_module("lessons.02_data_parallel.main")  # BucketedDDP
ZERO = importlib.import_module("lessons.03_zero.main")  # shard_bounds
CKPT = importlib.import_module("lessons.06_checkpointing.main")  # Checkpointer, verified load
DATA = Path(__file__).resolve().with_name("data") / "coriolanus.txt"
DATA_SHA256 = "2d9f15c52ff3588f742907c5889b11d3458bc47d44bde2e1f3cb6f8c9aa24169"

# Dense bf16 tensor-core peaks in FLOP/s, by a substring of torch.cuda.get_device_name().
DEVICE_PEAK_FLOPS = {
    "H100 80GB HBM3": 989e12,  # H100 SXM
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
}

# ============================================================================ 1. data


def load_text(path: Path = DATA, sha256: str | None = DATA_SHA256) -> str:
    """The corpus, refused unless its bytes are the ones the course ships."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (it is shipped in the repository)")
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{path}: sha256 {hashlib.sha256(data).hexdigest()[:16]}... is not the "
                         f"shipped file's {sha256[:16]}... (edited or corrupt)")
    return data.decode("utf-8")


class CharTokenizer:
    """Characters <-> integers: the sorted set of characters in the corpus."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; its fingerprint marks its checkpoints as its own.
    The global batch is fixed: each rank's micro-batch is global / (ranks x accumulation)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 64
    global_batch: int = 16  # sequences per optimizer step, over all ranks and micro-batches
    accum: int = 2  # micro-batches per rank per step
    steps: int = 80
    lr: float = 1e-2
    warmup: int = 8
    clip: float = 1.0
    weight_decay: float = 0.01
    dropout: float = 0.1
    seed: int = 0
    dp: str = "ours"

    def fingerprint(self) -> str:
        return CKPT.sha256_hex(json.dumps(dataclasses.asdict(self), sort_keys=True).encode())[:16]

    def micro_batch(self, world: int) -> int:
        return micro_batch_size(self.global_batch, world, self.accum)


def micro_batch_size(global_batch: int, world: int, accum: int) -> int:
    """Sequences in one rank's micro-batch: global_batch / (ranks x accumulation steps)."""
    if global_batch % (world * accum):
        raise ValueError(f"global batch {global_batch} is not divisible by {world} ranks x "
                         f"{accum} micro-batches")
    return global_batch // (world * accum)


def batch_for_step(data: torch.Tensor, config: RunConfig, step: int, rank: int, world: int,
                   micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `micro` of rank `rank` at `step`: the step's global batch of random windows
    (a generator seeded by (seed, step): the data cursor IS the step number) split over ranks,
    then over micro-batches. Same global batch for any number of ranks."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - config.seq - 1, (config.global_batch,), generator=generator)
    size = config.micro_batch(world)
    mine = starts[(rank * config.accum + micro) * size:(rank * config.accum + micro + 1) * size]
    windows = torch.stack([data[s:s + config.seq + 1] for s in mine.tolist()])
    return windows[:, :-1], windows[:, 1:]


# ============================================================================ 2. FLOPs and MFU


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(n_params: int, layers: int, hidden: int, seq: int) -> int:
    """Training FLOPs per token (PaLM, appendix B): 6N for the weight matmuls, forward and
    backward, plus 12 L H Q T for attention scores and values (H Q = hidden, T = seq)."""
    return 6 * n_params + 12 * layers * hidden * seq


def matmul_params(model: MEMORY.TinyGPT) -> int:
    """N for 6N: every parameter but the position table (an add, not a matmul); the tied
    token embedding counts once, for the output head's matmul."""
    return count_params(model) - model.pos.weight.numel()


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DEVICE_PEAK_FLOPS.items() if key in name), None)


def mfu(tokens_per_s: float, per_token: int, world: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the ranks' combined peak."""
    return None if peak is None else tokens_per_s * per_token / (world * peak)


# ============================================================================ 3. the trainer


class Trainer:
    """A rank's model, optimizer, schedule and state; its shard_state / load_shards are the
    interface lesson 06's Checkpointer and verified load work with."""

    def __init__(self, config: RunConfig, ctx: RankContext, vocab: int) -> None:
        self.config, self.rank, self.world, self.device = config, ctx.rank, ctx.world_size, ctx.device
        torch.manual_seed(config.seed)  # the same initial weights on every rank
        self.model = MEMORY.TinyGPT(vocab, config.hidden, config.heads, config.layers, config.seq,
                                    dropout=config.dropout).to(ctx.device)
        if config.dp == "ours":
            self.wrapped = DP.BucketedDDP(self.model)
        elif config.dp == "torch":
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        else:
            raise ValueError(f"unknown data parallelism {config.dp!r}: 'ours' or 'torch'")
        self.named = list(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, CKPT.cosine_with_warmup(config.warmup, config.steps))
        self.step = 0
        torch.manual_seed(config.seed * 7 + ctx.rank)  # dropout: a different stream per rank

    def train_step(self, data: torch.Tensor) -> float:
        """One optimizer step: `accum` micro-batches (all but the last under no_sync), clip,
        AdamW, LR schedule. Returns the loss averaged over micro-batches and ranks."""
        total = torch.zeros((), device=self.device)
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                    else contextlib.nullcontext())
        for micro in range(self.config.accum):
            tokens, targets = (t.to(self.device) for t in
                               batch_for_step(data, self.config, self.step, self.rank, self.world, micro))
            sync = contextlib.nullcontext() if micro == self.config.accum - 1 else self.wrapped.no_sync()
            with sync:
                with autocast:
                    logits = self.wrapped(tokens)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
                (loss / self.config.accum).backward()
            total += loss.detach() / self.config.accum
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        dist.all_reduce(total)
        return float(total) / self.world

    # ------------------------------------------------------------- what a checkpoint holds
    def shard_state(self) -> dict:
        """1/p of every parameter and AdamW state (ZERO.shard_bounds slices of the flattened
        tensors), the replicated small state, and this rank's RNG states."""
        params, exp_avg, exp_avg_sq, adam_step = {}, {}, {}, {}
        for name, param in self.named:
            start, end = ZERO.shard_bounds(param.numel(), self.world, self.rank)
            params[name] = param.detach().reshape(-1)[start:end].cpu().clone()
            state = self.optimizer.state.get(param, {})
            if state:
                exp_avg[name] = state["exp_avg"].reshape(-1)[start:end].cpu().clone()
                exp_avg_sq[name] = state["exp_avg_sq"].reshape(-1)[start:end].cpu().clone()
                adam_step[name] = state["step"].cpu().clone()
        return {"step": self.step, "rank": self.rank, "world_size": self.world,
                "fingerprint": self.config.fingerprint(), "params": params, "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq, "adam_step": adam_step,
                "scheduler": self.scheduler.state_dict(),
                "lr": [group["lr"] for group in self.optimizer.param_groups],
                "rng": CKPT.rng_state()}

    def load_shards(self, shards: list[dict]) -> None:
        """Reassemble every full tensor from the N saved slices (any N), then continue. RNG
        states are restored only when N == p (a rank's stream means nothing in another layout)."""
        for name, param in self.named:
            with torch.no_grad():
                param.copy_(torch.cat([s["params"][name] for s in shards]).view_as(param))
            if name in shards[0]["exp_avg"]:
                full = {key: torch.cat([s[key][name] for s in shards]).view_as(param).to(param.device)
                        for key in ("exp_avg", "exp_avg_sq")}
                self.optimizer.state[param] = {"step": shards[0]["adam_step"][name].clone(), **full}
        first = shards[0]
        self.step = first["step"]
        self.scheduler.load_state_dict(first["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, first["lr"]):
            group["lr"] = lr  # lesson 06: the scheduler's state does not restore the LR itself
        if len(shards) == self.world:
            CKPT.set_rng_state(shards[self.rank]["rng"])

    def param_sha256(self) -> str:
        digest = hashlib.sha256()
        for _, param in self.named:
            digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    @torch.no_grad()
    def evaluate(self, data: torch.Tensor, batches: int = 4) -> float:
        """Mean loss on fixed windows of held-out text (dropout off)."""
        self.model.eval()
        generator = torch.Generator().manual_seed(12345)
        total = 0.0
        for _ in range(batches):
            starts = torch.randint(0, data.numel() - self.config.seq - 1, (16,), generator=generator)
            windows = torch.stack([data[s:s + self.config.seq + 1] for s in starts.tolist()]).to(self.device)
            logits = self.model(windows[:, :-1])
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                           windows[:, 1:].reshape(-1)))
        self.model.train()
        return total / batches

    @torch.no_grad()
    def sample(self, tokenizer: CharTokenizer, prompt: str, chars: int, temperature: float = 0.8) -> str:
        """Continue `prompt` one character at a time (a fixed generator: the same text each run)."""
        self.model.eval()
        generator = torch.Generator().manual_seed(self.config.seed)
        ids = tokenizer.encode(prompt).tolist()
        for _ in range(chars):
            context = torch.tensor([ids[-self.config.seq:]], device=self.device)
            logits = self.model(context)[0, -1].float().cpu() / temperature
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
        self.model.train()
        return tokenizer.decode(ids)


# ============================================================================ 4. the run


def train_worker(ctx: RankContext, config: dict, ckpt_dir: str, save_every: int, keep: int,
                 resume: bool, reshard: bool, kill_at: int | None, sample_chars: int,
                 fault: str | None, fault_rank: int) -> dict:
    inject_fault(ctx, fault, fault_rank)
    config = RunConfig(**config)
    text = load_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    split = int(0.9 * data.numel())
    train, val = data[:split], data[split:]
    trainer = Trainer(config, ctx, len(tokenizer.chars))
    ckpt = Path(ckpt_dir)
    resumed_from = None
    if resume:
        _, shards = CKPT.load_latest(ckpt, ctx.world_size, reshard, config.fingerprint())
        trainer.load_shards(shards)
        resumed_from = trainer.step
        if ctx.rank == 0:
            CKPT.discard_newer_than(ckpt, trainer.step)
        dist.barrier()
    checkpointer = CKPT.Checkpointer(ckpt, keep=keep, save_every=save_every)
    losses, val_losses = [], [(trainer.step, trainer.evaluate(val))]
    progress = _progress(ctx.rank == 0 and sys.stdout.isatty(), config.steps, trainer.step)
    timed_tokens, timed_seconds = 0, 0.0
    with progress:
        while trainer.step < config.steps:
            started = time.perf_counter()
            losses.append((trainer.step + 1, trainer.train_step(train)))
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            if trainer.step > (resumed_from or 0) + 2:  # the first steps warm up caches
                timed_seconds += time.perf_counter() - started
                timed_tokens += config.global_batch * config.seq
            checkpointer.maybe_save(trainer)
            if trainer.step % max(1, config.steps // 4) == 0 or trainer.step == config.steps:
                val_losses.append((trainer.step, trainer.evaluate(val)))
            progress.advance(losses[-1][1])
            if kill_at is not None and trainer.step == kill_at and ctx.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # as an OOM killer or a node failure would
    checkpointer.wait()
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds else None
    per_token = flops_per_token(matmul_params(trainer.model), config.layers, config.hidden, config.seq)
    result = {"rank": ctx.rank, "param_sha256": trainer.param_sha256(), "resumed_from": resumed_from}
    if ctx.rank == 0:
        result.update({
            "losses": losses, "val_losses": val_losses, "params": count_params(trainer.model),
            "vocab": len(tokenizer.chars), "tokens_per_s": tokens_per_s, "flops_per_token": per_token,
            "mfu": mfu(tokens_per_s, per_token, ctx.world_size, device_peak_flops(ctx.device))
            if tokens_per_s else None,
            "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
            "sample": trainer.sample(tokenizer, "MARCIUS:\n", sample_chars) if sample_chars else ""})
    return result


class _progress:
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


def plot_losses(result: dict, path: Path) -> None:
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
                           "clipping, sharded checkpoints and exact resume.", world_size=2)
    defaults = RunConfig()
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
    parser.add_argument("--dropout", type=float_in(0.0, 0.9), default=defaults.dropout)
    parser.add_argument("--dp", choices=("ours", "torch"), default=defaults.dp,
                        help="lesson 02's BucketedDDP or torch DistributedDataParallel")
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
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    try:
        micro_batch_size(args.global_batch, world, args.accum)
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


def config_from(args) -> RunConfig:
    return RunConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                     global_batch=args.global_batch, accum=args.accum, steps=args.steps, lr=args.lr,
                     warmup=args.warmup, clip=args.clip, dropout=args.dropout, seed=args.seed,
                     dp=args.dp)


def run(args, config: RunConfig, ckpt: Path, resume: bool, kill_at: int | None,
        sample_chars: int) -> list[dict]:
    return launch(train_worker, args.world_size,
                  (dataclasses.asdict(config), str(ckpt), args.save_every, args.keep, resume,
                   args.reshard, kill_at, sample_chars, args.fault, args.fault_rank),
                  device=args.device, timeout_s=max(args.timeout, 600.0))


def resume_from_middle(args, config: RunConfig, ckpt: Path, scratch: Path) -> list[dict]:
    """Copy the checkpoints, point `latest` at the middle one, resume to the end."""
    copy = scratch / "resume-check"
    shutil.copytree(ckpt, copy)
    middle = CKPT.committed_steps(copy)[0]
    CKPT.atomic_write_bytes(copy / CKPT.LATEST, (CKPT.step_dir_name(middle) + "\n").encode())
    return run(args, config, copy, True, None, 0)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    config = config_from(args)
    scratch = Path(tempfile.mkdtemp(prefix="capstone-"))
    out = args.out if args.out is not None else scratch / "out"
    ckpt = out / "checkpoints"
    if not args.resume and ckpt.exists() and any(ckpt.iterdir()):
        print(f"error: {ckpt} already holds checkpoints: pass --resume to continue them, or "
              "choose another --out", file=sys.stderr)
        return 2
    ckpt.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args, config, ckpt, args.resume, args.kill_at_step, args.sample_chars)
        first = results[0]
        checks = [Check("corpus verified (sha256 of the shipped text)", True,
                        f"{DATA.name}: {DATA.stat().st_size:,} bytes, {first['vocab']} characters")]
        digests = {r["param_sha256"] for r in results}
        checks.append(Check("every rank ends with the same weights", len(digests) == 1,
                            f"{len(results)} rank(s): {sorted(digests)[0][:16]}..."))
        start_val, end_val = first["val_losses"][0][1], first["val_losses"][-1][1]
        checks.append(Check("held-out loss went down", end_val < start_val - 0.3,
                            f"{start_val:.3f} -> {end_val:.3f} nats/char (uniform: "
                            f"{math.log(first['vocab']):.3f})"))
        resume_metrics = None
        on_cpu = first["device_name"] == "cpu"
        if not (args.resume or args.no_resume_check or under_torchrun()) and on_cpu \
                and len(CKPT.committed_steps(ckpt)) >= 2:
            resumed = resume_from_middle(args, config, ckpt, scratch)
            same = resumed[0]["param_sha256"] == first["param_sha256"]
            checks.append(Check("resume from the middle checkpoint == the uninterrupted run (bitwise)",
                                same, f"resumed at step {resumed[0]['resumed_from']} of {config.steps}: "
                                      f"{resumed[0]['param_sha256'][:16]}..."))
            resume_metrics = resumed[0]["resumed_from"]
        if is_reporting_rank():
            plot_losses(first, out / "loss.png")
            print(f"loss curve: {out / 'loss.png'}\n--- sample ---\n{first['sample']}\n--------------")
        metrics = {
            "final_param_sha256": first["param_sha256"], "tokens_per_s": first["tokens_per_s"],
            "mfu": first["mfu"], "device_name": first["device_name"], "params": first["params"],
            "flops_per_token": first["flops_per_token"], "final_train_loss": first["losses"][-1][1]
            if first["losses"] else None, "final_val_loss": end_val, "val_losses": first["val_losses"],
            "resumed_from": first["resumed_from"], "resume_check_from": resume_metrics,
            "config": dataclasses.asdict(config), "out": str(out), "sample": first["sample"],
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


if __name__ == "__main__":
    run_main(main)
