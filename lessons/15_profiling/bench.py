"""Lesson 15's communication benchmark, reported as nccl-tests reports it
(`python lessons/15_profiling/main.py --bench`), and this CPU's memory bandwidth.

For all-reduce, all-gather, reduce-scatter and all-to-all at sizes from 4 KiB up, every rank
times each collective with lesson 01's `time_side_by_side` (the collectives take turns, a
barrier before each call, the MAX over ranks, the median of the rounds) while torch.profiler
records the same calls, each inside a record_function range: the trace's durations give the
same times, which the report compares. nccl-tests' columns follow (doc/PERFORMANCE.md, through
lesson 01's `bus_bandwidth`): algbw = S / t and busbw = algbw x (2(p-1)/p for all-reduce,
(p-1)/p for the others), S the whole vector (all-gather's output, reduce-scatter's input, a
rank's all-to-all send buffer). Lesson 01's alpha-beta fit (`fit_alpha_beta`), made without
one size, predicts that size. Timings report; the tests give their pass rates.
"""

from __future__ import annotations

import importlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from lessons._launch import RankContext, choose_device, is_reporting_rank, launch
from lessons._report import Check, Report, world_size_of

from . import main as profiling

collectives = importlib.import_module("lessons.01_collectives.main")  # bus_bandwidth, alpha_beta_seconds
collectives_bench = importlib.import_module("lessons.01_collectives.bench")  # time_side_by_side, fit

bus_bandwidth = collectives.bus_bandwidth  # lesson 01's nccl-tests definitions, under their own name
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# lesson 01's alpha-beta model of each (a ring: all-reduce 2(p-1) a + 2(p-1)/p S b, the others half)
MODELS = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
          "reduce_scatter": "ring_reduce_scatter", "all_to_all": "all_to_all"}
TRACE_TOLERANCE = (50e-6, 0.05)  # trace vs timers, same calls: 50 us + 5% (the median point ~1%)
FIT_FACTOR = 2.0  # the fit predicts a left-out size within a factor of 2 (gloo on loopback, loaded)


def collective_call(name: str, size_bytes: int, world: int, device: torch.device):
    """(the call, S in bytes as nccl-tests counts it) for one collective on float32 vectors of
    about `size_bytes`, rounded down to a multiple of the world size."""
    numel = max(size_bytes // 4 // world, 1) * world
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world, device=device)
    if name == "all_reduce":
        return (lambda: dist.all_reduce(full)), numel * 4
    if name == "all_gather":
        return (lambda: dist.all_gather_single(full, part)), numel * 4
    if name == "reduce_scatter":
        return (lambda: dist.reduce_scatter_single(part, full)), numel * 4
    if name == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full)), numel * 4
    raise ValueError(f"unknown collective {name!r}: one of {COLLECTIVES}")


def comm_bench_worker(ctx: RankContext, sizes: list[int], min_seconds: float, out: str) -> dict:
    """Every collective at every size: lesson 01's timers (time_side_by_side) and this rank's
    trace of the same calls. Returns {"rows": [{"collective", "bytes", "seconds"}], "trace":
    {label: [durations in seconds, call by call]}} (labels "bench {name} {bytes}")."""
    rows, labels = [], {}
    path = Path(out) / "bench" / f"rank{ctx.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for size in sizes:
            runs, nbytes = {}, {}
            for name in COLLECTIVES:
                call, nbytes[name] = collective_call(name, size, ctx.world_size, ctx.device)
                label = f"bench {name} {nbytes[name]}"
                labels[label] = name

                def labelled(call=call, label=label):
                    with record_function(label):
                        call()
                        if ctx.device.type == "cuda":
                            torch.cuda.synchronize(ctx.device)
                runs[name] = labelled
            for name, seconds in collectives_bench.time_side_by_side(runs, ctx.device, min_seconds).items():
                rows.append({"collective": name, "bytes": nbytes[name], "seconds": seconds})
    prof.export_chrome_trace(str(path))
    durations: dict[str, list[float]] = {label: [] for label in labels}
    for event in profiling.load_trace(path):
        if event["name"] in durations:
            durations[event["name"]].append(event["dur"] / 1e6)
    return {"rows": rows, "trace": durations}


def trace_seconds(per_rank: list[dict], label: str) -> float:
    """What the traces say one call took, as the timers count it: the MAX over ranks of each
    call's range (the first call of each label is the timers' warm-up: dropped), the median
    over calls."""
    calls = zip(*(r["trace"][label] for r in per_rank))
    return statistics.median(max(call) for call in list(calls)[1:])


def busbw_table(rows: list[dict], world: int) -> list[dict]:
    """nccl-tests' columns for every row: algbw = S / t, busbw = algbw x factor (lesson 01)."""
    table = []
    for row in rows:
        algbw, busbw = collectives.bus_bandwidth(row["collective"], row["bytes"], row["seconds"], world)
        table.append({**row, "algbw": algbw, "busbw": busbw})
    return table


