"""The planner (planner.py): its counts against the real nd.py objects and the lessons' own
functions, the layouts against what nd.py accepts, the ranking against its stated cost, the
CLI, and its memory prediction against the bytes lesson 07's MemoryTracker measures on the
layouts the CPU can run (float64, gloo: the suite never touches a GPU)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import io
import unittest
from unittest import mock

import torch

from lessons._testing import assert_argument_error

P = importlib.import_module("lessons.13_capstone.planner")
PC = importlib.import_module("lessons.13_capstone.planner_checks")  # the CLI hook, the measured check
nd = importlib.import_module("lessons.13_capstone.nd")
nd_model = importlib.import_module("lessons.13_capstone.nd_model")
zero = importlib.import_module("lessons.03_zero.main")
tensor_parallel = importlib.import_module("lessons.04_tensor_parallel.main")
pipeline = importlib.import_module("lessons.05_pipeline.main")
memory = importlib.import_module("lessons.07_memory.main")
context_parallel = importlib.import_module("lessons.11_context_parallel.main")

TINY = P.Model.of(nd_model.GPTConfig())
H100 = P.Cluster(gpus=64, gpus_per_node=8, memory_bytes=80e9, intra_bandwidth=450e9,
                 inter_bandwidth=50e9, peak_flops=989e12)


def config_of(model: P.Model, **run) -> nd_model.GPTConfig:
    return nd_model.GPTConfig(vocab=model.vocab, hidden=model.hidden, heads=model.heads,
                        layers=model.layers, seq=model.seq, **run)


@functools.cache
def gpt_of(model: P.Model) -> nd_model.GPT:
    return nd_model.build_gpt(config_of(model))


def real_stage(model: P.Model, layout: nd.Layout, coords: dict) -> nd.Stage:
    """nd.py's own Stage for `coords`, built without process groups (lesson 04's
    TensorParallelGroup with no group only records the rank; nothing communicates here)."""
    tp = tensor_parallel.TensorParallelGroup(coords["tp"], layout.tp)
    return nd.Stage(gpt_of(model), layout, coords, tp, None)


@functools.cache
def stage_builds(model: P.Model, tp: int, pp: int, cp: int, stage: int) -> bool:
    """Whether nd.Stage builds pipeline stage `stage` of a tp x pp x cp layout. Its checks
    (layers % pp, heads and widths % tp, the positions) depend on the sizes, not on the tp or
    cp rank (each rank's positions are checked by nd_accepts), nor on dp."""
    try:
        real_stage(model, nd.Layout(tp=tp, pp=pp, cp=cp), {"pp": stage, "dp": 0, "cp": 0, "tp": 0})
    except ValueError:
        return False
    return True


def nd_accepts(model: P.Model, run: P.Run, layout: nd.Layout) -> bool:
    """Whether nd.py builds every rank of `layout` and hands each dp replica its even share of
    the batch in micro-batches of run.micro_batch sequences (the oracle for enumerate_layouts)."""
    m = run.global_batch // (layout.dp * run.micro_batch)
    if m == 0:
        return False
    windows = torch.zeros(run.global_batch, model.seq + 1, dtype=torch.long)
    try:
        for rank in range(layout.world):
            coords = layout.coordinates(rank)
            positions = nd.local_positions(model.seq, layout, coords["cp"], coords["tp"])
            if not stage_builds(model, layout.tp, layout.pp, layout.cp, coords["pp"]):
                return False
            micro = nd.rank_batch(windows, layout, coords, m, positions)
            if len(micro) != m or any(x.shape[0] != run.micro_batch for x, _ in micro):
                return False
    except (ValueError, IndexError):  # IndexError: windows.chunk(dp) gave fewer than dp rows
        return False
    return True


class TestModel(unittest.TestCase):
    def test_parameter_count_equals_nd_gpt(self):
        Config = nd_model.GPTConfig
        for config in (Config(), Config(vocab=50, hidden=24, heads=3, layers=2, seq=12),
                       Config(vocab=7, hidden=16, heads=1, layers=1, seq=5)):
            gpt = nd_model.build_gpt(config)
            model = P.Model.of(config)
            self.assertEqual(model.parameters(), sum(p.numel() for p in gpt.parameters()), config)
            tied = memory.gpt_param_count(config.layers, config.hidden, config.vocab, config.seq)
            self.assertEqual(model.parameters() - tied, config.vocab * config.hidden)  # untied head

    def test_stage_parameters_equal_nd_stage(self):
        model = P.Model(layers=4, hidden=32, heads=4, vocab=40, seq=16)
        for layout in (nd.Layout(), nd.Layout(tp=2), nd.Layout(tp=4, pp=2), nd.Layout(pp=4, cp=2),
                       nd.Layout(dp=2, tp=2, pp=2)):
            for stage in range(layout.pp):
                real = list(real_stage(model, layout, {"pp": stage, "dp": 0, "cp": 0, "tp": 0}).parameters())
                self.assertEqual(P.stage_parameters(model, layout, stage),
                                 (sum(p.numel() for p in real), len(real)), (layout, stage))

    def test_the_worked_example_model(self):
        model = P.MODELS["llama3-8b-class"]
        h, v = 4096, 128256
        self.assertEqual(model.parameters(), 32 * (12 * h * h + 13 * h) + 2 * v * h + 8192 * h + 2 * h)
        self.assertEqual(round(model.parameters() / 1e9, 2), 7.53)

    def test_bad_models_are_refused(self):
        with self.assertRaisesRegex(ValueError, "hidden 30 is not divisible by heads 4"):
            P.Model(layers=1, hidden=30, heads=4, vocab=8, seq=8)
        with self.assertRaisesRegex(ValueError, "layers must be a positive integer"):
            P.Model(layers=0, hidden=32, heads=4, vocab=8, seq=8)


class TestLayouts(unittest.TestCase):
    CASES = [  # (model, gpus, gpus per node, global batch, micro-batch)
        (TINY, 8, 4, 8, 1),
        (TINY, 8, 8, 8, 2),
        (P.Model(layers=6, hidden=24, heads=6, vocab=20, seq=12), 6, 6, 6, 1),
        (P.Model(layers=4, hidden=32, heads=4, vocab=32, seq=20), 8, 8, 6, 1),
    ]

    def test_enumeration_is_what_nd_accepts_inside_a_node(self):
        refused = {"nd": 0, "node": 0}
        for model, gpus, per_node, batch, micro in self.CASES:
            cluster = dataclasses.replace(H100, gpus=gpus, gpus_per_node=per_node)
            run = P.Run(global_batch=batch, micro_batch=micro)
            listed = set(P.enumerate_layouts(model, cluster, run))
            for layout in P.all_layouts(gpus):
                in_node = per_node % (layout.tp * layout.cp) == 0
                accepted = nd_accepts(model, run, layout)
                self.assertEqual(layout in listed, accepted and in_node, (model, layout))
                refused["nd"] += not accepted
                refused["node"] += accepted and not in_node
        self.assertGreater(refused["nd"], 10)  # the oracle refuses for real
        self.assertGreater(refused["node"], 0)

    def test_every_layout_multiplies_to_the_gpus(self):
        layouts = P.all_layouts(12)  # 12 = 2^2 x 3: C(2+3, 3) x C(1+3, 3) = 40 ordered 4-factorizations
        self.assertEqual(len(set(layouts)), len(layouts))
        self.assertEqual(len(layouts), 40)
        self.assertTrue(all(layout.world == 12 for layout in layouts))
        self.assertIn(nd.Layout(dp=3, tp=2, pp=2), layouts)

    def test_each_refusal_names_its_constraint(self):
        cluster = dataclasses.replace(H100, gpus=8, gpus_per_node=4)
        run = P.Run(global_batch=8)
        model = P.Model(layers=6, hidden=24, heads=6, vocab=8, seq=12)
        for layout, words in [(nd.Layout(tp=4, dp=2), "heads do not split over tp = 4"),
                              (nd.Layout(pp=4, dp=2), "6 layers do not split over pp = 4"),
                              (nd.Layout(cp=4, dp=2), "seq 12 is not divisible by 2 cp = 8"),
                              (nd.Layout(cp=4, tp=2), "seq 12 is not divisible by 2 cp = 8"),
                              (nd.Layout(cp=2, tp=4), "6 heads do not split over tp = 4"),
                              (nd.Layout(dp=8), None)]:
            reason = P.why_refused(model, cluster, run, layout)
            self.assertEqual(reason is None, words is None, layout)
            if words:
                self.assertIn(words, reason)
        self.assertIn("seq / cp = 6 positions do not split over tp = 4", P.why_refused(
            dataclasses.replace(TINY, seq=12), cluster, run, nd.Layout(cp=2, tp=4)))
        self.assertIn("does not divide a node's 4 GPUs",
                      P.why_refused(TINY, cluster, P.Run(global_batch=8), nd.Layout(tp=2, cp=4)))
        self.assertIn("global batch 6 is not a multiple of dp 4",
                      P.why_refused(TINY, cluster, P.Run(global_batch=6), nd.Layout(dp=4, pp=2)))

    def test_links(self):
        eight = dataclasses.replace(H100, gpus=16, gpus_per_node=8)
        layout = nd.Layout(dp=2, tp=2, pp=2, cp=2)
        self.assertEqual([P.link_of(eight, layout, dim) for dim in ("tp", "cp", "dp", "pp")],
                         ["nvlink", "nvlink", "nvlink", "network"])
        self.assertEqual(P.link_of(eight, nd.Layout(dp=4, tp=4), "dp"), "network")
        for gpus, node in ((16, 8), (16, 4), (12, 6), (12, 4), (24, 6), (8, 3)):
            cluster = dataclasses.replace(H100, gpus=gpus, gpus_per_node=node) if gpus % node == 0 \
                else dataclasses.replace(H100, gpus=gpus, gpus_per_node=gpus)
            for layout in P.all_layouts(gpus):
                for dim in nd.DIMS:
                    groups = nd.dimension_groups(layout, dim)
                    inside = all(len({r // cluster.gpus_per_node for r in g}) == 1 for g in groups)
                    self.assertEqual(P.link_of(cluster, layout, dim), "nvlink" if inside else "network",
                                     (cluster.gpus_per_node, layout, dim))


class TestFormulas(unittest.TestCase):
    def test_block_activations_are_lesson_11s_count_plus_norm_statistics_and_lse(self):
        """At tp = 1 in 16-bit, nd's block keeps lesson 11's 34 (s/cp) b h bytes (Korthikanti's
        count without the softmax, which counts two 1-byte dropout masks where nd keeps the
        ring's second copy of the attention output) plus what that count leaves out: the
        LayerNorm statistics (4 (s/cp) b values) and the ring's log-sum-exp (a b (s/cp))."""
        model = P.Model(layers=2, hidden=64, heads=8, vocab=16, seq=32)
        for cp in (1, 2, 4):
            for b in (1, 3):
                ours = P.block_activation_bytes(model, nd.Layout(cp=cp), P.Run(global_batch=8, micro_batch=b))
                s = 32 // cp
                lesson11 = context_parallel.activation_bytes_per_rank(32, 64, 8, cp, b, flash=True)
                self.assertEqual(ours, lesson11 + 2 * (4 * s * b + 8 * b * s), (cp, b))

    def test_memory_uses_zero1_and_1f1b(self):
        model, run = P.Model(layers=8, hidden=32, heads=4, vocab=16, seq=16), P.Run(global_batch=12)
        for layout in (nd.Layout(pp=4), nd.Layout(dp=2, pp=4), nd.Layout(dp=3, pp=2, tp=2), nd.Layout(dp=4)):
            m = P.microbatches(run, layout)
            timeline = pipeline.simulate_schedule("1f1b", layout.pp, m)
            for mem in P.memory_per_stage(model, layout, run):
                self.assertEqual(mem.inflight, timeline.peak_inflight(mem.stage), (layout, mem.stage))
                psi, tensors = P.stage_parameters(model, layout, mem.stage)
                zero1 = zero.zero_bytes_per_device("zero1", psi, layout.dp)
                self.assertEqual(mem.states, zero1 + 4 * tensors)
                self.assertEqual(mem.peak, mem.states + mem.inflight * P.stage_activation_bytes(
                    model, layout, run, mem.stage))

    def test_communication(self):
        model = P.Model(layers=4, hidden=32, heads=4, vocab=40, seq=16)
        run = P.Run(global_batch=8)
        for layout in (nd.Layout(dp=2, tp=2, pp=2), nd.Layout(dp=4, pp=2), nd.Layout(cp=2, pp=4),
                       nd.Layout(dp=2, cp=2, tp=2)):
            cluster = dataclasses.replace(H100, gpus=8, gpus_per_node=4)
            m, blocks = P.microbatches(run, layout), model.layers // layout.pp
            for stage in range(layout.pp):
                traffic = P.communication(model, cluster, layout, run, stage)
                stage_module = real_stage(model, layout, {"pp": stage, "dp": 0, "cp": 0, "tp": 0})
                numels = [p.numel() for p in stage_module.parameters()]
                # dp: lesson 03's exact ring bytes, parameter by parameter (dp divides them all)
                self.assertEqual(traffic["dp"].bytes, zero.expected_bytes_sent(1, numels, 2, layout.dp, 0))
                # pp: an activation forward unless last, a gradient back unless first, per micro-batch
                ends = (stage > 0) + (stage < layout.pp - 1)
                n = model.seq // (layout.cp * layout.tp)
                self.assertEqual(traffic["pp"].bytes, ends * m * n * run.micro_batch * model.hidden * 2)
                # cp: the ring's (6 cp - 4) shard bytes per block and micro-batch, + the gradient all-reduce
                head_dim = model.hidden // model.heads
                shard = model.heads // layout.tp * (model.seq // layout.cp) * head_dim * 2
                ring = (6 * layout.cp - 4) * shard * run.micro_batch * blocks * m if layout.cp > 1 else 0
                grads = 2 * (layout.cp - 1) / layout.cp * sum(numels) * 2
                self.assertAlmostEqual(traffic["cp"].bytes, ring + grads, delta=1e-6)
                # tp: lesson 04's per-block bytes, + the replicated tables' gradient all-reduce
                replicated = sum(p.numel() for p, place in stage_module.placements
                                 if place.dim is None and not place.name.startswith("blocks."))
                per_block = tensor_parallel.tp_bytes_per_block(16 // layout.cp, 1, 32, layout.tp, 2, True)
                self.assertAlmostEqual(traffic["tp"].bytes, m * blocks * per_block
                                       + 2 * (layout.tp - 1) / layout.tp * replicated * 2, delta=1e-6)

    def test_bubble_is_lesson_05s(self):
        run = P.Run(global_batch=16)
        cluster = dataclasses.replace(H100, gpus=8, gpus_per_node=8)
        for c in P.evaluate(TINY, cluster, run):
            simulated = pipeline.simulate_schedule("1f1b", c.layout.pp, c.microbatches).bubble_fraction
            self.assertAlmostEqual(c.bubble, simulated, places=12)

    def test_precisions_are_lesson_07s_bytes_per_parameter(self):
        for precision, recipe, factor in (("bf16-mixed", "mixed_adam", 1), ("fp32", "fp32_adam", 1),
                                          ("fp64", "fp32_adam", 2)):
            weights, grads, optimizer, _ = P.PRECISIONS[precision]
            self.assertEqual(weights + grads + optimizer, factor * memory.model_state_bytes_per_param(recipe))


class TestRanking(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model, cls.batch = P.MODELS["llama3-8b-class"], P.Run(global_batch=512)
        cls.candidates = P.evaluate(cls.model, H100, cls.batch)

    def test_ranked_by_the_stated_cost(self):
        compute = 6 * self.model.parameters() * 512 * 8192 / (64 * 989e12 * 0.4)
        steps = [c.step_s for c in self.candidates]
        self.assertEqual(steps, sorted(steps))
        for c in self.candidates:
            self.assertAlmostEqual(c.compute_s, compute)
            seconds = 0.0
            for t in c.traffic.values():
                seconds += t.bytes / (450e9 if t.link == "nvlink" else 50e9)
            self.assertAlmostEqual(c.step_s, compute / (1 - c.bubble) + seconds, places=9)
        planned = P.plan(self.model, H100, self.batch)
        self.assertEqual(planned, [c for c in self.candidates if c.fits])
        self.assertTrue(all(c.memory.peak <= 0.9 * 80e9 for c in planned))
        self.assertTrue(any(not c.fits for c in P.evaluate(self.model, H100, P.Run(512, headroom=0.15))))

    def test_the_worked_example(self):
        """The README's numbers: the top three for Llama-3-8B-class on 64 H100s, dp64 first by a
        small margin and only while its 70.3 GB fits; with 15% headroom dp32 x tp2 leads."""
        top = [P.layout_name(c.layout) for c in P.plan(self.model, H100, self.batch)[:3]]
        self.assertEqual(top, ["dp64", "dp32xtp2", "dp16xtp2xpp2"])
        first = P.plan(self.model, H100, self.batch)[0]
        self.assertAlmostEqual(first.memory.peak / 1e9, 70.3, places=1)
        tighter = P.plan(self.model, H100, P.Run(512, headroom=0.15))
        self.assertEqual(P.layout_name(tighter[0].layout), "dp32xtp2")

    def test_the_worked_examples_simplifications(self):
        """The README's 'simplified' notes: N without the two tables, attention's share, and
        nd.py's own fp32-weights recipe, under which dp64's states alone pass 61 GB."""
        m, tokens = self.model, 512 * 8192
        n = m.parameters()
        self.assertAlmostEqual(n / 1e9, 7.53, places=2)
        matmul = n - m.vocab * m.hidden - m.seq * m.hidden
        self.assertAlmostEqual(matmul / 1e9, 6.97, places=2)
        self.assertAlmostEqual(6 * n * tokens / (64 * 989e12 * 0.4), 7.48, places=2)
        self.assertAlmostEqual(6 * matmul * tokens / (64 * 989e12 * 0.4), 6.93, places=2)
        attention = 12 * m.layers * m.heads * (m.hidden // m.heads) * m.seq  # PaLM's 12 L H Q T
        self.assertEqual(round(100 * attention / (6 * n)), 29)
        fp32_states = (4 + 4) * n + 8 * n / 64  # whole fp32 weights and grads, AdamW's 8 B sharded
        self.assertEqual(int(fp32_states / 1e9), 61)
        self.assertGreater(fp32_states, 0.9 * H100.memory_bytes * 0.8)  # with activations: no fit

    def test_a_slow_network_favours_layouts_that_keep_traffic_in_the_node(self):
        slow = dataclasses.replace(H100, inter_bandwidth=1e8)
        ranked = P.plan(self.model, slow, self.batch)
        network = [sum(t.bytes for t in c.traffic.values() if t.link == "network") for c in ranked]
        self.assertEqual(network[0], min(network))
        by_layout = {c.layout: c.step_s for c in self.candidates}
        for c in P.evaluate(self.model, slow, self.batch):
            crosses = any(t.link == "network" and t.bytes for t in c.traffic.values())
            self.assertEqual(c.step_s > by_layout[c.layout], crosses, c.layout)

    def test_an_impossible_budget_gives_an_empty_plan_and_the_reason(self):
        small = dataclasses.replace(H100, memory_bytes=12e9)  # ZeRO over dp x cp: cp layouts fit 14.4 GB
        self.assertEqual(P.plan(self.model, small, self.batch), [])
        reason = P.why_empty(self.model, small, self.batch)
        self.assertRegex(reason, r"no layout fits in 10\.8 GB per GPU .* smallest predicted peak is "
                                 r"\d+\.\d GB")
        self.assertIn(reason, P.format_plan(self.model, small, self.batch))
        prime = dataclasses.replace(H100, gpus=7, gpus_per_node=7)
        self.assertEqual(P.plan(self.model, prime, self.batch), [])
        self.assertIn("no layout of 7 GPUs can be built: 32 heads do not split over tp = 7",
                      P.why_empty(self.model, prime, self.batch))
        self.assertEqual(P.why_empty(self.model, H100, self.batch), "")


class TestCli(unittest.TestCase):
    def parse(self, *argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        PC.add_plan_arguments(parser)
        return parser.parse_args(["--plan", *argv])

    def test_defaults_print_the_worked_example(self):
        text = PC.plan_from_args(self.parse("--plan-top", "3"))
        self.assertIn("7.53 B parameters", text)
        self.assertRegex(text, r"\n\s+1  dp64 ")
        self.assertEqual(len([line for line in text.splitlines() if line[:3].strip().isdigit()]), 3)

    def test_overrides(self):
        model, cluster, run = PC.plan_inputs(self.parse(
            "--plan-model", "tiny", "--plan-layers", "8", "--plan-gpus", "16", "--plan-gpu-memory", "24",
            "--plan-precision", "fp32", "--plan-batch", "32", "--plan-seq", "64"))
        self.assertEqual((model.layers, model.hidden, model.seq), (8, 32, 64))
        self.assertEqual((cluster.gpus, cluster.memory_bytes, run.param_bytes, run.global_batch),
                         (16, 24e9, 4, 32))

    def test_bad_values(self):
        with self.assertRaisesRegex(ValueError, "hidden 4096 is not divisible by heads 7"):
            PC.plan_from_args(self.parse("--plan-heads", "7"))
        with self.assertRaisesRegex(ValueError, "12 GPUs do not fill whole nodes of 8"):
            PC.plan_from_args(self.parse("--plan-gpus", "12"))
        for argv in (["--plan-gpus", "0"], ["--plan-mfu", "1.5"], ["--plan-precision", "fp8"]):
            with self.assertRaises(SystemExit) as exit_, mock.patch("sys.stderr"):
                self.parse(*argv)
            self.assertEqual(exit_.exception.code, 2)

    def test_the_capstone_cli_prints_the_plan_and_refuses_bad_values(self):
        checks = importlib.import_module("lessons.13_capstone.checks")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(checks.main(["--plan", "--plan-top", "2"]), 0)
        self.assertRegex(out.getvalue(), r"\n\s+1  dp64 ")
        assert_argument_error(self, checks.parse_args, ["--plan", "--plan-heads", "7"],
                              "hidden 4096 is not divisible by heads 7")


class TestMeasuredCheck(unittest.TestCase):
    """The prediction at 8 bytes per element against lesson 07's MemoryTracker on each rank of
    the CPU layouts (nd's default tiny run: 4 layers, hidden 32, batch 8 in 2 micro-batches)."""

    # each dimension at least once (the README's table has seven layouts: planner_checks' main)
    LAYOUTS = [nd.Layout(dp=2), nd.Layout(cp=2), nd.Layout(tp=2, pp=2)]

    @classmethod
    def setUpClass(cls):
        cls.rows = PC.check_layouts(cls.LAYOUTS)

    def test_every_rank_was_measured(self):
        self.assertEqual(len(self.rows), sum(layout.world for layout in self.LAYOUTS))

    def test_model_states_match_exactly(self):
        """Parameters + full gradients + AdamW's moments on the dp shard (+ step counters)."""
        for row in self.rows:
            self.assertEqual(row["measured"]["states"], row["predicted"]["states"], row["layout"])
        dp2 = next(r for r in self.rows if r["layout"] == nd.Layout(dp=2))
        run, model = PC.check_run(nd_model.GPTConfig(), nd.Layout(dp=2)), TINY
        not_sharded = P.model_state_bytes(model, nd.Layout(), run, 0)  # planted: ZeRO forgotten
        self.assertNotEqual(dp2["measured"]["states"], not_sharded)

    def test_activations_per_micro_batch_match_exactly(self):
        for row in self.rows:
            self.assertEqual(row["measured"]["activation"], row["predicted"]["activation"], row["layout"])
        row = self.rows[0]  # planted: lesson 04's count as is (softmax and mask, no ring terms)
        run = PC.check_run(nd_model.GPTConfig(), row["layout"])
        as_is = tensor_parallel.saved_activation_bytes(16, run.micro_batch, 32, 4, 1, 8, True)
        self.assertNotEqual(P.block_activation_bytes(TINY, row["layout"], run), as_is)

    def test_peak_within_its_bracket(self):
        """The peak is not predicted exactly: backward's working set (the gradients of the
        activations of the micro-batch being processed, made while its saved tensors are
        still alive) comes on top, and bounded by that micro-batch's activations; on a
        pipeline's first stage the peak comes in the first backward, before every gradient
        exists, so it may fall short by at most the gradient bytes."""
        for row in self.rows:
            p, m = row["predicted"], row["measured"]["peak"]
            self.assertLessEqual(p["peak"] - p["gradients"], m, row["layout"])
            self.assertLessEqual(m, p["peak"] + p["activation"], row["layout"])


if __name__ == "__main__":
    unittest.main()
