"""Lesson 05, part 1: pipeline schedules, as the order of work on each device.

A model of p stages is cut over p devices; a step's batch is cut into m micro-batches. A
schedule says, for every device, in which order it runs three kinds of operation (`Op`):
F, the forward of a micro-batch on its stage; B, its backward (in zero-bubble schedules only
the input gradient); W, the weight gradient. Simplest first, each buying something:

1. GPipe (`gpipe_order`): all forwards, then all backwards; holds all m micro-batches;
2. 1F1B (`one_f_one_b_order`, by `warmup_then_alternate`): start backwards as soon as
   possible; holds at most p micro-batches, with GPipe's bubble;
3. interleaved 1F1B (`interleaved_order`): v model chunks per device, a bubble v times smaller,
   micro-batches taken in groups of p (or of N, as Megatron-LM allows);
4. ZB-H1 (`zb_h1_order`): backward split into B and W, and W fills the bubble.

`schedule_order` names them. These are pure lists; main.py measures them (a simulator and
the closed forms) and runs one on real ranks.
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")

# ============================================================================ 1-2. schedules


@dataclasses.dataclass(frozen=True)
class Op:
    """One unit of work on one device: kind F, B (full backward, or input-gradient only when
    the schedule splits backward) or W (weight gradient), for a micro-batch and model chunk."""

    kind: str
    microbatch: int
    chunk: int = 0


def gpipe_order(stages: int, microbatches: int) -> list[list[Op]]:
    """Every device: F0 .. F(m-1), then B0 .. B(m-1). Holds all m micro-batches' activations."""
    return [[Op("F", i) for i in range(microbatches)] + [Op("B", i) for i in range(microbatches)]
            for _ in range(stages)]


