"""Functions that lesson 04's tests run on spawned ranks (importable by their dotted name).

One worker per exercise. Each tests its exercise alone: every other piece it needs is either
given (TensorParallelGroup, lesson 01's rings) or an oracle written here on torch.distributed's
own collectives, so a mistake in one exercise fails that exercise's tests and no other's.
Tensors every rank needs for the expected values (another rank's input or gradient) are made
from seeds, never received from the code under test.

Each exercise's body runs on a `tp` it is given: on every world size, the default group over
lesson 01's rings (bytes counted); on 3 ranks also a tensor-parallel group that is not the
world, ranks {1, 2} over torch.distributed's collectives, where rank 0 idles and global rank 1
is tensor-parallel rank 0 (code that reads the global rank or communicates on the whole world
fails there). Its result is under "subgroup" (None on rank 0).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessons._launch import phase

M = importlib.import_module("lessons.04_tensor_parallel.main")
C = importlib.import_module("lessons.04_tensor_parallel.checks")
collectives = importlib.import_module("lessons.01_collectives.main")


def gap(ours, expected) -> float:
    """max |ours - expected|; inf when the shapes differ or `ours` is missing."""
    if not isinstance(ours, torch.Tensor) or ours.shape != expected.shape:
        return float("inf")
    return float((ours.detach() - expected).abs().max()) if ours.numel() else 0.0


def per_rank(seed: int, world: int, *shape: int) -> list[torch.Tensor]:
    """One float64 tensor per rank, the same list on every rank (so each can check the others)."""
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1000 * r),
                        dtype=torch.float64) for r in range(world)]


def backward(y: torch.Tensor, grad: torch.Tensor) -> None:
    """Backpropagate `grad` into y, as a loss sum(y * grad): y.backward(grad) would import
    sympy on its first call (torch's shape checks), seconds per rank on a busy machine."""
    (y * grad).sum().backward()


def ring_bytes(numel: int, world: int, rank: int, kind: str) -> int:
    return collectives.ring_bytes_sent(numel, 8, world, rank)[kind]


SUBGROUP = [1, 2]  # the tensor-parallel group that is not the world, in a world of 3


def on_every_group(ctx, body) -> dict:
    """`body(tp)` on the default group (counted rings), and on 3 ranks again on the group
    {1, 2} over torch's collectives (rank 0 idle): {**world result, "subgroup": ...}."""
    name = getattr(body, "__name__", None) or getattr(getattr(body, "func", None), "__name__", "the exercise")
    phase(f"{name} on the default group of {ctx.world_size} (lesson 01's rings)")
    out = body(M.TensorParallelGroup.join())
    if ctx.world_size == 3:
        phase(f"{name} on the tensor-parallel group {{1, 2}} of 3 (torch's collectives)")
        group = dist.new_group(SUBGROUP)  # every rank takes part in creating it
        out["subgroup"] = body(M.TensorParallelGroup.join(group)) if ctx.rank in SUBGROUP else None
        dist.barrier()  # rank 0 waits for the group's work, so no rank exits early
    return out


def hand_worked(tp) -> dict:
    """Per-rank tensors whose rows differ, every expected value written out in the tests: rank
    r of p holds the partial sum (r + 1) [[1, 2], [3, 4], ..., [2p - 1, 2p]] (p rows; the sum
    over ranks is p(p+1)/2 times it, its mean (p+1)/2 times) and the row [r, 10 r]."""
    base = torch.arange(1.0, 2 * tp.size + 1, dtype=torch.float64).reshape(tp.size, 2)
    return {"partial": (tp.rank + 1) * base,
            "row": torch.tensor([[tp.rank, 10.0 * tp.rank]], dtype=torch.float64)}


def rows_list(t: torch.Tensor | None) -> list | None:
    return None if t is None else t.detach().tolist()


def all_checks(ctx, seq: int, batch: int, hidden: int, heads: int) -> dict:
    """The demo's checks, and on 2 and 4 ranks what a test adds (one launch per world size)."""
    result = C.verify_worker(ctx, 3, seq, batch, hidden, heads, None, 0)
    if ctx.world_size == 2:
        result["gap_without_sp_all_reduce"] = sp_without_grad_all_reduce(ctx)
    if ctx.world_size == 4:
        result["sub_groups"] = [sub_groups(ctx, save_shard) for save_shard in (False, True)]
    return result


# ============================================================================ exercise f-and-g


def f_and_g(ctx) -> dict:
    return on_every_group(ctx, f_and_g_body)


def f_and_g_body(tp) -> dict:
    """f on an input that is the same on every rank, g on one that differs; each backward fed
    a gradient that differs per rank (f) or is the same everywhere (g). Bytes per direction;
    inputs unchanged; the hand-worked case."""
    p, r = tp.size, tp.rank
    xs, grads = per_rank(1, p, 3, 2, 4), per_rank(2, p, 3, 2, 4)
    out = {}
    x = xs[0].clone().requires_grad_()
    y = M.CopyToTensorParallel.apply(x, tp)
    out["f_forward_bytes"] = tp.traffic.bytes_sent
    backward(y, grads[r])
    out["f_backward_bytes"] = tp.traffic.bytes_sent - out["f_forward_bytes"]
    out["f_out_gap"], out["f_grad_gap"] = gap(y, xs[0]), gap(x.grad, sum(grads))
    sent = tp.traffic.bytes_sent
    x = xs[r].clone().requires_grad_()
    y = M.ReduceFromTensorParallel.apply(x, tp)
    out["g_forward_bytes"] = tp.traffic.bytes_sent - sent
    out["g_input_gap"] = gap(x, xs[r])  # the partial sum is not summed in place
    backward(y, grads[0])
    out["g_backward_bytes"] = tp.traffic.bytes_sent - sent - out["g_forward_bytes"]
    out["g_out_gap"], out["g_grad_gap"] = gap(y, sum(xs)), gap(x.grad, grads[0])
    out["all_reduce_bytes"] = ring_bytes(xs[0].numel(), p, r, "all_reduce")
    # by hand: f's backward and g's forward both sum (r + 1) [[1, 2], [3, 4]] over the ranks
    case = hand_worked(tp)
    x = torch.ones(p, 2, dtype=torch.float64, requires_grad=True)
    backward(M.CopyToTensorParallel.apply(x, tp), case["partial"])
    out["hand_f_grad"] = rows_list(x.grad)
    out["hand_g_out"] = rows_list(M.ReduceFromTensorParallel.apply(case["partial"], tp))
    if tp.group is not None:  # torch's collectives: nothing counted
        out = {key: value for key, value in out.items() if "bytes" not in key}
    return out


# ============================================================================ oracles


class OracleReduce(torch.autograd.Function):
    """g on torch's all_reduce; counts its forwards (one per row-parallel layer)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, tp):
        OracleReduce.calls += 1
        out = x.clone()
        dist.all_reduce(out, group=tp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class OracleCopy(torch.autograd.Function):
    """f on torch's all_reduce; counts its backwards (one per column-parallel layer)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        OracleCopy.calls += 1
        out = grad.clone()
        dist.all_reduce(out, group=ctx.tp.group)
        return out, None


def oracle_enter(x, weight, bias, tp):
    return F.linear(OracleCopy.apply(x, tp), weight, bias)


class OracleColumn(nn.Module):
    """A column-parallel layer on torch's collectives. No default `enter`: the block under test
    must pass its own to every column-parallel layer."""

    def __init__(self, dense, tp, enter=None):
        super().__init__()
        if enter is None:
            raise AssertionError("TensorParallelBlock built a column-parallel layer without passing "
                                 "its `enter` (ColumnParallelLinear(dense, tp, enter))")
        layers = [dense] if isinstance(dense, nn.Linear) else list(dense)
        self.weight = nn.Parameter(torch.cat([one.weight.detach().chunk(tp.size)[tp.rank]
                                              for one in layers]).clone())
        self.bias = nn.Parameter(torch.cat([one.bias.detach().chunk(tp.size)[tp.rank]
                                            for one in layers]).clone())
        self.tp, self.enter = tp, enter

    def forward(self, x):
        return self.enter(x, self.weight, self.bias, self.tp)


class OracleRow(nn.Module):
    """A row-parallel layer on torch's collectives. No default `leave`: the block under test
    must pass its own to every row-parallel layer."""

    def __init__(self, dense, tp, leave=None):
        super().__init__()
        if leave is None:
            raise AssertionError("TensorParallelBlock built a row-parallel layer without passing "
                                 "its `leave` (RowParallelLinear(dense, tp, leave))")
        self.weight = nn.Parameter(dense.weight.detach().chunk(tp.size, dim=1)[tp.rank].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone())
        self.tp, self.leave = tp, leave

    def forward(self, x):
        return self.leave.apply(F.linear(x, self.weight), self.tp) + self.bias


# ============================================================================ exercise parallel-linears


def parallel_linears(ctx) -> dict:
    return on_every_group(ctx, parallel_linears_body)


def parallel_linears_body(tp) -> dict:
    """Column- and row-parallel layers against nn.Linear, given an `enter` without f and g on
    torch's all_reduce (so only the layers are graded). Shapes, outputs, every gradient."""
    p, r = tp.size, tp.rank
    torch.manual_seed(5)
    column_dense, row_dense = nn.Linear(12, 24).double(), nn.Linear(24, 12).double()
    q, k, v = (nn.Linear(12, 12).double() for _ in range(3))
    x, dy = per_rank(3, 1, 5, 2, 12)[0], per_rank(4, 1, 5, 2, 24)[0]
    out: dict = {"enter_calls": 0}

    def plain_enter(x_in, weight, bias, group):  # no f: the input gradient is not graded here
        out["enter_calls"] += 1
        out["enter_got_tp"] = group is tp
        return F.linear(x_in, weight, bias)

    # column-parallel: rows [r 24/p, (r+1) 24/p) of the output features
    column = M.ColumnParallelLinear(column_dense, tp, plain_enter)
    features = slice(r * 24 // p, (r + 1) * 24 // p)
    y = column(x)
    out["column_enter_calls"], out["column_enter_got_tp"] = out["enter_calls"], out.pop("enter_got_tp")
    backward(y, dy[..., features])
    backward(column_dense(x), dy)
    out["column_shapes"] = [tuple(column.weight.shape), tuple(column.bias.shape)]
    out["column_out_gap"] = gap(y, column_dense(x).detach()[..., features])
    out["column_grad_gap"] = max(gap(column.weight.grad, column_dense.weight.grad[features]),
                                 gap(column.bias.grad, column_dense.bias.grad[features]))
    out["column_copies"] = column.weight.data_ptr() != column_dense.weight.data_ptr()
    # fused QKV: [q_r | k_r | v_r]
    fused = M.ColumnParallelLinear([q, k, v], tp, plain_enter)
    heads = slice(r * 12 // p, (r + 1) * 12 // p)
    expected = torch.cat([layer(x).detach()[..., heads] for layer in (q, k, v)], dim=-1)
    out["fused_out_gap"] = gap(fused(x), expected)
    out["fused_shapes"] = [tuple(fused.weight.shape), tuple(fused.bias.shape)]
    # row-parallel: input features [r 24/p, (r+1) 24/p), summed by an oracle g
    OracleReduce.calls = 0
    row = M.RowParallelLinear(row_dense, tp, OracleReduce)
    x_full, dy_row = per_rank(6, 1, 5, 2, 24)[0].requires_grad_(), per_rank(7, 1, 5, 2, 12)[0]
    x_local = x_full.detach()[..., features].clone().requires_grad_()
    y = row(x_local)
    out["leave_calls"] = OracleReduce.calls
    backward(y, dy_row)
    y_dense = row_dense(x_full)
    backward(y_dense, dy_row)
    out["row_shapes"] = [tuple(row.weight.shape), tuple(row.bias.shape)]
    out["row_out_gap"] = gap(y, y_dense.detach())
    out["row_grad_gap"] = max(gap(row.weight.grad, row_dense.weight.grad[:, features]),
                              gap(row.bias.grad, row_dense.bias.grad))
    out["row_input_grad_gap"] = gap(x_local.grad, x_full.grad[..., features])
    out["errors"] = []
    if p > 1:  # 2p + 1 features never divide over p > 1 ranks
        for make in (lambda: M.ColumnParallelLinear(nn.Linear(4, 2 * p + 1), tp, plain_enter),
                     lambda: M.RowParallelLinear(nn.Linear(2 * p + 1, 4), tp, OracleReduce)):
            try:
                make()
                out["errors"].append("accepted")
            except ValueError as exc:
                out["errors"].append(type(exc).__name__)
    return out


# ============================================================================ exercise tp-block


def tp_block(ctx, seq: int, batch: int, hidden: int, heads: int) -> dict:
    return on_every_group(ctx, functools.partial(tp_block_body, seq=seq, batch=batch, hidden=hidden,
                                                 heads=heads))


def tp_block_body(tp, *, seq: int, batch: int, hidden: int, heads: int) -> dict:
    """The block built on oracle layers, f and g (torch's all_reduce), against the dense block:
    output, every gradient, the input gradient, and one f and one g per region."""
    x = C.block_input(3, seq, batch, hidden, "cpu")
    y_ref, grads_ref = C.dense_reference(3, hidden, heads, x)
    OracleReduce.calls = OracleCopy.calls = 0
    dense = C.make_dense(3, hidden, heads)
    with mock.patch.object(M, "ColumnParallelLinear", OracleColumn), \
            mock.patch.object(M, "RowParallelLinear", OracleRow):
        block = M.TensorParallelBlock(dense, tp, oracle_enter, OracleReduce)
    dense_storages = {p.untyped_storage().data_ptr() for p in dense.parameters()}
    shared = sorted(name for name, p in block.named_parameters()
                    if p.untyped_storage().data_ptr() in dense_storages)
    local_x = x.clone().requires_grad_()
    y = block(local_x)
    reduces = OracleReduce.calls
    (y * C.loss_weights(x.shape)).sum().backward()
    grads = C.gather_gradients(block, tp.size, tp.group)
    return {"out_gap": gap(y, y_ref), "input_grad_gap": gap(local_x.grad, grads_ref["input"]),
            "grad_gaps": {name: gap(grads.get(name), grads_ref[name]) for name in grads_ref
                          if name != "input"},
            "parameters": sorted(name for name, _ in block.named_parameters()),
            "shared_with_dense": shared,
            "forward_reduces": reduces, "backward_copies": OracleCopy.calls}


# ============================================================================ exercise sp-conversions


@dataclasses.dataclass
class CountingGroup(M.TensorParallelGroup):
    """The lesson's group, counting its all-reduces."""

    all_reduces: int = 0

    def all_reduce(self, x):
        self.all_reduces += 1
        return super().all_reduce(x)


class FakeBlock(M.TensorParallelBlock):
    """What `all_reduce_sequence_parallel_grads` reads of a block (its replicated parameters,
    o.weight and tp), built without the exercise that builds blocks."""

    def __init__(self, tp, h: int):
        nn.Module.__init__(self)
        self.ln1, self.ln2 = nn.LayerNorm(h).double(), nn.LayerNorm(h).double()
        self.o, self.down = nn.Linear(h, h).double(), nn.Linear(4 * h, h).double()
        self.tp = tp


REPLICATED = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "o.bias", "down.bias"]


def sp_conversions(ctx) -> dict:
    return on_every_group(ctx, sp_conversions_body)


def sp_conversions_body(tp) -> dict:
    """The gather and the reduce-scatter along the sequence, forward and backward, against
    tensors every rank builds from seeds, and by hand; then the replicated gradients'
    all-reduce, of one block and of two blocks at once."""
    p, r = tp.size, tp.rank
    s, b, h = 2 * p, 2, 3
    rows = slice(r * s // p, (r + 1) * s // p)
    full = per_rank(1, 1, s, b, h)[0]
    grads = per_rank(2, p, s, b, h)
    out = {}
    x = full[rows].clone().requires_grad_()
    y = M.GatherFromSequenceParallel.apply(x, tp)
    out["gather_forward_bytes"] = tp.traffic.bytes_sent
    backward(y, grads[r])
    out["gather_backward_bytes"] = tp.traffic.bytes_sent - out["gather_forward_bytes"]
    out["gather_out_gap"], out["gather_grad_gap"] = gap(y, full), gap(x.grad, sum(grads)[rows])
    sent = tp.traffic.bytes_sent
    partials, local_grads = per_rank(3, p, s, b, h), per_rank(4, p, s // p, b, h)
    x = partials[r].clone().requires_grad_()
    y = M.ReduceScatterToSequenceParallel.apply(x, tp)
    out["scatter_forward_bytes"] = tp.traffic.bytes_sent - sent
    out["scatter_input_gap"] = gap(x, partials[r])  # the partial sums are not reduced in place
    backward(y, local_grads[r])
    out["scatter_backward_bytes"] = tp.traffic.bytes_sent - sent - out["scatter_forward_bytes"]
    out["scatter_out_gap"] = gap(y, sum(partials)[rows])
    out["scatter_grad_gap"] = gap(x.grad, torch.cat(local_grads))
    out["all_gather_bytes"] = ring_bytes(s * b * h, p, r, "all_gather")
    out["reduce_scatter_bytes"] = ring_bytes(s * b * h, p, r, "reduce_scatter")
    # by hand: rank r holds position r, the row [r, 10 r] (b = 1, h = 2); the gradients and
    # the partial sums are (r + 1) [[1, 2], [3, 4], ...] along the p positions
    case = hand_worked(tp)
    x = case["row"].unsqueeze(1).requires_grad_()  # (1, 1, 2)
    y = M.GatherFromSequenceParallel.apply(x, tp)
    out["hand_gather_out"] = rows_list(y.reshape(p, 2))
    backward(y, case["partial"].unsqueeze(1))
    out["hand_gather_grad"] = rows_list(x.grad.reshape(1, 2))
    out["hand_scatter_out"] = rows_list(
        M.ReduceScatterToSequenceParallel.apply(case["partial"].unsqueeze(1), tp).reshape(1, 2))
    # the six replicated gradients of one block, each rank's different; o.weight stays its own
    torch.manual_seed(0)
    group = CountingGroup(r, p, tp.group)
    blocks = [FakeBlock(group, h), FakeBlock(group, h)]
    values = {}
    for index, block in enumerate(blocks):
        for i, name in enumerate(REPLICATED + ["o.weight"]):
            layer, kind = name.split(".")
            param = getattr(getattr(block, layer), kind)
            values[index, name] = per_rank(10 + 10 * index + i, p, *param.shape)
            param.grad = values[index, name][r].clone()

    def grad_gaps(index):
        block = blocks[index]
        return {f"block {index} {name}": gap(getattr(getattr(block, name.split(".")[0]),
                                                     name.split(".")[1]).grad,
                                             sum(values[index, name])) for name in REPLICATED}

    out["reduced_count"] = M.all_reduce_sequence_parallel_grads(blocks[0])
    out["replicated_gaps"] = grad_gaps(0)
    out["other_gap"] = gap(blocks[0].o.weight.grad, values[0, "o.weight"][r])
    out["all_reduces"] = group.all_reduces
    for name in REPLICATED:  # again from each rank's own values: then both blocks at once
        layer, kind = name.split(".")
        getattr(getattr(blocks[0], layer), kind).grad = values[0, name][r].clone()
    group.all_reduces = 0
    out["reduced_count_two"] = M.all_reduce_sequence_parallel_grads(blocks)
    out["replicated_gaps_two"] = {**grad_gaps(0), **grad_gaps(1)}
    out["all_reduces_two"] = group.all_reduces
    if tp.group is not None:
        out = {key: value for key, value in out.items() if "bytes" not in key}
    return out


# ============================================================================ exercise save-the-shard


def save_the_shard(ctx) -> dict:
    return on_every_group(ctx, save_the_shard_body)


def save_the_shard_body(tp) -> dict:
    """GatherLinearSaveShard on this rank's rows, weights and output gradient, every rank's
    made from seeds: output, the three gradients, bytes saved and sent. What the graph keeps
    for backward is measured between forward and backward: the tensors saved for backward
    (a saved-tensor hook) and any tensor kept on the autograd context as an attribute."""
    p, r = tp.size, tp.rank
    s, b, h, n = 2 * p, 2, 4, 6
    rows = slice(r * s // p, (r + 1) * s // p)
    full = per_rank(1, 1, s, b, h)[0]
    weights, biases, grads = per_rank(2, p, n, h), per_rank(3, p, n), per_rank(4, p, s, b, n)
    x = full[rows].clone().requires_grad_()
    weight, bias = weights[r].clone().requires_grad_(), biases[r].clone().requires_grad_()
    with C.saved_tensor_bytes([weight, bias]) as saved:
        y = M.GatherLinearSaveShard.apply(x, weight, bias, tp)
    forward_bytes = tp.traffic.bytes_sent
    kept = dict(saved["storages"])  # storage -> bytes: saved for backward, or on the context
    kept.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in getattr(y.grad_fn, "__dict__", {}).values() if isinstance(t, torch.Tensor)
                 and t.untyped_storage().data_ptr() not in (weight.data_ptr(), bias.data_ptr())})
    backward(y, grads[r])
    input_grad = sum(g @ w for g, w in zip(grads, weights))[rows]
    out = {"out_gap": gap(y, F.linear(full, weights[r], biases[r])),
            "weight_grad_gap": gap(weight.grad, torch.einsum("sbn,sbh->nh", grads[r], full)),
            "bias_grad_gap": gap(bias.grad, grads[r].sum((0, 1))),
            "input_grad_gap": gap(x.grad, input_grad),
            "kept_bytes": sum(kept.values()), "shard_bytes": x.numel() * 8,
            "forward_bytes": forward_bytes, "backward_bytes": tp.traffic.bytes_sent - forward_bytes,
            "all_gather_bytes": ring_bytes(s * b * h, p, r, "all_gather"),
            "reduce_scatter_bytes": ring_bytes(s * b * h, p, r, "reduce_scatter")}
    if tp.group is not None:
        out = {key: value for key, value in out.items() if not key.endswith("_bytes")
               or key in ("kept_bytes", "shard_bytes")}
    return out


# ============================================================================ integration


def sp_without_grad_all_reduce(ctx) -> float:
    """Sequence parallel WITHOUT reducing the replicated gradients: LayerNorm grads are wrong."""
    x = C.block_input(4, 8, 2, 16, "cpu")
    _, grads = C.dense_reference(3, 16, 4, x)
    block = M.SequenceParallelBlock(C.make_dense(3, 16, 4), M.TensorParallelGroup.join())
    rows = slice(ctx.rank * 8 // ctx.world_size, (ctx.rank + 1) * 8 // ctx.world_size)
    y = block(x[rows].clone().requires_grad_())
    (y * C.loss_weights(x.shape)[rows]).sum().backward()
    return float((block.ln1.weight.grad - grads["ln1.weight"]).abs().max())


def sub_groups(ctx, save_shard: bool) -> dict:
    """Two tensor-parallel groups of 2 ranks in a world of 4 (a mesh's TP dimension), each on
    torch.distributed's collectives: every group's sequence-parallel block equals the dense one."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = M.TensorParallelGroup.join(groups[ctx.rank // 2])
    x = C.block_input(5, 8, 2, 16, "cpu")
    y_ref, grads_ref = C.dense_reference(3, 16, 4, x)
    block = M.SequenceParallelBlock(C.make_dense(3, 16, 4), tp, save_shard)
    rows = slice(tp.rank * 4, (tp.rank + 1) * 4)
    local_x = x[rows].clone().requires_grad_()
    y = block(local_x)
    (y * C.loss_weights(x.shape)[rows]).sum().backward()
    M.all_reduce_sequence_parallel_grads(block)
    ln_gap = float((block.ln1.weight.grad - grads_ref["ln1.weight"]).abs().max())
    return {"tp_rank": tp.rank, "tp_size": tp.size, "bytes_counted": tp.traffic.bytes_sent,
            "out_gap": float((y.detach() - y_ref[rows]).abs().max()),
            "input_grad_gap": float((local_x.grad - grads_ref["input"][rows]).abs().max()),
            "ln_grad_gap": ln_gap}
