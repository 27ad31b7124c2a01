"""Lesson 12's suite: each exercise alone (the router and its losses against hand
computations whose rows differ; capacity and the drop order against hand-worked examples and a
plain loop; the expert-parallel layer on 1, 2, 3 and 4 ranks and on subgroups of 3 and 4 ranks,
with the router and capacity replaced by oracles; the rows and bytes per rank from a routing);
then the lesson as a whole (untagged: integration): nothing replaced, the layer against a
per-token loop, the demo, the docs' numbers, the CLI and torchrun."""

from __future__ import annotations

import importlib
import json
import math
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import (
    assert_argument_error,
    exercise,
    launch_once,
    rank_configurations,
    torchrun_demo,
)

M = importlib.import_module("lessons.12_expert_parallel.main")
C = importlib.import_module("lessons.12_expert_parallel.checks")
W = importlib.import_module("lessons.12_expert_parallel.tests.workers")
B = importlib.import_module("lessons.12_expert_parallel.bench")
README = Path(M.__file__).with_name("README.md")
WORLDS = (1, 2, 3, 4)
HIDDEN, FFN = 6, 8
# a launch runs ~20 small configurations (well under 10 s of CPU); the rest is start-up of
# torch in each rank on a loaded 2-core machine
LAUNCH_TIMEOUT_S = 90


@launch_once
def rank_results(world: int) -> list[dict]:
    """One launch per world size (every configuration inside), shared by the classes; a failed
    launch is reported again, not retried."""
    return launch(W.ep_worker, world, (HIDDEN, FFN), device="cpu", timeout_s=LAUNCH_TIMEOUT_S)


def readme_text() -> str:
    return " ".join(README.read_text().split())


def mask_text(mask: torch.Tensor, tokens: list[int] | None = None) -> str:
    """A keep mask (T, k) as 't0 TT, t1 TF, ...' (T: kept, F: dropped): short enough to read.
    tokens: the token numbers of the rows (default 0..T-1)."""
    tokens = tokens if tokens is not None else list(range(mask.shape[0]))
    return ", ".join(f"t{t} " + "".join("T" if kept else "F" for kept in row)
                     for t, row in zip(tokens, mask.tolist()))


class RankCase(unittest.TestCase):
    def configs(self, prefix: str):
        """(where, world, rank, key, value, per_rank) for every configuration starting with
        prefix, one world size after the other (a failed launch ends the test, named)."""
        for world in WORLDS:
            yield from rank_configurations({world: rank_results(world)}, prefix, "ep")

    def ok(self, where: str, value: dict) -> None:
        self.assertNotIn("error", value, f"{where}: {value.get('error')}")


# ============================================================================ router


def hand_routing(top_k: int) -> M.Routing:
    """4 tokens, 3 experts, logits = log of probabilities whose rows differ:
    (.6 .3 .1), (.1 .2 .7), (.2 .5 .3), (.5 .1 .4)."""
    probs = torch.tensor([[6, 3, 1], [1, 2, 7], [2, 5, 3], [5, 1, 4]], dtype=torch.float64) / 10
    return M.route(probs.log(), torch.eye(3, dtype=torch.float64), top_k)


