"""Lesson 04: tensor parallelism: column/row-parallel layers, the Megatron MLP and attention,
and sequence parallelism.

The story, top to bottom (1-2 in communication.py, the rest here):

1. `TensorParallelGroup`: the ranks that share a layer and their collectives (lesson 01's
   rings on the default group, every byte counted; torch.distributed's on a sub-group).
2. Megatron's f (identity forward, all-reduce backward) and g (the reverse), autograd functions.
3. `ColumnParallelLinear` (split the output features), `RowParallelLinear` (split the input
   features): column then row needs one g and one f, nothing in between.
4. `TensorParallelBlock`: attention split by heads, the MLP column-GeLU-row.
5. Sequence parallelism: LayerNorm and the residual on s/p positions, an all-gather into each
   parallel region and a reduce-scatter out of it. First simply (the gathered input stays
   saved for backward), then as Megatron builds it: save the shard and gather it again in
   backward, which reaches Korthikanti et al.'s activation memory.
6. The cost model: bytes sent per block (activations) and per step (the replicated
   gradients), and bytes saved for backward per block.

The proof is in checks.py: `python lessons/04_tensor_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn as nn
import torch.nn.functional as F

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique
communication = importlib.import_module("lessons.04_tensor_parallel.communication")  # 1-2
TensorParallelGroup = communication.TensorParallelGroup  # the group (later lessons import it here)
CopyToTensorParallel = communication.CopyToTensorParallel  # Megatron's f
ReduceFromTensorParallel = communication.ReduceFromTensorParallel  # Megatron's g

# ============================================================================ 3. parallel linears


def shard_rows(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows [r n/p, (r+1) n/p) of an (n, ...) weight or bias: a column-parallel shard."""
    rows = weight.shape[0] // world
    return weight[rank * rows:(rank + 1) * rows].clone()


