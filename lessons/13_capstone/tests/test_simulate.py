"""The planner against nd.py's real step run on fake tensors with the fake process group
(simulate.py), on a small cluster the suite runs in seconds: 16 ranks of a 4-layer model
(hidden 64, 64 tokens), one rank of each pipeline position. The README's 64-GPU table is the
same code at full size (`python lessons/13_capstone/main.py --plan --simulate`, minutes: a
demo, not a unit test)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from lessons._testing import assert_argument_error

P = importlib.import_module("lessons.13_capstone.planner")
PC = importlib.import_module("lessons.13_capstone.planner_checks")
S = importlib.import_module("lessons.13_capstone.simulate")
nd = importlib.import_module("lessons.13_capstone.nd")
collectives = importlib.import_module("lessons.01_collectives.main")

# every dimension at 2 (16 ranks); 3 micro-batches per dp replica (m > pp: 1F1B's steady state,
# as with 4, for three quarters of the fake-tensor ops); sizes small, shapes real; a
# vocabulary (1024 x hidden 64) whose head's weight gradient decides the last stage's peak
MODEL = P.Model(layers=4, hidden=64, heads=4, vocab=1024, seq=64)
CLUSTER = P.Cluster(16, 8, 80e9, 450e9, 50e9, 989e12)
RUN = P.Run.for_engine("megatron", 6)
EVERY = nd.Layout(dp=2, tp=2, pp=2, cp=2)


class TestSimulation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.plan_run = S.nd_run(RUN)
        cls.strategy = P.Strategy(EVERY, 1)
        config = S.config_of(MODEL, cls.strategy, cls.plan_run)
        cls.simulated = S.simulate_layout(config, EVERY)
        cls.rows = S.compare(MODEL, CLUSTER, cls.plan_run, cls.strategy, cls.simulated)

    def test_one_rank_per_pipeline_position(self):
        coords = [(s.coords["pp"], s.coords["dp"], s.coords["cp"], s.coords["tp"]) for s in self.simulated]
        self.assertEqual(coords, [(0, 0, 0, 0), (1, 0, 0, 0)], "the first and the last stage, rank 0 of each")
        self.assertFalse(dist.is_initialized(), "simulate_rank leaves no process group behind")

    def test_zero_shards_over_dp_x_cp(self):
        self.assertTrue(S.nd_folds_cp(), "nd.py folds cp into ZeRO's group")
        self.assertEqual({s.zero_world for s in self.simulated}, {4}, "ZeRO over dp x cp = 4 ranks")

    def test_states_and_bytes_by_dimension_match_the_planner(self):
        """Model states to the byte; the bytes each dimension sends within a few bytes (the
        world's scalar all-reduces of the loss and the norm, filed under every dimension)."""
        for row in self.rows:
            where = f"{P.strategy_name(row['strategy'])} stage {row['stage']}"
            self.assertEqual(row["states_simulated"], row["states_predicted"], where)
            for dim in ("tp", "cp", "pp", "dp"):
                predicted, simulated = row["by_dim_predicted"][dim], row["by_dim_simulated"][dim]
                self.assertLessEqual(abs(simulated - predicted), 16, f"{where} {dim}: planner "
                                     f"{predicted:.0f} bytes, simulated {simulated} bytes")
            self.assertGreater(row["by_dim_simulated"]["cp"], 0, f"{where}: the ring sent nothing")

    def test_peak_and_total_agree_within_the_tolerance(self):
        for row in self.rows:
            where = f"{P.strategy_name(row['strategy'])} stage {row['stage']}"
            ratio = row["peak_simulated"] / row["peak_predicted"]
            self.assertLess(abs(ratio - 1), S.TOLERANCE, f"{where}: peak simulated / predicted = {ratio:.3f}")
            self.assertLess(abs(ratio - 1), 0.03, f"{where}: the README says within 3%, got {ratio:.3f}")
            self.assertTrue(row["agrees"], f"{where}: compare() says they disagree: {row}")

    def test_a_planted_mistake_is_caught(self):
        """The planner without ZeRO's sharding (states whole on every rank) disagrees."""
        with mock.patch.object(P, "zero_group", lambda run, layout: 1):
            wrong = S.compare(MODEL, CLUSTER, self.plan_run, self.strategy, self.simulated)
        self.assertFalse(any(r["agrees"] for r in wrong), "ZeRO forgotten, yet a row agrees")

    def test_the_heads_weight_gradient_decides_the_last_stage(self):
        """The last stage peaks as its second micro-batch's head weight gradient (16-bit and its
        fp32 copy) meets the first's: the planner without `head_gradient_bytes` (only the
        loss's backward on top of the activations) falls more than 3% short."""
        with mock.patch.object(P, "head_gradient_bytes", lambda model, run, strategy: 0):
            wrong = S.compare(MODEL, CLUSTER, self.plan_run, self.strategy, self.simulated)
        for right, row in zip(self.rows, wrong):
            ratio = row["peak_simulated"] / row["peak_predicted"]
            if row["stage"] == EVERY.pp - 1:
                self.assertGreater(ratio, 1.03, f"last stage without the head's gradient: simulated / "
                                                f"predicted = {ratio:.3f}")
            else:
                self.assertEqual(row["peak_predicted"], right["peak_predicted"],
                                 "only the last stage has the head")


class TestCounter(unittest.TestCase):
    def test_unknown_collectives_are_refused(self):
        """A collective the counter does not know raises instead of going uncounted."""
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        try:
            counter = S.CollectiveCounter(nd.Layout(dp=4), 0)
            with counter:
                dist.all_reduce(torch.ones(10))
                with self.assertRaisesRegex(NotImplementedError, "does not count c10d"):
                    dist.all_to_all_single(torch.empty(8), torch.ones(8))
            expected = collectives.ring_bytes_sent(10, 4, 4, 0)["all_reduce"]
            self.assertEqual(counter.bytes_by(), {("dp",): expected}, "an fp32 all-reduce of 10 over 4 ranks")
        finally:
            dist.destroy_process_group()


class TestCli(unittest.TestCase):
    def test_plan_simulate_writes_the_comparison(self):
        """`--plan --simulate --json` on 4 GPUs of the tiny model: the plan's best layout
        simulated, its rows in the JSON, exit 0 when they agree. A global batch of 2: the same
        best layout as 4 (pp4), its stages in 2 micro-batches instead of 4."""
        checks = importlib.import_module("lessons.13_capstone.checks")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "plan.json"
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = checks.main(["--plan", "--simulate", "--plan-model", "tiny", "--plan-gpus", "4",
                                    "--plan-batch", "2", "--plan-top", "1", "--json", str(path)])
            report = json.loads(path.read_text())
        self.assertEqual(code, 0, out.getvalue())
        self.assertTrue(report["passed"], report)
        self.assertGreater(len(report["simulated"]), 0, "no layout simulated")
        self.assertIn("| strategy | stage | peak GB predicted |", out.getvalue())

    def test_simulate_needs_plan(self):
        checks = importlib.import_module("lessons.13_capstone.checks")
        assert_argument_error(self, checks.parse_args, ["--simulate"],
                              "--simulate checks the planner's layouts: use it with --plan")


if __name__ == "__main__":
    unittest.main()
