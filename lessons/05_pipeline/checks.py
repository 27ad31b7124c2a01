"""Lesson 05's proof: simulated schedules against their closed forms, the message plan against
a rendezvous (NCCL-like) model, and the real pipeline against one process and against
torch.distributed.pipelining; the Gantt charts (--plots) and the CLI.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from lessons._checks import max_abs_diff
from lessons._launch import RankContext, inject_fault, launch
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    int_in,
    lesson_parser,
    merge_rank_checks,
)

from . import main as pipeline

LESSON = "05_pipeline"
# float64; each stage runs the same layer ops on the same micro-batch shapes as one process,
# so results agree to float64 rounding at most (bit for bit on CPU); a lost or misrouted
# message is off by O(1).
TOLERANCE = 1e-12
LAYERS, WIDTH, ROWS = 12, 16, 4  # the model: 12 x (Linear(16, 16), Tanh); 4 rows per micro-batch

# ============================================================================ the simulator


def simulation_report(stages: int, microbatches: int, chunks: int,
                      group: int | None = None) -> tuple[list[Check], dict]:
    """Simulate the four schedules (interleaved with micro-batch groups of `group`, default
    p); compare bubbles and in-flight peaks with the closed forms, and the real pipeline's
    message plans with the rendezvous model."""
    checks: list[Check] = []
    metrics: dict = {"bubble_interleaved": None, "peak_inflight_interleaved": None}
    p, m, v = stages, microbatches, chunks
    timelines = {}
    for kind in pipeline.SCHEDULES:
        if kind == "interleaved" and v < 2:
            continue
        timelines[kind] = timeline = pipeline.simulate_schedule(kind, p, m, v, group)
        metrics[f"bubble_{kind}"] = bubble = timeline.bubble_fraction
        metrics[f"peak_inflight_{kind}"] = timeline.peak_inflight()
        if kind == "zb_h1" and m < p:
            continue  # the closed form assumes m >= p; the simulated value is still reported
        expected = pipeline.bubble_closed_form(kind, p, m, v)
        checks.append(Check(f"{kind}: simulated bubble == closed form", abs(bubble - expected) < 1e-9,
                            f"{bubble:.4f} simulated, {expected:.4f} formula"))
    one_f_one_b = pipeline.simulate_schedule("1f1b", p, m)
    held = [one_f_one_b.peak_inflight(d) for d in range(p)]
    checks.append(Check("GPipe holds all m micro-batches; 1F1B at most p",
                        metrics["peak_inflight_gpipe"] == m and metrics["peak_inflight_1f1b"] == min(p, m),
                        f"GPipe {metrics['peak_inflight_gpipe']:g}, 1F1B {metrics['peak_inflight_1f1b']:g}"))
    checks.append(Check("1F1B: stage d holds min(p-d, m) micro-batches", held == [
        pipeline.peak_inflight_closed_form("1f1b", p, m, 1, d) for d in range(p)],
        "stages 0..p-1 hold " + ", ".join(f"{h:g}" for h in held)))
    if metrics["peak_inflight_interleaved"] is not None:
        expected = pipeline.peak_inflight_closed_form("interleaved", p, m, v, 0, group)
        checks.append(Check("interleaved: device 0 holds (2(p-1) + (v-1)N + 1)/v stages' worth",
                            metrics["peak_inflight_interleaved"] == expected,
                            f"{metrics['peak_inflight_interleaved']:g} simulated, {expected:g} "
                            f"formula (N = {group or p})"))
    zb = [timelines["zb_h1"].peak_inflight(d) for d in range(p)]
    checks.append(Check("ZB-H1: every device holds min(p, m), device 0 no more than 1F1B's",
                        zb == [pipeline.peak_inflight_closed_form("zb_h1", p, m, 1, d) for d in range(p)]
                        and zb[0] == held[0],
                        "stages 0..p-1 hold " + ", ".join(f"{h:g}" for h in zb)
                        + f" (1F1B's device 0: {held[0]:g})"))
    for kind in ("gpipe", "1f1b"):
        plans = [pipeline.p2p_plan(order, d, p) for d, order in enumerate(
            pipeline.schedule_order(kind, p, m))]
        problem = rendezvous_problem(plans)
        messages = sum(t.send for plan in plans for transfers, _ in plan for t in transfers)
        checks.append(Check(f"{kind}: message plan matches by order and cannot deadlock",
                            problem is None, problem or f"{messages} messages, every group completes"))
    return checks, metrics


def rendezvous_problem(plans: list[list[tuple[list, object]]]) -> str | None:
    """Run every stage's message plan (`p2p_plan`) under the strictest semantics NCCL allows:
    a rank posts one group and blocks until every message in it has completed, and a message
    completes only once both its send and its receive are posted (no buffering). On each link
    a -> b the k-th send meets the k-th receive (no tags), which must expect the same
    (kind, micro-batch). Returns None, or what goes wrong: a mismatch or a deadlock."""
    sends: dict[tuple[int, int], list] = {}
    receives: dict[tuple[int, int], list] = {}
    for stage, plan in enumerate(plans):
        for group, (transfers, _) in enumerate(plan):
            for t in transfers:
                link = (stage, t.peer) if t.send else (t.peer, stage)
                (sends if t.send else receives).setdefault(link, []).append(
                    ((t.kind, t.microbatch), stage, group))
    waits: list[list[list]] = [[[] for _ in plan] for plan in plans]  # counterparts' groups
    for link in sorted(set(sends) | set(receives)):
        out, into = sends.get(link, []), receives.get(link, [])
        for k in range(max(len(out), len(into))):
            sent = out[k][0] if k < len(out) else "nothing"
            expected = into[k][0] if k < len(into) else "nothing"
            if sent != expected:
                return f"link {link[0]}->{link[1]}, message {k}: {sent} sent, {expected} expected"
            (_, a, group_a), (_, b, group_b) = out[k], into[k]
            waits[a][group_a].append((b, group_b))
            waits[b][group_b].append((a, group_a))
    position = [0] * len(plans)
    while any(position[s] < len(plans[s]) for s in range(len(plans))):
        moved = False
        for stage, plan in enumerate(plans):
            group = position[stage]
            if group < len(plan) and all(position[s] >= g for s, g in waits[stage][group]):
                position[stage] += 1  # every counterpart is posted: the group completes
                moved = True
        if not moved:
            return f"deadlock: stages blocked in groups {position}"
    return None


def plot_gantt(timeline: pipeline.Timeline, title: str, path: Path) -> None:
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


# ============================================================================ the real pipeline


def make_layers(seed: int, device: torch.device | str = "cpu") -> nn.Sequential:
    """The whole model: LAYERS x (Linear(WIDTH, WIDTH), Tanh), float64, built on CPU (the same
    weights on every device)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(LAYERS)]).double().to(device)


