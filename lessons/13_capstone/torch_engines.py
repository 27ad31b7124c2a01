"""PyTorch's production path beside ours: the same GPT, layout and batches through torch's engines.

nd.py composes the course's own pieces; torchtitan composes PyTorch's. Here the same model
(`nd_model.build_gpt`, the same initial weights as `nd_model.train_one_process`) trains on the same mesh
(`nd.build_mesh`) with PyTorch's engines, on the same global batch per step, with the same loss
(mean cross-entropy over the global batch), global-norm clipping, AdamW with nanoGPT's groups and
lesson 06's warmup + cosine. Per step it returns (loss, gradient norm), to hold next to
one process and to our NDTrainer. In the order torchtitan applies them to a model:

1. pp: the model cut into stages by hand (torchtitan's manual split, `GPTStage`), run by
   `torch.distributed.pipelining`'s PipelineStage + Schedule1F1B (our lesson 05);
2. tp: `parallelize_module` with SequenceParallel (the LayerNorms), ColwiseParallel (q, k, v,
   up) and RowwiseParallel (o, down) on each block, `heads` divided by tp as torchtitan divides
   n_heads (our lesson 04's sequence-parallel block);
3. dp: FSDP2 `fully_shard` on each block, then on the stage (parameters, gradients and AdamW
   states sharded on dim 0 of each tensor: ZeRO-3-like; ours is lesson 03's ZeRO-1);
4. the step every engine shares (`train`): forward + backward, the global gradient norm over
   every mesh dimension that shards gradients (torchtitan's clip_grad_norm_: torch's own
   `clip_grad_norm_` cannot combine gradients on different meshes in torch 2.13), clipping,
   AdamW, the schedule;
5. cp: `torch.distributed.tensor.experimental.context_parallel` (ring attention inside
   F.scaled_dot_product_attention; our lesson 11). Its ring handlers exist only for the CUDA
   attention kernels: on CPU the first attention raises, and the run records PyTorch's error.

`compare_with_torch(layouts, config, device)` runs, per world size, one launch in which every
layout trains with torch's engine and with our NDTrainer, and tabulates both against one
process; device="cuda" runs it on GPUs with NCCL (the notebook). Simplified against torchtitan:
the vocabulary is not split over tp (embeddings and head stay plain replicated tensors, as in
nd.py), no activation checkpointing, no torch.compile, no mixed precision, one stage per rank.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessons._launch import RankContext, launch

nd = importlib.import_module("lessons.13_capstone.nd")
nd_model = importlib.import_module("lessons.13_capstone.nd_model")
checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # cosine_with_warmup

ENGINES = {"dp": "fully_shard", "tp": "parallelize_module", "pp": "pipelining 1F1B",
           "cp": "context_parallel"}
MISTAKES = ("heads-not-divided",)  # planted: each tp rank splits its h / tp features into H heads


def axes_of(layout) -> tuple[str, ...]:
    """The dimensions a layout splits, e.g. ("dp", "tp") for dp2 x tp2."""
    return tuple(dim for dim in ("dp", "tp", "pp", "cp") if getattr(layout, dim) > 1)


def engine_of(layout) -> str:
    """torch's engines that train `layout`, e.g. "parallelize_module + fully_shard"."""
    order = ("pp", "tp", "dp", "cp")  # the order they are applied in
    return " + ".join(ENGINES[dim] for dim in order if dim in axes_of(layout)) or "one process"


