"""Lesson 11's proof: attention by blocks, ring attention and Ulysses against PyTorch's
`F.scaled_dot_product_attention` on the whole sequence in one process.

On every rank: build the same full q, k, v (float64), compute the reference output and its
gradients with PyTorch; check blockwise.py's `blockwise_attention` (out, lse, dQ, dK, dV) in
float64, and in float32 and bf16 within stated bounds; run this rank's shard through the
context-parallel attention, gather the output and dQ, dK, dV back into sequence order and
compare; count the exchange steps, the bytes sent and the tiles computed, each against its
formula in cost.py, main.py or ulysses.py. Then the CLI.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._checks import max_abs_diff
from lessons._launch import RankContext, inject_fault
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    int_in,
    launch_checks,
    lesson_parser,
)

from . import blockwise, ulysses
from . import main as context_parallel

memory = importlib.import_module("lessons.07_memory.main")  # lesson 07's technique
tiny_gpt = importlib.import_module("lessons.07_memory.tiny_gpt")  # lesson 07's TinyGPT, markov_batches


LESSON = "11_context_parallel"
# float64: the blocked and ringed sums add the same terms as PyTorch's in another order and
# rescale by exp(lse_a - lse); ~1e-16 relative on O(1) values. A lost block, a wrong mask or a
# missing rescale is off by O(0.1). TF32 never applies to float64.
TOLERANCE = 1e-10
VARIANTS = ("ring", "ulysses")

# ============================================================================ references


def full_inputs(seed: int, seq: int, heads: int, head_dim: int, device,
                kv_heads: int | None = None) -> tuple[torch.Tensor, ...]:
    """q (H, seq, d), k and v (H_kv, seq, d) (kv_heads None: H) and the loss weights w (H, seq,
    d): float64, the same on every rank (built on CPU)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(heads, seq, head_dim)] + [(kv_heads or heads, seq, head_dim)] * 2 + [(heads, seq, head_dim)]
    return tuple(torch.randn(*shape, generator=generator, dtype=torch.float64).to(device) for shape in shapes)


