"""The trainer that exercises lesson 06's technique (atomic_file.py, main.py, exact_resume.py).

Lesson 02's MLP trained with lesson 03's ZeRO-1 Adam (so the optimizer state is sharded), a
warmup + cosine LR schedule, a GradScaler, a data cursor, and per-rank randomness (input noise
from torch's RNG, a loss weight from Python's `random`): a resumed run is bit-identical only if
every piece of `exact_resume_state` comes back. Also the single-process reference that a
resharded run must equal, and the training loop that saves every K steps.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._checks import fingerprint, tensor_digest
from lessons._launch import RankContext

from . import atomic_file, exact_resume
from . import main as checkpointing

data_parallel = importlib.import_module("lessons.02_data_parallel.main")  # lesson 02's technique
zero = importlib.import_module("lessons.03_zero.main")  # lesson 03's technique: ZeroStage1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; its fingerprint marks the run's checkpoints as its own."""

    seed: int = 0
    steps: int = 10
    batch: int = 24
    dataset: int = 96
    lr: float = 0.01
    warmup: int = 3
    noise: bool = True  # per-rank randomness from the global RNGs (needs the RNG states)

    def fingerprint(self) -> str:
        """Every field counts, even `steps` (the cosine schedule depends on it)."""
        return fingerprint(self)