def pipeline_data(seed: int, microbatches: int, device: torch.device | str = "cpu"):
    """Inputs and targets, (m ROWS, WIDTH) each, float64."""
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(microbatches * ROWS, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(microbatches * ROWS, WIDTH, generator=generator, dtype=torch.float64)
    return x.to(device), y.to(device)


def microbatch_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def single_process_reference(seed: int, microbatches: int, device: torch.device | str = "cpu") -> dict:
    """One process, the whole model: loss = mean over micro-batches of each one's MSE."""
    model = make_layers(seed, device)
    x, y = pipeline_data(seed, microbatches, device)
    losses = []
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
        loss = microbatch_loss(model(xs), ys) / microbatches
        loss.backward()
        losses.append(loss.item() * microbatches)
    return {"losses": losses, "grads": [p.grad for p in model.parameters()]}


def run_pipeline(ctx: RankContext, kind: str, seed: int, microbatches: int) -> dict:
    """Our pipeline: this rank is stage `rank`, running `pipeline_step` on its GPipe or 1F1B
    order."""
    stage, stages = ctx.rank, ctx.world_size
    module = pipeline.split_stage(make_layers(seed, ctx.device), stage, stages)
    x, y = pipeline_data(seed, microbatches, ctx.device)
    order = pipeline.schedule_order(kind, stages, microbatches)[stage]
    result = pipeline.pipeline_step(module, order, list(x.chunk(microbatches)),
                                    list(y.chunk(microbatches)), microbatch_loss, (ROWS, WIDTH))
    return {**result, "grads": [p.grad for p in module.parameters()]}


def run_torch_pipelining(ctx: RankContext, kind: str, seed: int, microbatches: int) -> dict:
    """The same stages through torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    module = pipeline.split_stage(make_layers(seed, ctx.device), ctx.rank, ctx.world_size)
    stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device)
    schedule_class = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=microbatches, loss_fn=microbatch_loss)
    x, y = pipeline_data(seed, microbatches, ctx.device)
    losses: list[torch.Tensor] = []
    inputs = (x,) if ctx.rank == 0 else ()  # the first stage feeds the data
    last = {"target": y, "losses": losses} if ctx.rank == ctx.world_size - 1 else {}
    schedule.step(*inputs, **last)
    return {"losses": [loss.item() for loss in losses],
            "grads": [p.grad for p in module.parameters()]}


def gather_grads(ctx: RankContext, grads: list[torch.Tensor]) -> list[list[float]]:
    """Every stage's gradients, in model order, on every rank (as plain lists)."""
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, [g.detach().cpu().reshape(-1).tolist() for g in grads])
    return [g for stage_grads in everyone for g in stage_grads]


