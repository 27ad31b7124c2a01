"""Lesson 14's suite. Every failure is injected for real somewhere here: a raised exception, a
process that exits, a hang (watchdog and py-spy), a SIGTERM and a SIGKILL in the middle of the
emergency save, a flipped bit, a sleeping rank; and a rank killed under torchrun with
--max-restarts, whose job must end on the uninterrupted run's digest. After each, no process of
the run may be left (process listings). Every run passes --device cpu.

Learner mode: the classes tagged with `exercise(...)` grade one exercise each (pure functions
in this process, collectives on 3 spawned ranks and on a subgroup of them); the untagged ones
grade the lesson as a whole."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

import torch

from lessons._launch import launch
from lessons._testing import (
    REPO_ROOT,
    assert_argument_error,
    exercise,
    free_port,
    processes_mentioning,
    rank_of,
    spawned_workers,
)

M = importlib.import_module("lessons.14_fault_tolerance.main")  # detection
FM = importlib.import_module("lessons.14_fault_tolerance.failure_model")
I = importlib.import_module("lessons.14_fault_tolerance.integrity")  # noqa: E741
R = importlib.import_module("lessons.14_fault_tolerance.recovery")
C = importlib.import_module("lessons.14_fault_tolerance.checks")
NH = importlib.import_module("lessons.14_fault_tolerance.nccl_hang")  # the one-GPU hang (notebook)
W = importlib.import_module("lessons.14_fault_tolerance.tests.workers")
MAIN = Path(M.__file__)
README = MAIN.with_name("README.md").read_text()
HOUR = 3600.0
SMALL = ["--device", "cpu", "--steps", "8", "--save-every", "2"]


def cli(*args: str, tmp: str, **popen) -> subprocess.Popen:
    """The lesson's command line in its own session; its temporary files (the launcher's run
    directory, which a SIGKILLed launcher cannot remove) go under `tmp`."""
    return subprocess.Popen([sys.executable, str(MAIN), *args], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": tmp},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


_REFERENCE: dict[int, str] = {}


def reference_digest(world: int) -> str:
    """The uninterrupted run's digest on `world` self-spawned ranks (computed once)."""
    if world not in _REFERENCE:
        with tempfile.TemporaryDirectory(prefix="lesson14-ref-") as tmp:
            report = Path(tmp) / "r.json"
            code = C.main([*SMALL, "--world-size", str(world), "--out", f"{tmp}/out",
                           "--json", str(report)])
            assert code == 0, f"the uninterrupted {world}-rank run failed (exit {code})"
            _REFERENCE[world] = json.loads(report.read_text())["metrics"]["final_param_sha256"]
    return _REFERENCE[world]


# ============================================================================ exercises


@exercise("failure-model")
class TestFailureModel(unittest.TestCase):
    def test_the_job_fails_when_any_gpu_does(self):
        self.assertEqual(FM.job_mtbf(50_000.0, 1), 50_000.0)
        self.assertAlmostEqual(FM.job_mtbf(50_000.0, 16_384), 50_000.0 / 16_384, delta=1e-12,
                               msg="rates add: the job's MTBF is one GPU's divided by the count")
        with self.assertRaises(ValueError):
            FM.job_mtbf(1.0, 0)

    def test_a_segment_without_failures_or_restarts_costs_its_length(self):
        # M e^(R/M) (e^(L/M) - 1) -> L as M -> infinity; with R = 0 and L = M: M (e - 1)
        self.assertAlmostEqual(FM.segment_time(10.0, 0.0, 1e12), 10.0, delta=1e-6)
        self.assertAlmostEqual(FM.segment_time(3.0, 0.0, 3.0), 3.0 * (math.e - 1), delta=1e-12)
        self.assertAlmostEqual(FM.segment_time(3.0, 3.0, 3.0), 3.0 * math.e * (math.e - 1),
                               delta=1e-12, msg="a restart of R costs the factor e^(R/M)")

    def test_the_run_is_segments_and_the_last_one_has_no_save(self):
        seg = FM.segment_time
        # 10 s of work saved every 4 s: segments 4 + 1 (save), 4 + 1, then the last 2 s alone
        expected = 2 * seg(5.0, 2.0, 30.0) + seg(2.0, 2.0, 30.0)
        self.assertAlmostEqual(FM.expected_wall_time(10.0, 4.0, 1.0, 2.0, 30.0), expected,
                               delta=1e-12)
        # no checkpoint at all: one segment of the whole work, no save
        self.assertAlmostEqual(FM.expected_wall_time(10.0, 10.0, 1.0, 2.0, 30.0),
                               seg(10.0, 2.0, 30.0), delta=1e-12)
        self.assertAlmostEqual(FM.expected_wall_time(10.0, 50.0, 1.0, 2.0, 30.0),
                               seg(10.0, 2.0, 30.0), delta=1e-12)
        # any unit (hours: values below 1 are valid), and a free save and restart are allowed:
        # 0.5 h of work saved every 0.2 h is segments 0.2, 0.2 and the last 0.1
        got = FM.expected_wall_time(0.5, 0.2, 0.0, 0.0, 0.8)
        expected = 2 * seg(0.2, 0.0, 0.8) + seg(0.1, 0.0, 0.8)
        self.assertAlmostEqual(got, expected, delta=1e-12,
                               msg=f"expected_wall_time(work=0.5, interval=0.2, save=0, restart=0, "
                               f"mtbf=0.8): expected {expected!r}, got {got!r}")
        for bad in ((0.0, 1.0, 0.0, 0.0, 1.0), (1.0, 0.0, 0.0, 0.0, 1.0),
                    (1.0, 1.0, -1.0, 0.0, 1.0), (1.0, 1.0, 0.0, 0.0, 0.0)):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                FM.expected_wall_time(*bad)

    def test_the_model_equals_runs_with_injected_failures(self):
        # 1500 simulated runs (simulate_run is the harness's failure injector, not an exercise);
        # 4 standard errors: a correct formula fails this 6e-5 of the time, for this seed never
        work, mtbf, restart, save = 10.0, 6.0, 0.5, 0.3
        for interval in (2.0, 3.3, 10.0):
            rng = random.Random(1)
            walls = [FM.simulate_run(work, interval, save, restart, mtbf, rng)[0] for _ in range(1500)]
            mean = sum(walls) / len(walls)
            sd = math.sqrt(sum((w - mean) ** 2 for w in walls) / (len(walls) - 1))
            expected = FM.expected_wall_time(work, interval, save, restart, mtbf)
            with self.subTest(interval=interval):
                self.assertLess(abs(mean - expected), 4 * sd / math.sqrt(len(walls)),
                                f"expected {expected:.3f}, simulated {mean:.3f}")


