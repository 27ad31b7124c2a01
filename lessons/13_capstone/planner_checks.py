"""Lesson 13's planner, the harness: the `--plan` flags of the capstone's CLI, and the check
of planner.py's memory predictions against bytes measured on the CPU.

* `add_plan_arguments`, `plan_from_args`: the flags checks.py wires in;
* `planner_check`: one rank's measured bytes (lesson 07's MemoryTracker) during
  nd.NDTrainer's steps, for the predictions of `predict_for_check`; `check_layouts` launches
  it for several layouts and `format_check` prints the table the README quotes
  (`python -m lessons.13_capstone.planner_checks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import torch

from lessons._report import float_in, int_in

from . import nd, nd_model
from .planner import (
    GB,
    H100_80GB,
    MODELS,
    PRECISIONS,
    Cluster,
    Model,
    Run,
    format_plan,
    memory_per_stage,
    stage_activation_bytes,
    stage_parameters,
)

memory = importlib.import_module("lessons.07_memory.main")  # MemoryTracker

# ============================================================================ 1. the CLI hook


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's flags, in a group of their own; `--plan` asks for the plan."""
    group = parser.add_argument_group("planner (--plan prints the layouts that fit, best first)")
    group.add_argument("--plan", action="store_true",
                       help="print the planner's table for the --plan-* settings and exit")
    group.add_argument("--plan-model", choices=sorted(MODELS), default="llama3-8b-class",
                       help="the model's shape (default llama3-8b-class: Llama 3 8B's sizes "
                            "with the course's block)")
    for name in ("layers", "hidden", "heads", "vocab"):
        group.add_argument(f"--plan-{name}", type=int_in(1), default=None,
                           help=f"override the model's {name}")
    group.add_argument("--plan-seq", type=int_in(2), default=None,
                       help="sequence length (default: the model's)")
    group.add_argument("--plan-batch", type=int_in(1), default=512,
                       help="global batch in sequences per step (default 512)")
    group.add_argument("--plan-micro-batch", type=int_in(1), default=1,
                       help="sequences per micro-batch (default 1)")
    group.add_argument("--plan-precision", choices=sorted(PRECISIONS), default="bf16-mixed")
    group.add_argument("--plan-gpus", type=int_in(1, 1 << 16), default=64, help="GPUs (default 64)")
    group.add_argument("--plan-gpus-per-node", type=int_in(1, 1024), default=8)
    group.add_argument("--plan-gpu-memory", type=float_in(1e-3), default=H100_80GB["memory_gb"],
                       help="GB (1e9 bytes) per GPU (default 80: H100 80GB)")
    group.add_argument("--plan-nvlink", type=float_in(1e-3), default=H100_80GB["nvlink_gbs"],
                       help="GB/s one way per GPU inside a node (default 450: NVLink 4, 900 both ways)")
    group.add_argument("--plan-network", type=float_in(1e-3), default=H100_80GB["network_gbs"],
                       help="GB/s one way per GPU between nodes (default 50: one 400 Gb/s NIC per GPU)")
    group.add_argument("--plan-peak-tflops", type=float_in(1e-3), default=H100_80GB["peak_tflops"],
                       help="dense TFLOP/s per GPU (default 989: H100 SXM bf16)")
    group.add_argument("--plan-mfu", type=float_in(1e-3, 1.0), default=0.4,
                       help="model FLOPs utilisation the compute time assumes (default 0.4)")
    group.add_argument("--plan-headroom", type=float_in(0.0, 0.99), default=0.1,
                       help="share of GPU memory kept free (default 0.1)")
    group.add_argument("--plan-top", type=int_in(1), default=10, help="rows to print (default 10)")


def plan_inputs(args: argparse.Namespace) -> tuple[Model, Cluster, Run]:
    """The Model, Cluster and Run the --plan-* flags describe (ValueError on a bad combination)."""
    base = MODELS[args.plan_model]
    overrides = {name: getattr(args, f"plan_{name}")
                 for name in ("layers", "hidden", "heads", "vocab", "seq")}
    model = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    cluster = Cluster(args.plan_gpus, args.plan_gpus_per_node, args.plan_gpu_memory * GB,
                      args.plan_nvlink * GB, args.plan_network * GB, args.plan_peak_tflops * 1e12)
    run = Run.with_precision(args.plan_precision, args.plan_batch, micro_batch=args.plan_micro_batch,
                             mfu=args.plan_mfu, headroom=args.plan_headroom)
    return model, cluster, run


def plan_from_args(args: argparse.Namespace) -> str:
    """The text `--plan` prints. A bad combination of values raises ValueError naming it."""
    return format_plan(*plan_inputs(args), top=args.plan_top)


# ============================================================================ 2. the measured check


