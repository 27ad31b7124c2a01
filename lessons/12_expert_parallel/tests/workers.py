"""Functions that lesson 12's tests run on spawned ranks (importable by their dotted name).

One launch per world size runs every configuration. The dispatch-combine exercise is tested
alone: the router, capacity and routing-count pieces it needs are replaced by oracles written
here (a sort of the softmax, the drop order by a plain loop, the counts by a comprehension),
so a mistake there fails that exercise's tests and not this one's. Every configuration runs
in its own try: a stub that raises is a failed result, not a dead rank. The unpatched run
(everything the learner wrote together) is the integration.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from unittest import mock

import torch
import torch.distributed as dist

from lessons._launch import RankContext

M = importlib.import_module("lessons.12_expert_parallel.main")
C = importlib.import_module("lessons.12_expert_parallel.checks")

# ============================================================================ oracles


def oracle_route(x, router_weight, top_k):
    logits = x @ router_weight
    probs = torch.nn.functional.softmax(logits, dim=1)
    gates, experts = probs.sort(dim=1, descending=True)
    return M.Routing(experts[:, :top_k], gates[:, :top_k], probs, logits)


def oracle_capacity(tokens, num_experts, top_k, factor):
    if factor <= 0 or math.isinf(factor):
        return tokens
    return min(tokens, math.ceil(factor * tokens * top_k / num_experts))


def oracle_keep(experts, num_experts, capacity):
    tokens, top_k = experts.shape
    keep = torch.zeros(tokens, top_k, dtype=torch.bool)
    used = [0] * num_experts
    for choice in range(top_k):
        for token in range(tokens):
            e = int(experts[token, choice])
            keep[token, choice] = used[e] < capacity
            used[e] += 1
    return keep.to(experts.device)


def oracle_aux(routing, num_experts):
    tokens, top_k = routing.experts.shape
    f = torch.stack([(routing.experts == i).sum() for i in range(num_experts)]).double() / (tokens * top_k)
    return num_experts * (f.to(routing.probs) * routing.probs.mean(0)).sum()


def oracle_z(routing):
    return (routing.logits.exp().sum(1).log() ** 2).mean()


def oracle_dispatch_counts(experts, keep, num_experts, ep):
    per = num_experts // ep
    return [sum(1 for e in experts[keep].tolist() if e // per == rank) for rank in range(ep)]


ORACLES = {"route": oracle_route, "expert_capacity": oracle_capacity, "keep_mask": oracle_keep,
           "load_balancing_loss": oracle_aux, "router_z_loss": oracle_z,
           "dispatch_counts": oracle_dispatch_counts}


@contextlib.contextmanager
def oracles():
    """main.py's router, capacity and routing-count pieces replaced by the oracles."""
    with contextlib.ExitStack() as stack:
        for attr, oracle in ORACLES.items():
            stack.enter_context(mock.patch.object(M, attr, oracle))
        yield


# ============================================================================ the worker

CONFIGS = [(top_k, factor, skew) for top_k in (1, 2) for factor in (0.0, 1.0) for skew in (0.0, 20.0)]


def attempt(fn) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a learner's stub or bug is a failed result
        return {"error": f"{type(exc).__name__}: {exc}"}


def one(inputs, top_k, factor, engine) -> dict:
    ref = C.reference(inputs, top_k, factor, 1e-2)
    run = C.run_ep(inputs, top_k, factor, 1e-2, engine)
    stats = run["stats"]
    return {**C.gaps(run, ref), "bytes": {"forward": run["forward_bytes"], "backward": run["backward_bytes"]},
            "rows": C.routing_rows(ref, inputs["w_in"].shape[0], dist.get_world_size()),
            "send_counts": stats.send_counts, "recv_counts": stats.recv_counts, "dropped": stats.dropped,
            "expert_rows": stats.expert_rows,
            "kept": int(ref["routing"][dist.get_rank()][1].sum())}


def ep_worker(ctx: RankContext, tokens: int, hidden: int, ffn: int, experts: int) -> dict:
    """Every configuration on this world size: top-1 and top-2, with (factor 1) and without
    (factor 0) dropping, a random and a skewed router, both engines, with the oracles; then
    the lesson unpatched."""
    results = {}
    for top_k, factor, skew in CONFIGS:
        inputs = C.make_inputs(3, ctx.world_size, tokens, hidden, ffn, experts, ctx.device, skew)
        for engine in M.ENGINES:
            with oracles():
                results[f"ep/{top_k}/{factor}/{skew}/{engine}"] = attempt(
                    lambda i=inputs, k=top_k, f=factor, e=engine: one(i, k, f, e))
    inputs = C.make_inputs(4, ctx.world_size, tokens, hidden, ffn, experts, ctx.device)
    results["whole"] = attempt(lambda: one(inputs, 2, 1.25, "p2p"))
    return results
