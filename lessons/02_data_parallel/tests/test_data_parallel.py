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
import sys
import unittest
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessons._checks import max_abs_diff as _max_abs_diff
from lessons._launch import launch
from lessons._testing import (
    assert_argument_error,
    assert_every_check_passes,
    exercise,
    selected_exercises,
    torchrun_demo,
)

data_parallel = importlib.import_module("lessons.02_data_parallel.main")
cost_model = importlib.import_module("lessons.02_data_parallel.cost_model")
checks = importlib.import_module("lessons.02_data_parallel.checks")
find_unused = importlib.import_module("lessons.02_data_parallel.find_unused")
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
        for sizes, cap, expected, why in (
                ([5, 5, 6], 6, [[2], [1, 0]], "a new bucket starts empty: 5 bytes stay below the 6-byte cap"),
                ([1, 3, 4], 8, [[2, 1, 0]], "the first bucket starts empty too: 4 + 3 = 7 bytes stay "
                                            "below the 8-byte cap")):
            got = data_parallel.assign_buckets_by_size(sizes, cap)
            if got != expected:
                self.fail(f"assign_buckets_by_size({sizes}, {cap}): expected {expected}, got {got} ({why})")
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
        tiled = torch.cat([data_parallel.local_shard(x, r, 3) for r in range(3)])
        self.assertEqual(tiled.reshape(-1).tolist(), x.reshape(-1).tolist(), "3 shards of 12 rows, in order")
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

    def test_hand_worked_example(self):
        """The one-weight example of The math, from autograd in one process."""
        def gradient(ranks) -> float:
            weight = nn.Parameter(torch.ones(1, 1, dtype=torch.float64))
            x = torch.tensor([v for r in ranks for v in W.HAND_X[r]], dtype=torch.float64).reshape(-1, 1)
            y = torch.tensor([v for r in ranks for v in W.HAND_Y[r]], dtype=torch.float64).reshape(-1, 1)
            F.mse_loss(x @ weight, y).backward()
            return weight.grad.item()

        local = [gradient([r]) for r in range(3)]
        self.assertEqual([round(g, 12) for g in local], [3.0, 6.0, 2.0], "each rank's own gradient")
        self.assertIn("mean(2, 4) = 3", README)
        self.assertIn("mean(12, 0) = 6", README)
        self.assertIn("mean(4, 0) = 2", README)
        self.assertAlmostEqual(gradient([0, 1, 2]), 11 / 3, delta=1e-12, msg="all six rows")
        self.assertIn(f"(3 + 6 + 2) / 3 = 11/3 = {11 / 3:.3f}", README)
        self.assertAlmostEqual(gradient([0, 2]), 2.5, delta=1e-12, msg="ranks 0 and 2")
        self.assertIn("(3 + 2) / 2 = 2.5", README)
        skipped = (local[0] + 0 + local[2]) / 3
        self.assertIn(f"(3 + 0 + 2) / 3 = 5/3 = {skipped:.3f}", README)
        bugs = json.loads((LESSON_DIR / "bugs.json").read_text())
        self.assertIn(f"lists {len(bugs)} mistakes", README)

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
        self.assertEqual(self.results[2][0]["metrics"]["buckets"], 3, "buckets of the demo's model")

    def test_torch_contract_checks_are_there(self):
        names = [c["name"] for c in self.results[3][0]["checks"]]
        for fragment in ("find_unused_parameters", "broadcast_buffers:", "broadcast_buffers=False",
                         "tied weights", "process groups [[0, 2], [1]]"):
            self.assertTrue(any(fragment in name for name in names),
                            f"expected a check about {fragment!r}, got {names}")

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
                self.assertTrue(all(done >= line["backward_end_s"] for done in line["reduced_s"]),
                                f"expected every bucket reduced after backward ended at "
                                f"{line['backward_end_s']}, got {line['reduced_s']}")
                self.assertEqual(sum(line["bucket_bytes"]), result["params"] * 4)


