"""Lesson 07's suite: the tracker (against torch's MemTracker), bytes per parameter, the
activation formula, the loss scaler against GradScaler, recomputation, 8-bit Adam, the numbers
the README and the quiz quote, and the CLI."""

from __future__ import annotations

import importlib
import json
import math
import unittest
import unittest.mock
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes, exercise

M = importlib.import_module("lessons.07_memory.main")  # the technique: tracker, formulas, GPT
MP = importlib.import_module("lessons.07_memory.mixed_precision")  # master weights, loss scaling
A8 = importlib.import_module("lessons.07_memory.adam8bit")  # 8-bit Adam
tiny_gpt = importlib.import_module("lessons.07_memory.tiny_gpt")  # TinyGPT, markov_batches
C = importlib.import_module("lessons.07_memory.checks")  # the harness
W = importlib.import_module("lessons.07_memory.tests.workers")
README = Path(M.__file__).with_name("README.md").read_text()
QUIZ = Path(M.__file__).with_name("quiz.json").read_text()
_THREADS = torch.get_num_threads()


def setUpModule():  # one thread, as the demo's rank runs: the same sums, and no spinning
    torch.set_num_threads(1)  # threads fighting other processes on a loaded machine


def tearDownModule():
    torch.set_num_threads(_THREADS)


@exercise("tracker")
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
        self.assertEqual(sum(tracker.peak_breakdown().values()), 8000)

    def test_the_peak_snapshot_is_the_live_set_at_the_peak(self):
        tracker = M.MemoryTracker()
        with tracker:
            with tracker.phase("forward"):
                a = torch.zeros(100)
                b = torch.zeros(300)  # peak: 1,600 activation bytes
            del a
            with tracker.phase("backward"):
                c = torch.zeros(50)
            del b, c
        self.assertEqual(tracker.peak_bytes, 1600)
        self.assertEqual(tracker.peak_breakdown()["activation"], 1600)
        self.assertEqual(tracker.peak_breakdown()["temporary"], 0)

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

    def test_storages_on_another_device_are_host(self):
        tracker = M.MemoryTracker(device="meta")  # "the device" is meta; the CPU is the host
        with tracker:
            on_device = torch.zeros(100, device="meta")
            on_host = torch.zeros(100, device="cpu")
            self.assertEqual(tracker.live_bytes, 400)
            self.assertEqual(tracker.breakdown()["host"], 400)
            del on_device, on_host

    def test_refiling_between_device_categories_moves_no_bytes(self):
        tracker = M.MemoryTracker()
        with tracker:
            grad = torch.zeros(100)  # 400 temporary bytes
            tracker.mark([grad], "gradient")
            tracker.mark([grad[:10]], "optimizer")  # a view: the same storage, re-filed
            self.assertEqual(tracker.live_bytes, 400)
            self.assertEqual(tracker.breakdown()["optimizer"], 400)
            self.assertEqual(tracker.breakdown()["temporary"], 0)
            tracker.mark([grad], "host")  # offloaded: leaves the device count, the peak stays
            self.assertEqual(tracker.live_bytes, 0)
            del grad
        self.assertEqual((tracker.live_bytes, tracker.peak_bytes), (0, 400))
        self.assertEqual(tracker.live, {})

    def test_equal_to_torch_memtracker(self):
        result = C.compare_with_torch_memtracker(3)
        self.assertEqual(result["ours"], result["torch"])


