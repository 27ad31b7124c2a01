"""The shared launcher under failure: a crashing, a hanging, an exiting and an externally
killed rank each end the run in bounded time, with an error naming the rank, and leave no
worker process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import unittest
from pathlib import Path
from unittest import mock

from lessons._launch import WorkerError, choose_device, launch
from lessons._testing import alive, rank_of, spawned_workers
from tests import _launch_workers as workers

REPO_ROOT = Path(__file__).resolve().parent.parent
LESSON01 = REPO_ROOT / "lessons" / "01_collectives" / "main.py"


@unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
class TestLauncherFailures(unittest.TestCase):
    DEADLINE = 8.0  # generous: CI runs this beside other suites on 2 cores

    def assert_no_workers_left(self):
        time.sleep(0.1)
        self.assertEqual(spawned_workers(os.getpid()), [])

    def test_results_come_back_in_rank_order_as_plain_data(self):
        results = launch(workers.sum_ranks, 3, device="cpu", timeout_s=30)
        self.assertEqual([r["rank"] for r in results], [0, 1, 2])
        self.assertEqual({r["total"] for r in results}, {6})
        self.assertEqual(len({r["pid"] for r in results}), 3)
        self.assert_no_workers_left()

    def test_crashing_rank_is_named(self):
        started = time.monotonic()
        with self.assertRaises(WorkerError) as caught:
            launch(workers.crash_on, 3, (1,), device="cpu", timeout_s=30)
        self.assertEqual(caught.exception.rank, 1)
        self.assertIn("rank 1 failed: ValueError: injected failure on rank 1",
                      str(caught.exception))
        self.assertLess(time.monotonic() - started, 30)
        self.assert_no_workers_left()

    def test_hanging_rank_is_named_within_the_deadline(self):
        started = time.monotonic()
        with self.assertRaises(WorkerError) as caught:
            launch(workers.hang_on, 3, (2,), device="cpu", timeout_s=self.DEADLINE)
        elapsed = time.monotonic() - started
        self.assertEqual(caught.exception.rank, 2)
        self.assertIn("hung", str(caught.exception))
        self.assertIn("hang_on", str(caught.exception))  # the frame it was stuck in
        # deadline + process start-up + the parent's grace; never the 30-minute gloo default
        self.assertLess(elapsed, self.DEADLINE + 10)
        self.assert_no_workers_left()

    def test_a_hang_names_the_configuration_and_the_worker(self):
        with self.assertRaises(WorkerError) as caught:
            launch(workers.hang_in_phase, 3, (1,), device="cpu", timeout_s=self.DEADLINE)
        message = str(caught.exception)
        self.assertEqual(caught.exception.rank, 1, message)
        self.assertIn("while 'ep=2 top_k=2'", message)  # the phase it hung in
        self.assertIn("in hang_in_phase (_launch_workers.py:", message)  # where it was stuck
        self.assertIn("[worker tests._launch_workers.hang_in_phase, 3 ranks]", message)
        # the two peers waiting in the barrier are symptoms, named briefly, not in full
        self.assertIn("ranks 0, 2 then failed in communication", message)
        self.assert_no_workers_left()

    def test_rank_killed_by_a_signal_is_named(self):
        with self.assertRaises(WorkerError) as caught:
            launch(workers.die_on, 3, (0,), device="cpu", timeout_s=30)
        self.assertEqual(caught.exception.rank, 0)
        self.assertIn("killed by signal SIGKILL", str(caught.exception))
        self.assert_no_workers_left()

    def test_tensor_results_are_refused(self):
        with self.assertRaises(WorkerError) as caught:
            launch(workers.return_tensor, 2, device="cpu", timeout_s=30)
        self.assertIn("torch.Tensor", str(caught.exception))
        self.assert_no_workers_left()

    def test_both_start_methods_give_the_same_results(self):
        for method in ("forkserver", "spawn"):
            with self.subTest(method=method):
                results = launch(workers.sum_ranks, 2, device="cpu", timeout_s=60, method=method)
                self.assertEqual([r["total"] for r in results], [3, 3])
                self.assertEqual([r["threads"] for r in results], [1, 1])
                self.assertEqual({r["gloo_ifname"] for r in results}, {"lo"})
        self.assert_no_workers_left()

    def test_start_method_from_the_environment(self):
        from lessons._launch import start_method
        with mock.patch.dict(os.environ, {"COURSE_START_METHOD": "spawn"}):
            self.assertEqual(start_method(), "spawn")
        with mock.patch.dict(os.environ, {"COURSE_START_METHOD": "fork"}), \
                self.assertRaises(ValueError):
            start_method()

    def test_cuda_under_torchrun_needs_a_gpu_per_local_rank(self):
        env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
        with mock.patch.dict(os.environ, env), mock.patch("torch.cuda.device_count", return_value=1):
            with self.assertRaises(ValueError) as caught:
                choose_device("cuda", 4)
            self.assertEqual(str(caught.exception),
                             "torchrun --nproc-per-node=2 needs 2 GPU(s) on this node, found 1")
            self.assertEqual(choose_device("auto", 4), ("cpu", "gloo"))
        with mock.patch.dict(os.environ, env), mock.patch("torch.cuda.device_count", return_value=2):
            self.assertEqual(choose_device("auto", 4), ("cuda", "nccl"))

    def test_an_extra_launch_without_its_gpus_runs_on_the_cpu(self):
        from lessons._launch import device_for_extra_ranks
        with mock.patch.dict(os.environ, {}, clear=False), \
                mock.patch("torch.cuda.device_count", return_value=1):
            for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                os.environ.pop(name, None)
            self.assertEqual(device_for_extra_ranks("cuda", 2), "cpu")  # 2 ranks, 1 GPU
            self.assertEqual(device_for_extra_ranks("cuda", 1), "cuda")
            self.assertEqual(device_for_extra_ranks("auto", 2), "cpu")
            self.assertEqual(device_for_extra_ranks("cpu", 1), "cpu")
            with self.assertRaises(ValueError):
                device_for_extra_ranks("tpu", 1)  # a bad device is still refused

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            launch(workers.sum_ranks, 0)
        with self.assertRaises(ValueError):
            choose_device("tpu", 1)
        self.assertEqual(choose_device("cpu", 4), ("cpu", "gloo"))


@unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
class TestKillOneWorkerOfTheDemo(unittest.TestCase):
    """Issue 2's 'done means': SIGKILL one worker of lesson 01 mid-run from outside."""

    def test_external_sigkill(self):
        proc = subprocess.Popen(
            [sys.executable, str(LESSON01), "--world-size", "3", "--numel", "100",
             "--fault", "hang", "--fault-rank", "2", "--timeout", "60"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ranks: dict[int, int] = {}
            deadline = time.monotonic() + 60
            while len(ranks) < 3 and time.monotonic() < deadline:
                ranks = {rank: pid for pid in spawned_workers(proc.pid)
                         if (rank := rank_of(pid)) is not None}
                time.sleep(0.1)
            self.assertEqual(sorted(ranks), [0, 1, 2], "workers did not start")
            time.sleep(1.0)  # let them reach the collective that rank 2 never joins
            pids = list(ranks.values())
            os.kill(ranks[1], signal.SIGKILL)
            killed_at = time.monotonic()
            _, stderr = proc.communicate(timeout=30)
            elapsed = time.monotonic() - killed_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        self.assertEqual(proc.returncode, 1)
        self.assertIn("rank 1 failed: killed by signal SIGKILL", stderr)
        self.assertNotIn("Traceback", stderr)
        self.assertLess(elapsed, 10)
        self.assertEqual([pid for pid in pids if alive(pid)], [])


    def test_workers_exit_when_the_launcher_is_killed(self):
        script = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r})\n"
                  "from lessons._launch import launch\n"
                  "from tests._launch_workers import hang_on\n"
                  "if __name__ == '__main__':\n"
                  "    launch(hang_on, 2, (0,), device='cpu', timeout_s=120)\n")
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
        try:
            deadline = time.monotonic() + 60
            workers_seen: list[int] = []
            while len(workers_seen) < 2 and time.monotonic() < deadline:
                workers_seen = [pid for pid in spawned_workers(proc.pid) if rank_of(pid) is not None]
                time.sleep(0.1)
            self.assertEqual(len(workers_seen), 2)
            proc.kill()  # the launcher dies without any chance to clean up
            proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists()
                                                      for pid in workers_seen):
                time.sleep(0.1)
            self.assertFalse([pid for pid in workers_seen if Path(f"/proc/{pid}").exists()])
        finally:
            if proc.poll() is None:
                proc.kill()


class TestTorchrun(unittest.TestCase):
    """Under torchrun the lesson joins the group torchrun made instead of spawning."""

    def test_the_group_is_created_once_per_process(self):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             str(REPO_ROOT / "tests" / "_launch_workers.py")],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])
        self.assertEqual(proc.stdout.count("same group in both launches, destroyed at exit"), 2,
                         proc.stdout)


if __name__ == "__main__":
    unittest.main()
