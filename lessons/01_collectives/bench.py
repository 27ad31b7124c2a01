"""Lesson 01's benchmark (`main.py --bench`): our plain ring all-reduce, the segmented one and
torch's all_reduce, then our all-to-all and torch's all_to_all_single, at 4 KiB to 64 MiB,
with nccl-tests' bus bandwidth and an alpha-beta model fitted to the plain ring's times.

Timings report; they never decide a check (the machine may be shared).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from lessons._checks import synchronize
from lessons._launch import RankContext, is_reporting_rank, launch

from . import main as collectives
from .checks import torch_all_to_all


def time_side_by_side(runs: dict, device: torch.device, min_seconds: float,
                      max_rounds: int = 30) -> dict[str, float]:
    """Median seconds of each callable in `runs`, measured in alternation (round after round
    of each in turn, the order rotating from round to round), so that all see the same
    machine load. Each timing starts after a barrier with the GPU idle and ends when the GPU
    is done (`synchronize`: a host timer would otherwise measure only the launch of NCCL's
    kernels), and is the MAX over ranks: a collective is as slow as its slowest rank."""
    def once(run) -> float:
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for run in runs.values():  # warm-up: connections, allocator
        once(run)
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    while True:
        rounds = len(samples[names[0]])
        first = rounds % len(names)  # rotate the order: no callable always runs first
        for name in names[first:] + names[:first]:
            samples[name].append(once(runs[name]))
        rounds += 1
        spent = sum(sum(values) for values in samples.values())
        if rounds >= max_rounds or (rounds >= 5 and spent >= min_seconds):
            break
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_worker(ctx: RankContext, sizes_bytes: list[int], min_seconds: float) -> dict:
    """Time, on float32 vectors of each size S: our plain ring all-reduce ("ring"), the ring
    with the segmented reduce-scatter ("segmented"), torch's all_reduce ("torch"; on a copy,
    as ours clones), and an all-to-all of equal blocks of a send buffer of about S bytes, ours
    ("all_to_all") and torch's ("torch_all_to_all"). Seconds per size, max over ranks."""
    world = ctx.world_size
    rows = []
    for size in sizes_bytes:
        x = torch.randn(size // 4, device=ctx.device)
        counts = [x.numel() // world] * world
        send = x[: sum(counts)]
        runs = {
            "ring": lambda x=x: collectives.ring_all_reduce(x),
            "segmented": lambda x=x: collectives.ring_all_gather(
                collectives.segmented_ring_reduce_scatter(x), x.numel()),
            "torch": lambda x=x: dist.all_reduce(x.clone()),
            "all_to_all": lambda s=send, c=counts: collectives.all_to_all(s, c, c),
            "torch_all_to_all": lambda s=send, c=counts: torch_all_to_all(s, c, c),
        }
        times = time_side_by_side(runs, ctx.device, min_seconds)
        rows.append({"bytes": size, **{f"{name}_s": seconds for name, seconds in times.items()}})
    return {"rows": rows}


def fit_alpha_beta(rows: list[dict], world_size: int, key: str = "ring_s") -> tuple[float, float]:
    """Fit t = 2(p-1) alpha + 2(p-1)/p S beta to measured ring all-reduce times, each point
    weighted by 1/t: the fit minimises the RELATIVE errors, so the 4 KiB points (where alpha
    shows) count as much as the 64 MiB ones (where beta does); an unweighted fit is decided by
    the largest sizes alone. Both parameters are kept >= 0 (a negative one is set to 0 and
    the other refitted). Returns (alpha seconds per message, beta seconds per byte)."""
    p = world_size
    latency = torch.tensor([2.0 * (p - 1) / row[key] for row in rows], dtype=torch.float64)
    transfer = torch.tensor([2.0 * (p - 1) / p * row["bytes"] / row[key] for row in rows],
                            dtype=torch.float64)
    ones = torch.ones_like(latency)
    design = torch.stack([latency, transfer], dim=1)
    alpha, beta = torch.linalg.lstsq(design, ones.unsqueeze(1)).solution.flatten().tolist()
    if alpha < 0:  # one-parameter fits: argmin sum (1 - c x_i)^2 = sum x_i / sum x_i^2
        alpha, beta = 0.0, float(transfer.sum() / transfer.square().sum())
    elif beta < 0:
        alpha, beta = float(latency.sum() / latency.square().sum()), 0.0
    return alpha, beta


def fit_residuals(rows: list[dict], world_size: int, alpha: float, beta: float,
                  key: str = "ring_s") -> list[float]:
    """(model - measured) / measured for each row: how far the fitted model is off, by size."""
    return [collectives.alpha_beta_seconds("ring_all_reduce", row["bytes"], world_size, alpha, beta)
            / row[key] - 1 for row in rows]


def human_size(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def print_bench(rows: list[dict], world_size: int, alpha: float, beta: float) -> None:
    """The two tables and the fit, as README's "Measured here" quotes them."""
    def busbw(collective: str, row: dict, key: str) -> float:
        return collectives.bus_bandwidth(collective, row["bytes"], row[key], world_size)[1] / 1e9

    residuals = fit_residuals(rows, world_size, alpha, beta)
    print(f"\nall-reduce, {world_size} ranks, float32: our plain ring, the segmented ring, torch")
    print(f"{'size':>9} {'ring ms':>9} {'segm. ms':>9} {'torch ms':>9} {'ring/torch':>10} "
          f"{'segm./ring':>10} {'busbw ring':>11} {'busbw torch':>11} {'model ms':>9} {'resid.':>7}")
    for row, residual in zip(rows, residuals):
        model = collectives.alpha_beta_seconds("ring_all_reduce", row["bytes"], world_size,
                                               alpha, beta)
        print(f"{human_size(row['bytes']):>9} {row['ring_s'] * 1e3:9.3f} "
              f"{row['segmented_s'] * 1e3:9.3f} {row['torch_s'] * 1e3:9.3f} "
              f"{row['ring_s'] / row['torch_s']:10.2f} {row['segmented_s'] / row['ring_s']:10.2f} "
              f"{busbw('all_reduce', row, 'ring_s'):6.2f} GB/s "
              f"{busbw('all_reduce', row, 'torch_s'):6.2f} GB/s {model * 1e3:9.3f} {residual:+7.0%}")
    best = max(busbw("all_reduce", row, "ring_s") for row in rows)
    print(f"fit (weights 1/t): alpha = {alpha * 1e6:.1f} us per message, 1/beta = "
          f"{1 / beta / 1e9 if beta > 0 else float('inf'):.2f} GB/s (best measured ring busbw "
          f"{best:.2f} GB/s: 1/beta is the busbw the model reaches as S grows)")
    print(f"\nall-to-all, equal blocks, {world_size} ranks: ours vs torch all_to_all_single")
    print(f"{'size':>9} {'ours ms':>9} {'torch ms':>9} {'busbw ours':>11} {'busbw torch':>11}")
    for row in rows:
        print(f"{human_size(row['bytes']):>9} {row['all_to_all_s'] * 1e3:9.3f} "
              f"{row['torch_all_to_all_s'] * 1e3:9.3f} "
              f"{busbw('all_to_all', row, 'all_to_all_s'):6.2f} GB/s "
              f"{busbw('all_to_all', row, 'torch_all_to_all_s'):6.2f} GB/s")


def run_bench(world_size: int, device: str, quick: bool, timeout: float) -> dict:
    """Run the benchmark on `world_size` ranks, print it on the reporting rank and return the
    metrics for the report: the rows, the fit, its residuals and the 16 MiB ratios."""
    top = 20 if quick else 26  # 1 MiB or 64 MiB
    sizes = [1 << exponent for exponent in range(12, top + 1, 2)]
    results = launch(bench_worker, world_size, (sizes, 0.2 if quick else 2.0), device=device,
                     timeout_s=max(timeout, 600.0))
    world = len(results)
    rows = results[0]["rows"]
    if world < 2:
        return {"bench": rows, "bench_note": "one rank: nothing crosses a link, no fit"}
    alpha, beta = fit_alpha_beta(rows, world)
    if is_reporting_rank():
        print_bench(rows, world, alpha, beta)
    at_16 = [row for row in rows if row["bytes"] == 16 << 20]
    return {
        "bench": rows, "alpha_us": alpha * 1e6, "beta_gbps": 1 / beta / 1e9 if beta > 0 else None,
        "fit_residuals": fit_residuals(rows, world, alpha, beta),
        "ratio_ours_torch_16MiB": at_16[0]["ring_s"] / at_16[0]["torch_s"] if at_16 else None,
        "ratio_segmented_ring_16MiB": at_16[0]["segmented_s"] / at_16[0]["ring_s"] if at_16 else None,
    }
