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
    torchrun_demo,
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


def show(order: list) -> str:
    """[Op("F", 0), Op("B", 0, 1)] -> "F0 B0.1" (the notation of `ops`), for messages."""
    return " ".join(f"{op.kind}{op.microbatch}" + (f".{op.chunk}" if op.chunk else "") for op in order)


@exercise("one-f-one-b")
class TestOneFOneB(unittest.TestCase):
    def test_warmup_then_alternate_by_hand(self):
        forwards, backwards = ops("F0 F1 F2 F3"), ops("B0 B1 B2 B3")
        for warmup, expected in ((0, "F0 B0 F1 B1 F2 B2 F3 B3"), (1, "F0 F1 B0 F2 B1 F3 B2 B3"),
                                 (2, "F0 F1 F2 B0 F3 B1 B2 B3"), (4, "F0 F1 F2 F3 B0 B1 B2 B3")):
            got = S.warmup_then_alternate(forwards, backwards, warmup)
            with self.subTest(warmup=warmup):
                self.assertEqual(got, ops(expected), f"warm-up {warmup}: expected {expected}, "
                                 f"got {show(got)}")
        self.assertEqual(forwards, ops("F0 F1 F2 F3"), "the given lists are not changed: forwards "
                         f"now {show(forwards)}")
        chunked = S.warmup_then_alternate(ops("F0.0 F1.0 F0.1 F1.1"), ops("B0.1 B1.1 B0.0 B1.0"), 3)
        expected = "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"
        self.assertEqual(chunked, ops(expected), f"chunks, warm-up 3: expected {expected}, "
                         f"got {show(chunked)}")

    def test_three_stages_by_hand(self):
        """p = 3 (a middle stage), m = 4 and m = 2: every device's order written out."""
        cases = {(3, 4): ["F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
                 (3, 2): ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]}
        for (p, m), expected in cases.items():
            got = M.one_f_one_b_order(p, m)
            for d in range(p):
                with self.subTest(p=p, m=m, device=d):
                    self.assertEqual(got[d], ops(expected[d]), f"p = {p}, m = {m}, device {d}: "
                                     f"expected {expected[d]}, got {show(got[d])}")

    def test_order_on_every_device(self):
        """Device d: min(p-d-1, m) warm-up forwards, then F B in turn, then the last backwards."""
        for p in (1, 2, 3, 4, 6):
            for m in (1, 2, p, 2 * p + 1):
                orders = M.one_f_one_b_order(p, m)
                self.assertEqual(len(orders), p, f"p = {p}, m = {m}: one order per device")
                for d, order in enumerate(orders):
                    with self.subTest(p=p, m=m, device=d):
                        self.assertEqual(pairs(order), W.expected_1f1b(p, m, d),
                                         f"p = {p}, m = {m}, device {d}: got {show(order)}")
                        self.assertEqual([op.chunk for op in order], [0] * len(order),
                                         f"p = {p}, m = {m}, device {d}: every op on chunk 0")

    def test_micro_batches_held(self):
        """The most forwards not yet matched by their backward: min(p-d, m), GPipe's m at most."""
        for p, m in ((4, 8), (4, 2), (3, 3), (3, 5), (1, 5)):
            for d, order in enumerate(M.one_f_one_b_order(p, m)):
                held = peak = 0
                for op in order:
                    held += 1 if op.kind == "F" else -1
                    peak = max(peak, held)
                self.assertEqual(peak, min(p - d, m), f"p = {p}, m = {m}, device {d}: most "
                                 f"micro-batches between F and B, order {show(order)}")

    def test_every_op_exactly_once(self):
        """1F1B's orders here; every schedule's (built on 1F1B's) in the integration tests."""
        assert_every_op_once(self, ("1f1b",))


def assert_every_op_once(case: unittest.TestCase, kinds) -> None:
    for kind in kinds:
        for p, m, v in ((1, 1, 1), (2, 4, 2), (4, 8, 2), (3, 9, 3), (4, 2, 1), (3, 5, 1)):
            if kind == "interleaved" and m % p:
                continue
            orders = M.schedule_order(kind, p, m, v if kind == "interleaved" else 1)
            op_kinds = "FBW" if kind == "zb_h1" else "FB"
            chunks = v if kind == "interleaved" else 1
            for d, order in enumerate(orders):
                counts = Counter((op.kind, op.microbatch, op.chunk) for op in order)
                where = f"{kind}, p = {p}, m = {m}, v = {v}, device {d}"
                case.assertEqual(len(counts), len(op_kinds) * m * chunks, f"{where}: distinct ops")
                repeated = [key for key, count in counts.items() if count != 1]
                case.assertEqual(repeated, [], f"{where}: ops that appear more than once")


