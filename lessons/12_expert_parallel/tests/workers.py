"""Functions that lesson 12's tests run on spawned ranks (importable by their dotted name).

One launch per world size runs every configuration. The dispatch-combine exercise is tested
alone: the router, capacity and routing-count pieces it needs are replaced by oracles written
here (a sort of the softmax, the drop order by a plain loop, the counts by a comprehension),
so a mistake there fails that exercise's tests and not this one's. Every configuration runs
in its own try (a stub that raises is a failed result, not a dead rank) and names itself with
`phase` (a hang says which configuration hung). The unpatched run (everything the learner
wrote together) is the integration.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from unittest import mock

import torch
import torch.distributed as dist

from lessons._checks import max_abs_diff
from lessons._launch import RankContext, phase

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

# (top_k, capacity factor, skew): top-1 and top-2, with (factor 1) and without (factor 0)
# dropping, a random router and one that sends (almost) everything to rank 0's experts
CONFIGS = [(top_k, factor, skew) for top_k in (1, 2) for factor in (0.0, 1.0) for skew in (0.0, 20.0)]
# tokens per rank: uneven (each rank's capacity is its own), none a multiple of the experts
TOKENS = (11, 7, 9, 5)
# the subgroup runs: (world, members of the EP group); the other ranks idle
SUBGROUPS = {3: [0, 2], 4: [1, 2, 3]}
SUB_CONFIGS = [(2, 1.0, 0.0), (1, 0.0, 20.0)]


def experts_for(ep: int) -> int:
    """Experts the ep ranks share equally: 6 at ep = 3, else 4."""
    return 6 if ep == 3 else 4


def attempt(fn) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a learner's stub or bug is a failed result
        return {"error": f"{type(exc).__name__}: {exc}"}


def one(inputs, top_k, factor, engine, group=None) -> dict:
    """One configuration on the ep ranks of `group`: the EP layer against one process, and
    what the routing says each rank should send, receive and drop."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = inputs["w_in"].shape[0]
    ref = C.reference(inputs, top_k, factor, 1e-2)
    run = C.run_ep(inputs, top_k, factor, 1e-2, engine, group)
    stats = run["stats"]
    local = experts // ep
    routed = [torch.bincount(e[k], minlength=experts) for e, k in ref["routing"]]
    ref_experts, ref_keep = ref["routing"][rank]
    shard = slice(rank * local, (rank + 1) * local)
    plain = M.ep_moe_layer(inputs["x"][rank], inputs["router"], inputs["w_in"][shard], inputs["w_out"][shard],
                           experts, top_k, factor, engine, group=group)  # no stats passed
    return {"no_stats": max_abs_diff(plain.out, ref["out"][rank]),
            **C.gaps(run, ref), "bytes": {"forward": run["forward_bytes"], "backward": run["backward_bytes"]},
            "rows": [oracle_dispatch_counts(e, k, experts, ep) for e, k in ref["routing"]],
            "send_counts": stats.send_counts, "recv_counts": stats.recv_counts, "dropped": stats.dropped,
            "expert_rows": stats.expert_rows, "tokens": inputs["x"][rank].shape[0],
            "expected_expert_rows": [int(sum(r[rank * local + e] for r in routed)) for e in range(local)],
            "expected_dropped": int((~ref_keep).sum()), "kept": int(ref_keep.sum()),
            "group_rank": rank, "top_k": top_k, "factor": factor,
            "same_keep": bool(torch.equal(run["keep"], ref_keep)),
            "same_experts": bool(torch.equal(run["experts"], ref_experts))}


def ep_worker(ctx: RankContext, hidden: int, ffn: int) -> dict:
    """Every configuration on this world size: top-1 and top-2, with (factor 1) and without
    (factor 0) dropping, a random and a skewed router, both engines, uneven tokens per rank,
    with the oracles; on a subgroup of the world (SUBGROUPS, the other ranks idle); then the
    lesson unpatched."""
    world = ctx.world_size
    tokens, experts = list(TOKENS[:world]), experts_for(world)
    results = {}
    for top_k, factor, skew in CONFIGS:
        inputs = C.make_inputs(3, world, tokens, hidden, ffn, experts, ctx.device, skew)
        for engine in M.ENGINES:
            key = f"ep/{top_k}/{factor}/{skew}/{engine}"
            phase(f"dispatch-combine ep={world} {key}")
            with oracles():
                results[key] = attempt(lambda i=inputs, k=top_k, f=factor, e=engine: one(i, k, f, e))
    members = SUBGROUPS.get(world)
    if members is not None:
        group = dist.new_group(members)  # every rank creates it; only its members use it
        if ctx.rank in members:
            sub_tokens, sub_experts = tokens[:len(members)], experts_for(len(members))
            for top_k, factor, skew in SUB_CONFIGS:
                inputs = C.make_inputs(6, len(members), sub_tokens, hidden, ffn, sub_experts, ctx.device,
                                       skew)
                key = f"sub/{members}/{top_k}/{factor}/{skew}/torch"
                phase(f"dispatch-combine on ranks {members} of {world}: {key}")
                with oracles():
                    results[key] = attempt(lambda i=inputs, k=top_k, f=factor: one(i, k, f, "torch", group))
        dist.barrier()
    inputs = C.make_inputs(4, world, tokens, hidden, ffn, experts, ctx.device)
    phase(f"integration ep={world}: everything unpatched")
    results["whole"] = attempt(lambda: one(inputs, 2, 1.25, "p2p"))
    return results
