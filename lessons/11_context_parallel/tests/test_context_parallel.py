"""Lesson 11's suite: each exercise alone (attention by blocks and its merge, forward and
backward, in one process; the layouts and their tiles; ring attention and Ulysses on 1-4 ranks
with the other exercises replaced by oracles); then the lesson as a whole (untagged:
integration): ring == Ulysses == PyTorch's attention with nothing replaced, the demo, PyTorch's
own context_parallel on CPU, the docs' numbers, the CLI and torchrun."""

from __future__ import annotations

import functools
import importlib
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import (
    assert_argument_error,
    exercise,
    rank_configurations,
    run_under_torchrun,
)

M = importlib.import_module("lessons.11_context_parallel.main")
U = importlib.import_module("lessons.11_context_parallel.ulysses")
C = importlib.import_module("lessons.11_context_parallel.checks")
W = importlib.import_module("lessons.11_context_parallel.tests.workers")
B = importlib.import_module("lessons.11_context_parallel.bench")
README = Path(M.__file__).with_name("README.md")
WORLDS = (1, 2, 3, 4)
SEQ, HEADS, HEAD_DIM = 24, 12, 4  # 24 divisible by 2 cp and 12 by cp for cp = 1..4


@functools.cache
def rank_results() -> dict:
    """One launch per world size (every configuration inside), shared by the classes."""
    return {world: launch(W.cp_worker, world, (SEQ, HEADS, HEAD_DIM), device="cpu", timeout_s=60)
            for world in WORLDS}


def readme_text() -> str:
    return " ".join(README.read_text().split())


def qkv(seed: int, heads: int, seq: int, d: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, seq, d, generator=generator, dtype=torch.float64) for _ in range(4)]


def expected_tiles(cp: int, rank: int, layout: str, causal: bool) -> int:
    """Tiles rank `rank` computes, written out (the zigzag exercise's formula is not used here)."""
    chunks = (2 * rank, 2 * rank + 1) if layout == "contiguous" else (rank, 2 * cp - 1 - rank)
    return sum(c + 1 for c in chunks) if causal else 4 * cp


class RankCase(unittest.TestCase):
    def configs(self, prefix: str):
        """(where, world, rank, key, value) for every configuration starting with prefix."""
        for where, world, rank, key, value, _ in rank_configurations(rank_results(), prefix, "cp"):
            yield where, world, rank, key, value

    def assert_exact(self, prefix: str):
        for where, _, _, _, value in self.configs(prefix):
            with self.subTest(where=where):
                self.assertNotIn("error", value, value.get("error"))
                self.assertLessEqual(value["out_gap"], C.TOLERANCE, "output")
                self.assertLessEqual(max(value["grad_gaps"]), C.TOLERANCE, "dQ, dK, dV")


# ============================================================================ online-softmax