@exercise("router")
class TestRouter(unittest.TestCase):
    def test_top_k_and_gates(self):
        """Best first; the gates are the probabilities themselves (not renormalised)."""
        for top_k, experts, gates in ((1, [[0], [2], [1], [0]], [[.6], [.7], [.5], [.5]]),
                                      (2, [[0, 1], [2, 1], [1, 2], [0, 2]],
                                       [[.6, .3], [.7, .2], [.5, .3], [.5, .4]])):
            routing = hand_routing(top_k)
            with self.subTest(top_k=top_k):
                self.assertEqual(routing.experts.tolist(), experts, f"top-{top_k} experts, best first")
                self.assertEqual(routing.experts.dtype, torch.int64, "experts are int64 indices")
                got = [[round(g, 12) for g in row] for row in routing.gates.tolist()]
                self.assertEqual(got, gates, f"top-{top_k} gates: the softmax probabilities of the "
                                             f"chosen experts, not renormalised over the {top_k}")
                self.assertLess((routing.probs.sum(-1) - 1).abs().max().item(), 1e-12,
                                "probs sum to 1 over the experts of each token")

    def test_top_k_of_random_logits(self):
        x = torch.randn(20, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        w = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        routing = M.route(x, w, 3)
        logits = x @ w
        probs = torch.softmax(logits, -1)
        order = probs.argsort(dim=1, descending=True)[:, :3]
        self.assertLess((routing.logits - logits).abs().max().item(), 1e-12, "logits = x @ router_weight")
        self.assertLess((routing.probs - probs).abs().max().item(), 1e-12, "probs = softmax(logits, -1)")
        self.assertEqual(routing.experts.tolist(), order.tolist(), "the 3 most probable experts, best first")
        self.assertLess((routing.gates - probs.gather(1, order)).abs().max().item(), 1e-12,
                        "gates = probs of the chosen experts")

    def test_gradient_reaches_the_router_through_the_gates(self):
        x = torch.randn(10, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        w = torch.randn(4, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        weights = torch.randn(10, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        ours = w.clone().requires_grad_()
        (M.route(x, ours, 2).gates * weights).sum().backward()
        theirs = w.clone().requires_grad_()
        probs = torch.softmax(x @ theirs, -1)
        (probs.gather(1, probs.detach().topk(2, -1).indices) * weights).sum().backward()
        self.assertIsNotNone(ours.grad, "no gradient reached router_weight through the gates")
        self.assertLess((ours.grad - theirs.grad).abs().max().item(), 1e-12,
                        "d(gates)/d(router_weight) differs from the softmax's")

    def test_load_balancing_loss_by_hand(self):
        """P = column means (.35, .275, .375). Top-1: f = (2, 1, 1)/4, 3 (.5 x .35 + .25 x .275 +
        .25 x .375) = 1.0125. Top-2: f over the T k = 8 assignments (2, 3, 3)/8: 0.99375 (counting
        first choices only gives 1.0125, dividing by T instead of T k gives 1.9875)."""
        for top_k, want in ((1, 1.0125), (2, 0.99375)):
            got = M.load_balancing_loss(hand_routing(top_k), 3)
            with self.subTest(top_k=top_k):
                self.assertEqual(got.dim(), 0, f"a 0-dim tensor, got shape {tuple(got.shape)}")
                self.assertAlmostEqual(got.item(), want, places=12,
                                       msg=f"top-{top_k}: E sum_i f_i P_i = {want}, got {got.item()}")

    def test_load_balancing_loss_with_an_unused_expert(self):
        """E = 4, T = 3, top-2: expert 3 is never chosen, f = (2, 2, 2, 0)/6 (not a binary
        fraction): the loss is 4 x 1/3 x (P_0 + P_1 + P_2) in float64."""
        logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, -1.0], [1.0, 0.0, 2.0, -1.0]],
                              dtype=torch.float64)
        routing = M.route(logits, torch.eye(4, dtype=torch.float64), 2)
        probs = torch.softmax(logits, -1).mean(0)
        want = (4 * (probs[:3].sum() / 3)).item()
        got = M.load_balancing_loss(routing, 4)
        self.assertEqual(got.dtype, torch.float64, "the loss has the probabilities' dtype")
        self.assertAlmostEqual(got.item(), want, places=13,
                               msg=f"E sum_i f_i P_i with f = (1/3, 1/3, 1/3, 0): expected {want!r}, "
                                   f"got {got.item()!r}")

    def test_load_balancing_loss_bounds(self):
        """1 at uniform routing; below E/k when every token picks the same k experts; below 1
        for some routings (it is not minimal at uniform routing)."""
        uniform = M.route(torch.zeros(6, 4, dtype=torch.float64), torch.eye(4, dtype=torch.float64), 2)
        # every expert chosen by 3 of the 6 tokens (ties broken differently per row)
        uniform = uniform._replace(experts=torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 3], [1, 2]]))
        self.assertAlmostEqual(M.load_balancing_loss(uniform, 4).item(), 1.0, places=12,
                               msg="uniform f and P: the loss is 1")
        logits = torch.zeros(5, 8, dtype=torch.float64)
        logits[:, :2] = 40.0  # every token: experts 0 and 1, probability ~1/2 each
        top = M.load_balancing_loss(M.route(logits, torch.eye(8, dtype=torch.float64), 2), 8).item()
        self.assertTrue(4.0 - 1e-9 < top <= 4.0, f"the bound E/k = 8/2 = 4 is approached: got {top}")
        low = M.load_balancing_loss(M.route(*counterexample()), 2).item()
        self.assertLess(low, 1.0, f"f = (0.6, 0.4), P ~ (0.3, 0.7): E sum f P < 1, got {low}")

    def test_load_balancing_gradient_flows_through_p_only(self):
        logits = torch.tensor([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0], [0.5, 0.0]], dtype=torch.float64,
                              requires_grad=True)
        M.load_balancing_loss(M.route(logits, torch.eye(2, dtype=torch.float64), 1), 2).backward()
        f = torch.tensor([3 / 4, 1 / 4], dtype=torch.float64)  # experts 0, 0, 1, 0
        theirs = logits.detach().clone().requires_grad_()
        (2 * (f * torch.softmax(theirs, -1).mean(0)).sum()).backward()
        self.assertIsNotNone(logits.grad, "no gradient through P_i = mean of the probabilities")
        self.assertLess((logits.grad - theirs.grad).abs().max().item(), 1e-12,
                        f"d loss / d logits: expected E f_i dP_i (f constant) {theirs.grad.tolist()}, "
                        f"got {logits.grad.tolist()}")

    def test_z_loss_by_hand(self):
        """Rows whose log-sum-exp differ: ln 4, ln 2, ln 8 = 2, 1, 3 x ln 2. The mean of the
        squares is 14/3 (ln 2)^2; the square of the mean would be 4 (ln 2)^2."""
        logits = torch.tensor([[math.log(3), 0.0], [0.0, 0.0], [math.log(7), 0.0]], dtype=torch.float64)
        routing = M.route(logits, torch.eye(2, dtype=torch.float64), 1)
        got = M.router_z_loss(routing)
        want = 14 / 3 * math.log(2) ** 2
        self.assertEqual(got.dim(), 0, f"a 0-dim tensor, got shape {tuple(got.shape)}")
        self.assertAlmostEqual(got.item(), want, places=12,
                               msg=f"mean over tokens of (log-sum-exp)^2 = {want:.6f}, got {got.item():.6f} "
                                   f"(square of the mean: {4 * math.log(2) ** 2:.6f})")

    def test_z_loss_gradient(self):
        logits = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
        M.router_z_loss(M.route(logits, torch.eye(3, dtype=torch.float64), 1)).backward()
        lse = torch.logsumexp(logits.detach(), -1, keepdim=True)
        want = 2 * lse * torch.softmax(logits.detach(), -1) / 2
        self.assertIsNotNone(logits.grad, "no gradient from the z-loss to the logits")
        self.assertLess((logits.grad - want).abs().max().item(), 1e-12,
                        f"d z / d logits = 2 lse softmax / T: expected {want.tolist()}, "
                        f"got {logits.grad.tolist()}")


