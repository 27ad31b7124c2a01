"""Lesson 06: sharded, atomic, verified checkpoints; exact resume; resharding; export.

The story, top to bottom:

1. Atomic files: write to a temporary file in the same directory, fsync it, rename it over
   the target, fsync the directory.
2. The training state needed for EXACT resume: model, (sharded) optimizer, LR scheduler,
   gradient scaler, RNG states (Python, torch CPU, CUDA), data cursor and step. The trainer
   is lesson 02's model with lesson 03's ZeRO-1 Adam, so the optimizer state is sharded.
3. The save protocol: every rank writes its shard atomically; rank 0 writes a manifest (format
   version, world size, step, each file's size and sha256) LAST, as the commit marker; then
   the `latest` pointer moves atomically; then rotation keeps the newest K. Periodic saves,
   and an asynchronous save that writes in the background and commits at the next wait.
4. Verified load: the manifest and every hash are checked before anything is used; every kind
   of damage is rejected with an error that names the file.
5. Resharding: a state saved by N ranks loads into M ranks.
6. Export: the final weights written from the live model with safetensors, verified by size
   and by a round-trip load.
7. The checks, including torch.distributed.checkpoint (dcp.save / dcp.load with load-time
   resharding) on the same state.

Run: `python lessons/06_checkpointing/main.py` (a temporary directory), or
`python lessons/06_checkpointing/main.py --ckpt-dir runs/a --steps 40 --save-every 5 --keep 2`
then the same with `--resume`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._launch import RankContext, inject_fault, launch
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

LESSON = "06_checkpointing"
DP = importlib.import_module("lessons.02_data_parallel.main")  # model, data helpers
ZERO = importlib.import_module("lessons.03_zero.main")  # ZeroAdam: a sharded optimizer
FORMAT_VERSION = 1
SHARD_NAME = re.compile(r"^shard-(\d{5})-of-(\d{5})\.pt$")
STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"
LATEST = "latest"
# Resharding changes the summation order of gradients (a different world size), so a resharded
# run equals the reference to float64 rounding (~1e-16 per step), not bit for bit.
RESHARD_TOLERANCE = 1e-10


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used. The message starts with the offending path."""


# ============================================================================ 1. atomic files


def fsync_directory(path: Path) -> None:
    """fsync a directory so that a rename or a new file in it survives a power loss
    (fsync(2): the directory entry needs its own fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SimulatedCrash(RuntimeError):
    """Raised at a named point of the save protocol, to test what a crash there leaves."""


def crash_point(name: str, crash_at: str | None) -> None:
    if crash_at == name:
        raise SimulatedCrash(name)


def atomic_write_bytes(path: Path, data: bytes, crash_at: str | None = None) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never a part:
    temp file in the same directory (same filesystem, so rename is atomic), write, flush,
    fsync the file, os.replace over the target, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    crash_point(f"{path.name}:written", crash_at)
    os.replace(tmp, path)
    fsync_directory(path.parent)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def safetensors_file_bytes(header_bytes: int, tensor_bytes: int) -> int:
    """Size of a safetensors file: 8-byte little-endian header length, the JSON header, then
    the raw tensor bytes."""
    return 8 + header_bytes + tensor_bytes


def kept_steps(total_steps: int, save_every: int, keep: int) -> list[int]:
    """Which checkpoints survive a run of `total_steps` saving every `save_every` steps and
    keeping the newest `keep` by step number."""
    return list(range(save_every, total_steps + 1, save_every))[-keep:]


# ============================================================================ 2. the training state


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run. Its fingerprint marks its checkpoints as its own."""

    seed: int = 0
    steps: int = 8
    batch: int = 24
    dataset: int = 96
    lr: float = 0.01
    warmup: int = 3
    noise: bool = True  # per-rank randomness from the global RNGs (needs the RNG states)

    def fingerprint(self) -> str:
        """Every field counts: even `steps` (the cosine schedule depends on it)."""
        return sha256_hex(json.dumps(dataclasses.asdict(self), sort_keys=True).encode())[:16]


