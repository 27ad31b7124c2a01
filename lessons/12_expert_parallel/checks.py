"""Lesson 12's proof: the expert-parallel MoE layer against the same layer in one process.

On every rank: build every rank's tokens and the full set of experts (float64, the same on
every rank), compute each rank's group through `moe_layer` in one process (the reference:
outputs, losses, gradients of the input, the router and every expert), run this rank's tokens
through `ep_moe_layer` with its shard of the experts, and compare; count the rows and bytes
sent against the routing's formula, check that tokens are conserved, that both all-to-all
engines agree bit for bit, and that EP x DP on a 2-D DeviceMesh trains like one process.
Then the CLI.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from lessons._checks import max_abs_diff
from lessons._launch import RankContext, inject_fault
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    launch_checks,
    lesson_parser,
)

from . import main as expert_parallel

LESSON = "12_expert_parallel"
# float64: the EP layer adds the same products as one process, in another grouping of rows
# (a matmul over fewer or more rows, a top-2 token's two terms added in either order);
# ~1e-16 relative on O(1) values. A lost row, a wrong gate or a row sent to the wrong expert is
# off by O(0.1). TF32 never applies to float64.
TOLERANCE = 1e-10
Z_COEF = 1e-3  # ST-MoE's router z-loss coefficient

# ============================================================================ references


def make_inputs(seed: int, world: int, tokens: int | list[int], hidden: int, ffn: int, experts: int,
                device, skew: float = 0.0) -> dict:
    """Every rank's tokens x (world, T, d), loss weights w (world, T, d), the router (d, E) and
    every expert's w_in (E, d, f), w_out (E, f, d): float64, the same on every rank. tokens a
    list (one count per rank, uneven or 0): x and w are lists of (T_r, d) tensors instead. skew
    > 0 gives every token a constant feature 1 and the experts of rank 0 a bonus `skew` on it:
    a router that sends (almost) everything to rank 0."""
    g = torch.Generator().manual_seed(seed)
    counts = tokens if isinstance(tokens, list) else [tokens] * world
    x = torch.randn(sum(counts), hidden, generator=g, dtype=torch.float64)
    router = torch.randn(hidden, experts, generator=g, dtype=torch.float64)
    if skew:
        x[..., 0] = 1.0
        router[0, : max(experts // world, 1)] += skew
    w = torch.randn(sum(counts), hidden, generator=g, dtype=torch.float64)
    made = {"router": router,
            "w_in": torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64) / hidden**0.5,
            "w_out": torch.randn(experts, ffn, hidden, generator=g, dtype=torch.float64) / ffn**0.5}
    made = {k: v.to(device) for k, v in made.items()}
    for name, rows in (("x", x), ("w", w)):
        rows = rows.to(device)
        made[name] = (list(rows.split(counts)) if isinstance(tokens, list)
                      else rows.view(world, tokens, hidden))
    return made


def layer_loss(result: expert_parallel.MoEOutput, w: torch.Tensor, aux_coef: float) -> torch.Tensor:
    """sum(out * w) + aux_coef * aux + Z_COEF * z: one group's loss."""
    return (result.out * w).sum() + aux_coef * result.aux_loss + Z_COEF * result.z_loss


def reference(inputs: dict, top_k: int, capacity_factor: float, aux_coef: float) -> dict:
    """One process, every group through `moe_layer`: outputs, losses, routings, and the
    gradients of sum over groups of `layer_loss` w.r.t. x, the router and every expert."""
    x = [rows.clone().requires_grad_() for rows in inputs["x"]]
    params = [inputs[k].clone().requires_grad_() for k in ("router", "w_in", "w_out")]
    results = [expert_parallel.moe_layer(rows, *params, top_k, capacity_factor) for rows in x]
    sum(layer_loss(r, inputs["w"][g], aux_coef) for g, r in enumerate(results)).backward()
    return {"out": [r.out.detach() for r in results], "aux": [r.aux_loss.item() for r in results],
            "z": [r.z_loss.item() for r in results],
            "routing": [(r.routing.experts, r.keep) for r in results],
            "x_grad": [rows.grad for rows in x], "router_grad": params[0].grad,
            "w_in_grad": params[1].grad, "w_out_grad": params[2].grad}


