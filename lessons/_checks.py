"""Check helpers every lesson's harness shares (the proof's plumbing, never a lesson's idea).

A lesson's `main.py` holds the technique; its `checks.py` (and `bench.py`) compare it with
PyTorch's engine or an exact single-process reference. The comparisons, timings and digests
they all need live here once:

* `max_abs_diff(a, b)` and `compare(ours, theirs, tolerance)`: exact or bounded equality;
* `sum_order_tolerance(abs_sum, terms, dtype)`: how far two summation orders may differ;
* `best_time(fn, repeats, device)`: best-of timing that waits for GPU kernels;
* `fingerprint(config)` and `tensor_digest(state)`: stable names for configs and weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch


def max_abs_diff(a, b) -> float:
    """max |a - b| in float64 (0.0 for empty inputs). Accepts tensors, lists or numbers (read
    as float64: a list of Python floats is never rounded to float32 first)."""
    a = (a if isinstance(a, torch.Tensor) else torch.as_tensor(a, dtype=torch.float64))
    b = (b if isinstance(b, torch.Tensor) else torch.as_tensor(b, dtype=torch.float64))
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    return float((a - b).abs().max()) if a.numel() else 0.0


def max_abs_diff_all(ours: Mapping[str, torch.Tensor] | list,
                     theirs: Mapping[str, torch.Tensor] | list) -> float:
    """The largest `max_abs_diff` over matching tensors of two dicts (same keys) or lists."""
    if isinstance(ours, Mapping):
        if set(ours) != set(theirs):
            raise KeyError(f"different keys: {sorted(set(ours) ^ set(theirs))}")
        pairs = [(ours[key], theirs[key]) for key in ours]
    else:
        if len(ours) != len(theirs):
            raise ValueError(f"{len(ours)} tensors vs {len(theirs)}")
        pairs = list(zip(ours, theirs))
    return max((max_abs_diff(a, b) for a, b in pairs), default=0.0)


def sum_order_tolerance(abs_sum: torch.Tensor, terms: int, dtype: torch.dtype) -> torch.Tensor:
    """How far two float sums of the same `terms` numbers may differ when added in different
    orders, element by element.

    Recursive summation of n terms errs by at most (n-1) u sum|x_i| (u = eps/2, the unit
    roundoff; Higham, Accuracy and Stability of Numerical Algorithms, eq. 4.4). Two orders can
    err in opposite directions: |ours - theirs| <= (n-1) * eps * sum|x_i|.
    """
    return (terms - 1) * torch.finfo(dtype).eps * abs_sum


def compare(ours: torch.Tensor, theirs: torch.Tensor,
            tolerance: torch.Tensor | float | None = None) -> tuple[bool, str]:
    """Exact comparison (tolerance None: same shape, dtype and every element) or element-wise
    |ours - theirs| <= tolerance (a tensor of per-element bounds or one number).
    Returns (passed, a short detail for the report)."""
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False, (f"shape/dtype {tuple(ours.shape)}/{ours.dtype} vs "
                       f"{tuple(theirs.shape)}/{theirs.dtype}")
    if ours.numel() == 0:
        return True, "empty"
    if tolerance is None:
        mismatches = int((ours != theirs).sum())
        return mismatches == 0, "exact" if mismatches == 0 else f"{mismatches} elements differ"
    error = (ours.detach().double() - theirs.detach().double()).abs()
    bound = torch.as_tensor(tolerance, dtype=torch.float64, device=error.device)
    max_error = float(error.max())
    if bool((error <= bound).all()):
        return True, f"max |diff| {max_error:.2e} within bound"
    return False, f"max |diff| {max_error:.2e} exceeds the bound"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (a no-op on CPU): host timers then measure the kernels."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], Any], repeats: int, device: torch.device | str | None = None,
              warmup: int = 1) -> float:
    """Best of `repeats` wall-clock timings of `fn()` after `warmup` untimed calls. On a CUDA
    `device` every timing starts and ends with torch.cuda.synchronize, so it measures the
    kernels, not their launch. Timing reports; it never decides a test."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(max(repeats, 1)):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def canonical_json(config: Any) -> str:
    """Sorted keys, no whitespace: equal configurations give equal text on every machine."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def fingerprint(config: Any) -> str:
    """A run's name: the first 16 hex digits of sha256 over `canonical_json(config)`
    (a dict or a dataclass instance)."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:16]


def tensor_digest(state: Mapping[str, torch.Tensor] | list[torch.Tensor]) -> str:
    """sha256 over every tensor's name (or index), dtype, shape and bytes, in name order:
    equal iff bitwise equal. Bitwise equality is a same-machine claim: another CPU's kernels
    may round differently."""
    items = sorted(state.items()) if isinstance(state, Mapping) else list(enumerate(state))
    digest = hashlib.sha256()
    for name, tensor in items:
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
