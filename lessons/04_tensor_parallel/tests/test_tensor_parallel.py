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
    torchrun_demo,
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


# rank r's hand-worked partial sum is (r + 1) [[1, 2], [3, 4], ...] (p rows): their sum over p
# ranks, written out (a mean, or one rank's own, differs in every row)
HAND_SUM = {1: [[1.0, 2.0]], 2: [[3.0, 6.0], [9.0, 12.0]], 3: [[6.0, 12.0], [18.0, 24.0], [30.0, 36.0]]}
HAND_GATHERED = {1: [[0.0, 0.0]], 2: [[0.0, 0.0], [1.0, 10.0]],
                 3: [[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]]}  # rank r's row [r, 10 r], in rank order


class RankResults(unittest.TestCase):
    """Per-rank results of one launch per world size, read by every test of the class. On 3
    ranks each worker also ran on the tensor-parallel group {1, 2} (torch's collectives; rank
    0 idle): `ranks()` yields those results too, as TP size 2."""

    results: dict

    def ranks(self, subgroup: bool = True):
        """(TP size, TP rank, where, result) for every rank of every world size, then (`subgroup`) for
        the two ranks of the group {1, 2} in the world of 3."""
        for world, per_rank in self.results.items():
            for rank, result in enumerate(per_rank):
                yield world, rank, f"rank {rank} of {world}, default group (lesson 01's rings)", result
        if subgroup:
            per_rank = self.results[3]
            ran = [result.get("subgroup") is not None for result in per_rank]
            self.assertEqual(ran, [False, True, True], "the group {1, 2} of 3 ranks: which ranks "
                             "ran the exercise (rank 0 idles)")
            for rank in W.SUBGROUP:
                yield 2, rank - 1, (f"global rank {rank} = TP rank {rank - 1} of the group {{1, 2}} in a "
                          "world of 3 (torch's collectives)"), per_rank[rank]["subgroup"]

    def assert_exact(self, *keys):
        """Every gap (a number, or a dict of named ones) at most the tolerance, on every rank."""
        for _, _, where, result in self.ranks():
            for key in keys:
                gaps = result[key] if isinstance(result[key], dict) else {key: result[key]}
                for name, value in gaps.items():
                    with self.subTest(where=where, key=name):
                        self.assertLessEqual(value, C.TOLERANCE, f"{name}: max |ours - expected| "
                                             f"{value:.3g} (inf: wrong shape or missing), "
                                             f"tolerance {C.TOLERANCE:g}, on {where}")

    def assert_equal(self, key, expected, message, subgroup: bool = True):
        """result[key] == expected on every rank (`expected(world, result)` if callable); bytes
        only on the default group (torch's collectives count nothing)."""
        for world, _, where, result in self.ranks(subgroup):
            want = expected(world, result) if callable(expected) else expected
            with self.subTest(where=where, key=key):
                self.assertEqual(result[key], want, f"{message}: {key} expected {want!r}, got "
                                 f"{result[key]!r}, on {where}")


@exercise("f-and-g")
class TestFAndG(RankResults):
    @classmethod
    def setUpClass(cls):
        cls.results = launch_worlds(W.f_and_g, (1, 2, 3))

    def test_f_forward_is_the_identity_and_sends_nothing(self):
        self.assert_exact("f_out_gap")
        self.assert_equal("f_forward_bytes", 0, "f's forward sends nothing", subgroup=False)

    def test_f_backward_all_reduces(self):
        """Each rank's gradient is a partial sum; after f every rank holds their sum."""
        self.assert_exact("f_grad_gap")
        self.assert_equal("f_backward_bytes", lambda world, result: result["all_reduce_bytes"],
                          "f's backward: one all-reduce through tp", subgroup=False)

    def test_g_forward_all_reduces(self):
        self.assert_exact("g_out_gap", "g_input_gap")
        self.assert_equal("g_forward_bytes", lambda world, result: result["all_reduce_bytes"],
                          "g's forward: one all-reduce through tp", subgroup=False)

    def test_g_backward_is_the_identity_and_sends_nothing(self):
        """dL/dY is the same on every rank: summing it would count it p times."""
        self.assert_exact("g_grad_gap")
        self.assert_equal("g_backward_bytes", 0, "g's backward sends nothing", subgroup=False)

    def test_by_hand(self):
        """Rank r's partial sum (r + 1) [[1, 2], [3, 4], ...]: f's backward and g's forward give
        every rank the sum, p(p+1)/2 times [[1, 2], [3, 4], ...] (not the mean, not its own)."""
        self.assert_equal("hand_f_grad", lambda world, _: HAND_SUM[world],
                          "f's backward of the hand-worked gradients")
        self.assert_equal("hand_g_out", lambda world, _: HAND_SUM[world],
                          "g's forward of the hand-worked partial sums")


