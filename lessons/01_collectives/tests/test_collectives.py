"""Lesson 01's suite: the formulas, the numbers the README and the quiz quote, then every
collective against torch.distributed on 1, 2, 3 and 5 ranks, torchrun (one node and two on
loopback), and the failure paths the docs promise.

Learner mode: each exercise of main.py and latency_optimal.py (`# exercise ...` markers) has
its own test class, tagged with `exercise(...)`, whose ranks call only that exercise's
function (the all-gather gathers chunks torch reduce-scattered; the all-reduce, a
composition, uses both rings), so a wrong reduce-scatter fails `ring-reduce-scatter` and not
the broadcast. Each class launches
its ranks once per world size with a short deadline: a hung exercise fails in seconds.
Untagged tests (formulas, docs numbers, the demo's checks, torchrun, the CLI) are the lesson's
"integration" criterion."""

from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys
import unittest
from pathlib import Path

import torch

from lessons._checks import compare, sum_order_tolerance
from lessons._launch import launch
from lessons._report import merge_rank_checks
from lessons._testing import LazyWorlds, assert_argument_error, exercise, run_under_torchrun, torchrun_demo

M = importlib.import_module("lessons.01_collectives.main")  # the technique
L = importlib.import_module("lessons.01_collectives.latency_optimal")  # its log2 p algorithms
C = importlib.import_module("lessons.01_collectives.checks")  # the harness
B = importlib.import_module("lessons.01_collectives.bench")  # the benchmark
# Spawned ranks import their function by module name, so the workers live in a module with a
# real dotted name (pytest may give this test file a different one).
W = importlib.import_module("lessons.01_collectives.tests.workers")
LESSON_DIR = Path(M.__file__).resolve().parent
REPO_ROOT = LESSON_DIR.parent.parent
MAIN_PY = LESSON_DIR / "main.py"


# ----------------------------------------------------------------------------- pure functions


