"""Lesson 15's harness: real traces of lesson 02's DDP and of the capstone's step, read by
main.py, each number compared with an independent one (lesson 02's own timers, an injected
delay, the FLOP formulas, a single-process count), and the CLI.

* `ddp_variants`: lesson 02's BucketedDDP profiled with several buckets and with one, in
  pairs, beside lesson 02's own timers (its `on_event` marks on its bench's Stopwatch);
* `straggler_collectives`: blocking all-reduces with one rank late by a known delay;
* `capstone_steps`: the capstone's GPTTrainer profiled with `annotate_phases` (its loop is
  not edited), and its FLOPs counted by FlopCounterMode;
* `tensor_parallel_flops`: FlopCounterMode on each rank of lesson 04's Megatron MLP;
* the demo's table and the CLI (`--out DIR` keeps every rank's traces; `--bench` runs the
  communication benchmark of bench.py).

`python lessons/15_profiling/main.py` runs `main()` below.
"""

from __future__ import annotations

import importlib
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._launch import (
    RankContext,
    choose_device,
    inject_fault,
    is_reporting_rank,
    launch,
    one_thread,
)
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    lesson_parser,
    world_size_of,
)

from . import main as profiling
from . import roofline, utilisation

data_parallel = importlib.import_module("lessons.02_data_parallel.main")  # BucketedDDP
ddp_bench = importlib.import_module("lessons.02_data_parallel.bench")  # its Stopwatch (timers)
capstone = importlib.import_module("lessons.13_capstone.main")  # GPTTrainer, GPTRunConfig
tensor_parallel = importlib.import_module("lessons.04_tensor_parallel.main")  # the Megatron MLP
flops = utilisation.flops  # lesson 13's flops_per_token, mfu, DEVICE_PEAK_FLOPS

LESSON = "15_profiling"
ONE_BUCKET = 1 << 30  # a cap no gradient reaches: the whole gradient in one bucket
# Measured criteria (timing on a shared machine; the README gives their pass rates):
OVERLAP_MARGIN = 0.15  # bucketed DDP hides at least this much more of its communication
WINDOW_TOLERANCE = (1e-3, 0.10)  # |trace - timer| <= 1 ms + 10% for the wait after backward
MAMF_SHAPES = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (512, 2048, 512)]
QUICK_SHAPES = [(256, 256, 256), (512, 512, 512)]


# ============================================================================ runs on the ranks


def ddp_variants(ctx: RankContext, out: str, width: int, steps: int, pairs: int,
                 caps: dict[str, int]) -> dict:
    """Profile `steps` steps of lesson 02's BucketedDDP (a float32 TinyMLP width x width x
    width, 64 rows per rank) for each bucket cap in `caps`, the variants taking turns `pairs`
    times (a slow moment of the machine hits both alike); each run's trace goes to
    out/ddp/{variant}-{pair}/rank{r}.json. Beside the trace, lesson 02's own timers (its
    `on_event` marks on its bench's Stopwatch: CUDA events on a GPU) measure the wait after
    backward, reduced(last) - backward_end, per step. Returns {variant: [{"events" (this rank's
    trace, `load_trace`: plain data, so it crosses nodes too), "timer_wait", "buckets"}] per
    pair}."""
    sizes = {"d_in": width, "hidden": width, "d_out": width}
    x, y = (t.to(ctx.device) for t in data_parallel.global_batch(
        0, 64 * ctx.world_size, 0, d_in=width, d_out=width, dtype=torch.float32))
    x = data_parallel.local_shard(x, ctx.rank, ctx.world_size)
    y = data_parallel.local_shard(y, ctx.rank, ctx.world_size)
    results: dict[str, list] = {name: [] for name in caps}
    for pair in range(pairs):
        for name, cap in caps.items():
            path = Path(out) / "ddp" / f"{name}-{pair}" / f"rank{ctx.rank}.json"
            model = data_parallel.make_model(0, torch.float32, **sizes).to(ctx.device)
            results[name].append(profile_ddp_run(ctx, path, model, cap, x, y, steps))
    return results


