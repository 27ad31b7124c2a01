"""Lesson 13, the capstone: a character-level GPT trained end to end with data parallelism.

Each earlier lesson isolated one technique; a run needs them together, and their interactions
are where long runs break. In the order a step meets them:

1. data: the shipped corpus (sha256 checked), characters as tokens, each step's global batch a
   pure function of (seed, step), split over ranks, then over micro-batches;
2. the model and optimizer: lesson 07's TinyGPT under lesson 02's BucketedDDP (or torch DDP);
   AdamW decaying 2-D tensors only (nanoGPT's groups), lesson 06's warmup + cosine schedule;
3. the step: gradient accumulation under no_sync, global-norm clipping, bf16 autocast on GPU;
4. checkpoints on lesson 06's protocol, each rank saving 1/p of every tensor (lesson 03's
   shard_bounds); resume reassembles them on any number of ranks;
5. the cost model: tokens/s of the training steps here; FLOPs per token (PaLM) and MFU in
   flops.py.

Then every dimension at once, in three more technique files: nd_model.py (the one-process
model), nd.py (DP x TP x PP x CP on one DeviceMesh), nd_placement.py (checkpoints across
layouts); planner.py predicts which layouts fit a cluster. The proof (resume bit for bit,
resharding, our DDP against torch's), the progress bar, the loss plot, the sample and the CLI
are in checks.py; the N-D proof in nd_checks.py, torch's engines beside ours in
torch_engines.py, the planner's CLI and measured check in planner_checks.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

tiny_gpt = importlib.import_module("lessons.07_memory.tiny_gpt")  # lesson 07's TinyGPT, markov_batches
data_parallel = importlib.import_module("lessons.02_data_parallel.main")  # BucketedDDP
zero = importlib.import_module("lessons.03_zero.main")  # shard_bounds
checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # Checkpointer, load

DATA = Path(__file__).resolve().with_name("data") / "coriolanus.txt"
DATA_SHA256 = "2d9f15c52ff3588f742907c5889b11d3458bc47d44bde2e1f3cb6f8c9aa24169"

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
class GPTRunConfig:
    """Everything that defines a run; its fingerprint marks its checkpoints as its own.
    The global batch is fixed: each rank's micro-batch is global / (ranks x accumulation)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 64
    global_batch: int = 24  # sequences per optimizer step: 1-4 ranks x 2 micro-batches divide it
    accum: int = 2  # micro-batches per rank per step
    steps: int = 80
    lr: float = 1e-2
    warmup: int = 8
    clip: float = 1.0
    weight_decay: float = 0.01
    dropout: float = 0.1
    seed: int = 0
    ddp: str = "ours"

    def fingerprint(self) -> str:
        """Every field counts (even `steps`: the cosine schedule depends on it)."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return checkpointing.sha256_hex(text.encode())[:16]

    def micro_batch(self, world: int) -> int:
        return micro_batch_size(self.global_batch, world, self.accum)


def micro_batch_size(global_batch: int, world: int, accum: int) -> int:
    """Sequences in one rank's micro-batch: global_batch / (ranks x accumulation steps)."""
    if global_batch % (world * accum):
        raise ValueError(f"global batch {global_batch} is not divisible by {world} ranks x "
                         f"{accum} micro-batches")
    return global_batch // (world * accum)


def global_windows(data: torch.Tensor, seed: int, step: int, global_batch: int, seq: int) -> torch.Tensor:
    """The step's global batch: `global_batch` random windows (global_batch, seq + 1) of the
    corpus, from a generator seeded by (seed, step): the data cursor IS the step number."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (global_batch,), generator=generator)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()])


def held_out_windows(data: torch.Tensor, windows: int, seq: int) -> torch.Tensor:
    """The evaluation's fixed windows (windows, seq + 1), the same at every evaluation."""
    generator = torch.Generator().manual_seed(12345)
    starts = torch.randint(0, data.numel() - seq - 1, (windows,), generator=generator)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()])


