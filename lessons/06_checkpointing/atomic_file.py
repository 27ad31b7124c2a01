"""Lesson 06, parts 1-2: one file, atomically; the export, one file proven against the model.

Every file this lesson writes goes through `atomic_write_bytes`: each rank's shard, the
manifest and `latest` (main.py builds the many-file protocol on it), and the final export.
A crash can no longer leave half a file, but a complete file can still hold the wrong thing:
the 25-hour run of the README exported a valid, 200-byte safetensors file with no tensors in
it. So the export is written from the live model and then proven against it (`verify_export`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import torch


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
    """The hex sha256 of `data`: what a manifest records, and a reader recomputes, per file."""
    return hashlib.sha256(data).hexdigest()


# ============================================================================ 2. the export, proven


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
