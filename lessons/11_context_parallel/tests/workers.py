"""Functions that lesson 11's tests run on spawned ranks (importable by their dotted name).

One launch per world size runs every configuration. Each exercise is tested alone: the pieces
of OTHER exercises it needs are replaced by oracles written here (plain softmax attention, the
layouts by list comprehension), so a mistake in one exercise fails that exercise's tests and no
other's. Every configuration runs in its own try: a stub that raises is a failed result, not a
dead rank. The unpatched runs (everything the learner wrote together) are the integration.
"""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import torch
import torch.nn.functional as F

from lessons._launch import RankContext

M = importlib.import_module("lessons.11_context_parallel.main")
U = importlib.import_module("lessons.11_context_parallel.ulysses")
C = importlib.import_module("lessons.11_context_parallel.checks")


# ============================================================================ oracles


def oracle_attend_block(q, k, v, mask=None):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v, lse


def oracle_merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logsumexp(torch.stack([lse_a, lse_b]), dim=0)
    weights = torch.nan_to_num(torch.exp(torch.stack([lse_a, lse_b]) - lse))
    return weights[0, ..., None] * out_a + weights[1, ..., None] * out_b, lse


def oracle_backward(q, k, v, d_out, lse, delta, mask=None):
    scale = q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))
    d_scores = probs * (d_out @ v.transpose(-1, -2) - delta[..., None])
    return d_scores @ k * scale, d_scores.transpose(-1, -2) @ q * scale, probs.transpose(-1, -2) @ d_out


def oracle_positions(seq, cp, rank, layout):
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2 * cp = {2 * cp}")
    size = seq // (2 * cp)
    chunks = (2 * rank, 2 * rank + 1) if layout == "contiguous" else (rank, 2 * cp - 1 - rank)
    return torch.tensor([c * size + i for c in chunks for i in range(size)], dtype=torch.int64)


def oracle_blockwise(q, k, v, causal=False, block=64, q_pos=None, k_pos=None):
    mask = (k_pos[None, :] <= q_pos[:, None]) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


ORACLES = {  # exercise -> the module attributes it provides, replaced when another is tested
    "online-softmax": {"attend_block": oracle_attend_block, "merge_partials": oracle_merge,
                       "attend_block_backward": oracle_backward,
                       "blockwise_attention": oracle_blockwise},
    "zigzag": {"sequence_positions": oracle_positions},
}


@contextlib.contextmanager
def oracles(*exercises: str):
    """main.py's pieces of `exercises` replaced by the oracles (checks.py's gather too)."""
    with contextlib.ExitStack() as stack:
        for name in exercises:
            for attr, oracle in ORACLES[name].items():
                stack.enter_context(mock.patch.object(M, attr, oracle))
        yield


# ============================================================================ the worker


def attempt(fn) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a learner's stub or bug is a failed result
        return {"error": f"{type(exc).__name__}: {exc}"}


def summarise(run: dict, ref) -> dict:
    y_ref, g_ref = ref
    return {"out_gap": C.max_abs_diff(run["out"], y_ref),
            "grad_gaps": [C.max_abs_diff(a, b) for a, b in zip(run["grads"], g_ref)],
            "bytes": {"forward": run["forward_bytes"], "backward": run["backward_bytes"]},
            "forward_steps": run["forward_steps"], "backward_steps": run["backward_steps"],
            "tiles": run["tiles"]}


def cp_worker(ctx: RankContext, seq: int, heads: int, head_dim: int) -> dict:
    """Every configuration on this world size: ring (with online-softmax and zig-zag oracles)
    per mask and layout, Ulysses (with oracles) per mask, layout and engine, and the lesson
    unpatched: ring and Ulysses against sdpa and each other."""
    inputs = C.full_inputs(7, seq, heads, head_dim, ctx.device)
    refs = {causal: C.reference(*inputs, causal) for causal in (False, True)}
    results = {}
    for causal in (False, True):
        for layout in M.LAYOUTS:
            with oracles("online-softmax", "zigzag"):
                results[f"ring/{causal}/{layout}"] = attempt(
                    lambda c=causal, lay=layout: summarise(C.run_variant("ring", inputs, seq, c, lay),
                                                           refs[c]))
            for engine in ("p2p", "torch"):
                with oracles("online-softmax", "zigzag"):
                    results[f"ulysses/{causal}/{layout}/{engine}"] = attempt(
                        lambda c=causal, lay=layout, e=engine: summarise(
                            C.run_variant("ulysses", inputs, seq, c, lay, e), refs[c]))
    for variant in C.VARIANTS:  # integration: nothing replaced
        results[f"whole/{variant}"] = attempt(
            lambda v=variant: C.run_variant(v, inputs, seq, True, "zigzag"))
    whole = {}
    if all("error" not in results[f"whole/{v}"] for v in C.VARIANTS):
        ring, ulysses = results["whole/ring"], results["whole/ulysses"]
        whole = {"ring_vs_sdpa": summarise(ring, refs[True])["out_gap"],
                 "ulysses_vs_sdpa": summarise(ulysses, refs[True])["out_gap"],
                 "ring_vs_ulysses": max(C.max_abs_diff(a, b) for a, b in
                                        zip([ring["out"], *ring["grads"]],
                                            [ulysses["out"], *ulysses["grads"]]))}
    for variant in C.VARIANTS:  # tensors stay here; an error goes back
        if "error" not in results[f"whole/{variant}"]:
            del results[f"whole/{variant}"]
    results["whole"] = whole
    results["heads_refusal"] = attempt(lambda: {"message": str(U.check_heads(ctx.world_size + 1,
                                                                             ctx.world_size))})
    return results


def torch_cp_worker(ctx: RankContext, seq: int, heads: int, head_dim: int) -> str:
    return C.try_torch_context_parallel(ctx, seq, heads, head_dim)


def gpt_worker(ctx: RankContext, variant: str, layout: str) -> list[dict]:
    return [vars(check) for check in C.cp_gpt_steps(ctx, variant, layout)]