@exercise("read-the-dumps")
class TestDiagnose(unittest.TestCase):
    @staticmethod
    def entry(seq, op="all_reduce", group=(0, 1, 2), state="completed", sizes=((4,),)):
        return {"seq": seq, "op": op, "group": list(group), "sizes": [list(s) for s in sizes],
                "state": state, "step": 0}

    def dumps(self, per_rank: dict[int, list], steps=None):
        return [{"rank": r, "step": (steps or {}).get(r, 5), "entries": e}
                for r, e in sorted(per_rank.items())]

    def diagnose(self, dumps: list) -> dict:
        """M.diagnose(dumps), checked to return the documented keys and a one-line message."""
        verdict = M.diagnose(dumps)
        self.assertEqual(sorted(verdict), ["culprits", "kind", "message"],
                         f"the keys diagnose returned (verdict {verdict})")
        self.assertTrue(isinstance(verdict["message"], str) and "\n" not in verdict["message"],
                        f"the message must be one line of text, got {verdict['message']!r}")
        return verdict

    def test_the_rank_that_never_entered_is_named(self):
        e = self.entry
        dumps = self.dumps({0: [e(56), e(57, state="entered")], 1: [e(56), e(57, state="entered")],
                            2: [e(55), e(56)]}, steps={2: 4})
        verdict = self.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("behind", [2]),
                         "ranks 0 and 1 wait in #57; rank 2's last is #56: rank 2 is behind")
        for part in ("rank 2 at step 4", "all_reduce #56", "#57", "[0, 1]"):
            self.assertIn(part, verdict["message"], "the message names the rank behind, its step and "
                          "last collective, and the collective ranks 0 and 1 wait in")

    def test_a_rank_that_never_entered_any_collective_of_the_group_is_behind(self):
        e = self.entry
        # rank 2 hung before its first collective: ranks 0 and 1 wait in #1, rank 2 has no entry
        verdict = self.diagnose(self.dumps({0: [e(1, state="entered")], 1: [e(1, state="entered")],
                                            2: []}, steps={2: 0}))
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("behind", [2]),
                         "ranks 0 and 1 wait in all_reduce #1, rank 2 never entered a collective: "
                         f"expected ('behind', [2]), got {(verdict['kind'], verdict['culprits'])}")
        self.assertIn("rank 2 at step 0", verdict["message"], "the message names rank 2 and its step")

    def test_a_subgroup_is_compared_among_its_members_only(self):
        e = self.entry
        # ranks 0 and 2 share a subgroup; rank 1 is not in it and has done 40 collectives on
        # a group of its own (seq numbers count per group: 40 is no later than 3)
        dumps = self.dumps({0: [e(9), e(3, op="broadcast", group=(0, 2), state="entered")],
                            1: [e(9), e(40, group=(1,))],
                            2: [e(9), e(2, op="broadcast", group=(0, 2))]})
        verdict = self.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("behind", [2]),
                         "rank 1 is not in group [0, 2]: only 0 and 2 count, and rank 2 is behind")
        self.assertIn("broadcast #3 on group [0, 2]", verdict["message"])

    def test_a_different_collective_at_the_same_seq_is_a_mismatch(self):
        e = self.entry
        dumps = self.dumps({0: [e(7, state="entered")], 1: [e(7, state="entered")],
                            2: [e(7, op="broadcast", state="entered")]})
        verdict = self.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("mismatch", [2]),
                         "ranks 0 and 1 in all_reduce #7, rank 2 in broadcast #7")
        for part in ("#7", "[0, 1, 2]", "all_reduce", "broadcast"):
            self.assertIn(part, verdict["message"], "a mismatch's message names the collective #s, "
                          "its group and every member's op and sizes")
        sizes = self.dumps({0: [e(7, group=(0, 1), state="entered")],
                            1: [e(7, group=(0, 1), state="entered", sizes=((5,),))]})
        verdict = self.diagnose(sizes)
        self.assertEqual(verdict["kind"], "mismatch", "same op, other sizes: a mismatch")
        self.assertEqual(verdict["culprits"], [0, 1], "a tie names both")
        for part in ("[4]", "[5]"):
            self.assertIn(part, verdict["message"], "a mismatch's message names every member's sizes")

    def test_everyone_waiting_in_one_collective_is_a_transport_hang(self):
        e = self.entry
        verdict = self.diagnose(self.dumps({r: [e(7, state="entered")] for r in range(3)}))
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("waiting", []),
                         "(kind, culprits) of diagnose")

    def test_a_one_member_group_waiting_alone_is_a_transport_hang(self):
        e = self.entry
        # the world's #3 completed everywhere; rank 1 waits in #1 of its own group [1]
        dumps = self.dumps({0: [e(3)], 1: [e(3), e(1, op="broadcast", group=(1,), state="entered")],
                            2: [e(3)]})
        verdict = self.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("waiting", []),
                         "world #3 completed, rank 1 alone in broadcast #1 of group [1]: expected "
                         f"('waiting', []), got {(verdict['kind'], verdict['culprits'])}")
        for part in ("group [1]", "broadcast #1"):
            self.assertIn(part, verdict["message"], "a transport hang's message names the group "
                          "and the collective its members wait in")

    def test_a_missing_heartbeat_is_a_dead_rank(self):
        e = self.entry
        dumps = self.dumps({0: [e(3)], 2: [e(3)]})
        dumps.insert(1, None)
        verdict = self.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("dead", [1]),
                         "(kind, culprits) of diagnose")

    def test_no_collective_pending_names_the_rank_at_the_lowest_step(self):
        e = self.entry
        verdict = self.diagnose(self.dumps({0: [e(3)], 1: [e(3)], 2: [e(3)]}, steps={1: 2}))
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("stuck", [1]),
                         "(kind, culprits) of diagnose")


