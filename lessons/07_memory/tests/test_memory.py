"""Lesson 07's suite: the tracker (against torch's MemTracker), bytes per parameter, the
activation formula, the loss scaler against GradScaler (its clipping path and in-place
contract included), recomputation (whole layers and selective, measured between forward and
backward), FP8, 8-bit Adam, the numbers the README and the quiz quote, and the CLI."""

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
            self.assertEqual(tracker.live_bytes, 4000, "zeros(1000) and a view of it")
            b = a * 2
            self.assertEqual(tracker.live_bytes, 8000, "plus a * 2")
            del a, view, b
        self.assertEqual(tracker.live_bytes, 0, "after del: live bytes")
        self.assertEqual(tracker.peak_bytes, 8000, "peak")
        self.assertEqual(sum(tracker.peak_breakdown().values()), 8000, "live at the peak")

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
        self.assertEqual(tracker.peak_bytes, 1600, "peak: a and b (forward)")
        self.assertEqual(tracker.peak_breakdown()["activation"], 1600, "activations at the peak")
        self.assertEqual(tracker.peak_breakdown()["temporary"], 0, "c came after the peak")

    def test_host_bytes_are_not_device_bytes(self):
        tracker = M.MemoryTracker()
        with tracker:
            with tracker.phase("host"):
                host = torch.zeros(100)
            device = torch.zeros(50)
            self.assertEqual(tracker.live_bytes, 200, "live device bytes (host bytes excluded)")
            self.assertEqual(tracker.breakdown()["host"], 400, "bytes filed under host")
            tracker.mark([host], "host")  # re-filed where it already is (lesson 08 re-marks its states)
            self.assertEqual((tracker.live_bytes, tracker.breakdown()["host"]), (200, 400),
                             "(live device bytes, host bytes) after re-filing a host storage as host")
            tracker.mark([host], "temporary")
            self.assertEqual(tracker.live_bytes, 600, "live device bytes (host bytes excluded)")
            del host, device

    def test_storages_on_another_device_are_host(self):
        tracker = M.MemoryTracker(device="meta")  # "the device" is meta; the CPU is the host
        with tracker:
            on_device = torch.zeros(100, device="meta")
            on_host = torch.zeros(30, device="cpu")  # sizes differ: which is which shows
            self.assertEqual(tracker.live_bytes, 400, "live device bytes: 100 floats on meta, "
                             "device='meta' (the 30 on the CPU are host bytes)")
            self.assertEqual(tracker.breakdown()["host"], 120, "bytes filed under host: 30 floats "
                             "on the CPU, device='meta'")
            del on_device, on_host

    def test_refiling_between_device_categories_moves_no_bytes(self):
        tracker = M.MemoryTracker()
        with tracker:
            grad = torch.zeros(100)  # 400 temporary bytes
            tracker.mark([grad], "gradient")
            tracker.mark([grad[:10]], "optimizer")  # a view: the same storage, re-filed
            self.assertEqual(tracker.live_bytes, 400, "live device bytes (host bytes excluded)")
            self.assertEqual(tracker.breakdown()["optimizer"], 400, "bytes filed under optimizer")
            self.assertEqual(tracker.breakdown()["temporary"], 0, "bytes filed under temporary")
            tracker.mark([grad], "host")  # offloaded: leaves the device count, the peak stays
            self.assertEqual(tracker.live_bytes, 0, "live device bytes (host bytes excluded)")
            del grad
        self.assertEqual((tracker.live_bytes, tracker.peak_bytes), (0, 400),
                         "(live, peak) after the offload and del")
        self.assertEqual(tracker.live, {}, "a freed storage must be forgotten")
        self.assertEqual(tracker._refs, {}, "a freed storage's weak reference must be forgotten "
                         "too (else the tracker grows by one per temporary, all run long)")

    def test_a_tie_with_the_peak_keeps_the_first_snapshot(self):
        """Only a new maximum moves the peak: coming back to the same total later (here in
        backward, with other storages) leaves the snapshot of the first moment."""
        tracker = M.MemoryTracker()
        with tracker:
            with tracker.phase("forward"):
                a = torch.zeros(100)  # the peak: 400 activation bytes
            del a
            with tracker.phase("backward"):
                c = torch.zeros(100)  # 400 temporary bytes: equal to the peak, not above it
            del c
        self.assertEqual((tracker.peak_bytes, tracker.peak_breakdown()["activation"],
                          tracker.peak_breakdown()["temporary"]), (400, 400, 0),
                         "(peak, activation, temporary bytes at the peak) after a 400-byte "
                         "activation, then a 400-byte temporary once it was freed")

    def test_equal_to_torch_memtracker(self):
        result = C.compare_with_torch_memtracker(3)
        self.assertEqual(result["ours"], result["torch"], "one Adam step, seed 3: ours vs MemTracker")

    def test_memory_between_forward_and_backward(self):
        """What forward leaves for backward, as the tracker sees it: a bf16 layer keeps
        sbh(34 + 5as/h) + LayerNorm statistics, L layers L times that."""
        for seq, batch, hidden, heads, layers in ((8, 3, 32, 2, 1), (6, 2, 48, 3, 2)):
            measured = M.measure_layer_activations(seq, batch, hidden, heads, layers)
            one = (M.activation_bytes_per_layer(seq, batch, hidden, heads)
                   + M.layernorm_stats_bytes(seq, batch))
            self.assertEqual(measured, layers * one, f"s={seq} b={batch} h={hidden} a={heads} "
                             f"L={layers}: bytes alive after forward")