def counterexample() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x, router_weight, top_k) of the README's routing whose loss is below 1: 5 tokens, 2
    experts, top-1; 3 tokens lean slightly to expert 0 (logit 0.01), 2 firmly to expert 1."""
    x = torch.tensor([[0.01, 0.0]] * 3 + [[-10.0, 0.0]] * 2, dtype=torch.float64)
    return x, torch.eye(2, dtype=torch.float64), 1


# ============================================================================ capacity


@exercise("capacity")
class TestCapacity(unittest.TestCase):
    def test_capacity(self):
        cases = [((32, 8, 2, 1.25), 10, "ceil(1.25 x 32 x 2 / 8) = 10"),
                 ((10, 4, 1, 1.0), 3, "ceil(2.5) rounds up"),
                 ((7, 3, 2, 1.0), 5, "ceil(14 / 3)"),
                 ((12, 5, 1, 0.5), 2, "ceil(1.2)"),
                 ((9, 6, 2, 1.0), 3, "18 / 6, no rounding"),
                 ((8, 2, 2, math.inf), 8, "infinite factor: C = T"),
                 ((8, 2, 2, 0.0), 8, "factor 0: no limit, C = T"),
                 ((4, 2, 2, 10.0), 4, "never more than T: a token picks an expert once"),
                 ((0, 4, 2, 1.25), 0, "no tokens")]
        for args, want, why in cases:
            got = M.expert_capacity(*args)
            with self.subTest(args=args):
                self.assertEqual(got, want, f"expert_capacity{args}: expected {want} ({why}), got {got}")
                self.assertIsInstance(got, int, f"expert_capacity{args} returns an int")

    def test_drop_order_by_hand(self):
        """Capacity 2. First choices in token order: t0, t1 -> e0 kept, t2 -> e0 dropped, t3 ->
        e1 kept; then second choices: t0 -> e1 kept, t1 -> e2 kept, t2 -> e1 dropped (e1 has t3
        and t0), t3 -> e0 dropped. Token-major order would have kept t2's second choice."""
        experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
        keep = M.keep_mask(experts, 3, 2)
        self.assertEqual((keep.dtype, tuple(keep.shape)), (torch.bool, (4, 2)), "keep is bool (T, k)")
        self.assertEqual(mask_text(keep), "t0 TT, t1 TT, t2 FF, t3 TF",
                         f"choices {experts.tolist()}, capacity 2: choice-major, then token order")

    def test_drop_order_top_1_and_top_3(self):
        """Top-1, capacity 1: the first token of each expert stays. Top-3 of 3, capacity 2:
        first choices t0, t1 (e2) then t2 (e0); second choices t0 -> e0 (kept, e0 has t2), t1 -> e0
        dropped, t2 -> e1 kept; third choices t0 -> e1 kept, t1 -> e1 dropped, t2 -> e2 dropped."""
        self.assertEqual(mask_text(M.keep_mask(torch.tensor([[1], [0], [1], [1], [0]]), 2, 1)),
                         "t0 T, t1 T, t2 F, t3 F, t4 F", "top-1 choices 1, 0, 1, 1, 0 at capacity 1")
        experts = torch.tensor([[2, 0, 1], [2, 0, 1], [0, 1, 2]])
        self.assertEqual(mask_text(M.keep_mask(experts, 3, 2)), "t0 TTT, t1 TFF, t2 TTF",
                         f"top-3 choices {experts.tolist()} at capacity 2")

    def test_edges(self):
        experts = torch.tensor([[0, 1], [1, 0], [0, 1]])
        self.assertEqual(mask_text(M.keep_mask(experts, 2, 0)), "t0 FF, t1 FF, t2 FF",
                         "capacity 0 keeps nothing")
        self.assertEqual(mask_text(M.keep_mask(experts, 2, 3)), "t0 TT, t1 TT, t2 TT",
                         "capacity T keeps everything")
        empty = M.keep_mask(torch.zeros(0, 2, dtype=torch.int64), 4, 3)
        self.assertEqual((empty.dtype, tuple(empty.shape)), (torch.bool, (0, 2)), "no tokens: a (0, k) mask")

    def test_against_a_loop_and_conservation(self):
        g = torch.Generator().manual_seed(2)
        for top_k, experts, capacity in ((1, 4, 3), (2, 4, 5), (2, 8, 1), (3, 5, 4), (2, 3, 7)):
            choice = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(30)])
            keep = M.keep_mask(choice, experts, capacity)
            want = W.oracle_keep(choice, experts, capacity)
            with self.subTest(top_k=top_k, experts=experts, capacity=capacity):
                wrong = (keep != want).any(dim=1).nonzero().flatten()[:3]
                self.assertEqual(mask_text(keep[wrong], wrong.tolist()),
                                 mask_text(want[wrong], wrong.tolist()),
                                 f"30 tokens, top-{top_k} of {experts}, capacity {capacity}: the first wrong "
                                 f"tokens, whose choices are {choice[wrong].tolist()}")
                per_expert = torch.bincount(choice[keep], minlength=experts)
                self.assertLessEqual(per_expert.max().item(), capacity, "no expert over capacity")
                self.assertEqual(int((~M.keep_mask(choice, experts, 30)).sum()), 0,
                                 "capacity T: nothing dropped")