class TestRecorder(unittest.TestCase):
    def test_every_collective_is_recorded_with_its_group_and_sizes(self):
        results = launch(W.recorded_collectives, 3, device="cpu", timeout_s=60)
        for rank, result in enumerate(results):
            with self.subTest(rank=rank):
                ops = [(e["op"], e["seq"], e["group"], e["state"]) for e in result]
                self.assertEqual(ops[:3], [("all_reduce", 1, [0, 1, 2], "completed"),
                                           ("all_reduce", 2, [0, 1, 2], "completed"),
                                           ("broadcast", 3, [0, 1, 2], "completed")])
                self.assertEqual(result[0]["sizes"], [[7, 5]])
                if rank in (0, 2):
                    self.assertEqual(ops[3], ("all_reduce", 1, [0, 2], "completed"),
                                     "a subgroup counts its own collectives")


class TestNcclHang(unittest.TestCase):
    """nccl_hang.py's reading of a flight-recorder dump (the keys NCCL's dump had on an H100);
    its run needs a GPU and refuses without one."""

    @staticmethod
    def entry(seq: int, state: str) -> dict:
        return {"collective_seq_id": seq, "profiling_name": "nccl:all_reduce", "state": state,
                "input_sizes": [[1048576]], "process_group": ("0", "default_pg")}

    def test_the_first_collective_not_completed_is_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{NH.PREFIX}0"
            dump = {"version": "2.x", "entries": [self.entry(i, "completed") for i in (1, 2, 3, 4)]
                    + [self.entry(5, "scheduled"), self.entry(6, "scheduled")]}
            path.write_bytes(pickle.dumps(dump))
            rows = NH.read_dump(path)
        self.assertEqual([(r["seq"], r["state"]) for r in rows][3:],
                         [(4, "completed"), (5, "scheduled"), (6, "scheduled")])
        line = NH.diagnose_dump(rows)
        self.assertIn("collective #5 nccl:all_reduce [[1048576]] is scheduled", line)
        self.assertIn("4 before it completed", line)
        started = NH.diagnose_dump([{**r, "state": "started"} if r["seq"] == 2 else r for r in rows])
        self.assertIn("#2", started)
        self.assertIn("started but never finished", started)
        self.assertEqual(NH.diagnose_dump(rows[:4]), "all 4 recorded collectives completed")

    def test_a_file_that_is_no_dump_is_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in (("garbage", b"not a pickle"), ("no-entries", pickle.dumps({"x": 1}))):
                path = Path(tmp) / name
                path.write_bytes(data)
                with self.assertRaises(ValueError) as caught:
                    NH.read_dump(path)
                self.assertIn(f"{path}: not a flight-recorder dump", str(caught.exception))

    def test_without_a_gpu_it_refuses_with_one_line(self):
        no_gpu = mock.patch("torch.cuda.is_available", return_value=False)
        with tempfile.TemporaryDirectory() as tmp, no_gpu, contextlib.redirect_stderr(io.StringIO()) as err:
            self.assertEqual(NH.main(["--out", tmp]), 2)
        self.assertEqual(err.getvalue().strip().splitlines(),
                         ["nccl_hang.py needs a CUDA GPU (NCCL); none is visible here"])


