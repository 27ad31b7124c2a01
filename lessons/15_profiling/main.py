"""Lesson 15: profiling: where a distributed step's time goes, read from traces.

Every earlier lesson timed itself with its own clocks. Practitioners ask the profiler instead:
it records every operator, every collective and (on a GPU) every kernel of a few steps, on
every rank, into a trace that a viewer draws and a program can read. main.py, top to bottom:

1. Record: `profile_steps` runs a step function under torch.profiler with a schedule and
   writes this rank's Chrome trace; `annotate_phases` marks forward, backward and the
   optimizer step with record_function ranges from hooks, so a loop we did not write (the
   capstone's) is annotated without editing it.
2. Read: `load_trace` keeps the trace's complete ("X") events; `rank_timeline` turns them
   into one rank's intervals: compute, communication, the steps, the phases and the
   collectives it entered (the interval arithmetic is `merge_intervals` and its friends).
3. Measure, from the trace alone: `overlap_fraction` (the share of communication hidden
   behind compute), `exposed_communication` per step (what the step waited for), and
   `rank_gaps` (who waited for whom at each collective).

utilisation.py counts the FLOPs (FlopCounterMode against 6N + attention, recomputation) and
divides them by the right peak (the datasheet's for the dtype, or a measured achievable one);
roofline.py says which operations are memory-bound. The proof (lesson 02's DDP and the
capstone traced, checked against their own timers), the communication benchmark and the CLI
are in checks.py and bench.py. Run: `python lessons/15_profiling/main.py`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile, schedule

PHASES = ("forward", "backward", "optimizer")
Interval = tuple[float, float]  # (start, end) in seconds, start <= end

# ============================================================================ 1. record


def profile_steps(step: Callable[[int], None], steps: int, trace_path: Path, warmup: int = 1,
                  cuda: bool = False) -> Path:
    """Run `step(i)` for i = 0 .. warmup + steps - 1 under torch.profiler and write the trace of
    the last `steps` (this rank's) to `trace_path`, Chrome's JSON trace format.

    schedule(wait=0, warmup=warmup, active=steps): the first calls run with the profiler
    warming up (its first events are slow and are thrown away), the next `steps` are recorded,
    each inside a "ProfilerStep#i" range (`prof.step()` marks the boundaries). Activities: the
    CPU's operators (and the gloo threads' collectives); with `cuda`, CUDA kernels and memcpys
    too (CUPTI), on the GPU's own clock aligned to the host's: `step` must end with
    torch.cuda.synchronize() so that its kernels fall inside its ProfilerStep range.
    Cost: a few microseconds per operator while recording, and the file (about 0.5 KB per event)."""
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=steps),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path))) as prof:
        for index in range(warmup + steps):
            step(index)
            prof.step()
    return trace_path


@contextlib.contextmanager
def annotate_phases(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """While active, every forward of `model`, every backward through its output and every
    `optimizer.step()` run inside a record_function range named "forward", "backward" or
    "optimizer", set from hooks: the training loop itself is not edited.

    forward: a forward pre-hook opens the range, a forward hook closes it (and hooks the
    output). backward: a hook on the output's gradient opens it when backward reaches the model
    (the loss before it is not counted) and an autograd-engine callback queued there closes it
    when the engine finishes; DDP's own end-of-backward work (waiting for its all-reduces) is
    queued later, so it falls after the range, in no phase: exposed communication shows as a
    gap. optimizer: step pre- and post-hooks. Ranges open and close on one thread (the engine
    runs a CPU backward on the calling thread, a CUDA one on its device thread, hook and
    callback alike). Cost: a few microseconds per range."""
    open_ranges: dict[str, record_function] = {}

    def begin(name: str) -> None:
        if name not in open_ranges:  # a nested call (a micro-batch inside a range) opens nothing
            open_ranges[name] = record_function(name).__enter__()

    def end(name: str) -> None:
        if name in open_ranges:
            open_ranges.pop(name).__exit__(None, None, None)

    def on_output_grad(grad: torch.Tensor) -> None:
        if "backward" not in open_ranges:
            begin("backward")
            torch.autograd.Variable._execution_engine.queue_callback(lambda: end("backward"))

    def after_forward(module, args, output) -> None:
        end("forward")
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(on_output_grad)

    handles = [model.register_forward_pre_hook(lambda module, args: begin("forward")),
               model.register_forward_hook(after_forward)]
    if optimizer is not None:
        handles += [optimizer.register_step_pre_hook(lambda *args: begin("optimizer")),
                    optimizer.register_step_post_hook(lambda *args: end("optimizer"))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for name in list(open_ranges):
            end(name)


# ============================================================================ 2. read


def load_trace(path: Path) -> list[dict]:
    """The complete events of a Chrome trace, sorted by start: [{"name", "cat", "ph": "X",
    "ts" (start, microseconds), "dur" (microseconds), "pid", "tid", "args"}]. Other phases
    (metadata "M", flows "s"/"f", instants "i") are dropped. A file torch.profiler wrote holds
    {"traceEvents": [...], ...}; a bare list of events is read too."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return sorted((e for e in events if e.get("ph") == "X"), key=lambda e: (e["ts"], -e.get("dur", 0)))