class TestBytesPerParameter(unittest.TestCase):
    @exercise("memory-formulas")
    def test_the_table(self):
        expected = {"fp32_adam": 16, "mixed_adam": 16, "mixed_adam_main_grad": 18,
                    "mixed_adam_fp32_accum": 20, "mixed_adam8bit": 10}
        for recipe, nbytes in expected.items():
            with self.subTest(recipe=recipe):
                self.assertEqual(M.model_state_bytes_per_param(recipe), nbytes, recipe)

    def test_each_recipe_matches_the_formula(self):
        for recipe in C.RECIPES:
            with self.subTest(recipe=recipe):
                measured = C.measure_model_states(recipe)
                self.assertEqual(measured["bytes_per_param"], M.model_state_bytes_per_param(recipe),
                                 f"{recipe}: measured bytes per parameter")

    def test_main_grad_frees_the_16_bit_gradient(self):
        model = C.make_mlp(0, dtype=torch.bfloat16)
        optimizer = MP.MixedPrecisionAdam(model.parameters(), fp32_accumulation=True,
                                         free_model_grads=True)
        model.loss(torch.randn(4, 64, dtype=torch.bfloat16)).backward()
        optimizer.accumulate()
        self.assertTrue(all(p.grad is None for p in model.parameters()),
                        "free_model_grads: every 16-bit .grad must be None after accumulate()")
        self.assertTrue(all(bool(g.abs().sum() > 0) for g in optimizer.main_grads),
                        "every main_grad must hold the accumulated gradient")


