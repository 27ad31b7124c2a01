"""Lesson 03's suite, graded by exercise (lessons/_grading.py): the memory and traffic formulas
(zero-formulas), shards and the ZeRO-1 step (zero1-step), the ZeRO-2 hook (zero2-hook), the
ZeRO-3 hooks (zero3-hooks) and sharded clipping (sharded-clip), each on 3 spawned ranks, over
the world and over a process group ({0, 2} and {1}), with the other exercises' pieces given;
untagged (integration): every stage against plain DP, one process, ZeroRedundancyOptimizer
and FSDP2 (float64, and bf16 mixed precision) on 1 and 3 ranks (2 under torchrun), the
optimizer contract (frozen, tied and unused parameters, state dicts resharded, GradScalers),
the numbers the docs quote, and the CLI. The planted bugs these tests must catch are in
../bugs.json."""

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

from lessons._launch import WorkerError, launch
from lessons._testing import (
    assert_argument_error,
    assert_every_check_passes,
    exercise,
    launch_once,
    selected_exercises,
    torchrun_demo,
)

M = importlib.import_module("lessons.03_zero.main")  # the technique
C = importlib.import_module("lessons.03_zero.checks")  # the proof
W = importlib.import_module("lessons.03_zero.tests.workers")
README = Path(M.__file__).with_name("README.md").read_text()
EXERCISE_TIMEOUT_S = 120  # per exercise launch (a loaded 2-core machine); a stub fails at once


@launch_once
def all_exercises() -> list[dict]:
    """Every exercise's worker in one launch on 3 ranks."""
    return launch(W.exercises, W.WORLD, (list(W.EXERCISE_WORKERS),), device="cpu",
                  timeout_s=EXERCISE_TIMEOUT_S)


@launch_once
def one_exercise(name: str) -> list[dict]:
    """Exercise `name`'s worker alone on 3 ranks."""
    return launch(W.exercises, W.WORLD, ([name],), device="cpu", timeout_s=EXERCISE_TIMEOUT_S)


def exercise_results(name: str) -> list[dict]:
    """Exercise `name`'s worker results on 3 ranks. Every exercise's worker runs in one shared
    launch; when that launch fails (an exercise raised on a rank: a stub, a crash, or a hang at
    the deadline), each exercise runs alone, so that one exercise's failure never fails
    another's tests; the failing one's tests then report its own error (NotImplementedError
    for a stub). A failed launch is remembered, never retried (launch_once). When the grader
    runs some exercises alone (a planted bug, `course grade --exercise`), only theirs run."""
    if selected_exercises() is not None:
        return [result[name] for result in one_exercise(name)]
    try:
        return [result[name] for result in all_exercises()]
    except (WorkerError, AssertionError):
        return [result[name] for result in one_exercise(name)]


class ExerciseCase(unittest.TestCase):
    exercise_id = ""
    results: list[dict] = []

    @classmethod
    def setUpClass(cls):
        cls.results = exercise_results(cls.exercise_id)

    def assert_holds(self, *keys: str) -> None:
        """Each named check held on every rank ("" means it did; else the problem, shown)."""
        for key in keys:
            for result in self.results:
                if result[key]:
                    self.fail(result[key])


