"""Lesson 15, part 2: how much of the hardware a step used, and the peak to divide by.

In reading order:

1. Count: `count_flops` runs a step under torch.utils.flop_counter.FlopCounterMode, which adds
   up every matmul (and attention kernel) as 2 m n k; the capstone's count equals PaLM's
   6N + 12 L H Q T exactly once N holds only the matmul weights (lesson 13's flops.py counts
   biases and LayerNorm too). `hardware_flops_per_token` adds what recomputation replays:
   the hardware does more than the model needs, so HFU > MFU.
2. The peak: `peak_flops` is the datasheet's dense number for the device AND the dtype in use,
   refused (never guessed) for a device or dtype it does not know; `achievable_peak` measures
   what matmuls really reach here (a MAMF-style search over shapes, as the ml-engineering
   book's mamf-finder.py does).
MFU and HFU themselves are lesson 13's `flops.mfu`, given model or hardware FLOPs per token.
"""

from __future__ import annotations

import importlib
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

flops = importlib.import_module("lessons.13_capstone.flops")  # lesson 13's 6N + 12LHQT, MFU, peaks

# ============================================================================ 1. count


def count_flops(fn) -> tuple[int, dict[str, int]]:
    """Run `fn()` under FlopCounterMode and return (total FLOPs, {operator: FLOPs}). The mode
    sees every operator dispatched while it is active, backward and recomputation included;
    it counts matmuls (mm, addmm, bmm, baddbmm: 2 m n k, the bias add of addmm not counted),
    convolutions and the fused attention kernels, nothing else (no softmax, norm, GeLU)."""
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    by_op: dict[str, int] = {}
    for op, count in counter.get_flop_counts().get("Global", {}).items():
        name = str(op).split(".")[1] if "." in str(op) else str(op)  # aten.mm -> mm
        by_op[name] = by_op.get(name, 0) + count
    return counter.get_total_flops(), by_op


def weight_params(model: torch.nn.Module, layers_only: bool = False) -> int:
    """The parameters that multiply in a matmul: every tensor of 2 or more dimensions but the
    position table `model.pos` (an add), the tied token table counted once (the head's matmul;
    its lookup is not one). With `layers_only`, those inside model.layers (what full
    recomputation replays). Biases and LayerNorm gains are 1-D: no matmul."""
    params = model.layers.parameters() if layers_only else model.parameters()
    pos = getattr(model, "pos", None)
    return sum(p.numel() for p in params if p.dim() >= 2 and (pos is None or p is not pos.weight))


# exercise utilisation (4 points): The FLOPs the hardware did, and the peak to divide them by
# hint: recomputation replays forward: 2 per token for each weight it replays, 2 L H Q T for
#   each attention matmul; the datasheet's headline tensor numbers are "with sparsity".
def hardware_flops_per_token(weights: int, layer_weights: int, layers: int, hidden: int, seq: int,
                             recompute: str = "none") -> int:
    """Training FLOPs per token the hardware executes: the model's 6 W + 12 L H Q T (PaLM,
    appendix B: 2 W forward and 4 W backward for the matmul weights W, 12 L h s for the
    attention scores and values, h = H Q = hidden, s = seq) plus what recomputation replays
    in lesson 07's TinyGPT: "none": nothing; "full" (every layer checkpointed): each layer's
    forward again, 2 x layer_weights + 4 L h s (the embedding and the head are not replayed);
    "selective" (every layer's attention core, Korthikanti et al.): the scores q k^T again,
    2 L h s, and not the values p v: PyTorch's checkpoint stops replaying once it has every
    tensor backward saved (torch.utils.checkpoint's early stop), and p v's output is not one.
    An int. Any other `recompute`: ValueError."""
    model = 6 * weights + 12 * layers * hidden * seq
    replayed = {"none": 0, "selective": 2 * layers * hidden * seq,
                "full": 2 * layer_weights + 4 * layers * hidden * seq}
    if recompute not in replayed:
        raise ValueError(f"recompute={recompute!r}: 'none', 'selective' or 'full'")
    return model + replayed[recompute]


# ============================================================================ 2. the peak