class TestBytesPerParameter(unittest.TestCase):
    @exercise("memory-formulas")
    def test_the_table(self):
        expected = {"fp32_adam": 16, "mixed_adam": 16, "mixed_adam_main_grad": 18,
                    "mixed_adam_fp32_accum": 20, "mixed_adam8bit": 10}
        for recipe, nbytes in expected.items():
            with self.subTest(recipe=recipe):
                self.assertEqual(M.model_state_bytes_per_param(recipe), nbytes)

    def test_each_recipe_matches_the_formula(self):
        for recipe in C.RECIPES:
            with self.subTest(recipe=recipe):
                measured = C.measure_model_states(recipe)
                self.assertEqual(measured["bytes_per_param"], M.model_state_bytes_per_param(recipe))

    def test_main_grad_frees_the_16_bit_gradient(self):
        model = C.make_mlp(0, dtype=torch.bfloat16)
        optimizer = MP.MixedPrecisionAdam(model.parameters(), fp32_accumulation=True,
                                         free_model_grads=True)
        model.loss(torch.randn(4, 64, dtype=torch.bfloat16)).backward()
        optimizer.accumulate()
        self.assertTrue(all(p.grad is None for p in model.parameters()))
        self.assertTrue(all(bool(g.abs().sum() > 0) for g in optimizer.main_grads))


class TestActivations(unittest.TestCase):
    @exercise("memory-formulas")
    def test_formula(self):
        self.assertEqual(M.activation_bytes_per_layer(16, 2, 64, 4), 16 * 2 * 64 * (34 + 5 * 4 * 16 / 64))
        self.assertEqual(M.activation_bytes_per_layer(1024, 1, 1600, 25), 186_777_600)
        # fp32 tensors, 1-byte masks: sbh(16 x 4 + 2) + a s^2 b (2 x 4 + 1)
        self.assertEqual(M.activation_bytes_per_layer(8, 3, 32, 2, itemsize=4),
                         8 * 3 * 32 * 66 + 2 * 8 * 8 * 3 * 9)

    def test_measured_equals_formula_at_other_shapes(self):
        for seq, batch, hidden, heads in ((8, 3, 32, 2), (32, 1, 48, 6)):
            with self.subTest(seq=seq, hidden=hidden):
                measured = M.measure_layer_activations(seq, batch, hidden, heads)
                self.assertEqual(measured, M.activation_bytes_per_layer(seq, batch, hidden, heads)
                                 + M.layernorm_stats_bytes(seq, batch))


class TestMixedPrecision(unittest.TestCase):
    @exercise("loss-scaler")
    def test_scale_and_unscale(self):
        scaler = MP.DynamicLossScaler(init_scale=8.0)
        self.assertEqual(float(scaler.scale(torch.tensor(1.5))), 12.0)
        param = torch.nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor([8.0, -4.0, 16.0])
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler.unscale_(optimizer)
        self.assertEqual(param.grad.tolist(), [1.0, -0.5, 2.0])
        self.assertFalse(scaler.found_inf)
        param.grad = torch.tensor([1.0, float("nan"), 2.0])
        scaler.unscale_(optimizer)
        self.assertTrue(scaler.found_inf)

    @exercise("loss-scaler")
    def test_an_overflow_skips_the_step_and_backs_off(self):
        scaler = MP.DynamicLossScaler(init_scale=1024.0, growth_interval=3)
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([param], lr=1.0)
        param.grad = torch.tensor([float("inf"), 1.0])
        with unittest.mock.patch.object(optimizer, "step") as step:
            self.assertFalse(scaler.step(optimizer))
        step.assert_not_called()
        scaler.update()
        self.assertEqual(scaler.get_scale(), 512.0)
        self.assertEqual(scaler.clean_steps, 0)

    @exercise("loss-scaler")
    def test_the_scale_grows_only_after_growth_interval_clean_steps(self):
        scaler = MP.DynamicLossScaler(init_scale=4.0, growth_interval=3)
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([param], lr=0.0)
        scales = []
        for _ in range(7):
            param.grad = torch.ones(2)
            self.assertTrue(scaler.step(optimizer))
            scaler.update()
            scales.append(scaler.get_scale())
        self.assertEqual(scales, [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0])

    @exercise("loss-scaler")
    def test_scaler_matches_grad_scaler_with_other_overflows(self):
        result = C.compare_with_grad_scaler(steps=10, overflow_steps=(0, 1, 5), growth_interval=2)
        self.assertEqual(result["ours"], result["torch"])
        self.assertTrue(result["weights_equal"])
        self.assertEqual(result["ours"]["skipped"], [0, 1, 5])

    @exercise("loss-scaler")
    def test_defaults_are_grad_scalers(self):
        ours, theirs = MP.DynamicLossScaler(), torch.amp.GradScaler("cpu")
        self.assertEqual(ours.get_scale(), theirs.get_scale())
        self.assertEqual((ours.growth_factor, ours.backoff_factor, ours.growth_interval),
                         (theirs.get_growth_factor(), theirs.get_backoff_factor(),
                          theirs.get_growth_interval()))

    @exercise("loss-scaler")
    def test_a_scaler_that_never_backs_off_is_caught(self):
        class NoBackoff(MP.DynamicLossScaler):
            def update(self):
                self.found_inf = False
                super().update()

        original = MP.DynamicLossScaler
        try:
            MP.DynamicLossScaler = NoBackoff
            result = C.compare_with_grad_scaler()
        finally:
            MP.DynamicLossScaler = original
        self.assertNotEqual(result["ours"]["scales"], result["torch"]["scales"])

    def test_underflow(self):
        grads = C.small_gradients()
        self.assertGreater(C.underflow_fraction(grads, torch.float16), 0.4)
        self.assertEqual(C.underflow_fraction(grads, torch.float16, 2.0 ** 16), 0.0)


