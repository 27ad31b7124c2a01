"""PyTorch's engines beside ours (torch_engines.py): the same GPT, batches and layouts trained with
fully_shard, parallelize_module and torch.distributed.pipelining equal one process and our
NDTrainer; what torch 2.13 refuses on CPU/gloo (context_parallel; clip_grad_norm_ across meshes)
still fails with the error the docs quote; a planted mistake is caught. Two launches, shared by
the class: dp2, tp2, pp2, cp2 (+ the planted run) on 2 ranks, dp2 x tp2 on 4; device="cpu"."""

from __future__ import annotations

import dataclasses
import importlib
import math
import unittest

import torch

T = importlib.import_module("lessons.13_capstone.torch_engines")
nd = importlib.import_module("lessons.13_capstone.nd")
nd_model = importlib.import_module("lessons.13_capstone.nd_model")

# float64 on the CPU: the runs differ from one process only in the order of sums (the dp mean,
# the tp all-reduce, micro-batch accumulation, the norm's reduction), a few ulps per sum over 2
# layers and 3 AdamW steps; measured at most 6.7e-16 absolute (torch's and ours; 3e-15 with the
# README's 4 layers) on losses ~3.5 and norms ~1-3.3, about 1e-15 relative. 1e-12 relative leaves
# a margin of several hundred, and the planted mistake below moves the loss by 6.4e-3.
RELATIVE = 1e-12
CPU_CP_ERROR = ("NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
                "does not have a sharding strategy registered.")
# torch.nn.utils.clip_grad_norm_ on gradients that are not all on one mesh (pytorch issues 180346,
# 121020; torchtune 2420): plain replicated tensors beside TP's DTensors, and FSDP2's dp-only
# DTensors (the replicated parameters) beside (dp, tp) DTensors.
MIXED_TENSOR_ERROR = ("RuntimeError: aten.mul_.Tensor got mixed torch.Tensor and DTensor, need to convert "
                      "all torch.Tensor to DTensor before calling distributed operators!")
MIXED_MESH_ERROR = ("RuntimeError: All operands in aten.stack.default must have the same mesh, but got "
                    "DeviceMesh((dp=2, tp=2), 'cpu', stride=(2, 1)) and DeviceMesh((dp=2), 'cpu', "
                    "stride=(2,)).")
TRAINED = ["dp2", "tp2", "pp2", "dp2 x tp2"]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RELATIVE * abs(b)


class TestGPTStage(unittest.TestCase):
    """The hand-cut stages and the SDPA attention, in this process: the same function as nd_model.GPT."""

    def setUp(self):
        self.config = nd_model.GPTConfig()
        self.gpt = nd_model.build_gpt(self.config, torch.float64)
        self.tokens = T.batches_for(self.config, 1)[0][:, :-1]

    def test_stages_compose_to_the_model(self):
        whole = self.gpt(self.tokens)
        self.assertTrue(torch.equal(T.GPTStage(self.gpt)(self.tokens), whole),
                        "one stage holding every layer must equal the whole model")
        cut = T.GPTStage(self.gpt, 1, 2)(T.GPTStage(self.gpt, 0, 2)(self.tokens))
        self.assertTrue(torch.equal(cut, whole), "the stages in a row must equal the whole model")
        with self.assertRaisesRegex(ValueError, "4 layers do not split over pp = 3"):
            T.GPTStage(self.gpt, 0, 3)

    def test_sdpa_attention_is_the_same_attention(self):
        whole = self.gpt(self.tokens)
        sdpa = T.GPTStage(self.gpt, sdpa=True)(self.tokens)
        # float64, order of sums only: a sum's rounding is relative to its terms, so a logit near
        # zero (the difference of terms ~1) needs the error bound of the largest logit (measured
        # 1e-16 absolute on a logit of 8e-5 with AVX-512 kernels: 1.2e-12 relative)
        scale = whole.abs().max().item()
        torch.testing.assert_close(sdpa, whole, rtol=RELATIVE, atol=RELATIVE * scale)
        self.assertFalse(torch.equal(T.GPTStage(self.gpt, sdpa=True)(self.tokens.flip(1)), whole),
                         "other tokens gave the same output: the comparison cannot fail")

    def test_parse_layout(self):
        self.assertEqual(T.parse_layout("dp2xtp2xpp2"), nd.Layout(dp=2, tp=2, pp=2))
        self.assertEqual(T.parse_layout("dp2 x cp2"), nd.Layout(dp=2, cp=2))
        for bad in ("dp2xdp2", "ep2", "tp"):
            with self.assertRaisesRegex(ValueError, "bad layout"):
                T.parse_layout(bad)

    def test_engine_names(self):
        self.assertEqual(T.engine_of(nd.Layout(dp=2, tp=2)), "parallelize_module + fully_shard")
        self.assertEqual(T.engine_of(nd.Layout(tp=2, pp=2)), "pipelining 1F1B + parallelize_module")
        self.assertEqual(T.engine_of(nd.Layout(cp=2)), "context_parallel")


