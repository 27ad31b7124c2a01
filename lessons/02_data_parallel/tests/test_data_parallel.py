"""Lesson 02's suite: bucket assignment, then every DDP variant against the single-process run
and torch DDP on 1, 2, 3 and 4 ranks, then what the checks must catch, then the CLI."""

from __future__ import annotations

import importlib
import unittest

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes

M = importlib.import_module("lessons.02_data_parallel.main")
W = importlib.import_module("lessons.02_data_parallel.tests.workers")


class TestBuckets(unittest.TestCase):
    def test_reverse_order_and_cap(self):
        self.assertEqual(M.assign_buckets_by_size([8, 8, 8], 16), [[2, 1], [0]])
        self.assertEqual(M.assign_buckets_by_size([100, 1, 1], 10), [[2, 1, 0]])
        self.assertEqual(M.assign_buckets_by_size([5, 5, 5, 5], 1), [[3], [2], [1], [0]])
        self.assertEqual(M.assign_buckets_by_size([], 10), [])

    def test_every_parameter_in_exactly_one_bucket(self):
        sizes = [3, 70, 12, 1, 1, 400, 9]
        for cap in (1, 10, 50, 100, 1000):
            buckets = M.assign_buckets_by_size(sizes, cap)
            self.assertEqual(sorted(i for b in buckets for i in b), list(range(len(sizes))))
            for bucket in buckets[:-1]:  # every closed bucket reached the cap
                self.assertGreaterEqual(sum(sizes[i] for i in bucket), cap)

    def test_bytes_formula(self):
        self.assertEqual(M.ddp_bytes_per_rank(1000, 4, 4), 6000)
        self.assertEqual(M.ddp_bytes_per_rank(1000, 4, 1), 0)

    def test_local_shards_tile_the_batch(self):
        x = torch.arange(12.0).reshape(12, 1)
        self.assertTrue(torch.equal(torch.cat([M.local_shard(x, r, 3) for r in range(3)]), x))
        with self.assertRaisesRegex(ValueError, "not divisible"):
            M.local_shard(x, 0, 5)

    def test_readme_numbers(self):
        readme = (importlib.resources.files("lessons") / "02_data_parallel" / "README.md").read_text()
        params = 3 * (1024 * 1024 + 1024)
        self.assertIn(f"{params:,}", readme)
        self.assertIn(f"{M.ddp_bytes_per_rank(params, 4, 4) / 1e6:.1f} MB", readme)
        sizes = [1024 * 1024 * 4, 4096] * 3
        self.assertEqual(M.count_buckets(sizes, 1 << 20), 3)
        self.assertIn("3 buckets per step", readme)


class TestAgainstReferences(unittest.TestCase):
    """Every check of the demo, on 1, 2, 3 and 4 ranks (one launch each)."""

    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.all_checks, world, (3, 2, 12), device="cpu", timeout_s=90)
                       for world in (1, 2, 3, 4)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_bucket_count_reported(self):
        self.assertEqual(self.results[2][0]["metrics"]["buckets"], 3)


class TestWhatChecksCatch(unittest.TestCase):
    def test_missing_broadcast_leaves_ranks_different(self):
        params = launch(W.no_broadcast, 2, (5,), device="cpu", timeout_s=60)
        self.assertGreater(M.max_abs_diff(params[0], params[1]), 1e-3)

    def test_missing_average_is_p_times_too_large(self):
        summed = launch(W.sum_without_average, 2, (5,), device="cpu", timeout_s=60)[0]
        reference = M.make_model(5)
        x, y = M.global_batch(0, 8, 5)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        self.assertGreater(M.max_abs_diff(summed, grads), 1e3 * M.TOLERANCE)
        self.assertLess(M.max_abs_diff(torch.tensor(summed, dtype=torch.float64) / 2, grads), M.TOLERANCE)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments_exit_2(self):
        for argv, fragment in [(["--batch", "10", "--world-size", "4"], "not divisible"),
                               (["--steps", "0"], "out of range"),
                               (["--bucket-mb", "-1"], "out of range")]:
            with self.subTest(argv=argv):
                assert_argument_error(self, M.parse_args, argv, fragment)


if __name__ == "__main__":
    unittest.main()