def rows(timeline) -> list:
    return [[(op.kind, op.microbatch, op.chunk, start, end) for op, start, end in row]
            for row in timeline.rows]


@exercise("simulator")
class TestSimulatorByHand(unittest.TestCase):
    """`simulate` on small orders written out, every start and end worked out by hand."""

    def assert_rows(self, timeline, expected, what):
        got = rows(timeline)
        for d, (mine, want) in enumerate(zip(got, expected)):
            self.assertEqual(mine, want, f"{what}: device {d}'s (kind, micro-batch, chunk, start, end)")
        self.assertEqual(len(got), len(expected), f"{what}: one row per device")

    def test_gpipe_two_stages(self):
        timeline = M.simulate([ops("F0 F1 B0 B1")] * 2)  # F 1, B 2
        self.assertEqual((timeline.stages, timeline.chunks), (2, 1), "Timeline(stages, chunks)")
        self.assert_rows(timeline, [
            [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 5, 7), ("B", 1, 0, 7, 9)],
            [("F", 0, 0, 1, 2), ("F", 1, 0, 2, 3), ("B", 0, 0, 3, 5), ("B", 1, 0, 5, 7)]], "GPipe, p = 2")

    def test_a_busy_device_delays_a_ready_op(self):
        """1F1B, 2 stages: stage 1's F1 has its input at 2 but runs B0 until 4."""
        timeline = M.simulate([ops("F0 F1 B0 B1"), ops("F0 B0 F1 B1")])
        self.assert_rows(timeline, [
            [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 4, 6), ("B", 1, 0, 7, 9)],
            [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 4), ("F", 1, 0, 4, 5), ("B", 1, 0, 5, 7)]], "1F1B, p = 2")

    def test_three_stages_fewer_micro_batches(self):
        """1F1B, p = 3, m = 2: the middle stage's B waits for the last stage's B (5), the last
        stage's F1 for its own B0; the bubble is (p-1)/(m+p-1) = 1/2."""
        timeline = M.simulate([ops("F0 F1 B0 B1"), ops("F0 F1 B0 B1"), ops("F0 B0 F1 B1")])
        self.assert_rows(timeline, [
            [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 7, 9), ("B", 1, 0, 10, 12)],
            [("F", 0, 0, 1, 2), ("F", 1, 0, 2, 3), ("B", 0, 0, 5, 7), ("B", 1, 0, 8, 10)],
            [("F", 0, 0, 2, 3), ("B", 0, 0, 3, 5), ("F", 1, 0, 5, 6), ("B", 1, 0, 6, 8)]],
            "1F1B, p = 3, m = 2")
        self.assertEqual(timeline.bubble_fraction, 0.5, "1 - 18 busy / (3 devices x 12)")

    def test_one_stage(self):
        self.assert_rows(M.simulate([ops("F0 B0 F1 B1")], 1, 1.0, 3.0),
                         [[("F", 0, 0, 0, 1), ("B", 0, 0, 1, 4), ("F", 1, 0, 4, 5), ("B", 1, 0, 5, 8)]],
                         "one stage, t_b = 3")

    def test_chunks_are_virtual_stages(self):
        """2 devices x 2 chunks: virtual stages 0, 1, 2, 3 on devices 0, 1, 0, 1; each op takes
        1/v of its stage's time (F 0.5, B 1)."""
        timeline = M.simulate([ops("F0.0 F0.1 B0.1 B0.0")] * 2, chunks=2)
        self.assertEqual((timeline.stages, timeline.chunks), (2, 2), "Timeline(stages, chunks)")
        self.assert_rows(timeline, [
            [("F", 0, 0, 0, 0.5), ("F", 0, 1, 1, 1.5), ("B", 0, 1, 3, 4), ("B", 0, 0, 5, 6)],
            [("F", 0, 0, 0.5, 1), ("F", 0, 1, 1.5, 2), ("B", 0, 1, 2, 3), ("B", 0, 0, 4, 5)]],
            "2 devices x 2 chunks")

    def test_split_backward(self):
        """B (input gradient) waits for the next stage's B; W (weight gradient) for its own B;
        three stages, so the middle one waits on both sides."""
        self.assert_rows(M.simulate([ops("F0 B0 W0")] * 2, 1, 1.0, 1.0, 1.0), [
            [("F", 0, 0, 0, 1), ("B", 0, 0, 3, 4), ("W", 0, 0, 4, 5)],
            [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 3), ("W", 0, 0, 3, 4)]], "F B W, p = 2")
        self.assert_rows(M.simulate([ops("F0 B0 W0")] * 3, 1, 1.0, 1.0, 1.0), [
            [("F", 0, 0, 0, 1), ("B", 0, 0, 5, 6), ("W", 0, 0, 6, 7)],
            [("F", 0, 0, 1, 2), ("B", 0, 0, 4, 5), ("W", 0, 0, 5, 6)],
            [("F", 0, 0, 2, 3), ("B", 0, 0, 3, 4), ("W", 0, 0, 4, 5)]], "F B W, p = 3")

    def test_split_backward_with_chunks(self):
        """One device, two chunks, F = B = W = 1 per stage: every op takes 1/v = 0.5, W too."""
        self.assert_rows(M.simulate([ops("F0.0 F0.1 B0.1 W0.1 B0.0 W0.0")], 2, 1.0, 1.0, 1.0), [
            [("F", 0, 0, 0, 0.5), ("F", 0, 1, 0.5, 1), ("B", 0, 1, 1, 1.5), ("W", 0, 1, 1.5, 2),
             ("B", 0, 0, 2, 2.5), ("W", 0, 0, 2.5, 3)]], "F B W, one device, 2 chunks")

    def test_deadlock_is_detected(self):
        for orders, what in (([ops("F0 B0"), ops("B0 F0")], "B0 before F0 on the last stage"),
                             ([ops("F0 B0 F1 B1"), ops("F1 F0 B0 B1")], "a cycle through both devices"),
                             ([ops("F0 W0 B0")], "W0 before the B0 it needs")):
            with self.assertRaisesRegex(ValueError, "deadlocks",
                                        msg=f"{what}: ValueError '... deadlocks ...'"):
                M.simulate(orders, 1, 1.0, 1.0, 1.0)


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
                    got = M.bubble_closed_form(kind, p, m, v)
                    with self.subTest(kind=kind, p=p, m=m, v=v):
                        self.assertAlmostEqual(got, float(r / (1 + r)), places=12, msg=(
                            f"{kind}, p = {p}, m = {m}, v = {v}: expected "
                            f"{float(r / (1 + r)):.6f} = r/(1+r) with r = {r}, got {got:.6f}"))
        self.assertEqual(f"{M.bubble_closed_form('gpipe', 4, 8):.1%}", "27.3%", "GPipe, p = 4, m = 8")

    def test_bubble_refuses(self):
        for args, what in ((("nope", 4, 8), "an unknown schedule"),
                           (("zb_h1", 4, 3), "ZB-H1 with m < p (the form does not hold)")):
            with self.assertRaises(ValueError, msg=f"bubble_closed_form{args}: {what} is a ValueError"):
                M.bubble_closed_form(*args)

    def test_peak_inflight_by_hand(self):
        """Micro-batches' activations held, devices 0 .. p-1. ZB-H1: min(p, m) on every device
        (W waits until the cap of p forces it), not 1F1B's p - d."""
        table = {("gpipe", 4, 8, 1, None): [8, 8, 8, 8], ("1f1b", 4, 8, 1, None): [4, 3, 2, 1],
                 ("1f1b", 4, 2, 1, None): [2, 2, 2, 1], ("1f1b", 3, 5, 1, None): [3, 2, 1],
                 ("zb_h1", 4, 8, 1, None): [4, 4, 4, 4], ("zb_h1", 3, 5, 1, None): [3, 3, 3],
                 ("zb_h1", 4, 2, 1, None): [2, 2, 2, 2],
                 ("interleaved", 4, 8, 2, None): [5.5, 4.5, 3.5, 2.5],
                 ("interleaved", 4, 4, 2, None): [4, 4, 3.5, 2.5],
                 ("interleaved", 3, 6, 2, None): [4, 3, 2],
                 ("interleaved", 4, 10, 2, 5): [6, 5, 4, 3], ("1f1b", 1, 3, 1, None): [1]}
        for (kind, p, m, v, group), expected in table.items():
            got = [M.peak_inflight_closed_form(kind, p, m, v, d, **({"group": group} if group else {}))
                   for d in range(p)]
            with self.subTest(kind=kind, p=p, m=m, v=v, group=group):
                self.assertEqual(got, expected, f"{kind}, p = {p}, m = {m}, v = {v}, group {group}: "
                                 f"devices 0..{p - 1}")
        with self.assertRaises(ValueError, msg="an unknown schedule is a ValueError"):
            M.peak_inflight_closed_form("nope", 4, 8)


