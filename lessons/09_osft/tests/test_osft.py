"""Lesson 09's suite: the SVD split, naive vs fused forward, Gram vs factored projections,
orthogonality under Adam, the sharded U and V sides on 1, 2, 4 and 5 ranks, the forgetting
demo (right and wrong V projection), the cost model, the CLI, torchrun, and the README's
numbers (TestDocNumbers).

Learner mode: the tests tagged `@exercise(...)` grade one exercise of main.py each, on inputs
and truths built here with plain torch (orthonormal factors from a QR, the dense layer), so a
wrong piece fails its own exercise and not the others; the untagged tests (the checks of the
demo, the docs' numbers, the CLI) are the "integration" criterion."""

from __future__ import annotations

import importlib
import unittest
from pathlib import Path

import torch
import torch.nn as nn

from lessons._checks import max_abs_diff
from lessons._launch import launch
from lessons._testing import (
    assert_argument_error,
    assert_every_check_passes,
    exercise,
    torchrun_demo,
)

M = importlib.import_module("lessons.09_osft.main")
C = importlib.import_module("lessons.09_osft.checks")
W = importlib.import_module("lessons.09_osft.tests.workers")
README = Path(M.__file__).with_name("README.md")


def orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    """(rows, cols) float64 with orthonormal columns (a QR of a random matrix)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(rows, cols, generator=generator, dtype=torch.float64))[0]


def factors(n_rows: int, n_cols: int, k_high: int, seed: int = 0, bias: bool = True):
    """A dense float64 weight (N, M), its SVD cut at k_high in the order the kernels take, and a
    bias (or None): made here with torch.linalg.svd, not with the learner's svd_split."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_rows, n_cols, generator=generator, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    b = torch.randn(n_rows, generator=generator, dtype=torch.float64) if bias else None
    return weight, [u[:, :k_high], s[:k_high], vh[:k_high], u[:, k_high:], s[k_high:], vh[k_high:], b]


@exercise("svd-split")
class TestSplit(unittest.TestCase):
    def test_rank_ratio_semantics(self):
        self.assertEqual(M.frozen_rank(24, 16, 0.5), 8)
        self.assertEqual(M.frozen_rank(24, 16, 0.99), 15)  # floor(15.84)
        self.assertEqual(M.frozen_rank(24, 16, 1.0), 15)  # capped: one direction stays trainable
        self.assertEqual(M.frozen_rank(10, 7, 0.0), 0)
        self.assertEqual(M.frozen_rank(5, 9, 1.0), 4)  # capped at min(N, M) - 1, here with N < M
        self.assertEqual(M.frozen_rank(9, 5, 0.95), 4)  # floor(4.75)

    def test_split_reconstructs_and_is_orthonormal(self):
        weight = torch.randn(9, 6, dtype=torch.float64)
        parts = M.svd_split(weight, 0.5)
        self.assertEqual(parts["U_high"].shape, (9, 3))
        self.assertEqual(parts["V_low"].shape, (3, 6))
        rebuilt = (parts["U_high"] * parts["S_high"]) @ parts["V_high"] + \
            (parts["U_low"] * parts["S_low"]) @ parts["V_low"]
        self.assertLess(max_abs_diff(rebuilt, weight), C.TOLERANCE)
        self.assertGreaterEqual(float(parts["S_high"].min()), float(parts["S_low"].max()),
                                "every frozen singular value is at least every trainable one")
        eye = torch.eye(6, dtype=torch.float64)
        u = torch.cat([parts["U_high"], parts["U_low"]], dim=1)
        v = torch.cat([parts["V_high"], parts["V_low"]], dim=0)
        self.assertLess(max_abs_diff(u.T @ u, eye), C.TOLERANCE)
        self.assertLess(max_abs_diff(v @ v.T, eye), C.TOLERANCE)

    def test_split_at_full_rank_keeps_one_trainable_direction(self):
        parts = M.svd_split(torch.randn(5, 8, dtype=torch.float64), 1.0)
        self.assertEqual({k: tuple(v.shape) for k, v in parts.items()},
                         {"U_high": (5, 4), "S_high": (4,), "V_high": (4, 8),
                          "U_low": (5, 1), "S_low": (1,), "V_low": (1, 8)})

    def test_every_part_keeps_the_weights_dtype(self):
        weight = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))  # float32
        parts = M.svd_split(weight, 0.4)
        self.assertEqual({name: part.dtype for name, part in parts.items()},
                         dict.fromkeys(parts, torch.float32), "every part in the weight's dtype")
        rebuilt = (parts["U_high"] * parts["S_high"]) @ parts["V_high"] + \
            (parts["U_low"] * parts["S_low"]) @ parts["V_low"]
        # an fp32 product of 5 terms of size ~|W|: a few fp32 ulps of the largest entry
        self.assertLess(max_abs_diff(rebuilt, weight), 1e-5 * float(weight.abs().max()),
                        "the float32 parts rebuild the float32 weight")

    def test_frozen_parts_are_not_parameters(self):
        layer = M.OSFTLinear(nn.Linear(6, 9), 0.5)
        self.assertEqual({n for n, _ in layer.named_parameters()}, {"U_low", "S_low", "V_low", "bias"})