def max_gap(a: list, b: list) -> float:
    """max |a - b| over two lists of numbers or of lists (inf if their sizes differ)."""
    flat_a = [v for row in a for v in (row if isinstance(row, list) else [row])]
    flat_b = [v for row in b for v in (row if isinstance(row, list) else [row])]
    return max_abs_diff(flat_a, flat_b) if len(flat_a) == len(flat_b) else float("inf")


def pipeline_worker(ctx: RankContext, seed: int, microbatches: int, fault: str | None,
                    fault_rank: int) -> dict:
    """Our GPipe and 1F1B, and torch's, against one process running the whole model."""
    inject_fault(ctx, fault, fault_rank)
    if LAYERS % ctx.world_size:
        raise ValueError(f"{LAYERS} layers cannot be split into {ctx.world_size} equal stages")
    dist.barrier()  # NCCL: the group's first point-to-point batch must not be its first call
    reference = single_process_reference(seed, microbatches, ctx.device)
    reference_grads = [g.detach().cpu().reshape(-1).tolist() for g in reference["grads"]]
    checks = []
    last, p = ctx.world_size - 1, ctx.world_size
    for kind in ("gpipe", "1f1b"):
        ours = run_pipeline(ctx, kind, seed, microbatches)
        theirs = run_torch_pipelining(ctx, kind, seed, microbatches)
        ours_grads, theirs_grads = gather_grads(ctx, ours["grads"]), gather_grads(ctx, theirs["grads"])
        shared: list = [None] * ctx.world_size
        dist.all_gather_object(shared, (ours["losses"], theirs["losses"], ours["peak_held"]))
        ours_losses, theirs_losses, _ = shared[last]
        gap_ref = max(max_gap(ours_losses, reference["losses"]), max_gap(ours_grads, reference_grads))
        gap_torch = max(max_gap(ours_losses, theirs_losses), max_gap(ours_grads, theirs_grads))
        held = [item[2] for item in shared]
        expected = [pipeline.peak_inflight_closed_form(kind, p, microbatches, 1, d) for d in range(p)]
        name = "GPipe" if kind == "gpipe" else "1F1B"
        checks += [
            Check(f"our {name} pipeline: loss and every gradient == one process",
                  gap_ref <= TOLERANCE, f"max |diff| {gap_ref:.1e}"),
            Check(f"our {name} == torch.distributed.pipelining Schedule{name}",
                  gap_torch <= TOLERANCE, f"max |diff| {gap_torch:.1e}"),
            Check(f"our {name} pipeline: micro-batches held per stage == closed form",
                  held == expected, "stages 0..p-1 held " + ", ".join(map(str, held))),
        ]
    return {"checks": [vars(c) for c in checks], "device": ctx.device.type, "backend": ctx.backend}