class TestActivations(unittest.TestCase):
    @exercise("memory-formulas")
    def test_formula(self):
        self.assertEqual(M.activation_bytes_per_layer(16, 2, 64, 4), 16 * 2 * 64 * (34 + 5 * 4 * 16 / 64),
                         "s=16 b=2 h=64 a=4, 16-bit")
        self.assertEqual(M.activation_bytes_per_layer(1024, 1, 1600, 25), 186_777_600, "GPT-2 XL layer")
        # fp32 tensors, 1-byte masks: sbh(16 x 4 + 2) + a s^2 b (2 x 4 + 1)
        self.assertEqual(M.activation_bytes_per_layer(8, 3, 32, 2, itemsize=4),
                         8 * 3 * 32 * 66 + 2 * 8 * 8 * 3 * 9, "s=8 b=3 h=32 a=2, fp32 (itemsize 4)")
        self.assertEqual(M.activation_bytes_per_layer(5, 3, 12, 3), 5 * 3 * 12 * 34 + 3 * 5 * 5 * 3 * 5,
                         "s=5 b=3 h=12 a=3 (s != b != a): a s^2 b, not a s b^2 or a^2 s b")

    def test_measured_equals_formula_at_other_shapes(self):
        for seq, batch, hidden, heads in ((8, 3, 32, 2), (32, 1, 48, 6)):
            with self.subTest(seq=seq, hidden=hidden):
                measured = M.measure_layer_activations(seq, batch, hidden, heads)
                self.assertEqual(measured, M.activation_bytes_per_layer(seq, batch, hidden, heads)
                                 + M.layernorm_stats_bytes(seq, batch),
                                 f"s={seq} b={batch} h={hidden} a={heads}: measured vs formula")