def shard_cols(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Columns [r m/p, (r+1) m/p) of an (n, m) weight: a row-parallel shard (input features)."""
    cols = weight.shape[1] // world
    return weight[:, rank * cols:(rank + 1) * cols].clone()


def copy_then_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     tp: TensorParallelGroup) -> torch.Tensor:
    """How a column-parallel layer enters the tensor-parallel region: f, then the local matmul."""
    return F.linear(CopyToTensorParallel.apply(x, tp), weight, bias)


# exercise parallel-linears (4 points): Column- and row-parallel linear layers
# hint: shard_rows / shard_cols cut the shards; the row-parallel bias is added once,
#   after the partial products are summed.
class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r^T + b_r: A (out, in) split by rows (output features) over the group.

    `dense`: one nn.Linear, or several reading the same input (Q, K, V, fused as Megatron fuses
    QKV); rank r keeps rows [r out/p, (r+1) out/p) of each, side by side: parameters weight
    (k out/p, in) and bias (k out/p,) for k layers, so x (..., in) -> (..., k out/p), the
    layers' slices in order ([q_r | k_r | v_r] for QKV). Copies, never views of `dense`.
    `enter(x, weight, bias, tp)` brings the input in and multiplies; forward returns what it
    returns: `copy_then_linear` (f: nothing sent forward, dX all-reduced backward) or a
    sequence-parallel entry. 1/p of the FLOPs and weights. Some out_features not divisible
    by p: ValueError.
    """

    def __init__(self, dense: nn.Linear | Sequence[nn.Linear], tp: TensorParallelGroup,
                 enter: Callable = copy_then_linear):
        super().__init__()
        layers = [dense] if isinstance(dense, nn.Linear) else list(dense)
        for layer in layers:
            if layer.out_features % tp.size:
                raise ValueError(f"out_features {layer.out_features} not divisible by {tp.size}")
        self.weight = nn.Parameter(torch.cat([shard_rows(layer.weight.detach(), tp.rank, tp.size)
                                              for layer in layers]))
        self.bias = nn.Parameter(torch.cat([shard_rows(layer.bias.detach(), tp.rank, tp.size)
                                            for layer in layers]))
        self.tp, self.enter = tp, enter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enter(x, self.weight, self.bias, self.tp)


# exercise parallel-linears (continued)
class RowParallelLinear(nn.Module):
    """Y = sum_r X_r B_r^T + b: B (out, in) split by columns (input features) over the group.

    Parameters weight (out, in/p), columns [r in/p, (r+1) in/p), and bias (out,), replicated
    (copies of `dense`'s). x (..., in/p), the slice a column-parallel layer left -> (..., out):
    the partial products are summed by `leave.apply(partial, tp)`, called once per forward
    (g: all-reduce forward, 2(p-1)/p |y| bytes, nothing backward; or sequence parallelism's
    reduce-scatter); the bias is added once, after the sum. in_features not divisible by p:
    ValueError.
    """

    def __init__(self, dense: nn.Linear, tp: TensorParallelGroup,
                 leave: type[torch.autograd.Function] = ReduceFromTensorParallel):
        super().__init__()
        if dense.in_features % tp.size:
            raise ValueError(f"in_features {dense.in_features} not divisible by {tp.size}")
        self.weight = nn.Parameter(shard_cols(dense.weight.detach(), tp.rank, tp.size))
        self.bias = nn.Parameter(dense.bias.detach().clone())
        self.tp, self.leave = tp, leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leave.apply(F.linear(x, self.weight), self.tp) + self.bias


# ============================================================================ 4. the block


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """q, k, v (s, b, heads*d) -> (s, b, heads*d): softmax(q k^T / sqrt(d) + causal mask) v per
    head. Heads never interact, which is why attention splits by heads for free."""
    s, b, width = q.shape
    d = width // heads

    def split(t: torch.Tensor) -> torch.Tensor:  # (s, b, H*d) -> (b, H, s, d)
        return t.reshape(s, b, heads, d).permute(1, 2, 0, 3)

    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ split(v)
    return out.permute(2, 0, 1, 3).reshape(s, b, width)


# exercise tp-block (4 points): The tensor-parallel transformer block (heads and MLP split)
# hint: the fused QKV output on rank r is [q_r | k_r | v_r], each holding this rank's H/p heads.
class TensorParallelBlock(nn.Module):
    """A pre-norm transformer block split over the group's p ranks (Megatron-LM).

    `dense` is the block to split (checks.DenseBlock): LayerNorms ln1, ln2; nn.Linear q, k, v,
    o (h -> h), up (h -> 4h), down (4h -> h); `heads`; it computes x + o(attn(q, k, v of
    ln1 x)), then + down(gelu(up(ln2 x))) on x (s, b, h). This block computes the same.

    Attention: Q, K, V fused column-parallel (rank r owns heads [r H/p, (r+1) H/p)), O
    row-parallel. MLP: up column-parallel, GeLU on the local 4h/p slice, down row-parallel.
    LayerNorms (copies of dense's: no parameter is shared with `dense`) and the residual
    stream replicated (their gradients come out the same on every rank). Parameters ln1, ln2,
    qkv, o, up, down. f enters each region and g leaves it
    (`enter`, `leave`: pass them to every parallel linear): 2 all-reduces of s b h forward, 2
    backward. Attributes heads (this rank's H/p) and tp. Heads not divisible by p: ValueError
    "... must be divisible ..." naming both numbers, before anything is built.
    """

    def __init__(self, dense: nn.Module, tp: TensorParallelGroup,
                 enter: Callable = copy_then_linear,
                 leave: type[torch.autograd.Function] = ReduceFromTensorParallel):
        super().__init__()
        if dense.heads % tp.size:
            raise ValueError(f"attention heads ({dense.heads}) must be divisible by the "
                             f"tensor-parallel size ({tp.size})")
        self.heads, self.tp = dense.heads // tp.size, tp
        self.ln1, self.ln2 = copy.deepcopy(dense.ln1), copy.deepcopy(dense.ln2)  # replicated
        self.qkv = ColumnParallelLinear([dense.q, dense.k, dense.v], tp, enter)
        self.o = RowParallelLinear(dense.o, tp, leave)
        self.up = ColumnParallelLinear(dense.up, tp, enter)
        self.down = RowParallelLinear(dense.down, tp, leave)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)  # this rank's heads of each
        x = x + self.o(causal_attention(q, k, v, self.heads))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


