"""Lesson 13's planner, the harness: the `--plan` flags of the capstone's CLI, and the check
of planner.py's memory predictions against bytes measured on the CPU.

* `add_plan_arguments`, `plan_inputs`, `plan_from_args`, `plan_main`: the flags checks.py
  wires in (`--plan`, `--simulate`, `--json`);
* `planner_check`: one rank's measured bytes (lesson 07's MemoryTracker) during
  nd.NDTrainer's steps, for the predictions of `predict_for_check`; `check_runs` and
  `check_layouts` launch it for several layouts, one launch per world size (float64, or
  nd.py's bf16 autocast; with every block's forward recomputed in backward:
  `recompute_blocks`) and `format_check` prints the table the
  README quotes (`python -m lessons.13_capstone.planner_checks`);
* `ReferenceBlock`: a Llama-style block (RMSNorm, grouped-query attention, SwiGLU) in one
  process, whose saved bytes `reference_block_bytes` measures for the planner's terms that
  nd.py's block lacks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from lessons._report import float_in, int_in

from . import nd, nd_model
from .planner import (
    ENGINES,
    GB,
    GPUS,
    MODELS,
    RECIPES,
    RECOMPUTE,
    ZERO_STAGES,
    Cluster,
    Model,
    Run,
    Strategy,
    format_plan,
    format_published_plans,
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
    group.add_argument("--simulate", action="store_true",
                       help="with --plan: run nd.py's step for one rank of each pipeline position of "
                            "the top layouts and of three layouts using every dimension, on fake "
                            "tensors, and print predicted beside simulated bytes (minutes)")
    group.add_argument("--plan-model", choices=sorted(MODELS), default="llama3-8b-class",
                       help="the model's shape (default llama3-8b-class: Llama 3 8B's sizes with the "
                            "course's block, which nd.py builds; llama3-8b is Llama 3 8B itself)")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        group.add_argument(f"--plan-{name}", type=int_in(1), default=None,
                           help=f"override the model's {name}")
    group.add_argument("--plan-seq", type=int_in(2), default=None,
                       help="sequence length (default: the model's)")
    batch = group.add_mutually_exclusive_group()
    batch.add_argument("--plan-batch", type=int_in(1), default=None,
                       help="global batch in sequences per step (default 512)")
    batch.add_argument("--plan-batch-tokens", type=int_in(1), default=None,
                       help="global batch in tokens per step (a multiple of the sequence length)")
    group.add_argument("--plan-micro-batch", type=int_in(1), nargs="+", default=None,
                       help="micro-batch sizes the search may use (default 1 2 4 8)")
    group.add_argument("--plan-engine", choices=ENGINES, default="megatron",
                       help="megatron: production's choices (default); nd: what nd.py builds")
    group.add_argument("--plan-recipe", choices=sorted(RECIPES), default=None,
                       help="bytes per element (default: bf16 for megatron, Megatron-LM's; "
                            "nd-autocast for nd)")
    group.add_argument("--plan-zero", choices=ZERO_STAGES, nargs="+", default=None,
                       help="ZeRO stages the search may use")
    group.add_argument("--plan-recompute", choices=RECOMPUTE, nargs="+", default=None,
                       help="recomputation the search may use")
    group.add_argument("--plan-no-interleave", action="store_true", help="one model chunk per stage")
    group.add_argument("--plan-no-shift", action="store_true", help="equal stages only")
    group.add_argument("--plan-overlap", action="store_true",
                       help="dp, pp and cp traffic overlaps compute (tp's never)")
    group.add_argument("--plan-gpu", choices=sorted(GPUS), default="h100",
                       help="the GPU's memory, links and peak (default h100: H100 SXM 80GB, 8 per node)")
    group.add_argument("--plan-gpus", type=int_in(1, 1 << 16), default=64, help="GPUs (default 64)")
    group.add_argument("--plan-gpus-per-node", type=int_in(1, 1024), default=8)
    group.add_argument("--plan-gpu-memory", type=float_in(1e-3), default=None,
                       help="GB (1e9 bytes) per GPU (default: the GPU's, 80)")
    group.add_argument("--plan-nvlink", type=float_in(1e-3), default=None,
                       help="GB/s one way per GPU inside a node (default: H100 450, NVLink 4, 900 both ways)")
    group.add_argument("--plan-network", type=float_in(1e-3), default=None,
                       help="GB/s one way per GPU between nodes (default: H100 50, one 400 Gb/s NIC per GPU)")
    group.add_argument("--plan-peak-tflops", type=float_in(1e-3), default=None,
                       help="dense TFLOP/s per GPU (default: H100 SXM bf16 989)")
    group.add_argument("--plan-mfu", type=float_in(1e-3, 1.0), default=0.4,
                       help="model FLOPs utilisation the compute time assumes (default 0.4)")
    group.add_argument("--plan-headroom", type=float_in(0.0, 0.99), default=0.1,
                       help="share of GPU memory kept free (default 0.1)")
    group.add_argument("--plan-top", type=int_in(1), default=10, help="rows to print (default 10)")


def plan_inputs(args: argparse.Namespace) -> tuple[Model, Cluster, Run]:
    """The Model, Cluster and Run the --plan-* flags describe (ValueError on a bad combination)."""
    base = MODELS[args.plan_model]
    overrides = {name: getattr(args, f"plan_{name}")
                 for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")}
    model = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    gpu = GPUS[args.plan_gpu]
    picked = {key: getattr(args, f"plan_{flag}") for key, flag in (
        ("memory_gb", "gpu_memory"), ("nvlink_gbs", "nvlink"), ("network_gbs", "network"),
        ("peak_tflops", "peak_tflops"))}
    spec = {key: value if value is not None else gpu[key] for key, value in picked.items()}
    cluster = Cluster(args.plan_gpus, args.plan_gpus_per_node, spec["memory_gb"] * GB,
                      spec["nvlink_gbs"] * GB, spec["network_gbs"] * GB, spec["peak_tflops"] * 1e12)
    batch = args.plan_batch if args.plan_batch is not None else 512
    if args.plan_batch_tokens is not None:
        if args.plan_batch_tokens % model.seq:
            raise ValueError(f"--plan-batch-tokens {args.plan_batch_tokens} is not a multiple of the "
                             f"sequence length {model.seq}")
        batch = args.plan_batch_tokens // model.seq
    choices = {"mfu": args.plan_mfu, "headroom": args.plan_headroom, "overlap": args.plan_overlap}
    for key, value in (("micro_batches", args.plan_micro_batch), ("zero", args.plan_zero),
                       ("recompute", args.plan_recompute)):
        if value is not None:
            choices[key] = tuple(value)
    if args.plan_no_interleave:
        choices["interleave"] = False
    if args.plan_no_shift:
        choices["shift"] = False
    run = Run.for_engine(args.plan_engine, batch, args.plan_recipe, **choices)
    return model, cluster, run


def plan_from_args(args: argparse.Namespace) -> str:
    """The text `--plan` prints. A bad combination of values raises ValueError naming it."""
    return format_plan(*plan_inputs(args), top=args.plan_top)


def plan_main(args: argparse.Namespace) -> int:
    """`--plan` in the capstone's CLI: print the plan (args.plan_text, made while parsing);
    with --simulate, the simulation's comparison too; with --json, write both. 0 when every
    simulated layout agrees within simulate.TOLERANCE, else 1."""
    print(args.plan_text)
    model, cluster, run = plan_inputs(args)
    report = {"lesson": "13", "plan": args.plan_text, "simulated": []}
    passed = True
    if args.simulate:
        simulate = importlib.import_module("lessons.13_capstone.simulate")
        rows = simulate.simulate_plan(model, cluster, run, top=min(args.plan_top, 5))
        print()
        print(simulate.format_comparison(rows))
        report["simulated"] = [simulate.row_json(row) for row in rows]
        passed = all(row["agrees"] for row in rows)
    if getattr(args, "json", None):
        report["passed"] = passed
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if passed else 1


# ============================================================================ 2. the measured check


def check_run(config: nd_model.GPTConfig, layout: nd.Layout, recipe: str = "fp64",
              fold_cp: bool = True) -> Run:
    """The nd engine's Run of nd's `config` on `layout` (float64: 8 bytes per element, AdamW's
    two moments 16; "nd-autocast": nd.py's bf16 autocast on fp32 weights): config.microbatches
    micro-batches per dp replica; `fold_cp` whether nd.py's ZeRO group holds the cp ranks."""
    return Run.for_engine("nd", config.global_batch, recipe, fold_cp=fold_cp,
                          micro_batches=(config.global_batch // (layout.dp * config.microbatches),))


def check_strategy(config: nd_model.GPTConfig, layout: nd.Layout, recompute: str = "selective") -> Strategy:
    return Strategy(layout, config.global_batch // (layout.dp * config.microbatches), recompute=recompute)


def predict_for_check(config: nd_model.GPTConfig, layout: nd.Layout, rank: int, recipe: str = "fp64",
                      recompute: str = "selective", fold_cp: bool = True) -> dict:
    """What the planner predicts for `rank` of the tiny run `planner_check` measures."""
    model, run = Model.of(config), check_run(config, layout, recipe, fold_cp)
    strategy = check_strategy(config, layout, recompute)
    stage = layout.coordinates(rank)["pp"]
    mem = memory_per_stage(model, run, strategy)[stage]
    return {"stage": stage, "states": mem.states, "peak": mem.peak,
            "activation": stage_activation_bytes(model, run, strategy, stage),
            "gradients": stage_parameters(model, run, strategy, stage)[0] * run.recipe.grads}


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


@contextlib.contextmanager
def recompute_blocks(stage: nn.Module):
    """Full recomputation on nd.py's stage, added from outside: each nd.ParallelBlock's
    forward runs under torch.utils.checkpoint (non-reentrant), so autograd keeps only the
    block's input and replays the block, its tp gathers and cp ring included, in backward
    (Korthikanti et al.'s "full"; Megatron-LM's recompute_granularity="full")."""
    from torch.utils.checkpoint import checkpoint

    blocks = [m for m in stage.modules() if isinstance(m, nd.ParallelBlock)]
    originals = [block.forward for block in blocks]
    for block, forward in zip(blocks, originals):
        block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
    try:
        yield
    finally:
        for block, forward in zip(blocks, originals):
            block.forward = forward


def planner_check(ctx, config: nd_model.GPTConfig, layout: nd.Layout, windows: list[torch.Tensor],
                  bf16: bool = False, recompute: bool = False) -> dict:
    """One rank's measured bytes (a worker for lessons._launch.launch, on ctx.device; float64,
    or with `bf16` float32 weights under nd.py's bf16 autocast; `recompute`: every block
    recomputed in backward, `recompute_blocks`).

    After a first train_step (AdamW makes its moments in its first step), lesson 07's
    MemoryTracker, parameters and optimizer states filed as such, measures:
    `activation`, one micro-batch's forward through this rank's Stage (stage > 0: from an
    input made inside, as the pipeline's receive buffer is) and loss (last stage): what
    autograd saved (`file_saved_as_activation`) plus the output the pipeline keeps (the
    loss on the last stage); no backward is run. Counting only what autograd saves, not all
    that is still alive, keeps out the buffers gloo releases a moment after a collective.
    Over a second NDTrainer.train_step: `states`, parameter + gradient + optimizer bytes when
    the pipeline is done (every gradient exists, nothing reduce-scattered yet), `peak` (all
    tracked bytes) and what was live then (`peak_breakdown`); `zero_world`, the size of the
    group ZeRO shards over (dp, or dp x cp when nd.py folds cp into it)."""
    dtype = torch.float32 if bf16 else torch.float64
    mesh = nd.build_mesh(layout, ctx.device.type)
    trainer = nd.NDTrainer(config, layout, mesh, ctx.device, dtype, bf16=bf16)
    with recompute_blocks(trainer.stage) if recompute else contextlib.nullcontext():
        trainer.train_step(windows[0])
        tokens, targets = nd.rank_batch(windows[1], layout, trainer.coords, config.microbatches,
                                        trainer.positions)[0]
        tracker = memory.MemoryTracker()
        tracker.mark(trainer.stage.parameters(), "parameter")
        with tracker, file_saved_as_activation(tracker):
            made_before = set(tracker.live) | {t.untyped_storage()._cdata for t in (tokens, targets)}
            x = tokens if trainer.first else torch.zeros(
                trainer.positions.numel(), tokens.shape[0], config.hidden, dtype=dtype,
                device=ctx.device, requires_grad=True)
            out = trainer.stage(x)
            if trainer.last:
                out = trainer.loss_fn(out, targets)
        tracker.mark([out], "activation")  # what pipeline_step holds until this micro-batch's backward
        activation = tracker.breakdown()["activation"]
        if recompute:  # checkpoint keeps each block's input itself, outside the saved-tensor hooks:
            gc.collect()  # count every storage made in the forward and still alive
            activation += sum(a.nbytes for key, a in tracker.live.items()
                              if key not in made_before and a.category != "activation")
        del x, out

        tracker = memory.MemoryTracker()
        tracker.mark(trainer.stage.parameters(), "parameter")
        tracker.mark(memory.optimizer_tensors(trainer.zero.optimizer), "optimizer")
        states = breakdown_before_reduce(trainer, tracker)
        with tracker, file_saved_as_activation(tracker):
            trainer.train_step(windows[1])
    return {"rank": ctx.rank, "coords": trainer.coords, "activation": activation,
            "states": states["parameter"] + states["gradient"] + states["optimizer"],
            "peak": tracker.peak_bytes, "peak_breakdown": tracker.peak_breakdown(),
            "zero_world": trainer.zero.world}


def breakdown_before_reduce(trainer: nd.NDTrainer, tracker: memory.MemoryTracker) -> dict:
    """A dict that the trainer's next step fills with `tracker.breakdown()` at the moment the
    pipeline is done (every gradient exists, filed as "gradient"), just before ZeRO's first
    reduce-scatter of the step (its step() calls it again, with nothing left to do)."""
    reduce, seen = trainer.zero.reduce_scatter_gradients, {}

    def mark_then_reduce():
        if not seen:
            tracker.mark((p.grad for p in trainer.stage.parameters()), "gradient")
            seen.update(tracker.breakdown())
        reduce()

    trainer.zero.reduce_scatter_gradients = mark_then_reduce
    return seen


def planner_check_worker(ctx, config: nd_model.GPTConfig, windows: list[torch.Tensor],
                         checks: list[tuple[nd.Layout, bool, bool]]) -> list[dict]:
    """One rank of one launch: `planner_check` for each (layout, bf16, recompute) of `checks`
    in turn, all of this world size, each on a mesh and a trainer of its own (the tracker
    counts only the storages made while it tracks, and what it is told to mark)."""
    return [planner_check(ctx, config, layout, windows, bf16, recompute)
            for layout, bf16, recompute in checks]


def check_runs(checks: list[tuple[nd.Layout, bool, bool]], config: nd_model.GPTConfig | None = None,
               timeout_s: float = 120) -> list[list[dict]]:
    """`planner_check` for each (layout, bf16, recompute) of `checks` (CPU, gloo), one launch
    per world size; for each check, in order, one row per rank: the layout, the measured and
    the predicted bytes (the recipe "fp64", or "nd-autocast" with bf16)."""
    from lessons._launch import launch

    config = config or nd_model.GPTConfig()
    generator = torch.Generator().manual_seed(7)
    windows = [torch.randint(0, config.vocab, (config.global_batch, config.seq + 1), generator=generator)
               for _ in range(2)]
    out: list[list[dict]] = [[] for _ in checks]
    for world in dict.fromkeys(layout.world for layout, _, _ in checks):
        chosen = [i for i, (layout, _, _) in enumerate(checks) if layout.world == world]
        per_rank = launch(planner_check_worker, world, (config, windows, [checks[i] for i in chosen]),
                          device="cpu", timeout_s=timeout_s * len(chosen))
        for slot, i in enumerate(chosen):
            layout, bf16, recompute = checks[i]
            for measured in (rank_results[slot] for rank_results in per_rank):
                fold = measured["zero_world"] == layout.dp * layout.cp and layout.cp > 1
                out[i].append({"layout": layout, "measured": measured, "predicted": predict_for_check(
                    config, layout, measured["rank"], "nd-autocast" if bf16 else "fp64",
                    "full" if recompute else "selective", fold_cp=fold)})
    return out


def check_layouts(layouts: list[nd.Layout], config: nd_model.GPTConfig | None = None,
                  timeout_s: float = 120, bf16: bool = False, recompute: bool = False) -> list[dict]:
    """`check_runs` of each layout (float64, or bf16 autocast; `recompute`), one launch per
    world size: one row per rank, the layouts in order."""
    return [row for rows in check_runs([(layout, bf16, recompute) for layout in layouts], config, timeout_s)
            for row in rows]


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


# ========================================================================== 3. the terms nd.py's block lacks


class RMSNorm(torch.autograd.Function):
    """x / rms(x) x weight over the last dimension, keeping x and the fp32 1/rms for backward
    (a fused kernel's choice, Megatron-LM's and Transformer Engine's; torch's composite
    rms_norm keeps the normalized x as well)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 -> fp32; fp32, fp64 stay
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normalized = x * rstd
        g = grad * weight
        dx = rstd * (g - normalized * (g * normalized).mean(-1, keepdim=True))
        return dx.to(x.dtype), (grad * normalized).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype), None


class SwiGLU(torch.autograd.Function):
    """silu(gate) x up, keeping only gate and up for backward (silu is recomputed there), as
    Megatron-LM's fused swiglu keeps only its input (megatron/core/fusions/fused_bias_swiglu.py)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        sigmoid = torch.sigmoid(gate)
        return grad * up * sigmoid * (1 + gate * (1 - sigmoid)), grad * gate * sigmoid


class ReferenceBlock(nn.Module):
    """A Llama-style block in one process, for the planner's terms nd.py's block lacks:
    RMSNorm (gain only), grouped-query attention (`kv_heads` key/value heads, each shared by
    heads / kv_heads query heads) through torch's SDPA, a SwiGLU MLP of width `ffn`, no biases.
    x (b, s, h) -> (b, s, h), laid out so that the attention's output is O's input as it is
    (no copy), as flash attention's [s, b, h] output is in Megatron-LM. What it keeps for
    backward is what the planner's `block_activation_bytes` counts for such a block at
    tp = cp = 1 (megatron engine)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.Parameter(torch.ones(hidden)), nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, hidden + 2 * kv_heads * self.d, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(RMSNorm.apply(x, self.norm1, 1e-5)).split([h, self.kv_heads * self.d,
                                                                      self.kv_heads * self.d], -1)
        q, k, v = (t.unflatten(-1, (-1, self.d)).transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attention.transpose(1, 2).reshape(b, s, h))  # a view: no copy
        return x + self.down(SwiGLU.apply(*self.gate_up(RMSNorm.apply(x, self.norm2, 1e-5)).chunk(2, -1)))


def reference_block_bytes(model: Model, batch: int, dtype: torch.dtype = torch.float32) -> dict:
    """What one ReferenceBlock of `model`'s sizes saves for backward (MemoryTracker,
    `file_saved_as_activation`), by tensor, in `dtype`, on the CPU: {"total", "by_shape"}."""
    torch.manual_seed(0)
    block = ReferenceBlock(model.hidden, model.heads, model.kv_heads, model.ffn).to(dtype)
    x0 = torch.randn(batch, model.seq, model.hidden, dtype=dtype, requires_grad=True)
    tracker = memory.MemoryTracker()
    tracker.mark(block.parameters(), "parameter")
    shapes: dict[tuple, int] = {}
    made_before = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        if key in tracker.live and key not in made_before and tracker.live[key].category != "activation":
            tracker.mark([tensor], "activation")
            shapes[tuple(tensor.shape)] = shapes.get(tuple(tensor.shape),
                                                     0) + tensor.untyped_storage().nbytes()
        return tensor

    with tracker:
        made_before.update(tracker.live)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x0 * 1)  # the block's input, made inside: the first norm keeps it
    total = tracker.breakdown()["activation"]
    del y
    return {"total": total, "by_shape": shapes}


if __name__ == "__main__":  # python -m lessons.13_capstone.planner_checks: the measured check's table
    if sys.argv[1:] == ["--published"]:  # the planner's own picks at published runs' scale (minutes)
        print(format_published_plans())
        sys.exit(0)
    this = importlib.import_module("lessons.13_capstone.planner_checks")  # workers pickle by module name
    layouts = [nd.Layout(dp=2), nd.Layout(tp=2), nd.Layout(pp=2), nd.Layout(cp=2), nd.Layout(dp=2, tp=2),
               nd.Layout(tp=2, pp=2), nd.Layout(dp=2, pp=2, cp=2)]
    print(this.format_check(this.check_layouts(layouts)))
    print()
    print(this.format_check(this.check_layouts([nd.Layout(tp=2, cp=2), nd.Layout(dp=2, pp=2)], bf16=True)))
    print()
    print(this.format_check(this.check_layouts([nd.Layout(tp=2, pp=2, cp=2)], recompute=True)))