class TestMixedPrecision(unittest.TestCase):
    @exercise("loss-scaler")
    def test_scale_and_unscale(self):
        scaler = MP.DynamicLossScaler(init_scale=8.0)
        self.assertEqual(float(scaler.scale(torch.tensor(1.5))), 12.0, "scale(1.5) at S = 8")
        scaled = scaler.scale(torch.tensor(1.5, dtype=torch.bfloat16))
        self.assertEqual(scaled.dtype, torch.bfloat16, "scale() must keep the loss's dtype")
        param, other = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
        param.grad, other.grad = torch.tensor([8.0, -4.0, 16.0]), torch.tensor([-2.0, 0.5])
        grads = (param.grad, other.grad)
        optimizer = torch.optim.SGD([{"params": [param]}, {"params": [other], "lr": 0.5}], lr=1.0)
        scaler.unscale_(optimizer)
        self.assertEqual((param.grad.tolist(), other.grad.tolist()), ([1.0, -0.5, 2.0], [-0.25, 0.0625]),
                         "unscale_ at S = 8, two param groups: every .grad x 1/8")
        self.assertTrue(param.grad is grads[0] and other.grad is grads[1],
                        "unscale_ must work in place (GradScaler's contract: a clip or a hook "
                        "between unscale_ and step holds these tensors), not rebind .grad")
        self.assertFalse(scaler.found_inf, "finite gradients reported as an overflow")
        scaler.update()
        param.grad = torch.tensor([1.0, float("nan"), 2.0])
        scaler.unscale_(optimizer)
        self.assertTrue(scaler.found_inf, "a NaN gradient was not reported")
        scaler.update()
        param.grad = torch.tensor([1.0, 3.0, 2.0])
        scaler.unscale_(optimizer)
        self.assertFalse(scaler.found_inf, "found_inf stayed True after a finite unscale_ "
                         "(it must describe this call's gradients only)")

    @exercise("loss-scaler")
    def test_unscale_once_per_update_then_clip_then_step_matches_grad_scaler(self):
        """GradScaler's clipping recipe: unscale_, clip, step (which must not unscale again),
        update; unscale_ twice before update raises."""
        runs = {}
        for name in ("ours", "torch"):
            model = C.make_mlp(3)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = (MP.DynamicLossScaler(init_scale=2.0 ** 10) if name == "ours"
                      else torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
            generator = torch.Generator().manual_seed(3)
            for _ in range(3):
                optimizer.zero_grad()
                scaler.scale(model.loss(torch.randn(8, 64, generator=generator))).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                scaler.step(optimizer)
                scaler.update()
            runs[name] = [p.detach().clone() for p in model.parameters()]
            with self.assertRaises(RuntimeError, msg=f"{name}: a second unscale_ before update"):
                scaler.unscale_(optimizer)
                scaler.unscale_(optimizer)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(runs["ours"], runs["torch"])),
                        "unscale_, clip, step, update x 3: weights differ from GradScaler's (did "
                        "step() unscale the gradients a second time?)")

    @exercise("loss-scaler")
    def test_an_overflow_skips_the_step_and_backs_off(self):
        scaler = MP.DynamicLossScaler(init_scale=1024.0, growth_interval=3)
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([param], lr=1.0)
        param.grad = torch.tensor([float("inf"), 1.0])
        with unittest.mock.patch.object(optimizer, "step") as step:
            self.assertFalse(scaler.step(optimizer), "step() must return False on an overflow")
        step.assert_not_called()
        scaler.update()
        self.assertEqual(scaler.get_scale(), 512.0, "an overflow at S = 1024 backs off to 512")
        self.assertEqual(scaler.clean_steps, 0, "an overflow restarts the clean-step counter")

    @exercise("loss-scaler")
    def test_the_scale_grows_only_after_growth_interval_clean_steps(self):
        scaler = MP.DynamicLossScaler(init_scale=4.0, growth_interval=3)
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([param], lr=0.0)
        scales = []
        for _ in range(7):
            param.grad = torch.ones(2)
            self.assertTrue(scaler.step(optimizer), "step() must return True without overflow")
            scaler.update()
            scales.append(scaler.get_scale())
        self.assertEqual(scales, [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0],
                         "scale after each of 7 clean steps, S = 4, growth_interval 3")

    @exercise("loss-scaler")
    def test_scaler_matches_grad_scaler_with_other_overflows(self):
        result = C.compare_with_grad_scaler(steps=10, overflow_steps=(0, 1, 5), growth_interval=2)
        self.assertEqual(result["ours"], result["torch"], "scales and skipped steps vs GradScaler, "
                         "overflows at steps 0, 1, 5, growth_interval 2")
        self.assertTrue(result["weights_equal"], "weights differ from GradScaler's run")
        self.assertEqual(result["ours"]["skipped"], [0, 1, 5], "skipped steps")

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
        self.assertNotEqual(result["ours"]["scales"], result["torch"]["scales"],
                            "the comparison must tell a scaler that never backs off")

    def test_underflow(self):
        grads = C.small_gradients()
        self.assertGreater(C.underflow_fraction(grads, torch.float16), 0.4, "fp16 underflow share")
        self.assertEqual(C.underflow_fraction(grads, torch.float16, 2.0 ** 16), 0.0,
                         "fp16 x 2^16 underflow share")

    def test_fp8_round_trip(self):
        x = torch.tensor([[3.0, -1e-3], [0.25, 1e-6]], dtype=torch.float64)  # rows differ
        for fmt, half_step in (("e4m3", 2.0 ** -4), ("e5m2", 2.0 ** -3)):
            back, scale = MP.fp8_round_trip(x, fmt)
            info = torch.finfo(MP.FP8[fmt])
            self.assertEqual(scale, info.max / 3.0, f"{fmt}: scale = max / amax")
            self.assertEqual(back.shape, x.shape, f"{fmt}: shape")
            normal = (x * scale).abs() >= info.smallest_normal
            rel = ((back - x).abs() / x.abs())[normal]
            self.assertLessEqual(float(rel.max()), half_step, f"{fmt}: relative error of normals")
            unscaled, one = MP.fp8_round_trip(x, fmt, scaled=False)
            self.assertEqual((one, float(unscaled[1, 1])), (1.0, 0.0),
                             f"{fmt}: 1e-6 unscaled must flush to 0 (smallest subnormal "
                             f"{info.smallest_normal * info.eps:g})")
        empty, scale = MP.fp8_round_trip(torch.zeros(0), "e4m3")
        self.assertEqual((tuple(empty.shape), scale), ((0,), 1.0), "an empty tensor: scale 1")