@exercise("online-softmax")
class TestBlockwiseAttention(unittest.TestCase):
    def test_equals_sdpa_forward_and_backward(self):
        """float64, causal and not, blocks that divide the sequence and blocks that do not."""
        for causal in (False, True):
            for block in (1, 5, 8, 40):
                q, k, v, w = qkv(1, 3, 16, 8)
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = M.blockwise_attention(*leaves, causal=causal, block=block)
                (out * w).sum().backward()
                y_ref, g_ref = C.reference(q, k, v, w, causal)
                with self.subTest(causal=causal, block=block):
                    self.assertLessEqual((out.detach() - y_ref).abs().max().item(), C.TOLERANCE)
                    for ours, ref in zip(leaves, g_ref):
                        self.assertLessEqual((ours.grad - ref).abs().max().item(), C.TOLERANCE)

    def test_merge_is_exact_in_any_order(self):
        q, k, v, _ = qkv(2, 2, 6, 4)
        full = M.attend_block(q, k, v)
        parts = [M.attend_block(q, k[:, cut], v[:, cut]) for cut in (slice(0, 2), slice(2, 6))]
        for a, b in (parts, parts[::-1]):
            out, lse = M.merge_partials(*a, *b)
            self.assertLessEqual((out - full[0]).abs().max().item(), C.TOLERANCE)
            self.assertLessEqual((lse - full[1]).abs().max().item(), C.TOLERANCE)

    def test_fully_masked_rows_add_nothing(self):
        """A tile where a row sees no key: lse -inf, out 0, and merging it changes nothing."""
        q, k, v, _ = qkv(3, 2, 4, 4)
        mask = torch.zeros(4, 4, dtype=torch.bool)
        mask[2:] = True
        out, lse = M.attend_block(q, k, v, mask)
        self.assertTrue(torch.isinf(lse[:, :2]).all() and (lse[:, :2] < 0).all())
        self.assertTrue(torch.equal(out[:, :2], torch.zeros_like(out[:, :2])))
        visible = M.attend_block(q, k, v)
        empty = M.merge_partials(out[:, :2], lse[:, :2], out[:, :2], lse[:, :2])
        self.assertFalse(torch.isnan(empty[0]).any())
        merged, merged_lse = M.merge_partials(visible[0][:, :2], visible[1][:, :2], out[:, :2], lse[:, :2])
        self.assertLessEqual((merged - visible[0][:, :2]).abs().max().item(), C.TOLERANCE)
        self.assertTrue(torch.equal(merged_lse, visible[1][:, :2]))

    def test_tile_gradients_sum_to_autograd(self):
        """attend_block_backward over two key blocks, from the full row's lse, sums to sdpa's."""
        q, k, v, w = qkv(4, 2, 8, 4)
        out, lse = M.attend_block(q, k, v)
        delta = (w * out).sum(-1)
        parts = [M.attend_block_backward(q, k[:, cut], v[:, cut], w, lse, delta)
                 for cut in (slice(0, 3), slice(3, 8))]
        dq = parts[0][0] + parts[1][0]
        dk, dv = (torch.cat([parts[0][i], parts[1][i]], dim=1) for i in (1, 2))
        _, g_ref = C.reference(q, k, v, w, False)
        for ours, ref in zip((dq, dk, dv), g_ref):
            self.assertLessEqual((ours - ref).abs().max().item(), C.TOLERANCE)

    def test_no_seq_by_seq_matrix_is_saved(self):
        """Autograd keeps q, k, v, out, lse and the positions: (4 H s d + H s) * 8 + 2 s * 8
        bytes, nothing of H s s (sdpa's math path on CPU keeps its probabilities)."""
        heads, seq, d = 2, 64, 4
        q, k, v, _ = (t.requires_grad_() for t in qkv(5, heads, seq, d))
        saved = {}

        def pack(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            M.blockwise_attention(q, k, v, causal=True, block=16)
        self.assertEqual(sum(saved.values()), (4 * heads * seq * d + heads * seq) * 8 + 2 * seq * 8)

    def test_lesson_07_tracker_sees_no_seq_by_seq_matrix(self):
        """Lesson 07's MemoryTracker on the forward: what stays alive is out, lse and the
        positions; the peak is a few (s x block) tiles, far below one s x s matrix, which
        plain softmax attention does allocate."""
        heads, seq, d, block = 2, 512, 4, 16
        q, k, v, _ = (t.requires_grad_() for t in qkv(6, heads, seq, d))
        square = heads * seq * seq * 8
        peaks = {}
        for name, attend in (("blockwise", lambda: M.blockwise_attention(q, k, v, True, block)),
                             ("plain", lambda: torch.softmax(q @ k.transpose(-1, -2), -1) @ v)):
            tracker = M.memory.MemoryTracker()
            tracker.mark([q, k, v], "parameter")  # the inputs, made before: not activations
            with tracker, tracker.phase("forward"):
                out = attend()
            peaks[name] = tracker.peak_bytes - 3 * heads * seq * d * 8
            if name == "blockwise":
                self.assertEqual(tracker.breakdown()["activation"],
                                 (heads * seq * d + heads * seq) * 8 + 2 * seq * 8)
            del out
        self.assertLess(peaks["blockwise"], square / 4)
        self.assertGreaterEqual(peaks["plain"], square)


# ============================================================================ zigzag


@exercise("zigzag")
class TestLayouts(unittest.TestCase):
    def test_chunks(self):
        self.assertEqual([M.chunk_ids(4, r, "contiguous") for r in range(4)],
                         [(0, 1), (2, 3), (4, 5), (6, 7)])
        self.assertEqual([M.chunk_ids(4, r, "zigzag") for r in range(4)],
                         [(0, 7), (1, 6), (2, 5), (3, 4)])

    def test_positions_cover_the_sequence_once(self):
        for cp in (1, 2, 3, 5):
            for layout in M.LAYOUTS:
                seq = 2 * cp * 3
                every = torch.cat([M.sequence_positions(seq, cp, r, layout) for r in range(cp)])
                with self.subTest(cp=cp, layout=layout):
                    self.assertEqual(sorted(every.tolist()), list(range(seq)))
        self.assertEqual(M.sequence_positions(16, 2, 1, "zigzag").tolist(), list(range(4, 12)))
        self.assertEqual(M.sequence_positions(16, 2, 0, "zigzag").tolist(), [0, 1, 2, 3, 12, 13, 14, 15])

    def test_sequence_not_divisible_is_refused(self):
        with self.assertRaisesRegex(ValueError, "not divisible by 2 \\* cp = 6"):
            M.sequence_positions(10, 3, 0, "zigzag")

    def test_tiles_per_rank(self):
        """Contiguous: 4r + 3 (max - min = 4 (cp - 1)); zig-zag: 2 cp + 1 everywhere;
        no mask: 4 cp everywhere."""
        for cp in (1, 2, 3, 4, 8):
            zigzag = M.tiles_per_rank(cp, "zigzag")
            with self.subTest(cp=cp):
                self.assertEqual(M.tiles_per_rank(cp, "contiguous"), [4 * r + 3 for r in range(cp)])
                self.assertLessEqual(max(zigzag) - min(zigzag), 1)
                self.assertEqual(zigzag, [2 * cp + 1] * cp)
                self.assertEqual(M.tiles_per_rank(cp, "zigzag", causal=False), [4 * cp] * cp)
                self.assertEqual(sum(zigzag), sum(M.tiles_per_rank(cp, "contiguous")))


# ============================================================================ ring-attention


@exercise("ring-attention")
class TestRingAttention(RankCase):
    def test_equals_sdpa_for_every_cp_mask_and_layout(self):
        self.assert_exact("ring/")

    def test_exchange_steps(self):
        for where, world, _, _, value in self.configs("ring/"):
            with self.subTest(where=where):
                self.assertNotIn("error", value)
                self.assertEqual(value["forward_steps"], world - 1)
                self.assertEqual(value["backward_steps"], world if world > 1 else 0)

    def test_bytes_equal_the_formula(self):
        for where, world, _, _, value in self.configs("ring/"):
            with self.subTest(where=where):
                self.assertNotIn("error", value)
                formula = M.ring_bytes_per_rank(SEQ, HEADS, HEAD_DIM, world, 8)
                self.assertEqual(value["bytes"], formula._asdict())

    def test_masked_tiles_are_skipped(self):
        for where, world, rank, key, value in self.configs("ring/"):
            _, causal, layout = key.split("/")
            with self.subTest(where=where):
                self.assertNotIn("error", value)
                self.assertEqual(value["tiles"], expected_tiles(world, rank, layout, causal == "True"))


# ============================================================================ ulysses


@exercise("ulysses")
class TestUlysses(RankCase):
    def test_equals_sdpa_on_both_engines(self):
        self.assert_exact("ulysses/")

    def test_bytes_equal_the_formula(self):
        for where, world, _, key, value in self.configs("ulysses/"):
            if key.endswith("/p2p"):  # torch's all-to-all is not counted
                with self.subTest(where=where):
                    self.assertNotIn("error", value)
                    self.assertEqual(value["bytes"],
                                     U.ulysses_bytes_per_rank(SEQ, HEADS, HEAD_DIM, world, 8)._asdict())

    def test_heads_not_divisible(self):
        for where, world, _, _, value in self.configs("heads_refusal"):
            if world > 1:
                with self.subTest(where=where):
                    self.assertIn("divisible", value.get("error", ""))


# ============================================================================ integration


class TestWhole(RankCase):
    def test_ring_equals_ulysses_equals_one_process(self):
        for where, _, _, _, value in self.configs("whole"):
            with self.subTest(where=where):
                for key in ("ring_vs_sdpa", "ulysses_vs_sdpa", "ring_vs_ulysses"):
                    self.assertLessEqual(value.get(key, float("inf")), C.TOLERANCE, key)

    def test_bytes_compare(self):
        """Ulysses sends cp / 2 times fewer bytes forward than the ring (equal at cp = 2)."""
        for cp in (2, 4, 8):
            ring = M.ring_bytes_per_rank(4096, 32, 128, cp, 2).forward
            ulysses = U.ulysses_bytes_per_rank(4096, 32, 128, cp, 2).forward
            self.assertEqual(ring * 2, ulysses * cp)

    def test_gpt_training_steps_with_cp_equal_one_process(self):
        """Lesson 07's TinyGPT, 3 SGD steps, float64: CP = 2 (ring, zig-zag) and CP = 3
        (ring, contiguous) give the losses and gradients of one process."""
        for world, layout in ((2, "zigzag"), (3, "contiguous")):
            results = launch(W.gpt_worker, world, ("ring", layout), device="cpu", timeout_s=60)
            for rank, checks in enumerate(results):
                for check in checks:
                    with self.subTest(world=world, rank=rank, check=check["name"]):
                        self.assertTrue(check["passed"], check["detail"])

    def test_activation_bytes_per_rank_scale_as_one_over_cp(self):
        """Lesson 07's tracker on a layer with ring attention: the bytes kept per rank are
        exactly 1/cp of one process's, and grow linearly with the sequence."""
        kept = {world: launch(C.activation_worker, world, ([16, 32],), device="cpu", timeout_s=60)
                for world in (1, 2)}
        one = kept[1][0]
        self.assertEqual(one[1], 2 * one[0])
        for per_rank in kept[2]:
            self.assertEqual([2 * b for b in per_rank], one)

    def test_bench_replays_each_ranks_tiles(self):
        for layout in M.LAYOUTS:
            tiles = [B.rank_compute(32, 4, rank, layout, 1, 2)[0] for rank in range(4)]
            self.assertEqual(tiles, M.tiles_per_rank(4, layout))

    def test_demo_passes(self):
        self.assertEqual(C.main(["--device", "cpu", "--world-size", "2", "--seq", "16",
                                 "--variant", "ulysses", "--timeout", "60"]), 0)

    def test_pytorch_context_parallel_on_cpu(self):
        """torch 2.13's context_parallel does not run on CPU (the README quotes this error);
        if it starts to, the README and the notebook must change."""
        results = launch(W.torch_cp_worker, 2, (16, 2, 8), device="cpu", timeout_s=60)
        for message in results:
            self.assertIn("_scaled_dot_product_flash_attention_for_cpu", message)
            self.assertIn("does not have a sharding strategy registered", message)
        self.assertIn("does not have a sharding strategy registered", readme_text())


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed (integers: the same on any CPU)."""

    def test_memory_of_a_128k_context(self):
        text = readme_text()
        s, h, a, layers = 131072, 4096, 32, 32
        for cp in (1, 8, 16):
            per_layer = M.activation_bytes_per_rank(s, h, a, cp)
            self.assertIn(f"{per_layer / 1e9:,.2f} GB", text)
            self.assertIn(f"{per_layer * layers / 1e9:,.1f} GB", text)
        scores = (M.activation_bytes_per_rank(s, h, a, 1, flash=False)
                  - M.activation_bytes_per_rank(s, h, a, 1))
        self.assertIn(f"{scores / 1e12:,.2f} TB", text)

    def test_bytes_at_128k(self):
        text = readme_text()
        b = M.shard_bytes(131072, 32, 128, 8, 2)
        self.assertEqual(b, 2**27)
        ring = M.ring_bytes_per_rank(131072, 32, 128, 8, 2)
        ulysses = U.ulysses_bytes_per_rank(131072, 32, 128, 8, 2)
        self.assertIn(f"{ring.forward / 2**30:.2f} GiB", text)
        self.assertIn(f"{ulysses.forward / 2**20:.0f} MiB", text)

    def test_worked_tiles_and_demo_bytes(self):
        text = readme_text()
        self.assertIn(f"{M.tiles_per_rank(4, 'contiguous')}", text)
        self.assertIn(f"{M.tiles_per_rank(4, 'zigzag')}", text)
        ring = M.ring_bytes_per_rank(64, 4, 8, 4, 8)
        self.assertIn(f"{ring.forward:,} B forward and {ring.backward:,} B backward", text)
        ulysses = U.ulysses_bytes_per_rank(64, 4, 8, 4, 8)
        self.assertIn(f"{ulysses.forward:,} B each way", text)


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--seq", "20", "--world-size", "4"], "--seq 20")
        assert_argument_error(self, C.parse_args, ["--variant", "ulysses", "--heads", "6",
                                                   "--world-size", "4"], "--heads 6")
        assert_argument_error(self, C.parse_args, ["--layout", "striped"], "invalid choice")
        assert_argument_error(self, C.parse_args, ["--world-size", "0"], "out of range")

    def test_under_torchrun(self):
        report = run_under_torchrun(Path(M.__file__), ["--seq", "8", "--heads", "2"], nproc_per_node=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"))
        self.assertEqual(report["metrics"]["tiles_per_rank"], M.tiles_per_rank(2, "zigzag"))


if __name__ == "__main__":
    unittest.main()