# ============================================================================ 5. sequence parallel


# exercise sp-conversions (3 points): Sequence parallelism's gather, reduce-scatter and gradients
# hint: the gather's backward is the reduce-scatter's forward and vice versa; tp's gathers
#   and scatters work on dim 0, the sequence.
class GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's entry into a parallel region, replacing f (Korthikanti et al.).

    forward(x, tp): x (s/p, b, h), this rank's positions -> (s, b, h), all-gathered ((p-1)/p
    s b h elements sent). backward: the (s, b, h) gradient is a partial sum over this rank's
    features: reduce-scatter it to (s/p, b, h), (p-1)/p s b h elements.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        return tp.all_gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.reduce_scatter(grad), None


# exercise sp-conversions (continued)
class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's exit from a parallel region, replacing g.

    forward(x, tp): x (s, b, h) partial sums -> (s/p, b, h), summed, this rank's positions
    (reduce-scatter, (p-1)/p s b h elements). backward: all-gather the gradient to (s, b, h).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        return tp.reduce_scatter(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.all_gather(grad), None


def gather_then_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       tp: TensorParallelGroup) -> torch.Tensor:
    """The simple entry: all-gather, then the matmul. Autograd saves the matmul's input, the
    GATHERED (s, b, h) activation, for the weight gradient: s b h per region, not s b h / p."""
    return F.linear(GatherFromSequenceParallel.apply(x, tp), weight, bias)


