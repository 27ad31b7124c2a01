"""Lesson 07's suite: the tracker (against torch's MemTracker), bytes per parameter, the
activation formula, the loss scaler against GradScaler, recomputation, 8-bit Adam, the CLI."""

from __future__ import annotations

import importlib
import math
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes

M = importlib.import_module("lessons.07_memory.main")
W = importlib.import_module("lessons.07_memory.tests.workers")


class TestTracker(unittest.TestCase):
    def test_views_are_free_and_frees_are_seen(self):
        tracker = M.MemoryTracker()
        with tracker:
            a = torch.zeros(1000)  # 4,000 bytes
            view = a[10:20].view(2, 5)
            self.assertEqual(tracker.live_bytes, 4000)
            b = a * 2
            self.assertEqual(tracker.live_bytes, 8000)
            del a, view, b
        self.assertEqual(tracker.live_bytes, 0)
        self.assertEqual(tracker.peak_bytes, 8000)

    def test_host_bytes_are_not_device_bytes(self):
        tracker = M.MemoryTracker()
        with tracker:
            with tracker.phase("host"):
                host = torch.zeros(100)
            device = torch.zeros(50)
            self.assertEqual(tracker.live_bytes, 200)
            self.assertEqual(tracker.breakdown()["host"], 400)
            tracker.mark([host], "temporary")
            self.assertEqual(tracker.live_bytes, 600)
            del host, device

    def test_equal_to_torch_memtracker(self):
        result = M.compare_with_torch_memtracker(3)
        self.assertEqual(result["ours"], result["torch"])


class TestBytesPerParameter(unittest.TestCase):
    def test_each_recipe_matches_the_formula(self):
        for recipe in ("fp32_adam", "mixed_adam", "mixed_adam_fp32_accum"):
            with self.subTest(recipe=recipe):
                measured = M.measure_model_states(recipe)
                self.assertEqual(measured["bytes_per_param"], M.model_state_bytes_per_param(recipe))


class TestActivations(unittest.TestCase):
    def test_formula(self):
        self.assertEqual(M.activation_bytes_per_layer(16, 2, 64, 4), 16 * 2 * 64 * (34 + 5 * 4 * 16 / 64))
        self.assertEqual(M.activation_bytes_per_layer(1024, 1, 1600, 25), 186_777_600)

    def test_measured_equals_formula_at_other_shapes(self):
        for seq, batch, hidden, heads in ((8, 3, 32, 2), (32, 1, 48, 6)):
            with self.subTest(seq=seq, hidden=hidden):
                measured = M.measure_layer_activations(seq, batch, hidden, heads)
                self.assertEqual(measured, M.activation_bytes_per_layer(seq, batch, hidden, heads)
                                 + M.layernorm_stats_bytes(seq, batch))

    def test_readme_numbers(self):
        readme = Path(M.__file__).with_name("README.md").read_text()
        example = M.training_memory(**M.GPT2_XL)
        recomputed = M.training_memory(**M.GPT2_XL, recompute=True)
        eight = M.training_memory(**M.GPT2_XL, recipe="mixed_adam8bit", recompute=True)
        for text in (f"{example['params']:,}", f"{example['states_bytes'] / 1e9:.1f} GB",
                     f"{example['activation_bytes_per_layer'] / 1e6:.1f} MB",
                     f"{example['activation_bytes'] / 1e9:.2f} GB",
                     f"{example['total_bytes'] / 1e9:.1f} GB",
                     f"{recomputed['activation_bytes'] / 1e6:.0f} MB",
                     f"{eight['total_bytes'] / 1e9:.1f} GB",
                     f"{M.activation_bytes_per_layer(16, 2, 64, 4):,}"):
            self.assertIn(text, readme)


