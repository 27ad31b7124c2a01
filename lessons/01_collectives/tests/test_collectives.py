"""Lesson 01's suite: the formulas, then every collective against torch.distributed on
1, 2, 3 and 5 ranks, then the failure paths the docs promise."""

from __future__ import annotations

import importlib
import math
import re
import subprocess
import sys
import unittest
from pathlib import Path

import torch

from lessons._launch import WorkerError, launch
from lessons._report import merge_rank_checks
from lessons._testing import assert_argument_error

M = importlib.import_module("lessons.01_collectives.main")
# Spawned ranks import their function by module name, so the workers live in a module with a
# real dotted name (pytest may give this test file a different one).
W = importlib.import_module("lessons.01_collectives.tests.workers")
LESSON_DIR = Path(M.__file__).resolve().parent
REPO_ROOT = LESSON_DIR.parent.parent


# ----------------------------------------------------------------------------- pure functions


class TestChunksAndFormulas(unittest.TestCase):
    def test_chunk_sizes_cover_and_balance(self):
        for numel in range(0, 40):
            for world in range(1, 9):
                sizes = M.chunk_sizes(numel, world)
                self.assertEqual(sum(sizes), numel)
                self.assertLessEqual(max(sizes) - min(sizes), 1)
                bounds = M.chunk_bounds(numel, world)
                self.assertEqual(bounds[0][0], 0)
                self.assertEqual(bounds[-1][1], numel)
                for (_, end), (start, _) in zip(bounds, bounds[1:]):
                    self.assertEqual(end, start)

    def test_docs_examples_of_chunks(self):
        self.assertEqual(M.chunk_sizes(10, 4), [3, 3, 2, 2])
        self.assertEqual(M.chunk_sizes(2, 4), [1, 1, 0, 0])
        self.assertEqual(M.chunk_bounds(10, 4), [(0, 3), (3, 6), (6, 8), (8, 10)])

    def test_ring_bytes_equal_reference_formula_when_divisible(self):
        for world in (1, 2, 3, 4, 5, 8):
            for numel in (0, world, 7 * world):
                for rank in range(world):
                    exact = M.ring_bytes_sent(numel, 4, world, rank)["all_reduce"]
                    self.assertEqual(exact, M.ring_all_reduce_bytes_formula(numel * 4, world))

    def test_ring_bytes_uneven(self):
        # chunk sizes of 10 over 4: [3, 3, 2, 2]; rank 1 skips chunk 1 (3) and chunk 2 (2)
        self.assertEqual(M.ring_bytes_sent(10, 1, 4, 1),
                         {"reduce_scatter": 7, "all_gather": 8, "all_reduce": 15})

    def test_tree_bytes_total_is_p_minus_1_times_s(self):
        for world in range(1, 17):
            for root in range(world):
                total = sum(M.tree_broadcast_bytes_sent(100, world, root, rank)
                            for rank in range(world))
                self.assertEqual(total, (world - 1) * 100)
            rounds = math.ceil(math.log2(world)) if world > 1 else 0
            self.assertEqual(M.tree_broadcast_bytes_sent(100, world, 0, 0), rounds * 100)

    def test_recursive_doubling_bytes(self):
        self.assertEqual(M.recursive_doubling_bytes_sent(10, 8, 3), 30)
        # p = 5: q = 4; rank 0 folds rank 4 in and sends the result back; rank 4 sends once
        self.assertEqual([M.recursive_doubling_bytes_sent(10, 5, r) for r in range(5)],
                         [30, 20, 20, 20, 10])
        self.assertEqual(M.recursive_doubling_bytes_sent(10, 1, 0), 0)

    def test_alpha_beta_and_bus_bandwidth(self):
        self.assertAlmostEqual(M.alpha_beta_seconds("ring_all_reduce", 1000, 4, 1.0, 0.0), 6.0)
        self.assertAlmostEqual(M.alpha_beta_seconds("ring_all_reduce", 1000, 4, 0.0, 1.0), 1500.0)
        self.assertAlmostEqual(M.alpha_beta_seconds("recursive_doubling", 10, 8, 1.0, 0.1), 6.0)
        algbw, busbw = M.bus_bandwidth("all_reduce", 1e9, 0.1, 8)
        self.assertAlmostEqual(algbw, 1e10)
        self.assertAlmostEqual(busbw, 1.75e10)
        with self.assertRaises(ValueError):
            M.alpha_beta_seconds("gossip", 1, 2, 1, 1)

    def test_fit_alpha_beta_recovers_the_model(self):
        alpha, beta, world = 2e-5, 1e-9, 4
        rows = [{"bytes": size, "ours_s": M.alpha_beta_seconds("ring_all_reduce", size, world,
                                                               alpha, beta)}
                for size in (4096, 65536, 1 << 20, 1 << 24)]
        fitted_alpha, fitted_beta = M.fit_alpha_beta(rows, world)
        self.assertAlmostEqual(fitted_alpha / alpha, 1.0, places=6)
        self.assertAlmostEqual(fitted_beta / beta, 1.0, places=6)

    def test_ring_order_sum_is_the_ring_order(self):
        inputs = [torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32) for _ in range(3)]
        inputs[1] = torch.tensor([1.0, 1e8, 1.0], dtype=torch.float32)
        out = M.ring_order_sum(inputs)
        # chunk 0 lives on rank 0: x0 + (x2 + x1); float32 loses the 1.0 next to 2e8
        expected0 = inputs[0][0] + (inputs[2][0] + inputs[1][0])
        self.assertEqual(out[0].item(), expected0.item())

    def test_compare_catches_one_ulp_and_respects_the_bound(self):
        a = torch.tensor([1.0, 2.0])
        b = torch.nextafter(a, torch.tensor(3.0))
        self.assertFalse(M.compare(a, b, None)[0])
        self.assertTrue(M.compare(a, a.clone(), None)[0])
        abs_sum = torch.tensor([1.0, 2.0], dtype=torch.float64)
        bound = M.float_tolerance(abs_sum, 3, torch.float32)
        self.assertTrue(M.compare(a, a + bound.float() * 0.5, bound)[0])
        self.assertFalse(M.compare(a, a + bound.float() * 4, bound)[0])

    def test_merge_rank_checks_fails_if_one_rank_fails(self):
        ok = {"name": "x", "passed": True, "detail": "fine"}
        bad = {"name": "x", "passed": False, "detail": "off by one"}
        merged = merge_rank_checks([[ok], [bad], [ok]])
        self.assertFalse(merged[0].passed)
        self.assertIn("rank 1", merged[0].detail)

    def test_readme_worked_numbers_come_from_the_code(self):
        readme = (LESSON_DIR / "README.md").read_text()
        numbers = {
            "6,000": M.ring_all_reduce_bytes_formula(4000, 4),
            "8,000": M.recursive_doubling_bytes_sent(4000, 4, 0),
            "24,000": M.recursive_doubling_bytes_sent(4000, 64, 0),
            "7,875": M.ring_all_reduce_bytes_formula(4000, 64),
            "24,576": M.ring_bytes_sent(4096, 4, 4, 0)["all_reduce"],
            "6400 B": M.ring_bytes_sent(1000, 4, 5, 0)["all_reduce"],
            "16,000": 4 * 4000,
        }
        for text, value in numbers.items():
            self.assertIn(text, readme)
            self.assertEqual(float(re.sub(r"[^\d.]", "", text)), float(value), text)