@exercise("zero-formulas")
class TestFormulas(unittest.TestCase):
    """zero_bytes_per_device and zero_communication_elements (float64 arithmetic: the same on
    every CPU)."""

    def test_paper_example(self):
        table = M.memory_table_gb(7.5e9, 64)  # calls zero_bytes_per_device per stage
        for key, gb in (("baseline_gb", 120.0), ("zero1_gb", 31.40625), ("zero2_gb", 16.640625),
                        ("zero3_gb", 1.875)):
            self.assertAlmostEqual(table[key], gb, msg=f"{key} for 7.5e9 parameters on N = 64")

    def test_one_rank_shards_nothing(self):
        for stage in M.STAGES:
            self.assertEqual(M.zero_bytes_per_device(stage, 1000, 1), 16000,
                             f"{stage}, 1000 parameters on one rank: 16 bytes each")
        with self.assertRaises(ValueError, msg="an unknown stage must raise ValueError"):
            M.zero_bytes_per_device("zero4", 1, 1)

    def test_each_stage_divides_exactly_its_terms(self):
        psi, n = 1e9, 8  # param_bytes, grad_bytes and k chosen apart so that each term shows
        expected = {"baseline": (2 + 3 + 12) * psi, "zero1": (2 + 3) * psi + 12 * psi / n,
                    "zero2": 2 * psi + (3 + 12) * psi / n, "zero3": (2 + 3 + 12) * psi / n}
        for stage, value in expected.items():
            got = M.zero_bytes_per_device(stage, psi, n, k=12, param_bytes=2, grad_bytes=3)
            self.assertAlmostEqual(got, value, msg=f"{stage}, Psi = 1e9, N = 8, K = 12, 2-byte "
                                                   f"weights, 3-byte gradients")

    def test_what_is_not_divided_never_shrinks(self):
        psi = 70e9
        for stage, floor in (("zero1", 4 * psi), ("zero2", 2 * psi)):
            self.assertGreater(M.zero_bytes_per_device(stage, psi, 1 << 20), floor,
                               f"{stage} at N = 2^20 keeps more than {floor:g} bytes")
        smallest = next(n for n in range(1, 1000) if M.zero_bytes_per_device("zero3", psi, n) <= 80e9)
        self.assertEqual(smallest, math.ceil(16 * psi / 80e9), "smallest N for 70e9 in 80 GB")

    def test_communication(self):
        for stage in ("baseline", "zero1", "zero2"):
            self.assertEqual(M.zero_communication_elements(stage, 10), 20, f"{stage}: 2 Psi")
        self.assertEqual(M.zero_communication_elements("zero3", 10), 30, "zero3: 3 Psi")


@exercise("zero1-step")
class TestShardBounds(unittest.TestCase):
    def test_shards(self):
        self.assertEqual(M.shard_bounds(3, 4, 3), (3, 3), "rank 3 of 4 owns nothing of 3 elements")
        self.assertEqual([M.shard_bounds(10, 4, r) for r in range(4)],
                         [(0, 3), (3, 6), (6, 8), (8, 10)], "10 elements over 4 ranks")
        for numel in range(0, 30):
            for world in range(1, 7):
                bounds = [M.shard_bounds(numel, world, r) for r in range(world)]
                where = f"shard_bounds({numel}, {world}, r) for r = 0..{world - 1}: {bounds}"
                self.assertEqual(bounds[0][0], 0, f"{where}: must start at 0")
                self.assertEqual(sum(b - a for a, b in bounds), numel, f"{where}: must cover {numel}")
                self.assertEqual([a for a, _ in bounds[1:]], [b for _, b in bounds[:-1]],
                                 f"{where}: must tile without gap or overlap")
                sizes = [b - a for a, b in bounds]
                self.assertLessEqual(max(sizes) - min(sizes), 1, f"{where}: sizes differ by > 1")
                self.assertEqual(sizes, sorted(sizes, reverse=True),
                                 f"{where}: the larger shards come first (lesson 01's chunks)")


@exercise("zero1-step")
class TestZero1Step(ExerciseCase):
    exercise_id = "zero1-step"

    def test_1_reduce_scatter_mean_is_my_slice_of_the_group_average(self):
        self.assert_holds("reduce_scatter_mean")

    def test_2_reduce_scatter_gradients_reduces_present_gradients_and_frees_them(self):
        self.assert_holds("reduce_scatter_gradients")

    def test_4_all_gather_parameters_copies_every_owner_s_shard_in_place(self):
        self.assert_holds("all_gather_parameters")

    def test_3_skip_step_is_the_same_verdict_on_every_rank(self):
        self.assert_holds("skip_step")

    def test_5_training_equals_one_process(self):
        self.assert_holds("trajectory", "optimizers", "subgroup_trajectory")

    def test_6_grad_scaler_path_equals_one_process(self):
        self.assert_holds("grad_scaler")

    def test_7_live_bytes_and_bytes_sent_match_the_formulas(self):
        self.assert_holds("memory", "bytes_sent")


@exercise("zero2-hook")
class TestZero2Hook(ExerciseCase):
    exercise_id = "zero2-hook"

    def test_1_the_hook_reduce_scatters_each_gradient_during_backward(self):
        self.assert_holds("during0", "backward0", "sent0")

    def test_2_micro_batches_accumulate_in_the_shard(self):
        self.assert_holds("during1", "backward1", "sent1")

    def test_3_no_full_gradient_survives_backward(self):
        self.assert_holds("freed0", "freed1", "memory")

    def test_4_training_equals_one_process(self):
        self.assert_holds("trajectory", "bytes_sent", "subgroup_trajectory")