@exercise("sdc-vote")
class TestVote(unittest.TestCase):
    def test_majorities_ties_and_unanimity(self):
        self.assertEqual(I.vote(["a", "a", "a"]), ("a", []))
        self.assertEqual(I.vote(["a", "b", "a"]), ("a", [1]))
        self.assertEqual(I.vote(["a", "b"]), (None, [0, 1]),
                         "two replicas that differ: no majority, both suspect")
        self.assertEqual(I.vote(["x", "y", "x", "z", "x"]), ("x", [1, 3]))
        self.assertEqual(I.vote(["x", "y", "x", "y"]), (None, [0, 1, 2, 3]), "2 vs 2: no majority")
        self.assertEqual(I.vote(["only"]), ("only", []))

    def test_three_ranks_and_a_subgroup_find_heal_and_name_global_ranks(self):
        results = launch(W.sdc_worker, 3, (1, [1, 2], 2), device="cpu", timeout_s=60)
        world = results[0]["world"]
        self.assertEqual(world["verdict"]["suspects"], [1], "rank 1's flipped bit is named")
        self.assertEqual(world["verdict"]["healthy"], 0, "the lowest rank of the majority")
        self.assertEqual(len(set(world["verdict"]["fingerprints"])), 2)
        for rank, result in enumerate(results):
            with self.subTest(rank=rank):
                self.assertEqual(result["world"]["after"]["suspects"], [], "after healing: equal")
                self.assertTrue(result["world"]["equal_to_clean"],
                                "healed from the healthy replica: every rank holds the clean state")
        for rank in (1, 2):
            verdict = results[rank]["subgroup"]["verdict"]
            with self.subTest(subgroup_rank=rank):
                self.assertEqual(verdict["suspects"], [1, 2],
                                 "2 replicas (global ranks 1 and 2) differ: no majority, both named "
                                 "by their GLOBAL ranks")
                self.assertIsNone(verdict["healthy"], f"subgroup [1, 2], global rank {rank}: no "
                                  f"majority, so no healthy rank; got {verdict['healthy']}")
                self.assertTrue(results[rank]["subgroup"]["healed"],
                                f"heal_from_replica(group=[1, 2], healthy=global rank 1) on global "
                                f"rank {rank}: expected rank 1's (clean) tensors, got others")
                staged = results[rank]["subgroup"]["staged"]
                self.assertEqual(staged["copies"], [(3,), (7, 5)],
                                 f"the same heal on a group whose backend is NCCL (global rank {rank}): "
                                 "every CPU tensor goes through one CUDA copy (shapes of the copies)")
                self.assertTrue(staged["healed"], f"the heal staged through CUDA copies on global rank "
                                f"{rank}: the healed values must land in the rank's own tensors")
        self.assertNotIn("subgroup", results[0])
        self.assertTrue(results[0]["outside_untouched"],
                        "global rank 0, outside the subgroup [1, 2]: its tensors must not change while "
                        "the subgroup heals")


@exercise("preemption")
class TestStopAgreedDevice(unittest.TestCase):
    def test_the_all_reduced_tensor_lives_on_the_given_device(self):
        """NCCL reduces only CUDA tensors: the decision's tensor must be on `device`. No GPU
        here, so the device is "meta" and the all-reduce a recorder that stops the call (a
        meta tensor holds no values to decide on)."""
        class Reduced(Exception):
            pass
        seen = []

        def all_reduce(tensor, *args, **kwargs):
            seen.append((tensor.device.type, tensor.dtype, tuple(tensor.shape)))
            raise Reduced
        with mock.patch.object(I.dist, "all_reduce", all_reduce), \
                contextlib.suppress(Reduced):
            I.Preemption(100.0).stop_agreed(torch.device("meta"))
        self.assertEqual(seen, [("meta", torch.float64, (2,))],
                         "stop_agreed(device=meta): the all-reduced tensors (device, dtype, shape)")


@exercise("preemption")
class TestPreemption(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="lesson14-preempt-")
        # rank 1 gets SIGTERM with 40 s of grace, rank 2 with 25 s; rank 0 none
        cls.results = launch(W.preemption_worker, 3, ({"1": 40.0, "2": 25.0}, [0, 2], cls.tmp),
                             device="cpu", timeout_s=60)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_rank_stops_when_any_rank_was_signalled(self):
        for rank, result in enumerate(self.results):
            stop, left = result["world"]
            with self.subTest(rank=rank):
                self.assertTrue(stop, "rank 0 got no signal but must stop with the others")
                self.assertTrue(20.0 < left <= 25.0, f"the SHORTEST grace left, got {left}")
                self.assertEqual(tuple(result["quiet"]), (False, math.inf),
                                 "nobody signalled: go on")

    def test_a_subgroup_agrees_among_its_members(self):
        for rank in (0, 2):
            stop, left = self.results[rank]["subgroup"]
            with self.subTest(rank=rank):
                self.assertTrue(stop, f"subgroup [0, 2], global rank {rank}: rank 2 was signalled, "
                                f"expected stop=True, got {stop}")
                self.assertTrue(20.0 < left <= 25.0, f"rank 2's grace, got {left}")

    def test_one_float64_all_reduce_of_two_numbers_per_decision(self):
        for rank, result in enumerate(self.results):
            for key, group in (("world_collectives", [0, 1, 2]), ("subgroup_collectives", [0, 2])):
                if key not in result:
                    continue
                with self.subTest(rank=rank, group=group):
                    self.assertEqual(result[key], [("all_reduce", [[2]], "float64", group)],
                                     f"stop_agreed on group {group}, global rank {rank}: the "
                                     "collectives it made (op, input shapes, dtype, group)")

    def test_a_save_that_does_not_fit_is_not_started(self):
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                self.assertFalse(result["skipped"], "1.5 s left, 2 s predicted: skip the save")
                self.assertEqual(result["latest_after_skip"], "step-00000002",
                                 "the previous checkpoint stays `latest`")
                self.assertTrue(result["saved"], "2.5 s left, 2 s predicted: save")
                self.assertEqual(result["latest_after_save"], "step-00000003",
                                 "`latest` after the emergency save of step 3")
                self.assertFalse(result["at_the_margin"], "exactly 2 s left, 2 s predicted (a save "
                                 "of 1 s, margin 2): a save must fit in MORE than that; got saved")
                self.assertTrue(result["saved_unmeasured"], "0.5 s left and no save measured yet: "
                                "expected to save, got skipped")
                self.assertEqual(result["latest_after_unmeasured"], "step-00000004",
                                 "`latest` after the emergency save of step 4 (no save measured)")


