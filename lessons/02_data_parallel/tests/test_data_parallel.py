"""Lesson 02's suite: bucket assignment and the cost model, the numbers the docs quote, every DDP
variant against the single-process run and torch DDP on 1, 2 and 3 ranks, each exercise on 3
ranks (averages, the reducer's events on given buckets, what forward and no_sync decide), the
benchmark's plumbing, the CLI and a run under torchrun.

Tests tagged `@exercise(ID)` grade that exercise of main.py (python -m course grade 02); the
untagged ones grade "integration": the demo end to end, the docs' numbers, the CLI."""

from __future__ import annotations

import importlib
import json
import random
import re
import unittest
from pathlib import Path

import torch
import torch.distributed as dist

from lessons._checks import max_abs_diff as _max_abs_diff
from lessons._launch import launch
from lessons._testing import (
    assert_argument_error,
    assert_every_check_passes,
    exercise,
    run_under_torchrun,
)

data_parallel = importlib.import_module("lessons.02_data_parallel.main")
cost_model = importlib.import_module("lessons.02_data_parallel.cost_model")
checks = importlib.import_module("lessons.02_data_parallel.checks")
W = importlib.import_module("lessons.02_data_parallel.tests.workers")
LESSON_DIR = Path(data_parallel.__file__).resolve().parent
README = (LESSON_DIR / "README.md").read_text()
MiB = 2**20


def max_abs_diff(a, b) -> float:
    """max |a - b| in float64, lists of Python floats included (never rounded to float32)."""
    return _max_abs_diff(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))


def bench_model_sizes() -> list[int]:
    """Gradient sizes in bytes of the benchmark model (float32, three 1024-wide layers)."""
    return [1024 * 1024 * 4, 1024 * 4] * 3