@exercise("fused-forward")
class TestFusedForward(unittest.TestCase):
    """`osft_forward_fused` against the dense layer x W^T + b and against the naive forward
    (output and every gradient), with and without a bias, on 1-, 2- and 3-D inputs."""

    def setUp(self):
        torch.manual_seed(0)

    def test_equals_the_dense_layer(self):
        for bias in (True, False):
            for shape in ((7, 10), (2, 3, 10), (10,)):
                with self.subTest(bias=bias, shape=shape):
                    weight, args = factors(6, 10, 2, bias=bias)
                    x = torch.randn(*shape, dtype=torch.float64)
                    want = x @ weight.T + (args[-1] if bias else 0)
                    got = M.osft_forward_fused(x, *args)
                    self.assertEqual(tuple(got.shape), tuple(want.shape))
                    self.assertLess(max_abs_diff(got, want), C.TOLERANCE)

    def test_gradients_equal_the_naive_forward(self):
        _, args = factors(9, 5, 3, seed=1)
        x = torch.randn(4, 5, dtype=torch.float64)
        grads = []
        for forward in (M.osft_forward_fused, M.osft_forward_naive):
            leaves = [a.clone().requires_grad_(True) for a in [x, *args]]
            forward(*leaves).sin().sum().backward()
            grads.append([leaf.grad for leaf in leaves])
        for index, (fused, naive) in enumerate(zip(*grads)):
            with self.subTest(argument=index):
                self.assertIsNotNone(fused)
                self.assertLess(max_abs_diff(fused, naive), C.TOLERANCE)


@exercise("projections")
class TestProjections(unittest.TestCase):
    """The four projections against dU - Q Q^T dU / dV - dV Q Q^T written here, on orthonormal
    factors from a QR (k_h == k_l and k_h != k_l), and what they guarantee: the result is
    orthogonal to the frozen span, and projecting twice changes nothing."""

    def setUp(self):
        torch.manual_seed(0)

    CASES = [(12, 4, 4), (12, 5, 3), (10, 2, 7)]  # (N or M, k_high, k_low)

    def test_u_side(self):
        for n_rows, k_high, k_low in self.CASES:
            u_high = orthonormal(n_rows, k_high, n_rows + k_high)
            d_u = torch.randn(k_low, n_rows, dtype=torch.float64).T.contiguous()
            want = d_u - u_high @ (u_high.T @ d_u)
            for project in (M.project_u_gram, M.project_u_factored):
                with self.subTest(project=project.__name__, shape=(n_rows, k_high, k_low)):
                    got = project(d_u, u_high)
                    self.assertEqual(tuple(got.shape), (n_rows, k_low))
                    self.assertLess(max_abs_diff(got, want), C.TOLERANCE)
                    self.assertLess(float((u_high.T @ got).abs().max()), C.TOLERANCE)
                    self.assertLess(max_abs_diff(project(got, u_high), got), C.TOLERANCE)

    def test_v_side(self):
        for n_cols, k_high, k_low in self.CASES:
            v_high = orthonormal(n_cols, k_high, n_cols * k_high).T  # orthonormal rows (k_h, M)
            d_v = torch.randn(k_low, n_cols, dtype=torch.float64) + 3 * v_high[:1]  # in the frozen span too
            want = d_v - (d_v @ v_high.T) @ v_high
            for project in (M.project_v_gram, M.project_v_factored):
                with self.subTest(project=project.__name__, shape=(n_cols, k_high, k_low)):
                    got = project(d_v, v_high)
                    self.assertEqual(tuple(got.shape), (k_low, n_cols))
                    self.assertLess(max_abs_diff(got, want), C.TOLERANCE)
                    self.assertLess(float((got @ v_high.T).abs().max()), C.TOLERANCE)
                    self.assertLess(max_abs_diff(project(got, v_high), got), C.TOLERANCE)