class TestChunksAndFormulas(unittest.TestCase):
    def test_chunk_sizes_cover_and_balance(self):
        for numel in range(0, 40):
            for world in range(1, 9):
                sizes = M.chunk_sizes(numel, world)
                self.assertEqual(sum(sizes), numel)
                self.assertLessEqual(max(sizes) - min(sizes), 1)
                bounds = M.chunk_bounds(numel, world)
                self.assertEqual(bounds[0][0], 0)
                self.assertEqual(bounds[-1][1], numel)
                for (_, end), (start, _) in zip(bounds, bounds[1:]):
                    self.assertEqual(end, start)

    def test_ring_schedule_rotates_every_chunk_round_the_ring(self):
        for world in range(1, 8):
            numel = 3 * world + 1
            bounds = [slice(*b) for b in M.chunk_bounds(numel, world)]
            schedules = [M.ring_schedule(numel, world, rank, shift) for shift in (0, 1)
                         for rank in range(world)]
            for shift in (0, 1):
                per_rank = schedules[shift * world:(shift + 1) * world]
                for rank in range(world):
                    self.assertEqual(len(per_rank[rank]), world - 1)
                    for step, (_, recv) in enumerate(per_rank[rank]):
                        # what rank r receives at step s is what rank r-1 sends at step s
                        self.assertEqual(recv, per_rank[(rank - 1) % world][step][0])
                    received = [bounds.index(recv) for _, recv in per_rank[rank]]
                    if shift == 1 and world > 1:  # reduce-scatter: chunk r completes last
                        self.assertEqual(received[-1], rank)
                    if shift == 0:  # all-gather: every chunk but our own arrives once
                        self.assertEqual(sorted(received), sorted(set(range(world)) - {rank}))

    def test_ring_bytes_equal_reference_formula_when_divisible(self):
        for world in (1, 2, 3, 4, 5, 8):
            for numel in (0, world, 7 * world):
                for rank in range(world):
                    exact = M.ring_bytes_sent(numel, 4, world, rank)["all_reduce"]
                    self.assertEqual(exact, M.ring_all_reduce_bytes_formula(numel * 4, world))

    def test_ring_bytes_uneven_and_bounded_by_2s(self):
        # chunk sizes of 10 over 4: [3, 3, 2, 2]; rank 1 skips chunk 1 (3) and chunk 2 (2)
        self.assertEqual(M.ring_bytes_sent(10, 1, 4, 1),
                         {"reduce_scatter": 7, "all_gather": 8, "all_reduce": 15})
        for world in range(1, 70):
            self.assertLess(M.ring_all_reduce_bytes_formula(1000, world), 2000)

    def test_segmented_messages(self):
        # 4096 elements over 4 ranks: chunks of 1024; pieces of 341 -> 4 per chunk, 3 chunks sent
        self.assertEqual(C.segmented_messages(4096, 4, 0, 341), 12)
        self.assertEqual(C.segmented_messages(4096, 4, 0, 1 << 18), 3)  # one piece per chunk
        self.assertEqual(C.segmented_messages(2, 4, 3, 1), 2)  # chunks [1, 1, 0, 0]

    def test_tree_bytes_total_is_p_minus_1_times_s(self):
        for world in range(1, 17):
            for root in range(world):
                total = sum(L.tree_broadcast_bytes_sent(100, world, root, rank)
                            for rank in range(world))
                self.assertEqual(total, (world - 1) * 100)
            rounds = math.ceil(math.log2(world)) if world > 1 else 0
            self.assertEqual(L.tree_broadcast_bytes_sent(100, world, 0, 0), rounds * 100)

    def test_recursive_doubling_bytes(self):
        self.assertEqual(L.recursive_doubling_bytes_sent(10, 8, 3), 30)
        # p = 5: q = 4; rank 0 folds rank 4 in and sends the result back; rank 4 sends once
        self.assertEqual([L.recursive_doubling_bytes_sent(10, 5, r) for r in range(5)],
                         [30, 20, 20, 20, 10])
        self.assertEqual(L.recursive_doubling_bytes_sent(10, 1, 0), 0)

    def test_all_to_all_bytes(self):
        # equal blocks of a 4,000-byte buffer on 4 ranks: every block but our own, 3/4 * S
        self.assertEqual(M.all_to_all_bytes_sent([250] * 4, 4, 2), 3000)
        self.assertEqual(M.all_to_all_bytes_sent([0, 5, 0], 8, 1), 0)  # only to itself
        self.assertEqual(M.all_to_all_bytes_sent([0, 5, 0], 8, 0), 40)
        self.assertEqual(M.all_to_all_bytes_sent([0, 5, 0], 8, 0, counts_exchanged=True), 56)
        self.assertEqual(M.all_to_all_bytes_sent([7], 4, 0, counts_exchanged=True), 0)

    def test_alpha_beta_and_bus_bandwidth(self):
        self.assertAlmostEqual(M.alpha_beta_seconds("ring_all_reduce", 1000, 4, 1.0, 0.0), 6.0)
        self.assertAlmostEqual(M.alpha_beta_seconds("ring_all_reduce", 1000, 4, 0.0, 1.0), 1500.0)
        self.assertAlmostEqual(M.alpha_beta_seconds("recursive_doubling", 10, 8, 1.0, 0.1), 6.0)
        self.assertAlmostEqual(M.alpha_beta_seconds("all_to_all", 1000, 4, 1.0, 1.0), 753.0)
        algbw, busbw = M.bus_bandwidth("all_reduce", 1e9, 0.1, 8)
        self.assertAlmostEqual(algbw, 1e10)
        self.assertAlmostEqual(busbw, 1.75e10)
        self.assertAlmostEqual(M.bus_bandwidth("all_to_all", 1e9, 0.1, 8)[1], 8.75e9)
        with self.assertRaises(ValueError):
            M.alpha_beta_seconds("gossip", 1, 2, 1, 1)

    def test_fit_alpha_beta_recovers_the_model(self):
        alpha, beta, world = 2e-5, 1e-9, 4
        rows = [{"bytes": size, "ring_s": M.alpha_beta_seconds("ring_all_reduce", size, world,
                                                               alpha, beta)}
                for size in (4096, 65536, 1 << 20, 1 << 24)]
        fitted_alpha, fitted_beta = B.fit_alpha_beta(rows, world)
        self.assertAlmostEqual(fitted_alpha / alpha, 1.0, places=6)
        self.assertAlmostEqual(fitted_beta / beta, 1.0, places=6)
        self.assertLess(max(abs(r) for r in B.fit_residuals(rows, world, alpha, beta)), 1e-9)

    def test_fit_weights_small_sizes_and_keeps_parameters_non_negative(self):
        # 20% noise on the largest size: unweighted least squares would let it decide alpha
        alpha, beta, world = 1e-4, 1e-9, 4
        sizes = (4096, 16384, 65536, 1 << 20, 1 << 24)
        rows = [{"bytes": s, "ring_s": M.alpha_beta_seconds("ring_all_reduce", s, world, alpha,
                                                            beta) * (1.2 if s == 1 << 24 else 1)}
                for s in sizes]
        fitted_alpha, fitted_beta = B.fit_alpha_beta(rows, world)
        self.assertAlmostEqual(fitted_alpha / alpha, 1.0, delta=0.05)
        # pure bandwidth data plus noise that would make alpha negative: clamped to 0
        rows = [{"bytes": s, "ring_s": 1.5 * s * 1e-9 * (0.9 if s == 4096 else 1)} for s in sizes]
        fitted_alpha, fitted_beta = B.fit_alpha_beta(rows, world)
        self.assertGreaterEqual(fitted_alpha, 0.0)
        self.assertGreater(fitted_beta, 0.0)

    def test_ring_order_sum_is_the_ring_order(self):
        inputs = [torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32) for _ in range(3)]
        inputs[1] = torch.tensor([1.0, 1e8, 1.0], dtype=torch.float32)
        out = C.ring_order_sum(inputs)
        # chunk 0 lives on rank 0: x0 + (x2 + x1); float32 loses the 1.0 next to 2e8
        expected0 = inputs[0][0] + (inputs[2][0] + inputs[1][0])
        self.assertEqual(out[0].item(), expected0.item())

    def test_compare_catches_one_ulp_and_respects_the_bound(self):
        a = torch.tensor([1.0, 2.0])
        b = torch.nextafter(a, torch.tensor(3.0))
        self.assertEqual(compare(a, b, None), (False, "2 elements differ"), "each one ulp apart, exact")
        self.assertEqual(compare(a, a.clone(), None), (True, "exact"), "equal tensors, exact")
        bound = sum_order_tolerance(torch.tensor([1.0, 2.0], dtype=torch.float64), 3,
                                    torch.float32)
        self.assertTrue(compare(a, a + bound.float() * 0.5, bound)[0],
                        f"expected half the bound {bound.tolist()} to pass, got a failure")
        self.assertFalse(compare(a, a + bound.float() * 4, bound)[0],
                         f"expected 4x the bound {bound.tolist()} to fail, got a pass")

    def test_uneven_counts_pattern(self):
        for world in (1, 2, 3, 5):
            self.assertEqual(C.uneven_counts(0, world, 0), [0] * world)  # numel 0: nothing sent
            counts = [C.uneven_counts(rank, world, 1000) for rank in range(world)]
            if world > 1:
                self.assertIn(0, [c for row in counts for c in row])  # some blocks are empty
                self.assertGreater(len({c for row in counts for c in row}), 2)  # and uneven