# ============================================================================ dispatch-combine


@exercise("dispatch-combine")
class TestExpertParallel(RankCase):
    def check_layer(self, where, value):
        self.ok(where, value)
        for key in ("out", "x_grad", "router_grad", "expert_grads", "no_stats"):
            self.assertLessEqual(value[key], C.TOLERANCE,
                                 f"{where}: max |{key} - one process| = {value[key]:.1e} > {C.TOLERANCE}"
                                 + (" (called without stats)" if key == "no_stats" else ""))
        self.assertTrue(value["same_experts"] and value["same_keep"],
                        f"{where}: the MoEOutput's routing.experts / keep differ from the routing's")

    def test_equals_one_process_for_every_ep_k_and_capacity(self):
        """Outputs and losses, dX, the router's and every expert's gradients, float64, on 1-4
        ranks with uneven tokens per rank."""
        for where, _, _, _, value, _ in self.configs("ep/"):
            with self.subTest(where=where):
                self.check_layer(where, value)

    def test_on_a_subgroup(self):
        """The EP group is ranks {0, 2} of 3 (rank 1 idle) or {1, 2, 3} of 4 (ep = 3, rank 0
        idle): ep, ranks and all-to-alls come from `group`, not the world."""
        seen = set()
        for where, world, rank, _, value, _ in self.configs("sub/"):
            seen.add((world, rank))
            with self.subTest(where=where):
                self.check_layer(where, value)
                self.assertEqual(value["bytes"], {"forward": 0, "backward": 0},
                                 f"{where}: the torch engine sends nothing through lesson 01's Traffic")
        self.assertEqual(sorted(seen), [(3, 0), (3, 2), (4, 1), (4, 2), (4, 3)], "subgroup members that ran")

    def test_rows_sent_and_received_follow_the_routing(self):
        for where, _, _, _, value, _ in self.configs(""):
            with self.subTest(where=where):
                self.ok(where, value)
                rows, me = value["rows"], value["group_rank"]
                self.assertEqual(value["send_counts"], rows[me],
                                 f"{where}: stats.send_counts = this rank's row of the routing's rows {rows}")
                self.assertEqual(value["recv_counts"], [row[me] for row in rows],
                                 f"{where}: stats.recv_counts = rows[i][this rank] for every source i, "
                                 f"rows {rows}")
                self.assertEqual(value["expert_rows"], value["expected_expert_rows"],
                                 f"{where}: stats.expert_rows = kept rows routed to each local expert")

    def test_tokens_conserved(self):
        """routed = kept + dropped on every rank; what the local experts ran = what arrived;
        nothing dropped without a capacity limit."""
        for where, _, _, _, value, _ in self.configs(""):
            with self.subTest(where=where):
                self.ok(where, value)
                self.assertEqual(value["dropped"], value["expected_dropped"],
                                 f"{where}: stats.dropped = assignments the keep mask drops")
                self.assertEqual(value["tokens"] * value["top_k"], value["kept"] + value["dropped"],
                                 f"{where}: T k = kept + dropped")
                self.assertEqual(sum(value["expert_rows"]), sum(value["recv_counts"]),
                                 f"{where}: rows the local experts ran = rows received")
                if value["factor"] == 0.0:
                    self.assertEqual(value["dropped"], 0, f"{where}: no capacity limit, nothing dropped")

    def test_skewed_router_leaves_ranks_empty(self):
        """Top-1, no capacity limit, everything to the first rank's experts: the other ranks
        receive nothing and still take part in both all-to-alls."""
        found = 0
        for where, _world, _, key, value, _ in self.configs(""):
            if key.endswith(("/1/0.0/20.0/p2p", "/1/0.0/20.0/torch")):
                with self.subTest(where=where):
                    self.ok(where, value)
                    if value["group_rank"] > 0:
                        found += 1
                        self.assertEqual(sum(value["recv_counts"]), 0,
                                         f"{where}: received {value['recv_counts']}, expected nothing")
        self.assertGreater(found, 0, "no rank other than the first ran the skewed configuration")

    def test_bytes_counted(self):
        """Lesson 01's all-to-all counts: the per-expert counts (E/ep int64 to each other rank),
        then every row to another rank, there and back, forward; the same rows backward. The
        torch engine counts zero bytes of ours."""
        for where, world, rank, key, value, _ in self.configs("ep/"):
            with self.subTest(where=where):
                self.ok(where, value)
                if key.endswith("/torch"):
                    self.assertEqual(value["bytes"], {"forward": 0, "backward": 0},
                                     f"{where}: all_to_all_single sends nothing through lesson 01's Traffic")
                    continue
                rows = value["rows"]
                remote = (sum(rows[rank]) - rows[rank][rank]
                          + sum(r[rank] for r in rows) - rows[rank][rank]) * HIDDEN * 8
                counts = 8 * W.experts_for(world) // world * (world - 1)
                want = {"forward": remote + counts, "backward": remote}
                self.assertEqual(value["bytes"], want, f"{where}: bytes sent, rows {rows}")


