"""Functions that lesson 11's tests run on spawned ranks (importable by their dotted name).

One launch per world size runs every configuration. Each exercise is tested alone: the pieces
of OTHER exercises it needs are replaced by oracles written here (plain softmax attention, the
layouts by list comprehension), so a mistake in one exercise fails that exercise's tests and no
other's. Every configuration runs in its own try: a stub that raises is a failed result, not a
dead rank. The unpatched runs (everything the learner wrote together) are the integration.
Subgroups: at world 2, 3 and 4 the ring and Ulysses also run over ranks {1}, {0, 2} and
{1, 2, 3}, the other ranks idle, so a `group` argument that is ignored shows.
"""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._launch import RankContext

M = importlib.import_module("lessons.11_context_parallel.main")
B = importlib.import_module("lessons.11_context_parallel.blockwise")
U = importlib.import_module("lessons.11_context_parallel.ulysses")
C = importlib.import_module("lessons.11_context_parallel.checks")

KV_HEADS = {1: 4, 2: 4, 3: 6, 4: 2}  # grouped-query K/V heads per cp (12 query heads): 2 on 4
SUBGROUPS = ([1], [0, 2], [1, 2, 3])  # members of the subgroups, in one launch of 4 ranks

# ============================================================================ oracles


def oracle_attend_block(q, k, v, mask=None, scale=None):
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v, lse


def oracle_merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logsumexp(torch.stack([lse_a, lse_b]), dim=0)
    weights = torch.nan_to_num(torch.exp(torch.stack([lse_a, lse_b]) - lse))
    return weights[0, ..., None] * out_a + weights[1, ..., None] * out_b, lse


