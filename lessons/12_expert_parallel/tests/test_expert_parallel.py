"""Lesson 12's suite: each exercise alone (the router and its losses against a hand
computation; capacity and the drop order against a hand-worked example; the expert-parallel
layer on 1, 2 and 4 ranks with the router and capacity replaced by oracles; bytes per rank from
a routing matrix); then the lesson as a whole (untagged: integration): nothing replaced, the
layer against a per-token loop, the demo, the docs' numbers, the CLI and torchrun."""

from __future__ import annotations

import functools
import importlib
import math
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, exercise, rank_configurations, run_under_torchrun

M = importlib.import_module("lessons.12_expert_parallel.main")
C = importlib.import_module("lessons.12_expert_parallel.checks")
W = importlib.import_module("lessons.12_expert_parallel.tests.workers")
B = importlib.import_module("lessons.12_expert_parallel.bench")
README = Path(M.__file__).with_name("README.md")
WORLDS = (1, 2, 4)
TOKENS, HIDDEN, FFN, EXPERTS = 12, 6, 8, 4


@functools.cache
def rank_results() -> dict:
    """One launch per world size (every configuration inside), shared by the classes."""
    return {world: launch(W.ep_worker, world, (TOKENS, HIDDEN, FFN, EXPERTS), device="cpu", timeout_s=60)
            for world in WORLDS}


def readme_text() -> str:
    return " ".join(README.read_text().split())


class RankCase(unittest.TestCase):
    def configs(self, prefix: str):
        """(where, world, rank, key, value, per_rank) for every configuration starting with prefix."""
        return rank_configurations(rank_results(), prefix, "ep")


# ============================================================================ router


@exercise("router")
class TestRouter(unittest.TestCase):
    def hand_routing(self, top_k=1):
        """4 tokens, 2 experts, logits (ln 3, 0) x3 and (0, ln 3): probs 3/4 and 1/4."""
        logits = torch.tensor([[math.log(3), 0.0], [0.0, math.log(3)], [math.log(3), 0.0],
                               [math.log(3), 0.0]], dtype=torch.float64)
        return M.route(logits, torch.eye(2, dtype=torch.float64), top_k)

    def test_top_k_and_gates(self):
        routing = self.hand_routing()
        self.assertEqual(routing.experts[:, 0].tolist(), [0, 1, 0, 0])
        self.assertTrue(torch.allclose(routing.gates[:, 0], torch.full((4,), 0.75, dtype=torch.float64)))
        top2 = self.hand_routing(2)
        self.assertEqual(top2.experts.tolist(), [[0, 1], [1, 0], [0, 1], [0, 1]])
        self.assertTrue(torch.allclose(top2.gates.sum(1), torch.ones(4, dtype=torch.float64)))

    def test_top_k_of_random_logits(self):
        x = torch.randn(20, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        w = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        routing = M.route(x, w, 3)
        probs = torch.softmax(x @ w, -1)
        self.assertTrue(torch.allclose(routing.probs, probs))
        order = probs.argsort(dim=1, descending=True)[:, :3]
        self.assertEqual(routing.experts.tolist(), order.tolist())
        self.assertTrue(torch.allclose(routing.gates, probs.gather(1, order)))

    def test_load_balancing_loss_by_hand(self):
        """f = (3/4, 1/4), P = (0.625, 0.375): 2 (3/4 x 0.625 + 1/4 x 0.375) = 1.125."""
        self.assertAlmostEqual(M.load_balancing_loss(self.hand_routing(), 2).item(), 1.125, places=12)
        # top-2 of 2 experts: every expert chosen by every token, f = 1/2: 2 x (0.5 x 1) = 1
        self.assertAlmostEqual(M.load_balancing_loss(self.hand_routing(2), 2).item(), 1.0, places=12)

    def test_load_balancing_gradient_flows_through_p_only(self):
        logits = torch.zeros(4, 2, dtype=torch.float64, requires_grad=True)
        logits.data[:, 0] = torch.tensor([1.0, 2.0, -1.0, 0.5])
        routing = M.route(logits, torch.eye(2, dtype=torch.float64), 1)
        M.load_balancing_loss(routing, 2).backward()
        f = torch.tensor([3 / 4, 1 / 4], dtype=torch.float64)  # experts 0, 0, 1, 0
        probs = torch.softmax(logits.detach(), -1).requires_grad_()
        (2 * (f * probs.mean(0)).sum()).backward()
        expected = (probs.grad[:, None, :] @ torch.func.jacrev(lambda z: torch.softmax(z, -1))(
            logits.detach()).diagonal(dim1=0, dim2=2).permute(2, 0, 1)).squeeze(1)
        self.assertTrue(torch.allclose(logits.grad, expected))

    def test_z_loss_by_hand(self):
        """Every row's log-sum-exp is ln(3 + 1) = ln 4: z = (ln 4)^2."""
        self.assertAlmostEqual(M.router_z_loss(self.hand_routing()).item(), math.log(4) ** 2, places=12)


# ============================================================================ capacity


@exercise("capacity")
class TestCapacity(unittest.TestCase):
    def test_capacity(self):
        self.assertEqual(M.expert_capacity(32, 8, 2, 1.25), 10)
        self.assertEqual(M.expert_capacity(10, 4, 1, 1.0), 3)
        self.assertEqual(M.expert_capacity(8, 2, 2, math.inf), 8)
        self.assertEqual(M.expert_capacity(8, 2, 2, 0.0), 8)
        self.assertEqual(M.expert_capacity(4, 2, 2, 10.0), 4)

    def test_drop_order_by_hand(self):
        """Capacity 2. First choices in token order: t0, t1 -> e0 kept, t2 -> e0 dropped, t3 ->
        e1 kept; then second choices: t0 -> e1 kept, t1 -> e2 kept, t2 -> e1 dropped (e1 has t3
        and t0), t3 -> e0 dropped. Token-major order would have kept t2's second choice."""
        experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
        self.assertEqual(M.keep_mask(experts, 3, 2).tolist(),
                         [[True, True], [True, True], [False, False], [True, False]])

    def test_against_a_loop_and_conservation(self):
        g = torch.Generator().manual_seed(2)
        for top_k, experts, capacity in ((1, 4, 3), (2, 4, 5), (2, 8, 1), (3, 5, 4)):
            choice = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(30)])
            keep = M.keep_mask(choice, experts, capacity)
            with self.subTest(top_k=top_k, experts=experts, capacity=capacity):
                self.assertEqual(keep.tolist(), W.oracle_keep(choice, experts, capacity).tolist())
                per_expert = torch.bincount(choice[keep], minlength=experts)
                self.assertLessEqual(per_expert.max().item(), capacity)
                self.assertTrue(M.keep_mask(choice, experts, 30).all())