@exercise("parallel-linears")
class TestParallelLinears(RankResults):
    """nn.Linear(12, 24) column-parallel and nn.Linear(24, 12) row-parallel on 1-3 ranks and on
    the group {1, 2} of 3, with an `enter` that is a plain matmul and a `leave` on torch's
    all_reduce."""

    @classmethod
    def setUpClass(cls):
        cls.results = launch_worlds(W.parallel_linears, (1, 2, 3))

    def test_column_parallel_shards_the_output_features(self):
        self.assert_equal("column_shapes", lambda world, _: [(24 // world, 12), (24 // world,)],
                          "weight (out/p, in), bias (out/p,)")
        self.assert_exact("column_out_gap", "column_grad_gap")
        self.assert_equal("column_enter_calls", 1, "forward calls enter(x, weight, bias, tp) once")
        self.assert_equal("column_enter_got_tp", True, "forward passes the layer's tp to enter")
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
                          "column and row layers refuse 2p + 1 features (p does not divide them)")


@exercise("tp-block")
class TestBlock(RankResults):
    """The block on oracle layers and f and g, against the dense block (p = 3: 6 heads, h = 24,
    s = 9; on the group {1, 2} of 3: p = 2)."""

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
        self.assert_equal("shared_with_dense", [], "the block's parameters that share storage with "
                          "the dense block it was built from (the LayerNorms must be copies)")
        self.assert_equal("forward_reduces", 2, "one g per region (attention, MLP) forward")
        self.assert_equal("backward_copies", 2, "one f per region (attention, MLP) backward")

    def test_heads_not_divisible(self):
        for heads, size in ((3, 2), (4, 3)):
            with self.subTest(heads=heads, tp=size), self.assertRaisesRegex(
                    ValueError, rf"{heads}\b.*must be divisible.*\b{size}|{size}\b.*must be "
                    rf"divisible.*\b{heads}", msg=f"{heads} heads on {size} ranks: a ValueError "
                    "'... must be divisible ...' naming both"):
                M.TensorParallelBlock(C.make_dense(0, 4 * heads, heads), M.TensorParallelGroup(0, size))


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
        self.assert_exact("scatter_out_gap", "scatter_grad_gap", "scatter_input_gap")

    def test_by_hand(self):
        """Rank r holds position r, [r, 10 r]: gathered, [[0, 0], [1, 10], ...]. Gradients and
        partial sums (r + 1) [[1, 2], [3, 4], ...] along the positions: rank r keeps row r of
        their sum."""
        self.assert_equal("hand_gather_out", lambda world, _: HAND_GATHERED[world],
                          "the gathered positions, in rank order")
        for key, what in (("hand_gather_grad", "the gather's backward"),
                          ("hand_scatter_out", "the reduce-scatter's forward")):
            for world, rank, where, result in self.ranks():
                with self.subTest(where=where, key=key):
                    self.assertEqual(result[key], [HAND_SUM[world][rank]], f"{what}: row {rank} of "
                                     f"the sum {HAND_SUM[world]} expected, got {result[key]}, on {where}")

    def test_bytes_are_one_collective_each_way(self):
        gather, scatter = (lambda world, result: result["all_gather_bytes"],
                           lambda world, result: result["reduce_scatter_bytes"])
        self.assert_equal("gather_forward_bytes", gather, "gather forward: one all-gather", False)
        self.assert_equal("gather_backward_bytes", scatter, "gather backward: one reduce-scatter", False)
        self.assert_equal("scatter_forward_bytes", scatter, "reduce-scatter forward: one", False)
        self.assert_equal("scatter_backward_bytes", gather, "reduce-scatter backward: one all-gather",
                          False)

    def test_replicated_gradients_summed_with_one_all_reduce(self):
        self.assert_exact("replicated_gaps", "other_gap")
        self.assert_equal("reduced_count", 6, "returns how many gradients were reduced")
        self.assert_equal("all_reduces", 1, "one all-reduce of the six gradients flattened")

    def test_every_blocks_replicated_gradients_in_one_all_reduce(self):
        """A list of blocks (once per step, every layer): still one all-reduce."""
        self.assert_exact("replicated_gaps_two")
        self.assert_equal("reduced_count_two", 12, "two blocks: 12 gradients reduced")
        self.assert_equal("all_reduces_two", 1, "two blocks' twelve gradients in one all-reduce")


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

    def test_keeps_only_the_shard_between_forward_and_backward(self):
        """Measured after forward, before backward: the tensors saved for backward and any
        tensor kept on the autograd context, parameters aside: the shard X_r at most."""
        for _, _, where, result in self.ranks():
            kept, shard = result["kept_bytes"], result["shard_bytes"]
            with self.subTest(where=where):
                self.assertLessEqual(kept, shard, f"{kept} B kept for backward (saved or on the "
                                     f"context), expected at most the shard's {shard} B, on {where}")

    def test_bytes_sent(self):
        """Forward: one all-gather. Backward: the re-gather and one reduce-scatter."""
        self.assert_equal("forward_bytes", lambda world, result: result["all_gather_bytes"],
                          "forward: one all-gather", False)
        self.assert_equal("backward_bytes", lambda world, result: result["all_gather_bytes"]
                          + result["reduce_scatter_bytes"], "backward: all-gather + reduce-scatter", False)


class TestShardsAndFormulas(unittest.TestCase):
    def test_shards_tile_the_weight(self):
        weight = torch.arange(24.0).reshape(4, 6)
        for world, shard, dim in ((2, M.shard_rows, 0), (3, M.shard_cols, 1)):
            tiled = torch.cat([shard(weight, r, world) for r in range(world)], dim)
            self.assertTrue(torch.equal(tiled, weight), f"{shard.__name__} over {world} ranks, "
                            f"concatenated along dim {dim}: expected {weight.tolist()}, got {tiled.tolist()}")

    def test_reduce_scatter_refuses_a_sequence_p_does_not_divide(self):
        """Sequence parallelism splits dim 0 into p equal parts: 8 positions over 3 ranks is a
        clear error (before anything is sent), not a reshape failure."""
        with self.assertRaisesRegex(ValueError, r"8 rows do not split over 3 ranks",
                                    msg="reduce-scatter of 8 positions over p = 3"):
            M.TensorParallelGroup(0, 3).reduce_scatter(torch.zeros(8, 2, 4))

    def test_bytes_formula(self):
        """Activations: TP's 4 all-reduces of S = SP's 4 all-gathers + 4 reduce-scatters; saving
        the shard adds one all-gather of S per region (2 per block). The replicated gradients'
        all-reduce is apart: 6h per block, all blocks in one, once per step."""
        s_bytes = 9 * 2 * 24 * 8
        cases = {
            "p = 1, shard saved": (M.tp_bytes_per_block(8, 2, 16, 1, 8, True, True), 0),
            "TP, p = 3": (M.tp_bytes_per_block(9, 2, 24, 3, 8, False), 4 * 2 * 2 * s_bytes // 3),
            "SP, p = 3": (M.tp_bytes_per_block(9, 2, 24, 3, 8, True), 4 * 2 * 2 * s_bytes // 3),
            "SP saving the shard, p = 3": (M.tp_bytes_per_block(9, 2, 24, 3, 8, True, True),
                                           (4 * 2 + 2) * 2 * s_bytes // 3),
            "gradients, 1 block, p = 3": (M.sp_grad_all_reduce_bytes(24, 3, 8), 2 * 2 * 6 * 24 * 8 // 3),
            "gradients, 5 blocks, p = 3": (M.sp_grad_all_reduce_bytes(24, 3, 8, 5),
                                           5 * 2 * 2 * 6 * 24 * 8 // 3),
        }
        for case, (got, expected) in cases.items():
            self.assertEqual(got, expected, f"{case}: expected {expected} B, got {got} B")
        with self.assertRaises(ValueError, msg="save_shard without sequence parallelism"):
            M.tp_bytes_per_block(8, 2, 16, 2, 8, False, True)

    def test_saved_bytes_formula_against_korthikanti(self):
        """Without the dropout terms, Korthikanti et al.'s sbh(34/t + 5as/(ht)) in 16-bit is
        sbh(32/t + 2as/(ht)): our save-the-shard form in bytes of 2, up to the small terms."""
        s, b, h, a, t = 2048, 1, 4096, 32, 8
        ours = M.saved_activation_bytes(s, b, h, a, t, 2, True, True)
        small = 2 * 4 * s * b // t + s * s  # LayerNorm statistics and the causal mask
        expected = s * b * h * (32 // t) + 2 * a * s * s * b // t
        self.assertEqual(ours - small, expected, f"shard saved: expected sbh 32/t + 2as^2b/t = "
                         f"{expected} B, got {ours - small} B")
        # plain TP keeps sbh(8 + 24/t) + 2as^2b/t: Korthikanti's 10 + 24/t less the 2 masks
        tp = M.saved_activation_bytes(s, b, h, a, t, 2, False) - 2 * 4 * s * b - s * s
        expected = s * b * h * (8 + 24 // t) + 2 * a * s * s * b // t
        self.assertEqual(tp, expected, f"TP: expected sbh(8 + 24/t) + 2as^2b/t = {expected} B, got {tp} B")

    def test_attention_is_causal(self):
        q = k = v = torch.randn(5, 1, 4, dtype=torch.float64)
        out = M.causal_attention(q, k, v, 2)
        changed = v.clone()
        changed[4] += 1  # the last position must not affect earlier outputs
        moved = (M.causal_attention(q, k, changed, 2)[:4] - out[:4]).abs().max().item()
        self.assertEqual(moved, 0.0, f"changing position 4's value moved earlier outputs by {moved:.3g}")


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed (integers: the same on any CPU)."""

    def assert_quoted(self, text: str, quoted: str, what: str) -> None:
        self.assertIn(quoted, text, f"README should quote {what} as '{quoted}'")

    def test_worked_example(self):
        text = readme_text()
        tp_bytes = M.tp_bytes_per_block(8, 2, 16, 4, 8, False)
        for form in ((False, False), (True, False), (True, True)):
            self.assert_quoted(text, f"**{M.tp_bytes_per_block(8, 2, 16, 4, 8, *form):,} bytes**",
                               f"the activation bytes of form {form}")
            self.assert_quoted(text, f"{M.saved_activation_bytes(8, 2, 16, 4, 4, 8, *form):,} bytes saved",
                               f"the bytes saved of form {form}")
        grads = M.sp_grad_all_reduce_bytes(16, 4, 8)
        self.assert_quoted(text, f"2 x 3/4 x 96 x 8 = **{grads:,} bytes**, {grads / tp_bytes:.1%} of one "
                           "block's activation bytes", "the replicated gradients' all-reduce")
        for form, elements in ((False, 512), (True, 128)):
            got = M.layernorm_activation_elements(8, 2, 16, 4, form)
            self.assertEqual(got, elements, f"LayerNorm inputs, sequence_parallel={form}: expected "
                             f"{elements}, got {got}")
        self.assert_quoted(text, "from 512 to 128 elements", "the LayerNorm inputs")

    def test_large_example(self):
        text = readme_text()
        s, b, h, a, t = 4096, 1, 8192, 64, 8
        for form in ((False, False), (True, False), (True, True)):
            mib = M.saved_activation_bytes(s, b, h, a, t, 2, *form) / 2**20
            self.assert_quoted(text, f"{mib:,.0f} MiB", f"the bytes saved of form {form}")
        softmax = a * s * s * b // t * 2 / 2**20
        self.assert_quoted(text, f"{softmax:,.0f} MiB are the softmax outputs", "the softmax outputs")
        activations = [M.tp_bytes_per_block(s, b, h, t, 2, *form) / 2**20 for form in
                       ((False, False), (True, False), (True, True))]
        self.assertEqual(activations[0], activations[1], "TP and SP send the same activation bytes")
        self.assert_quoted(text, f"Each form sends {activations[0]:,.0f} MiB of activations per block "
                           f"and micro-batch ({activations[2]:,.0f} MiB saving the shard)", "the traffic")
        kib = M.sp_grad_all_reduce_bytes(h, t, 2) / 2**10
        self.assert_quoted(text, f"all-reduce sends {kib:,.0f} KiB per block, once per step",
                           "the gradient all-reduce at the real size")

    def test_exercise_command_parses(self):
        command = re.search(r"main\.py (--world-size 3[^`]*)`", text := readme_text())
        self.assertIsNotNone(command, "the think-it-through command with --world-size 3 is in the README")
        args = C.parse_args(command.group(1).split())
        self.assertEqual((args.world_size, args.heads), (3, 6), "the command's world size and heads")
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
        for key in ("bytes", "forward_bytes"):
            got = [metrics[form][key] for form in ("tp", "sp")]
            self.assertEqual(got[0], got[1], f"{key} on 4 ranks: TP {got[0]}, SP {got[1]}: expected equal")
        self.assertEqual(metrics["sp"]["forward_bytes"], metrics["sp_shard_saved"]["forward_bytes"],
                         "saving the shard adds bytes in backward only")

    def test_missing_sequence_parallel_gradient_all_reduce_is_caught(self):
        gaps = [result["gap_without_sp_all_reduce"] for result in self.results[2]]
        self.assertGreater(max(gaps), 1e3 * C.TOLERANCE, f"without the all-reduce the LayerNorm "
                           f"gradient should be off by O(1) on 2 ranks; max |diff| {max(gaps):.3g}")

    def test_sub_groups_on_torch_collectives(self):
        """Two tensor-parallel groups of 2 in a world of 4 (a mesh's TP dimension) on
        torch.distributed's collectives: each group's block equals the dense one."""
        results = [result["sub_groups"] for result in self.results[4]]
        places = [(r[0]["tp_rank"], r[0]["tp_size"]) for r in results]
        self.assertEqual(places, [(0, 2), (1, 2), (0, 2), (1, 2)], "(TP rank, TP size) of ranks 0-3")
        for rank, per_rank in enumerate(results):
            for save_shard, result in zip((False, True), per_rank):
                self.assertEqual(result["bytes_counted"], 0, "torch's collectives: nothing counted")
                for key in ("out_gap", "input_grad_gap", "ln_grad_gap"):
                    self.assertLessEqual(result[key], C.TOLERANCE, f"rank {rank} of 4, save_shard="
                                         f"{save_shard}: {key} {result[key]:.3g}")

    def test_saving_the_shard_saves_what_it_should(self):
        """Keeping the gathered input costs 2 (s b h - s b h / p) elements more than saving the
        shard: the QKV and up inputs, whole instead of 1/p."""
        for world, (seq, batch, hidden) in ((2, (8, 2, 16)), (3, (9, 2, 24)), (4, (8, 2, 16))):
            metrics = self.results[world][0]["metrics"]
            sbh = seq * batch * hidden
            got = metrics["sp"]["saved_bytes"] - metrics["sp_shard_saved"]["saved_bytes"]
            self.assertEqual(got, 2 * (sbh - sbh // world) * 8, f"p = {world}: bytes saved by saving "
                             "the shard")


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--heads", "3", "--world-size", "2"],
                              "not divisible")
        assert_argument_error(self, C.parse_args, ["--seq", "6", "--world-size", "4"], "--seq 6")
        assert_argument_error(self, C.parse_args, ["--hidden", "10", "--heads", "4"], "--hidden 10")

    @torchrun_demo(["--seq", "4", "--hidden", "8", "--heads", "2"])
    def test_under_torchrun(self, report):
        self.assertTrue(report["passed"], f"torchrun, 2 ranks: failed checks "
                        f"{[c for c in report['checks'] if not c['passed']]}")
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"), "torchrun's world size, device, backend")


if __name__ == "__main__":
    unittest.main()