# ============================================================================ the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Pipeline schedules simulated and checked against their closed forms, "
                           "and a real pipeline checked against one process and "
                           "torch.distributed.pipelining.")
    parser.add_argument("--simulate", action="store_true", help="only the schedule simulator")
    parser.add_argument("--stages", type=int_in(1, 64), default=None,
                        help="pipeline stages P to simulate (default: the world size)")
    parser.add_argument("--microbatches", type=int_in(1, 4096), default=8,
                        help="micro-batches M (default 8)")
    parser.add_argument("--chunks", type=int_in(1, 16), default=None,
                        help="model chunks per device V for interleaved 1F1B (default 2 when "
                             "interleaving accepts --microbatches, else 1: no interleaving)")
    parser.add_argument("--group", type=int_in(1, 4096), default=None,
                        help="interleaved 1F1B's micro-batch group N (Megatron-LM's "
                             "microbatch_group_size_per_vp_stage; default: the stages)")
    parser.add_argument("--plots", type=Path, default=None,
                        help="directory for one Gantt chart PNG per schedule")
    args = parser.parse_args(argv)
    world = check_args(parser, args)
    if not args.simulate and LAYERS % world:
        parser.error(f"the world size {world} must divide the model's {LAYERS} layers")
    if args.stages is None:
        args.stages = world
    problem = interleaving_problem(args.stages, args.microbatches, args.group)
    if args.chunks is None:
        args.chunks = 1 if problem and args.group is None else 2
    if args.chunks > 1 and problem:
        parser.error(f"{problem} (or use --chunks 1)")
    if args.group is not None and args.chunks == 1:
        parser.error("--group is interleaved 1F1B's micro-batch group: it needs --chunks 2 or more")
    return args


def interleaving_problem(stages: int, microbatches: int, group: int | None) -> str | None:
    """Why interleaved 1F1B refuses these sizes (schedules.interleaved_order's rules), or None."""
    try:
        pipeline.schedule_order("interleaved", stages, microbatches, 2, group)
    except ValueError as error:
        return str(error)
    return None


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    checks, metrics = simulation_report(args.stages, args.microbatches, args.chunks, args.group)
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        for kind in pipeline.SCHEDULES:
            if kind == "interleaved" and args.chunks < 2:
                continue
            plot_gantt(pipeline.simulate_schedule(kind, args.stages, args.microbatches, args.chunks,
                                                  args.group),
                       f"{kind}, p={args.stages}, m={args.microbatches}", args.plots / f"{kind}.png")
    world, device, backend = 1, "cpu", "none"
    if not args.simulate:
        results = launch(pipeline_worker, args.world_size,
                         (args.seed, args.microbatches, args.fault, args.fault_rank),
                         device=args.device, timeout_s=args.timeout)
        checks += merge_rank_checks([r["checks"] for r in results])
        world, device, backend = len(results), results[0]["device"], results[0]["backend"]
    metrics["headline"] = (f"bubble p={args.stages} m={args.microbatches}: GPipe/1F1B "
                           f"{metrics['bubble_gpipe']:.1%}, ZB-H1 {metrics['bubble_zb_h1']:.1%}")
    return finish(Report(LESSON, device, backend, world, checks, metrics), args.json, started)