# ============================================================================ 1. the model, cut


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """lesson 04's causal_attention through F.scaled_dot_product_attention (what torch's
    context_parallel intercepts): q, k, v (s, b, heads d) -> (s, b, heads d)."""
    s, b, width = q.shape

    def split(t: torch.Tensor) -> torch.Tensor:  # (s, b, heads d) -> (b, heads, s, d)
        return t.reshape(s, b, heads, width // heads).permute(1, 2, 0, 3)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, width)


class GPTStage(nn.Module):
    """Stage `stage` of `stages` of an nd_model.GPT, cut by hand as torchtitan's manual pipeline split
    does (stages = 1: the whole model): the first keeps the embeddings, each its layers / stages
    blocks, the last the final norm and head. tokens (b, s) or x (s, b, h) -> x (s, b, h) or
    logits (b, s, vocab). `positions` (s,) are the tokens' positions: context_parallel shards
    them with the tokens. `sdpa`: attention through F.scaled_dot_product_attention."""

    def __init__(self, gpt: nn.Module, stage: int = 0, stages: int = 1, sdpa: bool = False):
        super().__init__()
        per = len(gpt.blocks) // stages
        if per * stages != len(gpt.blocks):
            raise ValueError(f"{len(gpt.blocks)} layers do not split over pp = {stages}")
        self.embed, self.pos = (gpt.embed, gpt.pos) if stage == 0 else (None, None)
        self.blocks = nn.ModuleList(gpt.blocks[stage * per:(stage + 1) * per])
        self.norm, self.head = (gpt.norm, gpt.head) if stage == stages - 1 else (None, None)
        self.register_buffer("positions", torch.arange(gpt.pos.weight.shape[0]), persistent=False)
        self.sdpa = sdpa

    def block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """nd_model.Block's forward, its attention through SDPA when `sdpa`."""
        if not self.sdpa:
            return block(x)
        a = block.ln1(x)
        x = x + block.o(sdpa_attention(block.q(a), block.k(a), block.v(a), block.heads))
        return x + block.down(F.gelu(block.up(block.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = (self.embed(x) + self.pos.weight[self.positions[: x.shape[1]]]).transpose(0, 1)
        for block in self.blocks:
            x = self.block(block, x)
        if self.head is not None:  # contiguous: FSDP2 warns when a module returns a view
            return self.head(self.norm(x)).transpose(0, 1).contiguous()
        return x.contiguous()  # what a stage sends must be contiguous (x keeps embed's strides)


# ============================================================================ 2-3. TP and FSDP2


def tensor_parallel_stage(stage: GPTStage, tp_mesh, divide_heads: bool = True) -> None:
    """Megatron's split with sequence parallelism (lesson 04's SequenceParallelBlock, nd's
    ParallelBlock), in torch's TP styles on x (s, b, h), as torchtitan's plan for a llama:
    per block, ln1 and ln2 SequenceParallel (each rank normalizes its s / tp positions); q, k,
    v and up ColwiseParallel from Shard(0) (all-gather the sequence, output this rank's
    features); o and down RowwiseParallel to Shard(0) (reduce-scatter back to s / tp
    positions). Between them the residual stream is this rank's local (s / tp, b, h) piece,
    which is also what a pipeline stage sends. Stage 0 cuts the first block's input; the last
    stage's final norm is SequenceParallel and the head's input is gathered (the vocabulary is
    not split). Each rank attends with heads / tp heads: `heads` is divided, as torchtitan
    divides n_heads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    sequence = Shard(0)
    block_plan = {**{name: SequenceParallel(sequence_dim=0) for name in ("ln1", "ln2")},
                  **{name: ColwiseParallel(input_layouts=sequence) for name in ("q", "k", "v", "up")},
                  **{name: RowwiseParallel(output_layouts=sequence) for name in ("o", "down")}}
    for block in stage.blocks:
        if block.heads % tp:
            raise ValueError(f"{block.heads} heads do not split over tp = {tp}")
        parallelize_module(block, tp_mesh, block_plan)
        if divide_heads:
            block.heads //= tp
    ends = {}
    if stage.embed is not None:
        ends["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(sequence,),
                                              use_local_output=True)
    if stage.head is not None:
        ends["norm"] = SequenceParallel(sequence_dim=0)
        ends["head"] = PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    parallelize_module(stage, tp_mesh, ends)


def fully_shard_stage(stage: GPTStage, dp_mesh) -> None:
    """FSDP2: each block one all-gather unit, the rest of the stage (embeddings, final norm,
    head) another, as torchtitan wraps a model."""
    from torch.distributed.fsdp import fully_shard

    for block in stage.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(stage, mesh=dp_mesh)


# ============================================================================ 4. the step


def dtensor_class():
    """torch.distributed.tensor.DTensor (imported when used: the module is slow to import)."""
    from torch.distributed.tensor import DTensor

    return DTensor


def global_grad_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """||g||_2 of the whole model's gradient as torchtitan's clip_grad_norm_ computes it: torch's
    get_total_norm (on a DTensor, a norm reduced over its mesh: full_tensor()), squared and
    summed over the pipeline stages. One difference: gradients are normed per mesh (plain
    tensors, tp-only and (dp, tp) DTensors), then combined, as torchtitan does for EP: torch
    2.13's get_total_norm stacks all the norms and refuses a mix of meshes."""
    dtensor = dtensor_class()
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, dtensor) else None, []).append(p.grad)
    squares = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        squares.append((norm.full_tensor() if isinstance(norm, dtensor) else norm) ** 2)
    total = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def torch_clip_probe(params: list[nn.Parameter]) -> float | str:
    """What torch.nn.utils.clip_grad_norm_ alone says of this rank's gradients: its norm, or its
    error "Type: first line". max_norm = inf: the clip coefficient clamps to 1, so the gradients
    are multiplied by exactly 1.0 and stay as they were."""
    try:
        norm = torch.nn.utils.clip_grad_norm_(params, math.inf, foreach=False)
        return (norm.full_tensor() if isinstance(norm, dtensor_class()) else norm).item()
    except Exception as exc:  # noqa: BLE001 - what PyTorch says is the result
        return error_line(exc)


def error_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"


def train(params: list[nn.Parameter], forward_backward: Callable[[torch.Tensor], torch.Tensor],
          config, batches: list[torch.Tensor], pp_group=None) -> dict:
    """The loop every engine shares: `forward_backward(windows)` runs the step's forward and
    backward on the global batch `windows` (B, seq + 1) and returns its mean loss (a 0-d
    tensor, the same on every rank); then the global norm, torch's clip_grads_with_norm_,
    AdamW (nd_model.adamw: a DTensor keeps its global dim), the schedule. Returns {"history":
    [(loss, norm before clipping)], "torch_clip": torch_clip_probe at the first step}."""
    optimizer = nd_model.adamw(params, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, checkpointing.cosine_with_warmup(config.warmup, config.steps))
    history, probe = [], None
    for windows in batches:
        loss = forward_backward(windows)
        probe = torch_clip_probe(params) if probe is None else probe
        norm = global_grad_norm(params, pp_group)
        torch.nn.utils.clip_grads_with_norm_(params, config.clip, norm, foreach=False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        history.append((loss.item(), norm.item()))
    return {"history": history, "torch_clip": probe}


def train_with_torch(ctx: RankContext, config, layout, mesh, batches: list[torch.Tensor],
                     dtype: torch.dtype, mistake: str | None = None) -> dict:
    """dp, tp, pp and their combinations with torch's engines, applied as torchtitan applies
    them: cut the pipeline stage, tensor-parallelize it over tp, fully_shard it over dp. Each
    dp replica runs its rows of the global batch (`windows.chunk(dp)`, as nd.rank_batch cuts
    them); FSDP2 averages the gradients over dp, the logged loss is averaged over dp and, with
    pp, sent from the last stage."""
    stage_index = mesh["pp"].get_local_rank()
    dp_rank, dp_group, pp_group = mesh["dp"].get_local_rank(), mesh.get_group("dp"), mesh.get_group("pp")
    module = GPTStage(nd_model.build_gpt(config, dtype), stage_index, layout.pp).to(ctx.device)
    if layout.tp > 1:
        tensor_parallel_stage(module, mesh["tp"], divide_heads=mistake != "heads-not-divided")
    if layout.dp > 1:
        fully_shard_stage(module, mesh["dp"])

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1))

    if layout.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        stage = PipelineStage(module, stage_index, layout.pp, ctx.device, group=pp_group)
        # the schedule cuts the batch into micro-batches on dim 0, averages their gradients
        schedule = Schedule1F1B(stage, n_microbatches=config.microbatches, loss_fn=loss_fn)
    first, last = stage_index == 0, stage_index == layout.pp - 1

    def forward_backward(windows: torch.Tensor) -> torch.Tensor:
        rows = windows.chunk(layout.dp)[dp_rank].to(ctx.device)
        tokens, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        if layout.pp == 1:
            loss = loss_fn(module(tokens), targets)
            loss.backward()
        else:
            losses: list[torch.Tensor] = []
            schedule.step(*((tokens,) if first else ()),
                          **({"target": targets, "losses": losses} if last else {}))
            loss = torch.stack(losses).mean() if last else torch.zeros((), dtype=dtype, device=ctx.device)
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=dp_group)
        dist.broadcast(logged, dist.get_global_rank(pp_group, layout.pp - 1), group=pp_group)
        return logged / layout.dp

    return train(list(module.parameters()), forward_backward, config, batches,
                 pp_group if layout.pp > 1 else None)