# exercise one-f-one-b (3 points): The 1F1B order: warm-up, steady one-forward-one-backward, cool-down
# hint: after w warm-up forwards, the k-th backward comes right after forward w + k (while
#   one remains).
def warmup_then_alternate(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    """The 1F1B pattern: `warmup` forwards, then one forward and one backward in turn while
    forwards remain, then the remaining backwards: a new list F_0 .. F_(w-1), F_w B_0,
    F_(w+1) B_1, ..., then the backwards left. Every op once; forwards and backwards each
    keep their given order."""
    order = forwards[:warmup]
    for k, backward in enumerate(backwards):
        order += forwards[warmup + k:warmup + k + 1] + [backward]
    return order


# exercise one-f-one-b (continued)
def one_f_one_b_order(stages: int, microbatches: int) -> list[list[Op]]:
    """1F1B (PipeDream's one-forward-one-backward, flushed at the end of every step as in
    PipeDream-Flush, Narayanan et al. 2020): one list of 2m ops per device.

    Device d warms up with min(p-d-1, m) forwards, then F B F B ..., then drains: forwards
    and backwards each in micro-batch order (Op("F", i), Op("B", i), chunk 0). Device d holds
    at most min(p-d, m) micro-batches' activations (p on device 0) where GPipe holds m: the
    bubble is the same. The warm-up is a choice: the fewest forwards that keep GPipe's
    bubble (one fewer stalls the pipeline; one more only holds more).
    """
    forwards = [Op("F", i) for i in range(microbatches)]
    backwards = [Op("B", i) for i in range(microbatches)]
    return [warmup_then_alternate(forwards, backwards, min(stages - d - 1, microbatches))
            for d in range(stages)]


def interleaved_order(stages: int, microbatches: int, chunks: int,
                      group: int | None = None) -> list[list[Op]]:
    """Interleaved 1F1B (Narayanan et al. 2021): device d holds v = `chunks` model chunks
    (virtual stages d, d+p, d+2p, ...). Micro-batches go through the chunks in groups of N =
    `group` (default p; Megatron-LM's microbatch_group_size_per_vp_stage): micro-batches
    [g, g+N) run on chunk 0, then on chunk 1, ..., then the next group (the last group takes
    what is left); backwards take the chunks in reverse. Warm-up: (p-d-1) x 2 + (v-1) x N
    chunk forwards (as Megatron-LM's schedules.py), so device 0 holds (2(p-1) + (v-1) N + 1)/v
    stages' worth: p + (p-1)/v at N = p. Megatron's rules, each a ValueError: p <= N <= m,
    and m mod N is 0 or at least p (a shorter last group stalls the pipeline). At N = p: m a
    multiple of p."""
    n = stages if group is None else group
    if not stages <= n <= microbatches:
        raise ValueError(f"interleaved 1F1B needs a micro-batch group between the stages "
                         f"({stages}) and the micro-batches ({microbatches}), got {n}")
    if 0 < microbatches % n < stages:
        raise ValueError(f"interleaved 1F1B: micro-batches ({microbatches}) mod group ({n}) must "
                         f"be 0 or at least the stages ({stages}); with a group of p, a multiple "
                         "of stages")
    table = [(i, c) for start in range(0, microbatches, n)
             for c in range(chunks)
             for i in range(start, microbatches if start + n >= microbatches else start + n)]
    forwards = [Op("F", i, c) for i, c in table]
    backwards = [Op("B", i, chunks - 1 - c) for i, c in table]
    return [warmup_then_alternate(forwards, backwards,
                                  min((stages - d - 1) * 2 + (chunks - 1) * n, len(table)))
            for d in range(stages)]


def zb_h1_order(stages: int, microbatches: int, t_f: float = 1, t_b: float = 1,
                t_w: float = 1, max_inflight: int | None = None) -> list[list[Op]]:
    """ZB-H1 (Qi et al. 2023): backward split into B (input gradient, on the critical path)
    and W (weight gradient, which nothing downstream waits for). Each device keeps 1F1B's
    order of F and B; a pending W runs when it fits in an idle gap without delaying the next
    F or B, or when starting another F would hold more than `max_inflight` micro-batches
    (default p, 1F1B's peak on device 0), delaying that F, or at the end. So every device
    holds min(p, m) micro-batches at its peak. Built by simulating that rule with durations
    t_f, t_b, t_w. (Raising max_inflight alone does not give ZB-H2: its F/B order differs.)"""
    cap = stages if max_inflight is None else max_inflight
    base = [[(op.kind, op.microbatch) for op in order]
            for order in one_f_one_b_order(stages, microbatches)]
    duration = {"F": t_f, "B": t_b, "W": t_w}
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    pending_w: list[list[int]] = [[] for _ in range(stages)]
    started_f, finished_w = [0] * stages, [0] * stages
    orders: list[list[Op]] = [[] for _ in range(stages)]
    for _ in range(3 * stages * microbatches):
        best = None  # (start, device, kind, microbatch)
        for d in range(stages):
            ready = None
            if position[d] < len(base[d]):
                kind, i = base[d][position[d]]
                if kind == "F":
                    deps = [("F", d - 1, i)] if d > 0 else []
                else:
                    deps = [("F", d, i)] + ([("B", d + 1, i)] if d < stages - 1 else [])
                if all(dep in done for dep in deps):
                    ready = max([free[d]] + [done[dep] for dep in deps])
            over_memory = (position[d] < len(base[d]) and base[d][position[d]][0] == "F"
                           and started_f[d] - finished_w[d] >= cap)
            gap_fits = ready is None or free[d] + t_w <= ready
            if pending_w[d] and (over_memory or gap_fits):
                candidate = (free[d], d, "W", pending_w[d][0])
            elif ready is not None:
                candidate = (ready, d, *base[d][position[d]])
            else:
                continue
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            raise ValueError("zb_h1_order: 1F1B's order deadlocks (no device can run its next op)")
        start, d, kind, i = best
        free[d] = start + duration[kind]
        done[(kind, d, i)] = free[d]
        orders[d].append(Op(kind, i))
        if kind == "W":
            pending_w[d].pop(0)
            finished_w[d] += 1
        else:
            position[d] += 1
            if kind == "F":
                started_f[d] += 1
            else:
                pending_w[d].append(i)
    return orders


def schedule_order(kind: str, stages: int, microbatches: int, chunks: int = 1,
                   group: int | None = None) -> list[list[Op]]:
    """The per-device order of a named schedule: one list of ops per device (`group`: the
    interleaved schedule's micro-batch group)."""
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError("stages, micro-batches and chunks must be >= 1")
    if kind == "gpipe":
        return gpipe_order(stages, microbatches)
    if kind == "1f1b":
        return one_f_one_b_order(stages, microbatches)
    if kind == "interleaved":
        return interleaved_order(stages, microbatches, chunks, group)
    if kind == "zb_h1":
        return zb_h1_order(stages, microbatches)
    raise ValueError(f"unknown schedule {kind!r}; use one of {SCHEDULES}")