class TestRecomputation(unittest.TestCase):
    def test_same_gradients_and_the_saving_formula(self):
        """Measured between forward and backward (what forward leaves for backward)."""
        result = C.compare_recomputation(8, 2, 32, 2, 3)
        self.assertTrue(result["grads_equal"], "recomputed gradients differ from the plain run's")
        self.assertEqual(result["saved_bytes"], result["saved_bytes_formula"],
                         "bytes saved after forward by recomputing whole layers (s=8 b=2 h=32 a=2 L=3)")
        self.assertEqual(result["selective_saved_bytes"], result["selective_saved_bytes_formula"],
                         "bytes saved after forward by recomputing the attention cores")

    def test_a_selective_layer_keeps_34_sbh(self):
        for seq, batch, hidden, heads in ((16, 2, 64, 4), (12, 3, 48, 6)):
            measured = M.measure_layer_activations(seq, batch, hidden, heads, selective=True)
            self.assertEqual(measured, 34 * seq * batch * hidden + M.layernorm_stats_bytes(seq, batch),
                             f"bf16 layer with its attention core recomputed, s={seq} b={batch} "
                             f"h={hidden} a={heads}: 34sbh + LayerNorm statistics")
        memory = {r: M.training_memory(**M.GPT2_XL, recompute=r)["activation_bytes_per_layer"]
                  for r in (False, "selective", True, "full")}
        sbh = 1024 * 1600
        self.assertEqual(memory, {False: M.activation_bytes_per_layer(1024, 1, 1600, 25),
                                  "selective": 34 * sbh, True: 2 * sbh, "full": 2 * sbh},
                         "training_memory's bytes per layer by recompute option (GPT-2 XL)")
        with self.assertRaises(ValueError, msg="TinyGPT(recompute='attention') must be refused"):
            tiny_gpt.TinyGPT(8, 8, 2, 1, 4, recompute="attention")

    def test_the_backward_peak_exceeds_what_forward_kept(self):
        small = C.gpt_step_on_meta(layers=3, hidden=32, heads=2, vocab=64, seq=16, recompute=True)
        per_layer = M.activation_bytes_per_layer(16, 1, 32, 2)
        # one layer is whole again during backward, on top of what forward kept
        self.assertGreater(small["backward_beyond_states"], small["kept_after_forward"] + per_layer // 2,
                           f"backward peak beyond the states vs kept after forward: {small}")