@exercise("zero3-hooks")
class TestZero3Hooks(ExerciseCase):
    exercise_id = "zero3-hooks"

    def test_1_the_module_holds_its_shards(self):
        self.assert_holds("module_parameters")

    def test_2_no_gathered_weight_lives_from_forward_to_backward(self):
        self.assert_holds("between_forward_and_backward")

    def test_4_nothing_is_left_after_backward(self):
        self.assert_holds("after_backward", "quirks")

    def test_3_forward_and_shard_gradients_equal_plain_models(self):
        self.assert_holds("forward", "shard_grads")

    def test_5_mixed_precision_gathers_bf16_and_reduces_float32(self):
        self.assert_holds("mixed_precision")

    def test_6_training_equals_one_process(self):
        self.assert_holds("trajectory", "subgroup_trajectory", "tied_and_frozen")

    def test_7_live_bytes_and_three_psi_sent(self):
        self.assert_holds("memory", "bytes_sent")


@exercise("sharded-clip")
class TestShardedClip(ExerciseCase):
    exercise_id = "sharded-clip"

    def test_1_clips_by_the_global_norm_of_the_group(self):
        self.assert_holds("clips", "float32")

    def test_2_small_gradients_are_left_alone(self):
        self.assert_holds("leaves_small_alone")

    def test_3_training_with_clipping_equals_one_process(self):
        self.assert_holds("training")


class TestDocNumbers(unittest.TestCase):
    """Every number the README quotes, from the code."""

    def test_paper_example(self):
        for text in ("120 GB", "31.4 GB", "16.6 GB", "1.9 GB", "120.00, 31.41, 16.64, 1.88"):
            self.assertTrue(text in README, f"README: expected the paper's figure {text!r}, not found")

    def test_exercise_one_70b_in_80_gb(self):
        psi, budget = 70e9, 80e9
        for floor in (4 * psi, 2 * psi):  # ZeRO-1 and ZeRO-2 keep these, never divided by N
            self.assertGreater(floor, budget, "the floor that never shrinks exceeds 80 GB")
            self.assertTrue(f"{floor / 1e9:.0f} GB" in README,
                            f"README: expected {floor / 1e9:.0f} GB (the floor), not found")
        smallest = next(n for n in range(1, 1000) if M.zero_bytes_per_device("zero3", psi, n) <= budget)
        self.assertTrue(f"N_d = {smallest}" in README, f"README: expected N_d = {smallest}, not found")

    def test_readme_model_numbers(self):
        model = C.data_parallel.make_model(0, **C.SIZES)
        numels = [p.numel() for p in model.parameters()]
        psi = sum(numels)
        shard = sum(b - a for a, b in (M.shard_bounds(n, 4, 0) for n in numels))
        dp = M.expected_bytes_sent(1, numels, 8, 4, 0)
        z3 = M.expected_bytes_sent(3, numels, 8, 4, 0)
        self.assertEqual(z3 / dp, 1.5, f"ZeRO-3 / DP bytes at 4 ranks: expected 1.5, got {z3 / dp}")
        quoted = [f"Psi = {psi:,}", f"Psi_r = {shard}", f"{dp:,} for plain DP", f"{z3:,} for ZeRO-3",
                  f"{round(2 * 3 / 4 * psi * 8):,} would be the ideal"]
        quoted += [f"{value:,} B" for stage in (0, 1, 2, 3)
                   for value in C.expected_live_bytes(stage, psi, shard, 8).values()]
        missing = [text for text in quoted if text not in README]
        self.assertEqual(missing, [], "README: the model's numbers (computed here) not found")