def reference(q, k, v, w, causal: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """PyTorch's attention on the whole sequence: output and [dQ, dK, dV] for loss sum(out w)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=k.shape[-3] != q.shape[-3])
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def gather_sequence(local: torch.Tensor, seq: int, layout: str, group=None) -> torch.Tensor:
    """Every rank's (H, seq / cp, d) shard of `group` put back at its global positions."""
    cp = dist.get_world_size(group)
    pieces = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    full = local.new_empty(local.shape[0], seq, local.shape[2])
    for rank, piece in enumerate(pieces):
        full[:, context_parallel.sequence_positions(seq, cp, rank, layout).to(local.device)] = piece
    return full


def run_variant(variant: str, inputs, seq: int, causal: bool, layout: str, engine: str = "p2p",
                group=None) -> dict:
    """This rank's shard through `variant` over `group` (None: every rank); the gathered output
    and gradients, what was counted, and the forward's seconds."""
    q, k, v, w = inputs
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    where = context_parallel.sequence_positions(seq, cp, rank, layout).to(q.device)
    local = [t[:, where].clone().requires_grad_() for t in (q, k, v)]
    stats = context_parallel.RingStats()
    started = time.perf_counter()
    if variant == "ring":
        out = context_parallel.ring_attention(*local, seq, causal, layout, stats, group)
    else:
        out = ulysses.ulysses_attention(*local, seq, causal, layout, engine, stats.traffic, group=group)
    seconds = time.perf_counter() - started
    forward_bytes = stats.traffic.bytes_sent
    (out * w[:, where]).sum().backward()
    return {"out": gather_sequence(out.detach(), seq, layout, group),
            "grads": [gather_sequence(t.grad, seq, layout, group) for t in local],
            "forward_bytes": forward_bytes, "backward_bytes": stats.traffic.bytes_sent - forward_bytes,
            "forward_steps": stats.forward_steps, "backward_steps": stats.backward_steps,
            "tiles": stats.tiles, "seconds": seconds}


# ============================================================================ float32 and bf16

# Error bounds, as multiples of the dtype's eps times max |reference| (the reference: float64
# attention on the same rounded inputs). bf16: every tile is computed in fp32 and each output is
# one fp32 result rounded to bf16 (<= eps / 2), and delta reads the bf16-rounded O (<= eps / 2
# more in the gradients): 1 eps; measured <= 0.52 eps (tests). float32: the scores are E-term
# dot products and each key block rescales once (Higham's gamma_n = n eps for n-term sums):
# (E + key blocks) eps; measured <= 6 eps with E = 32. A lost block or a wrong mask is off by
# O(0.1), far beyond either.
PRECISION = {"float32": "E + key blocks", "bfloat16": "1"}


def precision_bound(dtype: torch.dtype, head_dim: int, keys: int, block_k: int) -> float:
    """The bound above, in units of eps x max |reference|."""
    return 1.0 if dtype == torch.bfloat16 else head_dim + -(-keys // block_k)


def precision_gaps(dtype: torch.dtype, seed: int, causal: bool, shape=(2, 4, 67, 32),
                   blocks=(16, 24)) -> dict:
    """`blockwise_attention` and PyTorch's SDPA, both in `dtype`, against float64 SDPA on the
    same rounded inputs: max |error| / (eps max |reference|) for out, dQ, dK, dV ("ours",
    "sdpa"), the dtype each output came back in, and the bound."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(*shape, generator=generator).to(dtype) for _ in range(4))
    ref_out, ref_grads = reference(*(t.double() for t in (q, k, v, w)), causal)
    eps = torch.finfo(dtype).eps
    gaps = {}
    for name, attend in (("ours", lambda *t: blockwise.blockwise_attention(
            *t, causal, block_q=blocks[0], block_k=blocks[1])),
                         ("sdpa", lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal))):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        (out * w).sum().backward()
        gaps[name] = [max_abs_diff(a.double(), b) / (eps * b.abs().max().item())
                      for a, b in zip([out.detach(), *(t.grad for t in leaves)], [ref_out, *ref_grads])]
        gaps[f"{name}_dtype"] = str(out.dtype).removeprefix("torch.")
    gaps["bound"] = precision_bound(dtype, shape[-1], shape[-2], blocks[1])
    return gaps


def precision_checks(seed: int) -> list[Check]:
    """float32 and bf16, causal and not: ours within its bound and (flash-attention's own test
    criterion) at most twice the error of PyTorch's SDPA in the same dtype."""
    checks = []
    for dtype in (torch.float32, torch.bfloat16):
        runs = [precision_gaps(dtype, seed, causal) for causal in (False, True)]
        ours = max(max(r["ours"]) for r in runs)
        sdpa = max(max(r["sdpa"]) for r in runs)
        name = str(dtype).removeprefix("torch.")
        checks.append(Check(f"blockwise attention in {name}: out, dQ, dK, dV within "
                            f"({PRECISION[name]}) eps and <= 2x sdpa's error",
                            ours <= runs[0]["bound"] and ours <= 2 * sdpa,
                            f"max {ours:.2f} eps (bound {runs[0]['bound']:g}), sdpa {sdpa:.2f} eps"))
    return checks


# ============================================================================ the checks


def blockwise_checks(inputs, causal: bool, block_q: int, block_k: int) -> tuple[list[Check], float]:
    """One process: `blockwise_attention` forward, backward and lse against PyTorch's."""
    q, k, v, w = inputs
    y_ref, g_ref = reference(q, k, v, w, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = blockwise.blockwise_attention(*leaves, causal, enable_gqa=True, block_q=block_q,
                                             block_k=block_k, return_lse=True)
    (out * w).sum().backward()
    scores = q @ blockwise.expand_kv(k, q.shape[0] // k.shape[0]).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~blockwise.causal_mask(*(torch.arange(n, device=q.device)
                                                             for n in scores.shape[-2:])), float("-inf"))
    gap = max(max_abs_diff(out.detach(), y_ref), max_abs_diff(lse.detach(), torch.logsumexp(scores, -1)))
    grad_gap = max(max_abs_diff(t.grad, g) for t, g in zip(leaves, g_ref))
    mask = "causal" if causal else "no mask"
    return [Check(f"blockwise attention ({mask}, {block_q} x {block_k} tiles): out, lse == sdpa's",
                  gap <= TOLERANCE, f"max |diff| {gap:.1e}"),
            Check(f"blockwise backward from the saved lse ({mask}) == sdpa's dQ, dK, dV",
                  grad_gap <= TOLERANCE, f"max |diff| {grad_gap:.1e}")], max(gap, grad_gap)


def variant_checks(variant: str, run: dict, ref, seq: int, heads: int, head_dim: int,
                   causal: bool, layout: str, kv_heads: int) -> tuple[list[Check], float]:
    """A context-parallel run against the reference and the formulas."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    y_ref, g_ref = ref
    gap = max_abs_diff(run["out"], y_ref)
    grad_gap = max(max_abs_diff(a, b) for a, b in zip(run["grads"], g_ref))
    formula = (context_parallel.ring_bytes_per_rank if variant == "ring"
               else ulysses.ulysses_bytes_per_rank)(seq, heads, head_dim, cp, 8, kv_heads)._asdict()
    counted = {"forward": run["forward_bytes"], "backward": run["backward_bytes"]}
    checks = [
        Check(f"{variant}: output == sdpa on the whole sequence", gap <= TOLERANCE, f"max |diff| {gap:.1e}"),
        Check(f"{variant}: gathered dQ, dK, dV == sdpa's", grad_gap <= TOLERANCE,
              f"max |diff| {grad_gap:.1e}"),
        Check(f"{variant}: bytes sent per rank == formula", counted == formula,
              f"{counted} counted, {formula} formula"),
    ]
    if variant == "ring":
        tiles = context_parallel.tiles_per_rank(cp, layout, causal)[rank]
        checks += [
            Check("ring: cp - 1 exchange steps forward, cp backward (0 at cp = 1)",
                  run["forward_steps"] == cp - 1 and run["backward_steps"] == (cp if cp > 1 else 0),
                  f"{run['forward_steps']} forward, {run['backward_steps']} backward"),
            Check(f"ring: tiles computed == tiles_per_rank ({layout})", run["tiles"] == tiles,
                  f"{run['tiles']} computed, {tiles} formula"),
        ]
    return checks, max(gap, grad_gap)


def refusal_checks(seq: int) -> list[Check]:
    """A head count Ulysses cannot split and a sequence the layout cannot cut: one clear line."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    bad_seq = 2 * cp * 3 + 1  # never divisible by 2 cp
    messages = []
    for refuse in (lambda: ulysses.check_heads(cp + 1, cp + 1, cp),
                   lambda: context_parallel.sequence_positions(bad_seq, cp, rank, "zigzag")):
        try:
            refuse()
            messages.append("accepted")
        except ValueError as exc:
            messages.append(str(exc))
    heads_ok = cp == 1 or "divisible" in messages[0]
    return [Check(f"{cp + 1} heads on {cp} ranks: Ulysses refuses", heads_ok,
                  messages[0] if cp > 1 else "1 rank: every head count divides"),
            Check(f"sequence {bad_seq} on {cp} ranks: refused", "divisible" in messages[1],
                  messages[1])]


def verify_worker(ctx: RankContext, seed: int, seq: int, heads: int, head_dim: int, causal: bool,
                  layout: str, variant: str, kv_heads: int, fault: str | None, fault_rank: int) -> dict:
    """Blockwise attention (float64 exactly; float32 and bf16 within bounds), the chosen variant
    (and Ulysses on torch's all-to-all) against the single-process reference; what was counted
    against the formulas."""
    inject_fault(ctx, fault, fault_rank)
    inputs = full_inputs(seed, seq, heads, head_dim, ctx.device, kv_heads)
    checks, gaps = [], []
    for mask in (False, True):  # query and key blocks that do not divide the sequence
        found, gap = blockwise_checks(inputs, mask, max(seq // 3, 1) + 1, max(seq // 4, 1) + 1)
        checks += found
        gaps.append(gap)
    checks += precision_checks(seed)
    ref = reference(*inputs, causal)
    run = run_variant(variant, inputs, seq, causal, layout)
    found, gap = variant_checks(variant, run, ref, seq, heads, head_dim, causal, layout, kv_heads)
    checks += found
    gaps.append(gap)
    if variant == "ulysses":
        other = run_variant("ulysses", inputs, seq, causal, layout, engine="torch")
        same = torch.equal(other["out"], run["out"]) and all(
            torch.equal(a, b) for a, b in zip(other["grads"], run["grads"]))
        checks.append(Check("ulysses: torch's all_to_all_single == lesson 01's exchange",
                            same, "outputs and gradients bit-identical" if same else "DIFFER"))
    checks += refusal_checks(seq)
    checks += cp_gpt_steps(ctx, variant, layout)
    return {"checks": [vars(c) for c in checks], "device": ctx.device.type, "backend": ctx.backend,
            "max_abs_err": max(gaps), "bytes": {"forward": run["forward_bytes"],
                                                 "backward": run["backward_bytes"]},
            "tiles": run["tiles"], "seconds": run["seconds"]}


# ============================================================================ in a model


def cp_layer_forward(layer, x: torch.Tensor, attend) -> torch.Tensor:
    """Lesson 07's TransformerLayer on this rank's tokens x (n, 1, h), dropout off, with its
    attention replaced by `attend(q, k, v)` on (H, n, d): everything else is per token."""
    n, _, h = x.shape
    heads = layer.heads
    q, k, v = (t.reshape(n, heads, h // heads).transpose(0, 1)
               for t in layer.qkv(layer.ln1(x)).split(h, dim=-1))
    context = attend(q, k, v).transpose(0, 1).reshape(n, 1, h)
    x = x + layer.out(context)
    return x + layer.down(F.gelu(layer.up(layer.ln2(x))))


def cp_gpt_steps(ctx: RankContext, variant: str, layout: str, steps: int = 3, vocab: int = 11,
                 layers: int = 2) -> list[Check]:
    """A few SGD steps of lesson 07's TinyGPT (float64, batch 1, dropout off) with context
    parallelism against the same steps in one process: the loss of every step and every
    gradient. CP: each rank embeds its positions, runs the layers with `variant`'s attention,
    sums its tokens' cross-entropy; the loss is the all-reduced sum / seq, the gradients of the
    replicated weights are all-reduced over cp (each rank holds only its tokens' share).
    Sequence 8 cp; 4 heads of 4 (cp heads for Ulysses when cp does not divide 4)."""
    cp, rank = ctx.world_size, ctx.rank
    seq, heads = 8 * cp, (cp if variant == "ulysses" and 4 % cp else 4)
    hidden = 4 * heads
    torch.manual_seed(0)
    reference = tiny_gpt.TinyGPT(vocab, hidden, heads, layers, seq, dropout=0.0)
    reference = reference.double().to(ctx.device).eval()
    model = copy.deepcopy(reference)
    where = context_parallel.sequence_positions(seq, cp, rank, layout).to(ctx.device)
    batches = tiny_gpt.markov_batches(vocab, seq, 1, steps, seed=3)
    attend = ((lambda q, k, v: context_parallel.ring_attention(q, k, v, seq, True, layout))
              if variant == "ring" else
              (lambda q, k, v: ulysses.ulysses_attention(q, k, v, seq, True, layout)))
    loss_gap = grad_gap = 0.0
    for tokens, targets in batches:
        tokens, targets = tokens.to(ctx.device), targets.to(ctx.device)
        ref_loss = reference.loss(tokens, targets)
        ref_loss.backward()
        x = (model.embed(tokens[:, where]) + model.pos.weight[where]).transpose(0, 1)
        for layer in model.layers:
            x = cp_layer_forward(layer, x, attend)
        logits = model.norm(x)[:, 0] @ model.embed.weight.T
        local = F.cross_entropy(logits, targets[0, where], reduction="sum") / seq
        local.backward()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        for param in model.parameters():
            dist.all_reduce(param.grad)
        loss_gap = max(loss_gap, abs(loss.item() - ref_loss.item()))
        grad_gap = max(grad_gap, max(max_abs_diff(p.grad, r.grad) for p, r in
                                     zip(model.parameters(), reference.parameters())))
        for net in (model, reference):
            with torch.no_grad():
                for param in net.parameters():
                    param -= 0.1 * param.grad
                    param.grad = None
    return [Check(f"GPT ({variant}), {steps} SGD steps: losses == one process", loss_gap <= TOLERANCE,
                  f"max |diff| {loss_gap:.1e}"),
            Check(f"GPT ({variant}): every gradient == one process", grad_gap <= TOLERANCE,
                  f"max |diff| {grad_gap:.1e}")]


def activation_worker(ctx: RankContext, seqs: list[int], hidden: int = 16, heads: int = 4) -> list[int]:
    """Bytes one rank keeps for backward (lesson 07's MemoryTracker, forward phase) in one of
    lesson 07's layers with ring attention (zig-zag, causal, float64), per sequence length:
    every tensor kept is per token, so the bytes are 1/cp of one process's."""
    torch.manual_seed(0)
    layer = memory.TransformerLayer(hidden, heads, dropout=0.0).double().to(ctx.device)
    kept = []
    for seq in seqs:
        n = seq // ctx.world_size
        x = torch.randn(n, 1, hidden, dtype=torch.float64, device=ctx.device, requires_grad=True)
        tracker = memory.MemoryTracker()
        tracker.mark([x, *layer.parameters()], "parameter")  # made before: not activations
        with tracker, tracker.phase("forward"):
            y = cp_layer_forward(layer, x, lambda q, k, v, s=seq: context_parallel.ring_attention(
                q, k, v, s, True, "zigzag"))
        kept.append(tracker.breakdown()["activation"])
        del y
    return kept


def try_torch_context_parallel(ctx: RankContext, seq: int, heads: int, head_dim: int) -> str:
    """Run PyTorch's own `context_parallel` on this group; returns "ok ..." or the error line.
    (torch 2.13 on CPU: sdpa's CPU kernel has no sharding strategy registered.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as torch_cp

    q, k, v, _ = full_inputs(0, seq, heads, head_dim, ctx.device)
    q, k, v = (t[None].float() for t in (q, k, v))
    try:
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        with torch_cp(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return f"ok: local output {tuple(out.shape)}"
    except Exception as exc:  # noqa: BLE001 - what PyTorch says is the result
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def torch_cp_worker(ctx: RankContext, seq: int, heads: int, head_dim: int) -> str:
    return try_torch_context_parallel(ctx, seq, heads, head_dim)


# ============================================================================ the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Context parallelism from scratch (ring attention, Ulysses), checked "
                           "against PyTorch's attention on the whole sequence.", world_size=4)
    parser.add_argument("--seq", type=int_in(1, 65536), default=48,
                        help="sequence length, divisible by 2 x world size (default 48: any world "
                             "size 1-4)")
    parser.add_argument("--heads", type=int_in(1, 256), default=12,
                        help="attention heads (default 12: Ulysses splits them over 1-4 ranks)")
    parser.add_argument("--kv-heads", type=int_in(1, 256), default=None,
                        help="key/value heads, grouped-query attention (default: --heads)")
    parser.add_argument("--head-dim", type=int_in(1, 1024), default=8, help="head size (default 8)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                        help="causal mask (default on)")
    parser.add_argument("--layout", choices=context_parallel.LAYOUTS, default="zigzag",
                        help="how the sequence is split (default zigzag)")
    parser.add_argument("--variant", choices=VARIANTS, default="ring", help="default ring")
    args = parser.parse_args(argv)
    world = check_args(parser, args)
    args.kv_heads = args.kv_heads or args.heads
    if args.quick:  # the smallest sequence both layouts can cut: 2 positions per chunk
        args.seq = 4 * world
    if args.seq % (2 * world):
        parser.error(f"--seq {args.seq} is not divisible by 2 x the world size = {2 * world} "
                     "(both layouts cut it into 2 cp equal chunks)")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}")
    if args.variant == "ulysses":
        try:
            ulysses.check_heads(args.heads, args.kv_heads, world)
        except ValueError as exc:
            parser.error(f"--heads {args.heads} / --kv-heads {args.kv_heads} on {world} ranks: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results, checks = launch_checks(
        verify_worker, args, (args.seed, args.seq, args.heads, args.head_dim, args.causal, args.layout,
                              args.variant, args.kv_heads))
    world = len(results)
    sizes = (args.seq, args.heads, args.head_dim, world, 8, args.kv_heads)
    ring_sent = context_parallel.ring_bytes_per_rank(*sizes)
    ulysses_sent = ulysses.ulysses_bytes_per_rank(*sizes)
    metrics = {
        "variant": args.variant, "layout": args.layout, "causal": args.causal,
        "bytes_per_rank": [r["bytes"] for r in results],
        "max_abs_err": max(r["max_abs_err"] for r in results),
        "tiles_per_rank": [r["tiles"] for r in results] if args.variant == "ring" else None,
        "tiles_formula": {layout: context_parallel.tiles_per_rank(world, layout, args.causal)
                          for layout in context_parallel.LAYOUTS},
        "forward_seconds_per_rank": [round(r["seconds"], 4) for r in results],
        "bytes_formula": {"ring": ring_sent._asdict(), "ulysses": ulysses_sent._asdict()},
    }
    sent = metrics["bytes_per_rank"][0]
    metrics["headline"] = (f"{args.variant}: {sent['forward']} B forward + {sent['backward']} B "
                           f"backward per rank, max |err| {metrics['max_abs_err']:.1e}")
    report = Report(LESSON, results[0]["device"], results[0]["backend"], world, checks, metrics)
    return finish(report, args.json, started)
