"""Lesson 03's suite: the memory arithmetic, sharding edges, every stage against plain DP,
one process, ZeroRedundancyOptimizer and FSDP2 on 1, 2, 3 and 4 ranks, and the CLI."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import tempfile
import unittest
from pathlib import Path

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes

M = importlib.import_module("lessons.03_zero.main")
W = importlib.import_module("lessons.03_zero.tests.workers")
README = Path(M.__file__).with_name("README.md").read_text()


class TestMemoryArithmetic(unittest.TestCase):
    def test_paper_example(self):
        table = M.memory_table_gb(7.5e9, 64)
        self.assertAlmostEqual(table["baseline_gb"], 120.0)
        self.assertAlmostEqual(table["zero1_gb"], 31.40625)
        self.assertAlmostEqual(table["zero2_gb"], 16.640625)
        self.assertAlmostEqual(table["zero3_gb"], 1.875)
        for text in ("120 GB", "31.4 GB", "16.6 GB", "1.9 GB", "120.00, 31.41, 16.64, 1.88"):
            self.assertIn(text, README)

    def test_one_rank_shards_nothing(self):
        for stage in M.STAGES:
            self.assertEqual(M.zero_bytes_per_device(stage, 1000, 1), 16000)
        with self.assertRaises(ValueError):
            M.zero_bytes_per_device("zero4", 1, 1)

    def test_communication(self):
        self.assertEqual(M.zero_communication_elements("zero1", 10), 20)
        self.assertEqual(M.zero_communication_elements("zero3", 10), 30)

    def test_shards(self):
        self.assertEqual(M.shard_bounds(3, 4, 3), (3, 3))
        for numel in range(0, 30):
            for world in range(1, 7):
                bounds = [M.shard_bounds(numel, world, r) for r in range(world)]
                self.assertEqual(sum(b - a for a, b in bounds), numel)

    def test_expected_live_bytes(self):
        self.assertEqual(M.expected_live_bytes(0, 100, 25, 8), {"params": 800, "grads": 800,
                                                                "optimizer": 1600})
        self.assertEqual(M.expected_live_bytes(2, 100, 25, 8), {"params": 800, "grads": 200,
                                                                "optimizer": 400})
        self.assertEqual(M.expected_live_bytes(3, 100, 25, 8), {"params": 200, "grads": 200,
                                                                "optimizer": 400})

    def test_readme_model_numbers(self):
        model = M.DP.make_model(0, **M.SIZES)
        numels = [p.numel() for p in model.parameters()]
        psi = sum(numels)
        self.assertIn(f"Psi = {psi:,}", README)
        shard = sum(b - a for a, b in (M.shard_bounds(n, 4, 0) for n in numels))
        self.assertIn(f"Psi_r = {shard}", README)
        dp = M.expected_bytes_sent(1, numels, 8, 4, 0)
        z3 = M.expected_bytes_sent(3, numels, 8, 4, 0)
        self.assertIn(f"{dp:,} for plain DP", README)
        self.assertIn(f"{z3:,} for ZeRO-3", README)
        self.assertEqual(z3 / dp, 1.5)
        live = M.expected_live_bytes(1, psi, shard, 8)
        self.assertIn(f"{live['params']:,} B", README)
        self.assertIn(f"{live['optimizer']:,} B", README)


class TestAgainstReferences(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.all_checks, world, (1, 2, 24), device="cpu", timeout_s=120)
                       for world in (1, 2, 3, 4)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_zero3_sends_one_and_a_half_times_more(self):
        for world in (2, 4):
            self.assertAlmostEqual(self.results[world][0]["metrics"]["zero3_over_zero1_bytes"],
                                   1.5, places=2)


class TestZero3AndBrokenStages(unittest.TestCase):
    def test_zero3_frees_full_weights(self):
        results = launch(W.zero3_lifetimes, 4, device="cpu", timeout_s=60)
        for rank, result in enumerate(results):
            self.assertTrue(result["weights_dropped"], f"rank {rank}")
            self.assertEqual(result["registered_params"], 0)
            self.assertEqual(result["regathered_left"], 0)
        self.assertEqual(results[3]["shard_sizes"][-1], 0)  # the 3-element bias: rank 3 owns nothing

    def test_missing_all_gather_is_caught(self):
        params = launch(W.broken_zero1, 2, (4,), device="cpu", timeout_s=60)
        self.assertGreater(M.DP.max_abs_diff(params[0], params[1]), 1e3 * M.TOLERANCE)

    def test_bad_stage(self):
        with self.assertRaisesRegex(ValueError, "stage must be"):
            M.ZeroAdam(M.DP.make_model(0), 4)


class TestCommandLine(unittest.TestCase):
    def test_memory_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "m.json"
            with contextlib.redirect_stdout(io.StringIO()):
                code = M.main(["--memory", "--params", "70e9", "--dp", "512", "--json", str(path)])
            data = json.loads(path.read_text())
        self.assertEqual(code, 0)
        self.assertAlmostEqual(data["metrics"]["zero3_gb"], 16 * 70e9 / 512 / 1e9)
        self.assertLessEqual({"baseline_gb", "zero1_gb", "zero2_gb", "zero3_gb"},
                             set(data["metrics"]))

    def test_bad_arguments_exit_2(self):
        for argv, fragment in [(["--batch", "10", "--world-size", "4"], "not divisible"),
                               (["--memory", "--dp", "0"], "out of range"),
                               (["--memory", "--params", "-5"], "out of range")]:
            with self.subTest(argv=argv):
                assert_argument_error(self, M.parse_args, argv, fragment)


if __name__ == "__main__":
    unittest.main()
