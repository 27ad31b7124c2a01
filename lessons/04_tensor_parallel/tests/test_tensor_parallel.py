"""Lesson 04's suite: shards, byte formulas, the parallel block against the dense one on 1, 2
and 4 ranks (with and without sequence parallelism), what the checks catch, and the CLI."""

from __future__ import annotations

import importlib
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes

M = importlib.import_module("lessons.04_tensor_parallel.main")
W = importlib.import_module("lessons.04_tensor_parallel.tests.workers")


class TestShardsAndFormulas(unittest.TestCase):
    def test_shards_tile_the_weight(self):
        weight = torch.arange(24.0).reshape(4, 6)
        self.assertTrue(torch.equal(torch.cat([M.shard_rows(weight, r, 2) for r in range(2)]), weight))
        self.assertTrue(torch.equal(torch.cat([M.shard_cols(weight, r, 3) for r in range(3)], 1),
                                    weight))

    def test_bytes_formula(self):
        self.assertEqual(M.tp_bytes_per_block(8, 2, 16, 4, 8, False), 12288)
        self.assertEqual(M.tp_bytes_per_block(8, 2, 16, 4, 8, True), 13440)
        self.assertEqual(M.tp_bytes_per_block(8, 2, 16, 1, 8, True), 0)
        self.assertEqual(M.layernorm_activation_elements(8, 2, 16, 4, False), 512)
        self.assertEqual(M.layernorm_activation_elements(8, 2, 16, 4, True), 128)

    def test_readme_numbers(self):
        readme = Path(M.__file__).with_name("README.md").read_text()
        for value in (M.tp_bytes_per_block(8, 2, 16, 4, 8, False),
                      M.tp_bytes_per_block(8, 2, 16, 4, 8, True)):
            self.assertIn(f"**{value:,} bytes**", readme)
        self.assertIn("from 512 to 128 elements", readme)

    def test_attention_is_causal(self):
        q = k = v = torch.randn(5, 1, 4, dtype=torch.float64)
        out = M.causal_attention(q, k, v, 2)
        changed = v.clone()
        changed[4] += 1  # the last position must not affect earlier outputs
        self.assertTrue(torch.equal(M.causal_attention(q, k, changed, 2)[:4], out[:4]))


class TestAgainstDense(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.all_checks, world, (8, 2, 16, 4), device="cpu", timeout_s=60)
                       for world in (1, 2, 4)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_sequence_parallel_sends_the_same_activation_bytes(self):
        metrics = self.results[4][0]["metrics"]
        self.assertEqual(metrics["tp"]["forward_bytes"], metrics["sp"]["forward_bytes"])


class TestWhatChecksCatch(unittest.TestCase):
    def test_missing_sequence_parallel_gradient_all_reduce(self):
        gaps = launch(W.sp_without_grad_all_reduce, 2, device="cpu", timeout_s=60)
        self.assertGreater(max(gaps), 1e3 * M.TOLERANCE)

    def test_heads_not_divisible(self):
        with self.assertRaisesRegex(ValueError, "must be divisible"):
            M.TensorParallelBlock(M.make_dense(0, 12, 3), 0, 2)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--heads", "3", "--world-size", "2"],
                              "not divisible")
        assert_argument_error(self, M.parse_args, ["--seq", "6", "--world-size", "4"], "--seq 6")
        assert_argument_error(self, M.parse_args, ["--hidden", "10", "--heads", "4"], "--hidden 10")


if __name__ == "__main__":
    unittest.main()