class DataCursor:
    """Walks a fixed dataset in a new random order every epoch (a torch.Generator seeded by
    (seed, epoch)), `batch` examples at a time. Its whole state is (epoch, position)."""

    def __init__(self, dataset: int, batch: int, seed: int):
        if dataset % batch:
            raise ValueError(f"dataset {dataset} is not a multiple of batch {batch}")
        self.dataset, self.batch, self.seed = dataset, batch, seed
        self.epoch, self.position = 0, 0

    def next_indices(self) -> torch.Tensor:
        order = torch.randperm(self.dataset, generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.epoch))
        indices = order[self.position:self.position + self.batch]
        self.position += self.batch
        if self.position == self.dataset:
            self.epoch, self.position = self.epoch + 1, 0
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def make_dataset(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed dataset of a run: `config.dataset` inputs (16 features) and targets (4), float64,
    drawn from a generator seeded by `config.seed` (the same on every rank)."""
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(config.dataset, 16, generator=generator, dtype=torch.float64)
    targets = torch.randn(config.dataset, 4, generator=generator, dtype=torch.float64)
    return inputs, targets


def cosine_with_warmup(warmup: int, total: int):
    """LR multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def rng_state() -> dict:
    """Python, torch CPU and (when present) CUDA generator states of this process."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """Lesson 02's MLP trained with lesson 03's ZeRO-1 Adam (sharded optimizer states), a
    warmup + cosine LR schedule, a GradScaler, and per-rank randomness (input noise from the
    torch RNG, a loss weight from Python's `random`) so that resuming needs every RNG state."""

    def __init__(self, config: TrainConfig, rank: int, world: int):
        self.config, self.rank, self.world = config, rank, world
        self.model = DP.make_model(config.seed)
        self.zero = ZERO.ZeroAdam(self.model, stage=1, lr=config.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.zero.optimizer, cosine_with_warmup(config.warmup, config.steps))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        self.cursor = DataCursor(config.dataset, config.batch, config.seed)
        self.step = 0
        random.seed(config.seed * 7 + rank)
        torch.manual_seed(config.seed * 7 + rank)
        self.inputs, self.targets = make_dataset(config)

    def train_step(self) -> float:
        indices = DP.local_shard(self.cursor.next_indices(), self.rank, self.world)
        x, y = self.inputs[indices], self.targets[indices]
        weight = 1.0
        if self.config.noise:
            x = x + 0.01 * torch.randn_like(x)
            weight = 1.0 + 0.01 * random.random()
        self.zero.zero_grad()
        loss = F.mse_loss(self.model(x), y) * weight
        self.scaler.scale(loss).backward()
        self.zero.step(self.scaler)
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        return loss.item()

    # ------------------------------------------------------------- what a checkpoint holds
    def shard_state(self) -> dict:
        """This rank's shard: its slices of the parameters and of the Adam states, plus the
        replicated small state (step, cursor, scheduler, scaler) and its own RNG states."""
        params, exp_avg, exp_avg_sq, adam_step = {}, {}, {}, {}
        for (name, param), (start, end), shard in zip(self.zero.named, self.zero.bounds,
                                                      self.zero.shards):
            params[name] = param.detach().reshape(-1)[start:end].clone()
            state = self.zero.optimizer.state.get(shard, {})
            if state:
                exp_avg[name] = state["exp_avg"].clone()
                exp_avg_sq[name] = state["exp_avg_sq"].clone()
                adam_step[name] = state["step"].clone()
        return {"step": self.step, "rank": self.rank, "world_size": self.world,
                "fingerprint": self.config.fingerprint(),
                "params": params, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                "adam_step": adam_step, "scheduler": self.scheduler.state_dict(),
                "lr": [group["lr"] for group in self.zero.optimizer.param_groups],
                "scaler": self.scaler.state_dict(), "cursor": self.cursor.state_dict(),
                "rng": rng_state()}

    def load_shards(self, shards: list[dict]) -> None:
        """Restore from the shards of every saved rank (N of them, any N): full tensors are
        reassembled from the N slices and re-sliced for this rank's M-way shard. RNG states
        are restored only when N == M (a rank's stream has no meaning in another layout)."""
        saved_world = len(shards)
        for (name, param), shard in zip(self.zero.named, self.zero.shards):
            with torch.no_grad():
                param.copy_(torch.cat([s["params"][name] for s in shards]).view_as(param))
            if name in shards[0]["exp_avg"]:
                start, end = ZERO.shard_bounds(param.numel(), self.world, self.rank)
                full_avg = torch.cat([s["exp_avg"][name] for s in shards])
                full_sq = torch.cat([s["exp_avg_sq"][name] for s in shards])
                self.zero.optimizer.state[shard] = {
                    "step": shards[0]["adam_step"][name].clone(),
                    "exp_avg": full_avg[start:end].clone(),
                    "exp_avg_sq": full_sq[start:end].clone()}
        first = shards[0]
        self.step = first["step"]
        self.scheduler.load_state_dict(first["scheduler"])
        # The scheduler's state does not include the LR it last wrote into the optimizer:
        # without this, the first resumed step runs at the warmup LR (a real resume bug).
        for group, lr in zip(self.zero.optimizer.param_groups, first["lr"]):
            group["lr"] = lr
        self.scaler.load_state_dict(first["scaler"])
        self.cursor.load_state_dict(first["cursor"])
        if saved_world == self.world:
            set_rng_state(shards[self.rank]["rng"])

    def param_sha256(self) -> str:
        """sha256 of every parameter's bytes, in named_parameters() order."""
        digest = hashlib.sha256()
        for _, param in self.zero.named:
            digest.update(param.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()


# ============================================================================ 3. the save protocol


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def serialize(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def write_shard(step_dir: Path, rank: int, world: int, payload: bytes,
                crash_at: str | None = None) -> dict:
    """Phase 1, on every rank: write this rank's shard atomically; return its manifest entry."""
    name = shard_name(rank, world)
    atomic_write_bytes(step_dir / name, payload, crash_at)
    return {"name": name, "rank": rank, "bytes": len(payload), "sha256": sha256_hex(payload)}


def commit(ckpt_dir: Path, step: int, world: int, entries: list[dict], fingerprint: str,
           keep: int, crash_at: str | None = None) -> None:
    """Phase 2, on rank 0 once every shard is on disk: manifest (the commit marker), then the
    `latest` pointer, then rotation. A crash before the manifest's rename leaves this step
    uncommitted and the previous checkpoint in charge; after it, this step is complete."""
    step_dir = ckpt_dir / step_dir_name(step)
    manifest = {"format_version": FORMAT_VERSION, "world_size": world, "step": step,
                "fingerprint": fingerprint, "files": sorted(entries, key=lambda e: e["rank"])}
    atomic_write_bytes(step_dir / MANIFEST, json.dumps(manifest, indent=1).encode(), crash_at)
    crash_point("committed", crash_at)
    atomic_write_bytes(ckpt_dir / LATEST, (step_dir.name + "\n").encode(), crash_at)
    crash_point("latest", crash_at)
    rotate(ckpt_dir, keep)


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the checkpoints whose manifest exists, oldest first."""
    steps = []
    for child in ckpt_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / MANIFEST).exists():
            steps.append(int(match.group(1)))
    return sorted(steps)


def discard_newer_than(ckpt_dir: Path, step: int) -> list[str]:
    """On resume from `step`: step directories above it (committed after `latest` was last
    moved, or half-written) belong to a future that no longer happens; remove them so that
    rotation by step number never keeps them over the new run's checkpoints."""
    removed = []
    for child in ckpt_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and int(match.group(1)) > step:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def rotate(ckpt_dir: Path, keep: int) -> list[int]:
    """Keep the newest `keep` committed checkpoints BY STEP NUMBER (never by file time), and
    remove uncommitted leftovers older than the newest commit. Returns the steps removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    steps = committed_steps(ckpt_dir)
    newest = steps[-1] if steps else -1
    doomed = steps[:-keep]
    for child in ckpt_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and not (child / MANIFEST).exists() and int(match.group(1)) < newest:
            shutil.rmtree(child, ignore_errors=True)
    for step in doomed:
        shutil.rmtree(ckpt_dir / step_dir_name(step), ignore_errors=True)
    return doomed


class Checkpointer:
    """Saves a Trainer every `save_every` steps into `ckpt_dir`, synchronously or in the
    background. An async save snapshots the state (copies), writes the shard in a thread while
    training goes on, and is committed by `wait()`, called before the next save and at exit
    (commit needs every rank's entry, which is a collective: it stays on the main thread)."""

    def __init__(self, ckpt_dir: Path, keep: int, save_every: int, async_save: bool = False):
        if keep < 1:
            raise ValueError(f"--keep must be >= 1, got {keep}")
        self.ckpt_dir, self.keep, self.save_every = ckpt_dir, keep, save_every
        self.async_save = async_save
        self._pending: tuple[threading.Thread, int, str] | None = None  # thread, step, fingerprint
        self._result: dict = {}

    def maybe_save(self, trainer: Trainer) -> None:
        if self.save_every and trainer.step % self.save_every == 0:
            self.save(trainer)

    def save(self, trainer: Trainer) -> None:
        self.wait()
        rank, world = trainer.rank, trainer.world
        step_dir = self.ckpt_dir / step_dir_name(trainer.step)
        if rank == 0:
            if step_dir.exists():  # a half-written leftover of a crashed save at this step
                shutil.rmtree(step_dir)
            step_dir.mkdir(parents=True)
        dist.barrier()
        payload = serialize(trainer.shard_state())  # the snapshot: copies of every tensor
        fingerprint = trainer.config.fingerprint()
        if self.async_save:
            def write() -> None:
                self._result = write_shard(step_dir, rank, world, payload)
            thread = threading.Thread(target=write, daemon=False)
            thread.start()
            self._pending = (thread, trainer.step, fingerprint)
        else:
            self._commit_everywhere(write_shard(step_dir, rank, world, payload), trainer.step,
                                    world, fingerprint)

    def wait(self) -> None:
        """Finish the pending async save (if any) on every rank and commit it."""
        if self._pending is None:
            return
        thread, step, fingerprint = self._pending
        thread.join()
        self._pending = None
        self._commit_everywhere(self._result, step, dist.get_world_size(), fingerprint)

    def _commit_everywhere(self, entry: dict, step: int, world: int, fingerprint: str) -> None:
        entries: list = [None] * world
        dist.all_gather_object(entries, entry)
        if dist.get_rank() == 0:
            commit(self.ckpt_dir, step, world, entries, fingerprint, self.keep)
        dist.barrier()


# ============================================================================ 4. verified load


def read_latest(ckpt_dir: Path) -> Path:
    """The directory `latest` names, refusing anything that is not a plain step directory."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    pointer = ckpt_dir / LATEST
    if not pointer.exists():
        raise CheckpointError(f"{pointer}: missing: {ckpt_dir} holds no committed checkpoint "
                              "(or is not a checkpoint directory)")
    name = pointer.read_text(errors="replace").strip()
    if not STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: {name!r} is not a step directory name (a path "
                              "escaping the checkpoint directory is refused)")
    if not (ckpt_dir / name).is_dir():
        raise CheckpointError(f"{pointer}: points to {name}, which is missing")
    return ckpt_dir / name


def verify_checkpoint(step_dir: Path, world: int | None, reshard: bool = False,
                      fingerprint: str | None = None) -> dict:
    """Check a checkpoint completely before anything is used: the manifest's fields, the set
    of shard files (no missing, extra, duplicate or escaping names), and each file's size and
    sha256. Returns the manifest; raises CheckpointError naming the file otherwise."""
    manifest_path = step_dir / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{manifest_path}: missing: the checkpoint was never committed")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path}: not a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format_version {version!r} is unknown "
                              f"(this code reads {FORMAT_VERSION})")
    for field, kind in (("world_size", int), ("step", int), ("files", list), ("fingerprint", str)):
        if not isinstance(manifest.get(field), kind) or isinstance(manifest.get(field), bool):
            raise CheckpointError(f"{manifest_path}: field {field!r} missing or not {kind.__name__}")
    saved_world = manifest["world_size"]
    if saved_world < 1:
        raise CheckpointError(f"{manifest_path}: world_size {saved_world} < 1")
    if fingerprint is not None and manifest["fingerprint"] != fingerprint:
        raise CheckpointError(f"{manifest_path}: fingerprint {manifest['fingerprint']} belongs "
                              f"to another run configuration (expected {fingerprint})")
    if world is not None and saved_world != world and not reshard:
        raise CheckpointError(f"{manifest_path}: saved by {saved_world} ranks but {world} are "
                              "running; pass --reshard to load it into a different world size")
    seen: dict[int, str] = {}
    for index, entry in enumerate(manifest["files"]):
        where = f"{manifest_path}: files[{index}]"
        if not isinstance(entry, dict) or not all(k in entry for k in ("name", "rank", "bytes",
                                                                        "sha256")):
            raise CheckpointError(f"{where}: needs name, rank, bytes and sha256")
        name = entry["name"]
        if not isinstance(name, str) or "/" in name or "\\" in name or name in (".", "..") \
                or os.path.isabs(name):
            raise CheckpointError(f"{where}: name {name!r} escapes the checkpoint directory")
        match = SHARD_NAME.match(name)
        if not match or int(match.group(2)) != saved_world or int(match.group(1)) != entry["rank"]:
            raise CheckpointError(f"{where}: {name!r} is not the shard name of rank "
                                  f"{entry['rank']} of {saved_world}")
        rank = entry["rank"]
        if rank in seen:
            raise CheckpointError(f"{where}: duplicate rank {rank} ({seen[rank]} and {name})")
        if not 0 <= rank < saved_world:
            raise CheckpointError(f"{where}: extra rank {rank}: world size is {saved_world}")
        seen[rank] = name
    for rank in range(saved_world):
        if rank not in seen:
            raise CheckpointError(f"{step_dir / shard_name(rank, saved_world)}: missing shard "
                                  f"of rank {rank} (not in the manifest)")
    listed = set(seen.values())
    for child in step_dir.iterdir():
        if SHARD_NAME.match(child.name) and child.name not in listed:
            raise CheckpointError(f"{child}: extra shard file not in the manifest")
    for entry in manifest["files"]:
        path = step_dir / entry["name"]
        if not path.exists():
            raise CheckpointError(f"{path}: missing shard of rank {entry['rank']}")
        data = path.read_bytes()
        if len(data) != entry["bytes"]:
            raise CheckpointError(f"{path}: {len(data)} bytes, the manifest says "
                                  f"{entry['bytes']} (truncated or extended)")
        if sha256_hex(data) != entry["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch (the file is corrupt)")
    return manifest


def load_latest(ckpt_dir: Path, world: int, reshard: bool, fingerprint: str) -> tuple[dict, list[dict]]:
    """Verify the latest checkpoint, then read every shard (resharding needs all of them)."""
    step_dir = read_latest(ckpt_dir)
    manifest = verify_checkpoint(step_dir, world, reshard, fingerprint)
    shards = []
    for entry in manifest["files"]:
        path = step_dir / entry["name"]
        try:
            shards.append(torch.load(io.BytesIO(path.read_bytes()), weights_only=False))
        except Exception as exc:  # a valid hash of an unreadable payload: say which file
            raise CheckpointError(f"{path}: cannot be deserialised ({exc})") from None
    return manifest, shards


# ============================================================================ 5-6. export


def export_safetensors(named_tensors: dict[str, torch.Tensor], path: Path) -> int:
    """Write the weights with the safetensors package (atomically), then verify: the file's
    size must equal 8 + header + every tensor's bytes, and loading it back must give tensors
    equal to the live ones. An empty or mismatched export raises instead of passing quietly."""
    from safetensors.torch import save
    if not named_tensors:
        raise CheckpointError(f"{path}: refusing to export an empty set of weights")
    tensors = {name: t.detach().contiguous().cpu() for name, t in named_tensors.items()}
    data = save(tensors)
    atomic_write_bytes(path, data)
    verify_export(tensors, path)
    return len(data)


def verify_export(expected: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import load
    data = path.read_bytes()
    payload = sum(t.numel() * t.element_size() for t in expected.values())
    if len(data) < 8:
        raise CheckpointError(f"{path}: {len(data)} bytes is not a safetensors file")
    header = int.from_bytes(data[:8], "little")
    if len(data) != safetensors_file_bytes(header, payload):
        raise CheckpointError(f"{path}: {len(data)} bytes, expected 8 + {header} + {payload} "
                              f"for {len(expected)} tensors")
    loaded = load(data)
    if set(loaded) != set(expected):
        raise CheckpointError(f"{path}: holds {sorted(loaded)[:5]}, expected {sorted(expected)[:5]}")
    for name, tensor in expected.items():
        if not torch.equal(loaded[name], tensor):
            raise CheckpointError(f"{path}: tensor {name!r} differs from the live model")


# ============================================================================ 7. runs and checks


def run_training(ctx: RankContext, config: TrainConfig, ckpt_dir: Path, save_every: int,
                 keep: int, resume: bool = False, reshard: bool = False, async_save: bool = False,
                 stop_at: int | None = None, sleep_per_step: float = 0.0,
                 export_path: Path | None = None) -> dict:
    """Train (from scratch or from the latest checkpoint) to `config.steps` (or `stop_at`),
    saving every `save_every` steps. Returns the final parameters' sha256 and where it began."""
    trainer = Trainer(config, ctx.rank, ctx.world_size)
    resumed_from = 0
    if resume:
        manifest, shards = load_latest(ckpt_dir, ctx.world_size, reshard, config.fingerprint())
        trainer.load_shards(shards)
        resumed_from = manifest["step"]
        if ctx.rank == 0:
            discard_newer_than(ckpt_dir, resumed_from)
        dist.barrier()
    checkpointer = Checkpointer(ckpt_dir, keep, save_every, async_save)
    try:
        while trainer.step < (stop_at or config.steps):
            trainer.train_step()
            checkpointer.maybe_save(trainer)
            if sleep_per_step:
                time.sleep(sleep_per_step)
    finally:
        if dist.is_initialized():
            checkpointer.wait()
    exported = None
    if export_path is not None and ctx.rank == 0:
        exported = export_safetensors(dict(trainer.model.named_parameters()), export_path)
    return {"sha256": trainer.param_sha256(), "resumed_from": resumed_from, "step": trainer.step,
            "params": DP.flat_params(trainer.model).tolist(), "exported_bytes": exported}


def reference_params(config: TrainConfig) -> list[float]:
    """One process, the whole batch, no per-rank noise: what a resharded run must equal."""
    trainer = _SingleProcessTrainer(config)
    while trainer.step < config.steps:
        trainer.train_step()
    return DP.flat_params(trainer.model).tolist()


class _SingleProcessTrainer(Trainer):
    """The Trainer's math on one process with plain Adam (no dist)."""

    def __init__(self, config: TrainConfig):  # no super(): there is no process group here
        if config.noise:
            raise ValueError("the single-process reference exists only for noise=False")
        self.config, self.rank, self.world = config, 0, 1
        self.model = DP.make_model(config.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(config.warmup, config.steps))
        self.cursor = DataCursor(config.dataset, config.batch, config.seed)
        self.step = 0
        self.inputs, self.targets = make_dataset(config)

    def train_step(self) -> float:
        indices = self.cursor.next_indices()
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(self.inputs[indices]), self.targets[indices])
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return loss.item()


def full_state(shards: list[dict]) -> dict[str, torch.Tensor]:
    """Reassemble a checkpoint's full tensors (parameters and Adam moments, flattened) from
    the slices of every rank: what DCP must reproduce after its own resharding."""
    state = {}
    for name in shards[0]["params"]:
        state[f"param.{name}"] = torch.cat([s["params"][name] for s in shards])
        if name in shards[0]["exp_avg"]:
            state[f"exp_avg.{name}"] = torch.cat([s["exp_avg"][name] for s in shards])
            state[f"exp_avg_sq.{name}"] = torch.cat([s["exp_avg_sq"][name] for s in shards])
    return state


def dcp_save(ctx: RankContext, state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.distributed.checkpoint on the same state: every tensor becomes a DTensor sharded
    on dim 0 across this world (torch.chunk layout); dcp.save writes a file per rank plus
    its own metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    dcp.save({name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in state.items()},
             checkpoint_id=str(path))


def dcp_load(ctx: RankContext, sizes: dict[str, int], path: Path) -> dict[str, torch.Tensor]:
    """dcp.load in place into DTensors sharded across THIS world size, which may differ from
    the one that saved: DCP reshards at load time. Returns the full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    state = {name: distribute_tensor(torch.zeros(n, dtype=torch.float64), mesh, [Shard(0)])
             for name, n in sizes.items()}
    dcp.load(state, checkpoint_id=str(path))
    return {name: tensor.full_tensor() for name, tensor in state.items()}


def verify_worker(ctx: RankContext, config: dict, workdir: str, save_every: int, keep: int,
                  fault: str | None, fault_rank: int) -> dict:
    """Phase 1 of the demo on every rank: an uninterrupted run, an interrupted-and-resumed run,
    an async-save run and an export (all with per-rank noise); then a noise-free run saved at
    mid-training for the resharding check, and the same state saved with DCP."""
    inject_fault(ctx, fault, fault_rank)
    config = TrainConfig(**config)
    work = Path(workdir)
    full = run_training(ctx, config, work / "a", save_every, keep,
                        export_path=work / "model.safetensors")
    # What a crash between the second and the third save leaves on disk: the checkpoints up
    # to the second save, `latest` naming it. A fresh trainer resumes from there.
    if ctx.rank == 0:
        shutil.copytree(work / "a", work / "b")
        second = step_dir_name(save_every * 2)
        for child in (work / "b").iterdir():
            if STEP_DIR.match(child.name) and child.name > second:
                shutil.rmtree(child)
        atomic_write_bytes(work / "b" / LATEST, (second + "\n").encode())
    dist.barrier()
    resumed = run_training(ctx, config, work / "b", save_every, keep, resume=True)
    asynchronous = run_training(ctx, config, work / "c", save_every, keep, async_save=True)
    plain = dataclasses.replace(config, noise=False)
    run_training(ctx, plain, work / "e", save_every, keep, stop_at=save_every * 2)
    _, shards = load_latest(work / "e", ctx.world_size, False, plain.fingerprint())
    dcp_save(ctx, full_state(shards), work / "dcp")
    return {"full": full["sha256"], "resumed": resumed["sha256"],
            "resumed_from": resumed["resumed_from"], "async": asynchronous["sha256"],
            "exported_bytes": full["exported_bytes"]}


def reshard_worker(ctx: RankContext, config: dict, workdir: str) -> dict:
    """Phase 2, on a different number of ranks: resume the noise-free checkpoint with
    resharding and train to the end; load the DCP checkpoint with load-time resharding."""
    plain = dataclasses.replace(TrainConfig(**config), noise=False)
    work = Path(workdir)
    run = run_training(ctx, plain, work / "e", save_every=0, keep=1, resume=True, reshard=True)
    _, shards = load_latest(work / "e", None, True, plain.fingerprint())
    sizes = {name: t.numel() for name, t in full_state(shards).items()}
    loaded = dcp_load(ctx, sizes, work / "dcp")
    return {"params": run["params"], "resumed_from": run["resumed_from"],
            "dcp": {name: t.tolist() for name, t in loaded.items()}}


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
        data = (d / first).read_bytes()
        (d / first).write_bytes(data[: len(data) - 10])

    def duplicate(data: dict) -> None:
        data["files"].append(dict(data["files"][0]))

    def extra_rank(data: dict) -> None:
        extra = dict(data["files"][0], rank=world, name=shard_name(world, world))
        data["files"].append(extra)

    def escape(data: dict) -> None:
        data["files"][0]["name"] = "../../etc/passwd"

    cases = [
        ("a flipped byte", flip_byte, first, "sha256 mismatch"),
        ("a truncated shard", truncate, first, "truncated"),
        ("a missing shard", lambda d: (d / first).unlink(), first, "missing shard"),
        ("a duplicate rank", edit_manifest(duplicate), MANIFEST, "duplicate rank"),
        ("an extra rank", edit_manifest(extra_rank), MANIFEST, "extra rank"),
        ("a path escaping the directory", edit_manifest(escape), MANIFEST, "escapes"),
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
        try:
            verify_checkpoint(target, world)
            message = "accepted"
        except CheckpointError as exc:
            message = str(exc)
        ok = expected in message and culprit in message
        checks.append(Check(f"load rejects {label}", ok, message[:110]))
    try:
        verify_checkpoint(step_dir, world + 1)
        message = "accepted"
    except CheckpointError as exc:
        message = str(exc)
    checks.append(Check("load rejects a world-size mismatch without --reshard",
                        "pass --reshard" in message and MANIFEST in message, message[:110]))
    return checks


SAVE_CRASH_POINTS = (f"{shard_name(0, 1)}:written", f"{MANIFEST}:written", "committed",
                     f"{LATEST}:written", "latest")


def crash_during_save_checks(scratch: Path) -> list[Check]:
    """Simulate a crash at every point of the save protocol (one rank, no process group):
    afterwards the latest verified checkpoint must be the old one (crash before the manifest's
    rename) or the new one (after it), never a broken one."""
    checks = []
    for point in SAVE_CRASH_POINTS:
        ckpt = scratch / f"crash-{point.replace(':', '-')}"
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(parents=True)
        for step, crash_at in ((1, None), (2, point)):
            step_dir = ckpt / step_dir_name(step)
            step_dir.mkdir()
            payload = serialize({"step": step})
            try:
                entry = write_shard(step_dir, 0, 1, payload, crash_at)
                commit(ckpt, step, 1, [entry], "f", keep=1, crash_at=crash_at)
            except SimulatedCrash:
                pass
        try:
            step_dir = read_latest(ckpt)
            verify_checkpoint(step_dir, 1)
            loaded = torch.load(io.BytesIO((step_dir / shard_name(0, 1)).read_bytes()))["step"]
            # until `latest` has moved, it still names step 1 (even if step 2 is committed)
            expected = 2 if point == "latest" else 1
            ok = loaded == expected
            detail = f"latest loads step {loaded}, expected {expected}"
        except CheckpointError as exc:
            ok, detail = False, str(exc)[:100]
        checks.append(Check(f"crash at '{point}' leaves a loadable checkpoint", ok, detail))
    return checks


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Sharded, atomic, verified checkpoints with exact resume, "
                           "resharding and export; compared with torch.distributed.checkpoint.")
    parser.add_argument("--ckpt-dir", type=Path, help="train into this directory (without it: "
                        "the full demo in a temporary directory)")
    parser.add_argument("--steps", type=int_in(1, 100_000), default=8, help="training steps (default 8)")
    parser.add_argument("--save-every", type=int_in(1), default=3, help="save every K steps (default 3)")
    parser.add_argument("--keep", type=int_in(1), default=2, help="keep the newest J checkpoints (default 2)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--reshard", action="store_true",
                        help="allow resuming with a different --world-size")
    parser.add_argument("--async-save", action="store_true", help="write shards in the background")
    parser.add_argument("--batch", type=int_in(1, 4096), default=24, help="global batch (default 24)")
    parser.add_argument("--sleep-per-step", type=float_in(0.0, 60.0), default=0.0,
                        help="slow training down, to kill it by hand and resume")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.batch % args.world_size:
        parser.error(f"--batch {args.batch} is not divisible by --world-size {args.world_size}")
    if 96 % args.batch:
        parser.error(f"--batch {args.batch} must divide the dataset size 96")
    if (args.resume or args.reshard) and args.ckpt_dir is None:
        parser.error("--resume and --reshard need --ckpt-dir")
    return args


def run_worker(ctx: RankContext, config: dict, ckpt_dir: str, save_every: int, keep: int,
               resume: bool, reshard: bool, async_save: bool, sleep_per_step: float,
               fault: str | None, fault_rank: int) -> dict:
    """The CLI's training run on one rank."""
    inject_fault(ctx, fault, fault_rank)
    return run_training(ctx, TrainConfig(**config), Path(ckpt_dir), save_every, keep, resume,
                        reshard, async_save, sleep_per_step=sleep_per_step,
                        export_path=Path(ckpt_dir) / "model.safetensors")


def train_cli(args, config: TrainConfig) -> Report:
    """`--ckpt-dir`: a real run. A bad checkpoint directory is refused here, in the parent,
    with one line, before any rank starts."""
    if args.resume:
        step_dir = read_latest(args.ckpt_dir)
        verify_checkpoint(step_dir, args.world_size, args.reshard, config.fingerprint())
    else:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if (args.ckpt_dir / LATEST).exists():
            raise CheckpointError(f"{args.ckpt_dir}: already holds checkpoints; pass --resume "
                                  "to continue, or use a new directory")
    results = launch(run_worker, args.world_size,
                     (dataclasses.asdict(config), str(args.ckpt_dir), args.save_every, args.keep,
                      args.resume, args.reshard, args.async_save, args.sleep_per_step,
                      args.fault, args.fault_rank), device="cpu", timeout_s=args.timeout)
    manifest = verify_checkpoint(read_latest(args.ckpt_dir), len(results), False,
                                 config.fingerprint())
    steps = committed_steps(args.ckpt_dir)
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
    return Report(LESSON, "cpu", "gloo", len(results), checks, metrics)


def demo(args, config: TrainConfig) -> Report:
    """The self-checking demo in a temporary directory."""
    other_world = 2 if args.world_size != 2 else 3
    with tempfile.TemporaryDirectory(prefix="lesson06-") as tmp:
        work = Path(tmp)
        first = launch(verify_worker, args.world_size,
                       (dataclasses.asdict(config), tmp, args.save_every, args.keep, args.fault,
                        args.fault_rank), device="cpu", timeout_s=args.timeout)
        second = launch(reshard_worker, other_world, (dataclasses.asdict(config), tmp),
                        device="cpu", timeout_s=args.timeout)
        r0 = first[0]
        checks = [
            Check("every rank ends with the same parameters",
                  len({r["full"] for r in first}) == 1, r0["full"][:16]),
            Check(f"crash after step {args.save_every * 2}'s save, resumed: bit-identical",
                  all(r["resumed"] == r["full"] for r in first),
                  f"resumed from step {r0['resumed_from']}; sha256 {r0['resumed'][:16]}"),
            Check("asynchronous saves: same run, valid checkpoints",
                  all(r["async"] == r["full"] for r in first)
                  and bool(verify_checkpoint(read_latest(work / "c"), args.world_size)),
                  f"latest {read_latest(work / 'c').name}"),
        ]
        steps = committed_steps(work / "a")
        expected = kept_steps(config.steps, args.save_every, args.keep)
        checks.append(Check(f"rotation keeps the newest {args.keep} by step number",
                            steps == expected, f"committed {steps}"))
        checks.append(Check("export from the live model verified (size, round trip)",
                            bool(r0["exported_bytes"]), f"{r0['exported_bytes']} bytes"))
        try:
            verify_export({"w": torch.ones(3)}, _write_empty_export(work))
            message = "accepted"
        except CheckpointError as exc:
            message = str(exc)
        checks.append(Check("an empty export (the 200-byte file) is caught", "expected" in message,
                            message[:100]))
        checks += corrupt_and_expect(read_latest(work / "a"), work, args.world_size)
        checks += crash_during_save_checks(work)
        plain = dataclasses.replace(config, noise=False)
        reference = reference_params(plain)
        gap = max(DP.max_abs_diff(r["params"], reference) for r in second)
        checks.append(Check(f"resharded {args.world_size} -> {other_world} ranks == unsharded "
                            "reference", gap <= RESHARD_TOLERANCE and second[0]["resumed_from"] > 0,
                            f"resumed at step {second[0]['resumed_from']}; max |diff| {gap:.1e}"))
        _, shards = load_latest(work / "e", None, True, plain.fingerprint())
        ours = full_state(shards)
        same = all(torch.equal(torch.tensor(second[0]["dcp"][name], dtype=torch.float64), t)
                   for name, t in ours.items())
        checks.append(Check(f"dcp.save on {args.world_size} ranks, dcp.load on {other_world} "
                            "== our checkpoint", same, f"{len(ours)} tensors, bitwise"))
    metrics = {"final_param_sha256": r0["full"], "resumed_from_step": r0["resumed_from"],
               "exported_bytes": r0["exported_bytes"], "reshard_max_diff": gap,
               "headline": f"resume bit-exact from step {r0['resumed_from']}; "
                           f"{len(SAVE_CRASH_POINTS)} crash points safe"}
    return Report(LESSON, "cpu", "gloo", args.world_size, checks, metrics)


def _write_empty_export(work: Path) -> Path:
    """The production failure: an export that serialised an empty map."""
    from safetensors.torch import save
    path = work / "empty.safetensors"
    path.write_bytes(save({}))
    return path


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    config = TrainConfig(seed=args.seed, steps=args.steps, batch=args.batch)
    try:
        report = train_cli(args, config) if args.ckpt_dir else demo(args, config)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return finish(report, args.json, started)


if __name__ == "__main__":
    run_main(main)