@exercise("bucket-assignment")
class TestBuckets(unittest.TestCase):
    def test_reverse_order_and_cap(self):
        self.assertEqual(data_parallel.assign_buckets_by_size([8, 8, 8], 16), [[2, 1], [0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([100, 1, 1], 10), [[2, 1, 0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([5, 5, 5, 5], 1), [[3], [2], [1], [0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([4, 4, 4], 8), [[2, 1], [0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([], 10), [])

    def test_first_bucket_has_its_own_cap(self):
        self.assertEqual(data_parallel.assign_buckets_by_size([8, 8, 8, 8], 100, first_cap_bytes=8),
                         [[3], [2, 1, 0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([8, 8, 8, 8, 8], 16, first_cap_bytes=8),
                         [[4], [3, 2], [1, 0]])
        self.assertEqual(data_parallel.assign_buckets_by_size(bench_model_sizes(), 25 * MiB, MiB),
                         [[5, 4], [3, 2, 1, 0]])

    def test_every_parameter_once_and_every_bucket_closed_at_the_cap(self):
        rng = random.Random(0)
        for trial in range(200):
            sizes = [rng.choice([1, 3, 70, 400, 5000]) for _ in range(rng.randint(0, 12))]
            cap = rng.choice([1, 10, 50, 100, 1000, 10**6])
            buckets = data_parallel.assign_buckets_by_size(sizes, cap)
            with self.subTest(trial=trial, sizes=sizes, cap=cap):
                self.assertEqual(sorted(i for b in buckets for i in b), list(range(len(sizes))))
                self.assertEqual([i for b in buckets for i in b], list(reversed(range(len(sizes)))),
                                 "buckets follow the gradient order: last parameter first")
                for bucket in buckets[:-1]:  # every closed bucket reached the cap, not before
                    self.assertGreaterEqual(sum(sizes[i] for i in bucket), cap)
                for bucket in buckets:  # ...and closed with the parameter that reached it
                    self.assertLess(sum(sizes[i] for i in bucket[:-1]), cap)
                self.assertLessEqual(cost_model.count_buckets(sizes, cap),
                                     cost_model.bucket_count_bound(sum(sizes), cap, len(sizes)))

    def test_same_as_torch_reducer(self):
        """torch's own rule (the C++ reducer's compute_bucket_assignment_by_size, called the way
        DDP calls it when it rebuilds buckets in gradient order), on random float32 sizes."""
        rng = random.Random(3)
        for trial in range(300):
            numels = [rng.choice([1, 3, 70, 400, 5000]) for _ in range(rng.randint(1, 12))]
            cap = rng.choice([4, 40, 200, 400, 4000, 4 * 10**6])
            first = rng.choice([None, 4, 100, 4000])
            tensors = [torch.empty(n) for n in numels]
            limits = [cap] if first is None else [first, cap]
            reverse = list(reversed(range(len(numels))))
            theirs, _ = dist._compute_bucket_assignment_by_size(
                [tensors[i] for i in reverse], limits, [False] * len(numels), reverse)
            with self.subTest(trial=trial, bytes=[4 * n for n in numels], cap=cap, first=first):
                self.assertEqual(data_parallel.assign_buckets_by_size([4 * n for n in numels], cap,
                                                                      first), theirs)

    def test_assign_buckets_weighs_bytes(self):
        model = data_parallel.make_model(0)  # float64: 4096, 256, 8192, 256, 1024, 32 bytes
        self.assertEqual(data_parallel.assign_buckets(list(model.parameters()), 1024),
                         [[5, 4], [3, 2], [1, 0]])
        single = data_parallel.make_model(0, torch.float32)  # half the bytes
        self.assertEqual(data_parallel.assign_buckets(list(single.parameters()), 1024),
                         [[5, 4, 3, 2], [1, 0]])
        self.assertEqual(data_parallel.assign_buckets(list(model.parameters()), 10**6, 1024),
                         [[5, 4], [3, 2, 1, 0]])


class TestLocalShards(unittest.TestCase):
    def test_local_shards_tile_the_batch(self):
        x = torch.arange(12.0).reshape(12, 1)
        self.assertTrue(torch.equal(torch.cat([data_parallel.local_shard(x, r, 3) for r in range(3)]), x))
        with self.assertRaisesRegex(ValueError, "not divisible"):
            data_parallel.local_shard(x, 0, 5)


class TestCostModel(unittest.TestCase):
    def test_bytes_formula(self):
        self.assertEqual(cost_model.ddp_bytes_per_rank(1000, 4, 4), 6000)
        self.assertEqual(cost_model.ddp_bytes_per_rank(1000, 4, 1), 0)

    def test_fifo_end_is_the_max_over_suffixes(self):
        rng = random.Random(1)
        for _ in range(200):
            n = rng.randint(1, 6)
            ready = sorted(rng.uniform(0, 10) for _ in range(n))
            alone = [rng.uniform(0, 5) for _ in range(n)]
            closed_form = max(ready[i] + sum(alone[i:]) for i in range(n))
            self.assertAlmostEqual(cost_model.all_reduces_end(ready, alone), closed_form)

    def test_overlap_never_loses_and_keeps_the_last_bucket_exposed(self):
        rng = random.Random(2)
        for _ in range(200):
            n = rng.randint(1, 6)
            t_fwd, t_bwd, t_opt = (rng.uniform(0.1, 10) for _ in range(3))
            ready = sorted(rng.uniform(0, t_bwd) for _ in range(n - 1)) + [t_bwd]
            alone = [rng.uniform(0, 5) for _ in range(n)]
            overlapped = cost_model.step_time_overlapped(t_fwd, t_bwd, ready, alone, t_opt)
            after = cost_model.step_time_after_backward(t_fwd, t_bwd, sum(alone), t_opt)
            self.assertLessEqual(overlapped, after + 1e-12)
            bound = t_fwd + max(t_bwd + alone[-1], ready[0] + sum(alone)) + t_opt
            self.assertGreaterEqual(overlapped, bound - 1e-12)

    def test_one_bucket_at_the_end_is_no_overlap(self):
        self.assertAlmostEqual(cost_model.step_time_overlapped(10, 30, [30], [45], 5),
                               cost_model.step_time_after_backward(10, 30, 45, 5))


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed from the code."""

    def test_bytes_and_buckets_worked_example(self):
        params = 3 * (1024 * 1024 + 1024)
        sizes = bench_model_sizes()
        self.assertEqual(sum(sizes), params * 4)
        self.assertIn(f"Psi = {params:,} float32", README)
        self.assertIn(f"{params * 4 / 1e6:.1f} MB of gradient", README)
        self.assertIn(f"{cost_model.ddp_bytes_per_rank(params, 4, 4) / 1e6:.1f} MB per step", README)
        bound = -(-sum(sizes) // MiB)
        self.assertEqual(bound, 13)
        self.assertIn(f"ceil(Psi x b / cap) = {bound} is only", README)
        self.assertEqual(cost_model.count_buckets(sizes, MiB), 3)
        self.assertIn("exactly 3 buckets per step", README)
        self.assertEqual(cost_model.bucket_count_bound(sum(sizes), MiB, len(sizes)), 6)

    def test_time_worked_example(self):
        ready, alone = [10, 20, 30], [15, 15, 15]
        self.assertEqual(cost_model.step_time_after_backward(10, 30, 45, 5), 90)
        self.assertEqual(cost_model.all_reduces_end(ready, alone), 55)
        self.assertEqual(cost_model.step_time_overlapped(10, 30, ready, alone, 5), 70)
        self.assertIn("10 + 30 + 45 + 5 = 90 ms", README)
        self.assertIn("max(10 + 45, 20 + 30, 30 + 15) = 55 ms", README)
        self.assertIn("T = 10 + max(30, 55) + 5 = 70 ms: 25 ms", README)

    def test_bucket_order_examples(self):
        self.assertEqual(data_parallel.assign_buckets_by_size([8, 8, 8], 16), [[2, 1], [0]])
        self.assertIn("`assign_buckets_by_size([8, 8, 8], 16)` is `[[2, 1], [0]]`", README)
        self.assertEqual(len(data_parallel.assign_buckets(list(data_parallel.make_model(0).parameters()),
                                                          1024)), 3)
        self.assertIn("1,024-byte cap gives 3 buckets", README)

    def test_quiz_numeric_answers(self):
        quiz = json.loads((LESSON_DIR / "quiz.json").read_text())
        numeric = [q for q in quiz["questions"] if q["type"] == "numeric"]
        self.assertGreaterEqual(len(numeric), 2)
        for question in numeric:
            spec = question["check"]
            module = data_parallel if hasattr(data_parallel, spec["function"]) else cost_model
            value = getattr(module, spec["function"])(**spec["kwargs"]) * spec.get("scale", 1)
            with self.subTest(question=question["id"]):
                self.assertLessEqual(abs(value - question["answer"]), question["tolerance"] + 1e-9)

    def test_measured_figures_are_labelled(self):
        measured = README.split("**Measured here.**", 1)[1].split("##", 1)[0]
        self.assertRegex(measured, r"--bench")
        self.assertTrue(re.search(r"\d+ ranks?", measured), measured)


class TestAgainstReferences(unittest.TestCase):
    """Every check of the demo, on 1, 2 and 3 ranks (one launch each; 4 is the demo's default),
    and on 2 ranks the benchmark's plumbing."""

    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.all_checks, world, (3, 2, 12, world == 2), device="cpu",
                                     timeout_s=90)
                       for world in (1, 2, 3)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_bucket_count_reported(self):
        self.assertEqual(self.results[2][0]["metrics"]["buckets"], 3)

    def test_bench_runs_and_its_timelines_are_ordered(self):
        """The benchmark's plumbing (no timing value is asserted)."""
        result = self.results[2][0]["bench"]
        variants = [row["variant"] for row in result["rows"]]
        self.assertEqual(variants[:2], ["local (no communication)", "flat, after backward"])
        self.assertEqual([row["buckets"] for row in result["rows"]], [0, 1, 3, 1, 3])
        for name, line in result["timelines"].items():
            with self.subTest(variant=name):
                self.assertEqual(line["launch_s"], sorted(line["launch_s"]))
                self.assertLessEqual(line["launch_s"][-1], line["backward_end_s"])
                self.assertTrue(all(done >= line["backward_end_s"] for done in line["reduced_s"]))
                self.assertEqual(sum(line["bucket_bytes"]), result["params"] * 4)


class TestOnRanks(unittest.TestCase):
    """One launch on 3 ranks: each exercise's section (workers.exercise_checks; a section that
    raised comes back as its error, and fails that exercise's tests alone)."""

    world = 3
    seed = 5

    @classmethod
    def setUpClass(cls):
        cls.results = launch(W.exercise_checks, cls.world, (cls.seed,), device="cpu", timeout_s=90)

    def section(self, name: str) -> list[dict]:
        """The section's result on every rank; the test fails with its error if it raised."""
        for rank, result in enumerate(self.results):
            if "error" in result[name]:
                self.fail(f"rank {rank}: {result[name]['error']}")
        return [result[name] for result in self.results]

    def assert_average(self, got, reference, local=None, what: str = "") -> None:
        """`got` is the average `reference` (float64, within checks.TOLERANCE); else say which
        usual mistake it looks like."""
        got, reference = torch.tensor(got, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
        self.assertEqual(got.shape, reference.shape, f"{what}: gradient sizes differ")
        gap = max_abs_diff(got, reference)
        if gap <= checks.TOLERANCE:
            return
        if max_abs_diff(got, reference * self.world) <= checks.TOLERANCE:
            self.fail(f"{what}: the SUM over ranks, p = {self.world} times the average (divide by "
                      f"the world size)")
        if local is not None and max_abs_diff(got, local) <= checks.TOLERANCE:
            self.fail(f"{what}: still this rank's local gradient (nothing reduced into .grad)")
        self.fail(f"{what}: max |grad - average| = {gap:.2e} > {checks.TOLERANCE:g}")

    # ------------------------------------------------------------------ average-gradients

    @exercise("average-gradients")
    def test_naive_all_reduce_averages_every_gradient(self):
        reference = W.reference_gradient(self.seed, self.seed, self.world, unused=True)
        for rank, result in enumerate(self.section("average")):
            self.assert_average(result["naive"]["grads"], reference, what=f"naive, rank {rank}")
            self.assertEqual(result["naive"]["count"], 6, "one all-reduce per parameter WITH a gradient")
            self.assertTrue(result["naive"]["spare_has_no_grad"], "a parameter without gradient is skipped")

    @exercise("average-gradients")
    def test_flat_all_reduce_averages_and_copies_back(self):
        reference = W.reference_gradient(self.seed, self.seed, self.world, unused=True)
        for rank, result in enumerate(self.section("average")):
            self.assert_average(result["flat"]["grads"], reference, what=f"flat, rank {rank}")
            self.assertEqual(result["flat"]["count"], 1, "one all-reduce in all")
            self.assertTrue(result["flat"]["spare_has_no_grad"], "a parameter without gradient is skipped")

    def test_missing_broadcast_leaves_ranks_different(self):
        results = self.section("average")
        self.assertGreater(max_abs_diff(results[0]["no_broadcast"], results[1]["no_broadcast"]), 1e-3)

    # ------------------------------------------------------------------ bucketed-reducer

    def expected_events(self, grad_order: list[int], launch_after: dict[int, list[int]]) -> list[tuple]:
        events = []
        for index in grad_order:
            events.append(("grad", index))
            events += [("launch", bucket) for bucket in launch_after.get(index, [])]
        return events + [("backward_end", -1), ("reduced", 0), ("reduced", 1), ("reduced", 2)]

    @exercise("bucketed-reducer")
    def test_buckets_launch_during_backward_as_they_fill(self):
        """Buckets [[5, 4], [3, 2], [1, 0]], gradients 5, 4, ..., 0: bucket 0 starts right after
        gradient 4, while backward still runs (the overlap), and so on."""
        expected = self.expected_events([5, 4, 3, 2, 1, 0], {4: [0], 2: [1], 0: [2]})
        for rank, result in enumerate(self.section("reducer")):
            with self.subTest(rank=rank):
                self.assertEqual([tuple(e) for e in result["in_order"]["events"]], expected)

    @exercise("bucketed-reducer")
    def test_buckets_launch_in_index_order_even_when_gradients_arrive_reversed(self):
        """BackwardsMLP: bucket 2 (fc1) and bucket 1 complete first, yet nothing launches before
        bucket 0, then 0, 1, 2 at once (every rank issues the same all-reduces in one order)."""
        expected = self.expected_events([1, 0, 3, 2, 5, 4], {4: [0, 1, 2]})
        reference = W.reference_reordered_gradient(self.seed, self.world)
        for rank, result in enumerate(self.section("reducer")):
            with self.subTest(rank=rank):
                self.assertEqual(result["reversed"]["buckets"], [[5, 4], [3, 2], [1, 0]])
                self.assertEqual([tuple(e) for e in result["reversed"]["events"]], expected)
                self.assert_average(result["reversed"]["grads"], reference, what="reversed gradients")

    @exercise("bucketed-reducer")
    def test_every_bucket_averaged_into_grad(self):
        reference = W.reference_gradient(self.seed + 1000, self.seed, self.world)
        for rank, result in enumerate(self.section("reducer")):
            local = W.local_gradient(self.seed + 1000, self.seed, self.world, rank)
            self.assert_average(result["in_order"]["grads"], reference, local, f"rank {rank}")
            self.assert_average(result["uneven"]["grads"],
                                W.reference_gradient(self.seed, self.seed, self.world),
                                what=f"buckets [[5], [4, 3, 2], [1, 0]], rank {rank}")

    @exercise("bucketed-reducer")
    def test_second_backward_starts_afresh(self):
        reference = W.reference_gradient(self.seed + 1000, self.seed, self.world)
        expected = self.expected_events([5, 4, 3, 2, 1, 0], {4: [0], 2: [1], 0: [2]})
        for rank, result in enumerate(self.section("reducer")):
            with self.subTest(rank=rank):
                self.assertEqual([tuple(e) for e in result["second_backward"]["events"]], expected)
                self.assert_average(result["second_backward"]["grads"], reference,
                                    what=f"second backward, rank {rank}")

    @exercise("bucketed-reducer")
    def test_unsynchronised_backward_communicates_nothing(self):
        for rank, result in enumerate(self.section("reducer")):
            with self.subTest(rank=rank):
                events = [tuple(e) for e in result["unsynchronised"]["events"]]
                self.assertEqual(events, [("grad", i) for i in (5, 4, 3, 2, 1, 0)],
                                 "_sync_this_backward False: no launch, no callback")
                local = W.local_gradient(self.seed + 1000, self.seed, self.world, rank)
                self.assertLess(max_abs_diff(result["unsynchronised"]["grads"], local),
                                checks.TOLERANCE, "the local gradient stays in .grad")

    @exercise("bucketed-reducer")
    def test_unused_parameter_raises_naming_it(self):
        for rank, result in enumerate(self.section("reducer")):
            with self.subTest(rank=rank):
                unused = result["unused"]
                self.assertEqual(unused["raised"], "RuntimeError", unused["message"])
                self.assertIn("spare.weight", unused["message"])
                self.assertIn("spare.bias", unused["message"])

    # ------------------------------------------------------------------ no-sync

    @exercise("no-sync")
    def test_no_sync_clears_the_flag_and_restores_it(self):
        for states in self.section("no_sync_flag"):
            self.assertEqual((states["before"], states["inside"], states["after"]), (True, False, True))

    @exercise("no-sync")
    def test_no_sync_restores_the_flag_when_the_body_raises(self):
        for states in self.section("no_sync_flag"):
            self.assertTrue(states["after_exception"], "restore in a finally block")

    @exercise("no-sync")
    def test_no_sync_nests_and_restores_the_previous_value(self):
        for states in self.section("no_sync_flag"):
            self.assertEqual((states["nested_inside"], states["after_inner"], states["after_outer"]),
                             (False, False, True))
            self.assertFalse(states["preset_false_after"], "restore the value it had, not True")

    @exercise("no-sync")
    def test_forward_decides_whether_its_backward_synchronises(self):
        for result in self.section("no_sync_decision"):
            self.assertEqual(result["plain"], [True])
            self.assertEqual(result["both_inside"], [False])
            self.assertEqual(result["forward_inside_only"], [False],
                             "decided at forward: leaving no_sync before backward changes nothing")
            self.assertEqual(result["backward_inside_only"], [True],
                             "decided at forward: entering no_sync after it changes nothing")
            self.assertEqual(result["accumulation"], [[False], [False], [True]])
            self.assertFalse(result["no_grad_decision"], "a forward without grad mode never synchronises")

    @exercise("no-sync")
    def test_forward_starts_fresh_bookkeeping_and_returns_the_output(self):
        for result in self.section("no_sync_decision"):
            self.assertEqual(result["starts_after_init"], 1)
            self.assertEqual(result["starts_per_forward"], 1, "call self._start_backward() once per forward")
            self.assertTrue(result["output_unchanged"])

class TestCommandLine(unittest.TestCase):
    def test_bad_arguments_exit_2(self):
        for argv, fragment in [(["--batch", "10", "--world-size", "4"], "not divisible"),
                               (["--steps", "0"], "out of range"),
                               (["--bucket-mb", "-1"], "out of range"),
                               (["--bucket-mb", "1", "x"], "not a number")]:
            with self.subTest(argv=argv):
                assert_argument_error(self, checks.parse_args, argv, fragment)

    def test_main_py_is_the_technique_and_hands_over_to_the_harness(self):
        source = (LESSON_DIR / "main.py").read_text()
        technique, entry = source.split('if __name__ == "__main__":')
        imported = set(re.findall(r"^(?:from|import) ([\w.]+)", technique, re.M))
        self.assertEqual({name for name in imported if name.startswith(("lessons", "torch.nn.parallel"))},
                         set())
        self.assertIn("run_harness(__file__)", entry)


class TestTorchrun(unittest.TestCase):
    def test_one_node_two_processes(self):
        report = run_under_torchrun(LESSON_DIR / "main.py", ["--steps", "1", "--batch", "4"],
                                    nproc_per_node=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual((report["world_size"], report["device"]), (2, "cpu"))
        self.assertEqual(len(report["checks"]), 12)


if __name__ == "__main__":
    unittest.main()