class TestAdam8bit(unittest.TestCase):
    @exercise("blockwise-quant")
    def test_one_absmax_per_block(self):
        # blocks of very different magnitudes: each keeps its own scale and relative precision
        x = torch.cat([torch.full((256,), 1e3), torch.linspace(-1e-3, 1e-3, 256), torch.ones(100)])
        where = "612 values in blocks of 256 (1e3 x 256, linspace(-1e-3, 1e-3), ones x 100)"
        codes, absmax = A8.quantize_blockwise(x, True, 256)
        self.assertEqual(tuple(codes.shape), (3, 256), f"{where}: codes shape (ceil(n/B), B)")
        self.assertEqual(absmax.tolist(), [1e3, float(torch.tensor(1e-3)), 1.0],
                         f"{where}: one absmax per block")
        self.assertEqual(codes[2, 100:].tolist(), [int((A8.CODEBOOKS[True] == 0).nonzero())] * 156,
                         f"{where}: the padding must be zeros, coded as the code of 0")
        back = A8.dequantize_blockwise(codes, absmax, True, x.shape)
        self.assertEqual(back.shape, x.shape, f"{where}: dequantized shape")
        small = slice(256, 512)
        self.assertLessEqual(float((back[small] - x[small]).abs().max()), 1e-3 * 0.07,
                             f"{where}: the small block keeps its own scale (error <= 7% of 1e-3)")
        self.assertTrue(torch.equal(back[:256], x[:256]), f"{where}: a constant block is exact")
        zero_codes, zero_absmax = A8.quantize_blockwise(torch.zeros(10), False, 4)
        self.assertTrue(torch.equal(A8.dequantize_blockwise(zero_codes, zero_absmax, False, (10,)),
                                    torch.zeros(10)), "an all-zero tensor must come back as zeros")

    @exercise("blockwise-quant")
    def test_empty_tensors_and_ties(self):
        codes, absmax = A8.quantize_blockwise(torch.zeros(0), True, 8)
        self.assertEqual((tuple(codes.shape), tuple(absmax.shape)), ((0, 8), (0,)),
                         "an empty tensor: no blocks")
        self.assertEqual(tuple(A8.dequantize_blockwise(codes, absmax, True, (0, 3)).shape), (0, 3),
                         "an empty tensor comes back empty, in its shape")
        book = A8.CODEBOOKS[False]
        tie = (book[200] + book[201]) / 2  # exactly between two codes (absmax 1 keeps it there)
        values = torch.tensor([1.0, float(tie), float(book[17])])
        codes, _ = A8.quantize_blockwise(values, False, 4)
        self.assertEqual(codes[0, :3].tolist(), [len(book) - 1, 200, 17],
                         "[1.0, the midpoint of codes 200 and 201, code 17]: a tie goes to the "
                         "lower code (docstring)")

    @exercise("blockwise-quant")
    def test_values_come_back_in_the_dtype_of_absmax(self):
        x = torch.tensor([[0.5, -3.0, 1e-3], [2.0, 0.25, -0.75]], dtype=torch.bfloat16)  # rows differ
        for signed, values in ((True, x), (False, x.abs())):
            codes, absmax = A8.quantize_blockwise(values, signed, 4)
            back = A8.dequantize_blockwise(codes, absmax, signed, values.shape)
            expected = (A8.CODEBOOKS[signed].to(torch.bfloat16)[codes.long()]
                        * absmax[:, None]).reshape(-1)[:6].view(2, 3)
            self.assertEqual((back.dtype, absmax.dtype), (torch.bfloat16, torch.bfloat16),
                             f"(dequantized dtype, absmax dtype) of a bf16 (2, 3) tensor, block 4, "
                             f"signed={signed}")
            self.assertTrue(torch.equal(back, expected), f"bf16 (2, 3), block 4, signed={signed}: "
                            f"dequantized {back.tolist()}, expected {expected.tolist()}")

    @exercise("blockwise-quant")
    def test_round_trip_error_is_within_half_a_code_gap(self):
        x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) ** 3
        for block in (A8.BLOCK, 256):
            for signed, values in ((True, x), (False, x.abs())):
                where = f"5000 values, block {block}, signed={signed}"
                codes, absmax = A8.quantize_blockwise(values, signed, block)
                self.assertEqual(codes.dtype, torch.uint8, where)
                self.assertEqual(absmax.numel(), math.ceil(5000 / block), f"{where}: blocks")
                back = A8.dequantize_blockwise(codes, absmax, signed, values.shape)
                book = A8.CODEBOOKS[signed]
                self.assertLessEqual(len(book), 256, "codebook size")
                # the nearest code is at most half the widest gap away, per block's absmax
                bound = float((book[1:] - book[:-1]).max()) / 2 * float(absmax.max())
                self.assertLessEqual(float((back - values).abs().max()), bound,
                                     f"{where}: round-trip error beyond half a code gap")
                self.assertTrue(torch.equal(back.abs().amax(), values.abs().amax()),
                                f"{where}: each block's absmax must come back exactly")

    def test_state_bytes(self):
        self.assertEqual(A8.adam8bit_state_bytes(16384), 2 * (16384 + 4 * 8))
        self.assertEqual(A8.adam8bit_state_bytes(4095), 8 * 4095)
        self.assertEqual(A8.adam8bit_state_bytes(4097), 2 * (3 * 2048 + 4 * 3))
        self.assertEqual(A8.adam8bit_state_bytes(4097, block=256), 2 * (17 * 256 + 4 * 17))

    def test_unquantized_is_torch_adam_exactly(self):
        batches = tiny_gpt.markov_batches(64, 8, 4, 5, 0)
        ours = C.train_curve("adam32_ours", batches, 32, 2, 1, 8)
        torch_adam = C.train_curve("adam", batches, 32, 2, 1, 8)
        self.assertEqual(ours["losses"], torch_adam["losses"], "Adam8bit (8-bit off) vs torch Adam")

    def test_a_parameter_without_gradient_is_skipped_as_torch_skips_it(self):
        """Per-parameter step counts: a parameter frozen for one step keeps its own bias
        correction, so it continues exactly as in torch.optim.Adam."""
        weights = {}
        for name in ("adam", "adam32_ours"):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
            optimizer = C.make_optimizer(name, params, 0.1)
            for step in range(4):
                for index, param in enumerate(params):
                    skip = index == 1 and step in (0, 2)
                    param.grad = None if skip else torch.full_like(param, 0.5 + step - index)
                optimizer.step()
            weights[name] = [p.detach().clone() for p in params]
        for index, (ours, theirs) in enumerate(zip(weights["adam32_ours"], weights["adam"])):
            self.assertTrue(torch.equal(ours, theirs), f"parameter {index} (no gradient in steps "
                            f"0 and 2 for parameter 1): {ours.tolist()} != {theirs.tolist()}")


