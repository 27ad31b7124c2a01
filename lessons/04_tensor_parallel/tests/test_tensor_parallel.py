"""Lesson 04's suite: each exercise alone (f and g, the parallel linears, the block on oracle
layers, the sequence-parallel conversions, saving the shard) on 1-4 ranks; then the lesson as a
whole (untagged: integration): shards, the cost model, the parallel blocks against the dense
one (tensor parallel, sequence parallel keeping the gathered input, sequence parallel saving the
shard), sub-groups on torch's collectives, what the checks catch, the CLI and torchrun."""

from __future__ import annotations

import importlib
import re
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import (
    assert_argument_error,
    assert_every_check_passes,
    exercise,
    run_under_torchrun,
)

M = importlib.import_module("lessons.04_tensor_parallel.main")
C = importlib.import_module("lessons.04_tensor_parallel.checks")
W = importlib.import_module("lessons.04_tensor_parallel.tests.workers")
README = Path(M.__file__).with_name("README.md")


def readme_text() -> str:
    """The README with every run of whitespace one space (numbers may wrap across lines)."""
    return " ".join(README.read_text().split())


def launch_worlds(worker, worlds, args=lambda world: ()) -> dict:
    """`worker` on each world size (a short deadline: a hung rank fails fast)."""
    return {world: launch(worker, world, args(world), device="cpu", timeout_s=45) for world in worlds}


class RankResults(unittest.TestCase):
    """Per-rank results of one launch per world size, read by every test of the class."""

    results: dict

    def ranks(self):
        """(world, "rank r of p", result) for every rank of every world size."""
        for world, per_rank in self.results.items():
            for rank, result in enumerate(per_rank):
                yield world, f"rank {rank} of {world}", result

    def assert_exact(self, *keys):
        """Every gap (a number, or a dict of named ones) at most the tolerance, on every rank."""
        for _, where, result in self.ranks():
            for key in keys:
                gaps = result[key] if isinstance(result[key], dict) else {key: result[key]}
                for name, value in gaps.items():
                    with self.subTest(where=where, key=name):
                        self.assertLessEqual(value, C.TOLERANCE, f"{name}: max |diff| {value:.3g}")

    def assert_equal(self, key, expected, message):
        """result[key] == expected on every rank (`expected(world, result)` if callable)."""
        for world, where, result in self.ranks():
            want = expected(world, result) if callable(expected) else expected
            with self.subTest(where=where, key=key):
                self.assertEqual(result[key], want, f"{message} ({where})")


@exercise("f-and-g")
class TestFAndG(RankResults):
    @classmethod
    def setUpClass(cls):
        cls.results = launch_worlds(W.f_and_g, (1, 2, 3))

    def test_f_forward_is_the_identity_and_sends_nothing(self):
        self.assert_exact("f_out_gap")
        self.assert_equal("f_forward_bytes", 0, "f's forward sends nothing")

    def test_f_backward_all_reduces(self):
        """Each rank's gradient is a partial sum; after f every rank holds their sum."""
        self.assert_exact("f_grad_gap")
        self.assert_equal("f_backward_bytes", lambda world, result: result["all_reduce_bytes"],
                          "f's backward: one all-reduce through tp")

    def test_g_forward_all_reduces(self):
        self.assert_exact("g_out_gap")
        self.assert_equal("g_forward_bytes", lambda world, result: result["all_reduce_bytes"],
                          "g's forward: one all-reduce through tp")

    def test_g_backward_is_the_identity_and_sends_nothing(self):
        """dL/dY is the same on every rank: summing it would count it p times."""
        self.assert_exact("g_grad_gap")
        self.assert_equal("g_backward_bytes", 0, "g's backward sends nothing")