# ============================================================================ dispatch-combine


@exercise("dispatch-combine")
class TestExpertParallel(RankCase):
    def test_equals_one_process_for_every_ep_k_and_capacity(self):
        """Outputs and losses, dX, the router's and every expert's gradients, float64."""
        for where, _, _, _, value, _ in self.configs("ep/"):
            with self.subTest(where=where):
                self.assertNotIn("error", value, value.get("error"))
                for key in ("out", "x_grad", "router_grad", "expert_grads"):
                    self.assertLessEqual(value[key], C.TOLERANCE, key)

    def test_rows_sent_and_received_follow_the_routing(self):
        for where, _, rank, _, value, _ in self.configs("ep/"):
            with self.subTest(where=where):
                self.assertNotIn("error", value, value.get("error"))
                rows = value["rows"]
                self.assertEqual(value["send_counts"], rows[rank])
                self.assertEqual(value["recv_counts"], [row[rank] for row in rows])

    def test_tokens_conserved(self):
        """routed = kept + dropped on every rank; what all ranks receive = what they kept;
        nothing dropped without a capacity limit."""
        for where, _, rank, key, value, per_rank in self.configs("ep/"):
            with self.subTest(where=where):
                self.assertNotIn("error", value, value.get("error"))
                top_k, factor = int(key.split("/")[1]), float(key.split("/")[2])
                self.assertEqual(TOKENS * top_k, value["kept"] + value["dropped"])
                self.assertEqual(sum(value["expert_rows"]), sum(value["recv_counts"]))
                if factor == 0.0:
                    self.assertEqual(value["dropped"], 0)
                if rank == 0:
                    self.assertEqual(sum(sum(r["recv_counts"]) for r in (p[key] for p in per_rank)),
                                     sum(p[key]["kept"] for p in per_rank))

    def test_skewed_router_leaves_ranks_empty(self):
        """Everything to rank 0's experts: the other ranks receive nothing and still answer."""
        for where, world, rank, key, value, _ in self.configs("ep/"):
            if world > 1 and rank > 0 and key.endswith("/20.0/p2p") and "/0.0/" in key and "/1/" in key:
                with self.subTest(where=where):
                    self.assertEqual(sum(value["recv_counts"]), 0)

    def test_bytes_counted(self):
        """Lesson 01's all-to-all counts: the per-expert counts (E/ep int64 to each other rank),
        then every row to another rank, there and back, forward; the same rows backward."""
        for where, world, rank, key, value, _ in self.configs("ep/"):
            if key.endswith("/p2p"):
                with self.subTest(where=where):
                    self.assertNotIn("error", value, value.get("error"))
                    rows = value["rows"]
                    remote = (sum(rows[rank]) - rows[rank][rank]
                              + sum(r[rank] for r in rows) - rows[rank][rank]) * HIDDEN * 8
                    counts = 8 * EXPERTS // world * (world - 1)
                    self.assertEqual(value["bytes"], {"forward": remote + counts, "backward": remote})