def profile_ddp_run(ctx: RankContext, path: Path, model: torch.nn.Module, cap: int,
                    x: torch.Tensor, y: torch.Tensor, steps: int) -> dict:
    """One run of `ddp_variants`: `model` under BucketedDDP with bucket cap `cap`, SGD, the
    phases annotated, `steps` profiled steps (after a warm-up) traced to `path`, lesson 02's
    timer read after each step."""
    watch = ddp_bench.Stopwatch(ctx.device)
    # The MLP's one buffer (input_scale) never changes: no broadcast before each forward
    # (torch DDP's broadcast_buffers=False), so a step's collectives are its buckets' all-reduces.
    ddp = data_parallel.BucketedDDP(model, bucket_cap_mb=cap / 2**20,  # exact: cap / 2^20 * 2^20
                                    broadcast_buffers=False,
                                    on_event=lambda kind, b: watch.mark(f"{kind}{b}"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    waits: list[float] = []

    def step(index: int) -> None:
        watch.marks.clear()
        optimizer.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        waits.append(watch.seconds("backward_end-1", f"reduced{len(ddp.buckets) - 1}"))

    with profiling.annotate_phases(model, optimizer):
        profiling.profile_steps(step, steps, path, cuda=ctx.device.type == "cuda")
    return {"events": profiling.load_trace(path), "timer_wait": waits[-steps:], "buckets": len(ddp.buckets)}


def straggler_collectives(ctx: RankContext, out: str, count: int, delay: float,
                          members: list[int], slow: int) -> list | None:
    """`count` blocking all-reduces of 1,000 floats on the group of `members` (global ranks;
    the others idle), one per profiled step; rank `slow` sleeps `delay` seconds before each (a
    straggler: a slow data loader, a throttled GPU). Every member writes
    out/straggler/rank{r}.json and returns its events (`load_trace`); None on a rank outside
    the group."""
    group = dist.new_group(members) if len(members) < ctx.world_size else None
    if ctx.rank not in members:
        return None
    buffer = torch.ones(1000, device=ctx.device)

    def step(index: int) -> None:
        if ctx.rank == slow:
            time.sleep(delay)
        dist.all_reduce(buffer, group=group)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    path = Path(out) / "straggler" / f"rank{ctx.rank}.json"
    profiling.profile_steps(step, count, path, cuda=ctx.device.type == "cuda")
    return profiling.load_trace(path)


def capstone_config(world: int, steps: int) -> capstone.GPTRunConfig:
    """The capstone's run, small: 2 layers, hidden 64, 4 heads, 64 characters, 2 micro-batches
    of 2 sequences per rank (the global batch grows with the ranks), no dropout."""
    return capstone.GPTRunConfig(layers=2, hidden=64, heads=4, seq=64, global_batch=4 * world,
                                 accum=2, steps=steps + 1, dropout=0.0)


def capstone_steps(ctx: RankContext, out: str, steps: int) -> dict:
    """`steps` profiled steps of the capstone's own GPTTrainer.train_step (after one warm-up),
    phases marked by `annotate_phases` on its model and optimizer, trace to
    out/capstone/rank{r}.json. Returns its events, the model's dimensions and the FLOPs
    FlopCounterMode counts for one of this rank's micro-batches (forward and backward)."""
    text = capstone.load_text()
    tokenizer = capstone.CharTokenizer(text)
    data = tokenizer.encode(text)
    config = capstone_config(ctx.world_size, steps)
    trainer = capstone.GPTTrainer(config, ctx.rank, ctx.world_size, ctx.device, len(tokenizer.chars))
    path = Path(out) / "capstone" / f"rank{ctx.rank}.json"
    with profiling.annotate_phases(trainer.model, trainer.optimizer):
        profiling.profile_steps(lambda index: trainer.train_step(data), steps, path,
                                cuda=ctx.device.type == "cuda")
    tokens, targets = (t.to(ctx.device) for t in capstone.batch_for_step(data, config, 0, ctx.rank,
                                                                          ctx.world_size, 0))
    counted, by_op = utilisation.count_flops(lambda: trainer.model.loss(tokens, targets).backward())
    trainer.optimizer.zero_grad(set_to_none=True)
    return {"events": profiling.load_trace(path), "micro_flops": counted, "micro_tokens": tokens.numel(),
            "by_op": by_op, "weights": utilisation.weight_params(trainer.model),
            "lesson13_n": flops.matmul_params(trainer.model), "vocab": len(tokenizer.chars)}


def tensor_parallel_flops(ctx: RankContext, hidden: int, tokens: int) -> int:
    """FLOPs FlopCounterMode counts on this rank for forward + backward of lesson 04's Megatron
    MLP (ColumnParallelLinear up h -> 4h, GeLU, RowParallelLinear down 4h -> h) split over every
    rank, on `tokens` tokens: each rank multiplies 1/p of every weight."""
    torch.manual_seed(0)
    up, down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
    tp = tensor_parallel.TensorParallelGroup.join(dist.group.WORLD)
    column = tensor_parallel.ColumnParallelLinear(up, tp).to(ctx.device)
    row = tensor_parallel.RowParallelLinear(down, tp).to(ctx.device)
    x = torch.randn(tokens, 1, hidden, device=ctx.device, requires_grad=True)
    return utilisation.count_flops(lambda: row(F.gelu(column(x))).sum().backward())[0]


def demo_worker(ctx: RankContext, out: str, width: int, steps: int, pairs: int, delay: float,
                fault: str | None, fault_rank: int) -> dict:
    """Everything the demo runs on the ranks, in one launch."""
    inject_fault(ctx, fault, fault_rank)
    cap = width * width * 4  # one float32 weight matrix: a bucket per layer
    return {"ddp": ddp_variants(ctx, out, width, steps, pairs, {"bucketed": cap, "one bucket": ONE_BUCKET}),
            "straggler": straggler_collectives(ctx, out, steps + 3, delay, list(range(ctx.world_size)),
                                               ctx.world_size - 1),
            "capstone": capstone_steps(ctx, out, steps),
            "tp_flops": tensor_parallel_flops(ctx, 48, 64)}


# ============================================================================ reading the runs


def wait_after_backward(timeline: dict) -> list[float]:
    """Per step, the trace's reading of lesson 02's timer: from the end of the step's last
    "backward" range (DDP's wait starts there) to the start of its "optimizer" range."""
    waits = []
    for start, end in timeline["steps"]:
        backward = [b for b in timeline["phases"]["backward"] if start <= b[0] <= end]
        optimizer = [o for o in timeline["phases"]["optimizer"] if start <= o[0] <= end]
        waits.append(optimizer[0][0] - backward[-1][1] if backward and optimizer else math.nan)
    return waits


def read_ddp(runs: list[dict]) -> list[dict]:
    """Per rank of one run: overlap, exposed communication, the trace's and the timer's wait,
    the all-reduces per step and the timeline."""
    rows = []
    for run in runs:
        timeline = profiling.rank_timeline(run["events"])
        per_step = [sum(1 for _, s, _ in timeline["collectives"] if start <= s <= end)
                    for start, end in timeline["steps"]]
        rows.append({"overlap": profiling.overlap_fraction(timeline["comm"], timeline["compute"]),
                     "exposed": profiling.exposed_communication(timeline),
                     "trace_wait": wait_after_backward(timeline), "timer_wait": run["timer_wait"],
                     "comm_per_step": per_step, "buckets": run["buckets"], "timeline": timeline})
    return rows


def within(a: float, b: float, tolerance: tuple[float, float] = WINDOW_TOLERANCE) -> bool:
    """|a - b| <= absolute + relative x |b|."""
    return abs(a - b) <= tolerance[0] + tolerance[1] * abs(b)


def ddp_checks(per_rank: list[dict], world: int, cuda: bool = False) -> tuple[list[Check], dict]:
    """Bucketing seen in the trace, overlap by the numbers, and the trace against the timers
    (on a CPU: on a GPU the host's ranges run ahead of the kernels that lesson 02's CUDA-event
    timer measures, so the two windows differ by design; the numbers go to the metrics)."""
    pairs = len(per_rank[0]["ddp"]["bucketed"])
    runs = {name: [read_ddp([r["ddp"][name][p] for r in per_rank]) for p in range(pairs)]
            for name in ("bucketed", "one bucket")}
    checks = []
    counts_ok, detail = True, []
    for name, by_pair in runs.items():
        for ranks in by_pair:
            for row in ranks:
                counts_ok &= all(c == row["buckets"] for c in row["comm_per_step"])
        detail.append(f"{name}: {by_pair[0][0]['buckets']} bucket(s), {by_pair[0][0]['comm_per_step']}")
    checks.append(Check("the trace shows one all-reduce call per bucket per step, on every rank",
                        counts_ok, "; ".join(detail) + " all-reduces per step on rank 0"))
    overlap = {name: [statistics.mean(r["overlap"] or 0.0 for r in ranks) for ranks in by_pair]
               for name, by_pair in runs.items()}
    gain = statistics.median(b - o for b, o in zip(overlap["bucketed"], overlap["one bucket"]))
    exposed = {name: statistics.median(e for ranks in by_pair for r in ranks for e in r["exposed"])
               for name, by_pair in runs.items()}
    if world > 1:
        checks.append(Check(f"buckets hide communication behind backward (trace; median of {pairs} "
                            f"pair(s), margin {OVERLAP_MARGIN})", gain >= OVERLAP_MARGIN,
                            f"overlap {statistics.median(overlap['bucketed']):.0%} with buckets vs "
                            f"{statistics.median(overlap['one bucket']):.0%} in one; exposed per "
                            f"step {exposed['bucketed'] * 1e3:.1f} vs {exposed['one bucket'] * 1e3:.1f} ms"))
    # One rank: no claim about overlap. NCCL launches no kernel for a one-rank all-reduce (on
    # one H100 the trace has none: overlap None), gloo still runs a local reduction on its own
    # thread (an overlap, of nothing that costs a peer's time).
    waits = [(t, w) for by_pair in runs.values() for ranks in by_pair for r in ranks
             for t, w in zip(r["trace_wait"], r["timer_wait"])]
    difference = statistics.median(abs(t - w) for t, w in waits)
    typical = statistics.median(w for _, w in waits)
    if not cuda:
        checks.append(Check("the trace's wait after backward == lesson 02's timers (median "
                            f"|difference| <= {WINDOW_TOLERANCE[0] * 1e3:g} ms + {WINDOW_TOLERANCE[1]:.0%})",
                            within(typical + difference, typical),
                            f"median |trace - timer| {difference * 1e3:.2f} ms of a median wait of "
                            f"{typical * 1e3:.1f} ms ({len(waits)} steps x ranks); exposed "
                            "communication (trace) is the part of that wait with an all-reduce "
                            "in flight"))
    metrics = {"wait_ms_trace_vs_timer": [difference * 1e3, typical * 1e3],
               "overlap_bucketed": statistics.median(overlap["bucketed"]),
               "overlap_one_bucket": statistics.median(overlap["one bucket"]),
               "exposed_ms_bucketed": exposed["bucketed"] * 1e3,
               "exposed_ms_one_bucket": exposed["one bucket"] * 1e3}
    return checks, metrics


def straggler_check(per_rank: list[list | None], slow: int, delay: float) -> tuple[Check, dict]:
    """The rank the others waited for, and how long, read from every member's trace."""
    collectives = {rank: profiling.rank_timeline(events)["collectives"]
                   for rank, events in enumerate(per_rank) if events is not None}
    gaps = profiling.rank_gaps(collectives)
    named = sum(1 for r in gaps["waited_for"] if r == slow)
    median_gap = statistics.median(gaps["gap_s"]) if gaps["gap_s"] else 0.0
    if len(collectives) < 2:
        return Check("1 rank: nobody waits (rank_gaps)", gaps["gap_s"] == [0.0] * len(gaps["gap_s"]),
                     f"{len(gaps['gap_s'])} collectives, gaps 0"), {}
    ok = named * 2 > len(gaps["waited_for"]) and 0.5 * delay <= median_gap <= 5 * delay
    waits = ", ".join(f"rank {r} {w * 1e3:.0f} ms" for r, w in gaps["wait_s"].items())
    return Check(f"rank {slow}, late by {delay * 1e3:.0f} ms, is the rank the others wait for "
                 "(trace)", ok, f"named at {named} of {len(gaps['waited_for'])} collectives; median "
                 f"gap {median_gap * 1e3:.1f} ms; waits {waits}"), \
        {"straggler_gap_ms": median_gap * 1e3, "waited_for": gaps["waited_for"]}


def capstone_checks(per_rank: list[dict], world: int, steps: int, peak: float) -> tuple[list[Check], dict]:
    """Phases on every rank; FLOPs counted against PaLM's formula; the run's utilisation of
    this CPU's measured achievable peak."""
    config = capstone_config(world, steps)
    results = [r["capstone"] for r in per_rank]
    timelines = [profiling.rank_timeline(r["events"]) for r in results]
    phases_ok = all(len(t["phases"]["forward"]) == len(t["phases"]["backward"]) == config.accum * steps
                    and len(t["phases"]["optimizer"]) == steps and len(t["steps"]) == steps
                    for t in timelines)
    first = results[0]
    per_token = flops.flops_per_token(first["weights"], config.layers, config.hidden, config.seq)
    counted = first["micro_flops"] / first["micro_tokens"]
    lesson13 = flops.flops_per_token(first["lesson13_n"], config.layers, config.hidden, config.seq)
    step_s = statistics.median(end - start for t in timelines for start, end in t["steps"])
    job_tokens = config.global_batch * config.seq
    achieved = per_token * job_tokens / step_s
    share = flops.mfu(job_tokens / step_s, per_token, world, peak)
    checks = [
        Check("capstone step traced unedited: forward/backward per micro-batch, optimizer per step",
              phases_ok, f"{config.accum} micro-batches x {steps} steps on each of {world} rank(s)"),
        Check("FLOPs counted (FlopCounterMode) == 6 W + 12 L H Q T per token, exactly",
              counted == per_token, f"{counted:,.0f} == {per_token:,} FLOPs/token (W = "
              f"{first['weights']:,} matmul weights); lesson 13's N ({first['lesson13_n']:,}, "
              f"biases and norms too) gives {lesson13 / per_token - 1:+.2%}; {first['by_op']}"),
    ]
    metrics = {"capstone_step_ms": step_s * 1e3, "capstone_flops_per_s": achieved,
               "capstone_share_of_achievable": share}
    return checks, metrics


def recompute_checks(vocab: int = 61) -> list[Check]:
    """HFU's numerator: FlopCounterMode on TinyGPT with each recomputation == the formula."""
    tiny_gpt = flops.tiny_gpt
    layers, hidden, heads, seq, batch = 2, 64, 4, 32, 3
    rows, ok = [], True
    for recompute, mode in ((False, "none"), (True, "full"), ("selective", "selective")):
        torch.manual_seed(0)
        model = tiny_gpt.TinyGPT(vocab, hidden, heads, layers, seq, dropout=0.0, recompute=recompute)
        tokens = torch.randint(0, vocab, (batch, seq))
        counted = utilisation.count_flops(lambda model=model, tokens=tokens:
                                          model.loss(tokens, tokens).backward())[0]
        formula = utilisation.hardware_flops_per_token(
            utilisation.weight_params(model), utilisation.weight_params(model, layers_only=True),
            layers, hidden, seq, mode) * batch * seq
        ok &= counted == formula
        rows.append((mode, counted))
    base = rows[0][1]
    return [Check("recomputation: FLOPs counted == hardware_flops_per_token (none, full, selective)",
                  ok, ", ".join(f"{mode} {count / base:.3f}x" for mode, count in rows)
                  + " of the model's FLOPs: HFU/MFU")]


def pitfall_checks(per_rank: list[dict], world: int) -> list[Check]:
    """The MFU mistakes seen in torchtitan's issues, each caught here."""
    h100 = "NVIDIA H100 80GB HBM3"
    bf16, tf32 = utilisation.peak_flops(h100, "bfloat16"), utilisation.peak_flops(h100, "tf32")
    refused = []
    for name in ("NVIDIA L4", "AMD Instinct MI350X", "NVIDIA H100"):
        try:
            utilisation.peak_flops(name, "bfloat16")
        except ValueError:
            refused.append(name)
    hidden, tokens = 48, 64
    with one_thread():
        torch.manual_seed(0)
        up, down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
        x = torch.randn(tokens, 1, hidden, requires_grad=True)
        dense = utilisation.count_flops(lambda: down(F.gelu(up(x))).sum().backward())[0]
    per_rank_counts = [r["tp_flops"] for r in per_rank]
    return [
        Check("a bf16 run divided by the TF32 peak reports twice its MFU (torchtitan #668)",
              bf16 == 2 * tf32, f"H100 SXM dense: bf16 {bf16 / 1e12:g}, TF32 {tf32 / 1e12:g} TFLOP/s"),
        Check("an unknown device is refused, never given another's peak (Primus #772)",
              refused == ["NVIDIA L4", "AMD Instinct MI350X", "NVIDIA H100"],
              f"refused {refused} (torchtitan's fallback: the A100's 312 TFLOP/s)"),
        Check(f"TP: each of {world} rank(s) counts 1/{world} of the MLP's FLOPs; the job's = "
              "their sum (torchtitan #1989)", sum(per_rank_counts) == dense
              and all(c * world == dense for c in per_rank_counts),
              f"per rank {per_rank_counts}, one process {dense:,}; counting the whole model on "
              f"every rank would claim {world * dense:,}"),
    ]


def roofline_checks(peak: float, bandwidth: float, world: int) -> tuple[list[Check], dict]:
    """The H100's ridge point from its datasheet, and this CPU's from measurements."""
    h100 = roofline.ridge_point(roofline.H100_SXM["bf16_flops"], roofline.H100_SXM["hbm_bytes_per_s"])
    config = capstone_config(world, 1)
    tokens = config.micro_batch(world) * config.seq
    ops = roofline.capstone_operations(tokens, config.hidden, config.heads, config.seq, 4)
    cpu_ridge = roofline.ridge_point(peak, bandwidth)
    bound = [op["name"] for op in ops if roofline.is_memory_bound(
        roofline.arithmetic_intensity(op["flops"], op["bytes"]), peak, bandwidth)]
    checks = [Check("H100 SXM ridge point: 989e12 / 3.35e12 = 295 FLOPs per byte (bf16, dense)",
                    round(h100) == 295, f"{h100:.1f} FLOPs/byte"),
              Check("this CPU's ridge point (measured peak / measured bandwidth); the capstone's "
                    "memory-bound operations here", cpu_ridge > 0,
                    f"{peak / 1e9:.1f} GFLOP/s / {bandwidth / 1e9:.1f} GB/s = {cpu_ridge:.1f} "
                    f"FLOPs/byte; memory-bound: {', '.join(bound) or 'none'}")]
    return checks, {"cpu_ridge": cpu_ridge, "h100_ridge": h100, "memory_bound_ops": bound}


# ============================================================================ the demo


def demo(args, out: Path) -> Report:
    world = world_size_of(args)
    device, backend = choose_device(args.device, world)
    per_rank = launch(demo_worker, world, (str(out), args.width, args.steps, args.pairs,
                                           args.delay / 1e3, args.fault, args.fault_rank),
                      device=args.device, timeout_s=args.timeout)
    world = len(per_rank)
    from . import bench
    with one_thread():  # the peak of one thread: what each CPU rank runs on
        peak, shape = utilisation.achievable_peak(QUICK_SHAPES if args.quick else MAMF_SHAPES)
        bandwidth = bench.memory_bandwidth(1 << (22 if args.quick else 24))
    checks, metrics = ddp_checks(per_rank, world, cuda=device == "cuda")
    row, straggler = straggler_check([r["straggler"] for r in per_rank], world - 1, args.delay / 1e3)
    checks.append(row)
    more, capstone_metrics = capstone_checks(per_rank, world, args.steps, peak)
    checks += more + recompute_checks() + pitfall_checks(per_rank, world)
    checks.append(Check("achievable peak of this CPU, one thread (MAMF-style search over shapes)",
                        peak > 0, f"{peak / 1e9:.1f} GFLOP/s float32 at {shape}; the capstone "
                        f"step ran at {capstone_metrics['capstone_share_of_achievable']:.1%} of "
                        f"{world} x that"))
    more, roof = roofline_checks(peak, bandwidth, world)
    checks += more
    if args.out is not None and is_reporting_rank():  # under torchrun every rank runs this
        from . import figures
        figures.plot_ddp_timelines(read_ddp([r["ddp"]["bucketed"][0] for r in per_rank]),
                                   read_ddp([r["ddp"]["one bucket"][0] for r in per_rank]),
                                   out / "ddp_timeline.png")
    metrics.update(straggler, **capstone_metrics, **roof, achievable_peak_flops=peak,
                   achievable_peak_shape=list(shape), memory_bandwidth=bandwidth,
                   traces=str(out) if args.out is not None else None)
    metrics["headline"] = (f"overlap {metrics.get('overlap_bucketed') or 0:.0%} bucketed vs "
                           f"{metrics.get('overlap_one_bucket') or 0:.0%} one bucket; "
                           f"{peak / 1e9:.0f} GFLOP/s achievable")
    return Report(LESSON, device, backend, world, checks, metrics)


# ============================================================================ the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Profiling a distributed step: torch.profiler traces of lesson 02's "
                           "DDP and the capstone, read into overlap, exposed communication and "
                           "rank gaps; FLOPs, MFU/HFU and the peak; rooflines; busbw.", world_size=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="keep every rank's traces (open them in ui.perfetto.dev) and the "
                             "timeline figure in this folder (default: a temporary one, removed)")
    parser.add_argument("--steps", type=int_in(1, 50), default=3, help="profiled steps per run (default 3)")
    parser.add_argument("--pairs", type=int_in(1, 20), default=2,
                        help="bucketed / one-bucket runs taking turns (default 2)")
    parser.add_argument("--width", type=int_in(8, 8192), default=1024,
                        help="the DDP model's width: 3 layers of width x width (default 1024)")
    parser.add_argument("--delay", type=float_in(1.0, 5000.0), default=60.0,
                        help="the straggler's delay before each collective, in ms (default 60)")
    parser.add_argument("--bench", action="store_true",
                        help="the communication benchmark instead: algbw and busbw of all-reduce, "
                             "all-gather, reduce-scatter and all-to-all over sizes, as nccl-tests "
                             "reports them, with lesson 01's alpha-beta fit")
    parser.add_argument("--max-bytes", type=int_in(1 << 12, 1 << 30), default=None,
                        help="--bench: the largest message (default 4 MiB, 1 MiB with --quick)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty: choose a new folder")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.bench:
        from . import bench
        return finish(bench.run_bench(args), args.json, started)
    out = args.out or Path(tempfile.mkdtemp(prefix="lesson15-"))
    try:
        report = demo(args, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    if args.out is not None and is_reporting_rank():
        print(f"traces in {out}: open any rank*.json in https://ui.perfetto.dev (Open trace file)",
              file=sys.stderr)
    return finish(report, args.json, started)


if __name__ == "__main__":
    from lessons._report import run_main
    run_main(main)
