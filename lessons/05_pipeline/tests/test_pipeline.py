"""Lesson 05's suite. Each exercise alone: the 1F1B order against its definition, the simulator
on orders timed by hand, the closed forms against the papers' numbers, the message plan under
rendezvous (NCCL) semantics and the real pipeline step on 1-4 stages (on orders written out in
tests/workers.py, not the learner's). Then the lesson as a whole (untagged: integration): the
simulator against every closed form over many (p, m, v), the Gantt chart, the real pipeline
against one process and torch.distributed.pipelining, the README's numbers, the CLI and
torchrun."""

from __future__ import annotations

import importlib
import json
import re
import tempfile
import unittest
from collections import Counter
from fractions import Fraction
from pathlib import Path

from lessons._launch import launch
from lessons._testing import (
    assert_argument_error,
    assert_every_check_passes,
    exercise,
    run_under_torchrun,
)

M = importlib.import_module("lessons.05_pipeline.main")
S = importlib.import_module("lessons.05_pipeline.schedules")  # the orders main.py runs
C = importlib.import_module("lessons.05_pipeline.checks")
W = importlib.import_module("lessons.05_pipeline.tests.workers")
README = Path(M.__file__).with_name("README.md")


def readme_text() -> str:
    """The README with every run of whitespace one space (numbers may wrap across lines)."""
    return " ".join(README.read_text().split())


def ops(text: str) -> list:
    """"F0 B0 F1.1" -> [Op("F", 0), Op("B", 0), Op("F", 1, 1)] (kind, micro-batch[.chunk])."""
    return [M.Op(word[0], *map(int, word[1:].split("."))) for word in text.split()]


def pairs(order: list) -> list[tuple[str, int]]:
    return [(op.kind, op.microbatch) for op in order]


@exercise("one-f-one-b")
class TestOneFOneB(unittest.TestCase):
    def test_warmup_then_alternate_by_hand(self):
        forwards, backwards = ops("F0 F1 F2 F3"), ops("B0 B1 B2 B3")
        for warmup, expected in ((0, "F0 B0 F1 B1 F2 B2 F3 B3"), (1, "F0 F1 B0 F2 B1 F3 B2 B3"),
                                 (2, "F0 F1 F2 B0 F3 B1 B2 B3"), (4, "F0 F1 F2 F3 B0 B1 B2 B3")):
            with self.subTest(warmup=warmup):
                self.assertEqual(S.warmup_then_alternate(forwards, backwards, warmup), ops(expected))
        self.assertEqual(forwards, ops("F0 F1 F2 F3"), "the given lists are not changed")
        chunked = S.warmup_then_alternate(ops("F0.0 F1.0 F0.1 F1.1"), ops("B0.1 B1.1 B0.0 B1.0"), 3)
        self.assertEqual(chunked, ops("F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"))

    def test_order_on_every_device(self):
        """Device d: min(p-d-1, m) warm-up forwards, then F B in turn, then the last backwards."""
        for p in (1, 2, 3, 4, 6):
            for m in (1, 2, p, 2 * p + 1):
                orders = M.one_f_one_b_order(p, m)
                self.assertEqual(len(orders), p)
                for d, order in enumerate(orders):
                    with self.subTest(p=p, m=m, device=d):
                        self.assertEqual(pairs(order), W.expected_1f1b(p, m, d))
                        self.assertTrue(all(op.chunk == 0 for op in order))

    def test_micro_batches_held(self):
        """The most forwards not yet matched by their backward: min(p-d, m), GPipe's m at most."""
        for p, m in ((4, 8), (4, 2), (3, 3), (1, 5)):
            for d, order in enumerate(M.one_f_one_b_order(p, m)):
                held = peak = 0
                for op in order:
                    held += 1 if op.kind == "F" else -1
                    peak = max(peak, held)
                self.assertEqual(peak, min(p - d, m), (p, m, d))

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


def rows(timeline) -> list:
    return [[(op.kind, op.microbatch, op.chunk, start, end) for op, start, end in row]
            for row in timeline.rows]