# ============================================================================ 5. context parallel


def train_context_parallel(ctx: RankContext, config, layout, mesh, batches: list[torch.Tensor],
                           dtype: torch.dtype) -> dict:
    """cp with torch's `context_parallel`: inside it, the tokens, targets and positions are
    sharded on the sequence (head-tail load balancing, lesson 11's zig-zag) and every
    F.scaled_dot_product_attention becomes a ring over the cp ranks, forward and backward.
    Each rank's loss is its tokens' cross-entropy sum / (b seq), summed over cp; gradients are
    summed over cp. Needs a CUDA attention kernel (flash, efficient or cuDNN: float32 or
    bf16 on a GPU); on CPU the first attention raises NotImplementedError."""
    from torch.distributed.tensor.experimental import context_parallel

    cp_mesh, cp_group = mesh["cp"], mesh.get_group("cp")
    module = GPTStage(nd_model.build_gpt(config, dtype), sdpa=True).to(ctx.device)

    def forward_backward(windows: torch.Tensor) -> torch.Tensor:
        windows = windows.to(ctx.device)
        tokens, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        count = targets.numel()
        with context_parallel(cp_mesh, buffers=[tokens, targets, module.positions],
                              buffer_seq_dims=[1, 1, 0], no_restore_buffers={tokens, targets}):
            logits = module(tokens)
            loss = F.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1),
                                   reduction="sum") / count
            loss.backward()
        for p in module.parameters():
            dist.all_reduce(p.grad, group=cp_group)
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=cp_group)
        return logged

    return train(list(module.parameters()), forward_backward, config, batches)