class TestKernels(unittest.TestCase):
    def test_single_process_checks(self):
        checks, _ = C.single_process_checks(1, "cpu")
        for check in checks:
            with self.subTest(check=check.name):
                self.assertTrue(check.passed, check.detail)

    def test_layer_fused_without_bias_and_3d_input(self):
        layer = nn.Linear(8, 5, bias=False).double()
        fused, naive = M.OSFTLinear(layer, 0.4), M.OSFTLinear(layer, 0.4, fused=False)
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        self.assertEqual(fused(x).shape, (2, 3, 5))
        self.assertLess(max_abs_diff(fused(x), naive(x)), C.TOLERANCE)

    def test_projection_removes_the_frozen_component(self):
        parts = M.svd_split(torch.randn(12, 10, dtype=torch.float64), 0.5)
        d_v = torch.randn(5, 10, dtype=torch.float64) + parts["V_high"][:5] * 3  # inside the frozen span
        v_left = M.project_v_factored(d_v, parts["V_high"]) @ parts["V_high"].T
        self.assertLess(float(v_left.abs().max()), C.TOLERANCE)
        d_u = torch.randn(12, 5, dtype=torch.float64)
        u_left = parts["U_high"].T @ M.project_u_factored(d_u, parts["U_high"])
        self.assertLess(float(u_left.abs().max()), C.TOLERANCE)

    def test_the_all_reduced_v_projection_is_not_a_projection(self):
        parts = M.svd_split(torch.randn(12, 10, dtype=torch.float64), 0.5)
        d_v = torch.randn(5, 10, dtype=torch.float64)
        once = C.all_reduced_v_projection(d_v, parts["V_high"], 1)  # one rank: the right answer
        self.assertLess(max_abs_diff(once, M.project_v_factored(d_v, parts["V_high"])), C.TOLERANCE)
        wrong = C.all_reduced_v_projection(d_v, parts["V_high"], 4)
        self.assertGreater(float((wrong @ parts["V_high"].T).abs().max()), 1e-3)


U_SHAPES = [(6, 3, 3), (9, 3, 4), (16, 6, 6)]  # (N, k_high, k_low): empty tail chunks on 5 ranks
V_SHAPES = [(6, 6, 10), (3, 4, 7), (5, 2, 9)]  # (k_high, k_low, M)
# (world size, the ranks the rows are split over; None: the world). 3: odd; (1, 2, 3) of 4: an
# odd subgroup that is not the world (rank 0 idles); (0, 2) of 3: a subgroup with a gap in it.
SHARD_CONFIGS = [(2, None), (3, None), (5, None), (4, (1, 2, 3)), (3, (0, 2))]


def where(world: int, members, rank: int) -> str:
    return f"world {world}, rows split over {'every rank' if members is None else members}, rank {rank}"


@exercise("sharded-u")
class TestShardedU(unittest.TestCase):
    """`sharded_project_u` and its batched form on 2, 3 and 5 ranks and on subgroups (rows split
    with torch.chunk semantics over the group, empty tails on 5) against the one-process
    projection; one all-reduce (over the group) per module, ONE for the batch. The first
    configuration that fails ends the test (a hang costs one deadline, not one per config)."""

    def test_on_worlds_and_subgroups(self):
        for world, members in SHARD_CONFIGS:
            results = launch(W.sharded_u, world, (U_SHAPES, members), device="cpu", timeout_s=60)
            for rank, result in enumerate(results):
                config = where(world, members, rank)
                if members is not None and rank not in members:
                    self.assertEqual(result, {"idle": True}, config)
                    continue
                self.assertLess(max(result["gaps"]), C.TOLERANCE,
                                f"{config}: max |projected rows - one process| per module: {result['gaps']}")
                self.assertEqual(result["per_module"], len(U_SHAPES),
                                 f"{config}: all-reduces, one per module")
                self.assertEqual(result["batched_count"], len(U_SHAPES),
                                 f"{config}: modules the batch returned")
                self.assertLess(max(result["batch_gaps"]), C.TOLERANCE,
                                f"{config}: max |batched rows - one process| per module: "
                                f"{result['batch_gaps']}")
                self.assertEqual(result["batched_calls"], 1, f"{config}: all-reduces for the whole batch")


