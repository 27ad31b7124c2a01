"""Lesson 03's suite: the memory arithmetic, sharding edges, every stage against plain DP,
one process, ZeroRedundancyOptimizer and FSDP2 on 1, 3 and 4 ranks (2 under torchrun), the
planted bugs each check must catch, the numbers the docs quote, and the CLI."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import tempfile
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes, run_under_torchrun

M = importlib.import_module("lessons.03_zero.main")  # the technique
C = importlib.import_module("lessons.03_zero.checks")  # the proof
W = importlib.import_module("lessons.03_zero.tests.workers")
README = Path(M.__file__).with_name("README.md").read_text()


class TestDocNumbers(unittest.TestCase):
    """Every number the README quotes, from the code (integer and float64 arithmetic: the same
    on every CPU)."""

    def test_paper_example(self):
        table = M.memory_table_gb(7.5e9, 64)
        self.assertAlmostEqual(table["baseline_gb"], 120.0)
        self.assertAlmostEqual(table["zero1_gb"], 31.40625)
        self.assertAlmostEqual(table["zero2_gb"], 16.640625)
        self.assertAlmostEqual(table["zero3_gb"], 1.875)
        for text in ("120 GB", "31.4 GB", "16.6 GB", "1.9 GB", "120.00, 31.41, 16.64, 1.88"):
            self.assertIn(text, README)

    def test_exercise_one_70b_in_80_gb(self):
        psi, budget = 70e9, 80e9
        for stage, floor in (("zero1", 4 * psi), ("zero2", 2 * psi)):  # never divided by N
            self.assertGreater(M.zero_bytes_per_device(stage, psi, 1 << 20), floor)
            self.assertGreater(floor, budget)
            self.assertIn(f"{floor / 1e9:.0f} GB", README)
        smallest = next(n for n in range(1, 1000) if M.zero_bytes_per_device("zero3", psi, n) <= budget)
        self.assertEqual(smallest, math.ceil(16 * psi / budget))
        self.assertIn(f"N_d = {smallest}", README)

    def test_readme_model_numbers(self):
        model = C.data_parallel.make_model(0, **C.SIZES)
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
        self.assertIn(f"{round(2 * 3 / 4 * psi * 8):,} would be the ideal", README)
        for stage in (0, 1, 2, 3):
            for value in C.expected_live_bytes(stage, psi, shard, 8).values():
                self.assertIn(f"{value:,} B", README)


class TestMemoryArithmetic(unittest.TestCase):
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
                self.assertEqual([a for a, _ in bounds[1:]], [b for _, b in bounds[:-1]])

    def test_expected_live_bytes(self):
        self.assertEqual(C.expected_live_bytes(0, 100, 25, 8), {"params": 800, "grads": 800,
                                                                "optimizer": 1600})
        self.assertEqual(C.expected_live_bytes(2, 100, 25, 8), {"params": 800, "grads": 200,
                                                                "optimizer": 400})
        self.assertEqual(C.expected_live_bytes(3, 100, 25, 8), {"params": 200, "grads": 200,
                                                                "optimizer": 400})

    def test_bad_stage(self):
        with self.assertRaisesRegex(ValueError, "stage must be"):
            M.ZeroAdam(C.data_parallel.make_model(0), 4)


class TestAgainstReferences(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.all_checks, world, (1, 2, 24), device="cpu", timeout_s=120)
                       for world in (1, 3, 4)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_zero3_sends_one_and_a_half_times_more(self):
        self.assertAlmostEqual(self.results[4][0]["metrics"]["zero3_over_zero1_bytes"], 1.5,
                               places=2)
        self.assertIsNone(self.results[1][0]["metrics"]["zero3_over_zero1_bytes"])

    def test_the_demo_under_torchrun(self):
        report = run_under_torchrun(Path(M.__file__), ["--quick", "--batch", "8"],
                                    nproc_per_node=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"))
        self.assertAlmostEqual(report["metrics"]["zero3_over_zero1_bytes"], 1.5, places=2)


class TestStagesAndPlantedBugs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = launch(W.stages_and_planted_bugs, 4, device="cpu", timeout_s=120)

    def test_zero_adam_builds_the_stage(self):
        self.assertEqual(self.results[0]["classes"], ["ZeroStage1", "ZeroStage2", "ZeroStage3"])

    def test_zero3_frees_full_weights(self):
        for rank, result in enumerate(self.results):
            lifetimes = result["lifetimes"]
            self.assertTrue(lifetimes["weights_dropped"], f"rank {rank}")
            self.assertTrue(lifetimes["full_params_freed"], f"rank {rank}")
            self.assertEqual(lifetimes["registered_params"], 0)
            self.assertEqual(lifetimes["regathered_left"], 0)
        self.assertEqual(self.results[3]["lifetimes"]["shard_sizes"][-1], 0)  # 3-element bias

    def test_weights_kept_after_forward_are_caught(self):
        self.assertFalse(self.results[0]["kept_weights"]["weights_dropped"])

    def test_missing_all_gather_is_caught(self):
        params = [torch.tensor(r["drifted_params"], dtype=torch.float64) for r in self.results]
        self.assertGreater(float((params[0] - params[1]).abs().max()), 1e3 * C.TOLERANCE)

    def test_kept_full_gradient_is_caught(self):
        for result in self.results:
            self.assertNotEqual(result["kept_grads"], result["expected_grads"])

    def test_clipping_by_the_shard_norm_is_caught(self):
        self.assertGreater(self.results[0]["local_clip_gap"], 1e3 * C.TOLERANCE)


class TestCommandLine(unittest.TestCase):
    def test_memory_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "m.json"
            with contextlib.redirect_stdout(io.StringIO()):
                code = C.main(["--memory", "--params", "70e9", "--dp", "512", "--json", str(path)])
            data = json.loads(path.read_text())
        self.assertEqual(code, 0)
        self.assertAlmostEqual(data["metrics"]["zero3_gb"], 16 * 70e9 / 512 / 1e9)
        self.assertLessEqual({"baseline_gb", "zero1_gb", "zero2_gb", "zero3_gb"},
                             set(data["metrics"]))

    def test_bad_arguments_exit_2(self):
        for argv, fragment in [(["--batch", "10", "--world-size", "4"], "not divisible"),
                               (["--memory", "--dp", "0"], "out of range"),
                               (["--memory", "--params", "-5"], "out of range"),
                               (["--device", "cuda", "--world-size", "64"], "needs 64 GPU")]:
            with self.subTest(argv=argv):
                assert_argument_error(self, C.parse_args, argv, fragment)


if __name__ == "__main__":
    unittest.main()