class TestMixedPrecision(unittest.TestCase):
    def test_scaler_matches_grad_scaler_with_other_overflows(self):
        result = M.compare_with_grad_scaler(steps=10, overflow_steps=(0, 1, 5), growth_interval=2)
        self.assertEqual(result["ours"], result["torch"])
        self.assertTrue(result["weights_equal"])
        self.assertEqual(result["ours"]["skipped"], [0, 1, 5])

    def test_defaults_are_grad_scalers(self):
        ours, theirs = M.DynamicLossScaler(), torch.amp.GradScaler("cpu")
        self.assertEqual(ours.get_scale(), theirs.get_scale())
        self.assertEqual((ours.growth_factor, ours.backoff_factor, ours.growth_interval),
                         (theirs.get_growth_factor(), theirs.get_backoff_factor(),
                          theirs.get_growth_interval()))

    def test_a_scaler_that_never_backs_off_is_caught(self):
        class NoBackoff(M.DynamicLossScaler):
            def update(self):
                self.found_inf = False
                super().update()

        original = M.DynamicLossScaler
        try:
            M.DynamicLossScaler = NoBackoff
            result = M.compare_with_grad_scaler()
        finally:
            M.DynamicLossScaler = original
        self.assertNotEqual(result["ours"]["scales"], result["torch"]["scales"])

    def test_underflow(self):
        grads = M.small_gradients()
        self.assertGreater(M.underflow_fraction(grads, torch.float16), 0.4)
        self.assertEqual(M.underflow_fraction(grads, torch.float16, 2.0 ** 16), 0.0)


class TestRecomputation(unittest.TestCase):
    def test_same_gradients_and_the_saving_formula(self):
        result = M.compare_recomputation(8, 2, 32, 2, 3)
        self.assertTrue(result["grads_equal"])
        self.assertEqual(result["saved_bytes"], result["saved_bytes_formula"])


class TestAdam8bit(unittest.TestCase):
    def test_round_trip_error_is_within_half_a_code_gap(self):
        x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) ** 3
        for signed, values in ((True, x), (False, x.abs())):
            codes, absmax = M.quantize_blockwise(values, signed)
            self.assertEqual(codes.dtype, torch.uint8)
            self.assertEqual(absmax.numel(), math.ceil(5000 / M.BLOCK))
            back = M.dequantize_blockwise(codes, absmax, signed, values.shape)
            book = M.CODEBOOKS[signed]
            self.assertLessEqual(len(book), 256)
            # the nearest code is at most half the widest gap away, per block's absmax
            bound = float((book[1:] - book[:-1]).max()) / 2 * float(absmax.max())
            self.assertLessEqual(float((back - values).abs().max()), bound)
            self.assertTrue(torch.equal(back.abs().amax(), values.abs().amax()))

    def test_state_bytes(self):
        self.assertEqual(M.adam8bit_state_bytes(16384), 2 * (16384 + 4 * 8))
        self.assertEqual(M.adam8bit_state_bytes(4095), 8 * 4095)
        self.assertEqual(M.adam8bit_state_bytes(4097), 2 * (3 * 2048 + 4 * 3))

    def test_readme_quotes_the_default_curves(self):
        result = M.compare_adam8bit(150, 64, 4, 2, 16, 16)
        readme = Path(M.__file__).with_name("README.md").read_text()
        for value in (result["final_loss"]["adam"], result["final_loss"]["adam8bit"]):
            self.assertIn(f"{value:.4f}", readme)
        self.assertIn(f"from {result['first_loss']:.3f}", readme)

    def test_readme_quotes_the_demo(self):
        readme = Path(M.__file__).with_name("README.md").read_text()
        self.assertIn(f"**{M.compare_with_torch_memtracker(0)['ours']['total']:,} B**", readme)
        recompute = M.compare_recomputation(16, 2, 64, 4, 2)
        for value in (recompute["plain"]["activation_bytes"], recompute["recompute"]["activation_bytes"],
                      recompute["saved_bytes"]):
            self.assertIn(f"{value:,} B", readme)
        self.assertIn(f"**{M.underflow_fraction(M.small_gradients(), torch.float16):.1%}**", readme)
        measured = M.measure_layer_activations(16, 2, 64, 4)
        self.assertIn(f"**{measured:,}** B", readme)

    def test_unquantized_is_torch_adam_exactly(self):
        batches = M.markov_batches(64, 8, 4, 5, 0)
        ours = M.train_curve("adam32_ours", batches, 32, 2, 1, 8)
        torch_adam = M.train_curve("adam", batches, 32, 2, 1, 8)
        self.assertEqual(ours["losses"], torch_adam["losses"])


class TestDemo(unittest.TestCase):
    def test_every_check_passes(self):
        assert_every_check_passes(self, {1: launch(W.all_checks, 1, device="cpu", timeout_s=120)})

    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--hidden", "30", "--heads", "4"], "--hidden 30")
        assert_argument_error(self, M.parse_args, ["--device", "cuda"], "runs on the CPU")
        assert_argument_error(self, M.parse_args, ["--world-size", "2"], "--world-size")
        assert_argument_error(self, M.parse_args, ["--steps", "3"], "--steps")


if __name__ == "__main__":
    unittest.main()