def run_ep(inputs: dict, top_k: int, capacity_factor: float, aux_coef: float, engine: str,
           group=None) -> dict:
    """This rank's tokens through `ep_moe_layer` with its shard of the experts, the ep ranks
    of `group` (default: the world; inputs hold one group of tokens per rank of it); the
    output, the losses, the gradients (router all-reduced over the group: it is replicated,
    each rank saw its tokens), what was counted, and the forward's seconds."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = inputs["w_in"].shape[0]
    shard = slice(rank * experts // ep, (rank + 1) * experts // ep)
    x = inputs["x"][rank].clone().requires_grad_()
    router = inputs["router"].clone().requires_grad_()
    w_in, w_out = (inputs[k][shard].clone().requires_grad_() for k in ("w_in", "w_out"))
    stats = expert_parallel.EPStats()
    started = time.perf_counter()
    result = expert_parallel.ep_moe_layer(x, router, w_in, w_out, experts, top_k, capacity_factor,
                                          engine, stats, group)
    seconds = time.perf_counter() - started
    forward_bytes = stats.traffic.bytes_sent
    layer_loss(result, inputs["w"][rank], aux_coef).backward()
    dist.all_reduce(router.grad, group=group)
    return {"rank": rank, "keep": result.keep, "experts": result.routing.experts,
            "out": result.out.detach(), "aux": result.aux_loss.item(), "z": result.z_loss.item(),
            "x_grad": x.grad, "router_grad": router.grad, "w_in_grad": w_in.grad, "w_out_grad": w_out.grad,
            "shard": shard, "stats": stats, "forward_bytes": forward_bytes,
            "backward_bytes": stats.traffic.bytes_sent - forward_bytes, "seconds": seconds}


def gaps(run: dict, ref: dict) -> dict:
    """max |diff| of the output (and losses), dX, the router's and this rank's experts' grads."""
    rank = run["rank"]
    return {"out": max(max_abs_diff(run["out"], ref["out"][rank]), abs(run["aux"] - ref["aux"][rank]),
                       abs(run["z"] - ref["z"][rank])),
            "x_grad": max_abs_diff(run["x_grad"], ref["x_grad"][rank]),
            "router_grad": max_abs_diff(run["router_grad"], ref["router_grad"]),
            "expert_grads": max(max_abs_diff(run["w_in_grad"], ref["w_in_grad"][run["shard"]]),
                                max_abs_diff(run["w_out_grad"], ref["w_out_grad"][run["shard"]]))}


def routing_rows(ref: dict, experts: int, ep: int) -> list[list[int]]:
    """rows[i][j]: rows rank i dispatches to rank j, from the reference's routings."""
    return [expert_parallel.dispatch_counts(e, keep, experts, ep) for e, keep in ref["routing"]]


# ============================================================================ the checks


def conservation_checks(run: dict, tokens: int, top_k: int, experts: int) -> list[Check]:
    """Sent = received + dropped, over all ranks; nothing dropped at infinite capacity."""
    stats = run["stats"]
    totals = torch.tensor([tokens * top_k, sum(stats.send_counts), sum(stats.recv_counts),
                           stats.dropped], dtype=torch.int64, device=run["out"].device)
    dist.all_reduce(totals)
    routed, sent, received, dropped = totals.tolist()
    g = torch.Generator().manual_seed(1)  # k distinct experts per token, as a router picks them
    every = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    unlimited = expert_parallel.keep_mask(every, experts, expert_parallel.expert_capacity(
        tokens, experts, top_k, math.inf))
    return [Check("tokens conserved: routed = received by experts + dropped, and sent = received",
                  routed == received + dropped and sent == received,
                  f"{routed} routed, {sent} sent, {received} received, {dropped} dropped"),
            Check("infinite capacity: no assignment dropped", bool(unlimited.all()),
                  f"{int((~unlimited).sum())} dropped")]