class TestOrders(unittest.TestCase):
    def test_every_op_exactly_once(self):
        assert_every_op_once(self, M.SCHEDULES)

    def test_bad_inputs(self):
        refusals = [
            (lambda: S.interleaved_order(4, 6, 2), "a multiple of stages", "m = 6 on p = 4, group p"),
            (lambda: S.interleaved_order(4, 9, 2, 4), "must be 0 or at least the stages",
             "a last group of 1 < p"),
            (lambda: S.interleaved_order(4, 8, 2, 3), "between the stages", "a group below p"),
            (lambda: S.interleaved_order(4, 8, 2, 9), "between the stages", "a group above m"),
            (lambda: S.interleaved_order(4, 2, 2), "between the stages", "m < p"),
            (lambda: M.schedule_order("nope", 2, 2), "unknown schedule", "an unknown schedule"),
            (lambda: M.schedule_order("gpipe", 0, 2), ">= 1", "0 stages"),
            (lambda: M.microbatch_count(100, 8, 2), "not a multiple", "100 over 8 x 2"),
        ]
        for make, fragment, what in refusals:
            with self.subTest(what), self.assertRaisesRegex(ValueError, fragment,
                                                            msg=f"{what}: ValueError '...{fragment}...'"):
                make()

    def test_interleaved_groups_like_megatron(self):
        """Megatron-LM's table for PP 2, VP 2 (model_parallel_config.py's examples): groups of
        2 with 4 micro-batches run 0 1 0 1 2 3 2 3 (chunks 0 0 1 1 0 0 1 1); groups of 3 with 5
        run 0 1 2 0 1 2 3 4 3 4."""
        for m, group, microbatches, chunks in ((4, 2, "0 1 0 1 2 3 2 3", "0 0 1 1 0 0 1 1"),
                                               (5, 3, "0 1 2 0 1 2 3 4 3 4", "0 0 0 1 1 1 0 0 1 1")):
            forwards = [op for op in S.interleaved_order(2, m, 2, group)[1] if op.kind == "F"]
            got = (" ".join(str(op.microbatch) for op in forwards),
                   " ".join(str(op.chunk) for op in forwards))
            self.assertEqual(got, (microbatches, chunks), f"m = {m}, group {group}: forwards' "
                             "(micro-batches, chunks)")