@exercise("simulator")
class TestSimulatorByHand(unittest.TestCase):
    """`simulate` on small orders written out, every start and end worked out by hand."""

    def test_gpipe_two_stages(self):
        timeline = M.simulate([ops("F0 F1 B0 B1")] * 2)  # F 1, B 2
        self.assertEqual((timeline.stages, timeline.chunks), (2, 1))
        self.assertEqual(rows(timeline), [
            [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 5, 7), ("B", 1, 0, 7, 9)],
            [("F", 0, 0, 1, 2), ("F", 1, 0, 2, 3), ("B", 0, 0, 3, 5), ("B", 1, 0, 5, 7)]])

    def test_a_busy_device_delays_a_ready_op(self):
        """1F1B, 2 stages: stage 1's F1 has its input at 2 but runs B0 until 4."""
        timeline = M.simulate([ops("F0 F1 B0 B1"), ops("F0 B0 F1 B1")])
        self.assertEqual(rows(timeline), [
            [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 4, 6), ("B", 1, 0, 7, 9)],
            [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 4), ("F", 1, 0, 4, 5), ("B", 1, 0, 5, 7)]])

    def test_one_stage(self):
        self.assertEqual(rows(M.simulate([ops("F0 B0 F1 B1")], 1, 1.0, 3.0)),
                         [[("F", 0, 0, 0, 1), ("B", 0, 0, 1, 4), ("F", 1, 0, 4, 5), ("B", 1, 0, 5, 8)]])

    def test_chunks_are_virtual_stages(self):
        """2 devices x 2 chunks: virtual stages 0, 1, 2, 3 on devices 0, 1, 0, 1; each op takes
        1/v of its stage's time (F 0.5, B 1)."""
        timeline = M.simulate([ops("F0.0 F0.1 B0.1 B0.0")] * 2, chunks=2)
        self.assertEqual((timeline.stages, timeline.chunks), (2, 2))
        self.assertEqual(rows(timeline), [
            [("F", 0, 0, 0, 0.5), ("F", 0, 1, 1, 1.5), ("B", 0, 1, 3, 4), ("B", 0, 0, 5, 6)],
            [("F", 0, 0, 0.5, 1), ("F", 0, 1, 1.5, 2), ("B", 0, 1, 2, 3), ("B", 0, 0, 4, 5)]])

    def test_split_backward(self):
        """B (input gradient) waits for the next stage's B; W (weight gradient) for its own B."""
        timeline = M.simulate([ops("F0 B0 W0")] * 2, 1, 1.0, 1.0, 1.0)
        self.assertEqual(rows(timeline), [
            [("F", 0, 0, 0, 1), ("B", 0, 0, 3, 4), ("W", 0, 0, 4, 5)],
            [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 3), ("W", 0, 0, 3, 4)]])

    def test_deadlock_is_detected(self):
        with self.assertRaisesRegex(ValueError, "deadlocks"):
            M.simulate([ops("F0 B0"), ops("B0 F0")])  # B0 before F0 on the last stage
        with self.assertRaisesRegex(ValueError, "deadlocks"):
            M.simulate([ops("F0 B0 F1 B1"), ops("F1 F0 B0 B1")])  # a cycle through both devices


@exercise("closed-forms")
class TestClosedForms(unittest.TestCase):
    def test_bubble_against_the_papers(self):
        """Each paper gives the bubble relative to the ideal time, r; as a share of the total
        time it is r / (1 + r). GPipe (Huang et al.) and 1F1B: r = (p-1)/m; interleaved
        (Narayanan et al.): (p-1)/(v m); ZB-H1 (Qi et al., t_F = t_B = t_W): (p-1)/(3m)."""
        for p in (1, 2, 3, 4, 8):
            for m in (p, 2 * p, 4 * p, 4 * p + 1):
                cases = [("gpipe", 1, Fraction(p - 1, m)), ("1f1b", 1, Fraction(p - 1, m)),
                         ("zb_h1", 1, Fraction(p - 1, 3 * m))]
                cases += [("interleaved", v, Fraction(p - 1, v * m)) for v in (2, 3, 4)]
                for kind, v, r in cases:
                    with self.subTest(kind=kind, p=p, m=m, v=v):
                        self.assertAlmostEqual(M.bubble_closed_form(kind, p, m, v), float(r / (1 + r)),
                                               places=12)
        self.assertEqual(f"{M.bubble_closed_form('gpipe', 4, 8):.1%}", "27.3%")

    def test_bubble_refuses(self):
        with self.assertRaises(ValueError):
            M.bubble_closed_form("nope", 4, 8)
        with self.assertRaises(ValueError):
            M.bubble_closed_form("zb_h1", 4, 3)  # m < p: the form does not hold

    def test_peak_inflight_by_hand(self):
        """Micro-batches' activations held, devices 0 .. p-1."""
        table = {("gpipe", 4, 8, 1): [8, 8, 8, 8], ("1f1b", 4, 8, 1): [4, 3, 2, 1],
                 ("1f1b", 4, 2, 1): [2, 2, 2, 1], ("zb_h1", 4, 8, 1): [4, 3, 2, 1],
                 ("interleaved", 4, 8, 2): [5.5, 4.5, 3.5, 2.5],
                 ("interleaved", 4, 4, 2): [4, 4, 3.5, 2.5], ("1f1b", 1, 3, 1): [1]}
        for (kind, p, m, v), expected in table.items():
            with self.subTest(kind=kind, p=p, m=m, v=v):
                self.assertEqual([M.peak_inflight_closed_form(kind, p, m, v, d) for d in range(p)],
                                 expected)
        with self.assertRaises(ValueError):
            M.peak_inflight_closed_form("nope", 4, 8)


