"""Lesson 09's suite: the SVD split, naive vs fused forward, Gram vs factored projections,
orthogonality under Adam, the sharded U and V sides on 1, 2, 4 and 5 ranks, the forgetting
demo, the benchmark's counts, the CLI."""

from __future__ import annotations

import importlib
import unittest
from pathlib import Path

import torch
import torch.nn as nn

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes

M = importlib.import_module("lessons.09_osft.main")
W = importlib.import_module("lessons.09_osft.tests.workers")


class TestSplit(unittest.TestCase):
    def test_rank_ratio_semantics(self):
        self.assertEqual(M.frozen_rank(24, 16, 0.5), 8)
        self.assertEqual(M.frozen_rank(24, 16, 0.99), 15)  # floor(15.84)
        self.assertEqual(M.frozen_rank(24, 16, 1.0), 15)  # capped: one direction stays trainable
        self.assertEqual(M.frozen_rank(10, 7, 0.0), 0)

    def test_split_reconstructs_and_is_orthonormal(self):
        weight = torch.randn(9, 6, dtype=torch.float64)
        parts = M.svd_split(weight, 0.5)
        self.assertEqual(parts["U_high"].shape, (9, 3))
        self.assertEqual(parts["V_low"].shape, (3, 6))
        rebuilt = (parts["U_high"] * parts["S_high"]) @ parts["V_high"] + \
            (parts["U_low"] * parts["S_low"]) @ parts["V_low"]
        self.assertLess(float((rebuilt - weight).abs().max()), M.TOLERANCE)
        self.assertTrue(bool(parts["S_high"].min() >= parts["S_low"].max()))

    def test_frozen_parts_are_not_parameters(self):
        layer = M.OSFTLinear(nn.Linear(6, 9), 0.5)
        self.assertEqual({n for n, _ in layer.named_parameters()}, {"U_low", "S_low", "V_low", "bias"})


class TestKernels(unittest.TestCase):
    def test_readme_quotes_the_orthogonality_demo(self):
        readme = Path(M.__file__).with_name("README.md").read_text()
        self.assertIn(f"**{M.train_orthogonal(300, False, 0)['orthogonality_error']:.2f}**", readme)

    def test_single_process_checks(self):
        checks, metrics = M.single_process_checks(1)
        for check in checks:
            with self.subTest(check=check.name):
                self.assertTrue(check.passed, check.detail)

    def test_fused_without_bias_and_3d_input(self):
        layer = nn.Linear(8, 5, bias=False).double()
        fused, naive = M.OSFTLinear(layer, 0.4), M.OSFTLinear(layer, 0.4, fused=False)
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        self.assertEqual(fused(x).shape, (2, 3, 5))
        self.assertLess(M.max_abs(fused(x) - naive(x)), M.TOLERANCE)

    def test_projection_removes_the_frozen_component(self):
        parts = M.svd_split(torch.randn(12, 10, dtype=torch.float64), 0.5)
        d_v = torch.randn(5, 10, dtype=torch.float64) + parts["V_high"][:5] * 3  # inside the frozen span
        v_left = M.project_v_factored(d_v, parts["V_high"]) @ parts["V_high"].T
        self.assertLess(M.max_abs(v_left), M.TOLERANCE)
        d_u = torch.randn(12, 5, dtype=torch.float64)
        u_left = parts["U_high"].T @ M.project_u_factored(d_u, parts["U_high"])
        self.assertLess(M.max_abs(u_left), M.TOLERANCE)

    def test_counts(self):
        self.assertEqual(M.projection_flops(1024, 1024, 512, 512),
                         {"gram": 4 * 1024 ** 2 * 1024, "factored": 4 * 2048 * 512 * 512})
        self.assertEqual(M.forward_cost(10, 4, 6, 2, 1)["extra_bytes_naive"], 3 * 10 * 4 * 4)


class TestSharded(unittest.TestCase):
    def test_shards_follow_torch_chunk_with_empty_tails(self):
        rows = torch.arange(6.0).view(6, 1)
        self.assertEqual([M.shard_rows(rows, r, 4).shape[0] for r in range(4)], [2, 2, 2, 0])
        self.assertEqual([M.shard_rows(rows, r, 5).shape[0] for r in range(5)], [2, 2, 2, 0, 0])
        self.assertTrue(torch.equal(torch.cat([M.shard_rows(rows, r, 4) for r in range(4)]), rows))

    def test_every_sharded_check_on_1_2_4_5_ranks(self):
        results = {world: launch(W.sharded, world, device="cpu", timeout_s=120) for world in (1, 2, 4, 5)}
        assert_every_check_passes(self, results)
        self.assertGreater(results[2][0]["metrics"]["v_wrong_gap"], 1e-3)
        readme = Path(M.__file__).with_name("README.md").read_text()
        self.assertIn(f"off by **{results[4][0]['metrics']['v_wrong_gap']:.1f}**", readme)

    def test_all_reduce_benchmark_runs(self):
        times = launch(W.all_reduce_bench, 2, device="cpu", timeout_s=60)[0]
        self.assertEqual(set(times), {"per_module_s", "batched_s"})


class TestContinualLearning(unittest.TestCase):
    def test_forgetting_is_reported_and_readme_quotes_the_run(self):
        result = M.continual_learning(0, 400)
        for key in ("forgetting_full_ft", "forgetting_osft", "acc_B_full_ft", "acc_B_osft"):
            self.assertIn(key, result)
        readme = Path(M.__file__).with_name("README.md").read_text()
        for key in ("acc_A_before", "acc_A_after_full_ft", "acc_A_after_osft", "acc_B_full_ft", "acc_B_osft"):
            self.assertIn(f"{result[key]:.1%}", readme, key)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--rank-ratio", "1.5"], "--rank-ratio")
        assert_argument_error(self, M.parse_args, ["--device", "cuda"], "runs on the CPU")
        assert_argument_error(self, M.parse_args, ["--steps", "5"], "--steps")
        assert_argument_error(self, M.parse_args, ["--bench-size", "10"], "--bench-size")


if __name__ == "__main__":
    unittest.main()