@exercise("sharded-v")
class TestShardedV(unittest.TestCase):
    """`Collectives.all_gather_rows` and `sharded_project_v` on 2, 3 and 5 ranks and on
    subgroups against the one-process projection. The V side must not all-reduce: on 2 ranks
    with equal blocks a plain Collectives shows the numbers are wrong; with uneven blocks the
    test's Collectives refuses all_reduce on every rank (an all-reduce of different shapes
    would hang gloo). The first configuration that fails ends the test."""

    def check(self, results, shapes, members=None):
        for rank, result in enumerate(results):
            config = where(len(results), members, rank)
            if members is not None and rank not in members:
                self.assertEqual(result, {"idle": True}, config)
                continue
            self.assertTrue(result["gather_ok"], f"{config}: all_gather_rows must return the whole 7 x 3 "
                                                 f"tensor, chunks in group-rank order")
            self.assertEqual(result["gather_calls"], 1, f"{config}: all_gather_rows counts one all-gather")
            self.assertEqual(result["all_reduces"], 0, f"{config}: the V side all-reduced")
            self.assertLess(max(result["gaps"]), C.TOLERANCE,
                            f"{config}: max |projected rows - one process| per module: {result['gaps']}")
            self.assertEqual(result["all_gathers"], 1 + len(shapes),
                             f"{config}: all-gathers, 1 + one per module")

    def test_equal_blocks_on_2_ranks(self):
        shapes = [(6, 6, 10), (4, 2, 8)]
        self.check(launch(W.sharded_v, 2, (shapes, False), device="cpu", timeout_s=60), shapes)

    def test_uneven_blocks_on_worlds_and_subgroups(self):
        for world, members in SHARD_CONFIGS[1:]:
            results = launch(W.sharded_v, world, (V_SHAPES, True, members), device="cpu", timeout_s=60)
            self.check(results, V_SHAPES, members)