def check_run(config: nd_model.GPTConfig, layout: nd.Layout) -> Run:
    """The Run of nd's `config` on `layout` in float64 (8 bytes per element, AdamW's two
    moments 16): config.microbatches micro-batches per dp replica."""
    return Run.with_precision("fp64", config.global_batch,
                              micro_batch=config.global_batch // (layout.dp * config.microbatches))


def predict_for_check(config: nd_model.GPTConfig, layout: nd.Layout, rank: int) -> dict:
    """What the planner predicts for `rank` of the tiny run `planner_check` measures."""
    model, run = Model.of(config), check_run(config, layout)
    stage = layout.coordinates(rank)["pp"]
    mem = memory_per_stage(model, layout, run)[stage]
    return {"stage": stage, "states": mem.states, "peak": mem.peak,
            "activation": stage_activation_bytes(model, layout, run, stage),
            "gradients": stage_parameters(model, layout, stage)[0] * run.grad_bytes}


def file_saved_as_activation(tracker: memory.MemoryTracker):
    """A saved_tensors_hooks context: every tensor autograd saves whose storage the tracker
    saw made inside it is re-filed as "activation" (weights, the batch, buffers are not)."""
    made_before = set(tracker.live)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        if key in tracker.live and key not in made_before:
            tracker.mark([tensor], "activation")
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def planner_check(ctx, config: nd_model.GPTConfig, layout: nd.Layout, windows: list[torch.Tensor]) -> dict:
    """One rank's measured bytes (a worker for lessons._launch.launch, float64 on ctx.device).

    After a first train_step (AdamW makes its moments in its first step), lesson 07's
    MemoryTracker, parameters and optimizer states filed as such, measures:
    `activation`, one micro-batch's forward through this rank's Stage (stage > 0: from an
    input made inside, as the pipeline's receive buffer is) and loss (last stage): what
    autograd saved (`file_saved_as_activation`) plus the output the pipeline keeps (the
    loss on the last stage); no backward is run. Counting only what autograd saves, not all
    that is still alive, keeps out the buffers gloo releases a moment after a collective.
    Over a second NDTrainer.train_step: `states`, parameter + gradient + optimizer bytes when
    the pipeline is done (every gradient exists, nothing reduce-scattered yet), `peak` (all
    tracked bytes) and what was live then (`peak_breakdown`)."""
    mesh = nd.build_mesh(layout, ctx.device.type)
    trainer = nd.NDTrainer(config, layout, mesh, ctx.device, torch.float64)
    trainer.train_step(windows[0])
    tokens, targets = nd.rank_batch(windows[1], layout, trainer.coords, config.microbatches,
                                    trainer.positions)[0]
    tracker = memory.MemoryTracker()
    tracker.mark(trainer.stage.parameters(), "parameter")
    with tracker, file_saved_as_activation(tracker):
        x = tokens if trainer.first else torch.zeros(
            trainer.positions.numel(), tokens.shape[0], config.hidden, dtype=torch.float64,
            device=ctx.device, requires_grad=True)
        out = trainer.stage(x)
        if trainer.last:
            out = trainer.loss_fn(out, targets)
    tracker.mark([out], "activation")  # what pipeline_step holds until this micro-batch's backward
    activation = tracker.breakdown()["activation"]
    del x, out

    tracker = memory.MemoryTracker()
    tracker.mark(trainer.stage.parameters(), "parameter")
    tracker.mark(memory.optimizer_tensors(trainer.zero.optimizer), "optimizer")
    reduce, states = trainer.reduce_gradients, {}

    def mark_then_reduce():  # the pipeline is done: every gradient exists
        tracker.mark((p.grad for p in trainer.stage.parameters()), "gradient")
        states.update(tracker.breakdown())
        reduce()

    trainer.reduce_gradients = mark_then_reduce
    with tracker, file_saved_as_activation(tracker):
        trainer.train_step(windows[1])
    return {"rank": ctx.rank, "coords": trainer.coords, "activation": activation,
            "states": states["parameter"] + states["gradient"] + states["optimizer"],
            "peak": tracker.peak_bytes, "peak_breakdown": tracker.peak_breakdown()}


def check_layouts(layouts: list[nd.Layout], config: nd_model.GPTConfig | None = None,
                  timeout_s: float = 120) -> list[dict]:
    """Launch `planner_check` for each layout (CPU, gloo); one row per rank: the layout, the
    measured and the predicted bytes."""
    from lessons._launch import launch

    config = config or nd_model.GPTConfig()
    generator = torch.Generator().manual_seed(7)
    windows = [torch.randint(0, config.vocab, (config.global_batch, config.seq + 1), generator=generator)
               for _ in range(2)]
    rows = []
    for layout in layouts:
        for measured in launch(planner_check, layout.world, (config, layout, windows), device="cpu",
                               timeout_s=timeout_s):
            rows.append({"layout": layout, "measured": measured,
                         "predicted": predict_for_check(config, layout, measured["rank"])})
    return rows


def format_check(rows: list[dict]) -> str:
    """Predicted vs measured bytes per rank, as a markdown table."""
    lines = ["| layout | rank | stage | states pred | states meas | act/micro-batch pred | meas | "
             "peak pred | peak meas | meas / pred |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        p, m = row["predicted"], row["measured"]
        lines.append(f"| {row['layout']} | {m['rank']} | {p['stage']} | {p['states']:.0f} | {m['states']} | "
                     f"{p['activation']} | {m['activation']} | {p['peak']:.0f} | {m['peak']} | "
                     f"{m['peak'] / p['peak']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m lessons.13_capstone.planner_checks: the measured check's table
    this = importlib.import_module("lessons.13_capstone.planner_checks")  # workers pickle by module name
    print(this.format_check(this.check_layouts([
        nd.Layout(dp=2), nd.Layout(tp=2), nd.Layout(pp=2), nd.Layout(cp=2), nd.Layout(dp=2, tp=2),
        nd.Layout(tp=2, pp=2), nd.Layout(dp=2, pp=2, cp=2)])))
