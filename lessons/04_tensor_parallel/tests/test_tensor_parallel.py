"""Lesson 04's suite: shards, the cost model, the parallel blocks against the dense one on 1-4
ranks (tensor parallel, sequence parallel keeping the gathered input, sequence parallel saving
the shard), sub-groups on torch's collectives, what the checks catch, the CLI and torchrun."""

from __future__ import annotations

import importlib
import re
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes, run_under_torchrun

M = importlib.import_module("lessons.04_tensor_parallel.main")
C = importlib.import_module("lessons.04_tensor_parallel.checks")
W = importlib.import_module("lessons.04_tensor_parallel.tests.workers")
README = Path(M.__file__).with_name("README.md")


def readme_text() -> str:
    """The README with every run of whitespace one space (numbers may wrap across lines)."""
    return " ".join(README.read_text().split())


class TestShardsAndFormulas(unittest.TestCase):
    def test_shards_tile_the_weight(self):
        weight = torch.arange(24.0).reshape(4, 6)
        self.assertTrue(torch.equal(torch.cat([M.shard_rows(weight, r, 2) for r in range(2)]), weight))
        self.assertTrue(torch.equal(torch.cat([M.shard_cols(weight, r, 3) for r in range(3)], 1),
                                    weight))

    def test_bytes_formula(self):
        self.assertEqual(M.tp_bytes_per_block(8, 2, 16, 1, 8, True, True), 0)
        # sequence parallel sends what tensor parallel sends, plus the 6h gradient all-reduce;
        # saving the shard adds one all-gather of S per region (2 per block)
        s_bytes = 9 * 2 * 24 * 8
        self.assertEqual(M.tp_bytes_per_block(9, 2, 24, 3, 8, False), 4 * 2 * 2 * s_bytes // 3)
        self.assertEqual(M.tp_bytes_per_block(9, 2, 24, 3, 8, True)
                         - M.tp_bytes_per_block(9, 2, 24, 3, 8, False), 2 * 2 * 6 * 24 * 8 // 3)
        self.assertEqual(M.tp_bytes_per_block(9, 2, 24, 3, 8, True, True)
                         - M.tp_bytes_per_block(9, 2, 24, 3, 8, True), 2 * 2 * s_bytes // 3)

    def test_saved_bytes_formula_against_korthikanti(self):
        """Without the dropout terms, Korthikanti et al.'s sbh(34/t + 5as/(ht)) in 16-bit is
        sbh(32/t + 2as/(ht)): our save-the-shard form in bytes of 2, up to the small terms."""
        s, b, h, a, t = 2048, 1, 4096, 32, 8
        ours = M.saved_activation_bytes(s, b, h, a, t, 2, True, True)
        small = 2 * 4 * s * b // t + s * s  # LayerNorm statistics and the causal mask
        self.assertEqual(ours - small, s * b * h * (32 // t) + 2 * a * s * s * b // t)
        # plain TP keeps sbh(8 + 24/t) + 2as^2b/t: Korthikanti's 10 + 24/t less the 2 masks
        tp = M.saved_activation_bytes(s, b, h, a, t, 2, False)
        self.assertEqual(tp - 2 * 4 * s * b - s * s, s * b * h * (8 + 24 // t) + 2 * a * s * s * b // t)

    def test_attention_is_causal(self):
        q = k = v = torch.randn(5, 1, 4, dtype=torch.float64)
        out = M.causal_attention(q, k, v, 2)
        changed = v.clone()
        changed[4] += 1  # the last position must not affect earlier outputs
        self.assertTrue(torch.equal(M.causal_attention(q, k, changed, 2)[:4], out[:4]))

    def test_heads_not_divisible(self):
        with self.assertRaisesRegex(ValueError, "must be divisible"):
            M.TensorParallelBlock(C.make_dense(0, 12, 3), M.TensorParallelGroup(rank=0, size=2))


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed (integers: the same on any CPU)."""

    def test_worked_example(self):
        text = readme_text()
        for form in ((False, False), (True, False), (True, True)):
            self.assertIn(f"**{M.tp_bytes_per_block(8, 2, 16, 4, 8, *form):,} bytes**", text)
            self.assertIn(f"{M.saved_activation_bytes(8, 2, 16, 4, 4, 8, *form):,} bytes saved", text)
        self.assertEqual(M.layernorm_activation_elements(8, 2, 16, 4, False), 512)
        self.assertEqual(M.layernorm_activation_elements(8, 2, 16, 4, True), 128)
        self.assertIn("from 512 to 128 elements", text)

    def test_large_example(self):
        text = readme_text()
        s, b, h, a, t = 4096, 1, 8192, 64, 8
        for form in ((False, False), (True, False), (True, True)):
            mib = M.saved_activation_bytes(s, b, h, a, t, 2, *form) / 2**20
            self.assertIn(f"{mib:,.0f} MiB", text)

    def test_exercise_4_command_parses(self):
        command = re.search(r"main\.py (--world-size 3[^`]*)`", text := readme_text())
        self.assertIsNotNone(command, "exercise 4's command")
        args = C.parse_args(command.group(1).split())
        self.assertEqual((args.world_size, args.heads), (3, 6))
        self.assertIn("--world-size 3", text)


class TestAgainstDense(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        sizes = {1: (8, 2, 16, 4), 2: (8, 2, 16, 4), 3: (9, 2, 24, 6), 4: (8, 2, 16, 4)}
        cls.results = {world: launch(W.all_checks, world, sizes[world], device="cpu", timeout_s=90)
                       for world in sizes}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_sequence_parallel_sends_the_same_activation_bytes(self):
        metrics = self.results[4][0]["metrics"]
        self.assertEqual(metrics["tp"]["forward_bytes"], metrics["sp"]["forward_bytes"])
        self.assertEqual(metrics["sp"]["forward_bytes"], metrics["sp_shard_saved"]["forward_bytes"])

    def test_missing_sequence_parallel_gradient_all_reduce_is_caught(self):
        gaps = [result["gap_without_sp_all_reduce"] for result in self.results[2]]
        self.assertGreater(max(gaps), 1e3 * C.TOLERANCE)

    def test_sub_groups_on_torch_collectives(self):
        """Two tensor-parallel groups of 2 in a world of 4 (a mesh's TP dimension) on
        torch.distributed's collectives: each group's block equals the dense one."""
        results = [result["sub_groups"] for result in self.results[4]]
        self.assertEqual([(r[0]["tp_rank"], r[0]["tp_size"]) for r in results],
                         [(0, 2), (1, 2), (0, 2), (1, 2)])
        for per_rank in results:
            for save_shard, result in zip((False, True), per_rank):
                self.assertEqual(result["bytes_counted"], 0)  # torch's collectives: not counted
                for key in ("out_gap", "input_grad_gap", "ln_grad_gap"):
                    self.assertLessEqual(result[key], C.TOLERANCE, (save_shard, key))

    def test_saving_the_shard_saves_what_it_should(self):
        """Keeping the gathered input costs 2 (s b h - s b h / p) elements more than saving the
        shard: the QKV and up inputs, whole instead of 1/p."""
        for world, (seq, batch, hidden) in ((2, (8, 2, 16)), (3, (9, 2, 24)), (4, (8, 2, 16))):
            metrics = self.results[world][0]["metrics"]
            sbh = seq * batch * hidden
            self.assertEqual(metrics["sp"]["saved_bytes"] - metrics["sp_shard_saved"]["saved_bytes"],
                             2 * (sbh - sbh // world) * 8)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--heads", "3", "--world-size", "2"],
                              "not divisible")
        assert_argument_error(self, C.parse_args, ["--seq", "6", "--world-size", "4"], "--seq 6")
        assert_argument_error(self, C.parse_args, ["--hidden", "10", "--heads", "4"], "--hidden 10")

    def test_under_torchrun(self):
        report = run_under_torchrun(Path(M.__file__), ["--seq", "4", "--hidden", "8", "--heads", "2"],
                                    nproc_per_node=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"))


if __name__ == "__main__":
    unittest.main()