class TestCostModel(unittest.TestCase):
    def test_forward_traffic(self):
        # naive 7TN element moves with a bias (5TN without), fused 3TN
        self.assertEqual(M.forward_cost(10, 4, 6, 2, 1)["extra_elements_naive"], 4 * 10 * 4)
        self.assertEqual(M.forward_cost(10, 4, 6, 2, 1, bias=False)["extra_elements_naive"], 2 * 10 * 4)
        self.assertEqual(M.forward_cost(10, 4, 6, 2, 1)["flops"], 2 * 10 * 10 * 3 + 10 * 3 + 10 * 4)

    def test_projection_flops_and_ratio(self):
        flops = M.projection_flops(1024, 1024, 512, 512)
        self.assertEqual(flops["gram"], 4 * 1024 ** 2 * 1024)
        self.assertEqual(flops["factored"], 4 * 2048 * 512 * 512)
        for k_high in (512, 256, 921, 100):  # square, split whole: N^2 / (2 k_h k_l), least at k_h = k_l
            k_low = 1024 - k_high
            ratio = M.projection_flops(1024, 1024, k_high, k_low)["ratio"]
            self.assertAlmostEqual(ratio, 1024 ** 2 / (2 * k_high * k_low))
            self.assertGreaterEqual(ratio, 2.0)
        self.assertEqual(M.gram_projection_flops(8, 6, 3, 2, cached_gram=True), 2 * (64 + 36) * 2)

    def test_v_side_elements(self):
        counts = M.v_side_received_elements(4096, 2048, 8)
        self.assertEqual(counts["all_gather_v_high"], 7 * 2048 * 4096 // 8)
        self.assertEqual(counts["all_reduce_gram"], 2 * 7 * 4096 * 4096 // 8)


class TestSharded(unittest.TestCase):
    def test_chunks_follow_torch_chunk_with_empty_tails(self):
        rows = torch.arange(6.0).view(6, 1)
        self.assertEqual([M.chunk_rows(rows, r, 4).shape[0] for r in range(4)], [2, 2, 2, 0])
        self.assertEqual([M.chunk_rows(rows, r, 5).shape[0] for r in range(5)], [2, 2, 2, 0, 0])
        self.assertEqual(torch.cat([M.chunk_rows(rows, r, 4) for r in range(4)]).flatten().tolist(),
                         rows.flatten().tolist(), "the chunks, in rank order, are the rows")

    def test_every_sharded_check_on_1_2_5_ranks(self):  # 4 ranks: TestDocNumbers and the demo
        results = {world: launch(W.sharded, world, device="cpu", timeout_s=45) for world in (1, 2, 5)}
        assert_every_check_passes(self, results)
        self.assertGreater(results[2][0]["metrics"]["v_wrong_gap"], 1e-3)

    def test_all_reduce_benchmark_runs(self):
        cases = launch(W.all_reduce_bench, 2, device="cpu", timeout_s=60)[0]
        self.assertEqual([(c["modules"], c["numel"]) for c in cases], [(4, 64), (2, 256)])
        self.assertTrue(all(c["per_module_s"] > 0 and c["batched_s"] > 0 for c in cases),
                        f"every timing positive: {cases}")


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed (float64: the same on any CPU)."""

    @classmethod
    def setUpClass(cls):
        cls.readme = README.read_text()

    def test_orthogonality_demo(self):
        self.assertIn(f"**{C.train_orthogonal(300, False, 0)['orthogonality_error']:.2f}**", self.readme)

    def test_wrong_v_gap_on_4_ranks(self):
        results = launch(W.sharded, 4, device="cpu", timeout_s=45)
        assert_every_check_passes(self, {4: results})
        self.assertIn(f"off by **{results[0]['metrics']['v_wrong_gap']:.1f}**", self.readme)

    def test_forgetting_demo(self):
        result = C.continual_learning(0, 400)
        for check in C.continual_checks(result):
            with self.subTest(check=check.name):
                self.assertTrue(check.passed, check.detail)
        for key in ("acc_A_before", "acc_A_after_full_ft", "acc_A_after_osft", "acc_B_full_ft",
                    "acc_B_osft", "forgetting_osft_grads", "forgetting_osft_grads_wrong_v"):
            self.assertIn(f"**{result[key]:.1%}**", self.readme, key)
        for key in ("loss_B_osft_grads", "loss_B_osft_grads_wrong_v"):
            self.assertIn(f"**{result[key]:.3f}**", self.readme, key)
        for key in ("v_side_error_osft_grads", "v_side_error_osft_grads_wrong_v"):
            self.assertIn(f"**{result[key]:.2f}**", self.readme, key)

    def test_cost_model_numbers(self):
        for bias in (True, False):
            saved = M.forward_cost(4096, 1024, 1024, 512, 512, bias=bias)["extra_bytes_naive"]
            self.assertIn(f"{saved / 1e6:.1f} MB", self.readme)
        flops = M.projection_flops(1024, 1024, 512, 512)
        self.assertIn(f"{flops['gram']:.2e}", self.readme)
        self.assertIn(f"{flops['factored']:.2e}", self.readme)
        k_high = M.frozen_rank(1024, 1024, 0.9)
        self.assertIn(f"{M.projection_flops(1024, 1024, k_high, 1024 - k_high)['ratio']:.1f}", self.readme)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--rank-ratio", "1.5"], "--rank-ratio")
        assert_argument_error(self, C.parse_args, ["--steps", "5"], "--steps")
        assert_argument_error(self, C.parse_args, ["--bench-size", "10"], "--bench-size")
        # no machine has 64 GPUs: --device cuda refuses with one line instead of running on the CPU
        assert_argument_error(self, C.parse_args, ["--device", "cuda", "--world-size", "64"],
                              "needs 64 GPU(s)")

    @torchrun_demo(["--quick", "--timeout", "120"])
    def test_under_torchrun(self, report):
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual(report["world_size"], 2)


if __name__ == "__main__":
    unittest.main()