# ============================================================================ ep-bytes


@exercise("ep-bytes")
class TestBytes(unittest.TestCase):
    def test_by_hand(self):
        rows = [[3, 1, 0], [2, 0, 4], [0, 0, 5]]
        # rank 1 sends 2 + 4 rows, returns 1 (from rank 0): 7 x 4 x 8 = 224; counts 8 x 2 x 2
        self.assertEqual(M.ep_bytes_per_rank(rows, 1, 4, 8, 2), (256, 224))
        self.assertEqual(M.ep_bytes_per_rank(rows, 2, 4, 8, 2), ((0 + 4) * 32 + 32, 4 * 32))
        self.assertEqual(M.ep_bytes_per_rank([[5]], 0, 4, 8, 2), (0, 0))

    def test_dispatch_counts(self):
        experts = torch.tensor([[0, 3], [1, 2]])
        keep = torch.tensor([[True, False], [True, True]])
        self.assertEqual(M.dispatch_counts(experts, keep, 4, 2), [2, 1])
        self.assertEqual(M.dispatch_counts(experts, keep, 4, 4), [1, 1, 1, 0])

    def test_balanced_routing(self):
        """Uniform rows: (ep - 1)/ep of T k rows each way, per direction."""
        ep, per_pair = 4, 6
        rows = [[per_pair] * ep for _ in range(ep)]
        forward, backward = M.ep_bytes_per_rank(rows, 0, 16, 2, 2)
        self.assertEqual(backward, M.balanced_all_to_all_bytes(ep * per_pair, 16, 1, ep, 2))
        self.assertEqual(forward - backward, 8 * 2 * 3)


# ============================================================================ integration