class TestTorchEngines(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # 2 layers (the default config's 4 in the README's table): pp2's stages still hold a
        # block each, and the launches take half the CPU; TestGPTStage cuts the 4-layer model
        cls.config = dataclasses.replace(nd_model.GPTConfig(), layers=2)
        cls.batches = T.batches_for(cls.config, 3)
        cls.reference, _ = nd_model.train_one_process(cls.config, cls.batches)
        cls.layouts = [nd.Layout(dp=2), nd.Layout(tp=2), nd.Layout(pp=2), nd.Layout(cp=2),
                       nd.Layout(dp=2, tp=2)]
        cls.results = T.run_layouts(cls.layouts, cls.config, cls.batches, device="cpu",
                                    planted=((nd.Layout(tp=2), "heads-not-divided"),))

    def test_torch_engines_equal_one_process_and_ours(self):
        for name in TRAINED:
            for rank, result in enumerate(self.results[name]):
                for step, (theirs, ours, one) in enumerate(zip(result["torch"], result["ours"],
                                                               self.reference, strict=True)):
                    with self.subTest(layout=name, rank=rank, step=step):
                        self.assertIsNone(result["error"])
                        for which in (0, 1):  # loss, gradient norm
                            self.assertTrue(close(theirs[which], one[which]), (theirs, one))
                            self.assertTrue(close(theirs[which], ours[which]), (theirs, ours))

    def test_clipping_engaged(self):
        """clip = 1.0 and the first norms are above it: the clipped step is what is compared."""
        self.assertGreater(self.reference[0][1], self.config.clip)

    def test_context_parallel_needs_a_cuda_attention_kernel(self):
        """torch 2.13 on CPU: the ring handlers and the CP sharding rules exist only for the
        flash, efficient and cuDNN CUDA kernels (torch/distributed/tensor/experimental/
        _context_parallel/_attention.py, _sharding_rules.py). The day this runs, this fails."""
        for result in self.results["cp2"]:
            self.assertEqual(result["error"], CPU_CP_ERROR)
            self.assertIsNone(result["torch"])
            for ours, one in zip(result["ours"], self.reference, strict=True):  # ours runs cp2
                self.assertTrue(close(ours[0], one[0]) and close(ours[1], one[1]),
                                f"ours {ours} against one process {one}")

    def test_torch_clip_grad_norm_alone(self):
        """What torch.nn.utils.clip_grad_norm_ says of each rank's first gradients: the global
        norm with one mesh (FSDP2's DTensors), a stage's own norm under pp (torchtitan issue
        596: the stages' squares must be summed), and an error for a mix of meshes."""
        first_norm = self.reference[0][1]
        for probe in (r["torch_clip"] for r in self.results["dp2"]):
            self.assertTrue(close(probe, first_norm), f"dp2: clip_grad_norm_ said {probe}, expected "
                                                      f"the global norm {first_norm}")
        stages = [r["torch_clip"] for r in self.results["pp2"]]
        self.assertTrue(all(norm < first_norm for norm in stages),
                        f"each stage's norm {stages} must be below the whole norm {first_norm}")
        self.assertTrue(close(math.sqrt(sum(norm**2 for norm in stages)), first_norm),
                        f"sqrt(sum of the stages' squared norms {stages}) != the whole norm {first_norm}")
        for name, error in (("tp2", MIXED_TENSOR_ERROR), ("dp2 x tp2", MIXED_MESH_ERROR)):
            for result in self.results[name]:
                self.assertEqual(result["torch_clip"], error)

    def test_planted_mistake_is_caught(self):
        """tp without dividing `heads`: each rank splits its h / tp features into all H heads of
        1 / tp the width; nothing fails, it trains on the wrong attention."""
        for result in self.results["tp2 with heads-not-divided"]:
            loss, one = result["torch"][0][0], self.reference[0][0]
            self.assertGreater(abs(loss - one), 1e6 * RELATIVE * one)

    def test_table(self):
        rows = {row["layout"]: row for row in T.table(self.layouts, self.results, self.reference)}
        for name in TRAINED:
            self.assertLess(max(rows[name][key] for key in ("loss_diff", "norm_diff", "ours_loss_diff",
                                                            "ours_norm_diff")), RELATIVE * 4)
            self.assertIsNone(rows[name]["error"])
        self.assertTrue(math.isnan(rows["cp2"]["loss_diff"]),
                        f"cp2 row: expected no loss difference (NaN), got {rows['cp2']['loss_diff']}")
        self.assertEqual(rows["cp2"]["error"], CPU_CP_ERROR)
        text = T.format_table(list(rows.values()))
        self.assertIn("| dp2 x tp2 | parallelize_module + fully_shard |", text)


if __name__ == "__main__":
    unittest.main()
