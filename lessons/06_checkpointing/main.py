"""Lesson 06: sharded, atomic, verified checkpoints; exact resume; resharding; export.

The protocol, top to bottom (the ZeRO trainer that exercises it is in trainer.py; the damage,
crash and failure checks, the comparison with torch.distributed.checkpoint and the CLI are in
checks.py):

1. One file, atomically: temp file in the same directory, fsync, os.replace, fsync the directory.
2. Many files, atomically: every rank writes its shard that way; rank 0 then writes the
   manifest (each file's size and sha256: the step can now verify itself), then moves `latest`
   (the run's commit point), then rotates old checkpoints away. A write that fails on any rank
   commits nothing, and every rank hears of it.
3. Verified load: `latest`, the manifest and every byte are checked before anything is used.
4. Resharding: N saved slices of a tensor become M slices (lesson 03's `shard_bounds`).
5. Export: safetensors, written from the live model and verified by size and round trip.
6. Exact resume: besides weights and optimizer, the LR the schedule last wrote, the gradient
   scaler, the data cursor and this rank's RNG states. How often to save: Young / Daly.
"""

from __future__ import annotations

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
import threading
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

zero = importlib.import_module("lessons.03_zero.main")  # lesson 03's technique: shard_bounds

FORMAT_VERSION = 1
MANIFEST, LATEST = "manifest.json", "latest"
SHARD_NAME = re.compile(r"^shard-(\d{5})-of-(\d{5})\.pt$")
STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or was not saved. The message starts with the path."""


# ============================================================================ 1. one file, atomically


# exercise atomic-write (2 points): One file, atomically: temp file, fsync, os.replace, fsync the directory
# hint: the order is everything: write, flush, os.fsync(handle.fileno()), os.replace, then
#   fsync_directory(path.parent). A rename before the fsync can publish an empty file.
def fsync_directory(path: Path) -> None:
    """fsync a directory: a new name or a rename in it is a change to the directory itself and
    needs its own fsync to survive a power loss (fsync(2)). Open it read-only with `os.open`,
    `os.fsync` the descriptor, and close it even if the fsync raises. Returns None."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# exercise atomic-write (continued)
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` by `data` so that every reader, after any crash, sees the old file or the
    new one, never a part of either.

    Steps: write a temporary file in the SAME directory (same filesystem, so the rename is
    atomic), named `.{path.name}.tmp-{os.getpid()}-{threading.get_ident()}` (unique per process
    and thread: asynchronous saves write from threads); flush and `os.fsync` it (the bytes are
    on disk); `os.replace` it over `path` (the atomic switch); `fsync_directory(path.parent)`
    (the new name is on disk). The calls go through this module's `os` (the tests watch them).
    Cost: len(data) bytes written, two fsyncs. A crash before os.replace leaves the old `path`
    and the stray temp file; nothing is returned, and no temp file is left after success.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ============================================================================ 2. many files, atomically


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def serialize(state: dict) -> bytes:
    """torch.save into memory: the bytes ARE the snapshot (training may go on meanwhile)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# exercise commit (3 points): Many files, atomically: shard entries, the two commits, rotation
# hint: commit = atomic_write_bytes(manifest), atomic_write_bytes(latest), rotate, in that order;
#   rotate sorts committed steps by NUMBER and removes all but the last `keep`.
def write_shard(step_dir: Path, rank: int, world: int, payload: bytes) -> dict:
    """Phase 1, on every rank: write this rank's shard `step_dir / shard_name(rank, world)`
    with `atomic_write_bytes` and return its manifest entry
    {"name": shard_name(rank, world), "rank": rank, "bytes": len(payload),
    "sha256": sha256_hex(payload)}."""
    name = shard_name(rank, world)
    atomic_write_bytes(step_dir / name, payload)
    return {"name": name, "rank": rank, "bytes": len(payload), "sha256": sha256_hex(payload)}


# exercise commit (continued)
def commit(ckpt_dir: Path, step: int, world: int, entries: list[dict], fingerprint: str,
           keep: int) -> None:
    """Phase 2, on rank 0 once every shard is on disk. Two commits, two roles:

    1. `step-N/manifest.json`, the JSON object {"format_version": FORMAT_VERSION,
       "world_size": world, "step": step, "fingerprint": fingerprint, "files": entries sorted
       by rank} (each entry as `write_shard` returned it: name, rank, bytes, sha256), written
       with `atomic_write_bytes`: step N is now complete and SELF-VERIFYING (a reader can prove
       every byte without trusting anything else).
    2. `latest` <- "step-N\n" (`step_dir_name(step)` and a newline), with `atomic_write_bytes`:
       the RUN's commit point; resume starts here.
    3. rotate(ckpt_dir, keep): only now may old checkpoints go.

    A crash before 1 leaves step N uncommitted; between 1 and 2 it leaves step N complete but
    not chosen (resume discards it); after 2 the new step is in charge. Never the reverse order.
    """
    manifest = {"format_version": FORMAT_VERSION, "world_size": world, "step": step,
                "fingerprint": fingerprint, "files": sorted(entries, key=lambda e: e["rank"])}
    step_dir = ckpt_dir / step_dir_name(step)
    atomic_write_bytes(step_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    atomic_write_bytes(ckpt_dir / LATEST, (step_dir.name + "\n").encode())
    rotate(ckpt_dir, keep)


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the step directories that hold a manifest, oldest first."""
    return sorted(int(m.group(1)) for child in ckpt_dir.iterdir()
                  if (m := STEP_DIR.match(child.name)) and (child / MANIFEST).exists())


# exercise commit (continued)
def rotate(ckpt_dir: Path, keep: int) -> list[int]:
    """Keep the newest `keep` committed checkpoints BY STEP NUMBER (never by file time, which
    a copy or a clock step can reorder) and remove uncommitted leftovers (step directories
    without a manifest) older than the newest commit; newer ones stay (`discard_newer_than`
    handles them on resume). `keep < 1` raises ValueError. Returns the committed steps removed,
    oldest first."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    steps = committed_steps(ckpt_dir)
    newest = steps[-1] if steps else -1
    for child in ckpt_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and not (child / MANIFEST).exists() and int(match.group(1)) < newest:
            shutil.rmtree(child, ignore_errors=True)
    for step in steps[:-keep]:
        shutil.rmtree(ckpt_dir / step_dir_name(step), ignore_errors=True)
    return steps[:-keep]


def discard_newer_than(ckpt_dir: Path, step: int) -> list[str]:
    """On resume from `step`: step directories above it (committed but never named by `latest`,
    or half-written) belong to a future that no longer happens; remove them so that rotation by
    step number never keeps them over the resumed run's checkpoints."""
    removed = [child.name for child in ckpt_dir.iterdir()
               if (m := STEP_DIR.match(child.name)) and int(m.group(1)) > step]
    for name in removed:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
    return removed


class Checkpointer:
    """Saves a trainer every `save_every` steps into `ckpt_dir` (one directory that every rank
    sees), synchronously or in the background.

    The trainer is any object with `.step`, `.config.fingerprint()` and `.shard_state()` (this
    rank's picklable state); the process group must be initialised. `save`: rank 0 creates
    step-N/, every rank serialises its state (the snapshot) and writes its shard, then
    `_commit_everywhere` all-gathers each rank's entry and rank 0 commits. With `async_save`
    the write runs in a thread while training goes on, and `wait()` (before the next save and
    at exit) commits it: the commit needs every rank, so it stays on the main thread.

    A save that fails on ANY rank (the write or the commit raises) commits nothing: `latest`
    and every older checkpoint stay as they were (rotation runs only after a commit), and
    every rank raises the same CheckpointError naming the failing rank.
    """

    def __init__(self, ckpt_dir: Path, keep: int, save_every: int, async_save: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.ckpt_dir, self.keep, self.save_every = Path(ckpt_dir), keep, save_every
        self.async_save = async_save
        self._pending: tuple[threading.Thread, int, str] | None = None  # thread, step, fingerprint
        self._outcome: dict = {}

    def maybe_save(self, trainer) -> None:
        if self.save_every and trainer.step % self.save_every == 0:
            self.save(trainer)

    def save(self, trainer) -> None:
        self.wait()
        rank, world = dist.get_rank(), dist.get_world_size()
        step_dir = self.ckpt_dir / step_dir_name(trainer.step)
        if rank == 0:
            shutil.rmtree(step_dir, ignore_errors=True)  # a half-written leftover of a crash
            step_dir.mkdir(parents=True)
        dist.barrier()
        payload = serialize(trainer.shard_state())

        def write() -> None:
            try:
                self._outcome = write_shard(step_dir, rank, world, payload)
            except Exception as exc:  # reported to every rank by _commit_everywhere
                self._outcome = {"error": f"{type(exc).__name__}: {exc}"}

        job = (trainer.step, trainer.config.fingerprint())
        if self.async_save:
            thread = threading.Thread(target=write)
            thread.start()
            self._pending = (thread, *job)
        else:
            write()
            self._commit_everywhere(*job)

    def wait(self) -> None:
        """Finish the pending asynchronous save (if any) on every rank and commit it."""
        if self._pending is not None:
            thread, step, fingerprint = self._pending
            thread.join()
            self._pending = None
            self._commit_everywhere(step, fingerprint)

    # exercise failure-safe-save (3 points): Every rank agrees before the commit
    # hint: dist.all_gather_object the outcomes; rank 0 commits only if none holds "error";
    #   dist.broadcast_object_list rank 0's verdict, so every rank raises the same error.
    def _commit_everywhere(self, step: int, fingerprint: str) -> None:
        """Collective, on every rank, after this rank's write of step `step` finished:
        `self._outcome` is this rank's manifest entry or {"error": "Type: message"}. Gather
        every rank's outcome (rank order). If none failed, rank 0 calls
        `commit(self.ckpt_dir, step, world, outcomes, fingerprint, self.keep)`; an exception
        there is a failure of "rank 0 (commit)". Every rank then learns rank 0's verdict and,
        if anything failed, raises CheckpointError(f"{step_dir}: not saved ({errors}); latest
        and older checkpoints are untouched") (step_dir: self.ckpt_dir / step_dir_name(step))
        with errors "rank r: Type: message" joined by "; ", the same message on every rank.
        No rank commits when any rank failed; without failures nothing is raised."""
        world = dist.get_world_size()
        outcomes: list = [None] * world
        dist.all_gather_object(outcomes, self._outcome)
        errors = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if "error" in o]
        if not errors and dist.get_rank() == 0:
            try:
                commit(self.ckpt_dir, step, world, outcomes, fingerprint, self.keep)
            except Exception as exc:
                errors = [f"rank 0 (commit): {type(exc).__name__}: {exc}"]
        verdict = [errors]
        dist.broadcast_object_list(verdict, src=0)  # every rank learns what rank 0 decided
        if verdict[0]:
            raise CheckpointError(f"{self.ckpt_dir / step_dir_name(step)}: not saved "
                                  f"({'; '.join(verdict[0])}); latest and older checkpoints "
                                  "are untouched")


# ============================================================================ 3. verified load


# exercise verified-load (4 points): Verified load: prove every byte before anything is used
# hint: check the manifest's fields before trusting them, the file list against ranks 0..W-1,
#   then each file's size and sha256; every error message starts with the offending path.
def read_latest(ckpt_dir: Path) -> Path:
    """The step directory `latest` names (its text, stripped). CheckpointError when
    `ckpt_dir` is not a directory ("no such checkpoint directory"), `latest` is missing
    ("holds no committed checkpoint"), its text is not a step-N name matching STEP_DIR ("is
    not a step directory name": a path escaping the directory is refused), or that directory
    does not exist ("which is missing")."""
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


# exercise verified-load (continued)
def verify_checkpoint(step_dir: Path, world: int | None, reshard: bool = False,
                      fingerprint: str | None = None) -> dict:
    """Prove a checkpoint before anything is used; return its manifest.

    In order: the manifest exists (else: never committed) and parses; its format version is
    known; its fields have their types; the run fingerprint matches (if given); the saved world
    size equals `world` unless `reshard`; the files are exactly ranks 0..W-1, each once, named
    shard-r-of-W.pt (no missing, extra, duplicate or path-escaping name, no stray shard file
    in the directory); every file has the manifest's size and sha256. Any failure raises
    CheckpointError whose message starts with the offending file and contains, by case:
    manifest absent "never committed"; unparsable "not valid JSON"; version V
    f"format_version {V!r} is unknown"; a field missing or of the wrong type (bool is not
    int) f"field {name!r} missing or not {type}"; another fingerprint "belongs to another
    run"; another world size "pass --reshard"; an entry without its four keys "needs name,
    rank, bytes and sha256"; a name with "/" or "\\" or "." / ".." "escapes the checkpoint
    directory" (the manifest is the culprit); a name that is not shard_name(rank, W) "is not
    the shard name"; a rank twice "duplicate rank"; a rank >= W "extra rank"; a rank of
    0..W-1 not listed "missing shard" (names shard_name(r, W)); a shard-*.pt file not listed
    "extra shard file"; a listed file absent "missing shard"; another size
    f"{size} bytes, the manifest says {bytes} (truncated or extended)"; another sha256
    "sha256 mismatch". Cost: one read of every byte.
    """
    manifest_path = step_dir / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{manifest_path}: missing: the checkpoint was never committed")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{manifest_path}: format_version {version!r} is unknown "
                              f"(this code reads {FORMAT_VERSION})")
    for field, kind in (("world_size", int), ("step", int), ("files", list), ("fingerprint", str)):
        if not isinstance(manifest.get(field), kind) or isinstance(manifest.get(field), bool):
            raise CheckpointError(f"{manifest_path}: field {field!r} missing or not {kind.__name__}")
    saved = manifest["world_size"]
    if fingerprint is not None and manifest["fingerprint"] != fingerprint:
        raise CheckpointError(f"{manifest_path}: fingerprint {manifest['fingerprint']} belongs "
                              f"to another run configuration (expected {fingerprint})")
    if world is not None and saved != world and not reshard:
        raise CheckpointError(f"{manifest_path}: saved by {saved} ranks but {world} are "
                              "running; pass --reshard to load it into a different world size")
    seen: dict[int, str] = {}
    for index, entry in enumerate(manifest["files"]):
        where = f"{manifest_path}: files[{index}]"
        if not isinstance(entry, dict) or not {"name", "rank", "bytes", "sha256"} <= set(entry):
            raise CheckpointError(f"{where}: needs name, rank, bytes and sha256")
        name, rank = entry["name"], entry["rank"]
        if not isinstance(name, str) or "/" in name or "\\" in name or name in (".", ".."):
            raise CheckpointError(f"{where}: name {name!r} escapes the checkpoint directory")
        match = SHARD_NAME.match(name)
        if not match or int(match.group(2)) != saved or int(match.group(1)) != rank:
            raise CheckpointError(f"{where}: {name!r} is not the shard name of rank {rank} of {saved}")
        if rank in seen:
            raise CheckpointError(f"{where}: duplicate rank {rank} ({seen[rank]} and {name})")
        if not 0 <= rank < saved:
            raise CheckpointError(f"{where}: extra rank {rank}: world size is {saved}")
        seen[rank] = name
    missing = sorted(set(range(saved)) - set(seen))
    if missing:
        raise CheckpointError(f"{step_dir / shard_name(missing[0], saved)}: missing shard of "
                              f"rank {missing[0]} (not in the manifest)")
    for child in step_dir.iterdir():
        if SHARD_NAME.match(child.name) and child.name not in seen.values():
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


# exercise verified-load (continued)
def load_latest(ckpt_dir: Path, world: int | None, reshard: bool,
                fingerprint: str | None) -> tuple[dict, list[dict]]:
    """Verify the checkpoint `latest` names, then read every shard (resharding needs them all)
    with torch.load(weights_only=True): tensors and plain data only, no code runs on load.
    Returns (manifest, shards in the manifest's rank order); a shard that cannot be loaded
    raises CheckpointError(f"{path}: cannot be deserialised (...)")."""
    step_dir = read_latest(ckpt_dir)
    manifest = verify_checkpoint(step_dir, world, reshard, fingerprint)
    shards = []
    for entry in manifest["files"]:
        path = step_dir / entry["name"]
        try:
            shards.append(torch.load(io.BytesIO(path.read_bytes()), weights_only=True))
        except Exception as exc:  # a valid hash of an unreadable payload: say which file
            raise CheckpointError(f"{path}: cannot be deserialised ({exc})") from None
    return manifest, shards


# ============================================================================ 4. resharding


def reshard(slices: list[torch.Tensor], world: int, rank: int) -> torch.Tensor:
    """N saved slices of one flattened tensor (rank order, lesson 03's near-equal chunks) ->
    this rank's slice of an M-way split: cat, then `zero.shard_bounds(numel, M, rank)`. Valid
    for parameters and Adam's moments, which are element-wise. Cost: one full tensor in memory."""
    full = torch.cat([s.reshape(-1) for s in slices])
    start, end = zero.shard_bounds(full.numel(), world, rank)
    return full[start:end].clone()


# ============================================================================ 5. export


def safetensors_file_bytes(header_bytes: int, tensor_bytes: int) -> int:
    """Size of a safetensors file: 8-byte little-endian header length + JSON header + data."""
    return 8 + header_bytes + tensor_bytes


def export_safetensors(named_tensors: dict[str, torch.Tensor], path: Path) -> int:
    """Write the LIVE weights (CPU copies) with safetensors, atomically, then `verify_export`.
    Returns the file's bytes. An empty map is refused: that is how 25 hours became 200 bytes."""
    from safetensors.torch import save
    if not named_tensors:
        raise CheckpointError(f"{path}: refusing to export an empty set of weights")
    tensors = {name: t.detach().contiguous().cpu() for name, t in named_tensors.items()}
    data = save(tensors)
    atomic_write_bytes(path, data)
    verify_export(tensors, path)
    return len(data)


def verify_export(expected: dict[str, torch.Tensor], path: Path) -> None:
    """Check an exported file against the live tensors: it holds tensors at all (a
    metadata-only file is valid safetensors and loads without error), its size is
    8 + header + sum of the tensors' bytes, its names are the expected ones, and every tensor
    round-trips bit for bit. Raises CheckpointError naming the file."""
    from safetensors.torch import load
    data = path.read_bytes()
    if len(data) < 8:
        raise CheckpointError(f"{path}: {len(data)} bytes is not a safetensors file")
    header = int.from_bytes(data[:8], "little")
    try:
        names = [k for k in json.loads(data[8:8 + header]) if k != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: the header is not valid JSON") from None
    if not names:
        raise CheckpointError(f"{path}: holds no tensors ({len(data)} bytes of header and "
                              f"metadata only), expected {len(expected)}")
    payload = sum(t.numel() * t.element_size() for t in expected.values())
    if len(data) != safetensors_file_bytes(header, payload):
        raise CheckpointError(f"{path}: {len(data)} bytes, expected 8 + {header} + {payload} "
                              f"for {len(expected)} tensors")
    loaded = load(data)
    if set(loaded) != set(expected):
        raise CheckpointError(f"{path}: holds {sorted(loaded)[:5]}, expected {sorted(expected)[:5]}")
    for name, tensor in expected.items():
        if not torch.equal(loaded[name], tensor.detach().cpu()):
            raise CheckpointError(f"{path}: tensor {name!r} differs from the live model")


# ============================================================================ 6. exact resume


class DataCursor:
    """Walks a dataset of `dataset` examples in a new order every epoch (randperm from a
    generator seeded by (seed, epoch)), `batch` indices at a time. State: (epoch, position)."""

    def __init__(self, dataset: int, batch: int, seed: int):
        if dataset % batch:
            raise ValueError(f"dataset {dataset} is not a multiple of batch {batch}")
        self.dataset, self.batch, self.seed = dataset, batch, seed
        self.epoch, self.position = 0, 0

    def next_indices(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.dataset, generator=generator)
        indices = order[self.position:self.position + self.batch]
        self.position += self.batch
        if self.position == self.dataset:
            self.epoch, self.position = self.epoch + 1, 0
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def cosine_with_warmup(warmup: int, total: int):
    """LR multiplier for LambdaLR: (step + 1) / warmup while step < warmup, then cosine decay
    0.5 (1 + cos(pi min(1, (step - warmup) / (total - warmup)))) to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


# exercise exact-resume (3 points): Exact resume: LR, scheduler, scaler, data cursor and RNG states
# hint: after scheduler.load_state_dict, write the saved LR into every param group: a fresh
#   scheduler holds factor(0) x base LR. Restore the RNG states last.
def rng_state(device: torch.device | str | None = None) -> dict:
    """This rank's generators: {"python": random.getstate(), "torch": torch.get_rng_state()}
    and, only when `device` is a CUDA device, "cuda": torch.cuda.get_rng_state(THAT device)
    (never get_rng_state_all: it would initialise CUDA on every device, make the bytes depend
    on the machine, and fail to load on a box with fewer GPUs)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


# exercise exact-resume (continued)
def set_rng_state(state: dict, device: torch.device | str | None = None) -> None:
    """Restore what `rng_state(device)` saved (the CUDA generator of `device` when present)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], torch.device(device))


# exercise exact-resume (continued)
def exact_resume_state(step: int, optimizer, scheduler, scaler, cursor: DataCursor,
                       device: torch.device | str | None = None) -> dict:
    """The small state exact resume needs besides the weights and the Adam moments: the step;
    the scheduler's state_dict AND the LR each param group holds now (a scheduler writes the
    LR after each step; a freshly built one holds factor(0) x base LR, so restoring only its
    state_dict runs ONE step at the initial LR: nanotron PR 245); the GradScaler's state (scale
    and growth tracker: they decide which fp16 steps overflow and are skipped), or None; the
    data cursor; this rank's RNG states. Plain data and CPU tensors: torch.load(weights_only).
    Returns {"step", "scheduler", "lr" (one float per param group), "scaler", "cursor", "rng"}."""
    return {"step": step, "scheduler": scheduler.state_dict(),
            "lr": [group["lr"] for group in optimizer.param_groups],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "cursor": cursor.state_dict(), "rng": rng_state(device)}


# exercise exact-resume (continued)
def restore_exact_resume_state(state: dict, optimizer, scheduler, scaler, cursor: DataCursor,
                               device: torch.device | str | None = None,
                               restore_rng: bool = True) -> int:
    """Inverse of `exact_resume_state`, in place; returns the step. Restores the scheduler's
    state_dict, then writes the saved LR into each param group (a different number of groups
    raises ValueError: zip(..., strict=True)), the scaler (skipped when `scaler` is None), the
    cursor and, unless `restore_rng=False` (the saved streams belong to another layout, when
    resharding), this rank's RNG states. Afterwards the next step runs exactly as it would
    have without the interruption: same LR, same loss scale, same batch, same random draws."""
    scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(optimizer.param_groups, state["lr"], strict=True):
        group["lr"] = lr
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    cursor.load_state_dict(state["cursor"])
    if restore_rng:
        set_rng_state(state["rng"], device)
    return int(state["step"])


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young (1974): the compute time between checkpoints that minimises the expected lost
    time, tau = sqrt(2 C M) for save cost C and mean time between failures M (first order,
    C << M). The time lost per unit of work is then about C/tau + tau/(2M) = sqrt(2C/M)."""
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly (2006), higher-order optimum: tau = sqrt(2CM) [1 + (1/3) sqrt(C/2M) + (1/9) (C/2M)]
    - C when C < 2M, else tau = M. Close to Young's when C << M."""
    if save_seconds >= 2.0 * mtbf_seconds:
        return mtbf_seconds
    ratio = save_seconds / (2.0 * mtbf_seconds)
    return young_interval(save_seconds, mtbf_seconds) * (
        1 + math.sqrt(ratio) / 3 + ratio / 9) - save_seconds


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