def make_dataset(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's fixed dataset: `config.dataset` inputs (16 features) and targets (4), float64,
    from a generator seeded by `config.seed` (the same on every rank)."""
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(config.dataset, 16, generator=generator, dtype=torch.float64)
    targets = torch.randn(config.dataset, 4, generator=generator, dtype=torch.float64)
    return inputs, targets


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened, in named_parameters() order, on the CPU."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


class ZeroTrainer:
    """One rank of the run: ZeRO-1 Adam, LambdaLR(cosine_with_warmup), GradScaler, DataCursor,
    per-rank noise; `shard_state()` is what this rank saves, `load_shards()` restores from the
    shards of N saved ranks into this rank of M."""

    def __init__(self, config: TrainConfig, rank: int, world: int,
                 device: torch.device | str = "cpu"):
        self.config, self.rank, self.world = config, rank, world
        self.device = torch.device(device)
        self.model = data_parallel.make_model(config.seed).to(self.device)
        self.zero = zero.ZeroStage1(self.model.named_parameters(), torch.optim.Adam, lr=config.lr,
                                    foreach=False)  # Adam's states sharded over the ranks
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.zero, exact_resume.cosine_with_warmup(config.warmup, config.steps))
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=2.0**10, growth_interval=3)
        self.cursor = exact_resume.DataCursor(config.dataset, config.batch, config.seed)
        self.step = 0
        random.seed(config.seed * 7 + rank)
        torch.manual_seed(config.seed * 7 + rank)  # seeds the CPU and every CUDA generator
        self.inputs, self.targets = (t.to(self.device) for t in make_dataset(config))

    def train_step(self) -> float:
        indices = data_parallel.local_shard(self.cursor.next_indices(), self.rank, self.world)
        x, y = self.inputs[indices.to(self.device)], self.targets[indices.to(self.device)]
        weight = 1.0
        if self.config.noise:
            x = x + 0.01 * torch.randn_like(x)
            weight = 1.0 + 0.01 * random.random()
        self.zero.zero_grad()
        loss = F.mse_loss(self.model(x), y) * weight
        self.scaler.scale(loss).backward()
        self.scaler.step(self.zero)  # the unscale and the inf/nan skip, the same on every rank
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        return loss.item()

    def shard_state(self) -> dict:
        """This rank's slices of the parameters and of Adam's moments (CPU copies), and the
        exact-resume state with this rank's RNG states."""
        params, exp_avg, exp_avg_sq, adam_step = {}, {}, {}, {}
        for (name, param), (start, end), shard in zip(self.zero.named, self.zero.bounds,
                                                      self.zero.shards):
            params[name] = param.detach().reshape(-1)[start:end].cpu().clone()
            state = self.zero.optimizer.state.get(shard, {})
            if state:
                exp_avg[name] = state["exp_avg"].cpu().clone()
                exp_avg_sq[name] = state["exp_avg_sq"].cpu().clone()
                adam_step[name] = state["step"].cpu().clone()
        return {"rank": self.rank, "world_size": self.world,
                "fingerprint": self.config.fingerprint(), "params": params, "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq, "adam_step": adam_step,
                **exact_resume.exact_resume_state(self.step, self.zero, self.scheduler,
                                                   self.scaler, self.cursor, self.device)}

    def load_shards(self, shards: list[dict]) -> None:
        """Restore from the shards of every saved rank (N of them, any N): parameters are the
        concatenated slices, Adam's moments are resharded to this rank's M-way slice. RNG
        states come back only when N == M (a rank's stream means nothing in another layout)."""
        for (name, param), shard in zip(self.zero.named, self.zero.shards):
            with torch.no_grad():
                param.copy_(torch.cat([s["params"][name] for s in shards]).view_as(param))
            if name in shards[0]["exp_avg"]:
                self.zero.optimizer.state[shard] = {
                    "step": shards[0]["adam_step"][name].clone(),
                    **{key: exact_resume.reshard([s[key][name] for s in shards], self.world,
                                                  self.rank).to(self.device)
                       for key in ("exp_avg", "exp_avg_sq")}}
        same_layout = len(shards) == self.world
        self.step = exact_resume.restore_exact_resume_state(
            shards[self.rank] if same_layout else shards[0], self.zero, self.scheduler,
            self.scaler, self.cursor, self.device, restore_rng=same_layout)

    def param_sha256(self) -> str:
        return tensor_digest(dict(self.model.named_parameters()))


class ReferenceTrainer:
    """The same math in one process, on the whole batch, with plain Adam and no noise: what a
    resharded run must equal. `load_shards` resumes it from N shards (resharding N -> 1)."""

    def __init__(self, config: TrainConfig):
        if config.noise:
            raise ValueError("the single-process reference exists only for noise=False")
        self.config, self.step = config, 0
        self.model = data_parallel.make_model(config.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, exact_resume.cosine_with_warmup(config.warmup, config.steps))
        self.cursor = exact_resume.DataCursor(config.dataset, config.batch, config.seed)
        self.inputs, self.targets = make_dataset(config)

    def train_step(self) -> None:
        indices = self.cursor.next_indices()
        self.optimizer.zero_grad()
        F.mse_loss(self.model(self.inputs[indices]), self.targets[indices]).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1

    def load_shards(self, shards: list[dict]) -> None:
        for name, param in self.model.named_parameters():
            with torch.no_grad():
                param.copy_(torch.cat([s["params"][name] for s in shards]).view_as(param))
            self.optimizer.state[param] = {
                "step": shards[0]["adam_step"][name].clone(),
                **{key: exact_resume.reshard([s[key][name] for s in shards], 1, 0).view_as(param)
                   for key in ("exp_avg", "exp_avg_sq")}}
        self.step = exact_resume.restore_exact_resume_state(
            shards[0], self.optimizer, self.scheduler, None, self.cursor, restore_rng=False)

    def finish(self) -> list[float]:
        while self.step < self.config.steps:
            self.train_step()
        return flat_parameters(self.model).tolist()


def reference_params(config: TrainConfig) -> list[float]:
    """The unsharded reference's final parameters (noise-free config)."""
    return ReferenceTrainer(config).finish()


def resume_unsharded(config: TrainConfig, ckpt_dir: Path) -> dict:
    """Resharding N -> 1 without a process group: load the latest checkpoint of any world size
    into the single-process reference and train it to the end."""
    manifest, shards = checkpointing.load_latest(ckpt_dir, None, True, config.fingerprint())
    trainer = ReferenceTrainer(config)
    trainer.load_shards(shards)
    return {"params": trainer.finish(), "resumed_from": manifest["step"],
            "saved_world": manifest["world_size"]}


def run_training(ctx: RankContext, config: TrainConfig, ckpt_dir: Path, save_every: int,
                 keep: int, resume: bool = False, reshard: bool = False, async_save: bool = False,
                 stop_at: int | None = None, sleep_per_step: float = 0.0,
                 export_path: Path | None = None) -> dict:
    """Train (from scratch or from the latest checkpoint) to `config.steps` (or `stop_at`),
    saving every `save_every` steps; rank 0 exports the live weights at the end. Returns the
    final parameters' sha256 and flat values, where it resumed, and the seconds of each save."""
    trainer = ZeroTrainer(config, ctx.rank, ctx.world_size, ctx.device)
    resumed_from = 0
    if resume:
        manifest, shards = checkpointing.load_latest(ckpt_dir, ctx.world_size, reshard,
                                                     config.fingerprint())
        trainer.load_shards(shards)
        resumed_from = manifest["step"]
        if ctx.rank == 0:
            checkpointing.discard_newer_than(ckpt_dir, resumed_from)
        dist.barrier()
    checkpointer = checkpointing.Checkpointer(ckpt_dir, keep, save_every, async_save)
    save_seconds = []
    try:
        while trainer.step < (stop_at or config.steps):
            trainer.train_step()
            started = time.perf_counter()
            checkpointer.maybe_save(trainer)
            if save_every and trainer.step % save_every == 0:
                save_seconds.append(time.perf_counter() - started)
            if sleep_per_step:
                time.sleep(sleep_per_step)
    finally:
        if dist.is_initialized():
            checkpointer.wait()
    exported = None
    if export_path is not None and ctx.rank == 0:
        exported = atomic_file.export_safetensors(dict(trainer.model.named_parameters()),
                                                    export_path)
    return {"sha256": trainer.param_sha256(), "resumed_from": resumed_from, "step": trainer.step,
            "params": flat_parameters(trainer.model).tolist(), "exported_bytes": exported,
            "save_seconds": statistics.median(save_seconds) if save_seconds else None}
