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

from lessons._launch import launch
from lessons._testing import (
    REPO_ROOT,
    assert_argument_error,
    exercise,
    processes_mentioning,
    rank_of,
    spawned_workers,
)

M = importlib.import_module("lessons.14_fault_tolerance.main")  # detection
FM = importlib.import_module("lessons.14_fault_tolerance.failure_model")
I = importlib.import_module("lessons.14_fault_tolerance.integrity")  # noqa: E741
R = importlib.import_module("lessons.14_fault_tolerance.recovery")
C = importlib.import_module("lessons.14_fault_tolerance.checks")
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

    def test_the_rank_that_never_entered_is_named(self):
        e = self.entry
        dumps = self.dumps({0: [e(56), e(57, state="entered")], 1: [e(56), e(57, state="entered")],
                            2: [e(55), e(56)]}, steps={2: 4})
        verdict = M.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("behind", [2]),
                         "ranks 0 and 1 wait in #57; rank 2's last is #56: rank 2 is behind")
        for part in ("rank 2 at step 4", "all_reduce #56", "#57", "[0, 1]"):
            self.assertIn(part, verdict["message"])

    def test_a_subgroup_is_compared_among_its_members_only(self):
        e = self.entry
        # ranks 0 and 2 share a subgroup; rank 1 is not in it and has done 40 collectives on
        # a group of its own (seq numbers count per group: 40 is no later than 3)
        dumps = self.dumps({0: [e(9), e(3, op="broadcast", group=(0, 2), state="entered")],
                            1: [e(9), e(40, group=(1,))],
                            2: [e(9), e(2, op="broadcast", group=(0, 2))]})
        verdict = M.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("behind", [2]),
                         "rank 1 is not in group [0, 2]: only 0 and 2 count, and rank 2 is behind")
        self.assertIn("broadcast #3 on group [0, 2]", verdict["message"])

    def test_a_different_collective_at_the_same_seq_is_a_mismatch(self):
        e = self.entry
        dumps = self.dumps({0: [e(7, state="entered")], 1: [e(7, state="entered")],
                            2: [e(7, op="broadcast", state="entered")]})
        verdict = M.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("mismatch", [2]))
        sizes = self.dumps({0: [e(7, group=(0, 1), state="entered")],
                            1: [e(7, group=(0, 1), state="entered", sizes=((5,),))]})
        self.assertEqual(M.diagnose(sizes)["kind"], "mismatch", "same op, other sizes: a mismatch")
        self.assertEqual(M.diagnose(sizes)["culprits"], [0, 1], "a tie names both")

    def test_everyone_waiting_in_one_collective_is_a_transport_hang(self):
        e = self.entry
        verdict = M.diagnose(self.dumps({r: [e(7, state="entered")] for r in range(3)}))
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("waiting", []))

    def test_a_missing_heartbeat_is_a_dead_rank(self):
        e = self.entry
        dumps = self.dumps({0: [e(3)], 2: [e(3)]})
        dumps.insert(1, None)
        verdict = M.diagnose(dumps)
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("dead", [1]))

    def test_no_collective_pending_names_the_rank_at_the_lowest_step(self):
        e = self.entry
        verdict = M.diagnose(self.dumps({0: [e(3)], 1: [e(3)], 2: [e(3)]}, steps={1: 2}))
        self.assertEqual((verdict["kind"], verdict["culprits"]), ("stuck", [1]))


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
                self.assertIsNone(verdict["healthy"])
        self.assertNotIn("subgroup", results[0])


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
                self.assertTrue(stop)
                self.assertTrue(20.0 < left <= 25.0, f"rank 2's grace, got {left}")

    def test_a_save_that_does_not_fit_is_not_started(self):
        for rank, result in enumerate(self.results):
            with self.subTest(rank=rank):
                self.assertFalse(result["skipped"], "1.5 s left, 2 s predicted: skip the save")
                self.assertEqual(result["latest_after_skip"], "step-00000002",
                                 "the previous checkpoint stays `latest`")
                self.assertTrue(result["saved"], "2.5 s left, 2 s predicted: save")
                self.assertEqual(result["latest_after_save"], "step-00000003")


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
        self.assertIsNone(I.name_straggler([0.05, 0.06, 0.052, 0.055], [0.07] * 4)["straggler"])
        # 3x the median but 0.02 s: below the floor
        self.assertIsNone(I.name_straggler([0.01, 0.03, 0.01], [0.03] * 3)["straggler"])
        self.assertEqual(I.name_straggler([0.01, 0.01, 0.2, 0.01], [0.2] * 4)["straggler"], 2)

    def test_two_ranks_compare_with_each_other_and_one_rank_with_nobody(self):
        # the median of both (0.145) would hide it: the reference is the OTHER rank
        self.assertEqual(I.name_straggler([0.27, 0.02], [0.28, 0.28])["straggler"], 0)
        self.assertIsNone(I.name_straggler([0.27], [0.28])["straggler"])

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
        if shutil.which("py-spy") is None:
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