# Dense tensor-core FLOP/s of each dtype, as a multiple of the dense bf16 peak of lesson 13's
# DEVICE_PEAK_FLOPS (exact device names). NVIDIA's datasheets print the tensor-core figures
# "with sparsity" (2:4 structured), twice the dense ones; per dense bf16 FLOP, fp16 runs at the
# same rate, TF32 at half (A100: 156 vs 312; H100 SXM: 494.5 vs 989), FP8 at twice, Hopper only.
DTYPE_RATE = {"bfloat16": 1.0, "float16": 1.0, "tf32": 0.5}
FP8_DEVICES = ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200")


# exercise utilisation (continued)
def peak_flops(device_name: str, dtype: str) -> float:
    """The dense peak FLOP/s of ONE device for matmuls in `dtype` ("bfloat16", "float16",
    "tf32", "float8"): lesson 13's dense bf16 peak for this exact name (flops.DEVICE_PEAK_FLOPS)
    times DTYPE_RATE[dtype]; "float8" is twice the bf16 peak on the FP8_DEVICES (Hopper) only.
    An unknown device (not exactly a name of the table: no substring match, no default), a
    dtype outside these, or float8 on a device without FP8: ValueError naming the device and
    the dtype; MFU is then not reported, never computed against a guessed peak."""
    peak = flops.DEVICE_PEAK_FLOPS.get(device_name)
    if peak is None:
        raise ValueError(f"no datasheet peak for device {device_name!r} (dtype {dtype}): refused, "
                         "not guessed; add its dense number with its source")
    if dtype == "float8" and device_name in FP8_DEVICES:
        return 2.0 * peak
    if dtype not in DTYPE_RATE:
        raise ValueError(f"no dense {dtype} peak for {device_name!r}: refused, not guessed")
    return peak * DTYPE_RATE[dtype]


def time_call(fn, device: torch.device) -> float:
    """Seconds `fn()` takes: on CUDA between two events on the current stream, read after
    synchronize (a host clock would time the kernel's launch, not the kernel); elsewhere with
    time.perf_counter."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# exercise utilisation (continued)
def matmul_flops_per_s(m: int, n: int, k: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", iters: int = 5, warmup: int = 2) -> float:
    """FLOP/s of one (m, k) @ (k, n) matmul shape: 2 m n k FLOPs over the FASTEST of `iters`
    timed calls of torch.mm(A, B, out=C), after `warmup` untimed ones, the operands made once,
    outside the timing. Before every call, as mamf-finder.py does, a buffer larger than the
    last-level cache (at least 32 MiB on a CPU, 256 MiB on a GPU) is zeroed (a cold cache, as
    in a real step) and C is rewritten; only the matmul is timed, by `time_call` (CUDA events
    on a GPU, time.perf_counter on a CPU), given this device.
    The fastest call is the achievable rate; a shared machine only ever slows a call down."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=generator).to(dtype)
    b = torch.randn(k, n, device=device, generator=generator).to(dtype)
    c, fill = torch.empty(m, n, device=device, dtype=dtype), torch.ones(m, n, device=device, dtype=dtype)
    cache = torch.empty((256 if device.type == "cuda" else 32) << 18, device=device)  # 256/32 MiB
    best = float("inf")
    for index in range(warmup + iters):
        cache.zero_()
        c.copy_(fill)
        seconds = time_call(lambda: torch.mm(a, b, out=c), device)
        if index >= warmup:
            best = min(best, seconds)
    return 2 * m * n * k / best


# exercise utilisation (continued)
def achievable_peak(shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", iters: int = 5,
                    warmup: int = 2) -> tuple[float, tuple[int, int, int]]:
    """A MAMF-style search (maximum achievable matmul FLOP/s): `matmul_flops_per_s` of every
    (m, n, k) in `shapes`, each once, in order; returns (the highest FLOP/s, its shape).
    The number to divide by when the datasheet has none (a CPU), or to know how far from the
    reachable ceiling a run is (an H100 reaches about 80% of its datasheet bf16 peak).
    No shapes: ValueError."""
    if not shapes:
        raise ValueError("achievable_peak needs at least one (m, n, k) shape")
    rates = [(matmul_flops_per_s(m, n, k, dtype, device, iters, warmup), (m, n, k))
             for m, n, k in shapes]
    return max(rates, key=lambda rate: rate[0])
