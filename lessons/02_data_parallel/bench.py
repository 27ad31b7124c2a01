"""Lesson 02's benchmark: does overlapping the all-reduce with backward pay, and what does the
bucket cap change? `python lessons/02_data_parallel/main.py --bench`.

Every rank trains the same float32 TinyMLP (three width x width layers) on its shard of one
batch with each variant in turn, one step at a time, so that a slow moment of a shared machine
hits every variant alike:

* local: no communication at all (the forward, backward and optimizer times that the other
  variants add communication to);
* flat: backward, then one all-reduce of every gradient (`flat_all_reduce_gradients`);
* bucketed, at each cap of the sweep (`BucketedDDP`): all-reduces launched during backward;
* torch DDP at the first cap of the sweep.

Next to each measured median step time stands cost_model.py's prediction from the measured
parts (`step_time_after_backward`, `step_time_overlapped`, every bucket's all-reduce timed
alone). On a GPU every mark is a CUDA event on the current stream, read after
torch.cuda.synchronize (a host clock would only see asynchronous work being queued); on a CPU,
time.perf_counter.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._checks import synchronize
from lessons._launch import RankContext, is_reporting_rank, launch

from . import cost_model
from . import main as data_parallel
from .checks import make_optimizer, shard_of_step, torch_ddp

WARMUP_STEPS = 2  # torch DDP reduces one bucket in step 1 and rebuilds its buckets for step 2


class Stopwatch:
    """Named marks on one clock: CUDA events on the current stream on a GPU, perf_counter on a
    CPU. `seconds(a, b)` is valid once the device is synchronized."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        if self.cuda:
            return self.marks[start].elapsed_time(self.marks[end]) / 1e3
        return self.marks[end] - self.marks[start]


def aligned(device: torch.device) -> None:
    """Every rank idle and at the same point: a step then measures itself, not a late peer."""
    synchronize(device)
    dist.barrier()
    synchronize(device)


def all_reduce_seconds(numel: int, device: torch.device, repeats: int) -> float:
    """Median time of one all-reduce of `numel` float32 elements, alone."""
    buffer = torch.ones(numel, device=device)
    watch = Stopwatch(device)
    times = []
    for _ in range(repeats + 1):
        aligned(device)
        watch.mark("start")
        dist.all_reduce(buffer)
        watch.mark("end")
        synchronize(device)
        times.append(watch.seconds("start", "end"))
    return statistics.median(times[1:])


def timed_step(kind: str, model, wrapped, optimizer, x, y, watch: Stopwatch) -> dict:
    """One training step of a variant, its parts in seconds (and, bucketed, its timeline in
    seconds after loss.backward() was called)."""
    watch.marks.clear()
    watch.mark("start")
    optimizer.zero_grad()
    loss = F.mse_loss(wrapped(x), y)
    watch.mark("backward")
    loss.backward()
    watch.mark("backward_return")
    if kind == "flat":
        data_parallel.flat_all_reduce_gradients(model)
    watch.mark("reduced")
    optimizer.step()
    watch.mark("end")
    synchronize(x.device)
    parts = {"step_s": watch.seconds("start", "end"), "forward_s": watch.seconds("start", "backward"),
             "backward_s": watch.seconds("backward", "backward_return"),
             "after_backward_s": watch.seconds("backward_return", "reduced"),
             "optimizer_s": watch.seconds("reduced", "end")}
    if kind == "bucketed":
        buckets = len(wrapped.buckets)
        parts["backward_end_s"] = watch.seconds("backward", "backward_end-1")
        parts["launch_s"] = [watch.seconds("backward", f"launch{i}") for i in range(buckets)]
        parts["reduced_s"] = [watch.seconds("backward", f"reduced{i}") for i in range(buckets)]
    return parts