# ============================================================================ the worker


def torch_run(ctx: RankContext, config, layout, mesh, batches: list[torch.Tensor], dtype: torch.dtype,
              mistake: str | None = None) -> tuple[dict, str | None]:
    """torch's engines on `layout`: (train's result, None), or (empty result, PyTorch's error
    "Type: first line") where torch refuses (NotImplementedError; any other error fails)."""
    nothing = {"history": None, "torch_clip": None}
    if layout.cp > 1 and axes_of(layout) != ("cp",):
        return nothing, f"not wired here: context_parallel with {' x '.join(axes_of(layout)[:-1])}"
    try:
        if layout.cp > 1:
            return train_context_parallel(ctx, config, layout, mesh, batches, dtype), None
        return train_with_torch(ctx, config, layout, mesh, batches, dtype, mistake), None
    except NotImplementedError as exc:
        return nothing, error_line(exc)


def worker(ctx: RankContext, config, layouts: list, batches: list[torch.Tensor],
           dtype: torch.dtype = torch.float64, planted: tuple = ()) -> dict[str, dict]:
    """One launch for several layouts of the same world size: each trains with torch's engines
    and with our NDTrainer on its mesh, on the same batches; then each (layout, mistake) of
    `planted` with torch's engines and the mistake. Returns {str(layout): {"ours": [(loss,
    norm)], "torch": [(loss, norm)] or None, "torch_clip": torch_clip_probe's result, "error":
    PyTorch's error or None}, f"{layout} with {mistake}": {"torch", "torch_clip", "error"}}."""
    results = {}
    for layout in layouts:
        mesh = nd.build_mesh(layout, ctx.device.type)
        trainer = nd.NDTrainer(config, layout, mesh, ctx.device, dtype)
        ours = [trainer.train_step(windows) for windows in batches]
        theirs, error = torch_run(ctx, config, layout, mesh, batches, dtype)
        results[str(layout)] = {"ours": ours, "torch": theirs["history"],
                                "torch_clip": theirs["torch_clip"], "error": error}
    for layout, mistake in planted:
        if mistake not in MISTAKES:
            raise ValueError(f"unknown mistake {mistake!r}: one of {MISTAKES}")
        theirs, error = torch_run(ctx, config, layout, nd.build_mesh(layout, ctx.device.type), batches,
                                  dtype, mistake)
        results[f"{layout} with {mistake}"] = {"torch": theirs["history"],
                                               "torch_clip": theirs["torch_clip"], "error": error}
    return results


