"""Lesson 08's suite: chunk packing, the LRU pool, bitwise training under offloading and
recomputation, the cost model against lesson 07's tracker, the planner, the CLI."""

from __future__ import annotations

import importlib
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes

M = importlib.import_module("lessons.08_offload.main")
W = importlib.import_module("lessons.08_offload.tests.workers")
CONFIG = W.CONFIG


class TestChunks(unittest.TestCase):
    def test_packing_keeps_order_and_never_straddles(self):
        model = M.make_model(CONFIG, 0)
        slots, used = M.pack_chunks(model.blocks, CONFIG["chunk_numel"])
        self.assertEqual(sum(used), sum(p.numel() for p in model.blocks.parameters()))
        self.assertTrue(all(0 < u <= CONFIG["chunk_numel"] for u in used))
        for before, after in zip(slots, slots[1:]):
            self.assertTrue((after.chunk, after.offset) == (before.chunk, before.offset + before.numel)
                            or (after.chunk == before.chunk + 1 and after.offset == 0))

    def test_a_parameter_larger_than_a_chunk_is_refused(self):
        with self.assertRaisesRegex(ValueError, "does not fit in a chunk"):
            M.pack_chunks(M.make_model(CONFIG, 0).blocks, 1000)

    def test_lru_pool(self):
        pool = M.BufferPool(2)
        self.assertEqual([f for _, _, f in pool.acquire([5])], [True])
        pool.acquire([6])
        pool.acquire([5])  # 6 is now the least recently used
        pool.acquire([7])
        self.assertEqual(set(pool.resident), {5, 7})
        self.assertEqual(pool.fetches, 3)
        with self.assertRaisesRegex(ValueError, "only 2 buffers"):
            pool.acquire([1, 2, 3])


class TestTraining(unittest.TestCase):
    def test_offloaded_and_recomputed_equal_plain_bitwise(self):
        reference = M.train_plain(CONFIG, 3, 1)
        for offload in (M.OffloadConfig(0, 0), M.OffloadConfig(1, 2), M.OffloadConfig(0, 3)):
            with self.subTest(offload=offload):
                run = M.train_offloaded(CONFIG, offload, 3, 1)
                self.assertEqual(run["losses"], reference["losses"])
                for a, b in zip(run["weights"], reference["weights"]):
                    self.assertTrue(torch.equal(a, b))

    def test_a_stale_resident_copy_would_be_caught(self):
        """Skip the invalidation after the host step: the next forward uses old weights."""
        model = M.make_model(CONFIG, 1)
        manager = M.ChunkManager(model, M.OffloadConfig(0, 0), CONFIG["chunk_numel"])
        batches = M.markov_batches(CONFIG, 3, 1)
        manager.pool.clear = lambda: None  # the bug: the pool still believes its copies are fresh
        manager.step(*batches[0])
        stale = manager.step(*batches[1])
        reference = M.train_plain(CONFIG, 2, 1)["losses"][1]
        self.assertNotEqual(stale, reference)


class TestCostModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.profile, cls.moments = M.profile_model(CONFIG, 0, repeats=1)

    def test_static_bytes_of_the_plain_run(self):
        plain = M.OffloadConfig(len(self.profile.chunk_used), 0)
        self.assertEqual(self.moments["start"], M.static_bytes(self.profile, plain))

    def test_peaks_and_fetches_of_configurations_not_profiled(self):
        for offload in (M.OffloadConfig(0, 0), M.OffloadConfig(2, 1), M.OffloadConfig(0, 3)):
            with self.subTest(offload=offload):
                run = M.train_offloaded(CONFIG, offload, 2, 0)
                predicted = M.predict_peak(self.profile, offload)
                self.assertLessEqual(abs(predicted - run["peak_bytes"]) / run["peak_bytes"], 0.10)
                self.assertEqual(run["fetches"], M.count_fetches(self.profile, offload))

    def test_planner(self):
        plain = M.OffloadConfig(len(self.profile.chunk_used), 0)
        self.assertEqual(M.plan(self.profile, M.predict_peak(self.profile, plain)), plain)
        smallest = min(M.predict_peak(self.profile, c) for c in M.all_configs(self.profile))
        self.assertLessEqual(M.predict_peak(self.profile, M.plan(self.profile, smallest)), smallest)
        with self.assertRaisesRegex(M.BudgetError, f"smallest feasible budget is {smallest:,} bytes"):
            M.plan(self.profile, smallest - 1)
        for budget in (smallest, (smallest + M.predict_peak(self.profile, plain)) // 2):
            chosen = M.plan(self.profile, budget)
            fitting = [c for c in M.all_configs(self.profile) if M.predict_peak(self.profile, c) <= budget]
            self.assertEqual(M.predict_time(self.profile, chosen),
                             min(M.predict_time(self.profile, c) for c in fitting))

    def test_recomputation_and_copies_only_add_time(self):
        base = M.predict_time(self.profile, M.OffloadConfig(len(self.profile.chunk_used), 0))
        for offload in M.all_configs(self.profile):
            self.assertGreaterEqual(M.predict_time(self.profile, offload), base)


class TestDefaultDemoNumbers(unittest.TestCase):
    def test_readme_quotes_the_default_configuration(self):
        args = M.parse_args([])
        config = M.model_config(args)
        profile, _ = M.profile_model(config, args.seed, repeats=1)
        readme = Path(M.__file__).with_name("README.md").read_text()
        plain = M.OffloadConfig(len(profile.chunk_used), 0)
        layers = config["layers"]
        for offload in (plain, M.OffloadConfig(0, 0), M.OffloadConfig(0, layers - 1)):
            self.assertIn(f"{M.predict_peak(profile, offload):,} B", readme)
        self.assertIn(f"{int(0.6 * M.predict_peak(profile, plain)):,} B", readme)
        everything = M.OffloadConfig(0, layers)
        run = M.train_offloaded(config, everything, 2, args.seed)
        self.assertIn(f"{run['peak_bytes']:,} measured", readme)
        self.assertIn(f"{M.count_fetches(profile, M.OffloadConfig(0, 0))} per step", readme)


class TestNamedModel(unittest.TestCase):
    def test_readme_numbers(self):
        layout = M.named_model_layout(**M.GPT2_XL)
        readme = Path(M.__file__).with_name("README.md").read_text()
        for text in (f"{layout['static_all_persistent'] / 1e9:.1f} GB",
                     f"{layout['static_all_offloaded'] / 1e9:.2f} GB",
                     f"{layout['host_all_offloaded'] / 1e9:.1f} GB",
                     f"{layout['chunks']} chunks", f"{layout['buffers']} buffers"):
            self.assertIn(text, readme)


class TestDemo(unittest.TestCase):
    def test_every_check_passes(self):
        assert_every_check_passes(self, {1: launch(W.quick_checks, 1, device="cpu", timeout_s=120)})

    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--hidden", "30", "--heads", "4"], "--hidden 30")
        assert_argument_error(self, M.parse_args, ["--device", "cuda"], "runs on the CPU")
        assert_argument_error(self, M.parse_args, ["--chunk-numel", "1000"], "largest weight")
        assert_argument_error(self, M.parse_args, ["--budget", "0"], "--budget")

    def test_impossible_budget_exits_2_naming_the_smallest(self):
        import contextlib
        import io
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = M.main(["--budget", "1000", "--layers", "2", "--steps", "2"])
        self.assertEqual(code, 2)
        self.assertRegex(stderr.getvalue().strip(), r"^error: .*smallest feasible budget is [\d,]+ bytes")


if __name__ == "__main__":
    unittest.main()
