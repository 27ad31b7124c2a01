"""Lesson 05's suite: the orders, the simulator against every closed form over many (p, m, v),
deadlock detection, the message plan under rendezvous (NCCL) semantics, the Gantt chart, the
real pipeline on 2, 3 and 4 stages against one process and torch.distributed.pipelining, the
README's numbers, the CLI and torchrun."""

from __future__ import annotations

import importlib
import json
import re
import tempfile
import unittest
from collections import Counter
from pathlib import Path

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes, run_under_torchrun

M = importlib.import_module("lessons.05_pipeline.main")
C = importlib.import_module("lessons.05_pipeline.checks")
W = importlib.import_module("lessons.05_pipeline.tests.workers")
README = Path(M.__file__).with_name("README.md")


def readme_text() -> str:
    """The README with every run of whitespace one space (numbers may wrap across lines)."""
    return " ".join(README.read_text().split())


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
        with self.assertRaisesRegex(ValueError, "not a multiple"):
            M.microbatch_count(100, 8, 2)


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

    def test_memory_closed_forms_over_a_sweep(self):
        """Every device's peak against `peak_inflight_closed_form`: GPipe m, 1F1B p-d, the
        interleaved device 0 p + (p-1)/v (m >= 2p), ZB-H1 at most 1F1B's."""
        for p in (1, 2, 3, 4, 8):
            for m in (1, p, 2 * p, 4 * p + 1):
                for kind in ("gpipe", "1f1b"):
                    timeline = M.simulate_schedule(kind, p, m)
                    for d in range(p):
                        with self.subTest(kind=kind, p=p, m=m, device=d):
                            self.assertEqual(timeline.peak_inflight(d),
                                             M.peak_inflight_closed_form(kind, p, m, 1, d))
                if m >= p:
                    self.assertLessEqual(M.simulate_schedule("zb_h1", p, m).peak_inflight(),
                                         M.peak_inflight_closed_form("zb_h1", p, m))
                for v in (2, 3, 4):
                    if m % p:
                        continue
                    timeline = M.simulate_schedule("interleaved", p, m, v)
                    for d in range(p):
                        with self.subTest(kind="interleaved", p=p, m=m, v=v, device=d):
                            self.assertAlmostEqual(timeline.peak_inflight(d),
                                                   M.peak_inflight_closed_form("interleaved", p, m, v, d))
                    if m >= 2 * p:
                        self.assertAlmostEqual(timeline.peak_inflight(), p + (p - 1) / v)

    def test_zb_h1_is_a_third_of_1f1b_bubble_time(self):
        p, m = 4, 8
        one_f_one_b = M.simulate(M.one_f_one_b_order(p, m), 1, 1.0, 2.0)
        zero_bubble = M.simulate(M.zb_h1_order(p, m), 1, 1.0, 1.0, 1.0)
        idle = lambda t: t.makespan * p - sum(e - s for row in t.rows for _, s, e in row)  # noqa: E731
        self.assertAlmostEqual(idle(zero_bubble) * 3, idle(one_f_one_b))

    def test_raising_the_cap_alone_is_not_zb_h2(self):
        """ZB-H2 allows 2p-1 micro-batches in flight, but with 1F1B's F/B order the extra room
        only holds W longer: more memory, the same bubble."""
        for p, m in ((2, 4), (4, 8), (4, 16), (8, 32)):
            h1 = M.simulate(M.zb_h1_order(p, m), 1, 1.0, 1.0, 1.0)
            capped = M.simulate(M.zb_h1_order(p, m, max_inflight=2 * p - 1), 1, 1.0, 1.0, 1.0)
            self.assertAlmostEqual(capped.bubble_fraction, h1.bubble_fraction, places=12)
            self.assertEqual(capped.peak_inflight(), 2 * p - 1)

    def test_deadlock_is_detected(self):
        orders = M.one_f_one_b_order(2, 2)
        orders[1] = [orders[1][1], orders[1][0]] + orders[1][2:]  # B0 before F0 on the last stage
        with self.assertRaisesRegex(ValueError, "deadlocks"):
            M.simulate(orders)

    def test_gantt_png(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "g.png"
            C.plot_gantt(M.simulate_schedule("zb_h1", 4, 8), "zb", path)
            self.assertEqual(path.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")


class TestMessagePlan(unittest.TestCase):
    """`p2p_plan` under rendezvous semantics (`rendezvous_problem`): what NCCL allows."""

    @staticmethod
    def plans(kind: str, p: int, m: int, orders=None) -> list:
        orders = orders or M.schedule_order(kind, p, m)
        return [M.p2p_plan(order, d, p) for d, order in enumerate(orders)]

    def test_grouped_plans_never_deadlock_and_match_by_order(self):
        for kind in ("gpipe", "1f1b"):
            for p in (1, 2, 3, 4, 6):
                for m in (1, 2, p, 2 * p + 1):
                    with self.subTest(kind=kind, p=p, m=m):
                        self.assertIsNone(C.rendezvous_problem(self.plans(kind, p, m)))

    def test_lone_blocking_sends_deadlock_1f1b(self):
        """The same messages, each posted alone: GPipe survives, 1F1B deadlocks (stage d sends
        an activation while d+1 sends a gradient, each waiting for the other's receive)."""
        def alone(kind, p, m):
            return [[([t], op) for transfers, op in plan for t in transfers]
                    for plan in self.plans(kind, p, m)]
        self.assertIsNone(C.rendezvous_problem(alone("gpipe", 4, 8)))
        self.assertIn("deadlock", C.rendezvous_problem(alone("1f1b", 4, 8)))

    def test_out_of_order_backwards_are_a_mismatch(self):
        orders = M.schedule_order("1f1b", 3, 4)
        orders[1] = ([op for op in orders[1] if op.kind == "F"]
                     + [op for op in reversed(orders[1]) if op.kind == "B"])
        self.assertIn("expected", C.rendezvous_problem(self.plans("1f1b", 3, 4, orders)))


class TestDocNumbers(unittest.TestCase):
    """Every number the README quotes, recomputed (exact rational arithmetic of the simulator:
    the same on any CPU)."""

    def test_worked_example(self):
        text = readme_text()
        for kind, quoted in (("gpipe", "27.3%"), ("interleaved", "15.8%"), ("zb_h1", "11.1%")):
            bubble = M.simulate_schedule(kind, 4, 8, 2).bubble_fraction
            self.assertEqual(f"{bubble:.1%}", quoted)
            self.assertIn(f"**{quoted}**", text)
        self.assertEqual(M.simulate_schedule("interleaved", 4, 8, 2).peak_inflight(), 5.5)
        self.assertIn("5.5 micro-batches", text)
        self.assertIn(f"GPipe {M.bubble_closed_form('gpipe', 8, 32):.1%}", text)
        self.assertIn(f"v = 4: {M.bubble_closed_form('interleaved', 8, 32, 4):.1%}", text)

    def test_gpipe_rule_of_thumb(self):
        text = readme_text()
        for p in (4, 8):
            self.assertIn(f"{M.bubble_closed_form('gpipe', p, 4 * p):.1%} at p = {p}", text)

    def test_global_batch_example(self):
        text = readme_text()
        for dp in (8, 16, 32):
            m = M.microbatch_count(512, dp, 2)
            self.assertIn(f"dp = {dp}: m = {m}, bubble {M.bubble_closed_form('1f1b', 8, m):.1%}", text)


class TestRealPipeline(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {world: launch(W.pipeline_checks, world, (4,), device="cpu", timeout_s=90)
                       for world in (2, 3, 4)}

    def test_every_check_passes(self):
        assert_every_check_passes(self, self.results)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--stages", "0"], "out of range")
        assert_argument_error(self, C.parse_args, ["--microbatches", "0"], "out of range")
        assert_argument_error(self, C.parse_args, ["--stages", "4", "--microbatches", "6",
                                                  "--chunks", "2"],
                              "multiple of --stages")
        assert_argument_error(self, C.parse_args, ["--world-size", "5"], "must divide")

    def test_stages_default_to_the_world_size(self):
        self.assertEqual(C.parse_args(["--world-size", "3", "--microbatches", "6"]).stages, 3)
        self.assertEqual(C.parse_args(["--world-size", "3", "--stages", "4"]).stages, 4)

    def test_simulate_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "s.json"
            code = C.main(["--simulate", "--stages", "4", "--microbatches", "8", "--chunks", "2",
                           "--json", str(out), "--plots", tmp])
            data = json.loads(out.read_text())
            pngs = sorted(p.name for p in Path(tmp).glob("*.png"))
        self.assertEqual(code, 0)
        for key in ("bubble_gpipe", "bubble_1f1b", "bubble_interleaved", "bubble_zb_h1",
                    "peak_inflight_gpipe", "peak_inflight_1f1b"):
            self.assertIn(key, data["metrics"])
        self.assertAlmostEqual(data["metrics"]["bubble_gpipe"], 3 / 11)
        self.assertEqual(pngs, ["1f1b.png", "gpipe.png", "interleaved.png", "zb_h1.png"])

    def test_readme_commands_parse(self):
        commands = re.findall(r"^python lessons/05_pipeline/main\.py((?:[^#\n\\]|\\\n)*)",
                              README.read_text(), re.M)
        self.assertGreaterEqual(len(commands), 3)
        for command in commands:
            if "--device cuda" not in command:  # needs GPUs; the CPU suite never touches one
                C.parse_args(command.replace("\\\n", " ").split())
        self.assertEqual(C.parse_args(["--world-size", "3"]).chunks, 1)  # 8 micro-batches, 3 stages

    def test_under_torchrun(self):
        report = run_under_torchrun(Path(M.__file__), ["--microbatches", "4"], nproc_per_node=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"))
        self.assertIn("our 1F1B == torch.distributed.pipelining Schedule1F1B",
                      [check["name"] for check in report["checks"]])


if __name__ == "__main__":
    unittest.main()
