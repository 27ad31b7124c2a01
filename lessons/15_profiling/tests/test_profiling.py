"""Lesson 15's suite. Real traces everywhere: lesson 02's BucketedDDP, blocking collectives with
a late rank, the capstone's own step and a benchmark, all profiled on spawned gloo ranks (3
ranks, and a subgroup {0, 2} of 3 where a group applies), read by main.py and compared with
an independent reference written here, with lesson 02's own timers, with an injected delay,
with FlopCounterMode and with the formulas.

Timing decides only the measured criteria, marked "Measured criterion" below (a threshold with
margin on a median of paired runs, the reference and the learner's code side by side); the
README gives how often each passed for the reference and failed for its planted bug over
repeated runs on a loaded 2-core machine. A criterion that needs a GPU is reported blocked
without one, never passed.

Learner mode: the classes tagged with `exercise(...)` grade one exercise each; the workers
return raw trace events (`load_trace`), so an unfinished `rank_timeline` fails only its own
exercise."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import shutil
import statistics
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from lessons._launch import launch, one_thread
from lessons._testing import assert_argument_error, exercise, launch_once, torchrun_demo

M = importlib.import_module("lessons.15_profiling.main")
U = importlib.import_module("lessons.15_profiling.utilisation")
R = importlib.import_module("lessons.15_profiling.roofline")
C = importlib.import_module("lessons.15_profiling.checks")
B = importlib.import_module("lessons.15_profiling.bench")
W = importlib.import_module("lessons.15_profiling.tests.workers")
README = (Path(M.__file__).with_name("README.md")).read_text()
SCRATCH = Path(tempfile.mkdtemp(prefix="lesson15-tests-"))  # every trace of this module; removed at the end
WORLD = 3
BENCH_SIZES = [1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]  # 4 KiB to 1 MiB
DELAY = 0.06  # the straggler's delay (s): large against a loaded machine's jitter (a few ms)


def tearDownModule():
    shutil.rmtree(SCRATCH, ignore_errors=True)


# ============================================================================ an independent reader


def event(name, ts, dur, cat="cpu_op", pid=1, tid=1):
    """A complete event as torch.profiler writes it (ts and dur in microseconds)."""
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": {}}


def covered(points: np.ndarray, intervals: list) -> np.ndarray:
    """For each point, whether some [start, end) holds it: the count of starts <= p minus the
    count of ends <= p is the number of intervals holding p (counting, no merging)."""
    if not intervals:
        return np.zeros(len(points), dtype=bool)
    spans = np.asarray(intervals, dtype=np.float64)
    starts, ends = np.sort(spans[:, 0]), np.sort(spans[:, 1])
    return (np.searchsorted(starts, points, side="right") - np.searchsorted(ends, points, side="right")) > 0


def segments(*interval_lists) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The elementary segments between all endpoints: (starts, ends, midpoints)."""
    edges = np.unique(np.asarray([t for intervals in interval_lists for span in intervals for t in span]
                                 or [0.0], dtype=np.float64))
    return edges[:-1], edges[1:], (edges[:-1] + edges[1:]) / 2


