"""Lesson 09's benchmarks (`--bench`): the kernels of main.py timed side by side with their FLOP
and byte counts, and per-module vs batched all-reduce at two block sizes. Timings report; they
never decide a check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from lessons._checks import best_time
from lessons._launch import RankContext, is_reporting_rank, launch

from . import main as osft

# (modules, numbers per module's coefficient block): tiny blocks, where latency dominates, and
# the U-side block of a 4096-wide layer at rank_ratio 0.5 (k_h x k_l = 2048 x 2048 = 4.2M), the
# size mini_trainer's batching PR names, with fewer modules so it fits a laptop's memory.
ALL_REDUCE_CASES = [(224, 64 * 64), (16, 2048 * 2048)]
ALL_REDUCE_CASES_QUICK = [(32, 64 * 64), (4, 256 * 256)]


def bench_kernels(n_rows: int, n_cols: int, tokens: int, rank_ratio: float, repeats: int,
                  device: str | torch.device = "cpu") -> dict:
    """Naive vs fused forward and Gram vs factored projection, fp32, measured side by side."""
    torch.manual_seed(0)
    layer = osft.OSFTLinear(nn.Linear(n_cols, n_rows), rank_ratio).to(device)
    args = (layer.U_high, layer.S_high, layer.V_high, layer.U_low, layer.S_low, layer.V_low, layer.bias)
    x = torch.randn(tokens, n_cols, device=device)
    k_high, k_low = layer.U_high.shape[1], layer.U_low.shape[1]
    with torch.no_grad():
        naive = best_time(lambda: osft.osft_forward_naive(x, *args), repeats, device)
        fused = best_time(lambda: osft.osft_forward_fused(x, *args), repeats, device)
    d_u, d_v = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
    gram = best_time(lambda: (osft.project_u_gram(d_u, layer.U_high),
                              osft.project_v_gram(d_v, layer.V_high)), repeats, device)
    factored = best_time(lambda: (osft.project_u_factored(d_u, layer.U_high),
                                  osft.project_v_factored(d_v, layer.V_high)), repeats, device)
    return {"shape": [n_rows, n_cols], "tokens": tokens, "k_high": k_high, "k_low": k_low,
            "device": str(device), "naive_s": naive, "fused_s": fused, "gram_s": gram,
            "factored_s": factored, "speedup_fused_forward": naive / fused,
            "speedup_factored_projection": gram / factored,
            **osft.forward_cost(tokens, n_rows, n_cols, k_high, k_low, bias=True),
            "projection_flops": osft.projection_flops(n_rows, n_cols, k_high, k_low)}


def bench_all_reduce_worker(ctx: RankContext, cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    """For each (modules, numel): one all-reduce per module vs one all-reduce of every module's
    coefficients concatenated (the batched U side). Best of `repeats`, after a warm-up."""
    return [time_all_reduces(ctx, n_modules, numel, repeats) for n_modules, numel in cases]


def time_all_reduces(ctx: RankContext, n_modules: int, numel: int, repeats: int) -> dict:
    tensors = [torch.randn(numel, device=ctx.device) for _ in range(n_modules)]

    def per_module():
        for tensor in tensors:
            dist.all_reduce(tensor)

    def batched():
        flat = torch.cat(tensors)
        dist.all_reduce(flat)
        return flat.split(numel)

    times = {"modules": n_modules, "numel": numel}
    for name, fn in (("per_module_s", per_module), ("batched_s", batched)):
        dist.barrier()
        times[name] = best_time(fn, repeats, ctx.device)
    return times


def run(args, device: str) -> dict:
    """The `--bench` part of the demo: kernel timings in this process, all-reduce timings on
    `--world-size` ranks; prints one line per measurement; returns the metrics."""
    size = 256 if args.quick else args.bench_size
    kernels = bench_kernels(size, size, 4 * size, args.rank_ratio, 3 if args.quick else 10, device)
    cases = ALL_REDUCE_CASES_QUICK if args.quick else ALL_REDUCE_CASES
    reduce = launch(bench_all_reduce_worker, args.world_size, (cases, 2 if args.quick else 3),
                    device=args.device, timeout_s=max(args.timeout, 600.0))[0]
    if is_reporting_rank():
        print(f"forward   naive {kernels['naive_s'] * 1e3:8.2f} ms  fused {kernels['fused_s'] * 1e3:8.2f} ms"
              f"  x{kernels['speedup_fused_forward']:.2f}  (same {kernels['flops']:.2e} FLOPs; "
              f"naive moves {kernels['extra_bytes_naive'] / 1e6:.1f} MB more)")
        flops = kernels["projection_flops"]
        print(f"project   Gram  {kernels['gram_s'] * 1e3:8.2f} ms  "
              f"factored {kernels['factored_s'] * 1e3:8.2f} ms  x{kernels['speedup_factored_projection']:.2f}"
              f"  (FLOPs {flops['gram']:.2e} vs {flops['factored']:.2e}, ratio {flops['ratio']:.2f})")
        for case in reduce:
            print(f"all-reduce {case['modules']} x {case['numel']:,} floats: per module "
                  f"{case['per_module_s'] * 1e3:.1f} ms, batched {case['batched_s'] * 1e3:.1f} ms"
                  f"  x{case['per_module_s'] / case['batched_s']:.2f}")
    return {"kernels": kernels, "all_reduce": reduce,
            "speedup_fused_forward": kernels["speedup_fused_forward"],
            "speedup_factored_projection": kernels["speedup_factored_projection"],
            "speedup_batched_all_reduce": [c["per_module_s"] / c["batched_s"] for c in reduce]}
