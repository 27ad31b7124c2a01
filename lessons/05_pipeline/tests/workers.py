"""Functions that lesson 05's tests run on spawned ranks (importable by their dotted name), and
the 1F1B order written out as its definition (the oracle other exercises' tests run on, so a
wrong `one_f_one_b_order` fails its own exercise and no other)."""

from __future__ import annotations

import importlib

import torch.distributed as dist

from lessons._launch import phase

M = importlib.import_module("lessons.05_pipeline.main")
S = importlib.import_module("lessons.05_pipeline.schedules")  # the orders main.py runs
C = importlib.import_module("lessons.05_pipeline.checks")


def expected_1f1b(stages: int, microbatches: int, device: int) -> list[tuple[str, int]]:
    """1F1B on `device`, as (kind, micro-batch) pairs: w = min(p-d-1, m) warm-up forwards, then
    F(w+k) B(k) for k < m - w, then the last w backwards."""
    w = min(stages - device - 1, microbatches)
    return ([("F", i) for i in range(w)]
            + [pair for k in range(microbatches - w) for pair in (("F", w + k), ("B", k))]
            + [("B", k) for k in range(microbatches - w, microbatches)])


def oracle_order(kind: str, stages: int, microbatches: int) -> list[list]:
    """Per-device orders of GPipe (given) or 1F1B (from `expected_1f1b`)."""
    if kind == "gpipe":
        return S.gpipe_order(stages, microbatches)
    return [[M.Op(k, i) for k, i in expected_1f1b(stages, microbatches, d)] for d in range(stages)]


def pipeline_checks(ctx, microbatches: int) -> dict:
    return C.pipeline_worker(ctx, 2, microbatches, None, 0)


def pipeline_step(ctx, microbatches: int) -> dict:
    """`pipeline_step` on GPipe's and 1F1B's orders (oracle orders) on the default group."""
    dist.barrier()
    return pipeline_step_body(microbatches, None, ctx.world_size)


def pipeline_step_body(microbatches: int, group, stages: int) -> dict:
    """`pipeline_step` on GPipe's and 1F1B's orders (oracle orders) on `group` (None: the
    default group) of `stages` ranks, against one process running the whole model: loss and
    every gradient gaps, micro-batches held per stage."""
    stage = dist.get_rank(group)
    reference = C.single_process_reference(2, microbatches)
    reference_grads = [g.detach().reshape(-1).tolist() for g in reference["grads"]]
    out = {}
    for kind in ("gpipe", "1f1b"):
        phase(f"pipeline_step, {kind}, {stages} stages, m = {microbatches}, "
              + ("the default group" if group is None else "the pipeline group {1, 2, 3} of 4"))
        module = M.split_stage(C.make_layers(2), stage, stages)
        x, y = C.pipeline_data(2, microbatches)
        order = oracle_order(kind, stages, microbatches)[stage]
        result = M.pipeline_step(module, order, list(x.chunk(microbatches)),
                                 list(y.chunk(microbatches)), C.microbatch_loss,
                                 (C.ROWS, C.WIDTH), group)
        shared: list = [None] * stages
        dist.all_gather_object(shared, ([p.grad.reshape(-1).tolist() for p in module.parameters()],
                                        result["losses"], result["peak_held"]), group=group)
        grads = [g for stage_grads, _, _ in shared for g in stage_grads]
        out[kind] = {"loss_gap": C.max_gap(shared[-1][1], reference["losses"]),
                     "grad_gap": C.max_gap(grads, reference_grads),
                     "held": [item[2] for item in shared]}
    return out


PIPELINE_GROUP = [1, 2, 3]  # a pipeline group that is not the world, in a world of 4


def pipeline_step_on_a_group(ctx, microbatches: int) -> dict | None:
    """`pipeline_step` on the pipeline group {1, 2, 3} of a 4-rank world (rank 0 idle): global
    rank 1 is stage 0, so the stage comes from the group and every peer's group rank must be
    mapped to its global rank. None on rank 0."""
    group = dist.new_group(PIPELINE_GROUP)  # every rank takes part in creating it
    out = None
    if ctx.rank in PIPELINE_GROUP:
        dist.barrier(group=group)
        out = pipeline_step_body(microbatches, group, len(PIPELINE_GROUP))
    dist.barrier()  # rank 0 waits for the group's step, so no rank exits early
    return out