# ----------------------------------------------------------------------------- against torch


class TestAgainstTorch(unittest.TestCase):
    """One launch per world size; every case's checks must pass on every rank."""

    WORLDS = (1, 2, 3, 5)

    @classmethod
    def setUpClass(cls):
        cls.results = {}
        for world in cls.WORLDS:
            cases = [(0, "int64"), (1, "int64"), (world - 1, "int32"), (world + 1, "int64"),
                     (1000, "float32"), (1001, "float64"), (37, "bfloat16"), (64, "float16")]
            cls.results[world] = launch(W.suite_worker, world, (cases,), device="cpu",
                                        timeout_s=60)

    def test_every_check_passes_on_every_rank(self):
        for world, per_rank in self.results.items():
            for index, case in enumerate(per_rank[0]):
                merged = merge_rank_checks([rank_result[index]["checks"]
                                            for rank_result in per_rank])
                for check in merged:
                    with self.subTest(world=world, case=case["case"], check=check.name):
                        self.assertTrue(check.passed, check.detail)

    def test_checks_are_all_there(self):
        names = [c["name"] for c in self.results[3][0][0]["checks"]]
        self.assertEqual(len(names), 10)
        self.assertTrue(any("bytes" in name for name in names))


class TestMultiProcessEdges(unittest.TestCase):
    def test_broken_ring_is_caught(self):
        results = launch(W.broken_ring_worker, 3, device="cpu", timeout_s=60)
        self.assertTrue(all(r["good"] for r in results))
        self.assertFalse(any(r["bad"] for r in results))

    def test_tree_broadcast_from_every_root(self):
        for flags in launch(W.all_roots_worker, 5, device="cpu", timeout_s=60):
            self.assertEqual(flags, [True] * 5)

    def test_wrong_chunk_size_names_the_rank(self):
        with self.assertRaises(WorkerError) as caught:
            launch(W.wrong_chunk_worker, 2, device="cpu", timeout_s=30)
        self.assertIn("ValueError", str(caught.exception))
        self.assertRegex(str(caught.exception), r"rank \d: chunk has \d+ elements, expected")


# ----------------------------------------------------------------------------- the CLI


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments_exit_2_with_one_error_line(self):
        for argv, fragment in [
            (["--world-size", "0"], "out of range"),
            (["--world-size", "two"], "not an integer"),
            (["--numel", "-1"], "out of range"),
            (["--dtype", "complex64"], "invalid choice"),
            (["--device", "tpu"], "invalid choice"),
            (["--fault", "crash", "--fault-rank", "4", "--world-size", "2"], "not a rank"),
            (["--timeout", "nan"], "not a finite number"),
        ]:
            with self.subTest(argv=argv):
                assert_argument_error(self, M.parse_args, argv, fragment)

    @unittest.skipIf(torch.cuda.device_count() >= 64, "needs fewer GPUs than --world-size")
    def test_cuda_without_gpus_is_an_argument_error(self):
        assert_argument_error(self, M.parse_args, ["--device", "cuda", "--world-size", "64"], "GPU")

    def test_script_bad_argument_has_no_traceback(self):
        proc = subprocess.run([sys.executable, str(LESSON_DIR / "main.py"), "--numel", "x"],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        self.assertEqual(proc.returncode, 2)
        self.assertNotIn("Traceback", proc.stderr)
        self.assertEqual(len(proc.stderr.strip().splitlines()[-1:]), 1)

    def test_crashing_rank_gives_one_clear_line(self):
        proc = subprocess.run([sys.executable, str(LESSON_DIR / "main.py"), "--world-size", "3",
                               "--numel", "10", "--fault", "crash", "--fault-rank", "2",
                               "--timeout", "30"],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        self.assertEqual(proc.returncode, 1)
        self.assertRegex(proc.stderr, r"error: rank 2 failed: RuntimeError: injected crash")
        self.assertNotIn("Traceback", proc.stderr)


if __name__ == "__main__":
    unittest.main()
