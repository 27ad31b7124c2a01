"""The course runner and test discovery, as the README documents them."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

from lessons._testing import alive, descendants, launch_once
from tests._course import REPO_ROOT, lessons


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


@launch_once
def shared_course_run() -> tuple[subprocess.CompletedProcess, dict]:
    """`course run 01 04 12 --json PATH --demo-args "--device cpu"`, once, in one process:
    (the process, its summary). Shared by two tests: one checks lesson 01's row and the table,
    the other compares 04's and 12's reports with isolated runs (a `course run` process pays
    for torch and a forkserver before its first demo). A failure is not run again."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "shared.json"
        proc = run("-m", "course", "run", "01", "04", "12", "--json", str(summary),
                   "--demo-args", "--device cpu")
        if proc.returncode != 0:
            raise AssertionError(f"course run 01 04 12 exited {proc.returncode}: {proc.stdout + proc.stderr}")
        return proc, json.loads(summary.read_text())


class TestDiscovery(unittest.TestCase):
    def test_root_discovery_finds_every_lesson_suite(self):
        suite = unittest.TestLoader().discover(str(REPO_ROOT), top_level_dir=str(REPO_ROOT))
        ids = set()
        stack = [suite]
        while stack:
            item = stack.pop()
            if isinstance(item, unittest.TestSuite):
                stack.extend(item)
            else:
                self.assertNotIsInstance(item, unittest.loader._FailedTest, str(item))
                ids.add(item.id())
        for lesson in lessons():
            prefix = lesson["paths"]["tests"].replace("/", ".") + "."
            self.assertTrue(any(test_id.startswith(prefix) for test_id in ids), prefix)

    def test_single_lesson_discovery_as_documented(self):
        for lesson in lessons():
            suite = unittest.TestLoader().discover(lesson["paths"]["tests"].split("/tests")[0],
                                                   top_level_dir=str(REPO_ROOT))
            self.assertGreater(suite.countTestCases(), 0, lesson["folder"])


class TestCourseCommands(unittest.TestCase):
    def test_course_run_chosen_lessons(self):
        proc, data = shared_course_run()
        self.assertTrue(data["passed"])
        self.assertEqual([row["lesson"] for row in data["lessons"]], ["01", "04", "12"])
        self.assertIn("ring all-reduce", data["lessons"][0]["headline"])
        self.assertIn("3 of 3 lesson demos passed", proc.stdout)

    def test_course_run_reports_a_failing_demo(self):
        # a demo that fails (a crashing rank) must make `course run` fail, not pass quietly
        proc = run("-m", "course", "run", "01", "--demo-args",
                   "--world-size 2 --numel 8 --fault crash --fault-rank 1")
        self.assertEqual(proc.returncode, 1, proc.stdout)
        self.assertIn("FAIL", proc.stdout)
        self.assertIn("rank 1 failed", proc.stdout)
        self.assertIn("0 of 1 lesson demos passed", proc.stdout)

    def test_in_one_process_and_isolated_give_the_same_reports(self):
        # course/demos.py: the same checks and metrics whether the demos share this process (and
        # its forkserver) or each gets a fresh one; only timings differ. 04 and 12 run after
        # 01 in the shared process.
        _, shared = shared_course_run()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "isolated.json"
            proc = run("-m", "course", "run", "04", "12", "--json", str(path), "--isolated",
                       "--demo-args", "--device cpu")
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            isolated = json.loads(path.read_text())
        self.assertTrue(shared["in_one_process"])
        self.assertFalse(isolated["in_one_process"])
        shared_rows = {row["lesson"]: row for row in shared["lessons"]}
        self.assertEqual([row["lesson"] for row in isolated["lessons"]], ["04", "12"])
        for alone in isolated["lessons"]:
            shared_row = shared_rows[alone["lesson"]]
            self.assertEqual(shared_row["checks"], alone["checks"])
            self.assertGreater(shared_row["checks"], 10)
            untimed = [{k: v for k, v in row["metrics"].items() if "seconds" not in k}
                       for row in (shared_row, alone)]
            self.assertEqual(untimed[0], untimed[1], shared_row["folder"])
            self.assertGreater(len(untimed[0]), 3, shared_row["folder"])

    @unittest.skipUnless(sys.platform.startswith("linux"), "uses /proc")
    def test_a_hung_demo_is_stopped_at_its_timeout_and_leaves_no_process(self):
        # in one process, a demo past --timeout is interrupted; its launch kills its ranks, the
        # table says so, and the runner's forkserver ends with it (12 s: on a heavily loaded
        # machine starting the forkserver and two ranks has taken more than 6)
        proc = subprocess.Popen(
            [sys.executable, "-m", "course", "run", "01", "--timeout", "12", "--demo-args",
             "--world-size 2 --numel 8 --fault hang --timeout 120"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: set[int] = set()
        started = time.monotonic()
        while proc.poll() is None and time.monotonic() - started < 90:
            seen.update(descendants(proc.pid))
            time.sleep(0.1)
        output = proc.communicate(timeout=30)[0]
        self.assertEqual(proc.returncode, 1, output)
        self.assertIn("FAIL (exit 124)", output)
        self.assertIn("stopped after 12 s", output)
        self.assertLess(time.monotonic() - started, 60)
        self.assertGreaterEqual(len(seen), 3, "the forkserver and two ranks were never seen")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in seen):
            time.sleep(0.1)
        self.assertEqual([pid for pid in seen if alive(pid)], [])

    def test_course_grade_one_exercise(self):
        # the command line end to end on a real lesson; one exercise's tests only (lesson 08's
        # whole suite already runs in this CI, and tests/test_exercises.py grades whole lessons)
        proc = run("-m", "course", "grade", "08", "--exercise", "planner", timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("08_offload", proc.stdout)
        self.assertRegex(proc.stdout, r"planner\s.*PASSED")
        self.assertIn("3 of 3 points", proc.stdout)

    def test_gpu_suite_is_blocked_without_a_gpu(self):
        # the CPU suite hides every GPU (conftest.py), so the GPU suite must say "blocked"
        proc = run("-m", "course", "gpu", "01", timeout=120)
        self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
        self.assertIn("the GPU suite is blocked", proc.stdout)

    def test_gpu_world_sizes(self):
        from course.__main__ import gpu_world_size
        multi = {"default_ranks": 4, "min_ranks": 1}
        self.assertEqual(gpu_world_size(multi, 1), 1)
        self.assertEqual(gpu_world_size(multi, 2), 2)
        self.assertEqual(gpu_world_size(multi, 8), 4)
        self.assertEqual(gpu_world_size({"default_ranks": 1, "min_ranks": 1}, 8), 1)
        self.assertIsNone(gpu_world_size({"default_ranks": 4, "min_ranks": 2}, 1))

    def test_unknown_lesson_is_an_error(self):
        proc = run("-m", "course", "run", "42")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("unknown lesson '42'", proc.stderr)


if __name__ == "__main__":
    unittest.main()