def batch_for_step(data: torch.Tensor, config: GPTRunConfig, step: int, rank: int, world: int,
                   micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `micro` of rank `rank` at `step`: the step's `global_windows` split over
    ranks, then over micro-batches. Same global batch for any number of ranks."""
    windows = global_windows(data, config.seed, step, config.global_batch, config.seq)
    size, index = config.micro_batch(world), rank * config.accum + micro
    mine = windows[index * size:(index + 1) * size]
    return mine[:, :-1], mine[:, 1:]


# ============================================================================ 2. model and optimizer


# exercise accumulation-step (6 points): AdamW's groups, then the step: accumulation and one clip
# hint: decide the groups by p.dim(), not by the parameter's name.
def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups by nanoGPT's rule (model.py, configure_optimizers): every
    tensor of 2 or more dimensions decays (the matmul weights and the embedding tables, the
    tied token table once), the 1-D ones do not (biases, LayerNorm gains and shifts).

    Returns [{"params": [...], "weight_decay": weight_decay}, {"params": [...],
    "weight_decay": 0.0}], in that order: every trainable parameter (requires_grad) of
    `model` in exactly one group (model.parameters() yields a tied tensor once). Mutates nothing.
    Decoupled weight decay shrinks a weight by lr x weight_decay x w each step; a LayerNorm
    gain pulled toward 0 shrinks the signal itself, and a bias has no scale to regularise."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# ============================================================================ 3. the training step


# exercise accumulation-step (continued)
# hint: only the last micro-batch's backward may all-reduce; clip once, on the full sum.
def accumulation_step(ddp: torch.nn.Module, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                      clip: float) -> torch.Tensor:
    """One optimizer step from this rank's `accum = len(micro_batches)` micro-batches.

    micro_batches: [(tokens (b, s), targets (b, s))], long, on the model's device, equal sizes:
    the rank's share of the step's global batch. `ddp` wraps `model` and has `no_sync()`. Per
    micro-batch: forward through `ddp` (never `model`: that skips DDP's all-reduce) and the
    mean cross-entropy over its b x s positions (under bf16 autocast on CUDA, which runs
    cross_entropy in fp32), backward of loss / accum. All but the last run under
    `ddp.no_sync()`, so their gradients add up locally and the last backward all-reduces
    (averages over p ranks) the sum: .grad = (1/p) sum_r (1/accum) sum_m grad(loss of
    micro-batch m of rank r), the gradient of the global batch's mean loss, to float
    rounding. Then global-norm clipping: every gradient times min(1, clip / (||g|| + 1e-6)),
    ||g|| the 2-norm over all parameters (torch's clip_grad_norm_; after the all-reduce each
    rank holds the whole gradient, so its local norm is the global one; under ZeRO a rank
    must all-reduce its shard's sum of squares first, lesson 03). Then, once each,
    optimizer.step(), scheduler.step(), optimizer.zero_grad().

    Cost: accum forwards and backwards of global_batch / (p accum) sequences and ONE
    all-reduce of the gradients (2 (p-1)/p x 4N bytes), not accum of them.
    Returns this rank's mean loss over its micro-batches (0-d, detached)."""
    accum, losses = len(micro_batches), []
    for index, (tokens, targets) in enumerate(micro_batches):
        sync = contextlib.nullcontext() if index == accum - 1 else ddp.no_sync()
        with sync:
            with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.is_cuda):
                logits = ddp(tokens)  # cross_entropy is on autocast's fp32 list: bf16 logits upcast
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            (loss / accum).backward()
        losses.append(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack(losses).mean()


class GPTTrainer:
    """One rank's run: lesson 07's TinyGPT (the same initial weights on every rank) under DDP,
    AdamW (decay_groups) with lesson 06's warmup + cosine, the step. lesson 06's Checkpointer
    uses shard_state() / load_shards(), `step`, `rank`, `world` and `config.fingerprint()`."""

    def __init__(self, config: GPTRunConfig, rank: int, world: int, device: torch.device,
                 vocab: int) -> None:
        self.config, self.rank, self.world, self.device = config, rank, world, device
        torch.manual_seed(config.seed)  # the same initial weights on every rank
        self.model = tiny_gpt.TinyGPT(vocab, config.hidden, config.heads, config.layers, config.seq,
                                    dropout=config.dropout).to(device)
        if config.ddp not in ("ours", "torch"):
            raise ValueError(f"unknown data parallelism {config.ddp!r}: 'ours' or 'torch'")
        self.ddp = (data_parallel.BucketedDDP(self.model) if config.ddp == "ours" else
                    torch.nn.parallel.DistributedDataParallel(
                        self.model, device_ids=[device.index] if device.type == "cuda" else None))
        self.named = list(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(decay_groups(self.model, config.weight_decay),
                                           lr=config.lr, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, checkpointing.cosine_with_warmup(config.warmup, config.steps))
        self.step = 0
        self.rng_device = (device,) if device.type == "cuda" else ()  # its own CUDA generator only
        torch.manual_seed(config.seed * 7 + rank)  # dropout: a different stream per rank

    def train_step(self, data: torch.Tensor) -> float:
        """accumulation_step on this rank's micro-batches of step `self.step`; returns the
        loss averaged over micro-batches and ranks (one all-reduce of a scalar, for the log)."""
        micro = [tuple(t.to(self.device) for t in batch_for_step(data, self.config, self.step,
                                                                 self.rank, self.world, m))
                 for m in range(self.config.accum)]
        loss = accumulation_step(self.ddp, self.model, self.optimizer, self.scheduler, micro,
                                 self.config.clip)
        self.step += 1
        dist.all_reduce(loss)
        return float(loss) / self.world

    @torch.no_grad()
    def evaluate(self, data: torch.Tensor, windows: int = 64) -> float:
        """Mean loss on `windows` fixed windows of held-out text (eval mode: dropout neither
        applies nor draws from the RNG, so evaluating never shifts the stream a resume replays)."""
        self.model.eval()
        batch = held_out_windows(data, windows, self.config.seq).to(self.device)
        logits = self.model(batch[:, :-1])
        self.model.train()
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))

    # ------------------------------------------------------------- 4. what a checkpoint holds
    # exercise checkpoint-resume (5 points): The checkpoint's state and the resume
    # hint: shard_state slices each flattened tensor with zero.shard_bounds and copies it to
    #   the CPU; the optimizer's moments are in self.optimizer.state[param].
    def shard_state(self) -> dict:
        """This rank's part of a checkpoint (lesson 06's Checkpointer serialises it):
        {"step": self.step, "rank": self.rank, "world_size": self.world, "fingerprint":
        self.config.fingerprint(), "params", "exp_avg", "exp_avg_sq": {name: 1-D CPU copy of
        the rank's slice of that tensor, flattened}, "adam_step": {name: CPU copy of AdamW's
        step counter}, "scheduler": self.scheduler.state_dict(), "lr": [each param group's
        "lr"], "rng": checkpointing.rng_state(*self.rng_device)}, names from self.named.
        DDP replicates every tensor, yet rank r saves only flat[start:end], (start, end) =
        zero.shard_bounds(numel, p, r) with (p, r) = (self.world, self.rank): the ranks write
        in parallel and the checkpoint holds each number once (3 x 4N bytes in all, not p times
        that). No moments (and no adam_step entries) before step 1. Mutates nothing."""
        slices: dict[str, dict] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "adam_step": {}}
        for name, param in self.named:
            start, end = zero.shard_bounds(param.numel(), self.world, self.rank)
            state = {"params": param.detach(), **self.optimizer.state.get(param, {})}
            for key in ("params", "exp_avg", "exp_avg_sq"):
                if key in state:
                    slices[key][name] = state[key].reshape(-1)[start:end].cpu().clone()
            if "step" in state:
                slices["adam_step"][name] = state["step"].cpu().clone()
        return {"step": self.step, "rank": self.rank, "world_size": self.world,
                "fingerprint": self.config.fingerprint(), **slices,
                "scheduler": self.scheduler.state_dict(),
                "lr": [group["lr"] for group in self.optimizer.param_groups],
                "rng": checkpointing.rng_state(*self.rng_device)}

    # exercise checkpoint-resume (continued)
    # hint: load_shards restores the LR itself too, and the RNG only when len(shards) == self.world.
    def load_shards(self, shards: list[dict]) -> None:
        """Continue from every saved rank's shard_state(), in rank order (any N, also N != p):
        each full tensor is torch.cat of its N slices (exact) in the parameter's shape, copied
        into the parameter (in place) and AdamW's state self.optimizer.state[param] =
        {"step", "exp_avg", "exp_avg_sq"} (none for a checkpoint saved before step 1). Then
        self.step, the scheduler (load_state_dict) and each group's "lr" itself (the
        scheduler's state lacks the LR it last wrote: the first resumed step would run at the
        initial LR, lesson 06). The RNG states (checkpointing.set_rng_state with rank r's
        "rng", r = self.rank) only when N == p = self.world: rank r's dropout stream means
        nothing in another layout."""
        for name, param in self.named:
            full = {key: torch.cat([s[key][name] for s in shards]).view_as(param).to(param.device)
                    for key in ("params", "exp_avg", "exp_avg_sq") if name in shards[0][key]}
            with torch.no_grad():
                param.copy_(full.pop("params"))
            if full:
                self.optimizer.state[param] = {"step": shards[0]["adam_step"][name].clone(), **full}
        self.step = shards[0]["step"]
        self.scheduler.load_state_dict(shards[0]["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, shards[0]["lr"]):
            group["lr"] = lr
        if len(shards) == self.world:
            checkpointing.set_rng_state(shards[self.rank]["rng"], *self.rng_device)


# exercise checkpoint-resume (continued)
# hint: resume is lesson 06's load_latest, then load_shards, then discard_newer_than on rank 0.
def resume(trainer: GPTTrainer, ckpt_dir: Path, reshard: bool) -> int:
    """Continue `trainer` from `ckpt_dir`'s latest checkpoint (a collective: every rank calls
    it). Lesson 06's verified load first (checkpointing.load_latest with trainer.world,
    `reshard` and trainer.config.fingerprint()): manifest, sizes, sha256 and the run's
    fingerprint, another world size refused unless `reshard`; a CheckpointError names the file
    before any tensor is used. Then trainer.load_shards(every shard). Rank 0 removes the step
    directories newer than the resumed step (checkpointing.discard_newer_than: rotation by
    step number would keep them over the new run's checkpoints); every rank waits for that
    (a barrier). Returns the resumed step."""
    _, shards = checkpointing.load_latest(ckpt_dir, trainer.world, reshard, trainer.config.fingerprint())
    trainer.load_shards(shards)
    if trainer.rank == 0:
        checkpointing.discard_newer_than(ckpt_dir, trainer.step)
    dist.barrier()
    return trainer.step


def train(trainer: GPTTrainer, train_data: torch.Tensor, val_data: torch.Tensor,
          checkpointer, after_step: Callable[[GPTTrainer, float], None] | None = None) -> dict:
    """The run from trainer.step to config.steps: train_step, checkpointer.maybe_save (lesson
    06's Checkpointer), the held-out loss at the start, every steps/4 and at the end, then
    `after_step(trainer, loss)` (the harness's progress bar, or a kill). tokens/s counts the
    training steps only: tokens / seconds inside train_step (GPU synchronised), without the
    checkpoint saves, the evaluations and the first 2 steps after a (re)start (warm-up).
    Returns {"losses": [(step, loss)], "val_losses": [(step, loss)], "tokens_per_s"}."""
    config, started_at = trainer.config, trainer.step
    losses, val_losses = [], [(trainer.step, trainer.evaluate(val_data))]
    timed_tokens, timed_seconds = 0, 0.0
    while trainer.step < config.steps:
        started = time.perf_counter()
        losses.append((trainer.step + 1, trainer.train_step(train_data)))
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        if trainer.step > started_at + 2:
            timed_seconds += time.perf_counter() - started
            timed_tokens += config.global_batch * config.seq
        checkpointer.maybe_save(trainer)
        if trainer.step % max(1, config.steps // 4) == 0 or trainer.step == config.steps:
            val_losses.append((trainer.step, trainer.evaluate(val_data)))
        if after_step is not None:
            after_step(trainer, losses[-1][1])
    checkpointer.wait()
    return {"losses": losses, "val_losses": val_losses,
            "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None}


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