# ============================================================================ ep-bytes


@exercise("ep-bytes")
class TestBytes(unittest.TestCase):
    def test_by_hand(self):
        rows = [[3, 1, 0], [2, 0, 4], [0, 0, 5]]
        cases = [(1, (256, 224), "rank 1 sends 2 + 4 rows, returns 1 (from rank 0): 7 x 4 x 8 = 224; "
                                 "counts 8 x 2 x 2"),
                 (2, (4 * 32 + 32, 4 * 32), "rank 2 sends nothing, returns rank 1's 4 rows"),
                 (0, ((1 + 2) * 32 + 32, 3 * 32), "rank 0 sends 1 row, returns rank 1's 2 rows")]
        for rank, want, why in cases:
            with self.subTest(rank=rank):
                got = M.ep_bytes_per_rank(rows, rank, 4, 8, 2)
                self.assertEqual(tuple(got), want, f"rows {rows}, rank {rank}, hidden 4, 8 B, 2 experts "
                                                   f"per rank: {why}")
                self.assertEqual((got.forward, got.backward), want, "a Bytes(forward, backward)")
        self.assertEqual(tuple(M.ep_bytes_per_rank([[5]], 0, 4, 8, 2)), (0, 0), "ep = 1: nothing travels")
        self.assertEqual(tuple(M.ep_bytes_per_rank([[0, 6], [1, 0]], 0, 3, 2, 5)), ((6 + 1) * 6 + 40, 7 * 6),
                         "ep 2, 5 experts per rank, bf16: 7 rows of 6 B; counts 8 x 5")

    def test_dispatch_counts(self):
        experts = torch.tensor([[0, 3], [1, 2]])
        keep = torch.tensor([[True, False], [True, True]])
        for num_experts, ep, want in ((4, 2, [2, 1]), (4, 4, [1, 1, 1, 0]), (4, 1, [3])):
            got = M.dispatch_counts(experts, keep, num_experts, ep)
            with self.subTest(num_experts=num_experts, ep=ep):
                self.assertEqual(got, want, f"experts {experts.tolist()}, keep {keep.tolist()}, "
                                            f"{num_experts} experts on {ep} ranks")
                self.assertIsInstance(got, list, "a list of ints, one per rank")
        experts = torch.tensor([[5, 0], [2, 3], [4, 1], [5, 4]])
        keep = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
        self.assertEqual(M.dispatch_counts(experts, keep, 6, 3), [2, 1, 3],
                         "6 experts on 3 ranks (2 each): kept experts 5, 0, 2, 1, 5, 4")
        self.assertEqual(M.dispatch_counts(torch.zeros(0, 2, dtype=torch.int64),
                                           torch.zeros(0, 2, dtype=torch.bool), 6, 3), [0, 0, 0],
                         "no tokens: nothing to send")

    def test_balanced_routing(self):
        """Uniform rows: (ep - 1)/ep of T k rows each way, per direction."""
        ep, per_pair = 4, 6
        rows = [[per_pair] * ep for _ in range(ep)]
        forward, backward = M.ep_bytes_per_rank(rows, 0, 16, 2, 2)
        self.assertEqual(backward, M.balanced_all_to_all_bytes(ep * per_pair, 16, 1, ep, 2),
                         "balanced rows: 2 (ep - 1)/ep T k d b")
        self.assertEqual(forward - backward, 8 * 2 * 3, "the split sizes: 8 B x 2 experts x 3 other ranks")