class QuotedNumbers(unittest.TestCase):
    def assertQuoted(self, text: str, where: str = README):
        self.assertTrue(text in " ".join(where.split()), f"{text!r} is not quoted")  # across line breaks


class TestDocNumbers(QuotedNumbers):
    """Every number the README and the quiz quote, recomputed (integers and exact formulas are
    quoted as they are; the 8-bit training curve, which depends on the CPU, with its band)."""

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
        selective = M.training_memory(**M.GPT2_XL, recompute="selective")
        per_layer, saved = selective["activation_bytes_per_layer"], 1 - selective[
            "activation_bytes_per_layer"] / example["activation_bytes_per_layer"]
        embeddings = (M.GPT2_XL["vocab"] + M.GPT2_XL["seq"]) * M.GPT2_XL["hidden"]
        self.assertEqual(eight["states_bytes"], 10 * eight["params"] + 6 * embeddings,
                         "8-bit Adam on GPT-2 XL: 10 B/param, +6 B/param of 32-bit embedding states")
        for text in (f"{per_layer / 1e6:.1f} MB per layer",
                     f"**{selective['activation_bytes'] / 1e9:.2f} GB**",
                     f"(total {selective['total_bytes'] / 1e9:.1f} GB)", f"**{100 * saved:.1f}% less**",
                     f"{embeddings:,} parameters", f"**+{6 * embeddings / 1e9:.2f} GB**"):
            self.assertQuoted(text)

    def test_precision_numbers(self):
        rounding = C.bf16_rounding_at_one()
        self.assertEqual((rounding["plus_0.0038"], rounding["plus_0.004"], rounding["minus_0.0019"],
                          rounding["minus_0.002"]), (1.0, 1.0078125, 1.0, 0.99609375),
                         "bf16 1.0 + 0.0038, + 0.004, - 0.0019, - 0.002")
        self.assertQuoted(f"2^-8 ≈ **{rounding['up_threshold']:.4f}**")
        self.assertQuoted(f"2^-9 ≈ {rounding['down_threshold']:.3f}")
        self.assertQuoted("1 + 0.0038 -> 1.0, 1 + 0.004 -> 1.0078125, 1 - 0.0019 -> 1.0, "
                          "1 - 0.002 -> 0.99609375")
        stats = C.codebook_stats(True)
        self.assertQuoted(f"{100 * stats['half_gap_min']:.1f}% to "
                          f"{100 * stats['half_gap_max']:.2f}% of the value")
        mantissa, exponent = f"{stats['smallest']:.1e}".split("e")
        self.assertQuoted(f"0.5625 x 2^-14 ≈ **{mantissa}e{int(exponent)}**")
        self.assertEqual(stats["smallest"], 0.5625 * 2 ** -14, "smallest signed code")
        fp8 = C.fp8_demo()
        self.assertQuoted(f"largest value **{fp8['e4m3']['max']:.0f}**")
        self.assertQuoted(f"largest **{fp8['e5m2']['max']:,.0f}**")
        self.assertEqual([fp8[f]["zeroed_unscaled"] for f in fp8] + [fp8[f]["zeroed_scaled"] for f in fp8],
                         [1.0, 1.0, 0.0, 0.0], "share of the small gradients FP8 zeroes, unscaled and scaled")
        self.assertQuoted("100% of the small gradients lost unscaled in both formats, none")

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
                      recompute["recompute"]["backward_peak_bytes"],
                      recompute["selective"]["activation_bytes"], recompute["selective_saved_bytes"],
                      M.measure_layer_activations(16, 2, 64, 4, selective=True)):
            self.assertQuoted(f"{value:,}")
        zeroed = C.underflow_fraction(C.small_gradients(), torch.float16)
        self.assertQuoted(f"**{zeroed:.1%}**")
        self.assertQuoted(f"{zeroed:.1%}", QUIZ)
        swallowed = C.swallowed_updates()
        self.assertEqual(swallowed["bf16"], 1.0)
        self.assertQuoted(f"stays 1.0 in bf16, {swallowed['fp32_master']:.6f} in an fp32 master")
        self.assertQuoted(", ".join(f"{s:.0f}" for s in C.compare_with_grad_scaler()["ours"]["scales"]))
        self.assertLessEqual(max(v["loss_rel_err"] for v in C.autocast_dtypes().values()), 0.003,
                             f"autocast loss vs fp32: {C.autocast_dtypes()}")

    def test_adam8bit_numbers(self):
        result = C.compare_adam8bit(150, 64, 4, 2, 16, 16, ours_fp32=False)  # bit-equality: TestDemo
        self.assertQuoted(f"{result['state_bytes_32']:,} -> {result['state_bytes_8']:,} B")
        self.assertQuoted(f"{result['reduction_total']:.1%} less")
        self.assertQuoted(f"{result['reduction_total']:.1%} saving", QUIZ)
        self.assertQuoted(f"**{result['reduction_quantized']:.2%}** on the "
                          f"{result['quantized_fraction']:.0%}")
        self.assertQuoted(f"from {result['first_loss']:.3f}")
        # Adam's curve is smooth: the same to 1e-6 across CPUs; the 8-bit one moves by ~5e-4
        self.assertQuoted("0.7998 with Adam")
        self.assertLessEqual(abs(result["final_loss"]["adam"] - 0.7998), 1e-4,
                             f"Adam's final loss {result['final_loss']['adam']}")
        self.assertQuoted("**0.800 ± 0.002** with 8-bit Adam")
        self.assertLessEqual(abs(result["final_loss"]["adam8bit"] - 0.800), 0.002,
                             f"8-bit Adam's final loss {result['final_loss']['adam8bit']}")


class TestDocNumbersOnMeta(QuotedNumbers):
    """The numbers the README quotes from a step on the meta device: shapes and bytes only, no
    CPU kernel runs (so tests/test_portability.py, which reruns TestDocNumbers on other CPU
    kernels, leaves them out)."""

    def test_gpt2_xl_backward_peak_measured_on_meta(self):
        recomputed = C.gpt_step_on_meta(**M.GPT2_XL, recompute=True)
        plain = C.gpt_step_on_meta(**M.GPT2_XL, recompute=False)
        self.assertQuoted(f"**{recomputed['kept_after_forward'] / 1e6:.1f} MB**")
        self.assertQuoted(f"**{recomputed['backward_beyond_states'] / 1e6:.1f} MB**")
        self.assertQuoted(f"{plain['kept_after_forward'] / 1e9:.2f} GB kept")
        self.assertQuoted(f"**{plain['backward_beyond_states'] / 1e9:.2f} GB**")
        states = M.training_memory(**M.GPT2_XL, recipe="mixed_adam8bit")["states_bytes"]
        self.assertQuoted(f"**{(states + recomputed['backward_beyond_states']) / 1e9:.1f} GB**")


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