class TestOrders(unittest.TestCase):
    def test_bad_inputs(self):
        with self.assertRaisesRegex(ValueError, "multiple of stages"):
            S.interleaved_order(4, 6, 2)
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

    def test_gantt_png(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "g.png"
            C.plot_gantt(M.simulate_schedule("zb_h1", 4, 8), "zb", path)
            self.assertEqual(path.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")


def transfers(text: str) -> list:
    """"s.a0>1 r.g0<1" -> [Transfer(send, activation 0, to 1), Transfer(receive, gradient 0,
    from 1)]."""
    kinds = {"a": "activation", "g": "gradient"}
    return [M.Transfer(word[0] == "s", kinds[word[2]], int(word[3:-2]), int(word[-1]))
            for word in text.split()]


@exercise("pipeline-step")
class TestMessagePlan(unittest.TestCase):
    """`p2p_plan` under rendezvous semantics (`rendezvous_problem`): what NCCL allows. Orders
    are GPipe's (given) and 1F1B's written out (tests/workers.py), not the learner's."""

    @staticmethod
    def plans(kind: str, p: int, m: int, orders=None) -> list:
        orders = orders or W.oracle_order(kind, p, m)
        return [M.p2p_plan(order, d, p) for d, order in enumerate(orders)]

    def test_two_stage_1f1b_plan_by_hand(self):
        """Each send goes out with the next op's receive; the last group has no op."""
        stage0, stage1 = self.plans("1f1b", 2, 2)
        self.assertEqual(stage0, [(transfers(""), M.Op("F", 0)),
                                  (transfers("s.a0>1"), M.Op("F", 1)),
                                  (transfers("s.a1>1 r.g0<1"), M.Op("B", 0)),
                                  (transfers("r.g1<1"), M.Op("B", 1)),
                                  (transfers(""), None)])
        self.assertEqual(stage1, [(transfers("r.a0<0"), M.Op("F", 0)),
                                  (transfers(""), M.Op("B", 0)),
                                  (transfers("s.g0>0 r.a1<0"), M.Op("F", 1)),
                                  (transfers(""), M.Op("B", 1)),
                                  (transfers("s.g1>0"), None)])
        self.assertEqual(M.p2p_plan(ops("F0 B0"), 0, 1), [([], M.Op("F", 0)), ([], M.Op("B", 0)),
                                                          ([], None)])

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
        orders = W.oracle_order("1f1b", 3, 4)
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


@exercise("pipeline-step")
class TestPipelineStep(unittest.TestCase):
    """`pipeline_step` on 1-4 stages, GPipe and 1F1B (orders written out), against one process
    running the whole model. The message plans are checked first: a plan that would deadlock
    fails here at once instead of hanging the ranks until their deadline."""

    SIZES = {1: 3, 2: 4, 3: 2}  # stages: micro-batches (m < p on 3 stages)

    @classmethod
    def setUpClass(cls):
        for world, microbatches in cls.SIZES.items():
            for kind in ("gpipe", "1f1b"):
                plans = [M.p2p_plan(order, d, world)
                         for d, order in enumerate(W.oracle_order(kind, world, microbatches))]
                problem = C.rendezvous_problem(plans)
                if problem:
                    raise AssertionError(f"{kind} on {world} stages, p2p_plan: {problem}")
        cls.results = {world: launch(W.pipeline_step, world, (m,), device="cpu", timeout_s=45)
                       for world, m in cls.SIZES.items()}

    def test_losses_and_gradients_equal_one_process(self):
        for world, per_rank in self.results.items():
            for kind in ("gpipe", "1f1b"):
                for rank, result in enumerate(per_rank):
                    with self.subTest(kind=kind, stages=world, rank=rank):
                        self.assertLessEqual(result[kind]["loss_gap"], C.TOLERANCE, "losses")
                        self.assertLessEqual(result[kind]["grad_gap"], C.TOLERANCE, "gradients")

    def test_micro_batches_held_per_stage(self):
        """GPipe holds all m micro-batches' activations; 1F1B min(p-d, m) on stage d."""
        for world, per_rank in self.results.items():
            m = self.SIZES[world]
            self.assertEqual(per_rank[0]["gpipe"]["held"], [m] * world)
            self.assertEqual(per_rank[0]["1f1b"]["held"], [min(world - d, m) for d in range(world)])


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