# exercise save-the-shard (4 points): Gather, matmul, and save only the shard (Megatron-LM)
# hint: save the shard and gather it again in backward; flatten X and dY to 2-D for dW.
class GatherLinearSaveShard(torch.autograd.Function):
    """The entry as Megatron-LM builds it: Y = AllGather(X_r) W^T + b, saving only X_r.

    forward(x, weight, bias, tp): x (s/p, b, h), weight (n, h), bias (n,) -> (s, b, n); saves
    x (s b h / p) instead of the gathered input (s b h). backward(dY (s, b, n)) gathers x
    again ((p-1)/p s b h more sent) for dW = dY^T X (n, h) and db = sum dY (n,), and
    reduce-scatters dX = dY W, a partial sum over this rank's n features, to (s/p, b, h):
    returns (dX_r, dW, db, None). Every collective through `tp` (counted).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                tp: TensorParallelGroup) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tp = tp
        return F.linear(tp.all_gather(x), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        full = ctx.tp.all_gather(x).reshape(-1, weight.shape[1])  # the re-gather
        grad_2d = grad.reshape(-1, weight.shape[0])
        grad_weight = (full.t() @ grad_2d).t()
        return ctx.tp.reduce_scatter(grad @ weight), grad_weight, grad_2d.sum(0), None


class SequenceParallelBlock(TensorParallelBlock):
    """`TensorParallelBlock` with the LayerNorms and residual stream on s/p positions.

    x (s/p, b, h), rows [r s/p, (r+1) s/p) of the sequence -> the same rows of the output. An
    all-gather enters each region and a reduce-scatter leaves it (the bytes of the all-reduces
    they replace). save_shard: save the QKV and up inputs as shards, gather again in backward.
    After backward (of the step's last micro-batch), call
    `all_reduce_sequence_parallel_grads(blocks)`.
    """

    def __init__(self, dense: nn.Module, tp: TensorParallelGroup, save_shard: bool = False):
        super().__init__(dense, tp, GatherLinearSaveShard.apply if save_shard else gather_then_linear,
                         ReduceScatterToSequenceParallel)


# exercise sp-conversions (continued)
def all_reduce_sequence_parallel_grads(blocks: TensorParallelBlock | list[TensorParallelBlock]) -> int:
    """The replicated parameters used on s/p positions (both LayerNorms, the row-parallel
    biases added after the reduce-scatter) have partial-sum gradients: sum each block's six
    h-vectors (ln1, ln2 weight and bias; o.bias, down.bias), of one block or of a list of
    blocks sharing one `tp`, with ONE `tp.all_reduce` of them all flattened (as Megatron-LM's
    finalize_model_grads does, once per optimizer step after the last micro-batch, over
    every layer); each .grad becomes its sum (same shape), every other gradient is left
    alone. Returns how many gradients were reduced (6 per block)."""
    blocks = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    replicated = [param for block in blocks for param in (
        block.ln1.weight, block.ln1.bias, block.ln2.weight, block.ln2.bias, block.o.bias,
        block.down.bias)]
    flat = blocks[0].tp.all_reduce(torch.cat([p.grad.reshape(-1) for p in replicated]))
    for param, summed in zip(replicated, flat.split([p.numel() for p in replicated])):
        param.grad = summed.view_as(param)
    return len(replicated)


# ============================================================================ 6. the cost model


def tp_bytes_per_block(seq: int, batch: int, hidden: int, world: int, itemsize: int,
                       sequence_parallel: bool, save_shard: bool = False) -> int:
    """Activation bytes one rank sends for one block's forward + backward, per micro-batch,
    over lesson 01's rings.

    S = s b h x itemsize. Tensor parallel: 4 all-reduces of S, 4 x 2(p-1)/p x S. Sequence
    parallel: 4 all-gathers + 4 reduce-scatters of S, (p-1)/p x S each: the same bytes.
    save_shard (sequence parallel only): + 2 all-gathers of S in backward. The replicated
    gradients' all-reduce is not here: it runs once per step (`sp_grad_all_reduce_bytes`).
    """
    if save_shard and not sequence_parallel:
        raise ValueError("save_shard is a form of sequence parallelism")
    activation = collectives.ring_bytes_sent(seq * batch * hidden, itemsize, world, 0)
    return 4 * activation["all_reduce"] + (2 * activation["all_gather"] if save_shard else 0)


def sp_grad_all_reduce_bytes(hidden: int, world: int, itemsize: int, blocks: int = 1) -> int:
    """Bytes one rank sends summing sequence parallelism's replicated gradients: ONE all-reduce
    per optimizer step of the 6h vectors (2 LayerNorms' weight and bias, 2 row-parallel
    biases) of all `blocks` flattened together (Megatron-LM's finalize_model_grads), after
    the last micro-batch: 2(p-1)/p x 6 h blocks x itemsize, whatever the micro-batches."""
    return collectives.ring_bytes_sent(6 * hidden * blocks, itemsize, world, 0)["all_reduce"]


def saved_activation_bytes(seq: int, batch: int, hidden: int, heads: int, world: int,
                           itemsize: int, sequence_parallel: bool, save_shard: bool = False) -> int:
    """Bytes one rank's autograd graph saves for backward in one block (no parameters).

    In units of s b h elements: LayerNorm inputs 2, QKV and up inputs 2, Q K V 3, O's input 1,
    GeLU's input and output 8: 16 (Korthikanti et al.'s 34 bytes in 16-bit are these 32 plus
    two dropout masks). Not split by p: TP 4, SP keeping the gathered input 2, SP saving the
    shard 0; the rest is /p. Plus the softmax output a s^2 b / p, LayerNorm mean and 1/std
    4 s b (/p under SP) and the s x s boolean causal mask (1 byte each): naive attention's
    (flash attention saves neither, only a log-sum-exp per head and query).
    """
    sbh = seq * batch * hidden
    replicated = 4 if not sequence_parallel else 0 if save_shard else 2  # s b h units not split
    elements = replicated * sbh + (16 - replicated) * sbh // world
    elements += heads * seq * seq * batch // world
    elements += 4 * seq * batch // (world if sequence_parallel else 1)
    return elements * itemsize + seq * seq


def layernorm_activation_elements(seq: int, batch: int, hidden: int, world: int,
                                  sequence_parallel: bool) -> int:
    """Elements of the two LayerNorms' inputs one rank keeps for backward: s b h each without
    sequence parallelism, s b h / p with it."""
    return 2 * seq * batch * hidden // (world if sequence_parallel else 1)


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