class TestHarness(unittest.TestCase):
    def test_expected_live_bytes(self):
        for stage, expected in ((0, {"params": 800, "grads": 800, "optimizer": 1600}),
                                (2, {"params": 800, "grads": 200, "optimizer": 400}),
                                (3, {"params": 200, "grads": 200, "optimizer": 400})):
            self.assertEqual(C.expected_live_bytes(stage, 100, 25, 8), expected, f"stage {stage}")

    def test_distinct_parameters_count_a_tied_weight_once(self):
        a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
        groups = [{"params": [a, b, a]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}]
        named = M.contract.distinct_parameters(groups)
        self.assertEqual([name for name, _ in named], ["0", "1", "2"],
                         "names: torch's state_dict numbering, each parameter once")
        self.assertIs(named[0][1], a, "the first parameter is the first one listed")
        named = M.contract.distinct_parameters([{"params": [a, b], "param_names": ["w", "b"]}])
        self.assertEqual([name for name, _ in named], ["w", "b"], "names from param_names")

    def test_a_state_is_sharded_when_every_rank_holds_its_shard(self):
        sizes = [2, 1, 0]
        sharded = [torch.zeros(n) for n in sizes]
        self.assertTrue(M.contract.is_sharded_state(sharded, sizes), "exp_avg-like shards")
        self.assertFalse(M.contract.is_sharded_state([torch.tensor(3.0)] * 3, sizes),
                         "a 0-d step is per parameter")
        self.assertTrue(M.contract.is_sharded_state([torch.zeros(1)] * 3, [1, 1, 1]),
                        "1-element shards are still shards (1-D), unlike a 0-d step")


class TestAgainstReferences(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.all_checks, world, (1, 2, 24), device="cpu", timeout_s=120)
                       for world in (1, 3)}  # 2 under torchrun below, 4 in the demo's default

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_zero3_sends_one_and_a_half_times_more(self):
        for world in (3,):
            ratio = self.results[world][0]["metrics"]["zero3_over_zero1_bytes"]
            self.assertAlmostEqual(ratio, 1.5, places=2, msg=f"world {world}: ZeRO-3 / ZeRO-1 "
                                                             f"bytes, expected 1.5, got {ratio}")
        self.assertIsNone(self.results[1][0]["metrics"]["zero3_over_zero1_bytes"],
                          "one rank sends nothing: expected no ratio")

    @torchrun_demo(["--quick", "--batch", "8"])
    def test_the_demo_under_torchrun(self, report):
        failed = [c for c in report["checks"] if not c["passed"]]
        self.assertEqual(failed, [], "torchrun, 2 ranks: expected every check to pass")
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"))
        self.assertAlmostEqual(report["metrics"]["zero3_over_zero1_bytes"], 1.5, places=2)


class TestOptimizerContract(unittest.TestCase):
    """The reference's contract on 3 ranks (workers.contract_checks): a problem per check."""

    @classmethod
    def setUpClass(cls):
        cls.results = launch(W.contract_checks, W.WORLD, (), device="cpu", timeout_s=120)

    def assert_holds(self, key: str) -> None:
        for result in self.results:
            if result[key]:
                self.fail(result[key])

    def test_frozen_and_tied_parameters_at_every_stage(self):
        for key in ("tied_zero1", "tied_zero2", "tied_zero3", "tied_zero1_group"):
            self.assert_holds(key)

    def test_a_consolidated_state_dict_loads_on_any_number_of_ranks(self):
        self.assert_holds("resharded_state_dict")

    def test_zero2_refuses_a_grad_scaler_clearly(self):
        self.assert_holds("zero2_refuses_scaler")

    def test_zero3_with_sharded_grad_scaler_equals_one_process(self):
        self.assert_holds("zero3_sharded_grad_scaler")


class TestCommandLine(unittest.TestCase):
    def test_memory_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "m.json"
            with contextlib.redirect_stdout(io.StringIO()):
                code = C.main(["--memory", "--params", "70e9", "--dp", "512", "--json", str(path)])
            data = json.loads(path.read_text())
        self.assertEqual(code, 0, "--memory: expected exit code 0")
        self.assertAlmostEqual(data["metrics"]["zero3_gb"], 16 * 70e9 / 512 / 1e9,
                               msg="--memory --params 70e9 --dp 512: zero3_gb = 16 Psi / N / 1e9")
        missing = {"baseline_gb", "zero1_gb", "zero2_gb", "zero3_gb"} - set(data["metrics"])
        self.assertEqual(missing, set(), "--memory --json: metrics missing")

    def test_bad_arguments_exit_2(self):
        for argv, fragment in [(["--batch", "10", "--world-size", "4"], "not divisible"),
                               (["--memory", "--dp", "0"], "out of range"),
                               (["--memory", "--params", "-5"], "out of range"),
                               (["--device", "cuda", "--world-size", "64"], "needs 64 GPU")]:
            with self.subTest(argv=argv):
                assert_argument_error(self, C.parse_args, argv, fragment)


if __name__ == "__main__":
    unittest.main()
