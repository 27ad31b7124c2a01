"""Lesson 12: expert parallelism: a mixture-of-experts layer with all-to-all dispatch.

The story, top to bottom:

1. The layer in one process (Switch Transformer, GShard): a router scores every token against
   E experts (softmax gate), each token goes to its top-k experts (top-1 or top-2), an expert is
   a small MLP, the outputs come back weighted by the gate.
2. Capacity: an expert takes at most C = ceil(factor T k / E) assignments; the rest are
   dropped, in a stated order (GShard's; Megatron-LM drops the lowest probabilities, and is
   dropless by default). Two losses keep the router in check: the load-balancing auxiliary
   loss E sum_i f_i P_i and the router z-loss mean (log sum exp logits)^2.
3. Expert parallel: the E experts sharded over ep ranks. Each rank routes its own tokens, tells
   every rank how many rows it will send to each of its experts (the split sizes, first), sends
   the rows with an all-to-all (uneven, possibly empty), the experts run, a second all-to-all
   brings the results home, weighted by the gate. Both with lesson 01's point-to-point
   all-to-all and torch's `dist.all_to_all_single`; the backward is the same two all-to-alls
   reversed.
4. The cost model: bytes per rank from the routing (who sends how many rows to whom).

The proof is in checks.py: `python lessons/12_expert_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique

# ============================================================================ 1. router and experts


class Routing(NamedTuple):
    """What the router decided for T tokens: experts (T, k) int64, each row k distinct experts,
    best first; gates (T, k) their softmax probabilities; probs and logits (T, E)."""

    experts: torch.Tensor
    gates: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


# exercise router (3 points): The top-k softmax router and its two losses
# hint: logits = x @ router_weight, probs = softmax over experts, torch.topk(probs, k);
#   f_i counts routed assignments (one_hot of the experts, before any dropping) over T k,
#   P_i = probs.mean(0); z-loss: torch.logsumexp(logits, -1) squared per token, then averaged.
def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> Routing:
    """The top-k softmax router. x (T, d), router_weight (d, E); 2 T d E FLOPs.

    logits = x W (T, E); probs = softmax(logits) over the E experts; each token's k experts
    with the largest probabilities (torch.topk: best first) and their gates = those
    probabilities, NOT renormalised over the k: Switch's gate (top-1) and Megatron-LM's router
    with `moe_router_pre_softmax`. Mixtral divides the k gates by their sum (a softmax over the
    top-k logits), GShard's top-2 by g1 + g2: the same forward output up to a per-token scale,
    but not the same router gradient. Gradients reach the router only through the gates (and
    the losses below): the choice itself is not differentiable.
    """
    logits = x @ router_weight
    probs = torch.softmax(logits, dim=-1)
    gates, experts = torch.topk(probs, top_k, dim=-1)
    return Routing(experts, gates, probs, logits)


# exercise router (continued)
def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """The load-balancing loss E sum_i f_i P_i: Switch Transformer's (eq. 4) for top-1; for
    top-k with f over all T k assignments, Megatron-LM's `switch_load_balancing_loss_func`.

    f_i = (assignments routed to expert i, before capacity drops) / (T k): the fraction of the
    T k assignments expert i was chosen for (a count: no gradient); P_i = (1/T) sum_t probs[t, i]
    (differentiable). 1 when both are uniform (1/E each); below E/k (f_i <= 1/k: a token picks
    an expert once); not minimal at uniform routing (E = 2, f = (0.6, 0.4), P = (0.3, 0.7):
    0.92). dL/dP_i = E f_i: the busiest experts' probabilities are pushed down hardest. (GShard
    counts first choices only; Hugging Face's Mixtral loss is k times this one.) Returns a 0-dim
    tensor of probs' dtype; weighted by a coefficient (1e-2) in the training loss.
    """
    tokens, top_k = routing.experts.shape
    counts = F.one_hot(routing.experts, num_experts).sum(dim=(0, 1)).to(routing.probs.dtype)
    return num_experts * torch.sum(counts / (tokens * top_k) * routing.probs.mean(dim=0))


# exercise router (continued)
def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's router z-loss (arXiv 2202.08906): (1/T) sum_t (log sum_j exp logits[t, j])^2.
    Keeps the logits small (a float32/bf16 router stays stable); coefficient 1e-3."""
    return torch.logsumexp(routing.logits, dim=-1).square().mean()


