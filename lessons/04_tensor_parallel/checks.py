"""Lesson 04's proof: the tensor-parallel and sequence-parallel blocks against the dense block.

On every rank: run the dense block (one process's answer) and the parallel block on the same
weights and input; reassemble the sharded gradients; compare the output, every gradient and
the input gradient; count the bytes sent (lesson 01's ring counter) and the bytes autograd
saves for backward (saved-tensor hooks), each against its formula in main.py. Then the CLI.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
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

from . import main as tensor_parallel

LESSON = "04_tensor_parallel"
# float64 on any device: the parallel block adds the same products as the dense one in another
# order (partial sums over ranks, other matmul blockings), ~1e-16 relative on values of O(10);
# a missing all-reduce or a wrong shard is off by O(1). TF32 never applies to float64.
TOLERANCE = 1e-10
FORMS = {  # metrics key -> (check label, sequence_parallel, save_shard)
    "tp": ("TP", False, False),
    "sp": ("TP + sequence parallel", True, False),
    "sp_shard_saved": ("TP + sequence parallel, shard saved", True, True),
}

# ============================================================================ references


class DenseBlock(nn.Module):
    """The model to split, and the reference: a pre-norm transformer block on (s, b, h),
    x + Attn(LN1 x), then + MLP(LN2 x). MLP = h -> 4h -> GeLU -> h; causal attention with
    `heads` heads (main.py's `causal_attention`)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.ln1(x)
        x = x + self.o(tensor_parallel.causal_attention(self.q(a), self.k(a), self.v(a), self.heads))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def make_dense(seed: int, hidden: int, heads: int,
               device: torch.device | str = "cpu") -> DenseBlock:
    """The dense block, float64, the same weights on every rank and device (built on CPU)."""
    torch.manual_seed(seed)
    return DenseBlock(hidden, heads).double().to(device)


def block_input(seed: int, seq: int, batch: int, hidden: int, device) -> torch.Tensor:
    return torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64).to(device)


def loss_weights(shape, device: torch.device | str = "cpu") -> torch.Tensor:
    """Fixed random weights so that every output element has a distinct gradient."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(99),
                       dtype=torch.float64).to(device)


def dense_reference(seed: int, hidden: int, heads: int, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Output and every parameter's gradient of the dense block for loss = sum(y * w)."""
    dense = make_dense(seed, hidden, heads, x.device)
    xr = x.clone().requires_grad_()
    y = dense(xr)
    (y * loss_weights(y.shape, x.device)).sum().backward()
    grads = {name: p.grad for name, p in dense.named_parameters()}
    grads["input"] = xr.grad
    return y.detach(), grads


@contextlib.contextmanager
def saved_tensor_bytes(exclude: list[torch.Tensor]):
    """Count the bytes autograd saves for backward inside the block: every distinct storage
    packed by a saved-tensor hook, except those of `exclude` (the parameters). Yields a dict
    whose "bytes" (and "storages", data pointer -> bytes) is filled in at exit. Views share
    their base's storage and count once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    result = {"bytes": 0, "storages": storages}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
    result["bytes"] = sum(storages.values())


def all_gather_cat(x: torch.Tensor, world: int, dim: int,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `x` (of `group`, world ranks) concatenated along `dim` (torch's
    all_gather: a check, not the lesson)."""
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def gather_gradients(block: tensor_parallel.TensorParallelBlock, world: int,
                     group: dist.ProcessGroup | None = None) -> dict:
    """The dense block's gradients rebuilt from this rank's shards: column-parallel weights and
    biases split by rows (QKV fused: rank r holds [q_r; k_r; v_r]), row-parallel weights by
    columns, the rest replicated. Keys are the dense block's parameter names."""
    grads = {}
    for name, param in block.named_parameters():
        layer, kind = name.split(".")
        if layer in ("o", "down") and kind == "weight":
            grads[name] = all_gather_cat(param.grad, world, 1, group)
        elif layer == "qkv":
            pieces = [piece.chunk(3) for piece in all_gather_cat(param.grad, world, 0, group).chunk(world)]
            for index, dense_name in enumerate("qkv"):
                grads[f"{dense_name}.{kind}"] = torch.cat([piece[index] for piece in pieces])
        elif layer == "up":
            grads[name] = all_gather_cat(param.grad, world, 0, group)
        else:
            grads[name] = param.grad
    return grads