class TestRecomputation(unittest.TestCase):
    def test_same_gradients_and_the_saving_formula(self):
        result = C.compare_recomputation(8, 2, 32, 2, 3)
        self.assertTrue(result["grads_equal"])
        self.assertEqual(result["saved_bytes"], result["saved_bytes_formula"])

    def test_the_backward_peak_exceeds_what_forward_kept(self):
        small = C.gpt_step_on_meta(layers=3, hidden=32, heads=2, vocab=64, seq=16, recompute=True)
        per_layer = M.activation_bytes_per_layer(16, 1, 32, 2)
        # one layer is whole again during backward, on top of what forward kept
        self.assertGreater(small["backward_beyond_states"], small["kept_after_forward"] + per_layer // 2)


class TestAdam8bit(unittest.TestCase):
    @exercise("blockwise-quant")
    def test_one_absmax_per_block(self):
        # blocks of very different magnitudes: each keeps its own scale and relative precision
        x = torch.cat([torch.full((256,), 1e3), torch.linspace(-1e-3, 1e-3, 256), torch.ones(100)])
        codes, absmax = A8.quantize_blockwise(x, True, 256)
        self.assertEqual(tuple(codes.shape), (3, 256))
        self.assertEqual(absmax.tolist(), [1e3, float(torch.tensor(1e-3)), 1.0])
        self.assertEqual(codes[2, 100:].tolist(), [int((A8.CODEBOOKS[True] == 0).nonzero())] * 156)
        back = A8.dequantize_blockwise(codes, absmax, True, x.shape)
        self.assertEqual(back.shape, x.shape)
        small = slice(256, 512)
        self.assertLessEqual(float((back[small] - x[small]).abs().max()), 1e-3 * 0.07)
        self.assertTrue(torch.equal(back[:256], x[:256]))
        zero_codes, zero_absmax = A8.quantize_blockwise(torch.zeros(10), False, 4)
        self.assertTrue(torch.equal(A8.dequantize_blockwise(zero_codes, zero_absmax, False, (10,)),
                                    torch.zeros(10)))

    @exercise("blockwise-quant")
    def test_round_trip_error_is_within_half_a_code_gap(self):
        x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) ** 3
        for block in (A8.BLOCK, 256):
            for signed, values in ((True, x), (False, x.abs())):
                codes, absmax = A8.quantize_blockwise(values, signed, block)
                self.assertEqual(codes.dtype, torch.uint8)
                self.assertEqual(absmax.numel(), math.ceil(5000 / block))
                back = A8.dequantize_blockwise(codes, absmax, signed, values.shape)
                book = A8.CODEBOOKS[signed]
                self.assertLessEqual(len(book), 256)
                # the nearest code is at most half the widest gap away, per block's absmax
                bound = float((book[1:] - book[:-1]).max()) / 2 * float(absmax.max())
                self.assertLessEqual(float((back - values).abs().max()), bound)
                self.assertTrue(torch.equal(back.abs().amax(), values.abs().amax()))

    def test_state_bytes(self):
        self.assertEqual(A8.adam8bit_state_bytes(16384), 2 * (16384 + 4 * 8))
        self.assertEqual(A8.adam8bit_state_bytes(4095), 8 * 4095)
        self.assertEqual(A8.adam8bit_state_bytes(4097), 2 * (3 * 2048 + 4 * 3))
        self.assertEqual(A8.adam8bit_state_bytes(4097, block=256), 2 * (17 * 256 + 4 * 17))

    def test_unquantized_is_torch_adam_exactly(self):
        batches = tiny_gpt.markov_batches(64, 8, 4, 5, 0)
        ours = C.train_curve("adam32_ours", batches, 32, 2, 1, 8)
        torch_adam = C.train_curve("adam", batches, 32, 2, 1, 8)
        self.assertEqual(ours["losses"], torch_adam["losses"])


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed (integers and exact formulas are
    quoted as they are; the 8-bit training curve, which depends on the CPU, with its band)."""

    def assertQuoted(self, text: str, where: str = README):
        self.assertTrue(text in " ".join(where.split()), f"{text!r} is not quoted")  # across line breaks

    def test_gpt2_xl_worked_example(self):
        example = M.training_memory(**M.GPT2_XL)
        recomputed = M.training_memory(**M.GPT2_XL, recompute=True)
        eight = M.training_memory(**M.GPT2_XL, recipe="mixed_adam8bit", recompute=True)
        for text in (f"{example['params']:,}", f"{example['states_bytes'] / 1e9:.1f} GB",
                     f"{example['activation_bytes_per_layer'] / 1e6:.1f} MB",
                     f"{example['activation_bytes'] / 1e9:.2f} GB",
                     f"{example['total_bytes'] / 1e9:.1f} GB",
                     f"{recomputed['activation_bytes'] / 1e6:.0f} MB",
                     f"{eight['total_bytes'] / 1e9:.1f} GB",
                     f"{example['logits_bytes'] / 1e6:.0f} MB",
                     f"{M.activation_bytes_per_layer(16, 2, 64, 4):,}"):
            self.assertQuoted(text)
        for text in (f"{example['states_bytes'] / 1e9:.1f} GB",
                     f"{example['activation_bytes'] / 1e9:.2f} GB"):
            self.assertQuoted(text, QUIZ)

    def test_gpt2_xl_backward_peak_measured_on_meta(self):
        recomputed = C.gpt_step_on_meta(**M.GPT2_XL, recompute=True)
        plain = C.gpt_step_on_meta(**M.GPT2_XL, recompute=False)
        self.assertQuoted(f"**{recomputed['kept_after_forward'] / 1e6:.1f} MB**")
        self.assertQuoted(f"**{recomputed['backward_beyond_states'] / 1e6:.1f} MB**")
        self.assertQuoted(f"{plain['kept_after_forward'] / 1e9:.2f} GB kept")
        self.assertQuoted(f"**{plain['backward_beyond_states'] / 1e9:.2f} GB**")
        states = M.training_memory(**M.GPT2_XL, recipe="mixed_adam8bit")["states_bytes"]
        self.assertQuoted(f"**{(states + recomputed['backward_beyond_states']) / 1e9:.1f} GB**")

    def test_formulas(self):
        self.assertQuoted(f"**{C.block_saving(2048):.2%}**")
        self.assertQuoted(f"**{C.block_saving(256):.1%}**")
        self.assertQuoted(f"{C.block_saving(2048):.2%}", QUIZ)
        flush = C.fp16_flush_threshold()
        self.assertEqual((flush["at_threshold"], flush["just_above"]), (0.0, 2.0 ** -24))
        mantissa, exponent = f"{flush['threshold']:.0e}".split("e")
        self.assertQuoted(f"2^-25 ≈ **{mantissa}e{int(exponent)}**")
        self.assertQuoted(f"~{mantissa}e{int(exponent)}", QUIZ)

    def test_demo_numbers(self):
        self.assertQuoted(f"**{C.compare_with_torch_memtracker(0)['ours']['total']:,} B**")
        for recipe in C.RECIPES:
            self.assertQuoted(f"{C.measure_model_states(recipe)['bytes_per_param']:.2f}")
        self.assertQuoted(f"**{M.measure_layer_activations(16, 2, 64, 4):,}** B")
        recompute = C.compare_recomputation(16, 2, 64, 4, 2)
        for value in (recompute["plain"]["activation_bytes"], recompute["recompute"]["activation_bytes"],
                      recompute["saved_bytes"], recompute["plain"]["backward_peak_bytes"],
                      recompute["recompute"]["backward_peak_bytes"]):
            self.assertQuoted(f"{value:,}")
        zeroed = C.underflow_fraction(C.small_gradients(), torch.float16)
        self.assertQuoted(f"**{zeroed:.1%}**")
        self.assertQuoted(f"{zeroed:.1%}", QUIZ)
        swallowed = C.swallowed_updates()
        self.assertEqual(swallowed["bf16"], 1.0)
        self.assertQuoted(f"stays 1.0 in bf16, {swallowed['fp32_master']:.6f} in an fp32 master")
        self.assertQuoted(", ".join(f"{s:.0f}" for s in C.compare_with_grad_scaler()["ours"]["scales"]))
        self.assertLessEqual(max(v["loss_rel_err"] for v in C.autocast_dtypes().values()), 0.003)

    def test_adam8bit_numbers(self):
        result = C.compare_adam8bit(150, 64, 4, 2, 16, 16)
        self.assertQuoted(f"{result['state_bytes_32']:,} -> {result['state_bytes_8']:,} B")
        self.assertQuoted(f"{result['reduction_total']:.1%} less")
        self.assertQuoted(f"{result['reduction_total']:.1%} saving", QUIZ)
        self.assertQuoted(f"**{result['reduction_quantized']:.2%}** on the "
                          f"{result['quantized_fraction']:.0%}")
        self.assertQuoted(f"from {result['first_loss']:.3f}")
        # Adam's curve is smooth: the same to 1e-6 across CPUs; the 8-bit one moves by ~5e-4
        self.assertQuoted("0.7998 with Adam")
        self.assertLessEqual(abs(result["final_loss"]["adam"] - 0.7998), 1e-4)
        self.assertQuoted("**0.800 ± 0.002** with 8-bit Adam")
        self.assertLessEqual(abs(result["final_loss"]["adam8bit"] - 0.800), 0.002)


class TestDemo(unittest.TestCase):
    def test_every_check_passes(self):
        assert_every_check_passes(self, {1: launch(W.all_checks, 1, device="cpu", timeout_s=120)})

    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--hidden", "30", "--heads", "4"], "--hidden 30")
        assert_argument_error(self, C.parse_args, ["--device", "cuda"], "runs on the CPU")
        assert_argument_error(self, C.parse_args, ["--world-size", "2"], "--world-size")
        assert_argument_error(self, C.parse_args, ["--steps", "3"], "--steps")

    def test_more_than_one_torchrun_process_is_refused(self):
        with unittest.mock.patch.dict("os.environ", {"RANK": "0", "WORLD_SIZE": "2"}):
            assert_argument_error(self, C.parse_args, [], "--nproc-per-node=1")

    def test_quiz_is_json(self):
        self.assertEqual(json.loads(QUIZ)["lesson"], "07_memory")


if __name__ == "__main__":
    unittest.main()