class TestDocNumbers(unittest.TestCase):
    """Numbers the README and the quiz quote, recomputed from the technique (integers: the
    same on every machine)."""

    def test_readme_worked_numbers_come_from_the_code(self):
        readme = (LESSON_DIR / "README.md").read_text()
        numbers = {
            "6,000": M.ring_all_reduce_bytes_formula(4000, 4),
            "8,000": L.recursive_doubling_bytes_sent(4000, 4, 0),
            "24,000": L.recursive_doubling_bytes_sent(4000, 64, 0),
            "7,875": M.ring_all_reduce_bytes_formula(4000, 64),
            "24,576": M.ring_bytes_sent(4096, 4, 4, 0)["all_reduce"],
            "6400 B": M.ring_bytes_sent(1000, 4, 5, 0)["all_reduce"],
            "16,000": sum(L.tree_broadcast_bytes_sent(4000, 5, 4, r) for r in range(5)),
            "3,000": M.all_to_all_bytes_sent([250] * 4, 4, 0),
            "36,864": M.all_to_all_bytes_sent([1024] * 4, 12, 0),
            "126 alpha": M.alpha_beta_seconds("ring_all_reduce", 0, 64, 1.0, 0.0),
            "6 alpha": M.alpha_beta_seconds("recursive_doubling", 0, 64, 1.0, 0.0),
        }
        for text, value in numbers.items():
            self.assertIn(text, readme)
            self.assertEqual(float(re.sub(r"[^\d.]", "", text.split()[0])), float(value), text)

    def test_readme_test_description_numbers(self):
        """The hand-worked inputs' digits, the subgroups the tests run on, the planted bugs."""
        readme = (LESSON_DIR / "README.md").read_text()
        group02 = (W.hand_input(0, 2) + W.hand_input(2, 2)).tolist()
        self.assertIn(f"reads {group02[0]}, {group02[1]}, ...", readme)
        self.assertIn(f"plants {len(json.loads((LESSON_DIR / 'bugs.json').read_text()))} mistakes", readme)
        self.assertEqual(W.CONFIGS[3][1], [[0, 2]], "README: over ranks {0, 2} (rank 1 idle)")
        self.assertEqual(W.CONFIGS[5][1:], [[[0, 2, 4], [1, 3]], [[1, 2, 3, 4]], [[r] for r in range(5)]],
                         "README: {0, 2, 4} and {1, 3} at once, then {1, 2, 3, 4}, then each rank alone")
        sizes = {len(g) for configs in W.CONFIGS.values() for config in configs if config
                 for g in config} | set(W.CONFIGS)
        self.assertEqual(sizes, {1, 2, 3, 4, 5}, "README: every exercise runs with p = 1 to 5")

    def test_quiz_numeric_answers_come_from_the_code(self):
        quiz = json.loads((LESSON_DIR / "quiz.json").read_text())
        numeric = [q for q in quiz["questions"] if q["type"] == "numeric"]
        self.assertGreaterEqual(len(numeric), 2)
        for question in numeric:
            spec = question["check"]
            module = M if hasattr(M, spec["function"]) else L  # main.py first, as the course does
            value = getattr(module, spec["function"])(**spec["kwargs"])
            if "index" in spec:
                value = value[spec["index"]]
            value *= spec.get("scale", 1)
            with self.subTest(question=question["id"]):
                self.assertLessEqual(abs(value - question["answer"]), question["tolerance"])