# ============================================================================ the checks


def run_block(ctx: RankContext, seed: int, seq: int, batch: int, hidden: int, heads: int,
              sequence_parallel: bool, save_shard: bool) -> dict:
    """Forward and backward of the parallel block on this rank's part of the input. Returns
    the full output, the full gradients (dense names, and "input"), and what was counted."""
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    x = block_input(seed, seq, batch, hidden, device)
    tp = tensor_parallel.TensorParallelGroup.join()
    dense = make_dense(seed, hidden, heads, device)
    block = (tensor_parallel.SequenceParallelBlock(dense, tp, save_shard) if sequence_parallel
             else tensor_parallel.TensorParallelBlock(dense, tp))
    rows = slice(rank * seq // world, (rank + 1) * seq // world) if sequence_parallel else slice(None)
    local_x = x[rows].clone().requires_grad_()
    with saved_tensor_bytes(list(block.parameters())) as saved:
        y = block(local_x)
    forward_bytes = tp.traffic.bytes_sent
    (y * loss_weights(x.shape, device)[rows]).sum().backward()
    sent = tp.traffic.bytes_sent  # the activations' collectives, forward and backward
    if sequence_parallel:  # once per step (here the step's only micro-batch and block)
        tensor_parallel.all_reduce_sequence_parallel_grads(block)
    grad_sent = tp.traffic.bytes_sent - sent
    grads = gather_gradients(block, world)
    grads["input"] = all_gather_cat(local_x.grad, world, 0) if sequence_parallel else local_x.grad
    output = all_gather_cat(y.detach(), world, 0) if sequence_parallel else y.detach()
    return {"output": output, "grads": grads, "sent": sent, "forward_sent": forward_bytes,
            "grad_sent": grad_sent, "saved": saved["bytes"]}


def check_form(form: str, run: dict, reference: tuple, seq: int, batch: int, hidden: int,
               heads: int, world: int) -> list[Check]:
    """Output, gradients, bytes sent and bytes saved of one form against the dense block and
    the formulas."""
    label, sequence_parallel, save_shard = FORMS[form]
    y_ref, grads_ref = reference
    out_gap = max_abs_diff(run["output"], y_ref)
    grad_gap = max(max_abs_diff(run["grads"][name], grads_ref[name]) for name in grads_ref)
    sent = tensor_parallel.tp_bytes_per_block(seq, batch, hidden, world, 8, sequence_parallel,
                                              save_shard)
    saved = tensor_parallel.saved_activation_bytes(seq, batch, hidden, heads, world, 8,
                                                   sequence_parallel, save_shard)
    checks = [
        Check(f"{label}: output == dense block", out_gap <= TOLERANCE, f"max |diff| {out_gap:.1e}"),
        Check(f"{label}: every gradient (and dX) == dense block", grad_gap <= TOLERANCE,
              f"max |diff| {grad_gap:.1e} over {len(grads_ref)} tensors"),
        Check(f"{label}: activation bytes sent per block (fwd+bwd) == formula", run["sent"] == sent,
              f"{run['sent']} B counted ({run['forward_sent']} forward), {sent} B formula"),
        Check(f"{label}: bytes saved for backward == formula", run["saved"] == saved,
              f"{run['saved']} B saved, {saved} B formula"),
    ]
    if sequence_parallel:
        grad_sent = tensor_parallel.sp_grad_all_reduce_bytes(hidden, world, 8)
        checks.append(Check(f"{label}: replicated gradients' all-reduce (once per step) == formula",
                            run["grad_sent"] == grad_sent,
                            f"{run['grad_sent']} B counted, {grad_sent} B formula"))
    return checks


def verify_worker(ctx: RankContext, seed: int, seq: int, batch: int, hidden: int, heads: int,
                  fault: str | None, fault_rank: int) -> dict:
    """Every form of the block against the dense one on this rank; the two sequence-parallel
    forms against each other; a head count that does not divide."""
    inject_fault(ctx, fault, fault_rank)
    reference = dense_reference(seed, hidden, heads, block_input(seed, seq, batch, hidden, ctx.device))
    checks, metrics, runs = [], {}, {}
    for form, (_, sequence_parallel, save_shard) in FORMS.items():
        runs[form] = run_block(ctx, seed, seq, batch, hidden, heads, sequence_parallel, save_shard)
        checks += check_form(form, runs[form], reference, seq, batch, hidden, heads, ctx.world_size)
        metrics[form] = {"bytes": runs[form]["sent"], "forward_bytes": runs[form]["forward_sent"],
                         "grad_all_reduce_bytes": runs[form]["grad_sent"],
                         "saved_bytes": runs[form]["saved"]}
    kept, shard = runs["sp"], runs["sp_shard_saved"]
    same_out = torch.equal(kept["output"], shard["output"])
    grad_gap = max(max_abs_diff(kept["grads"][n], shard["grads"][n]) for n in kept["grads"])
    checks.append(Check("sequence parallel: shard saved == gathered input kept (output, gradients)",
                        same_out and grad_gap <= TOLERANCE,
                        f"outputs {'bit-identical' if same_out else 'DIFFER'}, "
                        f"gradients max |diff| {grad_gap:.1e}"))
    checks.append(heads_check(ctx, seed))
    return {"checks": [vars(c) for c in checks], "metrics": metrics,
            "device": ctx.device.type, "backend": ctx.backend}


def heads_check(ctx: RankContext, seed: int) -> Check:
    """A head count not divisible by the tensor-parallel size is refused, naming both."""
    if ctx.world_size == 1:
        return Check("heads not divisible by the TP size: clear error", True,
                     "1 rank: every head count divides (tested on p > 1)")
    bad_heads = ctx.world_size + 1  # world + 1 heads never divide over world ranks
    try:
        tensor_parallel.TensorParallelBlock(make_dense(seed, bad_heads * 2, bad_heads),
                                            tensor_parallel.TensorParallelGroup.join())
        message = "accepted"
    except ValueError as exc:
        message = str(exc)
    return Check(f"{bad_heads} heads on {ctx.world_size} ranks: clear error",
                 "must be divisible" in message, message)


# ============================================================================ the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Tensor and sequence parallelism from scratch, checked against the "
                           "dense block.")
    parser.add_argument("--seq", type=int_in(1, 4096), help="sequence length (default 8, or the "
                        "next multiple of the world size: sequence parallelism splits it)")
    parser.add_argument("--batch", type=int_in(1, 1024), default=2, help="batch (default 2)")
    parser.add_argument("--hidden", type=int_in(1, 8192), help="hidden size (default 16, or the "
                        "next multiple of --heads)")
    parser.add_argument("--heads", type=int_in(1, 256), help="attention heads (default 4, or the "
                        "next multiple of the world size)")
    args = parser.parse_args(argv)
    world = check_args(parser, args)

    def at_least(default: int, unit: int) -> int:  # the smallest multiple of unit >= default
        return unit * -(-default // unit)

    args.heads = at_least(4, world) if args.heads is None else args.heads
    args.seq = at_least(8, world) if args.seq is None else args.seq
    args.hidden = at_least(16, args.heads) if args.hidden is None else args.hidden
    if args.heads % world:
        parser.error(f"--heads {args.heads} is not divisible by the world size {world}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.seq % world:
        parser.error(f"--seq {args.seq} is not divisible by the world size {world} "
                     "(sequence parallelism splits it)")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results, checks = launch_checks(
        verify_worker, args, (args.seed, args.seq, args.batch, args.hidden, args.heads))
    metrics = dict(results[0]["metrics"])
    world = len(results)
    metrics["layernorm_activation_elements"] = {
        "tp": tensor_parallel.layernorm_activation_elements(args.seq, args.batch, args.hidden,
                                                            world, False),
        "sp": tensor_parallel.layernorm_activation_elements(args.seq, args.batch, args.hidden,
                                                            world, True)}
    block = metrics["tp"]["bytes"]
    grads = metrics["sp"]["grad_all_reduce_bytes"]
    metrics["headline"] = (f"activations per block and micro-batch: {block} B with TP, "
                           f"{metrics['sp']['bytes']} B with SP, "
                           f"{metrics['sp_shard_saved']['bytes']} B with SP saving the shard; "
                           f"SP's gradient all-reduce once per step: {grads} B"
                           + (f" ({grads / block:.1%} of one block's activations, only "
                              f"because s b = {args.seq * args.batch} is tiny)" if block else ""))
    report = Report(LESSON, results[0]["device"], results[0]["backend"], world, checks, metrics)
    return finish(report, args.json, started)
