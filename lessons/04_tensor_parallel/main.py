"""Lesson 04: tensor parallelism: column/row-parallel layers, the Megatron MLP and attention,
and sequence parallelism.

The story, top to bottom:

1. Four communication operators as autograd functions (Megatron's f and g, and their
   sequence-parallel cousins), built on lesson 01's ring collectives so every byte is counted:
   f = identity forward / all-reduce backward; g = all-reduce forward / identity backward;
   all-gather forward / reduce-scatter backward, and the reverse.
2. `ColumnParallelLinear` (split the output features) and `RowParallelLinear` (split the input
   features).
3. The Megatron MLP (column, GeLU, row: one all-reduce forward, one backward) and self-attention
   split by heads (Q, K, V column-parallel by head groups, output projection row-parallel).
4. Sequence parallelism: the LayerNorm/dropout region works on a slice of the sequence; an
   all-gather enters the tensor-parallel region and a reduce-scatter leaves it, instead of
   the all-reduce.
5. The checks: outputs and every gradient equal the dense modules'; bytes per layer equal the
   formula, with and without sequence parallelism; a head count not divisible by the
   tensor-parallel size is a clear error.

Run: `python lessons/04_tensor_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

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

LESSON = "04_tensor_parallel"
COLLECTIVES = importlib.import_module("lessons.01_collectives.main")
# float64: tensor-parallel results differ from dense ones only in the order partial sums are
# added (~1e-16 relative); a missing all-reduce or a wrong shard is off by O(1).
TOLERANCE = 1e-10

# ============================================================================ 1. communication


class Comm:
    """Counts the bytes this rank sends in tensor-parallel collectives (lesson 01's rings)."""

    traffic = COLLECTIVES.Traffic()

    @classmethod
    def reset(cls) -> None:
        cls.traffic = COLLECTIVES.Traffic()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    return COLLECTIVES.ring_all_reduce(x.contiguous(), Comm.traffic)


def _all_gather_seq(x: torch.Tensor) -> torch.Tensor:
    """(s/p, b, h) on every rank -> (s, b, h): gather along the sequence (dim 0)."""
    world = dist.get_world_size()
    full = COLLECTIVES.ring_all_gather(x.contiguous().reshape(-1), x.numel() * world, Comm.traffic)
    return full.view(x.shape[0] * world, *x.shape[1:])


def _reduce_scatter_seq(x: torch.Tensor) -> torch.Tensor:
    """(s, b, h) partial sums on every rank -> (s/p, b, h) summed: this rank's sequence slice."""
    world = dist.get_world_size()
    part = COLLECTIVES.ring_reduce_scatter(x.contiguous().reshape(-1), Comm.traffic)
    return part.view(x.shape[0] // world, *x.shape[1:])


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity in forward (every rank already has X), all-reduce in backward
    (each rank's dX is a partial sum over its shard of the next layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce in forward (sum the row-parallel partial outputs), identity in
    backward (every rank needs the same dY)."""

    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence parallel's replacement for f: all-gather the sequence in forward, reduce-scatter
    the gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return _all_gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad)


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sequence parallel's replacement for g: reduce-scatter in forward (sum partial outputs and
    keep this rank's sequence slice), all-gather the gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad)


# ============================================================================ 2. parallel linears


def shard_rows(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows [r*n/p, (r+1)*n/p) of a (n, m) weight: a column-parallel shard (output features)."""
    rows = weight.shape[0] // world
    return weight[rank * rows:(rank + 1) * rows].clone()


def shard_cols(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Columns [r*m/p, (r+1)*m/p) of a (n, m) weight: a row-parallel shard (input features)."""
    cols = weight.shape[1] // world
    return weight[:, rank * cols:(rank + 1) * cols].clone()


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r^T + b_r with A (out, in) split by rows (output features): each rank computes
    out/p features of the output from the WHOLE input. No communication in forward (after f);
    the input gradient is a partial sum, all-reduced by f in backward."""

    def __init__(self, dense: nn.Linear, rank: int, world: int, enter=CopyToTensorParallel):
        super().__init__()
        if dense.out_features % world:
            raise ValueError(f"out_features {dense.out_features} not divisible by {world}")
        self.weight = nn.Parameter(shard_rows(dense.weight.detach(), rank, world))
        self.bias = nn.Parameter(shard_rows(dense.bias.detach()[:, None], rank, world)[:, 0])
        self.enter = enter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.enter.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r B_r^T + b with B (out, in) split by columns (input features): each rank
    multiplies its slice of the input features and the partial outputs are summed by g (an
    all-reduce). The bias is added once, after the sum."""

    def __init__(self, dense: nn.Linear, rank: int, world: int, leave=ReduceFromTensorParallel):
        super().__init__()
        if dense.in_features % world:
            raise ValueError(f"in_features {dense.in_features} not divisible by {world}")
        self.weight = nn.Parameter(shard_cols(dense.weight.detach(), rank, world))
        self.bias = nn.Parameter(dense.bias.detach().clone())
        self.leave = leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leave.apply(F.linear(x, self.weight)) + self.bias


# ============================================================================ 3. MLP and attention


class DenseBlock(nn.Module):
    """A pre-norm transformer block on (s, b, h): x + Attn(LN1 x), then + MLP(LN2 x).
    MLP = h -> 4h -> GeLU -> h; attention causal with `heads` heads."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(causal_attention(self.q(x), self.k(x), self.v(x), self.heads))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """q, k, v (s, b, heads*d) -> (s, b, heads*d): softmax(q k^T / sqrt(d) + causal mask) v per
    head. Heads never interact, which is why attention splits by heads for free."""
    s, b, width = q.shape
    d = width // heads

    def split(t: torch.Tensor) -> torch.Tensor:  # (s, b, H*d) -> (b, H, s, d)
        return t.view(s, b, heads, d).permute(1, 2, 0, 3)

    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ split(v)
    return out.permute(2, 0, 1, 3).reshape(s, b, width)


class TensorParallelBlock(nn.Module):
    """`DenseBlock` split over p ranks. Attention: Q, K, V column-parallel (heads/p heads per
    rank), O row-parallel. MLP: up column-parallel, down row-parallel. LayerNorms replicated.

    sequence_parallel=False: the input (s, b, h) is replicated; f before each column layer, g
    (all-reduce) after each row layer: per block, 2 all-reduces forward and 2 backward.
    sequence_parallel=True: the input is (s/p, b, h); LayerNorms run on the slice; all-gather
    enters each parallel region and reduce-scatter leaves it (same bytes, 1/p of the
    LayerNorm/dropout activations).
    """

    def __init__(self, dense: DenseBlock, rank: int, world: int, sequence_parallel: bool = False):
        super().__init__()
        if dense.heads % world:
            raise ValueError(f"attention heads ({dense.heads}) must be divisible by the "
                             f"tensor-parallel size ({world})")
        self.heads = dense.heads // world
        self.sequence_parallel = sequence_parallel
        enter = GatherFromSequenceParallel if sequence_parallel else CopyToTensorParallel
        leave = ReduceScatterToSequenceParallel if sequence_parallel else ReduceFromTensorParallel
        self.ln1 = _copy_layernorm(dense.ln1)
        self.ln2 = _copy_layernorm(dense.ln2)
        self.q, self.k, self.v = (ColumnParallelLinear(layer, rank, world, enter=_Identity)
                                  for layer in (dense.q, dense.k, dense.v))
        self.o = RowParallelLinear(dense.o, rank, world, leave)
        self.up = ColumnParallelLinear(dense.up, rank, world, enter=_Identity)
        self.down = RowParallelLinear(dense.down, rank, world, leave)
        self.enter = enter

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter.apply(x)  # one f (or all-gather) shared by Q, K and V
        return self.o(causal_attention(self.q(x), self.k(x), self.v(x), self.heads))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.enter.apply(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def all_reduce_sequence_parallel_grads(block: TensorParallelBlock) -> int:
    """With sequence parallelism each rank sees only s/p positions, so the gradients of the
    REPLICATED parameters used in that region (both LayerNorms, and the row-parallel biases
    added after the reduce-scatter) are partial sums over the sequence: all-reduce them (as
    Megatron does for its sequence-parallel parameters). Returns how many were reduced."""
    replicated = [block.ln1.weight, block.ln1.bias, block.ln2.weight, block.ln2.bias,
                  block.o.bias, block.down.bias]
    for param in replicated:
        param.grad = _all_reduce(param.grad)
    return len(replicated)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _copy_layernorm(dense: nn.LayerNorm) -> nn.LayerNorm:
    layer = nn.LayerNorm(dense.normalized_shape).to(dense.weight.dtype)
    layer.load_state_dict(dense.state_dict())
    return layer


# ============================================================================ the formulas


def tp_bytes_per_block(seq: int, batch: int, hidden: int, world: int, itemsize: int,
                       sequence_parallel: bool) -> int:
    """Bytes one rank sends for one block's forward + backward over a ring (lesson 01).

    S = s b h x itemsize, the size of one activation. Without sequence parallelism: attention
    and MLP each do 1 all-reduce in forward (g) and 1 in backward (f): 4 all-reduces of S,
    4 x 2(p-1)/p x S. With it: each all-reduce becomes an all-gather + a reduce-scatter of the
    same S, (p-1)/p x S each: the same total, plus a small all-reduce of the gradients of
    the six replicated h-vectors (LayerNorms, row biases) that only saw s/p positions.
    """
    # with p | s b h, lesson 01's exact ring count is 2(p-1)/p x S per all-reduce, and an
    # all-gather + a reduce-scatter of the same S send exactly as much
    per_all_reduce = COLLECTIVES.ring_bytes_sent(seq * batch * hidden, itemsize, world, 0)["all_reduce"]
    total = 4 * per_all_reduce
    if sequence_parallel:  # + the all-reduce of 6 replicated h-vectors' gradients
        total += 6 * COLLECTIVES.ring_bytes_sent(hidden, itemsize, world, 0)["all_reduce"]
    return total


def layernorm_activation_elements(seq: int, batch: int, hidden: int, world: int,
                                  sequence_parallel: bool) -> int:
    """Elements of the two LayerNorms' inputs one rank keeps for backward: s b h each without
    sequence parallelism, s b h / p with it."""
    return 2 * seq * batch * hidden // (world if sequence_parallel else 1)


# ============================================================================ 5. the checks


def make_dense(seed: int, hidden: int, heads: int) -> DenseBlock:
    torch.manual_seed(seed)
    return DenseBlock(hidden, heads).double()


def dense_reference(seed: int, hidden: int, heads: int, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Output and every parameter's gradient of the dense block for loss = sum(y * w)."""
    dense = make_dense(seed, hidden, heads)
    xr = x.clone().requires_grad_()
    y = dense(xr)
    (y * loss_weights(y.shape)).sum().backward()
    grads = {name: p.grad for name, p in dense.named_parameters()}
    grads["input"] = xr.grad
    return y.detach(), grads


def loss_weights(shape) -> torch.Tensor:
    """Fixed random weights so that every output element has a distinct gradient."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)


def gather_gradient(name: str, grad: torch.Tensor, world: int) -> torch.Tensor:
    """Rebuild a full gradient from the tensor-parallel shards: column-parallel weights and
    biases are split by rows, row-parallel weights by columns, the rest is replicated."""
    if world == 1:
        return grad
    column = name.split(".")[0] in ("q", "k", "v", "up")
    row = name.split(".")[0] in ("o", "down") and name.endswith("weight")
    if not (column or row):
        return grad
    return all_gather_cat(grad, world, dim=1 if row else 0)


def check_block(ctx: RankContext, seed: int, seq: int, batch: int, hidden: int, heads: int,
                sequence_parallel: bool) -> tuple[list[Check], dict]:
    """Forward and backward through the tensor-parallel block; compare with the dense one."""
    world, rank = ctx.world_size, ctx.rank
    x = torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(seed + 1),
                    dtype=torch.float64)
    y_ref, grads_ref = dense_reference(seed, hidden, heads, x)
    block = TensorParallelBlock(make_dense(seed, hidden, heads), rank, world, sequence_parallel)
    rows = seq // world
    local_x = (x[rank * rows:(rank + 1) * rows] if sequence_parallel else x).clone().requires_grad_()
    Comm.reset()
    y = block(local_x)
    forward_bytes = Comm.traffic.bytes_sent
    expected_y = y_ref[rank * rows:(rank + 1) * rows] if sequence_parallel else y_ref
    weights = loss_weights(y_ref.shape)
    local_w = weights[rank * rows:(rank + 1) * rows] if sequence_parallel else weights
    (y * local_w).sum().backward()
    if sequence_parallel:
        all_reduce_sequence_parallel_grads(block)
    total_bytes = Comm.traffic.bytes_sent
    label = "TP + sequence parallel" if sequence_parallel else "TP"
    out_gap = float((y.detach() - expected_y).abs().max())
    grad_gap = 0.0
    for name, param in block.named_parameters():
        full = gather_gradient(name, param.grad, world)
        grad_gap = max(grad_gap, float((full - grads_ref[name]).abs().max()))
    input_grad = local_x.grad
    if sequence_parallel:
        input_grad = all_gather_cat(input_grad, world, dim=0)
    grad_gap = max(grad_gap, float((input_grad - grads_ref["input"]).abs().max()))
    expected_bytes = tp_bytes_per_block(seq, batch, hidden, world, 8, sequence_parallel)
    checks = [
        Check(f"{label}: output == dense block", out_gap <= TOLERANCE, f"max |diff| {out_gap:.1e}"),
        Check(f"{label}: every gradient (and dX) == dense block", grad_gap <= TOLERANCE,
              f"max |diff| {grad_gap:.1e} over {len(grads_ref)} tensors"),
        Check(f"{label}: bytes sent per block (fwd+bwd) == formula",
              total_bytes == expected_bytes,
              f"{total_bytes} B counted ({forward_bytes} forward), {expected_bytes} B formula"),
    ]
    return checks, {"bytes": total_bytes, "forward_bytes": forward_bytes}


def all_gather_cat(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` (torch's all_gather: a check, not the lesson)."""
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=dim)


def verify_worker(ctx: RankContext, seed: int, seq: int, batch: int, hidden: int, heads: int,
                  fault: str | None, fault_rank: int) -> dict:
    inject_fault(ctx, fault, fault_rank)
    checks, metrics = [], {}
    for sequence_parallel in (False, True):
        block_checks, block_metrics = check_block(ctx, seed, seq, batch, hidden, heads,
                                                  sequence_parallel)
        checks += block_checks
        metrics["sp" if sequence_parallel else "tp"] = block_metrics
    if ctx.world_size > 1:  # world + 1 heads never divide over world ranks
        bad_heads = ctx.world_size + 1
        try:
            TensorParallelBlock(make_dense(seed, bad_heads * 2, bad_heads), ctx.rank, ctx.world_size)
            message = "accepted"
        except ValueError as exc:
            message = str(exc)
        checks.append(Check(f"{bad_heads} heads on {ctx.world_size} ranks: clear error",
                            "must be divisible" in message, message))
    else:
        checks.append(Check("heads not divisible by the TP size: clear error", True,
                            "1 rank: every head count divides (tested on p > 1)"))
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Tensor and sequence parallelism from scratch, checked against the "
                           "dense block.")
    parser.add_argument("--seq", type=int_in(1, 4096), default=8, help="sequence length (default 8)")
    parser.add_argument("--batch", type=int_in(1, 1024), default=2, help="batch (default 2)")
    parser.add_argument("--hidden", type=int_in(1, 8192), default=16, help="hidden size (default 16)")
    parser.add_argument("--heads", type=int_in(1, 256), default=4, help="attention heads (default 4)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    world = args.world_size
    if args.heads % world:
        parser.error(f"--heads {args.heads} is not divisible by --world-size {world}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.seq % world:
        parser.error(f"--seq {args.seq} is not divisible by --world-size {world} "
                     "(sequence parallelism splits it)")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results = launch(verify_worker, args.world_size,
                     (args.seed, args.seq, args.batch, args.hidden, args.heads, args.fault,
                      args.fault_rank), device="cpu", timeout_s=args.timeout)
    checks = merge_rank_checks([r["checks"] for r in results])
    metrics = dict(results[0]["metrics"])
    metrics["layernorm_activation_elements"] = {
        "tp": layernorm_activation_elements(args.seq, args.batch, args.hidden, len(results), False),
        "sp": layernorm_activation_elements(args.seq, args.batch, args.hidden, len(results), True)}
    metrics["headline"] = (f"{metrics['tp']['bytes']} B per block with TP, "
                           f"{metrics['sp']['bytes']} B with SP")
    return finish(Report(LESSON, "cpu", "gloo", len(results), checks, metrics), args.json, started)


if __name__ == "__main__":
    run_main(main)