def oracle_backward(q, k, v, d_out, lse, delta, mask=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
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


def oracle_blockwise(q, k, v, is_causal=False, scale=None, *, enable_gqa=False, block_q=64,
                     block_k=64, return_lse=False, q_pos=None, k_pos=None):
    q_pos = torch.arange(q.shape[-2]) if q_pos is None else q_pos
    k_pos = torch.arange(k.shape[-2]) if k_pos is None else k_pos
    mask = (k_pos[None, :] <= q_pos[:, None]) if is_causal else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return (out, None) if return_lse else out


ORACLES = {  # exercise -> (module, the attributes it provides, replaced when another is tested)
    "online-softmax": (B, {"attend_block": oracle_attend_block, "merge_partials": oracle_merge,
                           "attend_block_backward": oracle_backward}),
    "flash-attention": (B, {"blockwise_attention": oracle_blockwise}),
    "zigzag": (M, {"sequence_positions": oracle_positions}),
}


@contextlib.contextmanager
def oracles(*exercises: str):
    """The pieces of `exercises` replaced by the oracles."""
    with contextlib.ExitStack() as stack:
        for name in exercises:
            module, replaced = ORACLES[name]
            for attr, oracle in replaced.items():
                stack.enter_context(mock.patch.object(module, attr, oracle))
        yield


# ============================================================================ the worker


def attempt(fn) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a learner's stub or bug is a failed result
        return {"error": f"{type(exc).__name__}: {exc}"}


def summarise(run: dict, ref, config: dict) -> dict:
    y_ref, g_ref = ref
    return {**config, "out_gap": C.max_abs_diff(run["out"], y_ref),
            "grad_gaps": [C.max_abs_diff(a, b) for a, b in zip(run["grads"], g_ref)],
            "bytes": {"forward": run["forward_bytes"], "backward": run["backward_bytes"]},
            "forward_steps": run["forward_steps"], "backward_steps": run["backward_steps"],
            "tiles": run["tiles"]}


def run_config(variant: str, seq: int, heads: int, head_dim: int, causal: bool, layout: str,
               engine: str, kv_heads: int, group, members: list[int], inputs_cache: dict) -> dict:
    """One configuration with the other exercises' oracles, summarised with what it was."""
    cp = len(members)
    config = {"variant": variant, "cp": cp, "seq": seq, "causal": causal, "layout": layout, "engine": engine,
              "kv_heads": kv_heads, "group": members, "rank_in_group": members.index(dist.get_rank())}
    key = (seq, kv_heads, causal)
    if key not in inputs_cache:
        inputs = C.full_inputs(7 + kv_heads, seq, heads, head_dim, "cpu", kv_heads)
        inputs_cache[key] = inputs, C.reference(*inputs, causal)
    inputs, ref = inputs_cache[key]
    needed = ("online-softmax", "zigzag") if variant == "ring" else ("flash-attention", "zigzag")
    backward_tiles = []

    def counted_backward(*args, **kwargs):  # the ring's backward tiles, counted
        backward_tiles.append(1)
        return oracle_backward(*args, **kwargs)

    with oracles(*needed), mock.patch.object(B, "attend_block_backward", counted_backward):
        result = attempt(lambda: summarise(C.run_variant(variant, inputs, seq, causal, layout, engine, group),
                                           ref, config))
    return result if "error" in result else {**result, "backward_tiles": len(backward_tiles)}


def dq_beyond_one_rounding(q, k, v, w, out, dq, causal: bool) -> float:
    """How far a bf16 dQ is beyond ONE rounding of its exact value under the backward's contract:
    x = dQ in float64 from the same bf16 q, k, v, dO = w, with delta = rowsum(dO * O) read from
    `out` (the returned bf16 O, which FlashAttention-2's dot_do_o reads, or the fp32 O before
    rounding). Rounding once to bf16 gives x (1 + r), |r| <= eps / 2, so this is
    max_i (|dQ_i - x_i| - eps / 2 |x_i|) / (eps max |x|): at most the fp32 work's error when dQ
    is summed in fp32 and rounded once."""
    q, k, v, w, out = (t.double() for t in (q, k, v, w, out))
    scale = q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    delta = (w * out).sum(-1, keepdim=True)
    exact = (torch.softmax(scores, -1) * (w @ v.transpose(-1, -2) - delta)) @ k * scale
    eps = torch.finfo(torch.bfloat16).eps
    beyond = (dq.double() - exact).abs() - eps / 2 * exact.abs()
    return beyond.max().item() / (eps * exact.abs().max().item())


def run_bf16_ring(seq: int, heads: int, head_dim: int, causal: bool, group) -> dict:
    """The ring (online-softmax and zig-zag oracles) on bf16 inputs against float64 attention on
    the same rounded inputs: the output's dtype and max |error| / (eps max |reference|) for
    out, dQ, dK, dV (eps: bf16's); and dQ beyond one rounding (dq_beyond_one_rounding)."""
    inputs = tuple(t.to(torch.bfloat16) for t in C.full_inputs(7 + heads, seq, heads, head_dim, "cpu"))
    ref_out, ref_grads = C.reference(*(t.double() for t in inputs), causal)
    eps = torch.finfo(torch.bfloat16).eps
    with oracles("online-softmax", "zigzag"):
        run = C.run_variant("ring", inputs, seq, causal, "zigzag", group=group)
    return {"causal": causal, "dtype": str(run["out"].dtype).removeprefix("torch."),
            "errors": [C.max_abs_diff(a.double(), b) / (eps * b.abs().max().item())
                       for a, b in zip([run["out"], *run["grads"]], [ref_out, *ref_grads])],
            # delta from the returned out (as FlashAttention-2) or from an fp32 out saved before rounding
            "dq_beyond_one_rounding": min(dq_beyond_one_rounding(*inputs, out, run["grads"][0], causal)
                                          for out in (run["out"], ref_out))}


def cp_worker(ctx: RankContext, seq: int, heads: int, head_dim: int) -> dict:
    """Every configuration on this world size: ring (online-softmax and zig-zag oracles) per mask
    and layout, grouped-query and with one position per chunk; Ulysses (flash-attention and zig-zag oracles)
    the same on both engines; the lesson unpatched: ring and Ulysses against sdpa and each other."""
    world = ctx.world_size
    cache, results = {}, {}
    everyone = list(range(world))
    for causal in (False, True):
        for layout in M.LAYOUTS:
            results[f"ring/{causal}/{layout}"] = run_config(
                "ring", seq, heads, head_dim, causal, layout, "p2p", heads, None, everyone, cache)
            for engine in ("p2p", "torch"):
                results[f"ulysses/{causal}/{layout}/{engine}"] = run_config(
                    "ulysses", seq, heads, head_dim, causal, layout, engine, heads, None, everyone, cache)
    # one position per chunk (seq = 2 cp): each half of a shard is one position, a tile 1 x 1
    results["ring/short-chunks"] = run_config("ring", 2 * world, heads, head_dim, True, "zigzag", "p2p",
                                              heads, None, everyone, cache)
    for variant in C.VARIANTS:  # grouped-query attention: fewer K/V heads (replicated for Ulysses at 4)
        results[f"{variant}/gqa"] = run_config(variant, seq, heads, head_dim, True, "zigzag", "p2p",
                                               KV_HEADS[world], None, everyone, cache)
    for variant in C.VARIANTS:  # integration: nothing replaced
        results[f"whole/{variant}"] = attempt(
            lambda v=variant: C.run_variant(v, cache[(seq, heads, True)][0], seq, True, "zigzag"))
    whole = {}
    if all("error" not in results[f"whole/{v}"] for v in C.VARIANTS):
        ring, ulysses = results["whole/ring"], results["whole/ulysses"]
        ref = cache[(seq, heads, True)][1]
        whole = {"ring_vs_sdpa": summarise(ring, ref, {})["out_gap"],
                 "ulysses_vs_sdpa": summarise(ulysses, ref, {})["out_gap"],
                 "ring_vs_ulysses": max(C.max_abs_diff(a, b) for a, b in
                                        zip([ring["out"], *ring["grads"]],
                                            [ulysses["out"], *ulysses["grads"]]))}
    for variant in C.VARIANTS:  # tensors stay here; an error goes back
        if "error" not in results[f"whole/{variant}"]:
            del results[f"whole/{variant}"]
    results["whole"] = whole
    results["heads_refusal"] = attempt(lambda: {"message": str(U.check_heads(world + 1, world + 1, world))})
    return results


def subgroup_worker(ctx: RankContext, variant: str, seq: int, heads: int, head_dim: int) -> dict:
    """`variant` over ranks {1}, {0, 2} and {1, 2, 3} of 4 (each engine), the other ranks idle,
    each configuration on a group of its own made by every rank; the ring also on bf16 inputs.
    A member whose configuration fails raises at once: a mistake that ignores the group (or a
    dtype error mid-ring) leaves peers waiting in a point-to-point receive that has no timeout,
    and the launch then ends now instead of at its deadline (the subgroup tests share this
    launch, the other tests do not)."""
    results: dict = {}
    for members in SUBGROUPS:
        for engine in ("p2p", "torch") if variant == "ulysses" else ("p2p",):
            group = dist.new_group(members)  # every rank creates it; only members use it
            if ctx.rank in members:
                key = f"{variant}/subgroup/{engine}/ranks{members}"
                value = run_config(variant, seq, heads, head_dim, True, "zigzag", engine,
                                   KV_HEADS[len(members)], group, members, {})
                if "error" in value:
                    raise RuntimeError(f"{key} (cp={len(members)}, rank {members.index(ctx.rank)} "
                                       f"of the group): {value['error']}")
                results[key] = value
            if variant == "ring" and ctx.rank in members:  # bf16 inputs: out and lse must run in fp32
                for causal in (False, True):
                    key = f"bf16/ring/ranks{members}/causal={causal}"
                    value = attempt(lambda c=causal, g=group: run_bf16_ring(seq, heads, head_dim, c, g))
                    if "error" in value:
                        raise RuntimeError(f"{key} (cp={len(members)}): {value['error']}")
                    results[key] = value
            dist.barrier()
    return results


def torch_cp_worker(ctx: RankContext, seq: int, heads: int, head_dim: int) -> str:
    return C.try_torch_context_parallel(ctx, seq, heads, head_dim)


def gpt_worker(ctx: RankContext, variant: str, layout: str) -> list[dict]:
    return [vars(check) for check in C.cp_gpt_steps(ctx, variant, layout)]