class TestWhole(RankCase):
    def test_unpatched_layer_equals_one_process(self):
        for where, _, _, _, value, _ in self.configs("whole"):
            with self.subTest(where=where):
                self.assertNotIn("error", value, value.get("error"))
                for key in ("out", "x_grad", "router_grad", "expert_grads"):
                    self.assertLessEqual(value[key], C.TOLERANCE, key)

    def test_moe_layer_equals_a_token_loop(self):
        """The one-process layer against its definition, token by token."""
        inputs = C.make_inputs(0, 1, 16, 6, 8, 4, "cpu")
        for top_k, factor in ((1, 1.0), (2, 1.0), (2, 0.0)):
            result = M.moe_layer(inputs["x"][0], inputs["router"], inputs["w_in"], inputs["w_out"],
                                 top_k, factor)
            expected = torch.zeros_like(inputs["x"][0])
            for t in range(16):
                for c in range(top_k):
                    if result.keep[t, c]:
                        e = int(result.routing.experts[t, c])
                        expected[t] += result.routing.gates[t, c] * M.expert_mlp(
                            inputs["x"][0][t:t + 1], inputs["w_in"][e], inputs["w_out"][e])[0]
            with self.subTest(top_k=top_k, factor=factor):
                self.assertLessEqual((result.out - expected).abs().max().item(), C.TOLERANCE)

    def test_grouped_matmul_equals_the_loop(self):
        """bench.py's padded, batched form gives the loop's output (float64), drops included."""
        inputs = C.make_inputs(1, 1, 24, 6, 8, 4, "cpu")
        args = (inputs["x"][0], inputs["router"], inputs["w_in"], inputs["w_out"])
        for top_k, factor in ((1, 1.0), (2, 1.25), (2, 0.0)):
            with self.subTest(top_k=top_k, factor=factor):
                loop = M.moe_layer(*args, top_k, factor).out
                self.assertLessEqual((B.grouped_moe(*args, top_k, factor) - loop).abs().max().item(),
                                     C.TOLERANCE)

    def test_router_load_run_counts_every_assignment(self):
        loads = B.router_load_run(1.0, steps=2, tokens=16)
        self.assertEqual([sum(step) for step in loads], [32, 32])
        self.assertEqual(B.rank_loads([1, 2, 3, 4, 5, 6, 7, 8], 4), [3, 7, 11, 15])

    def test_demo_passes(self):
        self.assertEqual(C.main(["--device", "cpu", "--world-size", "2", "--quick", "--timeout", "60"]), 0)


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed. The routings are of float64
    random data, far from ties: the same choices on any CPU (re-run under
    ATEN_CPU_CAPABILITY=default); the byte counts are integers."""

    def test_mixtral_numbers(self):
        text = readme_text()
        ep_bytes = M.balanced_all_to_all_bytes(4096, 4096, 2, 8, 2)
        dense = M.dense_all_reduce_bytes(4096, 4096, 8, 2)
        self.assertIn(f"{ep_bytes / 2**20:.0f} MiB sent per rank per MoE layer", text)
        self.assertIn(f"{32 * ep_bytes / 2**30:.1f} GiB over the 32 layers", text)
        self.assertIn(f"all-reduces {dense / 2**20:.0f} MiB per layer", text)
        self.assertEqual(ep_bytes, 2 * dense)

    def test_demo_numbers(self):
        """The demo's defaults: 4 ranks x 32 tokens, 8 experts, top-2, hidden 16, factor 1.25."""
        text = readme_text()
        inputs = C.make_inputs(0, 4, 32, 16, 32, 8, "cpu")
        ref = C.reference(inputs, 2, 1.25, 1e-2)
        rows = C.routing_rows(ref, 8, 4)
        dropped = sum(int((~keep).sum()) for _, keep in ref["routing"])
        forward, backward = M.ep_bytes_per_rank(rows, 0, 16, 8, 2)
        self.assertIn(f"C = {M.expert_capacity(32, 8, 2, 1.25)})", text)
        self.assertIn(f"{dropped} of the {4 * 32 * 2} assignments are dropped", text)
        self.assertIn(f"rows {rows[0]} to ranks 0-3 and {forward:,} B forward, {backward:,} B backward", text)

    def test_token_flow_numbers(self):
        """The step drawn in 'The idea': ep 2, 4 experts, top-1, 8 tokens, factor 1.0."""
        text = readme_text()
        inputs = C.make_inputs(0, 2, 8, 16, 32, 4, "cpu")
        ref = C.reference(inputs, 1, 1.0, 1e-2)
        self.assertEqual(M.expert_capacity(8, 4, 1, 1.0), 2)
        for rank, (experts, keep) in enumerate(ref["routing"]):
            choices = ", ".join(str(e) for e in experts[:, 0].tolist())
            phrase = "tokens choose experts" if rank == 0 else "tokens choose"
            self.assertIn(f"{phrase} {choices}", text)
            self.assertEqual((~keep[:, 0]).nonzero().flatten().tolist(), [4])
            per_expert = torch.bincount(experts[keep], minlength=4).tolist()
            self.assertIn(f"counts per expert {per_expert}", text)
        rows = C.routing_rows(ref, 4, 2)
        self.assertEqual(rows, [[4, 3], [4, 3]])
        forward, backward = M.ep_bytes_per_rank(rows, 0, 16, 8, 2)
        self.assertIn(f"= {forward} B forward, {backward} B backward", text)

    def test_router_load_run(self):
        """bench.py's training run, with and without the auxiliary loss (float64)."""
        text = readme_text()
        for coef in (0.0, 1.0):
            last = B.router_load_run(coef)[-1]
            ranks = B.rank_loads(last, 4)
            with self.subTest(coef=coef):
                line = (f"aux coef {coef:<5}: ... last {last}, imbalance "
                        f"{M.load_imbalance(last):.2f}, per rank (ep 4) {ranks}")
                self.assertIn(" ".join(line.split()), text)
        self.assertIn("busiest rank gets 170 of the 512 rows where 128 is the fair share", text)
        self.assertIn(f"{170 / 128:.2f} times as long", text)

    def test_quiz_numbers(self):
        import json

        quiz = json.loads(README.with_name("quiz.json").read_text())
        answers = {q["id"]: q.get("answer") for q in quiz["questions"]}
        self.assertEqual(answers["capacity-demo"], M.expert_capacity(32, 8, 2, 1.25))
        self.assertEqual(answers["flow-bytes"], M.ep_bytes_per_rank([[4, 3], [4, 3]], 0, 16, 8, 2).forward)
        self.assertEqual(answers["mixtral-mib"], M.balanced_all_to_all_bytes(4096, 4096, 2, 8, 2) / 2**20)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--experts", "6", "--world-size", "4"], "divisible")
        assert_argument_error(self, C.parse_args, ["--experts", "4", "--top-k", "5", "--world-size", "2"],
                              "top-k 5")
        assert_argument_error(self, C.parse_args, ["--world-size", "0"], "out of range")

    def test_under_torchrun(self):
        report = run_under_torchrun(Path(M.__file__), ["--quick", "--experts", "4"], nproc_per_node=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual((report["world_size"], report["device"], report["backend"]), (2, "cpu", "gloo"))


if __name__ == "__main__":
    unittest.main()