def bench_worker(ctx: RankContext, width: int, steps: int, caps_bytes: list[int]) -> dict:
    """Median step times of every variant on this rank, the cost model's predictions and the
    bucket timelines (plain data; the reporting rank's is printed)."""
    sizes = {"d_in": width, "hidden": width, "d_out": width}
    x, y = shard_of_step(ctx, 0, 64 * ctx.world_size, 0, d_in=width, d_out=width,
                         dtype=torch.float32)
    watch = Stopwatch(ctx.device)

    def on_event(kind: str, bucket: int) -> None:
        watch.mark(f"{kind}{bucket}")

    def build(kind: str, cap: int = 0):
        model = data_parallel.make_model(0, torch.float32, **sizes).to(ctx.device)
        if kind == "bucketed":
            wrapped = data_parallel.BucketedDDP(model, bucket_cap_mb=cap / 2**20, on_event=on_event)
        elif kind == "torch":
            wrapped = torch_ddp(ctx, model, bucket_cap_mb=cap / 2**20)
        else:
            wrapped = model
            if kind == "flat":
                data_parallel.broadcast_parameters_and_buffers(model)
        return kind, cap, model, wrapped, make_optimizer(model)

    variants = {"local (no communication)": build("local"), "flat, after backward": build("flat")}
    for cap in caps_bytes:
        variants[f"bucketed, {cap / 2**20:g} MiB cap"] = build("bucketed", cap)
    variants[f"torch DDP, {caps_bytes[0] / 2**20:g} MiB cap"] = build("torch", caps_bytes[0])
    samples: dict[str, list[dict]] = {name: [] for name in variants}
    for step in range(WARMUP_STEPS + steps):
        for name, (kind, _, model, wrapped, optimizer) in variants.items():
            aligned(ctx.device)
            parts = timed_step(kind, model, wrapped, optimizer, x, y, watch)
            if step >= WARMUP_STEPS:
                samples[name].append(parts)

    def median(name: str, key: str) -> float:
        return statistics.median(sample[key] for sample in samples[name])

    local = "local (no communication)"
    t_fwd, t_bwd, t_opt = (median(local, key) for key in ("forward_s", "backward_s", "optimizer_s"))
    params = list(variants[local][2].parameters())
    total = sum(p.numel() for p in params)
    repeats = max(steps // 2, 3)
    t_all = all_reduce_seconds(total, ctx.device, repeats)
    rows, timelines = [], {}
    for name, (kind, cap, _, wrapped, _) in variants.items():
        row = {"variant": name, "step_ms": median(name, "step_s") * 1e3, "predicted_ms": None,
               "buckets": {"local": 0, "flat": 1}.get(kind, len(data_parallel.assign_buckets(params, cap))),
               "exposed_ms": None}
        if kind == "flat":
            row["predicted_ms"] = cost_model.step_time_after_backward(t_fwd, t_bwd, t_all, t_opt) * 1e3
            row["exposed_ms"] = median(name, "after_backward_s") * 1e3
        if kind == "bucketed":
            bucket_numels = [sum(params[i].numel() for i in bucket) for bucket in wrapped.buckets]
            ready = [statistics.median(s["launch_s"][i] for s in samples[name])
                     for i in range(len(bucket_numels))]
            alone = [all_reduce_seconds(n, ctx.device, repeats) for n in bucket_numels]
            row["predicted_ms"] = cost_model.step_time_overlapped(t_fwd, t_bwd, ready, alone, t_opt) * 1e3
            row["exposed_ms"] = statistics.median(
                s["reduced_s"][-1] - s["backward_end_s"] for s in samples[name]) * 1e3
            typical = sorted(samples[name], key=lambda s: s["step_s"])[len(samples[name]) // 2]
            timelines[name] = {key: typical[key] for key in ("backward_end_s", "launch_s", "reduced_s")}
            timelines[name]["bucket_bytes"] = [n * 4 for n in bucket_numels]
        rows.append(row)
    return {"params": total, "width": width, "world_size": ctx.world_size, "device": str(ctx.device),
            "parts_ms": {"forward": t_fwd * 1e3, "backward": t_bwd * 1e3, "optimizer": t_opt * 1e3,
                         "all_reduce_all": t_all * 1e3},
            "rows": rows, "timelines": timelines}


def print_bench(result: dict) -> None:
    parts = result["parts_ms"]
    print(f"\n{result['params']:,} float32 parameters, {result['world_size']} ranks on "
          f"{result['device']}: forward {parts['forward']:.1f} ms, backward {parts['backward']:.1f} "
          f"ms, optimizer {parts['optimizer']:.1f} ms, one all-reduce of every gradient "
          f"{parts['all_reduce_all']:.1f} ms")
    print(f"{'variant':<32} {'buckets':>7} {'step ms':>8} {'model ms':>8} {'exposed ms':>10}")
    for row in result["rows"]:
        model = "-" if row["predicted_ms"] is None else f"{row['predicted_ms']:.1f}"
        exposed = "-" if row["exposed_ms"] is None else f"{row['exposed_ms']:.1f}"
        print(f"{row['variant']:<32} {row['buckets']:>7} {row['step_ms']:>8.1f} {model:>8} "
              f"{exposed:>10}")
    print("model: step_time_after_backward / step_time_overlapped from the local parts and each "
          "bucket's all-reduce timed alone; exposed: communication waited for after backward")


def plot_bench(result: dict, path: Path) -> None:
    """The bucket timelines (launch and arrival of each bucket's all-reduce against backward)
    and the measured vs modelled step times, as one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    timelines = result["timelines"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.7 * max(len(timelines), 3)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    for row, line in enumerate(timelines.values()):
        end = line["backward_end_s"] * 1e3
        left.barh(row, end, color="#cde", label="backward compute" if row == 0 else None)
        left.barh(row, line["reduced_s"][-1] * 1e3 - end, left=end, color="#f9c",
                  label="wait for the all-reduces" if row == 0 else None)
        for bucket, (start, done) in enumerate(zip(line["launch_s"], line["reduced_s"])):
            left.plot([start * 1e3], [row + 0.25], "v", color="C3",
                      label="bucket launched" if row == bucket == 0 else None)
            left.annotate(f"b{bucket}", (start * 1e3, row + 0.32), ha="center", fontsize=7)
            left.plot([done * 1e3], [row - 0.25], "^", color="C2",
                      label="bucket averaged" if row == bucket == 0 else None)
    left.set_yticks(range(len(timelines)), [name.removeprefix("bucketed, ") for name in timelines])
    left.set_xlabel("ms since loss.backward() was called (rank 0, the median step)")
    left.legend(loc="lower right", fontsize=7)
    rows = result["rows"]
    positions = range(len(rows))
    right.barh([p + 0.2 for p in positions], [r["step_ms"] for r in rows], height=0.4,
               label="measured", color="C0")
    right.barh([p - 0.2 for p in positions], [r["predicted_ms"] or 0 for r in rows], height=0.4,
               label="cost model", color="C1")
    right.set_yticks(list(positions), [r["variant"] for r in rows], fontsize=7)
    right.set_xlabel("median step time (ms)")
    right.legend(fontsize=7)
    fig.suptitle(f"{result['params']:,} float32 parameters, {result['world_size']} ranks, "
                 f"{result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_bench(args, world: int) -> dict:
    """`--bench`: launch `bench_worker`, print and plot rank 0's result, return the metrics."""
    width, steps = (256, 4) if args.quick else (1024, 10)
    caps_mb = args.bucket_mb or ([0.0625, 0.375, 25.0] if args.quick else [0.5, 6.0, 25.0])
    result = launch(bench_worker, world, (width, steps, [int(cap * 2**20) for cap in caps_mb]),
                    device=args.device, timeout_s=max(args.timeout, 600))[0]
    if is_reporting_rank():
        print_bench(result)
        plot_bench(result, args.plot)
        print(f"timeline written to {args.plot}")
    by_kind: dict[str, dict] = {}
    for row in result["rows"]:  # the first row of each kind: bucketed at the first cap
        by_kind.setdefault(row["variant"].split(",")[0], row)
    ours, theirs = by_kind["bucketed"], by_kind["torch DDP"]
    return {"step_ms_flat": by_kind["flat"]["step_ms"], "step_ms_ours": ours["step_ms"],
            "step_ms_torch": theirs["step_ms"], "ratio_ours_torch": ours["step_ms"] / theirs["step_ms"],
            "bench_params": result["params"], "bench": result}
