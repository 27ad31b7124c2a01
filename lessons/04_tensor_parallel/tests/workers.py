"""Functions that lesson 04's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

import torch.distributed as dist

M = importlib.import_module("lessons.04_tensor_parallel.main")
C = importlib.import_module("lessons.04_tensor_parallel.checks")


def all_checks(ctx, seq: int, batch: int, hidden: int, heads: int) -> dict:
    """The demo's checks, and on 2 and 4 ranks what a test adds (one launch per world size)."""
    result = C.verify_worker(ctx, 3, seq, batch, hidden, heads, None, 0)
    if ctx.world_size == 2:
        result["gap_without_sp_all_reduce"] = sp_without_grad_all_reduce(ctx)
    if ctx.world_size == 4:
        result["sub_groups"] = [sub_groups(ctx, save_shard) for save_shard in (False, True)]
    return result


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


def saved_bytes(ctx, seq: int, batch: int, hidden: int, heads: int) -> dict:
    """Bytes saved for backward by each form, measured with saved-tensor hooks."""
    return {form: C.run_block(ctx, 3, seq, batch, hidden, heads, sp, shard)["saved"]
            for form, (_, sp, shard) in C.FORMS.items()}