@exercise("straggler")
class TestStraggler(unittest.TestCase):
    def test_the_slow_rank_is_named_by_its_work_not_its_wall_time(self):
        # every rank waited for rank 1: the same wall time everywhere, rank 1's own work long
        named = I.name_straggler([0.05, 0.30, 0.06], [0.31, 0.31, 0.31])
        self.assertEqual(named["straggler"], 1)
        self.assertAlmostEqual(named["seconds"], 0.31, delta=1e-12,
                               msg="a synchronous step lasts as long as the slowest rank")
        self.assertAlmostEqual(named["mean_work"], 0.41 / 3, delta=1e-12)
        self.assertAlmostEqual(named["max_work"], 0.30, delta=1e-12)
        self.assertAlmostEqual(named["waste"], 0.31 - 0.41 / 3, delta=1e-12)

    def test_no_straggler_when_the_spread_is_noise(self):
        got = I.name_straggler([0.05, 0.06, 0.052, 0.055], [0.07] * 4)["straggler"]
        self.assertIsNone(got, f"work [0.05, 0.06, 0.052, 0.055]: noise, expected None, got {got}")
        # 3x the median but 0.02 s: below the floor
        got = I.name_straggler([0.01, 0.03, 0.01], [0.03] * 3)["straggler"]
        self.assertIsNone(got, f"work [0.01, 0.03, 0.01]: 0.02 s above the median is below the "
                          f"floor 0.05, expected None, got {got}")
        self.assertEqual(I.name_straggler([0.01, 0.01, 0.2, 0.01], [0.2] * 4)["straggler"], 2)

    def test_the_median_of_the_other_ranks_by_hand(self):
        """Work times whose verdict flips if the median of the OTHER ranks is taken wrongly:
        an even count of others averages the middle two, an odd count takes the middle one;
        `factor` must be exceeded, `floor` met."""
        cases = [  # (work, factor, floor, expected straggler, why)
            ([0.1, 0.5, 0.3], 2.0, 0.05, 1, "others [0.1, 0.3]: median 0.2, 0.5 > 0.4"),
            ([0.1, 0.35, 0.3], 2.0, 0.05, None, "others [0.1, 0.3]: median 0.2, 0.35 <= 0.4"),
            ([0.1, 0.3, 0.5, 0.4], 2.0, 0.05, None, "others [0.1, 0.3, 0.4]: median 0.3, 0.5 <= 0.6"),
            ([0.1, 0.2, 0.3, 0.4, 0.45], 2.0, 0.05, None,
             "others [0.1, 0.2, 0.3, 0.4]: median 0.25, 0.45 <= 0.5"),
            ([0.1, 0.2, 0.3, 0.4, 0.55], 2.0, 0.05, 4,
             "others [0.1, 0.2, 0.3, 0.4]: median 0.25, 0.55 > 0.5"),
            ([0.1, 0.2, 0.1], 2.0, 0.05, None, "0.2 is exactly 2 x the median 0.1: not MORE than it"),
            ([0.25, 0.5, 0.25], 1.5, 0.25, 1, "0.5 - 0.25 is exactly the floor 0.25: at least it"),
            ([0.02, 0.06, 0.02], 2.0, 0.05, None, "0.06 - 0.02 = 0.04 < the floor 0.05"),
        ]
        for work, factor, floor, expected, why in cases:
            got = I.name_straggler(work, [max(work)] * len(work), factor, floor)["straggler"]
            self.assertEqual(got, expected, f"name_straggler(work={work}, factor={factor}, "
                             f"floor={floor}): expected {expected}, got {got} ({why})")

    def test_two_ranks_compare_with_each_other_and_one_rank_with_nobody(self):
        # the median of both (0.145) would hide it: the reference is the OTHER rank
        self.assertEqual(I.name_straggler([0.27, 0.02], [0.28, 0.28])["straggler"], 0)
        got = I.name_straggler([0.27], [0.28])["straggler"]
        self.assertIsNone(got, f"one rank alone is nobody's straggler: expected None, got {got}")

    def test_times_are_gathered_in_group_order(self):
        results = launch(W.straggler_worker, 3, ([1, 2],), device="cpu", timeout_s=60)
        for rank, result in enumerate(results):
            work, wall = result["world"]
            with self.subTest(rank=rank):
                self.assertEqual([round(w, 6) for w in work], [0.1, 0.2, 0.3])
                self.assertEqual(wall, [1.0, 2.0, 3.0])
        for rank in (1, 2):
            self.assertEqual(results[rank]["subgroup"][1], [2.0, 3.0], "the subgroup's members only")
        self.assertNotIn("subgroup", results[0])