# exercise read-the-trace (4 points): One rank's trace as intervals of compute and communication
# hint: merge after sorting by start; a GPU trace has "kernel" events (nccl in the name:
#   communication); a CPU trace's compute is the main thread's cpu_op events and the phase
#   ranges minus the c10d:: calls, its communication the gloo: events on gloo's own threads.
def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals: overlapping or touching ones
    ([1, 3] and [3, 4]) become one, empty ones (start == end) vanish, nested ones are absorbed.
    merge_intervals([(5, 6), (1, 3), (2, 4)]) == [(1, 4), (5, 6)]. Cost: a sort, O(n log n)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect_intervals(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a AND b, for two merged (sorted, disjoint) lists: a merged list. A sweep, O(|a| + |b|)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract_intervals(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a AND NOT b, for two merged lists: the parts of a that b does not cover, merged."""
    out = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
        if start < end:
            out.append((start, end))
    return out


def total(intervals: list[Interval]) -> float:
    """The summed length of merged intervals (seconds)."""
    return sum(end - start for start, end in intervals)


COMMUNICATION_OPS = ("c10d::", "nccl:", "gloo:")  # the names torch gives collectives


# exercise read-the-trace (continued)
def rank_timeline(events: list[dict]) -> dict:
    """One rank's trace (`load_trace`) as intervals in seconds (ts / 1e6, (ts + dur) / 1e6):
    {"compute": merged, "comm": merged, "steps": [(start, end)] of the "ProfilerStep#" ranges
    in order, "phases": {name: [(start, end)] in order} for the record_function ranges named
    in PHASES, "collectives": [(name, start, end)] of the cpu_op events whose name starts with
    "c10d::", on any thread, in order of start (each time this rank entered a collective: on a
    GPU, DDP's hooks call theirs from autograd's device thread, not the main one)}. Ranges
    are the host's, cat "user_annotation" (on a GPU the profiler also copies each range that
    launched kernels onto the GPU's timeline, cat "gpu_user_annotation": not counted twice).

    A GPU trace (some event has cat "kernel"): comm = the kernels whose name contains "nccl"
    (any case), compute = the other kernels (HTA's rule). A CPU trace: the main thread is the
    (pid, tid) of the ProfilerStep events (without any: the thread with the most cpu_op
    events); compute = the union of its cpu_op events and the phase ranges (Python between
    two operators of a phase is the step's work too; on a CPU the main thread is the device),
    MINUS the time inside its c10d:: calls (a blocking collective is waiting, not computing,
    even nested in another op); comm = the events whose name starts with "gloo:" (gloo runs
    collectives on threads of its own).
    Cost: O(n log n) in the events."""
    def span(event: dict) -> Interval:
        return event["ts"] / 1e6, (event["ts"] + event.get("dur", 0)) / 1e6

    ranges = [e for e in events if e.get("cat") == "user_annotation"]  # host side, not GPU copies
    steps = [span(e) for e in ranges if e["name"].startswith("ProfilerStep#")]
    phases = {name: [span(e) for e in ranges if e["name"] == name] for name in PHASES}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    threads = [(e["pid"], e["tid"]) for e in ranges if e["name"].startswith("ProfilerStep#")]
    if not threads:
        counts: dict[tuple, int] = {}
        for e in events:
            if e.get("cat") == "cpu_op":
                counts[(e["pid"], e["tid"])] = counts.get((e["pid"], e["tid"]), 0) + 1
        threads = [max(counts, key=counts.get)] if counts else [None]
    main = [e for e in events if (e["pid"], e["tid"]) == threads[0] and e.get("cat") == "cpu_op"]
    calls = [e for e in main if e["name"].startswith("c10d::")]
    if kernels:
        comm = merge_intervals(span(e) for e in kernels if "nccl" in e["name"].lower())
        compute = merge_intervals(span(e) for e in kernels if "nccl" not in e["name"].lower())
    else:
        comm = merge_intervals(span(e) for e in events if e["name"].startswith("gloo:"))
        busy = [span(e) for e in main if e not in calls] + [s for v in phases.values() for s in v]
        compute = subtract_intervals(merge_intervals(busy), merge_intervals(span(e) for e in calls))
    entered = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::")),
                     key=lambda e: e["ts"])
    return {"compute": compute, "comm": comm, "steps": steps, "phases": phases,
            "collectives": [(e["name"], *span(e)) for e in entered]}


# ============================================================================ 3. measure


# exercise overlap (4 points): How much communication hid behind compute, and what each step waited for
# hint: both are interval arithmetic on the timeline: intersect_intervals, subtract_intervals
#   and total; a step's window is one interval.
def overlap_fraction(comm: list[Interval], compute: list[Interval]) -> float | None:
    """The share of communication time during which compute ran too (HTA's
    communication-computation overlap): |comm AND compute| / |comm|, both merged lists; 1.0
    when every collective ran under compute, 0.0 when none did; None when there is no
    communication (nothing to hide). A number in [0, 1]."""
    busy = total(comm)
    return total(intersect_intervals(comm, compute)) / busy if busy > 0 else None


# exercise overlap (continued)
def exposed_communication(timeline: dict) -> list[float]:
    """Per step of `timeline` (`rank_timeline`), in order: the seconds inside the step's
    window during which communication was in flight and no compute ran,
    |(comm AND NOT compute) AND step|: what overlap did not hide, the time a perfect overlap
    would save. A list of floats, one per step ([] without steps)."""
    exposed = subtract_intervals(timeline["comm"], timeline["compute"])
    return [total(intersect_intervals(exposed, [window])) for window in timeline["steps"]]


# exercise rank-gaps (3 points): Who waited for whom at each collective
# hint: a collective completes only when its last member arrives: compare the START times
#   (when each rank entered); all ranks leave at about the same time.
def rank_gaps(collectives: dict[int, list[tuple[str, float, float]]]) -> dict:
    """Who waited for whom. `collectives`: global rank -> the collectives it entered, in order
    ((name, start, end) in seconds on one clock, as `rank_timeline` lists them), for ranks
    that issued the same sequence (one group; on a subgroup, its members only, keyed by their
    global ranks). A collective completes only when its last member arrives, so at collective
    k the rank that entered last is the one the others waited for, and each rank waited
    (last arrival - its own arrival).

    Returns {"waited_for": [the rank that entered last at each k; the lowest such rank on a
    tie], "gap_s": [last - first arrival at each k], "wait_s": {rank: the sum over k of its
    wait}}. Different counts or names at some k (the ranks did not issue the same
    collectives: a desynchronised run): ValueError naming the ranks. Cost: O(ranks x k)."""
    ranks = sorted(collectives)
    counts = {rank: len(collectives[rank]) for rank in ranks}
    if len(set(counts.values())) > 1:
        raise ValueError(f"ranks entered different numbers of collectives: {counts}")
    waited_for, gaps, wait = [], [], {rank: 0.0 for rank in ranks}
    for k in range(counts[ranks[0]] if ranks else 0):
        names = {rank: collectives[rank][k][0] for rank in ranks}
        if len(set(names.values())) > 1:
            raise ValueError(f"collective {k} differs between ranks: {names}")
        arrivals = {rank: collectives[rank][k][1] for rank in ranks}
        last = max(ranks, key=lambda rank: (arrivals[rank], -rank))
        waited_for.append(last)
        gaps.append(arrivals[last] - min(arrivals.values()))
        for rank in ranks:
            wait[rank] += arrivals[last] - arrivals[rank]
    return {"waited_for": waited_for, "gap_s": gaps, "wait_s": wait}


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