class TestOnRanks(unittest.TestCase):
    """One launch on 3 ranks: each exercise's section (workers.exercise_checks; a section that
    raised comes back as its error, and fails that exercise's tests alone), first over every
    rank (group=None), then over two subgroups at once: ranks {0, 2} and rank 1 alone."""

    world = 3
    seed = 5

    @classmethod
    def setUpClass(cls):
        selected = selected_exercises()  # the grader's exercises: only their sections run
        sections = [name for name, exercise in W.EXERCISE_OF.items()
                    if selected is None or exercise in selected]
        cls.results = launch(W.exercise_checks, cls.world, (cls.seed, sections), device="cpu", timeout_s=90)

    def configurations(self, name: str):
        """(where, global rank, group size, group rank, the section's result) for the section
        over every rank, then over the subgroups; the test fails with a section's error."""
        for suffix in ("", " in subgroups"):
            for rank, result in enumerate(self.results):
                members = [range(self.world)] if not suffix else W.SUBGROUPS
                group = next(list(g) for g in members if rank in g)
                where = f"group=None (3 ranks), rank {rank}" if not suffix else \
                    f"group=ranks {group} of 3, global rank {rank}"
                section = result[name + suffix]
                if "error" in section:
                    self.fail(f"{name}, {where}: raised {section['error']}")
                yield where, rank, len(group), group.index(rank), section

    def first_rank(self, where: str, rank: int) -> int:
        """The global rank of group rank 0 in the configuration `where` names."""
        return 0 if where.startswith("group=None") else next(g for g in W.SUBGROUPS if rank in g)[0]

    def assert_average(self, got, reference, world: int, local=None, what: str = "") -> None:
        """`got` is the average `reference` (float64, within checks.TOLERANCE) over `world`
        ranks; else say which usual mistake it looks like."""
        got, reference = torch.tensor(got, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
        self.assertEqual(got.shape, reference.shape, f"{what}: gradient sizes differ")
        gap = max_abs_diff(got, reference)
        if gap <= checks.TOLERANCE:
            return
        if world > 1 and max_abs_diff(got, reference * world) <= checks.TOLERANCE:
            self.fail(f"{what}: expected the average, got the SUM over ranks, p = {world} times it "
                      f"(divide by the group's size)")
        for other in (1, 2, 3):
            if other != world and max_abs_diff(got * other, reference * world) <= checks.TOLERANCE:
                self.fail(f"{what}: expected the sum divided by the group's size {world}, got it "
                          f"divided by {other}")
        if local is not None and max_abs_diff(got, local) <= checks.TOLERANCE:
            self.fail(f"{what}: expected the average, got this rank's local gradient (nothing "
                      f"reduced into .grad)")
        self.fail(f"{what}: expected the average, got max |grad - average| = {gap:.2e} > "
                  f"{checks.TOLERANCE:g} (first values expected {reference[:3].tolist()}, got "
                  f"{got[:3].tolist()})")

    def assert_grads(self, got: list, expected: list, what: str) -> None:
        """Per parameter: None where None is expected, else the expected values (float64)."""
        self.assertEqual(len(got), len(expected), f"{what}: expected {len(expected)} parameters")
        for index, (mine, theirs) in enumerate(zip(got, expected)):
            if (mine is None) != (theirs is None):
                self.fail(f"{what}, parameter {index}: expected .grad "
                          f"{'None' if theirs is None else 'a tensor'}, got "
                          f"{'None' if mine is None else 'a tensor: ' + str(mine[:3])}")
            if mine is not None:
                gap = max_abs_diff(mine, theirs)
                self.assertLessEqual(gap, checks.TOLERANCE,
                                     f"{what}, parameter {index}: expected {theirs[:3]}..., got "
                                     f"{mine[:3]}... (max gap {gap:.1e})")

    # ------------------------------------------------------------------ average-gradients

    @exercise("average-gradients")
    def test_naive_all_reduce_averages_every_gradient(self):
        for where, _, world, _, result in self.configurations("average"):
            reference = W.reference_gradient(self.seed, self.seed, world, unused=True)
            self.assert_average(result["naive"]["grads"], reference, world, what=f"naive, {where}")
            self.assertEqual(result["naive"]["count"], 6,
                             f"naive, {where}: expected one all-reduce per parameter WITH a gradient")
            self.assertTrue(result["naive"]["spare_has_no_grad"],
                            f"naive, {where}: expected the unused layer's .grad to stay None, got a tensor")

    @exercise("average-gradients")
    def test_flat_all_reduce_averages_and_copies_back(self):
        for where, _, world, _, result in self.configurations("average"):
            reference = W.reference_gradient(self.seed, self.seed, world, unused=True)
            self.assert_average(result["flat"]["grads"], reference, world, what=f"flat, {where}")
            self.assertEqual(result["flat"]["count"], 1, f"flat, {where}: expected one all-reduce in all")
            self.assertTrue(result["flat"]["spare_has_no_grad"],
                            f"flat, {where}: expected the unused layer's .grad to stay None, got a tensor")

    @exercise("average-gradients")
    def test_grads_are_averaged_in_place(self):
        for where, _, _, _, result in self.configurations("average"):
            for kind in ("naive", "flat"):
                self.assertTrue(result[kind]["same_storage"],
                                f"{kind}, {where}: expected each .grad to keep its storage (averaged "
                                f"in place), got a new tensor")

    @exercise("average-gradients")
    def test_hand_worked_one_weight(self):
        """y = w x, w = 1, two rows per rank: rank 0 x = [1, 2], y = [0, 1], its gradient
        mean(2 x (w x - y)) = mean([2, 4]) = 3; rank 1 x = [3, 0], y = [1, 2]: mean([12, 0]) = 6;
        rank 2 x = [-1, 1], y = [1, 1]: mean([4, 0]) = 2. The average over 3 ranks is 11/3,
        over ranks {0, 2} 2.5; rank 1 alone keeps 6."""
        expected = {"group=None": 11 / 3, "[0, 2]": 2.5, "[1]": 6.0}
        for where, _, _, _, result in self.configurations("average"):
            want = next(v for k, v in expected.items() if k in where)
            for kind in ("naive", "flat"):
                self.assertAlmostEqual(result[kind]["hand"], want, delta=1e-12,
                                       msg=f"{kind}, {where}: expected {want}, got {result[kind]['hand']}")

    def test_missing_broadcast_leaves_ranks_different(self):
        results = [r["average"] for r in self.results]
        gap = max_abs_diff(results[0]["no_broadcast"], results[1]["no_broadcast"])
        self.assertGreater(gap, 1e-3, f"expected ranks 0 and 1 to differ without the broadcast, got "
                                      f"max gap {gap:.1e}")

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
        for where, _, _, _, result in self.configurations("reducer"):
            self.assertEqual([tuple(e) for e in result["in_order"]["events"]], expected,
                             f"{where}: the events (gradient ready, launch, end of backward, reduced)")

    @exercise("bucketed-reducer")
    def test_buckets_launch_in_index_order_even_when_gradients_arrive_reversed(self):
        """BackwardsMLP: bucket 2 (fc1) and bucket 1 complete first, yet nothing launches before
        bucket 0, then 0, 1, 2 at once (every rank issues the same all-reduces in one order)."""
        expected = self.expected_events([1, 0, 3, 2, 5, 4], {4: [0, 1, 2]})
        for where, _, world, _, result in self.configurations("reducer"):
            reference = W.reference_reordered_gradient(self.seed, world)
            self.assertEqual(result["reversed"]["buckets"], [[5, 4], [3, 2], [1, 0]], where)
            self.assertEqual([tuple(e) for e in result["reversed"]["events"]], expected,
                             f"{where}: the events when gradients arrive in reverse bucket order")
            self.assert_average(result["reversed"]["grads"], reference, world,
                                what=f"reversed gradients, {where}")

    @exercise("bucketed-reducer")
    def test_every_bucket_averaged_into_grad(self):
        for where, rank, world, group_rank, result in self.configurations("reducer"):
            # every rank built its own weights (seed + 1000 + rank): the broadcast gives group rank 0's
            first = self.first_rank(where, rank)
            reference = W.reference_gradient(self.seed + 1000 + first, self.seed, world)
            local = W.local_gradient(self.seed + 1000 + first, self.seed, world, group_rank)
            self.assert_average(result["in_order"]["grads"], reference, world, local, where)
            self.assertEqual(result["in_order"]["same_storage"], [True] * 6,
                             f"{where}: expected each average copied into the .grad autograd made "
                             f"(in place), per parameter")
            self.assert_average(result["uneven"]["grads"],
                                W.reference_gradient(self.seed, self.seed, world), world,
                                what=f"buckets [[5], [4, 3, 2], [1, 0]], {where}")

    @exercise("bucketed-reducer")
    def test_hand_worked_one_weight_in_one_bucket(self):
        """The one-weight model of `average-gradients`' hand-worked case, in BucketedDDP (one
        parameter, one bucket): 11/3 over 3 ranks, 2.5 over ranks {0, 2}, 6 on rank 1 alone."""
        expected = {"group=None": 11 / 3, "[0, 2]": 2.5, "[1]": 6.0}
        for where, _, _, _, result in self.configurations("reducer"):
            want = next(v for k, v in expected.items() if k in where)
            self.assertAlmostEqual(result["hand"], want, delta=1e-12,
                                   msg=f"one weight, one bucket, {where}: expected {want}, got "
                                       f"{result['hand']}")

    @exercise("bucketed-reducer")
    def test_second_backward_starts_afresh(self):
        expected = self.expected_events([5, 4, 3, 2, 1, 0], {4: [0], 2: [1], 0: [2]})
        for where, rank, world, _, result in self.configurations("reducer"):
            first = self.first_rank(where, rank)
            reference = W.reference_gradient(self.seed + 1000 + first, self.seed, world)
            self.assertEqual([tuple(e) for e in result["second_backward"]["events"]], expected,
                             f"second backward, {where}: the events")
            self.assert_average(result["second_backward"]["grads"], reference, world,
                                what=f"second backward, {where}")

    @exercise("bucketed-reducer")
    def test_unsynchronised_backward_communicates_nothing(self):
        for where, rank, world, group_rank, result in self.configurations("reducer"):
            events = [tuple(e) for e in result["unsynchronised"]["events"]]
            self.assertEqual(events, [("grad", i) for i in (5, 4, 3, 2, 1, 0)],
                             f"{where}: _sync_this_backward False: expected no launch, no callback")
            first = self.first_rank(where, rank)
            local = W.local_gradient(self.seed + 1000 + first, self.seed, world, group_rank)
            gap = max_abs_diff(result["unsynchronised"]["grads"], local)
            self.assertLess(gap, checks.TOLERANCE, f"{where}: expected the local gradient to stay "
                                                   f"in .grad, got max gap {gap:.1e}")

    @exercise("bucketed-reducer")
    def test_unused_parameter_raises_naming_it(self):
        for where, _, _, _, result in self.configurations("reducer"):
            unused = result["unused"]
            self.assertEqual(unused["raised"], "RuntimeError",
                             f"{where}: expected a RuntimeError naming spare.weight, got "
                             f"{unused['raised'] or 'no error'} {unused['message'][:100]}")
            for name in ("spare.weight", "spare.bias"):
                self.assertIn(name, unused["message"], f"{where}: the error names every parameter")

    @exercise("bucketed-reducer")
    def test_a_failed_backward_switches_synchronisation_off(self):
        """After the RuntimeError, a backward that runs before the next forward (one that
        reaches the spare layer too, so that its bucket would complete) communicates nothing:
        `_finish` switched `_sync_this_backward` off; no rank launches an all-reduce that no
        `_finish` would wait for."""
        for where, _, _, _, result in self.configurations("reducer"):
            events = [tuple(e) for e in result["unused"]["events_after"]]
            sent = [e for e in events if e[0] != "grad"]
            if sent:
                self.fail(f"{where}: a backward after the failed one, before any forward: expected no "
                          f"launch and no callback (synchronisation switched off), got {sent}")
            if sorted(i for _, i in events) != list(range(8)):
                self.fail(f"{where}: expected a gradient for each of the 8 parameters, got {events}")

    @exercise("bucketed-reducer")
    def test_find_unused_parameters_leaves_a_layer_no_rank_used_untouched(self):
        """find_unused_parameters, the spare layer unused on every rank (given as forward would
        find it): its .grad stays None (torch DDP does not write zeros into it), every other
        .grad holds the average, and every bucket launches."""
        for where, _, world, _, result in self.configurations("reducer"):
            self.assert_grads(result["no_rank_used"]["grads"],
                              W.spare_expected(self.seed, world, "no_rank_used"),
                              f"no rank used the spare layer, {where}")
            launches = [e[1] for e in result["no_rank_used"]["events"] if e[0] == "launch"]
            self.assertEqual(launches, [0, 1, 2, 3], f"{where}: expected every bucket launched once, "
                                                     f"in order")

    @exercise("bucketed-reducer")
    def test_find_unused_parameters_averages_a_layer_one_rank_used(self):
        """Only group rank 0 ran the spare layer: every rank's spare .grad is rank 0's gradient
        / p (the others count zero), the rest the average of each rank's own gradient."""
        for where, _, world, _, result in self.configurations("reducer"):
            self.assert_grads(result["rank_0_used"]["grads"],
                              W.spare_expected(self.seed, world, "rank_0_used"),
                              f"only group rank 0 used the spare layer, {where}")

    @exercise("bucketed-reducer")
    def test_find_unused_parameters_asks_the_process_group_who_used_it(self):
        """Only global rank 1 ran the spare layer. Over 3 ranks: rank 1's gradient / 3
        everywhere; on the subgroups, rank 1 alone keeps its own, and ranks 0 and 2, whose group
        nobody used it in, keep .grad None (the used flags are all-reduced over the group)."""
        for where, rank, world, _, result in self.configurations("reducer"):
            users = (1,) if where.startswith("group=None") else ((0,) if rank == 1 else ())
            self.assert_grads(result["global_rank_1_used"]["grads"],
                              W.spare_expected(self.seed, world, "used_by", users),
                              f"only global rank 1 used the spare layer, {where}")

    @exercise("bucketed-reducer")
    def test_find_unused_parameters_counts_a_use_under_no_sync(self):
        """The spare layer ran in a no_sync micro-batch, not in the synchronised one: it is used
        (torch DDP records uses in every backward), so its accumulated .grad is averaged."""
        for where, _, world, _, result in self.configurations("reducer"):
            self.assert_grads(result["used_under_no_sync"]["grads"],
                              W.spare_expected(self.seed, world, "used_under_no_sync"),
                              f"spare layer used under no_sync only, {where}")

    @exercise("bucketed-reducer")
    def test_find_unused_parameters_and_an_output_the_loss_leaves_out(self):
        """TwoHeadMLP's aux head runs in forward but the loss leaves it out: its hooks fire
        with .grad None (the outputs go through find_unused.through_sink, as forward sends
        them). No rank's loss used it: .grad stays None; only group rank 0's did: rank 0's
        gradient / p everywhere. The idle layer (given as unused) stays None."""
        for case in ("aux_left_out", "aux_on_rank_0"):
            for where, _, world, _, result in self.configurations("reducer"):
                self.assert_grads(result[case]["grads"], W.spare_expected(self.seed, world, case),
                                  f"{case}, {where}")

    # ------------------------------------------------------------------ no-sync

    @exercise("no-sync")
    def test_no_sync_clears_the_flag_and_restores_it(self):
        for where, _, _, _, states in self.configurations("no_sync_flag"):
            self.assertEqual((states["before"], states["inside"], states["after"]), (True, False, True),
                             f"{where}: require_backward_grad_sync (before, inside, after no_sync)")

    @exercise("no-sync")
    def test_no_sync_restores_the_flag_when_the_body_raises(self):
        for where, _, _, _, states in self.configurations("no_sync_flag"):
            self.assertTrue(states["after_exception"], f"{where}: expected the flag True again after "
                                                       f"the body raised (restore in a finally block)")

    @exercise("no-sync")
    def test_no_sync_nests_and_restores_the_previous_value(self):
        for where, _, _, _, states in self.configurations("no_sync_flag"):
            self.assertEqual((states["nested_inside"], states["after_inner"], states["after_outer"]),
                             (False, False, True), f"{where}: (nested inside, after inner, after outer)")
            self.assertFalse(states["preset_false_after"],
                             f"{where}: expected False (the value it had), got True")

    @exercise("no-sync")
    def test_forward_decides_whether_its_backward_synchronises(self):
        for where, _, _, _, result in self.configurations("no_sync_decision"):
            self.assertEqual(result["plain"], [True], f"{where}: a plain forward and backward")
            self.assertEqual(result["both_inside"], [False], f"{where}: both inside no_sync")
            self.assertEqual(result["forward_inside_only"], [False],
                             f"{where}: decided at forward: leaving no_sync before backward changes nothing")
            self.assertEqual(result["backward_inside_only"], [True],
                             f"{where}: decided at forward: entering no_sync after it changes nothing")
            self.assertEqual(result["accumulation"], [[False], [False], [True]],
                             f"{where}: three micro-batches, the first two inside no_sync")
            self.assertFalse(result["no_grad_decision"],
                             f"{where}: expected a forward without grad mode never to synchronise")

    @exercise("no-sync")
    def test_forward_starts_fresh_bookkeeping_and_returns_the_output(self):
        for where, _, _, _, result in self.configurations("no_sync_decision"):
            self.assertEqual(result["starts_after_init"], 1, f"{where}: _start_backward calls after __init__")
            self.assertEqual(result["starts_per_forward"], 1,
                             f"{where}: expected self._start_backward() once per forward")
            self.assertTrue(result["keywords_passed"], f"{where}: expected forward(x, use_spare=False) "
                                                       f"to pass the keyword to the module")
            self.assertTrue(result["output_unchanged"], f"{where}: expected forward to return the "
                                                        f"module's output unchanged")

    @exercise("no-sync")
    def test_forward_asks_for_unused_parameters_only_when_it_synchronises(self):
        """find_unused_parameters: a synchronised forward stores unused_parameters(output,
        self.params) in _unused (the finder is given: it answers [99]); under no_sync, under
        no_grad or with the flag off, forward does not ask and _unused stays []."""
        for where, _, _, _, result in self.configurations("no_sync_decision"):
            asked = result["unused"]
            self.assertEqual((asked["plain"]["unused"], asked["plain"]["calls"]), ([99], 1),
                             f"{where}: a synchronised forward: (_unused, calls to unused_parameters)")
            self.assertTrue(asked["plain"]["with_output_and_params"],
                            f"{where}: expected unused_parameters(the module's output, self.params)")
            for name in ("no_sync", "no_grad", "flag_off"):
                self.assertEqual((asked[name]["unused"], asked[name]["calls"]), ([], 0),
                                 f"{where}, {name}: (_unused, calls to unused_parameters)")

    @exercise("no-sync")
    def test_forward_sends_its_outputs_through_the_sink(self):
        """find_unused_parameters: forward returns find_unused.through_sink(output), the same
        two tensors, so a loss on the first alone still fires the hooks of the second head's 2
        parameters (with .grad None): 6 hook calls in all; without the flag, 4 and no None."""
        for where, _, _, _, result in self.configurations("no_sync_decision"):
            left_out = result["left_out"]
            self.assertEqual((left_out["find_unused"]["hooks"], left_out["find_unused"]["grad_none"]),
                             (6, 2), f"{where}, find_unused_parameters: (hook calls, of them with "
                                     f".grad None) after a loss on the first output only")
            self.assertEqual((left_out["flag_off"]["hooks"], left_out["flag_off"]["grad_none"]), (4, 0),
                             f"{where}, find_unused_parameters off: (hook calls, with .grad None)")
            for name in ("find_unused", "flag_off"):
                self.assertTrue(left_out[name]["same_output"],
                                f"{where}, {name}: expected the module's two outputs, same values")

    @exercise("no-sync")
    def test_forward_broadcasts_rank_0s_buffers_as_torch_ddp_does(self):
        """Rank r sets its buffer to 10 r + k before forward k; the module reads group rank 0's
        value after a synchronised forward (forwards 1, 2 and 4: the first, the one after it,
        the no_grad one after a synchronised one) and its own after a no_sync or no_grad one
        (3 and 5), as torch DDP's require_forward_param_sync decides; with
        broadcast_buffers=False, its own every time (and at construction)."""
        for where, rank, _, _, result in self.configurations("no_sync_decision"):
            first = self.first_rank(where, rank)  # group rank 0's global rank
            buffers = result["buffers"]
            expected = [10.0 * first + 1, 10.0 * first + 2, 10.0 * rank + 3, 10.0 * first + 4,
                        10.0 * rank + 5]
            self.assertEqual(buffers["broadcast"]["seen"], expected,
                             f"{where}: the buffer the module read at forwards 1..5 (plain, no_sync, "
                             f"plain, no_grad, plain)")
            self.assertEqual(buffers["broadcast"]["after_init"], -1.0 - first,
                             f"{where}: the buffer after construction (rank 0's)")
            self.assertEqual(buffers["no_broadcast"]["seen"], [10.0 * rank + k for k in range(1, 6)],
                             f"{where}, broadcast_buffers=False: expected its own buffer every time")
            self.assertEqual(buffers["no_broadcast"]["after_init"], -1.0 - rank,
                             f"{where}, broadcast_buffers=False: not broadcast at construction either")


@exercise("find-unused")
class TestFindUnused(unittest.TestCase):
    """`find_unused.unused_parameters` in one process, on graphs built here: layers skipped,
    outputs in tuples and dicts, detached branches, tied weights, deep graphs."""

    def setUp(self):
        torch.manual_seed(0)
        self.x = torch.randn(5, 16, dtype=torch.float64)

    def assert_unused(self, output, params, expected: list[int], what: str) -> None:
        got = find_unused.unused_parameters(output, params)
        self.assertEqual(list(got), expected, f"{what}: expected unused indices {expected}, got {got}")

    def test_a_layer_forward_never_calls(self):
        model = data_parallel.make_model(0, unused=True)
        self.assert_unused(model(self.x), list(model.parameters()), W.SPARE, "TinyMLP with its spare layer")

    def test_a_layer_forward_skips_this_time(self):
        model = checks.build(checks.SpareMLP, 0, "cpu")
        params = list(model.parameters())
        self.assert_unused(model(self.x, use_spare=True), params, [], "SpareMLP using the spare layer")
        self.assert_unused(model(self.x, use_spare=False), params, W.SPARE, "SpareMLP skipping it")

    def test_every_output_counts(self):
        """A tuple, a dict with a list inside, non-tensor values and tensors without a graph."""
        model = checks.build(checks.SpareMLP, 0, "cpu")
        params = list(model.parameters())
        main = model(self.x, use_spare=False)
        aux = model.spare(torch.randn(5, 32, dtype=torch.float64))
        labels = torch.arange(5)
        self.assert_unused((main, aux), params, [], "(output, aux), aux through the spare layer")
        self.assert_unused((aux, main), params, [], "(aux, output)")
        self.assert_unused({"logits": labels, "extra": [None, 3, "text", (main, aux)]}, params, [],
                           "a dict holding a list holding a tuple, beside non-tensors")
        self.assert_unused([labels, main], params, W.SPARE, "[a tensor without graph, output]")
        self.assert_unused(None, params, list(range(8)), "no tensor at all")

    def test_a_detached_branch_is_unused(self):
        model = checks.build(checks.SpareMLP, 0, "cpu")
        hidden = F.relu(model.fc1(self.x))
        output = model.head(F.relu(model.fc2(hidden))) + model.spare(hidden).detach()[:, :4]
        self.assert_unused(output, list(model.parameters()), W.SPARE,
                           "the spare layer's output detached before it joins")

    def test_tied_weights_and_any_order(self):
        model = checks.build(checks.TiedMLP, 0, "cpu")
        params = list(model.parameters())
        self.assertEqual(len(params), 4, "fc2 and its alias `again` are one layer")
        self.assert_unused(model(self.x), params, [], "the tied model")
        self.assert_unused(F.relu(model.fc1(self.x)), params[::-1], [0, 1],
                           "fc1 alone, parameters listed in reverse: fc2's indices are 0 and 1")

    def test_a_graph_deeper_than_the_recursion_limit(self):
        """3,000 multiplications in a chain (and an input that requires grad, whose
        AccumulateGrad is not a parameter): walk it without recursion."""
        weight, other = nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.tensor(2.0))
        value = torch.tensor(1.0, requires_grad=True)
        for _ in range(3000):
            value = value * weight
        self.assert_unused(value, [other, weight], [0], "a 3,000-step chain through one weight")

    def test_each_node_is_visited_once(self):
        """The docstring's cost, one visit per node: 40 residual steps x = x + x w make a graph
        of 81 nodes but 2^40 paths (each residual block of a real network doubles them); a walk
        that does not remember the nodes it met follows every path. Counted in Python line
        events (sys.settrace), not in seconds, and stopped past 500 lines per node."""
        weight, other = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(2.0))
        value = torch.tensor(1.0)
        for _ in range(40):
            value = value + value * weight
        nodes, stack = {value.grad_fn}, [value.grad_fn]  # the graph's nodes, counted here
        while stack:
            for following, _ in stack.pop().next_functions:
                if following is not None and following not in nodes:
                    nodes.add(following)
                    stack.append(following)
        self.assertEqual(len(nodes), 81, "40 additions, 40 multiplications, one AccumulateGrad")
        budget, lines = 500 * len(nodes), 0

        class OverBudget(Exception):
            pass

        def tracer(frame, event, arg):
            nonlocal lines
            lines += event == "line"
            if lines > budget:
                raise OverBudget  # unwinds the walk (and unsets the tracer)
            return tracer

        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            got = find_unused.unused_parameters(value, [other, weight])
        except OverBudget:
            self.fail(f"expected about one visit per node of a graph of {len(nodes)} nodes and 2^40 "
                      f"paths, got more than {budget:,} Python lines without an answer: mark each "
                      f"node seen when you first meet it, and never push a seen node again")
        finally:
            sys.settrace(previous)
        self.assertEqual(list(got), [0], f"40 residual steps through one weight: expected unused "
                                         f"indices [0], got {got}")

    def test_nothing_is_computed_or_changed(self):
        model = data_parallel.make_model(0, unused=True)
        output = model(self.x)
        find_unused.unused_parameters(output, list(model.parameters()))
        grads = [p.grad for p in model.parameters()]
        self.assertEqual(grads, [None] * 8, "expected no .grad written by the search")
        output.sum().backward()  # the graph is still there
        self.assertIsNotNone(model.fc1.weight.grad, "expected the graph to survive the search")


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
    @torchrun_demo(["--steps", "1", "--batch", "4"])
    def test_one_node_two_processes(self, report):
        self.assertTrue(report["passed"], [c for c in report["checks"] if not c["passed"]])
        self.assertEqual((report["world_size"], report["device"]), (2, "cpu"))
        self.assertEqual(len(report["checks"]), 18, [c["name"] for c in report["checks"]])


if __name__ == "__main__":
    unittest.main()