# ============================================================================ integration


class TestWhole(RankCase):
    def test_unpatched_layer_equals_one_process(self):
        for where, _, _, _, value, _ in self.configs("whole"):
            with self.subTest(where=where):
                self.ok(where, value)
                for key in ("out", "x_grad", "router_grad", "expert_grads"):
                    self.assertLessEqual(value[key], C.TOLERANCE, f"{where}: {key} {value[key]:.1e}")

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
                gap = (result.out - expected).abs().max().item()
                self.assertLessEqual(gap, C.TOLERANCE, f"top-{top_k}, factor {factor}: max |diff| {gap:.1e}")

    def test_grouped_matmul_equals_the_loop(self):
        """bench.py's padded, batched form gives the loop's output (float64), drops included."""
        inputs = C.make_inputs(1, 1, 24, 6, 8, 4, "cpu")
        args = (inputs["x"][0], inputs["router"], inputs["w_in"], inputs["w_out"])
        for top_k, factor in ((1, 1.0), (2, 1.25), (2, 0.0)):
            with self.subTest(top_k=top_k, factor=factor):
                loop = M.moe_layer(*args, top_k, factor).out
                gap = (B.grouped_moe(*args, top_k, factor) - loop).abs().max().item()
                self.assertLessEqual(gap, C.TOLERANCE, f"top-{top_k}, factor {factor}: max |diff| {gap:.1e}")

    def test_router_load_run_counts_every_assignment(self):
        loads = B.router_load_run(1.0, steps=2, tokens=16)
        self.assertEqual([sum(step) for step in loads], [32, 32], "16 tokens x top-2 per step")
        self.assertEqual(B.rank_loads([1, 2, 3, 4, 5, 6, 7, 8], 4), [3, 7, 11, 15], "experts in blocks of 2")

    def test_demo_passes_at_an_odd_world_size(self):
        """The defaults at 3 ranks (6 experts: 2 per rank)."""
        self.assertEqual(C.main(["--device", "cpu", "--world-size", "3", "--quick", "--timeout", "90"]), 0,
                         "the demo's checks at --world-size 3")


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
        self.assertEqual(ep_bytes, 2 * dense, "at equal tokens per rank, top-2 EP sends k = 2 x TP's bytes")
        # per token processed: 8 EP ranks own 8 x 4096 tokens, 8 TP ranks share 4096
        ep_token, tp_token = 8 * ep_bytes / (8 * 4096), 8 * dense / 4096
        self.assertIn(f"{ep_token / 1024:.0f} KiB against {tp_token / 1024:.0f} KiB per token", text)
        self.assertEqual(ep_token / tp_token, 2 / 8, "per token, EP sends k / ep of TP's bytes")

    def test_parameter_counts(self):
        """Mixtral 8x7B from its configuration (hidden 4096, 14336, 32 layers, 32 heads, 8 K/V
        heads, vocabulary 32000, 8 experts, top-2, untied embeddings); the MLP share of a
        Mistral-7B / Llama-3-8B layer (the same shapes) against the classic 2/3."""
        d, f, layers, heads, kv, vocab = 4096, 14336, 32, 32, 8, 32000
        attention = 2 * d * d + 2 * d * (d // heads * kv)
        expert = 3 * d * f  # SwiGLU: gate, up, down
        norms = 2 * d
        total = layers * (attention + 8 * expert + d * 8 + norms) + 2 * vocab * d + d
        active = layers * (attention + 2 * expert + d * 8 + norms) + 2 * vocab * d + d
        text = readme_text()
        self.assertIn(f"about {total / 1e9:.1f}B parameters but computes with about "
                      f"{active / 1e9:.1f}B", text)
        share = expert / (attention + expert + norms)
        self.assertIn(f"about {100 * share:.0f}% of the non-embedding parameters", text)
        self.assertAlmostEqual(8 / 12, 2 / 3, msg="classic shape: MLP 8 d^2 of 12 d^2 per layer")

    def test_load_balancing_numbers(self):
        text = readme_text()
        low = M.load_balancing_loss(M.route(*counterexample()), 2).item()
        routing = M.route(*counterexample())
        probs = routing.probs.mean(0).tolist()
        self.assertIn(f"P = ({probs[0]:.2f}, {probs[1]:.2f}): the loss is {low:.2f}", text)
        self.assertIn(f"(p = {torch.softmax(torch.tensor([0.01, 0.0]), 0)[0].item():.4f})", text)
        self.assertIn("top-2 of E = 8: 4.0", text)

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
            self.assertEqual((~keep[:, 0]).nonzero().flatten().tolist(), [4], f"rank {rank} drops token 4")
            per_expert = torch.bincount(experts[keep], minlength=4).tolist()
            other = 1 - rank
            mine = per_expert[2 * other:2 * other + 2]
            self.assertIn(f"counts for experts {2 * other}, {2 * other + 1}: {mine}", text)
        rows = C.routing_rows(ref, 4, 2)
        self.assertEqual(rows, [[4, 3], [4, 3]])
        forward, backward = M.ep_bytes_per_rank(rows, 0, 16, 8, 2)
        self.assertIn(f"= {forward} B forward, {backward} B backward", text)

    def test_router_load_run(self):
        """bench.py's training run, with and without the auxiliary loss (float64)."""
        text = readme_text()
        runs = {coef: B.router_load_run(coef) for coef in (0.0, 1.0)}
        first, last, balanced = runs[0.0][0], runs[0.0][-1], runs[1.0][-1]
        self.assertEqual(runs[1.0][0], first, "both runs start from the same router")
        self.assertIn(f"step 0 expert loads {first}", text)
        self.assertEqual(first.index(max(first)), 3, "the README says expert 3 is the busiest at step 0")
        self.assertEqual(last.index(max(last)), 0, "the README says expert 0 leads at the last step")
        fair = sum(first) // 4
        phrases = [f"At step 0 expert 3 gets {first[3]} assignments and expert 0 {first[0]}, where "
                   f"{sum(first) // 8} is the fair share (imbalance {M.load_imbalance(first):.2f})",
                   f"the busiest rank holds {max(B.rank_loads(first, 4))} of the {sum(first)} rows",
                   f"(expert 0 leads at the last step with {last[0]}, expert 3 has {last[3]})",
                   f"{M.load_imbalance(first):.2f} to {M.load_imbalance(last):.2f} in "
                   f"{len(runs[0.0])} steps",
                   f"holds {max(B.rank_loads(last, 4))} rows where {fair} is the fair share",
                   f"take {max(B.rank_loads(last, 4)) / fair:.2f} times as long as balanced",
                   f"the imbalance falls to {M.load_imbalance(balanced):.2f} and the busiest rank holds "
                   f"{max(B.rank_loads(balanced, 4))} rows "
                   f"({max(B.rank_loads(balanced, 4)) / fair:.2f} times"]
        for phrase in phrases:
            self.assertIn(" ".join(phrase.split()), text)
        for coef, loads in runs.items():
            self.assertIn(" ".join(B.load_line(coef, loads).split()), text,
                          f"the bench's line for coef {coef}")

    def test_grouped_padding_numbers(self):
        capacity = M.expert_capacity(4096, 64, 2, 1.25)
        self.assertIn(f"{64 * capacity:,} rows (64 experts x C = {capacity}) for at most {4096 * 2:,} kept",
                      readme_text())

    def test_quiz_numbers(self):
        quiz = json.loads(README.with_name("quiz.json").read_text())
        answers = {q["id"]: q.get("answer") for q in quiz["questions"]}
        drop_order = M.keep_mask(torch.tensor([[0, 1], [0, 2], [0, 2], [1, 0]]), 3, 2)
        self.assertEqual(mask_text(drop_order), "t0 TT, t1 TT, t2 FT, t3 TF",
                         "drop-order: only token 2's first and token 3's second choice are dropped")
        self.assertEqual(answers["capacity-demo"], M.expert_capacity(32, 8, 2, 1.25))
        self.assertEqual(answers["flow-bytes"], M.ep_bytes_per_rank([[4, 3], [4, 3]], 0, 16, 8, 2).forward)
        self.assertEqual(answers["mixtral-mib"], M.balanced_all_to_all_bytes(4096, 4096, 2, 8, 2) / 2**20)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--experts", "6", "--world-size", "4"], "divisible")
        assert_argument_error(self, C.parse_args, ["--experts", "4", "--top-k", "5", "--world-size", "2"],
                              "top-k 5")
        assert_argument_error(self, C.parse_args, ["--world-size", "0"], "out of range")

    def test_defaults_run_at_every_world_size(self):
        for world in (1, 2, 3, 4):
            args = C.parse_args(["--world-size", str(world)])
            self.assertEqual(args.experts, 2 * world, f"--world-size {world}: default experts 2 per rank")

    @torchrun_demo(["--quick", "--experts", "4"])
    def test_under_torchrun(self, report):
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual((report["world_size"], report["device"], report["backend"]), (2, "cpu", "gloo"))


if __name__ == "__main__":
    unittest.main()