class TestSimulator(unittest.TestCase):
    def test_closed_forms_over_a_sweep(self):
        for p in (1, 2, 3, 4, 6, 8):
            for m in (p, 2 * p, 4 * p, 3 * p + p):
                for kind in ("gpipe", "1f1b", "zb_h1"):
                    bubble = M.simulate_schedule(kind, p, m).bubble_fraction
                    formula = M.bubble_closed_form(kind, p, m)
                    with self.subTest(kind=kind, p=p, m=m):
                        self.assertAlmostEqual(bubble, formula, places=9, msg=f"{kind}, p = {p}, m = {m}: "
                                               f"simulated {bubble:.6f}, formula {formula:.6f}")
                for v in (2, 3, 4):
                    bubble = M.simulate_schedule("interleaved", p, m, v).bubble_fraction
                    formula = M.bubble_closed_form("interleaved", p, m, v)
                    with self.subTest(kind="interleaved", p=p, m=m, v=v):
                        self.assertAlmostEqual(bubble, formula, places=9, msg=(
                            f"interleaved, p = {p}, m = {m}, v = {v}: simulated {bubble:.6f}, "
                            f"formula {formula:.6f}"))

    def test_interleaved_every_group_megatron_allows(self):
        """Any group N in [p, m] with m mod N 0 or >= p: the simulated bubble is the closed
        form, and every device's peak (2(p-d-1) + (v-1)N + 1)/v (capped at m)."""
        for p in (2, 3, 4):
            for m in range(p, 3 * p + 2):
                for group in range(p, m + 1):
                    if 0 < m % group < p:
                        continue
                    timeline = M.simulate_schedule("interleaved", p, m, 2, group)
                    formula = M.bubble_closed_form("interleaved", p, m, 2)
                    peaks = [timeline.peak_inflight(d) for d in range(p)]
                    expected = [M.peak_inflight_closed_form("interleaved", p, m, 2, d, group)
                                for d in range(p)]
                    with self.subTest(p=p, m=m, group=group):
                        self.assertAlmostEqual(timeline.bubble_fraction, formula, places=9,
                                               msg=f"p = {p}, m = {m}, N = {group}: bubble")
                        self.assertEqual(peaks, expected, f"p = {p}, m = {m}, N = {group}: peaks")

    def test_memory_closed_forms_over_a_sweep(self):
        """Every device's peak against `peak_inflight_closed_form`: GPipe m, 1F1B p-d, ZB-H1
        min(p, m), the interleaved device 0 p + (p-1)/v (m >= 2p)."""
        for p in (1, 2, 3, 4, 8):
            for m in (1, p, 2 * p, 4 * p + 1):
                for kind in ("gpipe", "1f1b", "zb_h1"):
                    timeline = M.simulate_schedule(kind, p, m)
                    got = [timeline.peak_inflight(d) for d in range(p)]
                    expected = [M.peak_inflight_closed_form(kind, p, m, 1, d) for d in range(p)]
                    with self.subTest(kind=kind, p=p, m=m):
                        self.assertEqual(got, expected, f"{kind}, p = {p}, m = {m}: devices' peaks")
                for v in (2, 3, 4):
                    if m % p:
                        continue
                    timeline = M.simulate_schedule("interleaved", p, m, v)
                    got = [timeline.peak_inflight(d) for d in range(p)]
                    expected = [M.peak_inflight_closed_form("interleaved", p, m, v, d) for d in range(p)]
                    with self.subTest(kind="interleaved", p=p, m=m, v=v):
                        self.assertEqual(got, expected, f"interleaved, p = {p}, m = {m}, v = {v}: peaks")
                        if m >= 2 * p:
                            self.assertAlmostEqual(got[0], p + (p - 1) / v, msg="device 0: p + (p-1)/v")

    def test_zb_h1_is_a_third_of_1f1b_bubble_time(self):
        p, m = 4, 8
        one_f_one_b = M.simulate(M.one_f_one_b_order(p, m), 1, 1.0, 2.0)
        zero_bubble = M.simulate(M.zb_h1_order(p, m), 1, 1.0, 1.0, 1.0)
        idle = lambda t: t.makespan * p - sum(e - s for row in t.rows for _, s, e in row)  # noqa: E731
        self.assertAlmostEqual(idle(zero_bubble) * 3, idle(one_f_one_b), msg=f"idle time: ZB-H1 "
                               f"{idle(zero_bubble)}, 1F1B {idle(one_f_one_b)}")

    def test_zb_h1_w_can_delay_a_forward(self):
        """The in-flight cap forces W before F: device 0 runs W0 at 8-9 and F4 at 9-10, though
        F4 (no input to wait for) could start at 8."""
        row = [(op.kind, op.microbatch, start, end)
               for op, start, end in M.simulate_schedule("zb_h1", 4, 8).rows[0]]
        self.assertEqual(row[4:7], [("B", 0, 7, 8), ("W", 0, 8, 9), ("F", 4, 9, 10)],
                         "device 0's fifth to seventh ops (kind, micro-batch, start, end)")

    def test_raising_the_cap_alone_is_not_zb_h2(self):
        """ZB-H2 allows 2p-1 micro-batches in flight, but with 1F1B's F/B order the extra room
        only holds W longer: more memory, the same bubble."""
        for p, m in ((2, 4), (4, 8), (4, 16), (8, 32)):
            h1 = M.simulate(M.zb_h1_order(p, m), 1, 1.0, 1.0, 1.0)
            capped = M.simulate(M.zb_h1_order(p, m, max_inflight=2 * p - 1), 1, 1.0, 1.0, 1.0)
            self.assertAlmostEqual(capped.bubble_fraction, h1.bubble_fraction, places=12,
                                   msg=f"p = {p}, m = {m}: bubble with cap 2p-1 vs p")
            self.assertEqual(capped.peak_inflight(), 2 * p - 1, f"p = {p}, m = {m}: peak with cap 2p-1")

    def test_gantt_png(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "g.png"
            C.plot_gantt(M.simulate_schedule("zb_h1", 4, 8), "zb", path)
            self.assertEqual(path.read_bytes()[:8], b"\x89PNG\r\n\x1a\n", "plot_gantt writes a PNG")


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

    def assert_plan(self, got, expected, what):
        for k, (mine, want) in enumerate(zip(got, expected)):
            self.assertEqual(mine, want, f"{what}, group {k}: (transfers, op)")
        self.assertEqual(len(got), len(expected), f"{what}: one group per op, and a last one")

    def test_two_stage_1f1b_plan_by_hand(self):
        """Each send goes out with the next op's receive; the last group has no op."""
        stage0, stage1 = self.plans("1f1b", 2, 2)
        self.assert_plan(stage0, [(transfers(""), M.Op("F", 0)),
                                  (transfers("s.a0>1"), M.Op("F", 1)),
                                  (transfers("s.a1>1 r.g0<1"), M.Op("B", 0)),
                                  (transfers("r.g1<1"), M.Op("B", 1)),
                                  (transfers(""), None)], "1F1B, p = 2, stage 0")
        self.assert_plan(stage1, [(transfers("r.a0<0"), M.Op("F", 0)),
                                  (transfers(""), M.Op("B", 0)),
                                  (transfers("s.g0>0 r.a1<0"), M.Op("F", 1)),
                                  (transfers(""), M.Op("B", 1)),
                                  (transfers("s.g1>0"), None)], "1F1B, p = 2, stage 1")
        self.assert_plan(M.p2p_plan(ops("F0 B0"), 0, 1), [([], M.Op("F", 0)), ([], M.Op("B", 0)),
                                                         ([], None)], "one stage")

    def test_middle_stage_plan_by_hand(self):
        """p = 3, m = 2 (1F1B): the middle stage receives from and sends to both neighbours."""
        middle = self.plans("1f1b", 3, 2)[1]  # its order: F0 F1 B0 B1
        self.assert_plan(middle, [(transfers("r.a0<0"), M.Op("F", 0)),
                                  (transfers("s.a0>2 r.a1<0"), M.Op("F", 1)),
                                  (transfers("s.a1>2 r.g0<2"), M.Op("B", 0)),
                                  (transfers("s.g0>0 r.g1<2"), M.Op("B", 1)),
                                  (transfers("s.g1>0"), None)], "1F1B, p = 3, m = 2, stage 1")

    def test_grouped_plans_never_deadlock_and_match_by_order(self):
        for kind in ("gpipe", "1f1b"):
            for p in (1, 2, 3, 4, 6):
                for m in (1, 2, p, 2 * p + 1):
                    with self.subTest(kind=kind, p=p, m=m):
                        problem = C.rendezvous_problem(self.plans(kind, p, m))
                        self.assertIsNone(problem, f"{kind}, p = {p}, m = {m}: {problem}")

    def test_lone_blocking_sends_deadlock_1f1b(self):
        """The same messages, each posted alone: GPipe survives, 1F1B deadlocks (stage d sends
        an activation while d+1 sends a gradient, each waiting for the other's receive)."""
        def alone(kind, p, m):
            return [[([t], op) for transfers, op in plan for t in transfers]
                    for plan in self.plans(kind, p, m)]
        problem = C.rendezvous_problem(alone("gpipe", 4, 8))
        self.assertIsNone(problem, f"GPipe, messages alone: {problem}")
        problem = C.rendezvous_problem(alone("1f1b", 4, 8)) or ""
        self.assertIn("deadlock", problem, "1F1B, messages alone: a deadlock expected")

    def test_out_of_order_backwards_are_a_mismatch(self):
        orders = W.oracle_order("1f1b", 3, 4)
        orders[1] = ([op for op in orders[1] if op.kind == "F"]
                     + [op for op in reversed(orders[1]) if op.kind == "B"])
        problem = C.rendezvous_problem(self.plans("1f1b", 3, 4, orders)) or ""
        self.assertIn("expected", problem, "backwards out of order on stage 1: a mismatch expected")


class TestDocNumbers(unittest.TestCase):
    """Every number the README quotes, recomputed (exact rational arithmetic of the simulator:
    the same on any CPU)."""

    def assert_quoted(self, text: str, quoted: str, what: str) -> None:
        self.assertIn(quoted, text, f"README should quote {what} as '{quoted}'")

    def test_worked_example(self):
        text = readme_text()
        for kind, quoted in (("gpipe", "27.3%"), ("interleaved", "15.8%"), ("zb_h1", "11.1%")):
            bubble = M.simulate_schedule(kind, 4, 8, 2).bubble_fraction
            self.assertEqual(f"{bubble:.1%}", quoted, f"{kind}'s bubble at p = 4, m = 8, v = 2")
            self.assert_quoted(text, f"**{quoted}**", f"{kind}'s bubble")
        self.assertEqual(M.simulate_schedule("interleaved", 4, 8, 2).peak_inflight(), 5.5,
                         "interleaved peak, p = 4, m = 8, v = 2")
        self.assert_quoted(text, "5.5 micro-batches", "the interleaved peak")
        zb = M.simulate_schedule("zb_h1", 4, 8)
        held = ", ".join(f"{zb.peak_inflight(d):g}" for d in range(4))
        self.assert_quoted(text, f"holding 4 on every device ({held})", "ZB-H1's peaks")
        self.assert_quoted(text, f"GPipe {M.bubble_closed_form('gpipe', 8, 32):.1%}",
                           "GPipe at p = 8, m = 32")
        self.assert_quoted(text, f"v = 4: {M.bubble_closed_form('interleaved', 8, 32, 4):.1%}",
                           "interleaved at p = 8, m = 32, v = 4")

    def test_zb_h1_delays_a_forward(self):
        row = M.simulate_schedule("zb_h1", 4, 8).rows[0]
        (b, b0, b1), (w, w0, w1), (f, f0, f1) = [(op.kind + str(op.microbatch), s, e)
                                                  for op, s, e in row[4:7]]
        self.assert_quoted(readme_text(), f"{b} runs {b0:g}-{b1:g}, {w} {w0:g}-{w1:g} and {f} {f0:g}-{f1:g}",
                           "device 0's ops around the first W")

    def test_warmup_is_a_choice(self):
        p, m = 4, 8
        forwards = [M.Op("F", i) for i in range(m)]
        backwards = [M.Op("B", i) for i in range(m)]

        def run(extra):
            return M.simulate([S.warmup_then_alternate(forwards, backwards, max(0, min(p - d - 1 + extra, m)))
                               for d in range(p)])
        fewer, more = run(-1), run(1)
        held = ", ".join(f"{more.peak_inflight(d):g}" for d in range(p))
        text = readme_text()
        self.assert_quoted(text, f"makespan grows to {fewer.makespan:g}", "one warm-up fewer")
        self.assertEqual(more.makespan, run(0).makespan, "one warm-up more keeps the makespan")
        self.assert_quoted(text, f"it stays {more.makespan:g} while every device holds one micro-batch "
                           f"more ({held})", "one warm-up more")

    def test_interleaved_group(self):
        text = readme_text()
        bubble = M.simulate_schedule("interleaved", 4, 10, 2, 5).bubble_fraction
        self.assertAlmostEqual(bubble, M.bubble_closed_form("interleaved", 4, 10, 2), places=12,
                               msg="p = 4, m = 10, v = 2, N = 5: simulated bubble vs closed form")
        peak = M.simulate_schedule("interleaved", 4, 10, 2, 5).peak_inflight()
        self.assert_quoted(text, f"the bubble is the closed form's {bubble:.1%} and the peak {peak:.1f} "
                           f"instead of {M.peak_inflight_closed_form('interleaved', 4, 10, 2):.1f}",
                           "the N = 5 example")

    def test_first_stage_memory(self):
        layers, p, v = 32, 8, 4
        one_f_one_b = M.peak_inflight_closed_form("1f1b", p, 32) * layers / p
        interleaved = M.peak_inflight_closed_form("interleaved", p, 32, v) * layers / p
        self.assertEqual(interleaved, layers * (1 + (p - 1) / (p * v)), "Megatron's interleaving penalty")
        self.assert_quoted(readme_text(), f"{one_f_one_b:g} layers' worth with 1F1B, {interleaved:g} "
                           "interleaved", "device 0's activations in layers")

    def test_gpipe_rule_of_thumb(self):
        text = readme_text()
        for p in (4, 8):
            self.assert_quoted(text, f"{M.bubble_closed_form('gpipe', p, 4 * p):.1%} at p = {p}",
                               f"GPipe at m = 4p, p = {p}")

    def test_global_batch_example(self):
        text = readme_text()
        for dp in (8, 16, 32):
            m = M.microbatch_count(512, dp, 2)
            self.assert_quoted(text, f"dp = {dp}: m = {m}, bubble {M.bubble_closed_form('1f1b', 8, m):.1%}",
                               f"the global-batch example at dp = {dp}")


@exercise("pipeline-step")
class TestPipelineStep(unittest.TestCase):
    """`pipeline_step` on 1-3 stages of the default group (m < p on 3) and on the pipeline
    group {1, 2, 3} of a 4-rank world (a middle stage, m = 5), GPipe and 1F1B (orders written
    out), against one process running the whole model. The message plans are checked first: a
    plan that would deadlock fails here at once instead of hanging the ranks until their
    deadline."""

    SIZES = {1: 3, 2: 4, 3: 2}  # stages: micro-batches (m < p on 3 stages)
    GROUP_MICROBATCHES = 5

    @classmethod
    def setUpClass(cls):
        for world, microbatches in (*cls.SIZES.items(), (3, cls.GROUP_MICROBATCHES)):
            for kind in ("gpipe", "1f1b"):
                plans = [M.p2p_plan(order, d, world)
                         for d, order in enumerate(W.oracle_order(kind, world, microbatches))]
                problem = C.rendezvous_problem(plans)
                if problem:
                    raise AssertionError(f"{kind} on {world} stages, m = {microbatches}, p2p_plan: {problem}")
        cls.results = {world: launch(W.pipeline_step, world, (m,), device="cpu", timeout_s=45)
                       for world, m in cls.SIZES.items()}
        cls.on_group = launch(W.pipeline_step_on_a_group, 4, (cls.GROUP_MICROBATCHES,), device="cpu",
                              timeout_s=45)

    def configurations(self):
        """(where, stages, m, per-stage results) for every run."""
        for world, per_rank in self.results.items():
            yield f"{world} stage(s), the default group", world, self.SIZES[world], per_rank
        self.assertIsNone(self.on_group[0], "rank 0 is outside the pipeline group {1, 2, 3}")
        yield ("the pipeline group {1, 2, 3} of 4 ranks (global rank 1 = stage 0)", 3,
               self.GROUP_MICROBATCHES, self.on_group[1:])

    def test_losses_and_gradients_equal_one_process(self):
        for where, _, m, per_rank in self.configurations():
            for kind in ("gpipe", "1f1b"):
                for stage, result in enumerate(per_rank):
                    with self.subTest(kind=kind, where=where, stage=stage):
                        for key, what in (("loss_gap", "every micro-batch's loss"),
                                          ("grad_gap", "every gradient of every stage")):
                            self.assertLessEqual(result[kind][key], C.TOLERANCE, f"{kind}, {where}, "
                                                 f"m = {m}, stage {stage}: {what}, max |ours - one "
                                                 f"process| {result[kind][key]:.3g} (inf: a size differs)")

    def test_micro_batches_held_per_stage(self):
        """GPipe holds all m micro-batches' activations; 1F1B min(p-d, m) on stage d."""
        for where, p, m, per_rank in self.configurations():
            for kind, expected in (("gpipe", [m] * p), ("1f1b", [min(p - d, m) for d in range(p)])):
                self.assertEqual(per_rank[0][kind]["held"], expected, f"{kind}, {where}, m = {m}: "
                                 "peak_held of stages 0..p-1")


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
                                                  "--chunks", "2"], "a multiple of stages")
        assert_argument_error(self, C.parse_args, ["--stages", "4", "--microbatches", "9",
                                                  "--group", "4"], "at least the stages")
        assert_argument_error(self, C.parse_args, ["--stages", "4", "--microbatches", "8",
                                                  "--group", "4", "--chunks", "1"], "--chunks 2")
        assert_argument_error(self, C.parse_args, ["--world-size", "5"], "must divide")

    def test_defaults(self):
        for argv, key, expected in ((["--world-size", "3", "--microbatches", "6"], "stages", 3),
                                    (["--world-size", "3", "--stages", "4"], "stages", 4),
                                    (["--world-size", "3"], "chunks", 1),  # 8 micro-batches, 3 stages
                                    (["--stages", "4", "--microbatches", "10", "--group", "5"], "chunks", 2)):
            got = getattr(C.parse_args(argv), key)
            self.assertEqual(got, expected, f"{' '.join(argv)}: --{key} expected {expected}, got {got}")

    def test_simulate_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "s.json"
            code = C.main(["--simulate", "--stages", "4", "--microbatches", "8", "--chunks", "2",
                           "--json", str(out), "--plots", tmp])
            data = json.loads(out.read_text())
            pngs = sorted(p.name for p in Path(tmp).glob("*.png"))
        failed = [c for c in data["checks"] if not c["passed"]]
        self.assertEqual(code, 0, f"exit code; failed checks {failed}")
        missing = [key for key in ("bubble_gpipe", "bubble_1f1b", "bubble_interleaved", "bubble_zb_h1",
                                   "peak_inflight_gpipe", "peak_inflight_1f1b") if key not in data["metrics"]]
        self.assertEqual(missing, [], "metrics missing from --json")
        self.assertAlmostEqual(data["metrics"]["bubble_gpipe"], 3 / 11, msg="GPipe's bubble, p = 4, m = 8")
        self.assertEqual(pngs, ["1f1b.png", "gpipe.png", "interleaved.png", "zb_h1.png"], "--plots files")

    def test_readme_commands_parse(self):
        commands = re.findall(r"^python lessons/05_pipeline/main\.py((?:[^#\n\\]|\\\n)*)",
                              README.read_text(), re.M)
        self.assertGreaterEqual(len(commands), 3, f"README's commands found: {commands}")
        for command in commands:
            if "--device cuda" not in command:  # needs GPUs; the CPU suite never touches one
                C.parse_args(command.replace("\\\n", " ").split())

    @torchrun_demo(["--microbatches", "4"])
    def test_under_torchrun(self, report):
        self.assertTrue(report["passed"], f"torchrun, 2 ranks: failed checks "
                        f"{[c for c in report['checks'] if not c['passed']]}")
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"), "torchrun's world size, device, backend")
        self.assertIn("our 1F1B == torch.distributed.pipelining Schedule1F1B",
                      [check["name"] for check in report["checks"]], "the torch comparison ran")


if __name__ == "__main__":
    unittest.main()
