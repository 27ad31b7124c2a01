"""Lesson 06: sharded, atomic, verified checkpoints; exact resume; resharding; export.

The technique, in reading order (trainer.py is the ZeRO trainer that exercises it; checks.py
holds the damage, crash and failure checks, the comparison with DCP and the CLI):

atomic_file.py   1. One file, atomically: temp file in the same directory, fsync, os.replace,
                 fsync the directory. 2. The export: safetensors from the live model, proven.
main.py          3. Many files, atomically: each rank writes its shard that way; rank 0 then
                 writes the manifest (each file's size and sha256: the step verifies itself),
                 moves `latest` (the run's commit point) and rotates; a write that fails on any
                 rank commits nothing, on every rank. 4. Verified load: `latest`, the manifest
                 and every byte are checked before anything is used.
exact_resume.py  5. Exact resume: data cursor, the LR the schedule last wrote, gradient scaler,
                 RNG states. 6. Resharding N saved slices into M. 7. How often to save.
"""

from __future__ import annotations

import importlib
import io
import json
import re
import shutil
import sys
import threading
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

atomic_file = importlib.import_module("lessons.06_checkpointing.atomic_file")  # parts 1-2
exact_resume = importlib.import_module("lessons.06_checkpointing.exact_resume")  # parts 5-7
# Part 1 as the protocol below uses it, and the names later lessons import from here:
CheckpointError, atomic_write_bytes, sha256_hex = (
    atomic_file.CheckpointError, atomic_file.atomic_write_bytes, atomic_file.sha256_hex)
export_safetensors, verify_export = atomic_file.export_safetensors, atomic_file.verify_export
cosine_with_warmup, rng_state, set_rng_state = (
    exact_resume.cosine_with_warmup, exact_resume.rng_state, exact_resume.set_rng_state)

FORMAT_VERSION = 1
MANIFEST, LATEST = "manifest.json", "latest"
SHARD_NAME = re.compile(r"^shard-(\d{5})-of-(\d{5})\.pt$")
STEP_DIR = re.compile(r"^step-(\d{8})$")


# ============================================================================ 3. many files, atomically


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
    of `group` sees; default the world), synchronously or in the background. The trainer is any
    object with `.step`, `.config.fingerprint()` and `.shard_state()` (this rank's picklable
    state). Ranks, shard names and the world size of the checkpoint are those of `group`.
    `save`: group rank 0 creates step-N/, every rank serialises its state (the snapshot) and
    writes its shard, then `_commit_everywhere` decides, on every rank. With `async_save` the
    write runs in a thread while training goes on, and `wait()` (before the next save and at
    exit) commits it: the commit needs every rank, so it stays on the main thread. A save that
    fails on ANY rank commits nothing (`latest` and every older checkpoint stay as they were)
    and raises the same CheckpointError on every rank."""

    def __init__(self, ckpt_dir: Path, keep: int, save_every: int, async_save: bool = False,
                 group: dist.ProcessGroup | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.ckpt_dir, self.keep, self.save_every = Path(ckpt_dir), keep, save_every
        self.async_save, self.group = async_save, group
        self._pending: tuple[threading.Thread, int, str] | None = None  # thread, step, fingerprint
        self._outcome: dict = {}

    def maybe_save(self, trainer) -> None:
        if self.save_every and trainer.step % self.save_every == 0:
            self.save(trainer)

    def save(self, trainer) -> None:
        self.wait()
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        step_dir = self.ckpt_dir / step_dir_name(trainer.step)
        if rank == 0:
            shutil.rmtree(step_dir, ignore_errors=True)  # a half-written leftover of a crash
            step_dir.mkdir(parents=True)
        dist.barrier(self.group)
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
    # hint: dist.all_gather_object the outcomes over self.group; group rank 0 commits only if none
    #   holds "error"; dist.broadcast_object_list its verdict (group_src=0), so every rank raises.
    def _commit_everywhere(self, step: int, fingerprint: str) -> None:
        """Collective, on every rank of `self.group` (None: the world), after this rank's write
        of step `step` finished: `self._outcome` is this rank's manifest entry or {"error":
        "Type: message"}. Gather every rank's outcome in group-rank order. If none failed,
        group rank 0 calls `commit(self.ckpt_dir, step, world, outcomes, fingerprint,
        self.keep)` (world: the group's size); an exception there is a failure of "rank 0
        (commit)". Every rank then learns group rank 0's verdict and, if anything failed,
        raises CheckpointError(f"{step_dir}: not saved ({errors}); latest and older checkpoints
        are untouched") (step_dir: self.ckpt_dir / step_dir_name(step)) with errors "rank r:
        Type: message" (r the group rank) joined by "; ", the same message on every rank.
        No rank commits when any rank failed; without failures nothing is raised."""
        world = dist.get_world_size(self.group)
        outcomes: list = [None] * world
        dist.all_gather_object(outcomes, self._outcome, group=self.group)
        errors = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if "error" in o]
        if not errors and dist.get_rank(self.group) == 0:
            try:
                commit(self.ckpt_dir, step, world, outcomes, fingerprint, self.keep)
            except Exception as exc:
                errors = [f"rank 0 (commit): {type(exc).__name__}: {exc}"]
        verdict = [errors]  # every rank learns what group rank 0 decided
        dist.broadcast_object_list(verdict, group=self.group, group_src=0)
        if verdict[0]:
            raise CheckpointError(f"{self.ckpt_dir / step_dir_name(step)}: not saved "
                                  f"({'; '.join(verdict[0])}); latest and older checkpoints "
                                  "are untouched")


# ============================================================================ 4. verified load


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


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
