"""Lesson 05: pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules,
and a real pipeline over point-to-point messages.

The story, top to bottom (1-2 in schedules.py, the rest here):

1-2. Operations F (forward of a micro-batch on a stage), B (its backward; in zero-bubble
   schedules only the input gradient) and W (the weight gradient); schedules as per-device
   orders of them: GPipe, 1F1B, interleaved 1F1B (v chunks per device), ZB-H1.
3. A simulator: an op starts when its device is free and its inputs exist; it measures the
   bubble and the micro-batches each device holds.
4. The closed forms it must reproduce: bubble, peak in flight, and how the global batch sets
   the number of micro-batches.
5. A real pipeline: this rank is one stage and runs its order, sending activations forward and
   gradients back in groups that cannot deadlock under NCCL and match by order (no tags).

The proof is in checks.py: `python lessons/05_pipeline/main.py`, or the simulator alone:
`python lessons/05_pipeline/main.py --simulate --stages 4 --microbatches 8 --chunks 2`.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn

schedules = importlib.import_module("lessons.05_pipeline.schedules")  # 1-2: who runs what
# the schedules' names this file uses, and that later lessons import from here:
Op, SCHEDULES, schedule_order = schedules.Op, schedules.SCHEDULES, schedules.schedule_order
one_f_one_b_order, zb_h1_order = schedules.one_f_one_b_order, schedules.zb_h1_order

# ============================================================================ 3. the simulator


@dataclasses.dataclass
class Timeline:
    """Each device's executed ops as (op, start, end), and what follows from them."""

    stages: int
    chunks: int
    rows: list[list[tuple[Op, float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for row in self.rows for _, _, end in row)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all devices' time: 1 - busy / (devices x makespan)."""
        busy = sum(end - start for row in self.rows for _, start, end in row)
        return 1.0 - busy / (self.stages * self.makespan)

    def peak_inflight(self, device: int | None = None) -> float:
        """Max over time (and over devices, or on `device`) of the micro-batches whose
        activations are held: from a forward's start until the op that frees them (B, or W
        when backward is split). A chunk holds 1/v of a stage's activations."""
        peak = 0.0
        for row in self.rows if device is None else [self.rows[device]]:
            split = any(op.kind == "W" for op, _, _ in row)
            events = []
            for op, start, end in row:
                if op.kind == "F":
                    events.append((start, 1))
                elif op.kind == ("W" if split else "B"):
                    events.append((end, -1))
            held = 0
            for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
                held += delta
                peak = max(peak, held / self.chunks)
        return peak


# exercise simulator (4 points): The simulator: an op starts when its device is free and its inputs exist
# hint: sweep the devices, running each one's next op while its inputs are done; start = max(device
#   free, inputs' ends). A sweep in which no device moves is a deadlock.
def simulate(orders: list[list[Op]], chunks: int = 1, t_f: float = 1.0, t_b: float = 2.0,
             t_w: float = 0.0) -> Timeline:
    """Run every device's order: an op starts when its device is free and its inputs exist.
    Op (kind, i, c) on device d runs virtual stage c p + d (p = len(orders) devices, v =
    `chunks`). F needs F of the previous virtual stage (none on stage 0); B needs this stage's
    F and the next virtual stage's B (none on the last); W needs this stage's B. Durations
    are per chunk (1/v of a stage): F t_f / v, B t_b / v, W t_w / v (t_w = 0: backward not
    split). Communication is free. Each device runs its ops in its order, one at a time.
    Returns Timeline(p, v, rows), rows[d] = [(op, start, end), ...] in d's order. Raises
    ValueError("... deadlocks ...") if the orders deadlock (an op waits for one that never runs)."""
    stages = len(orders)
    virtual = stages * chunks
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    rows: list[list[tuple[Op, float, float]]] = [[] for _ in range(stages)]
    duration = {"F": t_f / chunks, "B": t_b / chunks, "W": t_w / chunks}
    while any(position[d] < len(orders[d]) for d in range(stages)):
        progressed = False
        for d in range(stages):
            while position[d] < len(orders[d]):
                op = orders[d][position[d]]
                vs = op.chunk * stages + d
                if op.kind == "F":
                    deps = [("F", vs - 1, op.microbatch)] if vs > 0 else []
                elif op.kind == "B":
                    deps = [("F", vs, op.microbatch)] + (
                        [("B", vs + 1, op.microbatch)] if vs < virtual - 1 else [])
                else:
                    deps = [("B", vs, op.microbatch)]
                if any(dep not in done for dep in deps):
                    break
                start = max([free[d]] + [done[dep] for dep in deps])
                end = start + duration[op.kind]
                done[(op.kind, vs, op.microbatch)] = end
                rows[d].append((op, start, end))
                free[d] = end
                position[d] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: an op waits for one that never runs")
    return Timeline(stages, chunks, rows)


def simulate_schedule(kind: str, stages: int, microbatches: int, chunks: int = 1,
                      group: int | None = None) -> Timeline:
    """A named schedule simulated with F = 1, B = 2 (ZB-H1: F = B = W = 1)."""
    if kind == "zb_h1":
        return simulate(zb_h1_order(stages, microbatches), 1, 1.0, 1.0, 1.0)
    return simulate(schedule_order(kind, stages, microbatches, chunks, group),
                    chunks if kind == "interleaved" else 1)


# ============================================================================ 4. the closed forms


# exercise closed-forms (3 points): Bubble and peak activations in closed form
# hint: the bubble is a share of the TOTAL time: idle / (ideal + idle), not idle / ideal.
def bubble_closed_form(kind: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Bubble as a share of total time (t_B = 2 t_F; for ZB-H1 t_F = t_B = t_W; balanced
    stages, free communication): GPipe and 1F1B (p-1)/(m+p-1); interleaved ((p-1)/v) /
    (m + (p-1)/v), i.e. Megatron's (1/v)(p-1)/m relative to the ideal time, whatever the
    micro-batch group Megatron's rules allow; ZB-H1 (p-1)/(3m + p-1), a third of 1F1B's bubble
    time (p-1)(t_F + t_B - t_W) instead of (p-1)(t_F + t_B + t_W). Unknown kind, or ZB-H1 with
    m < p (where the form does not hold): ValueError."""
    p, m, v = stages, microbatches, chunks
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind == "interleaved":
        return ((p - 1) / v) / (m + (p - 1) / v)
    if kind == "zb_h1":
        if m < p:
            raise ValueError("the ZB-H1 closed form assumes micro-batches >= stages")
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"unknown schedule {kind!r}")


# exercise closed-forms (continued)
def peak_inflight_closed_form(kind: str, stages: int, microbatches: int, chunks: int = 1,
                              device: int = 0, group: int | None = None) -> float:
    """Micro-batches' activations (in whole stages) device d holds at its peak.

    GPipe m. 1F1B min(p-d, m): d's warm-up forwards plus one. ZB-H1 min(p, m) on every
    device: W frees a micro-batch's memory, and W waits until the cap of p forces it (after
    B, a micro-batch holds only what W needs, less than what B needs). Interleaved with
    micro-batch groups of N (`group`, default p): the (p-d-1) x 2 + (v-1) x N warm-up chunk
    forwards plus one, each 1/v of a stage, so device 0 holds p + (p-1)/v at N = p (capped
    at the m v chunks there are, i.e. m). Unknown kind: ValueError."""
    p, m, v, d = stages, microbatches, chunks, device
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - d, m)
    if kind == "zb_h1":
        return min(p, m)
    if kind == "interleaved":
        n = p if group is None else group
        return min((p - d - 1) * 2 + (v - 1) * n + 1, m * v) / v
    raise ValueError(f"unknown schedule {kind!r}")


def microbatch_count(global_batch: int, data_parallel: int, micro_batch: int) -> int:
    """m = global batch / (data-parallel size x micro-batch size) (Megatron-LM's
    ConstantNumMicroBatchesCalculator, which asserts the division is exact): every
    data-parallel replica runs m micro-batches per step. A fixed global batch spread over more
    replicas leaves fewer micro-batches per pipeline, so a larger bubble (p-1)/(m+p-1)."""
    if global_batch % (data_parallel * micro_batch):
        raise ValueError(f"global batch {global_batch} is not a multiple of data parallel "
                         f"{data_parallel} x micro-batch {micro_batch}")
    return global_batch // (data_parallel * micro_batch)


# ============================================================================ 5. a real pipeline


def split_stage(layers: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    """Layers [stage L/p, (stage+1) L/p) of a model of L layers: what stage `stage` runs."""
    per = len(layers) // stages
    return nn.Sequential(*list(layers)[stage * per:(stage + 1) * per])


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One point-to-point message of a pipeline: `send` or not (receive), an "activation"
    (forward, to stage + 1) or a "gradient" (backward, to stage - 1), its micro-batch and the
    neighbouring stage it goes to or comes from."""

    send: bool
    kind: str
    microbatch: int
    peer: int


# exercise pipeline-step (5 points): A real pipeline stage: the message plan and the training step
# hint: post each send with the NEXT op's receive, in one batch_isend_irecv group. A received
#   activation must be a leaf that requires grad: its .grad is what goes back.
def p2p_plan(order: list[Op], stage: int, stages: int) -> list[tuple[list[Transfer], Op | None]]:
    """What `pipeline_step` posts, as one group, before each op of this stage's `order` (F and
    B ops, chunk 0), and a last group with no op.

    F on stage d > 0 receives activation i from d-1; B on d < p-1 receives gradient i from d+1.
    F on d < p-1 sends activation i to d+1; B on d > 0 sends gradient i to d-1. Each send is
    posted with the NEXT op's receive (Megatron-LM's send_forward_recv_backward): in 1F1B,
    stage d sends an activation to d+1 while d+1 sends a gradient to d, and under NCCL a send
    waits for its receive, so two lone sends would wait on each other forever. Messages carry
    no tags: forwards and backwards run in micro-batch order on every stage, so the k-th
    message on each link is the k-th the other side expects. Returns len(order) + 1 pairs
    (transfers, op), the sends of a group before its receive; the last op is None.
    """
    plan: list[tuple[list[Transfer], Op | None]] = []
    pending: list[Transfer] = []
    for op in order:
        receive = []
        if op.kind == "F" and stage > 0:
            receive = [Transfer(False, "activation", op.microbatch, stage - 1)]
        elif op.kind == "B" and stage < stages - 1:
            receive = [Transfer(False, "gradient", op.microbatch, stage + 1)]
        plan.append((pending + receive, op))
        if op.kind == "F":
            pending = [Transfer(True, "activation", op.microbatch, stage + 1)] if stage < stages - 1 else []
        else:
            pending = [Transfer(True, "gradient", op.microbatch, stage - 1)] if stage > 0 else []
    plan.append((pending, None))
    return plan


# exercise pipeline-step (continued)
def pipeline_step(module: nn.Module, order: list[Op], inputs: list[torch.Tensor] | None,
                  targets: list[torch.Tensor] | None, loss_fn: Callable, boundary_shape: tuple,
                  group: dist.ProcessGroup | None = None) -> dict:
    """One training step's forward and backward of this stage, following `order` (GPipe or
    1F1B: `schedule_order(kind, p, m)[stage]`), gradients accumulated in module's .grad.

    Stage = this rank's index in `group` (None: the default group), p = its size. `inputs`:
    the m micro-batches (stage 0 only); `targets`: their targets (last stage only); every
    activation between stages has `boundary_shape`, module's dtype and device. The last stage
    adds loss_fn(out, target) / m per micro-batch, so gradients equal those of the mean loss.
    Messages follow `p2p_plan`, each group posted with dist.batch_isend_irecv and waited on
    (under NCCL the group's first use must include every rank: run a collective first); an
    activation is sent detached, a gradient is d loss / d (this stage's input).
    Returns {"losses": per-micro-batch losses (last stage), "peak_held": the most
    micro-batches whose activations this stage held at once}.
    """
    stage, stages = dist.get_rank(group), dist.get_world_size(group)
    parameter = next(module.parameters())
    microbatches = sum(op.kind == "F" for op in order)
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    outgoing: dict[tuple[str, int], torch.Tensor] = {}
    losses, peak_held = [], 0
    for transfers, op in p2p_plan(order, stage, stages):
        received = None
        if transfers:
            p2p = []
            for t in transfers:
                if t.send:
                    tensor = outgoing.pop((t.kind, t.microbatch))
                else:
                    tensor = received = torch.empty(boundary_shape, dtype=parameter.dtype,
                                                    device=parameter.device)
                peer = t.peer if group is None else dist.get_global_rank(group, t.peer)
                p2p.append(dist.P2POp(dist.isend if t.send else dist.irecv, tensor, peer, group))
            for request in dist.batch_isend_irecv(p2p):
                request.wait()
        if op is None:
            break
        i = op.microbatch
        if op.kind == "F":
            x = inputs[i] if stage == 0 else received.requires_grad_()
            out = module(x)
            if stage == stages - 1:
                out = loss_fn(out, targets[i]) / microbatches
                losses.append(out.item() * microbatches)
            else:
                outgoing[("activation", i)] = out.detach()
            saved[i] = (x, out)
            peak_held = max(peak_held, len(saved))
        else:
            x, out = saved.pop(i)
            if stage == stages - 1:
                out.backward()  # the loss: d loss / d loss = 1
            else:
                out.backward(received)  # the next stage's gradient of our output
            if stage > 0:
                outgoing[("gradient", i)] = x.grad
    return {"losses": losses, "peak_held": peak_held}


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