# ----------------------------------------------------------------------------- the exercises

EXERCISE_TIMEOUT_S = 30  # the work takes about a second: a hang or deadlock fails fast


def launch_exercise(worker, world: int, args: tuple = ()) -> list:
    """One launch of `worker` on `world` ranks over every group configuration of
    W.CONFIGS[world] (a failure or hang names the configuration each rank was running: the
    workers announce it with lessons._launch.phase)."""
    return launch(worker, world, (W.CONFIGS[world], *args), device="cpu", timeout_s=EXERCISE_TIMEOUT_S)


class _ExerciseCase(unittest.TestCase):
    """Launches `worker` once per world size of W.CONFIGS (3 and 5 ranks), each launch running
    every group configuration of that size, when a test of the class first reads that world (a
    failed launch fails the class's tests, it is not relaunched per test: LazyWorlds; a planted
    bug caught on 3 ranks costs no 5-rank launch), and checks named results: each worker
    returns, per rank, a list of cases {"case": ..., "where": ..., check: [passed, detail], ...}."""

    worker = None
    args: tuple = ()

    @classmethod
    def setUpClass(cls):
        cls.results = LazyWorlds(W.CONFIGS, lambda world: launch_exercise(cls.worker, world, cls.args))

    def assert_check(self, check: str):
        seen = 0
        for world, per_rank in self.results.items():
            for rank, cases in enumerate(per_rank):
                for case in cases:
                    if check in case:
                        seen += 1
                        passed, detail = case[check]
                        if not passed:
                            self.fail(f"{check}, {world} ranks, {case['where']}, global rank "
                                      f"{rank}, {case['case']}: {detail}")
        self.assertGreater(seen, 0, f"expected cases checking {check!r}, found none")

    def hand_values(self) -> dict:
        """{(world, where, global rank, case): values} of the hand-worked cases."""
        return {(world, case["where"], rank, case["case"]): case["values"]
                for world, per_rank in self.results.items() for rank, cases in enumerate(per_rank)
                for case in cases if "values" in case}

    def assert_hand(self, expected: dict) -> None:
        """Each hand-worked result equals the value worked out by hand in the test."""
        got = self.hand_values()
        for key, value in expected.items():
            with self.subTest(key=key):
                self.assertIn(key, got, f"expected a hand-worked result for {key}, found none")
                self.assertEqual(got[key], value, f"{key[3]} on {key[0]} ranks, {key[1]}, global "
                                                  f"rank {key[2]}: expected {value}, got {got[key]}")


