"""Lesson 11's suite: each exercise alone (attention by blocks and its merge, hand-worked and
against PyTorch; FlashAttention-2's loops as a drop-in for SDPA in float64, float32 and bf16;
the layouts and their tiles; ring attention and Ulysses on 1-4 ranks and on subgroups, with the
other exercises replaced by oracles); then the lesson as a whole (untagged: integration): ring
== Ulysses == PyTorch's attention with nothing replaced, the demo, PyTorch's own
context_parallel on CPU, the docs' numbers, the CLI and torchrun.

Every assertion names what was expected, what came back and the configuration."""

from __future__ import annotations

import functools
import importlib
import math
import unittest
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from lessons._launch import launch
from lessons._testing import (
    LazyWorlds,
    assert_argument_error,
    exercise,
    launch_once,
    rank_configurations,
    torchrun_demo,
)

M = importlib.import_module("lessons.11_context_parallel.main")
BW = importlib.import_module("lessons.11_context_parallel.blockwise")
U = importlib.import_module("lessons.11_context_parallel.ulysses")
C = importlib.import_module("lessons.11_context_parallel.checks")
CO = importlib.import_module("lessons.11_context_parallel.cost")
W = importlib.import_module("lessons.11_context_parallel.tests.workers")
B = importlib.import_module("lessons.11_context_parallel.bench")
README = Path(M.__file__).with_name("README.md")
WORLDS = (1, 2, 3, 4)
SEQ, HEADS, HEAD_DIM = 24, 12, 4  # 24 divisible by 2 cp and 12 by cp for cp = 1..4


@functools.cache
def rank_results() -> LazyWorlds:
    """One launch per world size (every configuration inside), shared by the classes; a world
    is launched when a test first reads it."""
    return LazyWorlds(WORLDS, lambda world: launch(W.cp_worker, world, (SEQ, HEADS, HEAD_DIM),
                                                   device="cpu", timeout_s=60))


@launch_once
def subgroup_results(variant: str) -> dict:
    """One launch of 4 ranks per variant: over ranks {1}, {0, 2} and {1, 2, 3}, the others idle
    (a failing member ends the launch at once: workers.subgroup_worker)."""
    return {4: launch(W.subgroup_worker, 4, (variant, SEQ, HEADS, HEAD_DIM), device="cpu", timeout_s=60)}


def readme_text() -> str:
    return " ".join(README.read_text().split())


