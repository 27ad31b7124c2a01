"""Lesson 02's suite: bucket assignment and the cost model, the numbers the docs quote, every DDP
variant against the single-process run and torch DDP on 1, 2 and 3 ranks, what the checks must
catch (missing broadcast, missing average, launch order), the benchmark's plumbing, the CLI and
a run under torchrun."""

from __future__ import annotations

import importlib
import json
import random
import re
import unittest
from pathlib import Path

import torch

from lessons._checks import max_abs_diff as _max_abs_diff
from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes, run_under_torchrun

data_parallel = importlib.import_module("lessons.02_data_parallel.main")
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


class TestBuckets(unittest.TestCase):
    def test_reverse_order_and_cap(self):
        self.assertEqual(data_parallel.assign_buckets_by_size([8, 8, 8], 16), [[2, 1], [0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([100, 1, 1], 10), [[2, 1, 0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([5, 5, 5, 5], 1), [[3], [2], [1], [0]])
        self.assertEqual(data_parallel.assign_buckets_by_size([], 10), [])

    def test_first_bucket_has_its_own_cap(self):
        self.assertEqual(data_parallel.assign_buckets_by_size([8, 8, 8, 8], 100, first_cap_bytes=8),
                         [[3], [2, 1, 0]])
        self.assertEqual(data_parallel.assign_buckets_by_size(bench_model_sizes(), 25 * MiB, MiB),
                         [[5, 4], [3, 2, 1, 0]])

    def test_every_parameter_once_and_count_within_bound(self):
        rng = random.Random(0)
        for trial in range(200):
            sizes = [rng.choice([1, 3, 70, 400, 5000]) for _ in range(rng.randint(0, 12))]
            cap = rng.choice([1, 10, 50, 100, 1000, 10**6])
            buckets = data_parallel.assign_buckets_by_size(sizes, cap)
            with self.subTest(trial=trial):
                self.assertEqual(sorted(i for b in buckets for i in b), list(range(len(sizes))))
                for bucket in buckets[:-1]:  # every closed bucket reached the cap
                    self.assertGreaterEqual(sum(sizes[i] for i in bucket), cap)
                self.assertLessEqual(data_parallel.count_buckets(sizes, cap),
                                     data_parallel.bucket_count_bound(sum(sizes), cap, len(sizes)))

    def test_launch_order_follows_the_assignment(self):
        model = data_parallel.make_model(0)
        self.assertEqual(data_parallel.assign_buckets(list(model.parameters()), 1024),
                         [[5, 4], [3, 2], [1, 0]])

    def test_local_shards_tile_the_batch(self):
        x = torch.arange(12.0).reshape(12, 1)
        self.assertTrue(torch.equal(torch.cat([data_parallel.local_shard(x, r, 3) for r in range(3)]), x))
        with self.assertRaisesRegex(ValueError, "not divisible"):
            data_parallel.local_shard(x, 0, 5)


class TestCostModel(unittest.TestCase):
    def test_bytes_formula(self):
        self.assertEqual(data_parallel.ddp_bytes_per_rank(1000, 4, 4), 6000)
        self.assertEqual(data_parallel.ddp_bytes_per_rank(1000, 4, 1), 0)

    def test_fifo_end_is_the_max_over_suffixes(self):
        rng = random.Random(1)
        for _ in range(200):
            n = rng.randint(1, 6)
            ready = sorted(rng.uniform(0, 10) for _ in range(n))
            alone = [rng.uniform(0, 5) for _ in range(n)]
            closed_form = max(ready[i] + sum(alone[i:]) for i in range(n))
            self.assertAlmostEqual(data_parallel.all_reduces_end(ready, alone), closed_form)

    def test_overlap_never_loses_and_keeps_the_last_bucket_exposed(self):
        rng = random.Random(2)
        for _ in range(200):
            n = rng.randint(1, 6)
            t_fwd, t_bwd, t_opt = (rng.uniform(0.1, 10) for _ in range(3))
            ready = sorted(rng.uniform(0, t_bwd) for _ in range(n - 1)) + [t_bwd]
            alone = [rng.uniform(0, 5) for _ in range(n)]
            overlapped = data_parallel.step_time_overlapped(t_fwd, t_bwd, ready, alone, t_opt)
            after = data_parallel.step_time_after_backward(t_fwd, t_bwd, sum(alone), t_opt)
            self.assertLessEqual(overlapped, after + 1e-12)
            bound = t_fwd + max(t_bwd + alone[-1], ready[0] + sum(alone)) + t_opt
            self.assertGreaterEqual(overlapped, bound - 1e-12)

    def test_one_bucket_at_the_end_is_no_overlap(self):
        self.assertAlmostEqual(data_parallel.step_time_overlapped(10, 30, [30], [45], 5),
                               data_parallel.step_time_after_backward(10, 30, 45, 5))


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed from the code."""

    def test_bytes_and_buckets_worked_example(self):
        params = 3 * (1024 * 1024 + 1024)
        sizes = bench_model_sizes()
        self.assertEqual(sum(sizes), params * 4)
        self.assertIn(f"Psi = {params:,} float32", README)
        self.assertIn(f"{params * 4 / 1e6:.1f} MB of gradient", README)
        self.assertIn(f"{data_parallel.ddp_bytes_per_rank(params, 4, 4) / 1e6:.1f} MB per step", README)
        bound = -(-sum(sizes) // MiB)
        self.assertEqual(bound, 13)
        self.assertIn(f"ceil(Psi x b / cap) = {bound} is only", README)
        self.assertEqual(data_parallel.count_buckets(sizes, MiB), 3)
        self.assertIn("exactly 3 buckets per step", README)
        self.assertEqual(data_parallel.bucket_count_bound(sum(sizes), MiB, len(sizes)), 6)

    def test_time_worked_example(self):
        ready, alone = [10, 20, 30], [15, 15, 15]
        self.assertEqual(data_parallel.step_time_after_backward(10, 30, 45, 5), 90)
        self.assertEqual(data_parallel.all_reduces_end(ready, alone), 55)
        self.assertEqual(data_parallel.step_time_overlapped(10, 30, ready, alone, 5), 70)
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
            value = getattr(data_parallel, spec["function"])(**spec["kwargs"]) * spec.get("scale", 1)
            with self.subTest(question=question["id"]):
                self.assertLessEqual(abs(value - question["answer"]), question["tolerance"] + 1e-9)

    def test_measured_figures_are_labelled(self):
        measured = README.split("**Measured here.**", 1)[1].split("##", 1)[0]
        self.assertRegex(measured, r"--bench")
        self.assertTrue(re.search(r"\d+ ranks?", measured), measured)


class TestAgainstReferences(unittest.TestCase):
    """Every check of the demo, on 1, 2 and 3 ranks (one launch each; 4 is the demo's default)."""

    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.all_checks, world, (3, 2, 12), device="cpu", timeout_s=90)
                       for world in (1, 2, 3)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)

    def test_bucket_count_reported(self):
        self.assertEqual(self.results[2][0]["metrics"]["buckets"], 3)


class TestWhatChecksCatch(unittest.TestCase):
    """One launch on 2 ranks: the failures the checks must catch, the launch order, the bench."""

    @classmethod
    def setUpClass(cls):
        cls.world = 2
        cls.results = launch(W.what_checks_catch, cls.world, (5,), device="cpu", timeout_s=90)

    def test_missing_broadcast_leaves_ranks_different(self):
        self.assertGreater(max_abs_diff(self.results[0]["no_broadcast"],
                                        self.results[1]["no_broadcast"]), 1e-3)

    def test_missing_average_is_p_times_too_large(self):
        grads = W.reference_gradient(5, self.world)
        summed = self.results[0]["summed"]
        self.assertGreater(max_abs_diff(summed, grads), 1e3 * checks.TOLERANCE)
        self.assertLess(max_abs_diff(torch.tensor(summed, dtype=torch.float64) / self.world, grads),
                        checks.TOLERANCE)

    def test_buckets_launch_in_index_order_even_when_gradients_arrive_reversed(self):
        for result in self.results:
            self.assertEqual(result["buckets"], [[5, 4], [3, 2], [1, 0]])
            events = [tuple(event) for event in result["events"]]
            # bucket 2 (fc1) and bucket 1 complete first, yet nothing launches before bucket 0
            self.assertEqual(events, [("grad", -2)] * 6 + [("launch", 0), ("launch", 1), ("launch", 2),
                                                          ("backward_end", -1), ("reduced", 0),
                                                          ("reduced", 1), ("reduced", 2)])
            self.assertLess(max_abs_diff(result["reordered_grads"],
                                         W.reference_reordered_gradient(5, self.world)),
                            checks.TOLERANCE)


    def test_bench_runs_and_its_timelines_are_ordered(self):
        """The benchmark's plumbing (no timing value is asserted)."""
        result = self.results[0]["bench"]
        variants = [row["variant"] for row in result["rows"]]
        self.assertEqual(variants[:2], ["local (no communication)", "flat, after backward"])
        self.assertEqual([row["buckets"] for row in result["rows"]], [0, 1, 3, 1, 3])
        for name, line in result["timelines"].items():
            with self.subTest(variant=name):
                self.assertEqual(line["launch_s"], sorted(line["launch_s"]))
                self.assertLessEqual(line["launch_s"][-1], line["backward_end_s"])
                self.assertTrue(all(done >= line["backward_end_s"] for done in line["reduced_s"]))
                self.assertEqual(sum(line["bucket_bytes"]), result["params"] * 4)


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