WORLD3, GROUP02 = "group=None (all 3 ranks)", "group=ranks [0, 2] of 3"
GROUP13 = "group=ranks [1, 3] of 5"


@exercise("ring-reduce-scatter")
class TestRingReduceScatter(_ExerciseCase):
    worker = W.reduce_scatter_worker
    args = (W.RING_CASES,)

    def test_equals_torch_reduce_scatter(self):
        self.assert_check("torch")

    def test_adds_in_the_ring_order_bit_for_bit(self):
        self.assert_check("ring_order")

    def test_bytes_sent_are_every_chunk_but_its_own(self):
        self.assert_check("bytes")

    def test_input_is_unchanged(self):
        self.assert_check("input_unchanged")

    def test_hand_worked_sums_on_the_world_and_on_subgroups(self):
        """Rank r holds [1, 2, ..., n] * 10**r. 3 ranks: the sum [111, 222, 333, 444, 555] in
        chunks of 2, 2, 1; ranks {0, 2}: [101, ..., 505] in chunks of 3 and 2 (rank 2 is the
        group's rank 1); n = 2 on 3 ranks leaves rank 2 an empty chunk."""
        self.assert_hand({
            (3, WORLD3, 0, "hand 5"): [111, 222], (3, WORLD3, 1, "hand 5"): [333, 444],
            (3, WORLD3, 2, "hand 5"): [555],
            (3, GROUP02, 0, "hand 5"): [101, 202, 303], (3, GROUP02, 2, "hand 5"): [404, 505],
            (3, WORLD3, 0, "hand 2"): [111], (3, WORLD3, 1, "hand 2"): [222],
            (3, WORLD3, 2, "hand 2"): [],
            (5, GROUP13, 1, "hand 5"): [1010, 2020, 3030], (5, GROUP13, 3, "hand 5"): [4040, 5050],
        })


@exercise("ring-all-gather")
class TestRingAllGather(_ExerciseCase):
    worker = W.all_gather_worker
    args = (W.RING_CASES,)

    def test_equals_torch_all_gather_exactly(self):
        self.assert_check("torch")

    def test_bytes_sent_are_every_chunk_but_the_next_ranks(self):
        self.assert_check("bytes")

    def test_chunk_is_unchanged(self):
        self.assert_check("input_unchanged")

    def test_wrong_chunk_size_is_a_value_error_naming_the_rank(self):
        self.assert_check("value_error_naming_the_rank")

    def test_hand_worked_gathers_on_the_world_and_on_subgroups(self):
        """Group rank g holds chunk g of [1, ..., n], plus 10 x its global rank: 3 ranks, n = 5
        (chunks 2, 2, 1) gather [1, 2, 13, 14, 25]; ranks {0, 2} (chunks 3, 2) gather
        [1, 2, 3, 24, 25]; n = 2 on 3 ranks (rank 2's chunk empty): [1, 12]."""
        expected = {}
        for rank in range(3):
            expected[(3, WORLD3, rank, "hand 5")] = [1, 2, 13, 14, 25]
            expected[(3, WORLD3, rank, "hand 2")] = [1, 12]
        for rank in (0, 2):
            expected[(3, GROUP02, rank, "hand 5")] = [1, 2, 3, 24, 25]
        self.assert_hand(expected)


