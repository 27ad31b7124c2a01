"""Lesson 05: pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules,
and a real pipeline over point-to-point messages.

The story, top to bottom:

1. Operations: F (forward of one micro-batch on one stage), B (its backward), and for the
   zero-bubble schedule B split into B (input gradient) and W (weight gradient).
2. Schedules as per-device orders: GPipe (all forwards, then all backwards), 1F1B (warm up, then
   one forward one backward), interleaved 1F1B (v model chunks per device), ZB-H1 (W passes
   moved into the bubbles).
3. A simulator: each device runs its order; an operation starts when its device is free and its
   inputs exist. It reports the bubble fraction and the peak number of micro-batches whose
   activations a device holds, checked against the closed forms, and draws a Gantt chart.
4. A real pipeline: a stack of layers split into 2-4 stages on 2-4 processes, executing the
   GPipe and 1F1B orders with isend/irecv. Loss and every gradient equal one process running
   the whole model, and torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) agrees.

Run: `python lessons/05_pipeline/main.py` (everything), or the simulator alone:
`python lessons/05_pipeline/main.py --simulate --stages 4 --microbatches 8 --chunks 2`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn

from lessons._launch import RankContext, inject_fault, launch
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    int_in,
    lesson_parser,
    merge_rank_checks,
    run_main,
)

LESSON = "05_pipeline"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")
# float64; the pipeline adds the same terms in the same order as one process, but the matmul
# kernels may block differently on a split model: allow float64 rounding, nothing more.
TOLERANCE = 1e-12

# ============================================================================ 1-2. schedules


@dataclasses.dataclass(frozen=True)
class Op:
    """One unit of work on one device: kind F, B (full backward, or input-gradient only when
    the schedule splits backward) or W (weight gradient), for a micro-batch and model chunk."""

    kind: str
    microbatch: int
    chunk: int = 0


def gpipe_order(stages: int, microbatches: int) -> list[list[Op]]:
    """Every device: F0 .. F(m-1), then B0 .. B(m-1). Holds all m micro-batches' activations."""
    return [[Op("F", i) for i in range(microbatches)] + [Op("B", i) for i in range(microbatches)]
            for _ in range(stages)]