def expert_mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """One expert: gelu(x W_in) W_out; x (n, d), W_in (d, f), W_out (f, d) -> (n, d). Rows are
    independent, so an expert may see its rows in any order and any number of batches."""
    return F.gelu(x @ w_in) @ w_out


# ============================================================================ 2. capacity


# exercise capacity (3 points): Capacity and the order in which tokens are dropped
# hint: C rounds UP (math.ceil) and never exceeds T. keep_mask: flatten the (T, k) choices
#   choice-major (experts.t().reshape(-1)); one_hot, cumsum over that order gives each
#   assignment's slot in its expert's buffer; keep slot < capacity.
def expert_capacity(tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    """C = ceil(factor T k / E) assignments per expert, at most T (Switch: tokens per batch /
    experts x capacity factor; with top-k, k assignments per token, as Megatron-LM's
    `get_capacity`). factor 0 or inf: no limit (C = T, every assignment fits, since a token
    picks an expert at most once)."""
    if factor <= 0 or math.isinf(factor):
        return tokens
    return min(tokens, math.ceil(factor * tokens * top_k / num_experts))


# exercise capacity (continued)
def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which (token, choice) assignments an expert of `capacity` slots takes: bool (T, k).

    Priority (GShard, Lingvo's `Top2GatingOnLogits`): choice-major, then token order: every
    token's first choice, tokens 0..T-1, then every second choice. An assignment's slot = how
    many assignments to the same expert come before it in that order; kept iff slot < capacity.
    So a second choice never displaces a first choice, and among first choices the LATER tokens
    are dropped. A dropped assignment contributes nothing (gate x 0); a token with all k dropped
    gets 0 from the layer (the residual connection around it carries the token on).
    """
    tokens, top_k = experts.shape
    order = F.one_hot(experts.t().reshape(-1), num_experts)  # (k T, E), choice-major
    slot = (order.cumsum(dim=0) * order).sum(dim=-1) - 1
    return (slot < capacity).reshape(top_k, tokens).t()


class MoEOutput(NamedTuple):
    """The layer's output (T, d), its two losses, the routing and the keep mask (T, k)."""

    out: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    routing: Routing
    keep: torch.Tensor


def moe_layer(x: torch.Tensor, router_weight: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
              top_k: int, capacity_factor: float) -> MoEOutput:
    """The mixture-of-experts layer in one process. x (T, d); router_weight (d, E); w_in
    (E, d, f), w_out (E, f, d): expert e is expert_mlp(., w_in[e], w_out[e]).

    out[t] = sum over t's kept choices c of gates[t, c] * expert_{experts[t, c]}(x[t]). A loop
    over experts: expert e runs once on all its kept rows (at most C of them). Compute: 4 d f
    FLOPs per kept assignment, k times a dense MLP of the same f per token, whatever E is.
    """
    num_experts = w_in.shape[0]
    routing = route(x, router_weight, top_k)
    keep = keep_mask(routing.experts, num_experts, expert_capacity(x.shape[0], num_experts, top_k,
                                                                   capacity_factor))
    token = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(routing.experts)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        chosen = (routing.experts == e) & keep
        rows = token[chosen]
        out = out.index_add(0, rows, expert_mlp(x[rows], w_in[e], w_out[e]) * routing.gates[chosen][:, None])
    return MoEOutput(out, load_balancing_loss(routing, num_experts), router_z_loss(routing), routing, keep)


# ============================================================================ 3. expert parallel

ENGINES = ("p2p", "torch")


def check_experts(num_experts: int, ep: int, top_k: int) -> None:
    """Every rank holds E / ep whole experts, and a token picks k distinct experts: refuse else."""
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts are not divisible by ep = {ep}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top-k {top_k} must be between 1 and the {num_experts} experts")


def expert_owner(expert: int, num_experts: int, ep: int) -> int:
    """The rank holding `expert`: experts are dealt in contiguous blocks, rank r holds
    r E/ep .. (r+1) E/ep - 1."""
    return expert // (num_experts // ep)


def uneven_all_to_all_rows(send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                           engine: str, traffic: collectives.Traffic, group=None) -> torch.Tensor:
    """Rows [o_j, o_j + send_counts[j]) to rank j of `group`, received rows stacked by source
    rank: lesson 01's `all_to_all` from point-to-point ("p2p": the default group, bytes counted)
    or torch's `dist.all_to_all_single` ("torch": any group, not counted)."""
    if engine == "p2p":
        if group is not None:
            raise ValueError("the p2p all-to-all runs on the default group; use engine 'torch'")
        return collectives.all_to_all(send, send_counts, recv_counts, traffic)
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """`uneven_all_to_all_rows` forward; backward the reverse all-to-all of the gradient (the
    splits swapped): the adjoint of a permutation of rows across ranks is its inverse."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, engine, traffic, group):
        ctx.args = (send_counts, recv_counts, engine, traffic, group)
        return uneven_all_to_all_rows(x, send_counts, recv_counts, engine, traffic, group)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts, engine, traffic, group = ctx.args
        grad_in = uneven_all_to_all_rows(grad.contiguous(), recv_counts, send_counts, engine, traffic,
                                         group)
        return grad_in, None, None, None, None, None


@dataclasses.dataclass
class EPStats:
    """What one rank did in one layer: bytes and messages sent (lesson 01's Traffic), rows sent
    to / received from each rank, assignments dropped, rows each local expert processed."""

    traffic: collectives.Traffic = dataclasses.field(default_factory=collectives.Traffic)
    send_counts: list[int] = dataclasses.field(default_factory=list)
    recv_counts: list[int] = dataclasses.field(default_factory=list)
    dropped: int = 0
    expert_rows: list[int] = dataclasses.field(default_factory=list)


# exercise dispatch-combine (5 points): Expert parallel: split sizes, dispatch, experts, combine
# hint: sort the kept (token, choice) rows by expert; per-expert counts (E,) go first in an
#   all-to-all of E / ep counts per rank; from them the row splits; dispatch x[token] with
#   AllToAll, run each local expert on its rows (received by source rank, then local expert),
#   AllToAll back with the splits swapped, index_add gate * row into the token's output.
def ep_moe_layer(x: torch.Tensor, router_weight: torch.Tensor, w_in: torch.Tensor,
                 w_out: torch.Tensor, num_experts: int, top_k: int, capacity_factor: float,
                 engine: str = "p2p", stats: EPStats | None = None, group=None) -> MoEOutput:
    """`moe_layer` on this rank's tokens x (T, d) with the experts sharded over the ep ranks
    of `group` (default: the world). router_weight (d, E) is replicated; w_in (E/ep, d, f) and
    w_out (E/ep, f, d) are this rank's experts (`expert_owner`). Capacity is per rank's tokens
    (each rank's T tokens are one GShard group): the result is exactly `moe_layer(x, ...)` with
    all E experts, out (T, d) and the same losses.

    1. route, keep_mask; the kept rows sorted by expert (stable: token order within one).
    2. split sizes first: an all-to-all of this rank's per-expert counts (E int64, E/ep to each
       rank) tells every rank how many rows of each of its experts arrive from each source.
    3. dispatch: AllToAll of the rows (uneven splits; a rank may receive nothing).
    4. each local expert on its received rows; 5. combine: AllToAll back (splits swapped),
       out[t] += gate * row. Backward: 5 and 3 reversed. stats: counts, dropped, rows per expert.
    The splits are Python ints: on a GPU that is a device-to-host copy, the CPU waits for the
    router. engine "p2p" runs on the default group only; "torch" sends nothing through
    lesson 01's Traffic (stats.traffic stays at 0 bytes).
    """
    ep = dist.get_world_size(group)
    local = num_experts // ep
    stats = stats if stats is not None else EPStats()
    routing = route(x, router_weight, top_k)
    keep = keep_mask(routing.experts, num_experts, expert_capacity(x.shape[0], num_experts, top_k,
                                                                   capacity_factor))
    token = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(routing.experts)[keep]
    expert = routing.experts[keep]
    order = torch.argsort(expert, stable=True)
    token, expert, gate = token[order], expert[order], routing.gates[keep][order]
    per_expert = torch.bincount(expert, minlength=num_experts)
    recv_per_expert = uneven_all_to_all_rows(per_expert, [local] * ep, [local] * ep, engine,
                                             stats.traffic, group).reshape(ep, local)
    send_counts = per_expert.reshape(ep, local).sum(dim=1).tolist()
    recv_counts = recv_per_expert.sum(dim=1).tolist()
    received = AllToAll.apply(x[token], send_counts, recv_counts, engine, stats.traffic, group)
    which = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep),
                                    recv_per_expert.reshape(-1))
    grouped = torch.argsort(which, stable=True)  # rows of local expert 0, then 1, ...
    rows = recv_per_expert.sum(dim=0).tolist()
    y = torch.cat([expert_mlp(part, w_in[e], w_out[e]) for e, part in
                   enumerate(received[grouped].split(rows))])
    y = torch.empty_like(y).index_copy(0, grouped, y)  # back to the order rows arrived in
    back = AllToAll.apply(y, recv_counts, send_counts, engine, stats.traffic, group)
    out = torch.zeros_like(x).index_add(0, token, back * gate[:, None])
    stats.send_counts, stats.recv_counts, stats.expert_rows = send_counts, recv_counts, rows
    stats.dropped = int(keep.numel() - keep.sum())
    return MoEOutput(out, load_balancing_loss(routing, num_experts), router_z_loss(routing), routing, keep)


# ============================================================================ 4. the cost model


# exercise ep-bytes (2 points): Bytes per rank from the routing
# hint: dispatch_counts: the kept experts' owners (`expert_owner`), counted per rank. Bytes:
#   only rows to OTHER ranks travel: this rank's row of the matrix minus its own entry
#   (dispatch), its column minus its own entry (the combine sends those rows back).
def dispatch_counts(experts: torch.Tensor, keep: torch.Tensor, num_experts: int, ep: int) -> list[int]:
    """Rows one rank's routing sends to each of the ep ranks: a list of ep ints, its kept
    assignments (experts (T, k), keep (T, k) bool) counted by the owner of their expert
    (`expert_owner`; its own rank's entry stays local). Sums to keep.sum()."""
    owners = experts[keep] // (num_experts // ep)
    return torch.bincount(owners, minlength=ep).tolist()


class Bytes(NamedTuple):
    """Bytes one rank sends in the forward and in the backward pass of one MoE layer."""

    forward: int
    backward: int


# exercise ep-bytes (continued)
def ep_bytes_per_rank(rows: list[list[int]], rank: int, hidden: int, itemsize: int,
                      experts_per_rank: int) -> Bytes:
    """Bytes rank `rank` sends, given rows[i][j] = rows rank i dispatches to rank j.

    Forward: the split sizes (E/ep int64 counts to each other rank: 8 (E/ep)(ep - 1)), the
    dispatch (sum over j != rank of rows[rank][j]) and the combine (sum over i != rank of
    rows[i][rank], the results it sends home), each row hidden * itemsize bytes. Backward: the
    same two all-to-alls reversed, no counts: the same row bytes. 0 at ep = 1. Balanced routing
    of T tokens x k: 2 (ep - 1)/ep T k d itemsize per direction.
    """
    ep = len(rows)
    sent = sum(rows[rank][j] for j in range(ep) if j != rank)
    returned = sum(rows[i][rank] for i in range(ep) if i != rank)
    payload = (sent + returned) * hidden * itemsize
    return Bytes(payload + 8 * experts_per_rank * (ep - 1), payload)


def load_imbalance(rows_per_unit: list[int]) -> float:
    """max / mean of the rows each expert (or rank) processes: 1.0 is perfect balance; the
    slowest one sets the step time, so imbalance x the balanced time is what the step costs."""
    mean = sum(rows_per_unit) / len(rows_per_unit)
    return max(rows_per_unit) / mean if mean else 1.0


def balanced_all_to_all_bytes(tokens: int, hidden: int, top_k: int, ep: int, itemsize: int) -> int:
    """Bytes one rank sends per layer forward (dispatch + combine) when routing is uniform:
    2 (ep - 1)/ep T k d itemsize, T tokens per rank (counts neglected)."""
    return 2 * (ep - 1) * tokens * top_k * hidden * itemsize // ep


def dense_all_reduce_bytes(tokens: int, hidden: int, tp: int, itemsize: int) -> int:
    """A tensor-parallel dense MLP's forward all-reduce of its (T, d) output, ring (lesson 01):
    2 (tp - 1)/tp T d itemsize per rank. The tp ranks share their T tokens, while each EP rank
    owns its T: per token processed, EP sends k/ep of TP's bytes (2 (ep-1)/ep k d b against
    2 (tp-1) d b), and neither moves weights."""
    return 2 * (tp - 1) * tokens * hidden * itemsize // tp


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