def fit_collective(rows: list[dict], world: int, name: str,
                   leave_out: int | None = None) -> tuple[float, float]:
    """Lesson 01's `fit_alpha_beta` (weights 1/t) on one collective's rows, without size
    `leave_out`. Its model is the ring all-reduce's, 2(p-1) a + 2(p-1)/p S b; the other three
    take (p-1) a + (p-1)/p S b, half of it, so they are fitted on twice their times."""
    scale = 1.0 if name == "all_reduce" else 2.0
    points = [{"bytes": r["bytes"], "ring_s": scale * r["seconds"]} for r in rows
              if r["collective"] == name and r["bytes"] != leave_out]
    return collectives_bench.fit_alpha_beta(points, world)


def predicted_seconds(name: str, size_bytes: int, world: int, alpha: float, beta: float) -> float:
    """Lesson 01's alpha-beta time of collective `name` on S bytes."""
    return collectives.alpha_beta_seconds(MODELS[name], size_bytes, world, alpha, beta)


def memory_bandwidth(numel: int, repeats: int = 5) -> float:
    """Bytes per second of a float32 copy of `numel` elements (read + write: 8 numel bytes),
    the fastest of `repeats` after one warm-up: the bandwidth side of this CPU's roofline."""
    source, target = torch.ones(numel), torch.empty(numel)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return 8 * numel / best


def bench_report(per_rank: list[dict], world: int) -> tuple[list[Check], dict, list[dict]]:
    """The checks of a benchmark run: the traces' times == the timers' (the median point within
    TRACE_TOLERANCE); lesson 01's fit, left without each inner size in turn, predicts it (the
    median over those sizes within FIT_FACTOR: one size where gloo switches algorithm may miss)."""
    table = busbw_table(per_rank[0]["rows"], world)
    differences = []
    for row in table:
        row["trace_seconds"] = trace_seconds(per_rank, f"bench {row['collective']} {row['bytes']}")
        differences.append(abs(row["trace_seconds"] - row["seconds"])
                           - TRACE_TOLERANCE[1] * row["seconds"] - TRACE_TOLERANCE[0])
    worst = max(abs(row["trace_seconds"] / row["seconds"] - 1) for row in table)
    checks = [Check("the time of every call read from the traces == lesson 01's timers (busbw alike; "
                    f"median point within {TRACE_TOLERANCE[0] * 1e6:g} us + {TRACE_TOLERANCE[1]:.0%})",
                    statistics.median(differences) <= 0,
                    f"worst point {worst:.1%} over {len(table)} (collective, size) points")]
    metrics: dict = {"busbw": table}
    sizes = sorted({row["bytes"] for row in table if row["collective"] == "all_reduce"})
    if world > 1 and len(sizes) >= 3:
        ratios = {name: {} for name in COLLECTIVES}
        for name in COLLECTIVES:
            for size in sizes[1:-1]:  # inner sizes: an interpolation, not an extrapolation
                alpha, beta = fit_collective(table, world, name, leave_out=size)
                measured = next(r["seconds"] for r in table if r["collective"] == name and r["bytes"] == size)
                ratios[name][size] = predicted_seconds(name, size, world, alpha, beta) / measured
        typical = statistics.median(ratios["all_reduce"].values())
        checks.append(Check(f"lesson 01's alpha-beta fit predicts each left-out size (all-reduce, median "
                            f"within a factor of {FIT_FACTOR:g})", 1 / FIT_FACTOR <= typical <= FIT_FACTOR,
                            "; ".join(f"{name} " + ", ".join(f"{r - 1:+.0%}" for r in by_size.values())
                                      for name, by_size in ratios.items())))
        metrics["fit_ratios"] = {name: {str(size): ratio for size, ratio in by_size.items()}
                                 for name, by_size in ratios.items()}
    return checks, metrics, table


def print_table(table: list[dict], world: int) -> None:
    print(f"\n{world} ranks, float32, nccl-tests' columns (time: lesson 01's timers; trace: the "
          "profiler's ranges of the same calls)")
    print(f"{'collective':<15} {'size (B)':>10} {'time (us)':>10} {'trace (us)':>10} "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10}")
    for row in table:
        print(f"{row['collective']:<15} {row['bytes']:>10} {row['seconds'] * 1e6:>10.1f} "
              f"{row['trace_seconds'] * 1e6:>10.1f} {row['algbw'] / 1e9:>10.3f} {row['busbw'] / 1e9:>10.3f}")


def run_bench(args) -> Report:
    """`--bench`: the benchmark on --world-size ranks, its table and checks."""
    top = args.max_bytes or (1 << 20 if args.quick else 1 << 22)
    sizes = [1 << e for e in range(12, top.bit_length(), 2)]
    world = world_size_of(args)
    device, backend = choose_device(args.device, world)
    with tempfile.TemporaryDirectory(prefix="lesson15-bench-") as tmp:
        per_rank = launch(comm_bench_worker, world,
                          (sizes, 0.05 if args.quick else 0.3, str(args.out or tmp)),
                          device=args.device, timeout_s=max(args.timeout, 600.0))
    checks, metrics, table = bench_report(per_rank, len(per_rank))
    if is_reporting_rank():
        print_table(table, len(per_rank))
    best = max(table, key=lambda row: row["busbw"])
    metrics["headline"] = (f"best busbw {best['busbw'] / 1e9:.2f} GB/s ({best['collective']}, "
                           f"{best['bytes']} B)")
    return Report("15_profiling", device, backend, len(per_rank), checks, metrics)