# ============================================================================ the lesson as a whole


@unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
class TestDemo(unittest.TestCase):
    """The demo: every failure injected, detected, named and survived, in one table."""

    @classmethod
    def setUpClass(cls):
        cls.dir = Path(tempfile.mkdtemp(prefix="lesson14-demo-"))
        cls.code = C.main(["--device", "cpu", "--json", str(cls.dir / "m.json")])
        cls.report = json.loads((cls.dir / "m.json").read_text())

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_every_failure_is_detected_and_survived(self):
        self.assertEqual(self.code, 0)
        names = [c["name"] for c in self.report["checks"]]
        for kind in ("crash", "exit", "hang", "sigterm", "bitflip", "slow"):
            with self.subTest(failure=kind):
                rows = [c for c in self.report["checks"] if c["name"].startswith(kind)
                        or c["name"].startswith(f"{kind} ")]
                self.assertEqual(len(rows), 1, names)
                self.assertTrue(rows[0]["passed"], rows[0]["detail"])
        for check in self.report["checks"]:
            with self.subTest(check=check["name"]):
                self.assertTrue(check["passed"], check["detail"])

    def test_the_hang_names_rank_2_and_the_collective_ranks_0_and_1_wait_in(self):
        row = next(c for c in self.report["checks"] if c["name"].startswith("hang"))
        self.assertRegex(row["detail"], r"rank 2 at step 3, last \w+ #\d+ \(completed\): never "
                                        r"entered \w+ #\d+ on group \[0, 1, 2\]")

    def test_the_cost_of_checking_and_of_a_straggler_are_measured(self):
        metrics = self.report["metrics"]
        self.assertGreater(metrics["check_seconds"], 0)
        self.assertGreater(metrics["check_overhead"], 0)
        cost = metrics["straggler"]
        self.assertGreater(cost["step_s"], cost["mean_work_s"] + C.SLOW_SECONDS / 2,
                           "a synchronous step pays the slowest rank's time, not the mean")

    def test_nothing_is_left_running(self):
        self.assertEqual(spawned_workers(os.getpid()), [])


@unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
class TestTorchrunKill(unittest.TestCase):
    """The issue's command: torchrun --max-restarts=1, rank 1 crashes after step 3 of the first
    attempt, torchrun restarts both ranks, the job resumes from step 2 and ends on the
    uninterrupted run's digest (bitwise, same machine)."""

    def test_a_rank_killed_under_torchrun_restarts_and_ends_on_the_same_digest(self):
        with tempfile.TemporaryDirectory(prefix="lesson14-torchrun-") as tmp:
            out, report = Path(tmp) / "out", Path(tmp) / "report.json"
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                   "PYTHONPATH": str(REPO_ROOT),
                   # torch 2.13's shared rendezvous store keeps the first attempt's gloo
                   # addresses: a restarted rank may read them (pytorch issues 135712, 167288)
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2", "--max-restarts=1", str(MAIN), "--fault", "crash",
                       "--fault-rank", "1", "--fault-step", "3", "--out", str(out), *SMALL,
                       "--json", str(report)]
            proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True,
                                  text=True, timeout=300)
            self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-3000:])
            self.assertIn("RuntimeError: injected crash on rank 1", proc.stderr)
            metrics = json.loads(report.read_text())["metrics"]
            self.assertEqual(metrics["restart_count"], 1, "the second attempt finished")
            self.assertEqual(metrics["resumed_from"], 2, "the latest checkpoint before step 3")
            self.assertEqual(processes_mentioning(str(out)), [], "torchrun left processes")
        self.assertEqual(metrics["final_param_sha256"], reference_digest(2))


@unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
class TestTorchrunNodeLost(unittest.TestCase):
    """torchrun's membership change: two one-process nodes on loopback (`--nnodes=1:2`, c10d
    rendezvous), the second node lost for good (its agent and its worker SIGKILLed) after the
    first checkpoint. The first node's worker fails in communication, its agent restarts the
    group alone, and the worker resumes the 2-rank checkpoint on 1 rank (resharded). It ends on
    the digest our own agent gives for the same history (2 ranks up to that checkpoint, then 1:
    `--fault exit --min-world-size 1`), bitwise."""

    RENDEZVOUS = ("last_call_timeout=5,"  # both nodes join the first round; the second round waits
                  "keep_alive_interval=1,keep_alive_max_attempt=2")  # the lost node is dropped in 2 s

    def node(self, number: int, endpoint: str, out: Path, tmp: str) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "PYTHONPATH": str(REPO_ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                   "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                   f"--rdzv-id=lost-{os.getpid()}",
                   f"--rdzv-conf=is_host={int(number == 0)},{self.RENDEZVOUS}",
                   str(MAIN), *SMALL, "--sleep-per-step", "0.5", "--out", str(out),
                   "--json", f"{tmp}/node{number}.json"]
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def test_a_lost_node_restarts_the_job_on_fewer_ranks_on_the_same_trajectory(self):
        with tempfile.TemporaryDirectory(prefix="lesson14-nodes-") as tmp:
            out = Path(tmp) / "out"
            endpoint = f"127.0.0.1:{free_port()}"
            nodes = [self.node(number, endpoint, out, tmp) for number in (0, 1)]
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (out / "checkpoints" / "latest").exists():
                    time.sleep(0.05)
                self.assertTrue((out / "checkpoints" / "latest").exists(), "no first checkpoint")
                lost = processes_mentioning(f"{tmp}/node1.json")  # the node: its agent and worker
                for pid in lost:
                    os.kill(pid, signal.SIGKILL)
                output = nodes[0].communicate(timeout=240)[0]
            finally:
                for proc in nodes:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
            self.assertGreaterEqual(len(lost), 2, "node 1's agent and worker were not both found")
            self.assertEqual(nodes[0].returncode, 0, output[-3000:])
            report = json.loads(Path(f"{tmp}/node0.json").read_text())
            metrics = report["metrics"]
            self.assertEqual((report["world_size"], metrics["restart_count"]), (1, 1),
                             "node 0's agent restarted the group on its one rank")
            resumed = metrics["resumed_from"]
            self.assertIsNotNone(resumed, "the restarted rank did not resume")
            self.assertTrue(report["passed"], [c for c in report["checks"] if not c["passed"]])
            self.assertEqual(processes_mentioning(str(out)), [], "torchrun left processes")
            code = C.main([*SMALL, "--world-size", "2", "--fault", "exit", "--fault-rank", "1",
                           "--fault-step", str(resumed + 1), "--min-world-size", "1",
                           "--out", f"{tmp}/ours", "--json", f"{tmp}/ours.json"])
            self.assertEqual(code, 0)
            ours = json.loads(Path(f"{tmp}/ours.json").read_text())["metrics"]
        self.assertEqual([a["world"] for a in ours["attempts"]], [2, 1])
        self.assertEqual(ours["resumed_from"], resumed)
        self.assertEqual(metrics["final_param_sha256"], ours["final_param_sha256"],
                         "torchrun's restart on fewer ranks left our agent's trajectory")


@unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
class TestPreemptedForReal(unittest.TestCase):
    """A scheduler's SIGTERM to the job's process group, then its SIGKILL while the emergency
    save is writing: `latest` keeps the previous checkpoint, which verifies, and the requeued
    job resumes from it and ends on the uninterrupted run's digest."""

    def test_a_save_cut_by_sigkill_leaves_the_previous_checkpoint(self):
        with tempfile.TemporaryDirectory(prefix="lesson14-preempt-") as tmp:
            out = Path(tmp) / "out"
            ckpt = out / "checkpoints"
            proc = cli(*SMALL, "--world-size", "2", "--out", str(out), "--sleep-per-step", "0.2",
                       "--save-delay", "0.6", "--grace", "30", "--check-every", "1",
                       tmp=tmp, start_new_session=True)
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (ckpt / "latest").exists():
                    time.sleep(0.05)
                self.assertTrue((ckpt / "latest").exists(), "no first checkpoint")
                os.killpg(proc.pid, signal.SIGTERM)  # the notice, to every process of the job
                committed = R.checkpointing.read_latest(ckpt).name
                newer = None
                while time.monotonic() < deadline and newer is None:  # the emergency save begins
                    newer = next((d for d in ckpt.glob("step-*") if d.name > committed
                                  and not (d / "manifest.json").exists()), None)
                    time.sleep(0.02)
                latest_before_kill = R.checkpointing.read_latest(ckpt).name
                os.killpg(proc.pid, signal.SIGKILL)  # the grace is over for this save
                proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
            self.assertIsNotNone(newer, "the emergency save never started")
            self.assertFalse((newer / "manifest.json").exists(), "the cut save was committed")
            latest = R.checkpointing.read_latest(ckpt)
            self.assertEqual(latest.name, latest_before_kill, "latest moved to the cut save")
            R.checkpointing.verify_checkpoint(latest, 2)
            time.sleep(0.2)
            self.assertEqual(processes_mentioning(str(out)), [])
            code = C.main([*SMALL, "--world-size", "2", "--out", str(out), "--resume",
                           "--json", f"{tmp}/resumed.json"])
            self.assertEqual(code, 0)
            metrics = json.loads(Path(f"{tmp}/resumed.json").read_text())["metrics"]
        self.assertEqual(metrics["resumed_from"], int(latest.name.split("-")[1]))
        self.assertEqual(metrics["final_param_sha256"], reference_digest(2))


@unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
class TestPySpy(unittest.TestCase):
    """py-spy reads a hung rank's Python stack from outside, without its cooperation."""

    def test_py_spy_dump_shows_where_the_hung_rank_is(self):
        if C.py_spy_executable() is None:
            self.skipTest("py-spy is not installed (pip install -r requirements-dev.txt)")
        with tempfile.TemporaryDirectory(prefix="lesson14-pyspy-") as tmp:
            proc = cli(*SMALL, "--world-size", "2", "--out", f"{tmp}/out", "--fault", "hang",
                       "--fault-rank", "1", "--fault-step", "2", "--watchdog", "0",
                       "--max-restarts", "0", tmp=tmp, start_new_session=True)
            try:
                deadline, dump = time.monotonic() + 120, ""
                while time.monotonic() < deadline and "inject_fault" not in dump:
                    ranks = {rank_of(pid): pid for pid in spawned_workers(proc.pid)}
                    if 1 in ranks:
                        dump = C.py_spy_dump(ranks[1]) or ""
                    time.sleep(0.5)
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        self.assertIn("inject_fault", dump, "py-spy shows the frame rank 1 hangs in")
        self.assertIn("train_resiliently", dump)


class TestCli(unittest.TestCase):
    def test_bad_arguments_exit_2_with_one_line(self):
        parse = C.parse_args
        assert_argument_error(self, parse, ["--fault", "melt"], "invalid choice")
        assert_argument_error(self, parse, ["--fault", "crash", "--fault-rank", "3"],
                              "--fault-rank 3")
        assert_argument_error(self, parse, ["--fault-step", "9"], "--fault-step 9")
        assert_argument_error(self, parse, ["--check-every", "3"], "--check-every 3")
        assert_argument_error(self, parse, ["--min-world-size", "4"], "--min-world-size 4")
        assert_argument_error(self, parse, ["--resume"], "--resume needs --out")
        assert_argument_error(self, parse, ["--watchdog", "-1"], "--watchdog")

    def test_torchrun_needs_out(self):
        with mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}):
            assert_argument_error(self, C.parse_args, ["--device", "cpu"], "--out is required")

    def test_existing_checkpoints_without_resume_exit_2(self):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "checkpoints").mkdir()
            (Path(tmp) / "checkpoints" / "latest").write_text("step-00000002\n")
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                code = C.main([*SMALL, "--out", tmp])
        self.assertEqual(code, 2)
        self.assertEqual(len(stderr.getvalue().strip().splitlines()), 1)
        self.assertIn("pass --resume", stderr.getvalue())


class TestDocNumbers(unittest.TestCase):
    """The numbers README.md and quiz.json quote, recomputed from failure_model.py."""

    def quoted(self, pattern: str) -> list[str]:
        found = re.findall(pattern, README)
        self.assertTrue(found, pattern)
        return found

    def test_llama3_mtbf(self):
        llama = FM.LLAMA3
        job = llama["days"] * 24 / llama["unexpected"]
        self.assertIn(f"{job:.2f} h", README)
        self.assertIn(f"{job * llama['gpus']:,.0f} h", README)
        self.assertIn(f"{FM.job_mtbf(job * llama['gpus'], 100_000) * 60:.0f} minutes", README)
        self.assertIn(f"{llama['days'] * 24 / llama['interruptions']:.2f} h", README)

    def test_intervals_and_goodput(self):
        llama = FM.LLAMA3
        mtbf = llama["days"] * 24 / llama["unexpected"] * HOUR
        young = FM.young_interval(60.0, mtbf)
        self.assertIn(f"{young:,.0f} s", README)
        self.assertIn(f"{FM.daly_interval(60.0, mtbf):,.0f} s", README)
        work = llama["days"] * 24 * HOUR
        self.assertIn(f"{FM.goodput(work, young, 60.0, 600.0, mtbf):.1%}", README)
        self.assertIn(f"{FM.goodput(work, young, 60.0, 0.0, mtbf):.1%}", README)
        fast = FM.young_interval(10.0, mtbf)  # an asynchronous save blocking for 10 s
        self.assertIn(f"**{FM.goodput(work, fast, 10.0, 600.0, mtbf):.1%}**", README)

    def test_the_model_reproduces_dalys_optima(self):
        for mtbf, printed, half in C.DALY_FIGURES:
            best = FM.best_interval(500 * HOUR, 300.0, 600.0, mtbf) / 60
            with self.subTest(mtbf=mtbf):
                self.assertLessEqual(abs(best - printed), half)
                self.assertIn(f"**{best:.2f}**", README)

    def test_the_25_hour_run(self):
        work, mtbf = 25 * HOUR, 24 * HOUR
        none = FM.expected_wall_time(work, work, 0.0, 600.0, mtbf)
        young = FM.young_interval(60.0, mtbf)
        saved = FM.expected_wall_time(work, young, 60.0, 600.0, mtbf)
        self.assertIn(f"{none / HOUR:.1f} h", README)
        self.assertIn(f"{work / none:.0%}", README)
        self.assertIn(f"{math.exp(-25 / 24):.0%}", README)
        self.assertIn(f"{saved / HOUR:.1f} h", README)
        self.assertIn(f"{young:,.0f} s", README)
        checks, metrics = C.simulation_checks()
        self.assertTrue(all(c.passed for c in checks), [c.detail for c in checks])
        for label in ("no checkpoint", "Young's interval"):
            sim = metrics[label]
            # the README quotes the simulated means; another libm may move the last digit
            self.assertTrue(any(abs(float(x) - sim["simulated_h"]) <= 0.02
                                for x in self.quoted(r"simulated ([0-9.]+) h")), label)


if __name__ == "__main__":
    unittest.main()