def batches_for(config, steps: int, seed: int = 7) -> list[torch.Tensor]:
    """`steps` global batches (global_batch, seq + 1) of random tokens, the same for every run."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab, (config.global_batch, config.seq + 1), generator=generator)
            for _ in range(steps)]


def run_layouts(layouts, config, batches: list[torch.Tensor], device: str = "cpu",
                dtype: torch.dtype = torch.float64, planted: tuple = (),
                timeout_s: float = 120.0) -> dict[str, list[dict]]:
    """The worker's results, {name: one entry per rank}: one launch per world size (the
    planted runs join the launch of their layout's world size)."""
    out: dict[str, list[dict]] = {}
    worlds = {layout.world for layout in layouts} | {layout.world for layout, _ in planted}
    for world in sorted(worlds):
        per_rank = launch(worker, world, (config, [layout for layout in layouts if layout.world == world],
                                          batches, dtype,
                                          tuple(run for run in planted if run[0].world == world)),
                          device=device, timeout_s=timeout_s)
        for name in per_rank[0]:
            out[name] = [rank_results[name] for rank_results in per_rank]
    return out


def max_gap(runs: list[list[tuple[float, float]] | None], reference: list[tuple[float, float]],
            which: int) -> float:
    """max over ranks and steps of |run - reference| in the loss (which = 0) or norm (1); nan
    when a run is missing."""
    if any(run is None for run in runs):
        return math.nan
    return max(abs(step[which] - ref[which]) for run in runs
               for step, ref in zip(run, reference, strict=True))


def table(layouts, results: dict[str, list[dict]], reference: list[tuple[float, float]]) -> list[dict]:
    """run_layouts' results against one process: [{"layout", "engine", "loss_diff", "norm_diff"
    (torch's, max |x - one process| over steps and ranks), "ours_loss_diff", "ours_norm_diff",
    "error" (where torch's engine did not run: why; its diffs are nan)}]."""
    rows = []
    for layout in layouts:
        ranks = results[str(layout)]
        rows.append({"layout": str(layout), "engine": engine_of(layout),
                     **{f"{who}{what}_diff": max_gap([r[key] for r in ranks], reference, which)
                        for who, key in (("", "torch"), ("ours_", "ours"))
                        for which, what in ((0, "loss"), (1, "norm"))},
                     "error": ranks[0]["error"]})
    return rows


def compare_with_torch(layouts, config=None, device: str = "cpu", dtype: torch.dtype = torch.float64,
                       steps: int | None = None, timeout_s: float = 120.0) -> list[dict]:
    """Per layout, torch's engines and our NDTrainer against nd_model.train_one_process (float64, on
    the CPU) on the same batches: `table`'s rows. device "cuda": NCCL ranks, one GPU each
    (float64 runs on GPUs; cp needs float32 or bf16 for a CUDA attention kernel)."""
    config = config or nd_model.GPTConfig()
    batches = batches_for(config, steps or config.steps)
    reference, _ = nd_model.train_one_process(config, batches)
    return table(layouts, run_layouts(layouts, config, batches, device, dtype, timeout_s=timeout_s),
                 reference)


def format_table(rows: list[dict]) -> str:
    """The comparison as a markdown table."""
    lines = ["| layout | torch engine | max loss diff | max norm diff | ours: loss / norm diff | "
             "torch error |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['layout']} | {row['engine']} | {row['loss_diff']:.1e} | "
                     f"{row['norm_diff']:.1e} | {row['ours_loss_diff']:.1e} / "
                     f"{row['ours_norm_diff']:.1e} | {row['error'] or ''} |")
    return "\n".join(lines)


def parse_layout(text: str):
    """ "dp2xtp2" (or "dp2 x tp2") -> nd.Layout(dp=2, tp=2)."""
    sizes = {}
    for part in text.replace(" ", "").split("x"):
        dim, size = part[:2], part[2:]
        if dim not in nd.DIMS or not size.isdigit() or dim in sizes:
            raise ValueError(f"bad layout {text!r}: write e.g. dp2xtp2 (dims {', '.join(nd.DIMS)})")
        sizes[dim] = int(size)
    return nd.Layout(**sizes)


DEFAULT_LAYOUTS = ("dp2", "tp2", "pp2", "cp2", "dp2xtp2")

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="torch's engines beside nd.py's, against one process")
    parser.add_argument("layouts", nargs="*", default=list(DEFAULT_LAYOUTS), help="e.g. dp2 tp2 dp2xtp2xpp2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                        help="float32 on cuda for context_parallel (a CUDA attention kernel)")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    try:
        layouts = [parse_layout(text) for text in args.layouts]
    except ValueError as exc:
        parser.error(str(exc))
    print(format_table(compare_with_torch(layouts,
                                          device=args.device, dtype=getattr(torch, args.dtype),
                                          steps=args.steps)))
