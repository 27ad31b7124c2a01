"""Lesson 05's suite: the orders, the simulator against every closed form over many (p, m, v),
deadlock detection, the Gantt chart, the real pipeline on 2, 3 and 4 stages against one process
and torch.distributed.pipelining, and the CLI."""

from __future__ import annotations

import importlib
import json
import tempfile
import unittest
from collections import Counter
from pathlib import Path

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes

M = importlib.import_module("lessons.05_pipeline.main")
W = importlib.import_module("lessons.05_pipeline.tests.workers")


class TestOrders(unittest.TestCase):
    def test_every_op_exactly_once(self):
        for kind in M.SCHEDULES:
            for p, m, v in ((1, 1, 1), (2, 4, 2), (4, 8, 2), (3, 9, 3), (4, 2, 1)):
                if kind == "interleaved" and m % p:
                    continue
                orders = M.schedule_order(kind, p, m, v if kind == "interleaved" else 1)
                kinds = "FBW" if kind == "zb_h1" else "FB"
                chunks = v if kind == "interleaved" else 1
                for order in orders:
                    counts = Counter((op.kind, op.microbatch, op.chunk) for op in order)
                    self.assertEqual(len(counts), len(kinds) * m * chunks, (kind, p, m, v))
                    self.assertTrue(all(c == 1 for c in counts.values()))

    def test_1f1b_warmup(self):
        orders = M.one_f_one_b_order(4, 8)
        self.assertEqual([op.kind for op in orders[0][:5]], ["F", "F", "F", "F", "B"])
        self.assertEqual([op.kind for op in orders[3][:2]], ["F", "B"])

    def test_bad_inputs(self):
        with self.assertRaisesRegex(ValueError, "multiple of stages"):
            M.interleaved_order(4, 6, 2)
        with self.assertRaises(ValueError):
            M.schedule_order("nope", 2, 2)
        with self.assertRaises(ValueError):
            M.schedule_order("gpipe", 0, 2)


class TestSimulator(unittest.TestCase):
    def test_closed_forms_over_a_sweep(self):
        for p in (1, 2, 3, 4, 6, 8):
            for m in (p, 2 * p, 4 * p, 3 * p + p):
                for kind in ("gpipe", "1f1b", "zb_h1"):
                    with self.subTest(kind=kind, p=p, m=m):
                        bubble = M.simulate_schedule(kind, p, m).bubble_fraction
                        self.assertAlmostEqual(bubble, M.bubble_closed_form(kind, p, m), places=9)
                for v in (2, 3, 4):
                    with self.subTest(kind="interleaved", p=p, m=m, v=v):
                        bubble = M.simulate_schedule("interleaved", p, m, v).bubble_fraction
                        self.assertAlmostEqual(bubble, M.bubble_closed_form("interleaved", p, m, v),
                                               places=9)

    def test_memory_claims(self):
        for p, m in ((2, 4), (4, 8), (4, 16), (8, 8)):
            self.assertEqual(M.simulate_schedule("gpipe", p, m).peak_inflight(), m)
            self.assertEqual(M.simulate_schedule("1f1b", p, m).peak_inflight(), p)
            self.assertLessEqual(M.simulate_schedule("zb_h1", p, m).peak_inflight(), p)

    def test_zb_h1_is_a_third_of_1f1b_bubble_time(self):
        p, m = 4, 8
        one_f_one_b = M.simulate(M.one_f_one_b_order(p, m), 1, 1.0, 2.0)
        zero_bubble = M.simulate(M.zb_h1_order(p, m), 1, 1.0, 1.0, 1.0)
        idle = lambda t: t.makespan * p - sum(e - s for row in t.rows for _, s, e in row)  # noqa: E731
        self.assertAlmostEqual(idle(zero_bubble) * 3, idle(one_f_one_b))

    def test_deadlock_is_detected(self):
        orders = M.one_f_one_b_order(2, 2)
        orders[1] = [orders[1][1], orders[1][0]] + orders[1][2:]  # B0 before F0 on the last stage
        with self.assertRaisesRegex(ValueError, "deadlocks"):
            M.simulate(orders)

    def test_gantt_png(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "g.png"
            M.plot_gantt(M.simulate_schedule("zb_h1", 4, 8), "zb", path)
            self.assertEqual(path.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")

    def test_readme_numbers(self):
        readme = Path(M.__file__).with_name("README.md").read_text()
        for kind, text in (("gpipe", "27.3%"), ("interleaved", "15.8%"), ("zb_h1", "11.1%")):
            bubble = M.simulate_schedule(kind, 4, 8, 2).bubble_fraction
            self.assertEqual(f"{bubble:.1%}", text)
            self.assertIn(text, readme)
        self.assertEqual(M.simulate_schedule("interleaved", 4, 8, 2).peak_inflight(), 5.5)
        self.assertIn(f"GPipe {M.bubble_closed_form('gpipe', 8, 32):.1%}", readme)


class TestRealPipeline(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.pipeline_checks, world, (4,), device="cpu", timeout_s=90)
                       for world in (2, 3, 4)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--stages", "0"], "out of range")
        assert_argument_error(self, M.parse_args, ["--microbatches", "0"], "out of range")
        assert_argument_error(self, M.parse_args, ["--stages", "4", "--microbatches", "6"],
                              "multiple of --stages")
        assert_argument_error(self, M.parse_args, ["--world-size", "5"], "must divide")

    def test_simulate_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "s.json"
            code = M.main(["--simulate", "--stages", "4", "--microbatches", "8", "--chunks", "2",
                           "--json", str(out), "--plots", tmp])
            data = json.loads(out.read_text())
            pngs = sorted(p.name for p in Path(tmp).glob("*.png"))
        self.assertEqual(code, 0)
        for key in ("bubble_gpipe", "bubble_1f1b", "bubble_interleaved", "bubble_zb_h1",
                    "peak_inflight_gpipe", "peak_inflight_1f1b"):
            self.assertIn(key, data["metrics"])
        self.assertAlmostEqual(data["metrics"]["bubble_gpipe"], 3 / 11)
        self.assertEqual(pngs, ["1f1b.png", "gpipe.png", "interleaved.png", "zb_h1.png"])


if __name__ == "__main__":
    unittest.main()