@exercise("ring-all-reduce")
class TestRingAllReduce(_ExerciseCase):
    worker = W.all_reduce_worker
    args = (W.RING_CASES,)

    def test_equals_torch_all_reduce(self):
        self.assert_check("torch")

    def test_sums_in_the_ring_order_bit_for_bit(self):
        self.assert_check("ring_order")

    def test_every_rank_holds_the_same_bits(self):
        self.assert_check("same_bits_on_every_rank")

    def test_bytes_sent_are_both_rings(self):
        self.assert_check("bytes")

    def test_input_is_unchanged(self):
        self.assert_check("input_unchanged")

    def test_hand_worked_sums_keep_the_shape(self):
        """[1..6] * 10**r as a 3 x 2 matrix: every rank of 3 gets [[111, 222], [333, 444],
        [555, 666]]; ranks {0, 2} get [[101, 202], [303, 404], [505, 606]]."""
        expected = {(3, WORLD3, r, "hand (3, 2)"): [[111, 222], [333, 444], [555, 666]]
                    for r in range(3)}
        expected.update({(3, GROUP02, r, "hand (3, 2)"): [[101, 202], [303, 404], [505, 606]]
                         for r in (0, 2)})
        self.assert_hand(expected)


@exercise("tree-broadcast")
class TestTreeBroadcast(_ExerciseCase):
    worker = W.broadcast_worker

    def test_equals_torch_broadcast_from_every_root(self):
        self.assert_check("torch")

    def test_returns_ceil_log2_p_rounds(self):
        self.assert_check("rounds")

    def test_bytes_sent_equal_the_formula(self):
        self.assert_check("bytes")

    def test_hand_worked_root_is_a_rank_of_the_group(self):
        """Root = the group's last rank, in place: on 3 ranks global rank 2's [100, 200, 300];
        on ranks {0, 2} the group's rank 1 is global rank 2 as well; on ranks {1, 3} of 5,
        global rank 3's [1000, 2000, 3000]."""
        expected = {(3, WORLD3, r, "hand, root = last rank of the group"): [100, 200, 300]
                    for r in range(3)}
        expected.update({(3, GROUP02, r, "hand, root = last rank of the group"): [100, 200, 300]
                         for r in (0, 2)})
        expected.update({(5, GROUP13, r, "hand, root = last rank of the group"): [1000, 2000, 3000]
                         for r in (1, 3)})
        self.assert_hand(expected)


@exercise("all-to-all")
class TestAllToAll(_ExerciseCase):
    """Equal blocks with trailing dims (Ulysses), uneven blocks with zeros and unknown counts
    (MoE dispatch), all empty, all to one rank, bad counts: against all_to_all_single,
    exactly, with bytes equal to the formula."""

    worker = W.all_to_all_worker

    def test_equals_torch_all_to_all_single(self):
        self.assert_check("torch")

    def test_bytes_sent_equal_the_formula(self):
        self.assert_check("bytes")

    def test_send_is_unchanged(self):
        self.assert_check("input_unchanged")

    def test_bad_counts_are_a_value_error_naming_the_rank(self):
        self.assert_check("value_error_naming_the_rank")

    def test_hand_worked_dispatch(self):
        """Rank r sends (r + j) % 3 rows to group rank j, row k of that block holding
        100 x global rank + 10 j + k. On 3 ranks the counts are [0, 1, 2], [1, 2, 0] and
        [2, 0, 1]: rank 0 receives [100] from rank 1 and [200, 201] from rank 2; rank 1 gets
        [10], then [110, 111] from itself; rank 2 gets [20, 21] and [220]. On ranks {0, 2} the
        counts are [0, 1] and [1, 2]: global rank 0 gets [200]; global rank 2 gets [10] from
        rank 0 and [210, 211] from itself."""
        self.assert_hand({
            (3, WORLD3, 0, "hand"): [100, 200, 201], (3, WORLD3, 1, "hand"): [10, 110, 111],
            (3, WORLD3, 2, "hand"): [20, 21, 220],
            (3, GROUP02, 0, "hand"): [200], (3, GROUP02, 2, "hand"): [10, 210, 211],
        })


# ----------------------------------------------------------------------------- the demo's checks