@exercise("parallel-linears")
class TestParallelLinears(RankResults):
    """nn.Linear(12, 24) column-parallel and nn.Linear(24, 12) row-parallel on 1-3 ranks, with
    an `enter` that is a plain matmul and a `leave` on torch's all_reduce."""

    @classmethod
    def setUpClass(cls):
        cls.results = launch_worlds(W.parallel_linears, (1, 2, 3))

    def test_column_parallel_shards_the_output_features(self):
        self.assert_equal("column_shapes", lambda world, _: [(24 // world, 12), (24 // world,)],
                          "weight (out/p, in), bias (out/p,)")
        self.assert_exact("column_out_gap", "column_grad_gap")
        self.assert_equal("column_enter_calls", 1, "forward calls enter(x, weight, bias, tp) once")
        self.assert_equal("column_copies", True, "the shard is a copy, not the dense weight")

    def test_fused_qkv_keeps_each_layers_slice(self):
        self.assert_equal("fused_shapes", lambda world, _: [(36 // world, 12), (36 // world,)],
                          "three layers: weight (3 out/p, in), bias (3 out/p,)")
        self.assert_exact("fused_out_gap")

    def test_row_parallel_shards_the_input_features(self):
        self.assert_equal("row_shapes", lambda world, _: [(12, 24 // world), (12,)],
                          "weight (out, in/p), bias (out,)")
        self.assert_exact("row_out_gap", "row_grad_gap", "row_input_grad_gap")
        self.assert_equal("leave_calls", 1, "forward sums the partial products with leave once")

    def test_features_not_divisible(self):
        self.assert_equal("errors", lambda world, _: [] if world == 1 else ["ValueError"] * 2,
                          "column and row layers refuse features that p does not divide")


@exercise("tp-block")
class TestBlock(RankResults):
    """The block on oracle layers and f and g, against the dense block."""

    @classmethod
    def setUpClass(cls):
        sizes = {1: (8, 2, 16, 4), 2: (8, 2, 16, 4), 3: (9, 2, 24, 6), 4: (8, 2, 16, 4)}
        cls.results = launch_worlds(W.tp_block, sizes, lambda world: sizes[world])

    def test_output_and_input_gradient_equal_the_dense_block(self):
        self.assert_exact("out_gap", "input_grad_gap")

    def test_every_parameter_gradient_equals_the_dense_block(self):
        self.assert_exact("grad_gaps")

    def test_one_f_and_one_g_per_region(self):
        names = sorted(f"{layer}.{kind}" for layer in ("ln1", "ln2", "qkv", "o", "up", "down")
                       for kind in ("weight", "bias"))
        self.assert_equal("parameters", names, "parameters ln1, ln2, qkv, o, up, down")
        self.assert_equal("forward_reduces", 2, "one g per region (attention, MLP) forward")
        self.assert_equal("backward_copies", 2, "one f per region (attention, MLP) backward")

    def test_heads_not_divisible(self):
        with self.assertRaisesRegex(ValueError, r"3\b.*must be divisible.*\b2|2\b.*must be divisible.*\b3"):
            M.TensorParallelBlock(C.make_dense(0, 12, 3), M.TensorParallelGroup(rank=0, size=2))


@exercise("sp-conversions")
class TestSequenceParallelConversions(RankResults):
    @classmethod
    def setUpClass(cls):
        cls.results = launch_worlds(W.sp_conversions, (1, 2, 3))

    def test_gather_forward_and_backward(self):
        """Forward: every rank's rows, in rank order. Backward: the sum of every rank's
        gradient, this rank's rows."""
        self.assert_exact("gather_out_gap", "gather_grad_gap")

    def test_reduce_scatter_forward_and_backward(self):
        """Forward: the sum of the partials, this rank's rows of the sequence (dim 0).
        Backward: every rank's gradient gathered along the sequence."""
        self.assert_exact("scatter_out_gap", "scatter_grad_gap")

    def test_bytes_are_one_collective_each_way(self):
        gather, scatter = (lambda world, result: result["all_gather_bytes"],
                           lambda world, result: result["reduce_scatter_bytes"])
        self.assert_equal("gather_forward_bytes", gather, "gather forward: one all-gather")
        self.assert_equal("gather_backward_bytes", scatter, "gather backward: one reduce-scatter")
        self.assert_equal("scatter_forward_bytes", scatter, "reduce-scatter forward: one")
        self.assert_equal("scatter_backward_bytes", gather, "reduce-scatter backward: one all-gather")

    def test_replicated_gradients_summed_with_one_all_reduce(self):
        self.assert_exact("replicated_gaps", "other_gap")
        self.assert_equal("reduced_count", 6, "returns how many gradients were reduced")
        self.assert_equal("all_reduces", 1, "one all-reduce of the six gradients flattened")


@exercise("save-the-shard")
class TestSaveTheShard(RankResults):
    @classmethod
    def setUpClass(cls):
        cls.results = launch_worlds(W.save_the_shard, (1, 2, 3))

    def test_output(self):
        self.assert_exact("out_gap")

    def test_weight_and_bias_gradients_over_every_position(self):
        self.assert_exact("weight_grad_gap", "bias_grad_gap")

    def test_input_gradient_is_reduce_scattered(self):
        """dX = sum over ranks of dY_r W_r, this rank's rows."""
        self.assert_exact("input_grad_gap")

    def test_saves_only_the_shard(self):
        for _, where, result in self.ranks():
            saved, shard = result["saved_bytes"], result["shard_bytes"]
            self.assertLessEqual(saved, shard, f"{saved} B saved for backward, the shard is "
                                               f"{shard} B ({where})")

    def test_bytes_sent(self):
        """Forward: one all-gather. Backward: the re-gather and one reduce-scatter."""
        self.assert_equal("forward_bytes", lambda world, result: result["all_gather_bytes"],
                          "forward: one all-gather")
        self.assert_equal("backward_bytes", lambda world, result: result["all_gather_bytes"]
                          + result["reduce_scatter_bytes"], "backward: all-gather + reduce-scatter")


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