def qkv(seed: int, *shape: int, dtype=torch.float64, value_dim: int | None = None):
    """q, k, v, w of shape (..., n, d) (v and w: value_dim columns), a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    last = shape[-1] if value_dim is None else value_dim
    shapes = [shape, shape, (*shape[:-1], last), (*shape[:-1], last)]
    return [torch.randn(*s, generator=generator, dtype=dtype) for s in shapes]


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def expected_tiles(cp: int, rank: int, layout: str, causal: bool) -> int:
    """Tiles rank `rank` computes, written out (the zigzag exercise's formula is not used here)."""
    chunks = (2 * rank, 2 * rank + 1) if layout == "contiguous" else (rank, 2 * cp - 1 - rank)
    return sum(c + 1 for c in chunks) if causal else 4 * cp


def reference_attention(q, k, v, causal: bool, scale: float | None = None, groups: int = 1):
    """Plain softmax attention, float64, autograd through it: (out, lse), SDPA's top-left mask."""
    k, v = (t.repeat_interleave(groups, dim=-3) if groups > 1 else t for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.nan_to_num(torch.exp(scores - lse[..., None])) @ v, lse


class RankCase(unittest.TestCase):
    def configs(self, prefix: str):
        """(where, world, rank, key, value) for every configuration starting with prefix."""
        variant = prefix.split("/")[0]
        if not prefix.startswith(f"{variant}/subgroup"):
            for where, world, rank, key, value, _ in rank_configurations(rank_results(), prefix, "cp"):
                yield where, world, rank, key, value
        if variant in C.VARIANTS and prefix in (f"{variant}/", f"{variant}/subgroup"):
            for where, world, rank, key, value, _ in rank_configurations(subgroup_results(variant),
                                                                         prefix, "world"):
                yield where, world, rank, key, value

    def assert_ran(self, where: str, value: dict) -> None:
        self.assertNotIn("error", value, f"{where}: expected a result, got {value.get('error')}")

    def assert_exact(self, prefix: str):
        count = 0
        for where, _, _, _, value in self.configs(prefix):
            count += 1
            with self.subTest(where=where):
                self.assert_ran(where, value)
                config = {k: value[k] for k in ("cp", "causal", "layout", "engine", "kv_heads", "group")}
                self.assertLessEqual(value["out_gap"], C.TOLERANCE,
                                     f"{where} {config}: output max |ours - sdpa| expected <= "
                                     f"{C.TOLERANCE:g}, got {value['out_gap']:.3g}")
                for name, found in zip(("dQ", "dK", "dV"), value["grad_gaps"]):
                    self.assertLessEqual(found, C.TOLERANCE,
                                         f"{where} {config}: {name} max |ours - sdpa| expected <= "
                                         f"{C.TOLERANCE:g}, got {found:.3g}")
        self.assertGreater(count, 0, f"no configuration starts with {prefix!r}")


# ============================================================================ online-softmax


@exercise("online-softmax")
class TestOneTile(unittest.TestCase):
    def test_hand_worked_tile(self):
        """One head, d = 1 (scale 1), queries 0 and 1, keys 0 and 1, values 1 and 3: row 0's
        scores (0, 0) give out 2, lse log 2; row 1's (0, 1) give (1 + 3e) / (1 + e), lse
        log(1 + e). With the causal mask row 0 sees key 0 only: out 1, lse 0. Scale 2: row 1's
        scores (0, 2)."""
        q = torch.tensor([[[0.0], [1.0]]], dtype=torch.float64)
        k, v = q.clone(), torch.tensor([[[1.0], [3.0]]], dtype=torch.float64)
        e = math.e
        cases = {
            "no mask": (None, None, [2.0, (1 + 3 * e) / (1 + e)], [math.log(2), math.log(1 + e)]),
            "causal": (torch.tensor([[True, False], [True, True]]), None,
                       [1.0, (1 + 3 * e) / (1 + e)], [0.0, math.log(1 + e)]),
            "scale 2": (None, 2.0, [2.0, (1 + 3 * e**2) / (1 + e**2)], [math.log(2), math.log(1 + e**2)]),
        }
        for name, (mask, scale, out_rows, lse_rows) in cases.items():
            out, lse = BW.attend_block(q, k, v, mask, scale)
            with self.subTest(case=name):
                self.assertEqual(tuple(out.shape), (1, 2, 1), f"{name}: out shape expected (1, 2, 1), "
                                                               f"got {tuple(out.shape)}")
                self.assertLessEqual(gap(out[0, :, 0], torch.tensor(out_rows, dtype=torch.float64)), 1e-12,
                                     f"{name}: out rows expected {out_rows}, got {out[0, :, 0].tolist()}")
                self.assertLessEqual(gap(lse[0], torch.tensor(lse_rows, dtype=torch.float64)), 1e-12,
                                     f"{name}: lse rows expected {lse_rows}, got {lse[0].tolist()}")

    def test_hand_worked_merge(self):
        """Row 0: (out 1, lse 0) with (out 3, lse log 3): lse log 4, out (1 + 3 * 3) / 4 = 2.5.
        Row 1: (out 5, lse log 2) with (out 1, lse log 6): lse log 8, out (2 * 5 + 6) / 8 = 2.
        Row 2: (out 4, lse 1) with an empty block (out 0, lse -inf): unchanged. Either order."""
        out_a = torch.tensor([[[1.0], [5.0], [4.0]]], dtype=torch.float64)
        lse_a = torch.tensor([[0.0, math.log(2), 1.0]], dtype=torch.float64)
        out_b = torch.tensor([[[3.0], [1.0], [0.0]]], dtype=torch.float64)
        lse_b = torch.tensor([[math.log(3), math.log(6), float("-inf")]], dtype=torch.float64)
        want_out, want_lse = [2.5, 2.0, 4.0], [math.log(4), math.log(8), 1.0]
        for order, args in (("a, b", (out_a, lse_a, out_b, lse_b)), ("b, a", (out_b, lse_b, out_a, lse_a))):
            out, lse = BW.merge_partials(*args)
            with self.subTest(order=order):
                self.assertLessEqual(gap(out[0, :, 0], torch.tensor(want_out, dtype=torch.float64)), 1e-12,
                                     f"merge({order}): out rows expected {want_out}, got "
                                     f"{out[0, :, 0].tolist()}")
                self.assertLessEqual(gap(lse[0], torch.tensor(want_lse, dtype=torch.float64)), 1e-12,
                                     f"merge({order}): lse rows expected {want_lse}, got {lse[0].tolist()}")

    def test_masked_tile_gradients_sum_to_autograd(self):
        """Causal, 8 x 8, key tiles 0-2 and 3-7 with their slices of the mask: the second tile
        hides every key from rows 0-2 (their probabilities there are 0, not exp(S - lse)), and
        the tiles' gradients from the full row's lse sum to autograd's through masked attention."""
        q, k, v, w = qkv(9, 2, 8, 4, value_dim=3)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference_attention(*leaves, True)
        (ref_out * w).sum().backward()
        delta = (w * ref_out.detach()).sum(-1)
        keep = torch.ones(8, 8, dtype=torch.bool).tril()
        parts = [BW.attend_block_backward(q, k[:, cut], v[:, cut], w, ref_lse.detach(), delta, keep[:, cut])
                 for cut in (slice(0, 3), slice(3, 8))]
        dq = parts[0][0] + parts[1][0]
        dk, dv = (torch.cat([parts[0][i], parts[1][i]], dim=1) for i in (1, 2))
        for name, ours, leaf in zip(("dQ", "dK", "dV"), (dq, dk, dv), leaves):
            self.assertLessEqual(gap(ours, leaf.grad), C.TOLERANCE,
                                 f"causal, {name} summed over masked tiles keys 0-2, 3-7: max |diff| "
                                 f"from autograd expected <= {C.TOLERANCE:g}, got {gap(ours, leaf.grad):.3g}")

    def test_merge_is_exact_in_any_order(self):
        q, k, v, _ = qkv(2, 2, 6, 4)
        full = BW.attend_block(q, k, v)
        parts = [BW.attend_block(q, k[:, cut], v[:, cut]) for cut in (slice(0, 2), slice(2, 6))]
        for order, (a, b) in (("first, second", parts), ("second, first", parts[::-1])):
            out, lse = BW.merge_partials(*a, *b)
            self.assertLessEqual(gap(out, full[0]), C.TOLERANCE,
                                 f"merge of keys 0-1 and 2-5 ({order}): out max |diff| from one tile "
                                 f"expected <= {C.TOLERANCE:g}, got {gap(out, full[0]):.3g}")
            self.assertLessEqual(gap(lse, full[1]), C.TOLERANCE,
                                 f"merge ({order}): lse max |diff| expected <= {C.TOLERANCE:g}, "
                                 f"got {gap(lse, full[1]):.3g}")

    def test_fully_masked_rows_add_nothing(self):
        """A tile where a row sees no key: lse -inf, out 0, and merging it changes nothing."""
        q, k, v, _ = qkv(3, 2, 4, 4)
        mask = torch.zeros(4, 4, dtype=torch.bool)
        mask[2:] = True
        out, lse = BW.attend_block(q, k, v, mask)
        self.assertEqual(lse[:, :2].tolist(), [[float("-inf")] * 2] * 2,
                         f"rows 0-1 see no key: lse expected -inf, got {lse[:, :2].tolist()}")
        self.assertEqual(out[:, :2].abs().max().item(), 0.0,
                         f"rows 0-1 see no key: out expected 0, got {out[:, :2].tolist()}")
        visible = BW.attend_block(q, k, v)
        empty = BW.merge_partials(out[:, :2], lse[:, :2], out[:, :2], lse[:, :2])
        self.assertFalse(torch.isnan(empty[0]).any().item(),
                         f"merging two empty rows: expected out 0, got {empty[0].tolist()}")
        merged, merged_lse = BW.merge_partials(visible[0][:, :2], visible[1][:, :2], out[:, :2], lse[:, :2])
        self.assertLessEqual(gap(merged, visible[0][:, :2]), C.TOLERANCE,
                             f"merging an empty tile changed out by {gap(merged, visible[0][:, :2]):.3g}")
        self.assertEqual(merged_lse.tolist(), visible[1][:, :2].tolist(),
                         "merging an empty tile must leave lse unchanged")

    def test_tile_gradients_sum_to_autograd(self):
        """attend_block_backward over two key tiles, from the full row's lse, sums to autograd's,
        with the default scale and with scale 0.3 (rows of q, dO and lse all differ)."""
        q, k, v, w = qkv(4, 2, 8, 4, value_dim=3)
        for scale in (None, 0.3):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out, _ = reference_attention(*leaves, False, scale)
            (ref_out * w).sum().backward()
            out, lse = BW.attend_block(q, k, v, None, scale)
            delta = (w * out).sum(-1)
            parts = [BW.attend_block_backward(q, k[:, cut], v[:, cut], w, lse, delta, None, scale)
                     for cut in (slice(0, 3), slice(3, 8))]
            dq = parts[0][0] + parts[1][0]
            dk, dv = (torch.cat([parts[0][i], parts[1][i]], dim=1) for i in (1, 2))
            for name, ours, leaf in zip(("dQ", "dK", "dV"), (dq, dk, dv), leaves):
                with self.subTest(scale=scale, grad=name):
                    self.assertLessEqual(gap(ours, leaf.grad), C.TOLERANCE,
                                         f"scale {scale}: {name} summed over tiles keys 0-2, 3-7: max "
                                         f"|diff| from autograd expected <= {C.TOLERANCE:g}, got "
                                         f"{gap(ours, leaf.grad):.3g}")


# ============================================================================ flash-attention


@exercise("flash-attention")
class TestBlockwiseAttention(unittest.TestCase):
    """BlockwiseAttention with the online-softmax pieces replaced by oracles."""

    def setUp(self):
        patcher = W.oracles("online-softmax")
        patcher.__enter__()
        self.addCleanup(patcher.__exit__, None, None, None)

    def compare(self, config: str, q, k, v, w, causal: bool, **kwargs):
        """Ours and SDPA (float64), out and dQ, dK, dV."""
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        theirs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = BW.blockwise_attention(*ours, causal, **kwargs)
        sdpa_kwargs = {key: kwargs[key] for key in ("scale", "enable_gqa") if key in kwargs}
        ref = F.scaled_dot_product_attention(*theirs, is_causal=causal, **sdpa_kwargs)
        self.assertEqual(tuple(out.shape), tuple(ref.shape),
                         f"{config}: out shape expected {tuple(ref.shape)}, got {tuple(out.shape)}")
        self.assertLessEqual(gap(out.detach(), ref.detach()), C.TOLERANCE,
                             f"{config}: out max |ours - sdpa| expected <= {C.TOLERANCE:g}, got "
                             f"{gap(out.detach(), ref.detach()):.3g}")
        if ref.numel():
            (out * w).sum().backward()
            (ref * w).sum().backward()
            for name, a, b in zip(("dQ", "dK", "dV"), ours, theirs):
                got = a.grad if a.grad is not None else torch.zeros_like(a)
                want = b.grad if b.grad is not None else torch.zeros_like(b)
                self.assertLessEqual(gap(got, want), C.TOLERANCE,
                                     f"{config}: {name} max |ours - sdpa| expected <= {C.TOLERANCE:g}, "
                                     f"got {gap(got, want):.3g}")

    def test_equals_sdpa_float64(self):
        """(batch, heads, L, E) with Ev != E; L = S, L < S, L > S (causal aligned top left, as
        SDPA), odd sizes, blocks that do not divide them, one block, single rows."""
        for L, S in ((12, 12), (7, 11), (11, 7), (1, 1), (5, 1), (1, 5)):
            for causal in (False, True):
                for block_q, block_k in ((1, 2), (3, 5), (4, 4), (64, 64)):
                    q = qkv(10 + L, 2, 3, L, 5)[0]
                    _, k, v, _ = qkv(20 + S, 2, 3, S, 5, value_dim=3)
                    w = qkv(30 + L, 2, 3, L, 3)[0]
                    config = f"L={L} S={S} causal={causal} block_q={block_q} block_k={block_k}"
                    with self.subTest(config=config):
                        self.compare(config, q, k, v, w, causal, block_q=block_q, block_k=block_k)

    def test_scale_gqa_and_one_head(self):
        q, _, _, w = qkv(40, 2, 6, 9, 4)
        _, k, v, _ = qkv(41, 2, 2, 9, 4)
        self.compare("scale=0.3", q, q.flip(-2), w, w, True, scale=0.3, block_q=4, block_k=3)
        self.compare("enable_gqa, 6 query heads on 2 K/V heads", q, k, v, w, True, enable_gqa=True,
                     block_q=2, block_k=5)
        self.compare("one head, (L, E) inputs", q[0, 0], k[0, 0], v[0, 0], w[0, 0], True,
                     block_q=4, block_k=4)

    def test_lse_is_returned_and_differentiable(self):
        """return_lse=True: lse == logsumexp of the scaled, masked scores (fp64 for fp64 inputs),
        and a loss that reads the lse gets its gradient (d lse_i / d S_ij = P_ij)."""
        q, k, v, w = qkv(50, 2, 3, 9, 4)
        u = qkv(51, 2, 3, 9)[0]
        for causal in (False, True):
            ours = [t.clone().requires_grad_() for t in (q, k, v)]
            theirs = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = BW.blockwise_attention(*ours, causal, block_q=4, block_k=2, return_lse=True)
            ref_out, ref_lse = reference_attention(*theirs, causal)
            config = f"causal={causal}, 9 x 9, blocks 4 x 2"
            self.assertEqual(lse.dtype, torch.float64,
                             f"{config}: lse dtype expected float64, got {lse.dtype}")
            self.assertLessEqual(gap(lse.detach(), ref_lse.detach()), C.TOLERANCE,
                                 f"{config}: lse max |diff| expected <= {C.TOLERANCE:g}, got "
                                 f"{gap(lse.detach(), ref_lse.detach()):.3g}")
            ((out * w).sum() + (lse * u).sum()).backward()
            ((ref_out * w).sum() + (ref_lse * u).sum()).backward()
            for name, a, b in zip(("dQ", "dK", "dV"), ours, theirs):
                self.assertLessEqual(gap(a.grad, b.grad), C.TOLERANCE,
                                     f"{config}, loss reading out and lse: {name} max |diff| expected "
                                     f"<= {C.TOLERANCE:g}, got {gap(a.grad, b.grad):.3g}")

    def test_empty_sequences(self):
        """S = 0: out 0 (as SDPA), lse -inf, zero dQ; L = 0: an empty output."""
        q, _, _, _ = qkv(60, 1, 2, 3, 4)
        empty = torch.zeros(1, 2, 0, 4, dtype=torch.float64)
        out, lse = BW.blockwise_attention(q, empty, empty, False, return_lse=True)
        self.assertEqual((tuple(out.shape), out.abs().sum().item()), ((1, 2, 3, 4), 0.0),
                         f"S = 0: expected zeros of shape (1, 2, 3, 4), got {out.tolist()}")
        self.assertTrue(bool(torch.isneginf(lse).all()), f"S = 0: lse expected -inf, got {lse.tolist()}")
        out = BW.blockwise_attention(empty, q, q, True)
        self.assertEqual(tuple(out.shape), (1, 2, 0, 4),
                         f"L = 0: shape expected (1, 2, 0, 4), got {tuple(out.shape)}")

    def test_float32_and_bf16(self):
        """Against float64 SDPA on the same rounded inputs: within checks.py's bounds, out in the
        inputs' dtype, and (flash-attention's test criterion) at most twice SDPA's own error in
        that dtype, over both masks. bf16 also with key blocks of 4: 17 merges per output row and
        17 sums per dQ row, each of which must happen in fp32 to stay within 1 eps."""
        for dtype in (torch.float32, torch.bfloat16):
            blocks = ((16, 24), (16, 4)) if dtype == torch.bfloat16 else ((16, 24),)
            runs = {(causal, b): C.precision_gaps(dtype, 0, causal, blocks=b)
                    for causal in (False, True) for b in blocks}
            for (causal, b), found in runs.items():
                config = f"{dtype}, causal={causal}, (2, 4, 67, 32), blocks {b[0]} x {b[1]}"
                self.assertEqual(found["ours_dtype"], str(dtype).removeprefix("torch."),
                                 f"{config}: out dtype expected the inputs', got {found['ours_dtype']}")
                for name, value in zip(("out", "dQ", "dK", "dV"), found["ours"]):
                    self.assertLessEqual(value, found["bound"],
                                         f"{config}: {name} error expected <= {found['bound']:g} eps x "
                                         f"max |ref|, got {value:.3f}")
            ours = max(max(r["ours"]) for r in runs.values())
            sdpa = max(max(r["sdpa"]) for r in runs.values())
            self.assertLessEqual(ours, 2 * sdpa, f"{dtype}: our worst error expected <= 2 x sdpa's "
                                                 f"{sdpa:.3f} eps, got {ours:.3f} eps")

    def test_queries_are_tiled_and_hidden_tiles_skipped(self):
        """Causal, L = S = 16, 4 x 4 tiles: 10 of the 16 have a visible entry; forward and
        backward each compute exactly those, every tile at most block_q x block_k, the forward
        with query blocks outer and the backward with key blocks outer (FlashAttention-2)."""
        q, k, v, w = (t.requires_grad_() for t in qkv(70, 1, 2, 16, 4))
        calls = {"forward": [], "backward": []}

        def start(tile, full):  # where the tile's rows begin in the full tensor
            rows = tile.shape[-2]
            return next((i for i in range(full.shape[-2]) if torch.equal(tile, full[..., i:i + rows, :])),
                        None)

        def spy(kind, real):
            def record(q_tile, k_tile, *args, **kwargs):
                calls[kind].append((q_tile.shape[-2], k_tile.shape[-2], start(q_tile, q.detach()),
                                    start(k_tile, k.detach())))
                return real(q_tile, k_tile, *args, **kwargs)
            return record

        with mock.patch.object(BW, "attend_block", spy("forward", BW.attend_block)), \
                mock.patch.object(BW, "attend_block_backward", spy("backward", BW.attend_block_backward)):
            (BW.blockwise_attention(q, k, v, True, block_q=4, block_k=4) * w).sum().backward()
        for kind, seen in calls.items():
            self.assertEqual(len(seen), 10, f"{kind}: causal 16 x 16 in 4 x 4 tiles: expected the 10 "
                                            f"visible tiles, got {len(seen)} calls")
            self.assertEqual(max(s[:2] for s in seen), (4, 4),
                             f"{kind}: largest tile expected (4, 4), got {max(s[:2] for s in seen)}")
            side = "query" if kind == "forward" else "key"
            outer = [s[2] if kind == "forward" else s[3] for s in seen]
            self.assertEqual(outer, sorted(outer), f"{kind}: the {side} block starts, tile by tile, expected "
                                                   f"non-decreasing ({side} blocks outer), got {outer}")

    def test_no_length_by_length_matrix_is_saved(self):
        """Autograd keeps q, k, v, out, lse and the positions: (4 H s d + H s) * 8 + 2 s * 8
        bytes, nothing of H s s (sdpa's math path on CPU keeps its probabilities)."""
        heads, seq, d = 2, 64, 4
        q, k, v, _ = (t.requires_grad_() for t in qkv(5, heads, seq, d))
        saved = {}

        def pack(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            BW.blockwise_attention(q, k, v, True, block_q=16, block_k=16)
        want = (4 * heads * seq * d + heads * seq) * 8 + 2 * seq * 8
        self.assertEqual(sum(saved.values()), want, f"bytes saved for backward: expected {want} (q, k, "
                                                    f"v, out, lse, positions), got {sum(saved.values())}")

    def test_lesson_07_tracker_sees_no_length_by_length_matrix(self):
        """Lesson 07's MemoryTracker on the forward: what stays alive is out, lse and the
        positions; the peak is a few block x block tiles, far below one s x s matrix, which
        plain softmax attention does allocate."""
        heads, seq, d, block = 2, 96, 4, 16
        q, k, v, _ = (t.requires_grad_() for t in qkv(6, heads, seq, d))
        square = heads * seq * seq * 8
        peaks = {}
        for name, attend in (("blockwise", lambda: BW.blockwise_attention(q, k, v, True, block_q=block,
                                                                          block_k=block)),
                             ("plain", lambda: torch.softmax(q @ k.transpose(-1, -2), -1) @ v)):
            tracker = M.cost.memory.MemoryTracker()
            tracker.mark([q, k, v], "parameter")  # the inputs, made before: not activations
            with tracker, tracker.phase("forward"):
                out = attend()
            peaks[name] = tracker.peak_bytes - 3 * heads * seq * d * 8
            if name == "blockwise":
                kept = tracker.breakdown()["activation"]
                want = (heads * seq * d + heads * seq) * 8 + 2 * seq * 8
                self.assertEqual(kept, want, f"bytes alive after the forward: expected {want} (out, lse, "
                                             f"positions), got {kept}")
            del out
        self.assertLess(peaks["blockwise"], square / 4, f"blockwise peak expected < a quarter of the "
                                                        f"{square} B s x s matrix, got {peaks['blockwise']}")
        self.assertGreaterEqual(peaks["plain"], square, f"plain attention's peak expected >= {square}, "
                                                        f"got {peaks['plain']}")

    def test_bad_arguments(self):
        q, k, v, _ = qkv(80, 1, 4, 5, 2)
        for kwargs, fragment in (({"block_q": 0}, "block sizes must be >= 1"),
                                 ({"block_k": -1}, "block sizes must be >= 1")):
            with self.assertRaisesRegex(ValueError, fragment, msg=f"{kwargs}: expected ValueError"):
                BW.blockwise_attention(q, k, v, **kwargs)
        with self.assertRaisesRegex(ValueError, "enable_gqa", msg="4 query heads on 2 K/V heads "
                                                                   "without enable_gqa: expected ValueError"):
            BW.blockwise_attention(q, k[:, :2], v[:, :2])


# ============================================================================ zigzag


@exercise("zigzag")
class TestLayouts(unittest.TestCase):
    def test_chunks(self):
        for cp, layout, want in ((4, "contiguous", [(0, 1), (2, 3), (4, 5), (6, 7)]),
                                 (4, "zigzag", [(0, 7), (1, 6), (2, 5), (3, 4)]),
                                 (3, "zigzag", [(0, 5), (1, 4), (2, 3)])):
            got = [M.chunk_ids(cp, r, layout) for r in range(cp)]
            self.assertEqual(got, want, f"chunk_ids, cp = {cp}, {layout}: expected {want}, got {got}")
        with self.assertRaisesRegex(ValueError, "striped", msg="an unknown layout: expected ValueError"):
            M.chunk_ids(2, 0, "striped")

    def test_positions_by_hand(self):
        """seq 12 on cp = 3 (chunks of 2): zig-zag rank r holds chunks r and 5 - r."""
        cases = {(16, 2, 1, "zigzag"): list(range(4, 12)), (16, 2, 0, "zigzag"): [0, 1, 2, 3, 12, 13, 14, 15],
                 (12, 3, 0, "zigzag"): [0, 1, 10, 11], (12, 3, 1, "zigzag"): [2, 3, 8, 9],
                 (12, 3, 2, "zigzag"): [4, 5, 6, 7], (12, 3, 1, "contiguous"): [4, 5, 6, 7],
                 (2, 1, 0, "zigzag"): [0, 1]}
        for args, want in cases.items():
            got = M.sequence_positions(*args)
            self.assertEqual((got.dtype, got.tolist()), (torch.int64, want),
                             f"sequence_positions{args}: expected int64 {want}, got {got.dtype} "
                             f"{got.tolist()}")

    def test_positions_cover_the_sequence_once(self):
        for cp in (1, 2, 3, 5):
            for layout in M.LAYOUTS:
                seq = 2 * cp * 3
                held = [M.sequence_positions(seq, cp, r, layout) for r in range(cp)]
                every = sorted(torch.cat(held).tolist())
                self.assertEqual(every, list(range(seq)), f"cp = {cp}, {layout}, seq {seq}: the ranks' "
                                                          f"positions expected 0..{seq - 1} once, got "
                                                          f"{every}")

    def test_sequence_not_divisible_is_refused(self):
        for seq, cp in ((10, 3), (9, 1), (20, 4)):
            with self.assertRaisesRegex(ValueError, f"not divisible by 2 \\* cp = {2 * cp}",
                                        msg=f"seq {seq} on cp = {cp}: expected ValueError"):
                M.sequence_positions(seq, cp, 0, "zigzag")

    def test_tiles_per_rank(self):
        """Contiguous: 4r + 3; zig-zag: 2 cp + 1 everywhere; no mask: 4 cp everywhere."""
        for cp in (1, 2, 3, 4, 5, 8):
            for layout, causal, want in (("contiguous", True, [4 * r + 3 for r in range(cp)]),
                                         ("zigzag", True, [2 * cp + 1] * cp),
                                         ("zigzag", False, [4 * cp] * cp),
                                         ("contiguous", False, [4 * cp] * cp)):
                got = M.tiles_per_rank(cp, layout, causal)
                self.assertEqual(got, want, f"tiles_per_rank(cp={cp}, {layout}, causal={causal}): "
                                            f"expected {want}, got {got}")


# ============================================================================ ring-attention


@exercise("ring-attention")
class TestRingAttention(RankCase):
    def test_equals_sdpa_for_every_cp_mask_and_layout(self):
        self.assert_exact("ring/")

    def test_on_a_subgroup(self):
        """Over ranks {1} of 2, {0, 2} of 3 and {1, 2, 3} of 4 (cp = 3): the others idle."""
        self.assert_exact("ring/subgroup")

    def test_grouped_query_attention(self):
        self.assert_exact("ring/gqa")

    def test_bf16_accumulates_in_fp32(self):
        """bf16 q, k, v against float64 attention on the same rounded inputs, in units of bf16's
        eps x max |reference|. The output is one fp32 (wide) result rounded once to bf16: at most
        eps / 2 from rounding plus the fp32 sums' error (about (d + tiles) 2^-24 relative, under
        0.01 eps): 0.51 eps; measured <= 0.38. dQ also reads delta from the rounded output
        (checks.py's 1 eps); measured <= 0.56. A running out or lse kept in bf16 rounds at every
        merge (measured up to 1.0 and 4 eps). dK, dV travel in bf16 by design: not bounded here.
        dQ against its exact value from the same bf16 inputs, delta read from the returned output
        (or, for a backward that saved the fp32 output, from the exact one; either way no delta
        error: workers.dq_beyond_one_rounding): summed over the tiles in fp32 and rounded once, each
        element is within eps / 2 of itself plus the fp32 work's error, which Higham's gamma_n
        on each product and sum (n <= 3 d + seq + 5 = 41 roundings, the scores' error carried
        through exp) bounds by 0.002 eps x max |dQ| here: 0.01 allowed; measured <= 1e-5. Summed in
        bf16, each tile's partial sum is rounded again: 0.076 to 0.32 eps beyond (at least 0.045
        over seeds 0-9 and cp = 1-4). Run over the subgroups' launch (cp = 1, 2, 3), where a
        failing member ends it at once."""
        count = 0
        for where, _, _, _, value, _ in rank_configurations(subgroup_results("ring"), "bf16/ring", "world"):
            count += 1
            with self.subTest(where=where):
                self.assert_ran(where, value)
                self.assertEqual(value["dtype"], "bfloat16", f"{where}: out dtype expected the inputs' "
                                                             f"bfloat16, got {value['dtype']}")
                for name, found, bound in zip(("out", "dQ"), value["errors"], (0.51, 1.0)):
                    self.assertLessEqual(found, bound, f"{where}: {name} error expected <= {bound:g} eps x "
                                                       f"max |ref|, got {found:.3f}")
                beyond = value["dq_beyond_one_rounding"]
                self.assertLessEqual(beyond, 0.01, f"{where}: dQ expected within one rounding (eps / 2 of "
                                                   f"each element) of its exact value, + 0.01 eps x max "
                                                   f"|dQ| for the fp32 sums, got {beyond:.3f} eps beyond: "
                                                   f"dQ summed over the tiles in bf16, not fp32?")
        self.assertGreater(count, 0, "no bf16 ring configuration ran")

    def test_exchange_steps(self):
        for where, _, _, _, value in self.configs("ring/"):
            with self.subTest(where=where):
                self.assert_ran(where, value)
                cp = value["cp"]
                got, want = (value["forward_steps"], value["backward_steps"]), (cp - 1, cp if cp > 1 else 0)
                self.assertEqual(got, want, f"{where}: (forward, backward) exchange steps expected {want}, "
                                            f"got {got}")

    def test_bytes_equal_the_formula(self):
        for where, _, _, _, value in self.configs("ring/"):
            with self.subTest(where=where):
                self.assert_ran(where, value)
                want = M.ring_bytes_per_rank(value["seq"], HEADS, HEAD_DIM, value["cp"], 8,
                                             value["kv_heads"])._asdict()
                self.assertEqual(value["bytes"], want, f"{where}: bytes sent expected {want}, got "
                                                       f"{value['bytes']}")

    def test_masked_tiles_are_skipped(self):
        """Forward and backward each compute the visible tiles of two halves of the shard by two
        halves of the held block: with one position per chunk, 1 x 1 tiles."""
        for where, _, _, _, value in self.configs("ring/"):
            with self.subTest(where=where):
                self.assert_ran(where, value)
                want = expected_tiles(value["cp"], value["rank_in_group"], value["layout"], value["causal"])
                self.assertEqual(value["tiles"], want, f"{where}: tiles computed expected {want}, got "
                                                       f"{value['tiles']}")
                got = value["backward_tiles"]
                self.assertEqual(got, want, f"{where}: backward tiles computed expected {want}, got {got}")


# ============================================================================ ulysses


@exercise("ulysses")
class TestUlysses(RankCase):
    def test_equals_sdpa_on_both_engines(self):
        self.assert_exact("ulysses/")

    def test_on_a_subgroup(self):
        self.assert_exact("ulysses/subgroup")

    def test_grouped_query_attention_and_replicated_kv_heads(self):
        """K/V heads split over cp (4 on 2, 6 on 3) or replicated (2 on 4)."""
        self.assert_exact("ulysses/gqa")

    def test_bytes_equal_the_formula(self):
        for where, _, _, _, value in self.configs("ulysses/"):
            if value.get("engine") == "p2p":  # torch's all-to-all is not counted
                with self.subTest(where=where):
                    self.assert_ran(where, value)
                    want = U.ulysses_bytes_per_rank(value["seq"], HEADS, HEAD_DIM, value["cp"], 8,
                                                    value["kv_heads"])._asdict()
                    self.assertEqual(value["bytes"], want, f"{where}: bytes sent expected {want}, got "
                                                           f"{value['bytes']}")


class TestWhole(RankCase):
    def test_ring_equals_ulysses_equals_one_process(self):
        count = 0
        for where, _, _, _, value in self.configs("whole"):
            count += 1
            with self.subTest(where=where):
                for key in ("ring_vs_sdpa", "ulysses_vs_sdpa", "ring_vs_ulysses"):
                    self.assertLessEqual(value.get(key, float("inf")), C.TOLERANCE,
                                         f"{where}: {key} expected <= {C.TOLERANCE:g}, got "
                                         f"{value.get(key, value)}")
        self.assertEqual(count, sum(len(r) for r in rank_results().values()),
                         "expected a 'whole' result on every rank")

    def test_bytes_compare(self):
        """Ulysses sends cp / 2 times fewer bytes forward than the ring (equal at cp = 2)."""
        for cp in (2, 4, 8):
            ring = M.ring_bytes_per_rank(4096, 32, 128, cp, 2).forward
            ulysses = U.ulysses_bytes_per_rank(4096, 32, 128, cp, 2).forward
            self.assertEqual(ring * 2, ulysses * cp, f"cp = {cp}: ring {ring} B expected cp / 2 x "
                                                     f"Ulysses's {ulysses} B")

    def test_gpt_training_steps_with_cp_equal_one_process(self):
        """Lesson 07's TinyGPT, 3 SGD steps, float64: CP = 2 (ring, zig-zag) and CP = 3
        (ring, contiguous) give the losses and gradients of one process."""
        for world, layout in ((2, "zigzag"), (3, "contiguous")):
            results = launch(W.gpt_worker, world, ("ring", layout), device="cpu", timeout_s=60)
            for rank, checks in enumerate(results):
                for check in checks:
                    with self.subTest(world=world, rank=rank, check=check["name"]):
                        self.assertTrue(check["passed"], f"cp = {world} ({layout}) rank {rank}: "
                                                         f"{check['name']}: {check['detail']}")

    def test_activation_bytes_per_rank_scale_as_one_over_cp(self):
        """Lesson 07's tracker on a layer with ring attention: the bytes kept per rank are
        exactly 1/cp of one process's, and grow linearly with the sequence."""
        kept = {world: launch(C.activation_worker, world, ([16, 32],), device="cpu", timeout_s=60)
                for world in (1, 2)}
        one = kept[1][0]
        self.assertEqual(one[1], 2 * one[0],
                         f"one process, seq 16 and 32: expected twice the bytes, got {one}")
        for per_rank in kept[2]:
            self.assertEqual([2 * b for b in per_rank], one,
                             f"cp = 2: a rank's bytes x 2 expected {one}, got {[2 * b for b in per_rank]}")

    def test_bench_replays_each_ranks_tiles(self):
        for layout in M.LAYOUTS:
            rows = [B.rank_compute(32, 4, rank, layout, 1, 2) for rank in range(4)]
            tiles, diagonal = [r[0] for r in rows], [r[2] for r in rows]
            want = M.tiles_per_rank(4, layout)
            self.assertEqual(tiles, want, f"{layout}: bench tiles expected {want}, got {tiles}")
            self.assertEqual(diagonal, [2] * 4,
                             f"{layout}: diagonal tiles per rank expected 2, got {diagonal}")

    def test_demo_passes_with_the_defaults_at_world_size_3(self):
        self.assertEqual(C.main(["--device", "cpu", "--world-size", "3", "--timeout", "60"]), 0,
                         "python lessons/11_context_parallel/main.py --world-size 3: expected exit 0")

    def test_defaults_are_accepted_at_world_sizes_1_to_4(self):
        for world in (1, 2, 3, 4):
            for variant in C.VARIANTS:
                args = C.parse_args(["--world-size", str(world), "--variant", variant])
                self.assertEqual((args.seq % (2 * world), args.heads % world), (0, 0),
                                 f"defaults at --world-size {world} --variant {variant}: seq {args.seq} "
                                 f"and heads {args.heads} expected to split")

    def test_pytorch_context_parallel_on_cpu(self):
        """torch 2.13's context_parallel does not run on CPU (the README quotes this error);
        if it starts to, the README and the notebook must change."""
        results = launch(W.torch_cp_worker, 2, (16, 2, 8), device="cpu", timeout_s=60)
        for message in results:
            for fragment in ("_scaled_dot_product_flash_attention_for_cpu",
                             "does not have a sharding strategy registered"):
                self.assertIn(fragment, message, f"torch's context_parallel on CPU: expected the error "
                                                 f"naming {fragment!r}, got {message!r}")
        self.assertIn("does not have a sharding strategy registered", readme_text(),
                      "the README must quote the error")


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed (integers and exact fractions:
    the same on any CPU; the bench's timings are one machine's and not tested)."""

    def assert_quoted(self, text: str, quoted: str, what: str) -> None:
        self.assertIn(quoted, text, f"the README should quote {what} as {quoted!r}")

    def test_memory_of_a_128k_context(self):
        text = readme_text()
        s, h, a, layers = 131072, 4096, 32, 32
        for cp in (1, 8, 16):
            per_layer = M.activation_bytes_per_rank(s, h, a, cp)
            self.assert_quoted(text, f"{per_layer / 1e9:,.2f} GB", f"cp = {cp}'s bytes per layer")
            self.assert_quoted(text, f"{per_layer * layers / 1e9:,.1f} GB",
                               f"cp = {cp}'s bytes for 32 layers")
        scores = (M.activation_bytes_per_rank(s, h, a, 1, flash=False)
                  - M.activation_bytes_per_rank(s, h, a, 1))
        self.assert_quoted(text, f"{scores / 1e12:,.2f} TB", "the score matrices' bytes")

    def test_bytes_at_128k(self):
        text = readme_text()
        b = M.shard_bytes(131072, 32, 128, 8, 2)
        self.assertEqual(b, 2**27, f"B at 128k, 32 heads of 128, cp 8, bf16: expected 128 MiB, got {b}")
        for kv, ring_text, ulysses_text in ((32, "{:.2f} GiB", "{:.0f} MiB"),
                                            (8, "{:.0f} MiB", "{:.0f} MiB")):
            ring = M.ring_bytes_per_rank(131072, 32, 128, 8, 2, kv).forward
            ulysses = U.ulysses_bytes_per_rank(131072, 32, 128, 8, 2, kv).forward
            self.assert_quoted(text, ring_text.format(ring / (2**30 if "GiB" in ring_text else 2**20)),
                               f"the ring's forward bytes with {kv} K/V heads")
            self.assert_quoted(text, ulysses_text.format(ulysses / 2**20), f"Ulysses's with {kv} K/V heads")
        gqa = U.ulysses_bytes_per_rank(131072, 32, 128, 8, 2, 8).forward
        self.assert_quoted(text, f"from 3.5 B to {gqa / b:.1f} B", "Ulysses's GQA bytes in units of B")
        for cp, quoted in ((2, "2 B at cp = 2"), (4, "3 B at cp = 4"), (8, "3.5 B at cp = 8")):
            units = (U.ulysses_bytes_per_rank(4096, 32, 128, cp, 2).forward
                     / M.shard_bytes(4096, 32, 128, cp, 2))
            self.assertIn(f"{units:g} B at cp = {cp}", text, f"Ulysses at cp = {cp}: expected {quoted}")

    def test_worked_tiles_flops_and_demo_bytes(self):
        text = readme_text()
        for layout in M.LAYOUTS:
            self.assert_quoted(text, f"{M.tiles_per_rank(4, layout)}", f"{layout}'s tiles at cp = 4")
            self.assert_quoted(text, f"{[int(w) for w in M.causal_work_per_rank(4, layout)]}",
                               f"{layout}'s FLOP units at cp = 4")
        for cp in (4, 8):
            work, tiles = M.causal_work_per_rank(cp, "contiguous"), M.tiles_per_rank(cp, "contiguous")
            self.assertEqual(max(work) / (sum(work) / cp), 2 - 1 / cp,
                             f"cp = {cp}: FLOP ratio expected 2 - 1/cp, got {work}")
            self.assert_quoted(text, f"**{2 - 1 / cp:g}** at cp = {cp}", f"the FLOP ratio at cp = {cp}")
            ratio = max(tiles) / (sum(tiles) / cp)
            self.assert_quoted(text, f"{max(tiles)}/{sum(tiles) // cp} = {ratio:.2f}",
                               f"the tile ratio at cp = {cp}")
        ring, ulysses = M.ring_bytes_per_rank(48, 12, 8, 4, 8), U.ulysses_bytes_per_rank(48, 12, 8, 4, 8)
        self.assert_quoted(text, f"B = 12 x 12 x 8 x 8 = {M.shard_bytes(48, 12, 8, 4, 8):,} bytes",
                           "the demo's B")
        self.assert_quoted(text, f"{ring.forward:,} B forward and {ring.backward:,} B backward",
                           "the demo's ring bytes")
        self.assert_quoted(text, f"{ulysses.forward:,} B each way", "the demo's Ulysses bytes")
        parser_defaults = C.parse_args(["--world-size", "4"])
        self.assertEqual((parser_defaults.seq, parser_defaults.heads, parser_defaults.head_dim), (48, 12, 8),
                         "the worked demo numbers assume the defaults seq 48, 12 heads of 8")

    def test_causal_pairs_per_layout(self):
        text = readme_text()
        seq, cp = 4096, 4
        layouts = {layout: [M.sequence_positions(seq, cp, r, layout) for r in range(cp)]
                   for layout in M.LAYOUTS}
        layouts["striped"] = [torch.arange(r, seq, cp) for r in range(cp)]
        pairs = {name: [CO.causal_pairs(p) for p in positions] for name, positions in layouts.items()}
        self.assertEqual(sum(pairs["zigzag"]), seq * (seq + 1) // 2,
                         f"the ranks' pairs must sum to s (s + 1) / 2, got {pairs['zigzag']}")
        self.assert_quoted(text, f"contiguous ranks see {min(pairs['contiguous']):,} to "
                                 f"{max(pairs['contiguous']):,}", "contiguous pairs")
        self.assert_quoted(text, f"zig-zag ranks {pairs['zigzag'][0]:,} each", "zig-zag pairs")
        self.assertEqual(len(set(pairs["zigzag"])), 1, f"zig-zag pairs expected equal, got {pairs['zigzag']}")
        low, high = min(pairs["striped"]), max(pairs["striped"])
        self.assert_quoted(text, f"striped ranks {low:,} to {high:,} (within {high / low - 1:.1%})",
                           "striped pairs")

    def test_flops_overlap_and_buffers(self):
        text = readme_text()
        forward, backward = CO.attention_flops(100, 3, 4)
        self.assertEqual((forward, backward), (4 * 1200, 10 * 1200), "attention_flops: 4 and 10 per pair")
        self.assert_quoted(text, f"**{backward / forward:g} times the forward**", "the backward's FLOPs")
        quoted = {(8, 450e9, False): "**{:,.0f}** tokens per rank over NVLink",
                  (8, 50e9, False): "**{:,.0f}** over InfiniBand", (32, 450e9, False): "({:,.0f} and",
                  (32, 50e9, False): "{:,.0f} with as many K/V heads", (8, 450e9, True): "**{:,.0f}** and",
                  (8, 50e9, True): "**{:,.0f}**. The backward"}
        for (kv, link, causal), pattern in quoted.items():
            tokens = CO.ring_overlap_min_tokens(32, kv, 2, 989e12, link, causal)
            self.assert_quoted(text, pattern.format(tokens), f"the overlap bound ({kv} K/V heads, "
                                                             f"{link:g} B/s, causal zig-zag {causal})")
        for cp, fits in ((8, True), (64, False)):
            n = 131072 // cp
            self.assertEqual(n >= CO.ring_overlap_min_tokens(32, 8, 2, 989e12, 50e9, True), fits,
                             f"128k on {cp} GPUs over InfiniBand: n = {n}")
            self.assert_quoted(text, f"({n:,} per rank)", f"the tokens per rank on {cp} GPUs")
        buffers = CO.kv_buffer_bytes(131072, 8, 128, 8, 2)
        self.assert_quoted(text, f"ring {buffers.ring_forward // 2**20} MiB forward and "
                                 f"{buffers.ring_backward // 2**20} MiB backward against "
                                 f"{buffers.all_gather // 2**20} MiB gathered", "the K/V buffers")
        self.assert_quoted(text, f"(B_kv = {M.shard_bytes(131072, 8, 128, 8, 2) // 2**20} MiB)", "B_kv")

    def test_precision_bounds_quoted(self):
        text = readme_text()
        self.assert_quoted(text, "bf16 gets 1 eps", "the bf16 bound")
        self.assertEqual(C.precision_bound(torch.bfloat16, 32, 67, 24), 1.0, "bf16 bound: 1 eps")
        self.assertEqual(C.precision_bound(torch.float32, 32, 67, 24), 32 + 3,
                         "float32 bound: E + key blocks")


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        for argv, fragment in ((["--seq", "20", "--world-size", "4"], "--seq 20"),
                               (["--variant", "ulysses", "--heads", "6", "--world-size", "4"], "--heads 6"),
                               (["--heads", "12", "--kv-heads", "5"], "--kv-heads 5"),
                               (["--variant", "ulysses", "--kv-heads", "3", "--world-size", "2"],
                                "--kv-heads 3"),
                               (["--layout", "striped"], "invalid choice"),
                               (["--world-size", "0"], "out of range")):
            with self.subTest(argv=argv):
                assert_argument_error(self, C.parse_args, argv, fragment)

    @torchrun_demo(["--seq", "8", "--heads", "2"])
    def test_under_torchrun(self, report):
        self.assertTrue(report["passed"], f"under torchrun, every check expected to pass, got "
                                          f"{[c for c in report['checks'] if not c['passed']]}")
        self.assertEqual((report["world_size"], report["device"], report["backend"]),
                         (2, "cpu", "gloo"), "torchrun --nproc-per-node=2 on CPU")
        self.assertEqual(report["metrics"]["tiles_per_rank"], M.tiles_per_rank(2, "zigzag"),
                         "tiles per rank under torchrun")


if __name__ == "__main__":
    unittest.main()