class TestAgainstTorch(unittest.TestCase):
    """Every check of the demo (`verify_collectives`: all of main.py together) on 1, 2, 3 and
    5 ranks, one launch per world size."""

    @classmethod
    def setUpClass(cls):
        cls.results = {}
        for world in (1, 2, 3, 5):
            cases = [(0, "int64"), (world + 1, "int64"), (1001, "float64"), (64, "float16")]
            cls.results[world] = launch(W.suite_worker, world, (cases,), device="cpu",
                                        timeout_s=120)

    def test_every_check_passes_on_every_rank(self):
        for world, per_rank in self.results.items():
            for index, case in enumerate(per_rank[0]["cases"]):
                merged = merge_rank_checks([rank_result["cases"][index]["checks"]
                                            for rank_result in per_rank])
                for check in merged:
                    with self.subTest(world=world, case=case["case"], check=check.name):
                        self.assertTrue(check.passed, f"{world} ranks, {case['case']}, "
                                                      f"{check.name}: {check.detail}")

    def test_checks_are_all_there(self):
        names = [c["name"] for c in self.results[3][0]["cases"][0]["checks"]]
        self.assertEqual(len(names), 15, f"the checks of verify_collectives: {names}")
        self.assertEqual(sum("== formula" in name for name in names), 5, names)
        self.assertEqual(sum("all-to-all" in name for name in names), 4, names)


class TestTorchrun(unittest.TestCase):
    """The demo joins a torchrun group instead of spawning: one node with two processes, and
    two nodes of one process each meeting on loopback (c10d rendezvous)."""

    @torchrun_demo(["--numel", "50", "--quick"])
    def test_one_node_two_processes(self, report):
        self.assertTrue(report["passed"], [c for c in report["checks"] if not c["passed"]])
        self.assertEqual(report["world_size"], 2)
        self.assertEqual(report["metrics"]["bytes_sent_per_rank"], [200, 200])
        self.assertIn("subgroups [[0], [1]]", " ".join(c["name"] for c in report["checks"]),
                      "the demo checks every collective on subgroups too")

    def test_two_nodes_on_loopback(self):
        report = run_under_torchrun(MAIN_PY, ["--numel", "51", "--dtype", "int64", "--quick"],
                                    nproc_per_node=1, nnodes=2)
        self.assertTrue(report["passed"], [c for c in report["checks"] if not c["passed"]])
        self.assertEqual(report["world_size"], 2)
        self.assertEqual(report["metrics"]["bytes_sent_per_rank"],
                         [M.ring_bytes_sent(51, 8, 2, r)["all_reduce"] for r in range(2)])


# ----------------------------------------------------------------------------- the CLI


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments_exit_2_with_one_error_line(self):
        for argv, fragment in [
            (["--world-size", "0"], "out of range"),
            (["--world-size", "two"], "not an integer"),
            (["--numel", "-1"], "out of range"),
            (["--dtype", "complex64"], "invalid choice"),
            (["--device", "tpu"], "invalid choice"),
            (["--fault", "crash", "--fault-rank", "4", "--world-size", "2"], "not a rank"),
            (["--timeout", "nan"], "not a finite number"),
            (["--bench", "--world-size", "1"], "at least 2 ranks"),
        ]:
            with self.subTest(argv=argv):
                assert_argument_error(self, C.parse_args, argv, fragment)

    @unittest.skipIf(torch.cuda.device_count() >= 64, "needs fewer GPUs than --world-size")
    def test_cuda_without_gpus_is_an_argument_error(self):
        assert_argument_error(self, C.parse_args, ["--device", "cuda", "--world-size", "64"], "GPU")

    def test_script_bad_argument_has_no_traceback(self):
        proc = subprocess.run([sys.executable, str(MAIN_PY), "--numel", "x"],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        self.assertEqual(proc.returncode, 2)
        self.assertNotIn("Traceback", proc.stderr)
        self.assertEqual(len(proc.stderr.strip().splitlines()[-1:]), 1)

    def test_crashing_rank_gives_one_clear_line(self):
        proc = subprocess.run([sys.executable, str(MAIN_PY), "--world-size", "3",
                               "--numel", "10", "--fault", "crash", "--fault-rank", "2",
                               "--timeout", "30", "--device", "cpu"],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        self.assertEqual(proc.returncode, 1)
        self.assertRegex(proc.stderr, r"error: rank 2 failed: RuntimeError: injected crash")
        self.assertNotIn("Traceback", proc.stderr)


if __name__ == "__main__":
    unittest.main()