def layer_checks(inputs: dict, top_k: int, capacity_factor: float, aux_coef: float, engine: str,
                 label: str) -> tuple[list[Check], dict, dict]:
    """One configuration: the EP layer against one process; the bytes against the formula."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    experts, hidden = inputs["w_in"].shape[0], inputs["x"].shape[-1]
    ref = reference(inputs, top_k, capacity_factor, aux_coef)
    run = run_ep(inputs, top_k, capacity_factor, aux_coef, engine)
    gap = gaps(run, ref)
    rows = routing_rows(ref, experts, ep)
    formula = expert_parallel.ep_bytes_per_rank(rows, rank, hidden, 8, experts // ep)._asdict()
    counted = {"forward": run["forward_bytes"], "backward": run["backward_bytes"]}
    checks = [Check(f"{label}: output and losses == one process", gap["out"] <= TOLERANCE,
                    f"max |diff| {gap['out']:.1e}"),
              Check(f"{label}: input and router gradients == one process",
                    max(gap["x_grad"], gap["router_grad"]) <= TOLERANCE,
                    f"max |diff| {max(gap['x_grad'], gap['router_grad']):.1e}"),
              Check(f"{label}: this rank's expert gradients == one process",
                    gap["expert_grads"] <= TOLERANCE, f"max |diff| {gap['expert_grads']:.1e}"),
              Check(f"{label}: rows sent == the routing's", run["stats"].send_counts == rows[rank],
                    f"{run['stats'].send_counts} sent, {rows[rank]} routed")]
    if engine == "p2p":
        checks.append(Check(f"{label}: bytes sent per rank == ep_bytes_per_rank", counted == formula,
                            f"{counted} counted, {formula} formula"))
    return checks, run, gap


def refusal_checks(ep: int) -> list[Check]:
    """Experts the ranks cannot share equally and a top-k above the experts: one clear line."""
    messages = []
    for experts, top_k in ((ep + 1, 1), (2 * ep, 2 * ep + 1)):
        try:
            expert_parallel.check_experts(experts, ep, top_k)
            messages.append("accepted")
        except ValueError as exc:
            messages.append(str(exc))
    return [Check(f"{ep + 1} experts on {ep} ranks: refused", ep == 1 or "divisible" in messages[0],
                  messages[0] if ep > 1 else "1 rank: every count divides"),
            Check(f"top-k {2 * ep + 1} of {2 * ep} experts: refused", "top-k" in messages[1], messages[1])]


def verify_worker(ctx: RankContext, seed: int, tokens: int, hidden: int, ffn: int, experts: int,
                  top_k: int, capacity_factor: float, aux_coef: float, fault: str | None,
                  fault_rank: int) -> dict:
    """The EP layer (both engines) against one process; counts against the formulas;
    conservation; refusals; EP x DP on a 2-D mesh."""
    inject_fault(ctx, fault, fault_rank)
    ep = ctx.world_size
    inputs = make_inputs(seed, ep, tokens, hidden, ffn, experts, ctx.device)
    checks, run, gap = layer_checks(inputs, top_k, capacity_factor, aux_coef, "p2p", f"top-{top_k}, p2p")
    other = run_ep(inputs, top_k, capacity_factor, aux_coef, "torch")
    same = all(torch.equal(run[k], other[k]) for k in ("out", "x_grad", "router_grad", "w_in_grad"))
    checks.append(Check("torch's all_to_all_single == lesson 01's all_to_all", same,
                        "outputs and gradients bit-identical" if same else "DIFFER"))
    checks += conservation_checks(run, tokens, top_k, experts)
    skewed = make_inputs(seed + 1, ep, tokens, hidden, ffn, experts, ctx.device, skew=20.0)
    found, skew_run, _ = layer_checks(skewed, min(top_k, experts // ep), 0.0, aux_coef, "p2p",
                                      "skewed router, no capacity limit (uneven, empty splits)")
    checks += found
    checks += refusal_checks(ep)
    checks += ep_dp_steps(ctx, 2 if ep % 2 == 0 else 1, top_k, capacity_factor, aux_coef)
    imbalance = torch.tensor(run["stats"].expert_rows + [sum(run["stats"].recv_counts)], dtype=torch.float64,
                             device=ctx.device)
    gathered = [torch.empty_like(imbalance) for _ in range(ep)]
    dist.all_gather(gathered, imbalance)
    per_expert = [int(v) for g in gathered for v in g[:-1].tolist()]
    per_rank = [int(g[-1]) for g in gathered]
    return {"checks": [vars(c) for c in checks], "device": ctx.device.type, "backend": ctx.backend,
            "max_abs_err": max(gap.values()), "bytes": {"forward": run["forward_bytes"],
                                                       "backward": run["backward_bytes"]},
            "dropped": run["stats"].dropped, "rows_per_expert": per_expert, "rows_per_rank": per_rank,
            "skewed_recv": skew_run["stats"].recv_counts, "seconds": run["seconds"]}


# ============================================================================ EP x DP


def ep_dp_steps(ctx: RankContext, dp: int, top_k: int, capacity_factor: float, aux_coef: float,
                steps: int = 3, tokens: int = 8, hidden: int = 8, ffn: int = 16) -> list[Check]:
    """EP x DP on `init_device_mesh(device, (dp, ep))`: rank (d, e) holds expert shard e
    (replicated over d), routes its own tokens (group d ep + e). Loss = (1/dp) sum over groups:
    expert gradients are averaged over the dp dimension (each replica saw its row's tokens), the
    router's (replicated everywhere) summed over the world and divided by dp. SGD steps against
    one process holding every expert and every group: losses and parameters after each step."""
    from torch.distributed.device_mesh import init_device_mesh

    world = ctx.world_size
    ep = world // dp
    experts = 2 * ep
    mesh = init_device_mesh(ctx.device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
    ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
    e_rank = dist.get_rank(ep_group)
    inputs = make_inputs(5, world, tokens, hidden, ffn, experts, ctx.device)
    shard = slice(e_rank * 2, e_rank * 2 + 2)
    ref = [inputs[k].clone().requires_grad_() for k in ("router", "w_in", "w_out")]
    ours = [inputs["router"].clone().requires_grad_(),
            *(inputs[k][shard].clone().requires_grad_() for k in ("w_in", "w_out"))]
    loss_gap = param_gap = 0.0
    for step in range(steps):
        x = inputs["x"] * (1 + 0.1 * step)
        total = sum(layer_loss(expert_parallel.moe_layer(x[g], *ref, top_k, capacity_factor),
                               inputs["w"][g], aux_coef) for g in range(world)) / dp
        total.backward()
        local = layer_loss(expert_parallel.ep_moe_layer(x[ctx.rank], *ours, experts, top_k,
                                                        capacity_factor, "torch", group=ep_group),
                           inputs["w"][ctx.rank], aux_coef)
        local.backward()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        loss /= dp
        dist.all_reduce(ours[0].grad)
        ours[0].grad /= dp
        for expert_weight in ours[1:]:
            dist.all_reduce(expert_weight.grad, group=dp_group)
            expert_weight.grad /= dp
        with torch.no_grad():
            for param in (*ref, *ours):
                param -= 0.1 * param.grad
                param.grad = None
        loss_gap = max(loss_gap, abs(loss.item() - total.item()))
        param_gap = max(param_gap, max_abs_diff(ours[0], ref[0]), max_abs_diff(ours[1], ref[1][shard]),
                        max_abs_diff(ours[2], ref[2][shard]))
    return [Check(f"EP x DP mesh (dp {dp}, ep {ep}), {steps} SGD steps: losses == one process",
                  loss_gap <= TOLERANCE, f"max |diff| {loss_gap:.1e}"),
            Check(f"EP x DP mesh (dp {dp}, ep {ep}): router and expert weights == one process",
                  param_gap <= TOLERANCE, f"max |diff| {param_gap:.1e}")]


# ============================================================================ the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Expert parallelism from scratch (a mixture-of-experts layer with "
                           "all-to-all dispatch), checked against the layer in one process.",
                           world_size=4)
    parser.add_argument("--experts", type=int_in(1, 1024), default=None,
                        help="experts (default 2 per rank: 8 at the default 4 ranks)")
    parser.add_argument("--top-k", type=int_in(1, 64), default=2, help="experts per token (default 2)")
    parser.add_argument("--capacity-factor", type=float_in(0.0, 1e6), default=1.25,
                        help="expert capacity factor; 0 = no limit (default 1.25)")
    parser.add_argument("--aux-loss-coef", type=float_in(0.0, 1e3), default=1e-2,
                        help="load-balancing loss coefficient (default 0.01)")
    parser.add_argument("--tokens", type=int_in(1, 65536), default=32, help="tokens per rank (default 32)")
    parser.add_argument("--hidden", type=int_in(1, 4096), default=16, help="model width (default 16)")
    parser.add_argument("--ffn", type=int_in(1, 16384), default=32, help="expert MLP width (default 32)")
    args = parser.parse_args(argv)
    world = check_args(parser, args)
    if args.quick:
        args.tokens, args.hidden, args.ffn = 8, 8, 16
    if args.experts is None:  # every world size 1-4 runs with the defaults
        args.experts = 2 * world
    try:
        expert_parallel.check_experts(args.experts, world, args.top_k)
    except ValueError as exc:
        parser.error(f"--experts {args.experts} / --top-k {args.top_k}: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results, checks = launch_checks(
        verify_worker, args, (args.seed, args.tokens, args.hidden, args.ffn, args.experts, args.top_k,
                              args.capacity_factor, args.aux_loss_coef))
    world = len(results)
    metrics = {
        "experts": args.experts, "top_k": args.top_k, "capacity_factor": args.capacity_factor,
        "capacity": expert_parallel.expert_capacity(args.tokens, args.experts, args.top_k,
                                                    args.capacity_factor),
        "tokens_dropped": sum(r["dropped"] for r in results),
        "bytes_per_rank": [r["bytes"] for r in results],
        "rows_per_expert": results[0]["rows_per_expert"],
        "rows_per_rank": results[0]["rows_per_rank"],
        "load_imbalance": round(expert_parallel.load_imbalance(results[0]["rows_per_expert"]), 4),
        "rank_imbalance": round(expert_parallel.load_imbalance(results[0]["rows_per_rank"]), 4),
        "skewed_rows_received": [r["skewed_recv"] for r in results],
        "max_abs_err": max(r["max_abs_err"] for r in results),
        "forward_seconds_per_rank": [round(r["seconds"], 4) for r in results],
    }
    sent = metrics["bytes_per_rank"][0]
    metrics["headline"] = (f"ep {world}, top-{args.top_k}: {metrics['tokens_dropped']} assignments "
                           f"dropped, rank 0 sends {sent['forward']} B forward, imbalance "
                           f"{metrics['load_imbalance']}, max |err| {metrics['max_abs_err']:.1e}")
    report = Report(LESSON, results[0]["device"], results[0]["backend"], world, checks, metrics)
    return finish(report, args.json, started)