def one_f_one_b_order(stages: int, microbatches: int) -> list[list[Op]]:
    """Device d warms up with min(p-d-1, m) forwards, then alternates one forward and one
    backward, then drains the remaining backwards (PipeDream-Flush). At most p-d micro-batches
    in flight on device d: p on device 0."""
    orders = []
    for device in range(stages):
        warmup = min(stages - device - 1, microbatches)
        order = [Op("F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < microbatches:
            if forward < microbatches:
                order.append(Op("F", forward))
                forward += 1
            order.append(Op("B", backward))
            backward += 1
        orders.append(order)
    return orders


def interleaved_order(stages: int, microbatches: int, chunks: int) -> list[list[Op]]:
    """Interleaved 1F1B (Narayanan et al. 2021): device d holds v = `chunks` model chunks
    (virtual stages d, d+p, d+2p, ...). Micro-batches go through the chunks in groups of p; the
    k-th forward of a device is micro-batch (k // (p v)) p + k % p on chunk (k // p) % v, and
    backwards take the chunks in reverse. Warm-up: (p-d-1) x 2 + (v-1) x p forwards."""
    if microbatches % stages:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({microbatches}) to be a "
                         f"multiple of stages ({stages})")
    total = microbatches * chunks

    def forward_op(k: int) -> Op:
        return Op("F", (k // (stages * chunks)) * stages + k % stages, (k // stages) % chunks)

    def backward_op(k: int) -> Op:
        return Op("B", (k // (stages * chunks)) * stages + k % stages,
                  chunks - 1 - (k // stages) % chunks)

    orders = []
    for device in range(stages):
        warmup = min((stages - device - 1) * 2 + (chunks - 1) * stages, total)
        order = [forward_op(k) for k in range(warmup)]
        forward, backward = warmup, 0
        while backward < total:
            if forward < total:
                order.append(forward_op(forward))
                forward += 1
            order.append(backward_op(backward))
            backward += 1
        orders.append(order)
    return orders


def schedule_order(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Op]]:
    """The per-device order of a named schedule (ZB-H1's comes from `zb_h1_order`)."""
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError("stages, micro-batches and chunks must be >= 1")
    if kind == "gpipe":
        return gpipe_order(stages, microbatches)
    if kind == "1f1b":
        return one_f_one_b_order(stages, microbatches)
    if kind == "interleaved":
        return interleaved_order(stages, microbatches, chunks)
    if kind == "zb_h1":
        return zb_h1_order(stages, microbatches)
    raise ValueError(f"unknown schedule {kind!r}; use one of {SCHEDULES}")


def zb_h1_order(stages: int, microbatches: int, t_f: float = 1, t_b: float = 1,
                t_w: float = 1) -> list[list[Op]]:
    """ZB-H1 (Qi et al. 2023): backward split into B (input gradient, on the critical path)
    and W (weight gradient, which nothing downstream waits for). Each device keeps 1F1B's
    order of F and B; a pending W runs when it fits in an idle gap without delaying the next
    F or B, or when starting another F would hold more than p micro-batches (1F1B's peak), or
    at the end. Built by simulating that rule with durations t_f, t_b, t_w."""
    base = [[(op.kind, op.microbatch) for op in order]
            for order in one_f_one_b_order(stages, microbatches)]
    duration = {"F": t_f, "B": t_b, "W": t_w}
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    pending_w: list[list[int]] = [[] for _ in range(stages)]
    started_f, finished_w = [0] * stages, [0] * stages
    orders: list[list[Op]] = [[] for _ in range(stages)]
    for _ in range(3 * stages * microbatches):
        best = None  # (start, device, kind, microbatch)
        for d in range(stages):
            ready = None
            if position[d] < len(base[d]):
                kind, i = base[d][position[d]]
                if kind == "F":
                    deps = [("F", d - 1, i)] if d > 0 else []
                else:
                    deps = [("F", d, i)] + ([("B", d + 1, i)] if d < stages - 1 else [])
                if all(dep in done for dep in deps):
                    ready = max([free[d]] + [done[dep] for dep in deps])
            over_memory = (position[d] < len(base[d]) and base[d][position[d]][0] == "F"
                           and started_f[d] - finished_w[d] >= stages)
            gap_fits = ready is None or free[d] + t_w <= ready
            if pending_w[d] and (over_memory or gap_fits):
                candidate = (free[d], d, "W", pending_w[d][0])
            elif ready is not None:
                candidate = (ready, d, *base[d][position[d]])
            else:
                continue
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        start, d, kind, i = best
        free[d] = start + duration[kind]
        done[(kind, d, i)] = free[d]
        orders[d].append(Op(kind, i))
        if kind == "W":
            pending_w[d].pop(0)
            finished_w[d] += 1
        else:
            position[d] += 1
            if kind == "F":
                started_f[d] += 1
            else:
                pending_w[d].append(i)
    return orders


# ============================================================================ 3. the simulator


@dataclasses.dataclass
class Timeline:
    """Each device's executed ops as (op, start, end), and what follows from them."""

    stages: int
    chunks: int
    rows: list[list[tuple[Op, float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for row in self.rows for _, _, end in row)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all devices' time: 1 - busy / (devices x makespan)."""
        busy = sum(end - start for row in self.rows for _, start, end in row)
        return 1.0 - busy / (self.stages * self.makespan)

    def peak_inflight(self) -> float:
        """Max over devices and time of micro-batches whose activations are held: from a
        forward's start until the op that frees them (B, or W when backward is split). A chunk
        holds 1/v of a stage's activations."""
        peak = 0.0
        for row in self.rows:
            split = any(op.kind == "W" for op, _, _ in row)
            events = []
            for op, start, end in row:
                if op.kind == "F":
                    events.append((start, 1))
                elif op.kind == ("W" if split else "B"):
                    events.append((end, -1))
            held = 0
            for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
                held += delta
                peak = max(peak, held / self.chunks)
        return peak


def simulate(orders: list[list[Op]], chunks: int = 1, t_f: float = 1.0, t_b: float = 2.0,
             t_w: float = 0.0) -> Timeline:
    """Run every device's order: an op starts when its device is free and its inputs exist.
    F on virtual stage c p + d needs F of the previous virtual stage; B needs this stage's F and
    the next virtual stage's B; W needs this stage's B. Durations are per chunk (1/v of a
    stage): F t_f / v, B t_b / v, W t_w / v (t_w = 0: backward not split). Communication is free.
    Raises ValueError if the orders deadlock."""
    stages = len(orders)
    virtual = stages * chunks
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    rows: list[list[tuple[Op, float, float]]] = [[] for _ in range(stages)]
    duration = {"F": t_f / chunks, "B": t_b / chunks, "W": t_w / chunks}
    while any(position[d] < len(orders[d]) for d in range(stages)):
        progressed = False
        for d in range(stages):
            while position[d] < len(orders[d]):
                op = orders[d][position[d]]
                vs = op.chunk * stages + d
                if op.kind == "F":
                    deps = [("F", vs - 1, op.microbatch)] if vs > 0 else []
                elif op.kind == "B":
                    deps = [("F", vs, op.microbatch)] + (
                        [("B", vs + 1, op.microbatch)] if vs < virtual - 1 else [])
                else:
                    deps = [("B", vs, op.microbatch)]
                if any(dep not in done for dep in deps):
                    break
                start = max([free[d]] + [done[dep] for dep in deps])
                end = start + duration[op.kind]
                done[(op.kind, vs, op.microbatch)] = end
                rows[d].append((op, start, end))
                free[d] = end
                position[d] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: an op waits for one that never runs")
    return Timeline(stages, chunks, rows)


def bubble_closed_form(kind: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Bubble as a share of total time (t_B = 2 t_F; for ZB-H1 t_F = t_B = t_W):
    GPipe and 1F1B (p-1)/(m+p-1); interleaved ((p-1)/v) / (m + (p-1)/v), i.e. Megatron's
    (1/v)(p-1)/m relative to the ideal time; ZB-H1 (p-1)/(3m + p-1), a third of 1F1B's bubble
    time (p-1)(t_F + t_B - t_W) instead of (p-1)(t_F + t_B + t_W)."""
    p, m, v = stages, microbatches, chunks
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind == "interleaved":
        return ((p - 1) / v) / (m + (p - 1) / v)
    if kind == "zb_h1":
        if m < p:
            raise ValueError("the ZB-H1 closed form assumes micro-batches >= stages")
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"unknown schedule {kind!r}")


def simulate_schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Timeline:
    """Times: F = 1, B = 2 (B = 1 and W = 1 when split, for ZB-H1)."""
    if kind == "zb_h1":
        return simulate(zb_h1_order(stages, microbatches), 1, 1.0, 1.0, 1.0)
    return simulate(schedule_order(kind, stages, microbatches, chunks),
                    chunks if kind == "interleaved" else 1)


def plot_gantt(timeline: Timeline, title: str, path: Path) -> None:
    """One row per device, one box per op (F blue, B green, W orange, micro-batch number
    inside); the white gaps are the bubble."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"F": "#8ab6e6", "B": "#8fd18f", "W": "#f2b36b"}
    fig, ax = plt.subplots(figsize=(max(6, timeline.makespan * 0.35), 0.5 * timeline.stages + 1))
    for device, row in enumerate(timeline.rows):
        for op, start, end in row:
            shade = 0.75 if op.chunk % 2 else 1.0
            ax.broken_barh([(start, end - start)], (device - 0.4, 0.8), facecolors=colors[op.kind],
                           edgecolors="black", linewidth=0.5, alpha=shade)
            ax.text((start + end) / 2, device, str(op.microbatch), ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(timeline.stages), [f"device {d}" for d in range(timeline.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward of a whole stage = 1)")
    ax.set_title(f"{title}: bubble {timeline.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def simulation_report(stages: int, microbatches: int, chunks: int) -> tuple[list[Check], dict]:
    """Simulate the four schedules; compare bubbles and in-flight peaks with the closed forms."""
    checks: list[Check] = []
    metrics: dict = {"bubble_interleaved": None, "peak_inflight_interleaved": None}
    for kind in SCHEDULES:
        if kind == "interleaved" and (chunks < 2 or microbatches % stages):
            continue
        timeline = simulate_schedule(kind, stages, microbatches, chunks)
        bubble = timeline.bubble_fraction
        metrics[f"bubble_{kind}"] = bubble
        metrics[f"peak_inflight_{kind}"] = timeline.peak_inflight()
        if kind == "zb_h1" and microbatches < stages:
            continue  # the closed form assumes m >= p; the simulated value is still reported
        expected = bubble_closed_form(kind, stages, microbatches, chunks)
        checks.append(Check(f"{kind}: simulated bubble == closed form", abs(bubble - expected) < 1e-9,
                            f"{bubble:.4f} simulated, {expected:.4f} formula"))
    checks.append(Check("GPipe holds all m micro-batches; 1F1B at most p",
                        metrics["peak_inflight_gpipe"] == microbatches
                        and metrics["peak_inflight_1f1b"] == min(stages, microbatches),
                        f"GPipe {metrics['peak_inflight_gpipe']:g}, 1F1B "
                        f"{metrics['peak_inflight_1f1b']:g}"))
    checks.append(Check("ZB-H1 keeps 1F1B's peak memory", metrics["peak_inflight_zb_h1"]
                        <= metrics["peak_inflight_1f1b"],
                        f"ZB-H1 {metrics['peak_inflight_zb_h1']:g} micro-batches"))
    return checks, metrics


# ============================================================================ 4. a real pipeline


LAYERS, WIDTH = 12, 16


def make_layers(seed: int) -> nn.Sequential:
    """The whole model: LAYERS x (Linear(WIDTH, WIDTH), Tanh), float64."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(LAYERS)]).double()


def stage_module(seed: int, stage: int, stages: int) -> nn.Sequential:
    """Layers [stage L/p, (stage+1) L/p) of the same model."""
    layers = list(make_layers(seed))
    per = LAYERS // stages
    return nn.Sequential(*layers[stage * per:(stage + 1) * per])


def pipeline_data(seed: int, microbatches: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(microbatches * rows, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(microbatches * rows, WIDTH, generator=generator, dtype=torch.float64)
    return x, y


def microbatch_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def single_process_reference(seed: int, microbatches: int) -> dict:
    """One process, the whole model: loss = mean over micro-batches of each one's MSE."""
    model = make_layers(seed)
    x, y = pipeline_data(seed, microbatches)
    losses = []
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
        loss = microbatch_loss(model(xs), ys) / microbatches
        loss.backward()
        losses.append(loss.item() * microbatches)
    return {"losses": losses, "grads": [p.grad.reshape(-1).tolist() for p in model.parameters()]}


def run_pipeline(ctx: RankContext, kind: str, seed: int, microbatches: int) -> dict:
    """This rank is one stage. Execute the schedule's order for this device with point-to-point
    messages: F receives an activation from the previous stage and sends its output on; B
    receives the output's gradient from the next stage, backpropagates, and sends the input's
    gradient back. Sends are non-blocking (waited at the end), receives block when needed."""
    stage, stages = ctx.rank, ctx.world_size
    module = stage_module(seed, stage, stages)
    x, y = pipeline_data(seed, microbatches)
    inputs, targets = x.chunk(microbatches), y.chunk(microbatches)
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sends, losses = [], []
    for op in schedule_order(kind, stages, microbatches)[stage]:
        i = op.microbatch
        if op.kind == "F":
            if stage == 0:
                activation = inputs[i].clone()
            else:
                activation = torch.empty(inputs[i].shape, dtype=torch.float64)
                dist.recv(activation, stage - 1, tag=2 * i)
            activation.requires_grad_(stage > 0)
            out = module(activation)
            if stage == stages - 1:
                out = microbatch_loss(out, targets[i]) / microbatches
                losses.append(out.item() * microbatches)
            else:
                sends.append(dist.isend(out.detach().contiguous(), stage + 1, tag=2 * i))
            saved[i] = (activation, out)
        else:
            activation, out = saved.pop(i)
            if stage == stages - 1:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, stage + 1, tag=2 * i + 1)
                out.backward(grad)
            if stage > 0:
                sends.append(dist.isend(activation.grad.contiguous(), stage - 1, tag=2 * i + 1))
    for request in sends:
        request.wait()
    return {"losses": losses, "grads": [p.grad.reshape(-1).tolist() for p in module.parameters()]}


def run_torch_pipelining(ctx: RankContext, kind: str, seed: int, microbatches: int) -> dict:
    """The same stages through torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    module = stage_module(seed, ctx.rank, ctx.world_size)
    stage = PipelineStage(module, ctx.rank, ctx.world_size, torch.device("cpu"))
    schedule_class = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=microbatches, loss_fn=microbatch_loss)
    x, y = pipeline_data(seed, microbatches)
    losses: list[torch.Tensor] = []
    inputs = (x,) if ctx.rank == 0 else ()  # the first stage feeds the data
    last = {"target": y, "losses": losses} if ctx.rank == ctx.world_size - 1 else {}
    schedule.step(*inputs, **last)
    return {"losses": [loss.item() for loss in losses],
            "grads": [p.grad.reshape(-1).tolist() for p in module.parameters()]}


def gather_grads(ctx: RankContext, grads: list[list[float]]) -> list[list[float]]:
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, grads)
    return [g for stage_grads in everyone for g in stage_grads]


def max_gap(a: list, b: list) -> float:
    flat_a = torch.tensor([v for row in a for v in (row if isinstance(row, list) else [row])],
                          dtype=torch.float64)
    flat_b = torch.tensor([v for row in b for v in (row if isinstance(row, list) else [row])],
                          dtype=torch.float64)
    if flat_a.shape != flat_b.shape:
        return float("inf")
    return float((flat_a - flat_b).abs().max()) if flat_a.numel() else 0.0


def pipeline_worker(ctx: RankContext, seed: int, microbatches: int, fault: str | None,
                    fault_rank: int) -> dict:
    """Our GPipe and 1F1B, and torch's, against one process running the whole model."""
    inject_fault(ctx, fault, fault_rank)
    if LAYERS % ctx.world_size:
        raise ValueError(f"{LAYERS} layers cannot be split into {ctx.world_size} equal stages")
    reference = single_process_reference(seed, microbatches)
    checks = []
    last = ctx.world_size - 1
    for kind in ("gpipe", "1f1b"):
        ours = run_pipeline(ctx, kind, seed, microbatches)
        theirs = run_torch_pipelining(ctx, kind, seed, microbatches)
        ours_grads, theirs_grads = gather_grads(ctx, ours["grads"]), gather_grads(ctx, theirs["grads"])
        losses: list = [None] * ctx.world_size
        dist.all_gather_object(losses, (ours["losses"], theirs["losses"]))
        ours_losses, theirs_losses = losses[last]
        gap_ref = max(max_gap(ours_losses, reference["losses"]), max_gap(ours_grads, reference["grads"]))
        gap_torch = max(max_gap(ours_losses, theirs_losses), max_gap(ours_grads, theirs_grads))
        name = "GPipe" if kind == "gpipe" else "1F1B"
        checks.append(Check(f"our {name} pipeline: loss and every gradient == one process",
                            gap_ref <= TOLERANCE, f"max |diff| {gap_ref:.1e}"))
        checks.append(Check(f"our {name} == torch.distributed.pipelining Schedule{name}",
                            gap_torch <= TOLERANCE, f"max |diff| {gap_torch:.1e}"))
    return {"checks": [vars(c) for c in checks]}


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Pipeline schedules simulated and checked against their closed forms, "
                           "and a real pipeline checked against one process and "
                           "torch.distributed.pipelining.")
    parser.add_argument("--simulate", action="store_true", help="only the schedule simulator")
    parser.add_argument("--stages", type=int_in(1, 64), default=4, help="pipeline stages P (default 4)")
    parser.add_argument("--microbatches", type=int_in(1, 4096), default=8,
                        help="micro-batches M (default 8)")
    parser.add_argument("--chunks", type=int_in(1, 16), default=2,
                        help="model chunks per device V for interleaved 1F1B (default 2)")
    parser.add_argument("--plots", type=Path, default=None,
                        help="directory for one Gantt chart PNG per schedule")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.chunks > 1 and args.microbatches % args.stages:
        parser.error(f"--microbatches {args.microbatches} must be a multiple of --stages "
                     f"{args.stages} for interleaved 1F1B (or use --chunks 1)")
    if not args.simulate and LAYERS % args.world_size:
        parser.error(f"--world-size {args.world_size} must divide the model's {LAYERS} layers")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    checks, metrics = simulation_report(args.stages, args.microbatches, args.chunks)
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        for kind in SCHEDULES:
            if kind == "interleaved" and args.chunks < 2:
                continue
            plot_gantt(simulate_schedule(kind, args.stages, args.microbatches, args.chunks),
                       f"{kind}, p={args.stages}, m={args.microbatches}",
                       args.plots / f"{kind}.png")
    world = 1
    if not args.simulate:
        results = launch(pipeline_worker, args.world_size,
                         (args.seed, args.microbatches, args.fault, args.fault_rank),
                         device="cpu", timeout_s=args.timeout)
        checks += merge_rank_checks([r["checks"] for r in results])
        world = len(results)
    metrics["headline"] = (f"bubble p={args.stages} m={args.microbatches}: GPipe/1F1B "
                           f"{metrics['bubble_gpipe']:.1%}, ZB-H1 {metrics['bubble_zb_h1']:.1%}")
    return finish(Report(LESSON, "cpu", "gloo", world, checks, metrics), args.json, started)


if __name__ == "__main__":
    run_main(main)