def as_intervals(starts: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> list:
    """Kept segments glued back into sorted disjoint intervals (adjacent ones share an edge)."""
    out: list = []
    for start, end, k in zip(starts.tolist(), ends.tolist(), keep):
        if not k:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def rebased(events: list[dict]) -> list[dict]:
    """The same trace with its clock starting near 0: seconds since boot (~1e6 s) leave only
    nanoseconds of float64 precision, which the comparisons below must not depend on."""
    origin = min(e["ts"] for e in events)
    return [{**e, "ts": e["ts"] - origin} for e in events]


def reference_timeline(events: list[dict]) -> dict:
    """This test's own reading of a CPU or GPU trace (point coverage, not interval merging)."""
    def span(e):
        return (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
    steps = [e for e in events
             if e["name"].startswith("ProfilerStep#") and e["cat"] == "user_annotation"]
    if steps:
        main = (steps[0]["pid"], steps[0]["tid"])
    else:
        counts: dict = {}
        for e in events:
            if e["cat"] == "cpu_op":
                counts[(e["pid"], e["tid"])] = counts.get((e["pid"], e["tid"]), 0) + 1
        main = max(counts, key=counts.get)
    on_main = [e for e in events if (e["pid"], e["tid"]) == main and e["cat"] == "cpu_op"]
    calls = [span(e) for e in on_main if e["name"].startswith("c10d::")]
    phases = {name: [span(e) for e in events if e["name"] == name and e["cat"] == "user_annotation"]
              for name in M.PHASES}
    kernels = [e for e in events if e["cat"] == "kernel"]
    if kernels:
        comm_raw = [span(e) for e in kernels if "nccl" in e["name"].lower()]
        busy, cut = [span(e) for e in kernels if "nccl" not in e["name"].lower()], []
    else:
        comm_raw = [span(e) for e in events if e["name"].startswith("gloo:")]
        busy = [span(e) for e in on_main if not e["name"].startswith("c10d::")]
        busy += [s for spans in phases.values() for s in spans]
        cut = calls
    starts, ends, mids = segments(comm_raw, busy, cut)
    return {"compute": as_intervals(starts, ends, covered(mids, busy) & ~covered(mids, cut)),
            "comm": as_intervals(starts, ends, covered(mids, comm_raw)),
            "steps": [span(e) for e in steps], "phases": phases,
            "collectives": [(e["name"], *span(e)) for e in sorted(events, key=lambda e: e["ts"])
                            if e["cat"] == "cpu_op" and e["name"].startswith("c10d::")]}


def reference_overlap(comm: list, compute: list) -> float | None:
    starts, ends, mids = segments(comm, compute)
    lengths, in_comm = ends - starts, covered(mids, comm)
    busy = float((lengths * in_comm).sum())
    return float((lengths * (in_comm & covered(mids, compute))).sum()) / busy if busy > 0 else None


def reference_exposed(timeline: dict) -> list[float]:
    starts, ends, mids = segments(timeline["comm"], timeline["compute"], timeline["steps"])
    lengths = ends - starts
    exposed = covered(mids, timeline["comm"]) & ~covered(mids, timeline["compute"])
    return [float((lengths * (exposed & covered(mids, [step]))).sum()) for step in timeline["steps"]]


def reference_gaps(collectives: dict) -> dict:
    ranks = sorted(collectives)
    starts = np.asarray([[c[1] for c in collectives[r]] for r in ranks])  # (ranks, k)
    last = [ranks[int(np.flatnonzero(column == column.max())[0])] for column in starts.T]
    return {"waited_for": last, "gap_s": list(starts.max(0) - starts.min(0)),
            "wait_s": {r: float((starts.max(0) - starts[i]).sum()) for i, r in enumerate(ranks)}}


def assert_intervals_equal(case: unittest.TestCase, ours: list, theirs: list, what: str) -> None:
    case.assertEqual(len(ours), len(theirs), f"{what}: {len(ours)} intervals, expected {len(theirs)} "
                                             f"(first ones: {ours[:3]} vs {theirs[:3]})")
    worst = max((max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(ours, theirs)), default=0.0)
    case.assertLess(worst, 1e-9, f"{what}: an interval is off by {worst:.3g} s")


# ============================================================================ shared real runs


@launch_once
def demo_runs() -> list[dict]:
    """3 ranks: lesson 02's DDP (bucket per layer vs one bucket, 3 pairs of 3 steps, width
    1024), 6 blocking all-reduces with rank 2 late by DELAY, the capstone's steps, lesson 04's
    TP MLP counted by FlopCounterMode: checks.demo_worker, the demo's own launch."""
    return launch(C.demo_worker, WORLD, (str(SCRATCH / "demo"), 1024, 3, 3, DELAY, None, 0),
                  device="cpu", timeout_s=600)


@launch_once
def subgroup_straggler() -> list:
    """The subgroup {0, 2} of 3 ranks, rank 0 late by DELAY, rank 1 idle (not a member)."""
    return launch(C.straggler_collectives, WORLD, (str(SCRATCH / "sub"), 6, DELAY, [0, 2], 0),
                  device="cpu", timeout_s=300)


@launch_once
def collective_traces() -> list[list[dict]]:
    return launch(W.traced_collectives, WORLD, (str(SCRATCH / "collectives"), 2), device="cpu",
                  timeout_s=300)


# ============================================================================ read-the-trace


CPU_TRACE = [  # main thread (pid 7, tid 1); gloo on tid 2; another thread tid 3 (not compute)
    event("ProfilerStep#1", 1_000, 9_000, cat="user_annotation", pid=7),
    event("forward", 1_000, 2_000, cat="user_annotation", pid=7),
    event("aten::mm", 1_100, 1_500, pid=7),
    event("backward", 3_500, 3_000, cat="user_annotation", pid=7),
    event("autograd::engine::evaluate_function: MmBackward0", 3_600, 2_400, pid=7),
    event("c10d::allreduce_", 4_000, 1_000, pid=7),  # a blocking call nested in an op: waiting
    event("gloo:all_reduce", 4_200, 4_000, cat="user_annotation", pid=7, tid=2),
    event("aten::copy_", 7_000, 500, pid=7),
    event("optimizer", 8_000, 1_000, cat="user_annotation", pid=7),
    event("aten::add_", 8_100, 800, pid=7),
    event("aten::mm", 2_000, 5_000, pid=7, tid=3),  # a helper thread: not the main thread
    event("ProfilerStep#2", 10_000, 5_000, cat="user_annotation", pid=7),
    event("c10d::allgather_", 10_500, 100, pid=7),
    event("gloo:all_gather", 10_550, 4_000, cat="user_annotation", pid=7, tid=2),
    event("aten::mm", 11_000, 1_000, pid=7),
]


@exercise("read-the-trace")
class TestMergeIntervals(unittest.TestCase):
    def test_overlapping_touching_nested_and_empty_intervals(self):
        cases = [([(5, 6), (1, 3), (2, 4)], [(1, 4), (5, 6)]),
                 ([(1, 3), (3, 4)], [(1, 4)]),  # touching
                 ([(0, 10), (2, 3), (4, 5)], [(0, 10)]),  # nested
                 ([(2, 2), (1, 1.5)], [(1, 1.5)]),  # an empty one vanishes
                 ([(0, 0), (1, 2), (3, 5)], [(1, 2), (3, 5)]),  # ... also first: the rest is read
                 ([], []),
                 ([(3, 4), (0, 1), (0.5, 2)], [(0, 2), (3, 4)])]
        for given, expected in cases:
            with self.subTest(given=given):
                self.assertEqual(M.merge_intervals(given), expected,
                                 f"merge_intervals({given}) should be {expected}")

    def test_a_generator_is_read_once(self):
        self.assertEqual(M.merge_intervals((s, s + 2) for s in (4, 0, 1)), [(0, 3), (4, 6)])


@exercise("read-the-trace")
class TestRankTimeline(unittest.TestCase):
    def test_a_hand_built_cpu_trace(self):
        t = M.rank_timeline(list(CPU_TRACE))
        assert_intervals_equal(self, t["steps"], [(0.001, 0.01), (0.01, 0.015)],
                               "ProfilerStep ranges, in seconds")
        self.assertEqual(sorted(t["phases"]), sorted(M.PHASES), "a list for every phase")
        for name, spans in {"forward": [(0.001, 0.003)], "backward": [(0.0035, 0.0065)],
                            "optimizer": [(0.008, 0.009)]}.items():
            assert_intervals_equal(self, t["phases"][name], spans, f"phase {name}")
        # busy: forward 1-3, backward 3.5-6.5 (its op 3.6-6.0 inside), copy 7-7.5, optimizer
        # 8-9, mm 11-12 (ms); minus the c10d calls 4-5 and 10.5-10.6 (not the helper thread)
        expected = [(0.001, 0.003), (0.0035, 0.004), (0.005, 0.0065), (0.007, 0.0075), (0.008, 0.009),
                    (0.011, 0.012)]
        assert_intervals_equal(self, t["compute"], expected, "compute")
        assert_intervals_equal(self, t["comm"], [(0.0042, 0.0082), (0.01055, 0.01455)], "comm")
        self.assertEqual([c[0] for c in t["collectives"]], ["c10d::allreduce_", "c10d::allgather_"])
        assert_intervals_equal(self, [c[1:] for c in t["collectives"]],
                               [(0.004, 0.005), (0.0105, 0.0106)], "collectives (start, end)")

    def test_b_without_profiler_steps_the_busiest_thread_is_the_main_one(self):
        events = [event("aten::mm", 0, 10, tid=5), event("aten::add", 20, 10, tid=5),
                  event("aten::mm", 0, 100, tid=6), event("c10d::broadcast_", 40, 5, tid=5)]
        t = M.rank_timeline(events)
        assert_intervals_equal(self, t["compute"], [(0.0, 1e-5), (2e-5, 3e-5)], "compute of tid 5")
        self.assertEqual([c[0] for c in t["collectives"]], ["c10d::broadcast_"])
        self.assertEqual((t["steps"], t["comm"]), ([], []), "no steps, no gloo events")

    def test_b_a_collective_entered_on_another_thread_counts(self):
        # a GPU trace: DDP's bucket hooks run on autograd's device thread (tid 2), not the main one
        events = [event("ProfilerStep#0", 0, 100, cat="user_annotation", tid=1),
                  event("c10d::allreduce_", 60, 5, tid=2), event("c10d::allreduce_", 30, 5, tid=2),
                  event("c10d::broadcast_", 10, 5, tid=1),
                  event("nccl:all_reduce", 31, 4, cat="user_annotation", tid=2),
                  event("ncclDevKernel_AllReduce_Sum_f32", 40, 10, cat="kernel", pid=0, tid=7)]
        t = M.rank_timeline(events)
        self.assertEqual([(c[0], c[1]) for c in t["collectives"]],
                         [("c10d::broadcast_", 1e-5), ("c10d::allreduce_", 3e-5), ("c10d::allreduce_", 6e-5)])
        self.assertEqual(t["collectives"], reference_timeline(events)["collectives"])

    def test_b_the_busiest_thread_even_when_another_comes_first(self):
        events = [event("aten::mm", 0, 100, tid=6), event("aten::mm", 5, 10, tid=5),
                  event("aten::add", 20, 10, tid=5), event("aten::relu", 40, 10, tid=5)]
        t = M.rank_timeline(events)
        assert_intervals_equal(self, t["compute"], [(5e-6, 1.5e-5), (2e-5, 3e-5), (4e-5, 5e-5)],
                               "compute of tid 5 (3 cpu_op events), not of tid 6 (1, seen first)")

    def test_b_the_profiler_step_thread_even_when_another_is_busier(self):
        events = [event("ProfilerStep#0", 0, 100, cat="user_annotation", tid=1),
                  event("aten::mm", 10, 20, tid=1),
                  *[event("aten::add", 5 + 20 * i, 10, tid=2) for i in range(3)]]  # a busier helper
        t = M.rank_timeline(events)
        assert_intervals_equal(self, t["compute"], [(1e-5, 3e-5)],
                               "compute of the ProfilerStep's thread (tid 1), not of tid 2 (3 cpu_op events)")

    def test_b_a_trace_of_kernels_alone(self):
        events = [event("sm90_gemm", 0, 10, cat="kernel", pid=0, tid=7),
                  event("ncclDevKernel_AllGather_RING_LL", 5, 20, cat="kernel", pid=0, tid=20)]
        t = M.rank_timeline(events)  # no ProfilerStep, no cpu_op: no main thread, no collectives
        assert_intervals_equal(self, t["compute"], [(0.0, 1e-5)], "compute = the gemm kernel")
        assert_intervals_equal(self, t["comm"], [(5e-6, 2.5e-5)], "comm = the nccl kernel")
        self.assertEqual((t["steps"], t["collectives"]), ([], []), "no steps, no c10d:: calls")

    def test_a_gpu_trace_reads_kernels(self):
        events = [event("ProfilerStep#3", 0, 1000, cat="user_annotation"),
                  event("ProfilerStep#3", 40, 900, cat="gpu_user_annotation", pid=0, tid=7),  # its GPU copy
                  event("backward", 50, 400, cat="user_annotation"),
                  event("backward", 60, 420, cat="gpu_user_annotation", pid=0, tid=7),
                  event("aten::mm", 10, 50),  # a launch on the host: not GPU compute
                  event("c10d::allreduce_", 100, 20),
                  event("ampere_sgemm_128x64", 60, 300, cat="kernel", pid=0, tid=7),
                  event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200, 500, cat="kernel", pid=0, tid=20),
                  event("NCCLKernel_Custom", 800, 100, cat="kernel", pid=0, tid=20),
                  event("Memcpy HtoD", 900, 50, cat="gpu_memcpy", pid=0, tid=7)]
        t = M.rank_timeline(events)
        assert_intervals_equal(self, t["compute"], [(6e-5, 3.6e-4)], "compute = non-nccl kernels")
        assert_intervals_equal(self, t["comm"], [(2e-4, 7e-4), (8e-4, 9e-4)],
                               "comm = nccl kernels, any case")
        self.assertEqual([c[0] for c in t["collectives"]], ["c10d::allreduce_"])
        assert_intervals_equal(self, t["steps"], [(0.0, 1e-3)], "the host's ProfilerStep, once")
        assert_intervals_equal(self, t["phases"]["backward"], [(5e-5, 4.5e-4)],
                               "the host's backward range, once")

    def test_c_real_traces_of_three_ranks_and_a_subgroup(self):
        per_rank = collective_traces()
        for rank, events in enumerate(map(rebased, per_rank)):
            ours, theirs = M.rank_timeline(events), reference_timeline(events)
            with self.subTest(rank=rank):
                for key in ("compute", "comm", "steps"):
                    assert_intervals_equal(self, ours[key], theirs[key], f"rank {rank} {key}")
                names = [c[0] for c in ours["collectives"]]
                self.assertEqual(names, [c[0] for c in theirs["collectives"]], f"rank {rank} collectives")
                expected = 2 * (2 if rank in (0, 2) else 1)  # 2 steps; rank 1 is not in {0, 2}
                self.assertEqual(len(names), expected, f"rank {rank}: collectives entered {names}")

    def test_d_real_ddp_traces_with_phases(self):
        runs = demo_runs()
        for rank, result in enumerate(runs):
            events = rebased(result["ddp"]["bucketed"][0]["events"])
            ours, theirs = M.rank_timeline(events), reference_timeline(events)
            with self.subTest(rank=rank):
                for key in ("compute", "comm", "steps"):
                    assert_intervals_equal(self, ours[key], theirs[key], f"rank {rank} {key}")
                for phase in M.PHASES:
                    assert_intervals_equal(self, ours["phases"][phase], theirs["phases"][phase],
                                           f"rank {rank} phase {phase}")


# ============================================================================ overlap


@exercise("overlap")
class TestOverlapByHand(unittest.TestCase):
    def test_overlap_fraction(self):
        cases = [([(0, 4)], [(1, 2), (3, 5)], 0.5),  # comm 0-4, compute over 1-2 and 3-4
                 ([(0, 1), (2, 5)], [(0, 3)], 2 / 4),
                 ([(0, 2)], [(5, 6)], 0.0),
                 ([(1, 2)], [(0, 3)], 1.0),
                 ([(0, 10)], [(0, 1)], 0.1)]  # rows that differ: over compute it would be 1.0
        for comm, compute, expected in cases:
            with self.subTest(comm=comm, compute=compute):
                got = M.overlap_fraction(comm, compute)
                self.assertIsNotNone(got, "there is communication: a number, not None")
                self.assertAlmostEqual(got, expected, delta=1e-12,
                                       msg=f"overlap_fraction({comm}, {compute}) = "
                                           "|comm AND compute| / |comm|")

    def test_no_communication_is_none(self):
        self.assertIsNone(M.overlap_fraction([], [(0, 1)]), "nothing to hide: None, not 0 or 1")

    def test_exposed_communication_per_step(self):
        timeline = {"steps": [(0.0, 10.0), (10.0, 20.0), (20.0, 25.0)],
                    "comm": [(2.0, 6.0), (9.0, 12.0), (14.0, 19.0)],
                    "compute": [(0.0, 3.0), (5.0, 8.0), (10.0, 15.0)]}
        # exposed: comm minus compute = 3-5, 9-10, 15-19; per step 2+1, 4, 0
        got = M.exposed_communication(timeline)
        self.assertEqual(len(got), 3, "one number per step")
        for index, (value, expected) in enumerate(zip(got, [3.0, 4.0, 0.0])):
            self.assertAlmostEqual(value, expected, delta=1e-12,
                                   msg=f"step {index}: |(comm - compute) AND step| should be "
                                       f"{expected}, got {got}")
        self.assertEqual(M.exposed_communication({**timeline, "steps": []}), [], "no steps: []")


@exercise("overlap")
class TestOverlapOnRealTraces(unittest.TestCase):
    """Measured criterion: the overlap the learner's `overlap_fraction` reads from real traces
    of lesson 02's BucketedDDP. With a bucket per layer the all-reduces start during backward;
    in one bucket, after it: per pair of runs (taking turns), the mean over the 3 ranks; the
    median over 3 pairs must gain at least checks.OVERLAP_MARGIN (0.15; measured ~0.3-0.5 on
    a loaded 2-core machine)."""

    @classmethod
    def setUpClass(cls):
        runs = demo_runs()
        cls.timelines = {name: [[reference_timeline(rebased(r["ddp"][name][p]["events"])) for r in runs]
                                for p in range(len(runs[0]["ddp"][name]))]
                         for name in ("bucketed", "one bucket")}

    def test_a_same_numbers_as_an_independent_reader(self):
        for name, pairs in self.timelines.items():
            for pair, ranks in enumerate(pairs):
                for rank, timeline in enumerate(ranks):
                    with self.subTest(variant=name, pair=pair, rank=rank):
                        ours = M.overlap_fraction(timeline["comm"], timeline["compute"])
                        theirs = reference_overlap(timeline["comm"], timeline["compute"])
                        self.assertAlmostEqual(ours, theirs, delta=1e-9, msg=f"{name} rank {rank}")
                        exposed = M.exposed_communication(timeline)
                        expected = reference_exposed(timeline)
                        self.assertEqual(len(exposed), len(expected), "one number per step")
                        for got, want in zip(exposed, expected):
                            self.assertAlmostEqual(got, want, delta=1e-9, msg=f"{name} rank {rank} exposed")

    def test_b_buckets_hide_communication_measured(self):
        overlap = {name: [statistics.mean(M.overlap_fraction(t["comm"], t["compute"]) for t in ranks)
                          for ranks in pairs] for name, pairs in self.timelines.items()}
        gains = [b - o for b, o in zip(overlap["bucketed"], overlap["one bucket"])]
        self.assertGreaterEqual(statistics.median(gains), C.OVERLAP_MARGIN,
                                f"overlap with a bucket per layer {overlap['bucketed']} vs one bucket "
                                f"{overlap['one bucket']} (per pair): the median gain should be >= "
                                f"{C.OVERLAP_MARGIN}")
        self.assertLess(statistics.median(overlap["one bucket"]), 0.2,
                        f"one bucket starts only after backward: overlap {overlap['one bucket']}")


# ============================================================================ rank gaps


@exercise("rank-gaps")
class TestRankGapsByHand(unittest.TestCase):
    def test_the_last_to_arrive_is_waited_for(self):
        collectives = {0: [("c10d::allreduce_", 1.0, 5.0), ("c10d::broadcast_", 10.0, 11.0)],
                       1: [("c10d::allreduce_", 4.0, 5.0), ("c10d::broadcast_", 7.0, 11.0)],
                       2: [("c10d::allreduce_", 2.0, 5.1), ("c10d::broadcast_", 9.0, 11.0)]}
        got = M.rank_gaps(collectives)
        self.assertEqual(got["waited_for"], [1, 0], "the latest START at each collective")
        self.assertEqual(len(got["gap_s"]), 2)
        for got_gap, expected in zip(got["gap_s"], [3.0, 3.0]):
            self.assertAlmostEqual(got_gap, expected, delta=1e-12,
                                   msg=f"last - first arrival: {got['gap_s']}")
        expected_wait = {0: 3.0 + 0.0, 1: 0.0 + 3.0, 2: 2.0 + 1.0}
        self.assertEqual(set(got["wait_s"]), {0, 1, 2}, "a wait for every rank")
        for rank, wait in expected_wait.items():
            self.assertAlmostEqual(got["wait_s"][rank], wait, delta=1e-12,
                                   msg=f"rank {rank}: sum of (last - own arrival): {got['wait_s']}")

    def test_a_tie_names_the_lowest_rank_and_a_subgroup_keeps_global_ranks(self):
        got = M.rank_gaps({2: [("c10d::allreduce_", 3.0, 4.0)], 0: [("c10d::allreduce_", 3.0, 4.0)]})
        self.assertEqual(got["waited_for"], [0], "a tie: the lowest rank")
        got = M.rank_gaps({0: [("a", 1.0, 2.0)], 2: [("a", 1.5, 2.0)]})
        self.assertEqual((got["waited_for"], sorted(got["wait_s"])), ([2], [0, 2]),
                         "members {0, 2}: named by their global ranks")

    def test_a_group_of_one_rank_waits_for_nobody(self):
        got = M.rank_gaps({1: [("c10d::allreduce_", 1.0, 2.0), ("c10d::barrier", 3.0, 3.5)]})
        self.assertEqual(got["waited_for"], [1, 1], "the only member is the last to arrive")
        self.assertEqual((got["gap_s"], got["wait_s"]), ([0.0, 0.0], {1: 0.0}),
                         "one rank: no gap, no wait")

    def test_different_collectives_are_refused(self):
        with self.assertRaisesRegex(ValueError, "numbers"):
            M.rank_gaps({0: [("a", 1.0, 2.0)], 1: []})
        with self.assertRaisesRegex(ValueError, "differs"):
            M.rank_gaps({0: [("a", 1.0, 2.0)], 1: [("b", 1.0, 2.0)]})
        self.assertEqual(M.rank_gaps({}), {"waited_for": [], "gap_s": [], "wait_s": {}})


@exercise("rank-gaps")
class TestRankGapsOnRealTraces(unittest.TestCase):
    """Measured criterion: a rank that sleeps DELAY (60 ms) before each of 6 blocking
    all-reduces is the one the others wait for in the majority of collectives, and the median
    gap is within [0.5, 5] x DELAY (a loaded machine adds its own delays, never removes one);
    on the world (3 ranks, rank 2 late) and on the subgroup
    {0, 2} (rank 0 late, rank 1 idle). Computed side by side with this test's own reading."""

    def check(self, per_rank: list, slow: int):
        collectives = {rank: reference_timeline(events)["collectives"]
                       for rank, events in enumerate(per_rank) if events is not None}
        got, expected = M.rank_gaps(collectives), reference_gaps(collectives)
        self.assertEqual(got["waited_for"], expected["waited_for"],
                         "the rank that entered last, per collective")
        for a, b in zip(got["gap_s"], expected["gap_s"]):
            self.assertAlmostEqual(a, b, delta=1e-9, msg=f"gaps {got['gap_s']} vs {expected['gap_s']}")
        named = got["waited_for"].count(slow)
        self.assertGreater(2 * named, len(got["waited_for"]),
                           f"rank {slow} is late by {DELAY * 1e3:.0f} ms: named {got['waited_for']}")
        gap = statistics.median(got["gap_s"])
        self.assertTrue(0.5 * DELAY <= gap <= 5 * DELAY,
                        f"median gap {gap * 1e3:.1f} ms for a delay of {DELAY * 1e3:.0f} ms")

    def test_on_three_ranks(self):
        self.check([r["straggler"] for r in demo_runs()], WORLD - 1)

    def test_on_a_subgroup(self):
        per_rank = subgroup_straggler()
        self.assertIsNone(per_rank[1], "rank 1 is not a member: it traced nothing")
        self.check(per_rank, 0)


# ============================================================================ utilisation


@exercise("utilisation")
class TestRecomputationFlops(unittest.TestCase):
    def count(self, recompute, early_stop=True, layers=3, hidden=12, heads=3, seq=6, batch=3, vocab=17):
        torch.manual_seed(0)
        model = U.flops.tiny_gpt.TinyGPT(vocab, hidden, heads, layers, seq, dropout=0.0, recompute=recompute)
        tokens = torch.randint(0, vocab, (batch, seq))
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            counted = U.count_flops(lambda: model.loss(tokens, tokens).backward())[0]
        return counted, model, (layers, hidden, seq), batch * seq

    def test_equals_flop_counter_mode_for_every_recomputation(self):
        for recompute, mode in ((False, "none"), (True, "full"), ("selective", "selective")):
            counted, model, (layers, hidden, seq), tokens = self.count(recompute)
            per_token = U.hardware_flops_per_token(U.weight_params(model),
                                                   U.weight_params(model, layers_only=True),
                                                   layers, hidden, seq, mode)
            with self.subTest(recompute=mode):
                self.assertIsInstance(per_token, int, "FLOPs per token is an int")
                self.assertEqual(per_token * tokens, counted,
                                 f"{mode}: FlopCounterMode counted {counted:,}, formula "
                                 f"{per_token * tokens:,}")

    def test_selective_replays_the_values_matmul_too_without_early_stop(self):
        counted, model, (layers, hidden, seq), tokens = self.count("selective", early_stop=False)
        per_token = U.hardware_flops_per_token(U.weight_params(model),
                                               U.weight_params(model, layers_only=True), layers,
                                               hidden, seq, "selective")
        self.assertEqual(counted - per_token * tokens, 2 * layers * hidden * seq * tokens,
                         "without early stop, p v is replayed too: 2 L h s more per token")

    def test_an_unknown_recomputation_is_refused(self):
        with self.assertRaisesRegex(ValueError, "recompute"):
            U.hardware_flops_per_token(10, 5, 1, 4, 4, "everything")


@exercise("utilisation")
class TestDatasheetPeak(unittest.TestCase):
    def test_dense_peaks_by_dtype(self):
        table = U.flops.DEVICE_PEAK_FLOPS
        for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe"):
            with self.subTest(device=name):
                self.assertEqual(U.peak_flops(name, "bfloat16"), table[name],
                                 "dense bf16 = lesson 13's table")
                self.assertEqual(U.peak_flops(name, "float16"), table[name], "fp16 runs at the bf16 rate")
                self.assertEqual(U.peak_flops(name, "tf32"), table[name] / 2, "TF32 at half the bf16 rate")
        self.assertEqual(U.peak_flops("NVIDIA H100 80GB HBM3", "float8"), 2 * 989e12, "FP8 on Hopper: twice")
        self.assertEqual(U.peak_flops("NVIDIA H200", "bfloat16"), 989e12)

    def test_unknown_devices_and_dtypes_are_refused_never_guessed(self):
        for device, dtype in (("NVIDIA L4", "bfloat16"), ("NVIDIA H100", "bfloat16"),
                              ("AMD Instinct MI350X", "bfloat16"), ("cpu", "float32"),
                              ("NVIDIA H100 80GB HBM3", "float32"), ("NVIDIA A100-SXM4-80GB", "float8"),
                              ("NVIDIA H100 80GB HBM3", "int8")):
            with self.subTest(device=device, dtype=dtype):
                with self.assertRaises(ValueError) as caught:
                    U.peak_flops(device, dtype)
                self.assertIn(device, str(caught.exception), "the error names the device")
                self.assertIn(dtype, str(caught.exception), "the error names the dtype")


def reference_mamf(shapes, iters=5, warmup=2) -> float:
    """This test's own measurement: best-of timings of torch.mm, 2 m n k FLOPs each."""
    best = 0.0
    for m, n, k in shapes:
        a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
        cache = torch.empty(32 << 18)
        times = []
        for _ in range(warmup + iters):
            cache.zero_()
            started = time.perf_counter()
            torch.mm(a, b, out=c)
            times.append(time.perf_counter() - started)
        best = max(best, 2 * m * n * k / min(times[warmup:]))
    return best


@exercise("utilisation")
class TestMatmulTiming(unittest.TestCase):
    @staticmethod
    def on_a_fake_clock(durations: list[float], m: int, n: int, k: int, iters: int) -> float:
        """matmul_flops_per_s(m, n, k, iters=iters, warmup=2), each call timed as the next duration."""
        clock = iter(t for d in durations for t in (0.0, d))
        with mock.patch.object(U.time, "perf_counter", lambda: next(clock)):
            return U.matmul_flops_per_s(m, n, k, iters=iters, warmup=2)

    def test_a_the_fastest_timed_call_after_the_warmup(self):
        # the 2 warm-up calls are the fastest (so counting them is caught), the timed ones 5, 3,
        # 4, 6, 9 ms
        got = self.on_a_fake_clock([0.001, 0.001, 0.005, 0.003, 0.004, 0.006, 0.009], 8, 6, 5, iters=5)
        self.assertAlmostEqual(got, 2 * 8 * 6 * 5 / 0.003, delta=1e-6,
                               msg="2 m n k FLOPs over the fastest timed call (3 ms)")

    def test_a_the_first_timed_call_can_be_the_fastest(self):
        got = self.on_a_fake_clock([0.001, 0.001, 0.002, 0.003, 0.004], 7, 3, 4, iters=3)  # 2 ms first
        self.assertAlmostEqual(got, 2 * 7 * 3 * 4 / 0.002, delta=1e-6,
                               msg="the first call after the warm-up (2 ms) is timed too")

    def test_a_each_timed_call_is_one_cold_matmul_into_c(self):
        """float64, 5 x 3 times 3 x 4: every one of the 2 + 3 calls is torch.mm(A, B, out=C) of
        the right shapes and dtype, timed by time_call on this device, after a buffer of at
        least 32 MiB was zeroed."""
        log, mm, zero = [], torch.mm, torch.Tensor.zero_

        def timed(fn, device):
            log.append(("timed", device))
            fn()
            return 0.5

        def recording_mm(a, b, *args, **kwargs):
            out = kwargs.get("out")
            log.append(("mm", tuple(a.shape), tuple(b.shape), a.dtype, b.dtype,
                        None if out is None else (tuple(out.shape), out.dtype)))
            return mm(a, b, *args, **kwargs)

        def recording_zero(tensor):
            log.append(("zero", tensor.numel() * tensor.element_size() >= 32 << 20))
            return zero(tensor)

        with mock.patch.object(U, "time_call", timed), mock.patch.object(U.torch, "mm", recording_mm), \
                mock.patch.object(torch.Tensor, "zero_", recording_zero):
            got = U.matmul_flops_per_s(5, 4, 3, torch.float64, "cpu", iters=3, warmup=2)
        call = [("zero", True), ("timed", torch.device("cpu")),
                ("mm", (5, 3), (3, 4), torch.float64, torch.float64, ((5, 4), torch.float64))]
        self.assertEqual([entry for entry in log if entry[0] != "zero" or entry[1]], call * 5,
                         "per call: a >= 32 MiB buffer zeroed, then time_call(fn, cpu) running "
                         "torch.mm(A (m, k), B (k, n), out=C (m, n)) in the dtype asked for")
        self.assertAlmostEqual(got, 2 * 5 * 4 * 3 / 0.5, delta=1e-9, msg="2 m n k / the fastest call")

    def test_b_the_best_shape_wins(self):
        rates = {(1, 1, 1): 5.0, (2, 2, 2): 9.0, (3, 3, 3): 7.0}
        calls, signature = [], inspect.signature(U.matmul_flops_per_s)

        def fake(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            calls.append(dict(bound.arguments))
            return rates[(bound.arguments["m"], bound.arguments["n"], bound.arguments["k"])]

        with mock.patch.object(U, "matmul_flops_per_s", fake):
            self.assertEqual(U.achievable_peak(list(rates), torch.float64, "meta", 3, 1), (9.0, (2, 2, 2)))
        self.assertEqual(calls, [{"m": s[0], "n": s[1], "k": s[2], "dtype": torch.float64, "device": "meta",
                                  "iters": 3, "warmup": 1} for s in rates],
                         "each shape once, in order, with the dtype, device, iters and warmup given")
        with self.assertRaises(ValueError):
            U.achievable_peak([])

    def test_c_measured_side_by_side_with_a_reference(self):
        """Measured criterion: the learner's achievable_peak and this test's reference_mamf,
        one thread, taking turns 5 times; the median ratio within [0.7, 1/0.7]."""
        shapes = [(256, 256, 256), (384, 384, 384)]
        ratios = []
        with one_thread():
            for turn in range(5):
                if turn % 2:
                    theirs = reference_mamf(shapes)
                    ours = U.achievable_peak(shapes)[0]
                else:
                    ours = U.achievable_peak(shapes)[0]
                    theirs = reference_mamf(shapes)
                ratios.append(ours / theirs)
        ratio = statistics.median(ratios)
        self.assertTrue(0.7 <= ratio <= 1 / 0.7,
                        f"achievable_peak / reference = {ratio:.2f} (per turn "
                        f"{[round(r, 2) for r in ratios]})")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a GPU: blocked, not passed")
    def test_d_gpu_reaches_half_its_datasheet_bf16_peak(self):
        """GPU criterion: bf16 matmuls reach at least half the datasheet's dense bf16 peak
        (an H100 SXM reaches about 80%, the ml-engineering book's MAMF table)."""
        name = torch.cuda.get_device_name()
        try:
            peak = U.peak_flops(name, "bfloat16")
        except ValueError:
            self.skipTest(f"{name}: no datasheet peak in the table (blocked, not passed)")
        got = U.achievable_peak([(4096, 4096, 4096), (8192, 8192, 8192)], torch.bfloat16, "cuda")[0]
        self.assertGreaterEqual(got, 0.5 * peak, f"{got / 1e12:.0f} of {peak / 1e12:.0f} TFLOP/s")


# ============================================================================ the lesson as a whole


class TestTraceAgainstTimers(unittest.TestCase):
    """Measured: the wait after backward that lesson 02's timers measure (its on_event marks)
    equals the same window read from the trace (the end of the backward range to the start of
    the optimizer range): median |difference| <= 1 ms + 10% of the median wait."""

    def test_the_wait_after_backward(self):
        runs = demo_runs()
        waits = []
        for name in ("bucketed", "one bucket"):
            for pair in range(len(runs[0]["ddp"][name])):
                for result in runs:
                    run = result["ddp"][name][pair]
                    trace = C.wait_after_backward(reference_timeline(run["events"]))
                    self.assertEqual(len(trace), len(run["timer_wait"]), "a wait per profiled step")
                    waits += list(zip(trace, run["timer_wait"]))
        difference = statistics.median(abs(t - w) for t, w in waits)
        typical = statistics.median(w for _, w in waits)
        self.assertLessEqual(difference, C.WINDOW_TOLERANCE[0] + C.WINDOW_TOLERANCE[1] * typical,
                             f"median |trace - timer| {difference * 1e3:.2f} ms, median wait "
                             f"{typical * 1e3:.1f} ms")

    def test_one_all_reduce_per_bucket_per_step(self):
        for result in demo_runs():
            for name, runs in result["ddp"].items():
                for run in runs:
                    timeline = reference_timeline(run["events"])
                    per_step = [sum(1 for _, s, _ in timeline["collectives"] if a <= s <= b)
                                for a, b in timeline["steps"]]
                    self.assertEqual(per_step, [run["buckets"]] * len(per_step),
                                     f"{name}: {run['buckets']} bucket(s), all-reduces per step {per_step}")
                    self.assertEqual(run["buckets"], 3 if name == "bucketed" else 1)


class TestCapstoneAndFlops(unittest.TestCase):
    def test_the_capstone_step_is_traced_with_its_phases(self):
        config = C.capstone_config(WORLD, 3)
        for rank, result in enumerate(demo_runs()):
            timeline = reference_timeline(result["capstone"]["events"])
            counts = {phase: len(spans) for phase, spans in timeline["phases"].items()}
            with self.subTest(rank=rank):
                self.assertEqual(counts, {"forward": 2 * 3, "backward": 2 * 3, "optimizer": 3},
                                 f"{config.accum} micro-batches x 3 steps: {counts}")
                for forward, backward in zip(timeline["phases"]["forward"], timeline["phases"]["backward"]):
                    self.assertLessEqual(forward[1], backward[0], "each backward starts after its forward")

    def test_flops_counted_equal_the_formula(self):
        config = C.capstone_config(WORLD, 3)
        result = demo_runs()[0]["capstone"]
        per_token = U.flops.flops_per_token(result["weights"], config.layers, config.hidden, config.seq)
        self.assertEqual(result["micro_flops"], per_token * result["micro_tokens"],
                         f"FlopCounterMode {result['micro_flops']:,} vs 6W + 12LHQT "
                         f"{per_token * result['micro_tokens']:,}")
        self.assertGreater(result["lesson13_n"], result["weights"],
                           "lesson 13's N counts biases and norms too")

    def test_tensor_parallel_ranks_count_their_share(self):
        counts = [r["tp_flops"] for r in demo_runs()]
        with one_thread():
            torch.manual_seed(0)
            up, down = torch.nn.Linear(48, 192), torch.nn.Linear(192, 48)
            x = torch.randn(64, 1, 48, requires_grad=True)
            dense = U.count_flops(lambda: down(torch.nn.functional.gelu(up(x))).sum().backward())[0]
        self.assertEqual(counts, [dense // WORLD] * WORLD, f"per rank {counts}, one process {dense}")


class TestRoofline(unittest.TestCase):
    def test_the_h100_ridge_and_a_matmul(self):
        ridge = R.ridge_point(989e12, 3.35e12)
        self.assertAlmostEqual(ridge, 295.22, delta=0.01)
        self.assertAlmostEqual(R.matmul_intensity(128, 8192, 8192, 2), 2 * 128 * 8192 * 8192 /
                               (2 * (128 * 8192 + 8192 * 8192 + 128 * 8192)), delta=1e-9)
        self.assertTrue(R.is_memory_bound(R.matmul_intensity(128, 8192, 8192, 2), 989e12, 3.35e12),
                        "128 x 8192 x 8192 in bf16 (about 124 FLOP/B, below the ridge 295) is memory bound")
        self.assertFalse(R.is_memory_bound(R.matmul_intensity(1024, 8192, 8192, 2), 989e12, 3.35e12),
                         "1024 x 8192 x 8192 in bf16 (819 FLOP/B, above the ridge 295) is compute bound")
        self.assertEqual(R.attainable_flops(10.0, 989e12, 3.35e12), 10.0 * 3.35e12)
        self.assertEqual(R.attainable_flops(1e4, 989e12, 3.35e12), 989e12)

    def test_the_capstone_operations_add_up(self):
        ops = {op["name"]: op for op in R.capstone_operations(tokens=4 * 64, hidden=64, heads=4, seq=64,
                                                              itemsize=2)}
        matmuls = sum(ops[n]["flops"] for n in ("qkv", "out", "up", "down"))
        self.assertEqual(matmuls, 2 * 4 * 64 * 12 * 64 * 64,
                         "the layer's 12 h^2 weights, 2 FLOPs per token each")
        attention = ops["scores q k^T"]["flops"] + ops["values p v"]["flops"]
        self.assertEqual(attention, 4 * 4 * 64 * 64 * 64, "4 s h FLOPs per token (a third of 12 L H Q T)")


class TestBenchmark(unittest.TestCase):
    """Measured: the collectives' times read from the traces == lesson 01's timers of the same
    calls (the median point within 50 us + 5%: two readings of one call, 20 of 20 under load).
    Lesson 01's fit, left without each inner size in turn, is recomputed here, but how well it
    predicts decides no test: gloo on a loaded machine kept it within a factor of 2 in only 19
    of 20 runs (the README's table), which would turn CI red one run in twenty."""

    @classmethod
    def setUpClass(cls):
        cls.per_rank = launch(B.comm_bench_worker, 2, (BENCH_SIZES, 0.2, str(SCRATCH / "bench")),
                              device="cpu", timeout_s=600)

    def test_columns_and_checks(self):
        checks, metrics, table = B.bench_report(self.per_rank, 2)
        self.assertEqual(len(table), 4 * len(BENCH_SIZES), "4 collectives x every size")
        for row in table:
            factor = {"all_reduce": 2 * 1 / 2}.get(row["collective"], 1 / 2)
            self.assertAlmostEqual(row["algbw"], row["bytes"] / row["seconds"], delta=1e-6 * row["algbw"])
            self.assertAlmostEqual(row["busbw"], row["algbw"] * factor, delta=1e-6 * row["algbw"],
                                   msg=f"{row['collective']}: busbw = algbw x factor (nccl-tests)")
        traced = [c for c in checks if "read from the traces" in c.name]
        self.assertEqual(len(traced), 1, [c.name for c in checks])
        self.assertTrue(traced[0].passed, traced[0].detail)
        fitted = [c for c in checks if "alpha-beta fit" in c.name]
        self.assertEqual(len(fitted), 1, [c.name for c in checks])
        sizes = sorted({row["bytes"] for row in table})
        for name in B.COLLECTIVES:  # each inner size left out in turn, predicted by the rest
            for size in sizes[1:-1]:
                points = [{"bytes": r["bytes"], "ring_s": r["seconds"] * (1 if name == "all_reduce" else 2)}
                          for r in table if r["collective"] == name and r["bytes"] != size]
                alpha, beta = B.collectives_bench.fit_alpha_beta(points, 2)
                measured = next(r["seconds"] for r in table if r["collective"] == name and r["bytes"] == size)
                predicted = B.collectives.alpha_beta_seconds(B.MODELS[name], size, 2, alpha, beta)
                self.assertAlmostEqual(metrics["fit_ratios"][name][str(size)], predicted / measured,
                                       delta=1e-9 * predicted / measured,
                                       msg=f"{name}, {size} B left out: predicted / measured")
        typical = statistics.median(metrics["fit_ratios"]["all_reduce"].values())
        self.assertEqual(fitted[0].passed, 1 / B.FIT_FACTOR <= typical <= B.FIT_FACTOR,
                         f"the fit's check reads the median all-reduce ratio {typical:.2f} "
                         f"against a factor of {B.FIT_FACTOR:g}")

    def test_the_fit_is_lesson_01s(self):
        rows = [{"collective": "reduce_scatter", "bytes": s, "seconds": 1e-5 + s * 1e-9 / 2}
                for s in (1000, 4000, 16000, 64000)]
        alpha, beta = B.fit_collective(rows, 2, "reduce_scatter")
        self.assertAlmostEqual(alpha, 1e-5, delta=1e-9, msg="(p-1) a with p = 2")
        self.assertAlmostEqual(beta, 1e-9, delta=1e-13, msg="(p-1)/p S b with p = 2")


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments_exit_2_with_one_line(self):
        for argv, fragment in ((["--steps", "0"], "--steps"), (["--width", "4"], "--width"),
                               (["--delay", "0"], "--delay"), (["--pairs", "0"], "--pairs"),
                               (["--world-size", "0"], "--world-size"),
                               (["--device", "cuda"], "GPU")):
            with self.subTest(argv=argv):
                if argv[-1] == "cuda" and torch.cuda.is_available():
                    continue
                assert_argument_error(self, C.parse_args, argv, fragment)
        full = SCRATCH / "full"
        full.mkdir(parents=True, exist_ok=True)
        (full / "x").write_text("x")
        assert_argument_error(self, C.parse_args, ["--out", str(full)], "not empty")

    def test_the_demo_writes_every_ranks_traces_and_cleans_up(self):
        out = SCRATCH / "cli"
        report = SCRATCH / "cli.json"
        tmp = SCRATCH / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        with mock.patch.object(tempfile, "tempdir", str(tmp)), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            C.main(["--world-size", "3", "--steps", "1", "--pairs", "1", "--width", "64", "--delay", "5",
                    "--quick", "--out", str(out), "--json", str(report)])
            C.main(["--world-size", "1", "--steps", "1", "--pairs", "1", "--width", "64", "--quick"])
        for run in ("ddp/bucketed-0", "ddp/one bucket-0", "straggler", "capstone"):
            self.assertEqual(sorted(p.name for p in (out / run).iterdir()),
                             ["rank0.json", "rank1.json", "rank2.json"], f"{run}: one trace per rank")
        self.assertTrue((out / "ddp_timeline.png").stat().st_size > 0, "the timeline figure")
        data = json.loads(report.read_text())
        exact = [c for c in data["checks"] if any(fragment in c["name"] for fragment in EXACT_CHECKS)]
        self.assertGreaterEqual(len(exact), 10, [c["name"] for c in data["checks"]])
        for check in exact:
            with self.subTest(check=check["name"]):
                self.assertTrue(check["passed"], check["detail"])
        left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("lesson15-", "dtfs-")))
        self.assertEqual(left, [], "no temporary folder of the lesson or its launcher left behind")


EXACT_CHECKS = ("all-reduce call per bucket", "traced unedited", "FLOPs counted", "recomputation", "TF32",
                "unknown device", "TP:", "achievable peak", "ridge point")


class TestUnderTorchrun(unittest.TestCase):
    @torchrun_demo(["--steps", "2", "--pairs", "2", "--quick"])
    def test_two_ranks_under_torchrun(self, report):
        """The demo joins torchrun's group; its exact checks pass (its measured rows are printed,
        not asserted here: the classes above grade them)."""
        self.assertEqual(report["world_size"], 2, "torchrun's world size")
        names = [c["name"] for c in report["checks"]]
        for fragment in EXACT_CHECKS:
            matching = [c for c in report["checks"] if fragment in c["name"]]
            with self.subTest(check=fragment):
                self.assertTrue(matching, f"no check named like {fragment!r} in {names}")
                self.assertTrue(all(c["passed"] for c in matching), [c["detail"] for c in matching])


class TestDocNumbers(unittest.TestCase):
    """Every number the README quotes, recomputed (plain kernels too: tests/test_portability)."""

    def assertQuoted(self, text: str) -> None:
        """`text` appears in the README (line breaks read as spaces)."""
        self.assertIn(" ".join(text.split()), " ".join(README.split()), f"the README should quote {text!r}")

    def test_interval_example(self):
        self.assertEqual(M.overlap_fraction([(0, 4)], [(1, 2), (3, 5)]), 0.5)
        self.assertEqual(M.exposed_communication({"comm": [(0, 4)], "compute": [(1, 2), (3, 5)],
                                                  "steps": [(0, 5)]}), [2.0])
        self.assertQuoted("2 / 4 = 0.5 and 2 ms exposed")

    def test_capstone_flops_and_recomputation(self):
        capstone = C.capstone
        vocab = len(capstone.CharTokenizer(capstone.load_text()).chars)
        config = C.capstone_config(2, 1)
        torch.manual_seed(0)
        model = U.flops.tiny_gpt.TinyGPT(vocab, config.hidden, config.heads, config.layers, config.seq)
        weights, layer_weights = U.weight_params(model), U.weight_params(model, layers_only=True)
        self.assertEqual((vocab, weights, U.flops.matmul_params(model)), (58, 102_016, 103_808))
        per_token = U.flops.flops_per_token(weights, config.layers, config.hidden, config.seq)
        dims = (config.layers, config.hidden, config.seq)
        lesson13 = U.flops.flops_per_token(U.flops.matmul_params(model), *dims)
        full = U.hardware_flops_per_token(weights, layer_weights, *dims, "full")
        selective = U.hardware_flops_per_token(weights, layer_weights, *dims, "selective")
        self.assertEqual((per_token, full, selective), (710_400, 939_776, 726_784))
        for text in ("W = 102,016", "**710,400 FLOPs per token**", "(103,808)",
                     f"{lesson13 / per_token - 1:.2%} more", "939,776 per token",
                     f"**{full / per_token:.3f}x**", "(726,784", f"**{selective / per_token:.3f}x**"):
            self.assertQuoted(text)

    def test_peaks_and_pitfalls(self):
        h100 = "NVIDIA H100 80GB HBM3"
        self.assertEqual(tuple(U.peak_flops(h100, dtype) for dtype in ("bfloat16", "float16", "tf32")),
                         (989e12, 989e12, 494.5e12))
        self.assertEqual(U.peak_flops(h100, "bfloat16") / U.peak_flops(h100, "tf32"), 2.0)
        self.assertEqual(f"{2300 / 312:.1f}", "7.4")
        self.assertEqual(f"{794.5 / 989:.1%}", "80.3%")
        for text in ("989 TFLOP/s in bf16 and fp16, 494.5 in TF32", "**2x** its MFU",
                     "2,300 / 312 = **7.4x**", "794.5 TFLOP/s", "80.3% of 989"):
            self.assertQuoted(text)

    def test_tensor_parallel_count(self):
        with one_thread():
            torch.manual_seed(0)
            up, down = torch.nn.Linear(48, 192), torch.nn.Linear(192, 48)
            x = torch.randn(64, 1, 48, requires_grad=True)
            dense = U.count_flops(lambda: down(torch.nn.functional.gelu(up(x))).sum().backward())[0]
        self.assertEqual(dense, 7_077_888)
        self.assertQuoted("**7,077,888** in one process")

    def test_rooflines_and_busbw(self):
        self.assertEqual(round(R.ridge_point(989e12, 3.35e12)), 295)
        self.assertEqual(f"{R.matmul_intensity(256, 8192, 8192, 2):.1f}", "240.9")
        self.assertEqual(f"{R.matmul_intensity(1024, 8192, 8192, 2):.1f}", "819.2")
        ops = {op["name"]: op for op in R.capstone_operations(2048, 128, 1, 2048, 2)}
        scores, softmax = ops["scores q k^T"], ops["softmax"]
        self.assertEqual(f"{R.arithmetic_intensity(scores['flops'], scores['bytes']):.1f}", "113.8")
        self.assertEqual(R.arithmetic_intensity(softmax["flops"], softmax["bytes"]), 1.25)
        algbw, busbw = B.bus_bandwidth("all_reduce", 1e9, 0.01, 8)
        self.assertEqual((round(algbw / 1e9), round(busbw / 1e9)), (100, 175))
        for text in ("= **295 FLOPs per byte**", "**240.9**", "**819.2**", "**113.8**", "**1.25**",
                     "algbw **100 GB/s**", "busbw **175 GB/s**"):
            self.assertQuoted(text)

    def test_measured_criteria_constants(self):
        self.assertEqual((C.OVERLAP_MARGIN, C.WINDOW_TOLERANCE), (0.15, (1e-3, 0.10)))
        self.assertEqual(DELAY, 0.06)
        for text in ("at least 0.15", "within 1 ms + 10%", "sleeping 60 ms"):
            self.assertQuoted(text)


if __name__ == "__main__":
    unittest.main()
