"""Lesson 12's benchmark and training run (`python -m lessons.12_expert_parallel.bench`).

1. What the router does to the machine: a short training run of one MoE layer in one process,
   with and without the load-balancing loss, recording the assignments each expert gets per
   step, the experts' imbalance and the per-rank imbalance if the experts were spread over ep
   ranks (the rank with the most rows sets the step time and the all-to-all's size).
2. The loop over experts (`moe_layer`) against a grouped matmul: the kept rows sorted by
   expert and padded to the capacity C, one batched matmul (E, C, d) x (E, d, f) for all
   experts. Timings report; they never decide a check.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lessons._checks import synchronize
from lessons._launch import one_thread
from lessons._report import float_in, int_in

from . import main as expert_parallel


def router_load_run(aux_coef: float, steps: int = 40, tokens: int = 256, hidden: int = 16,
                    ffn: int = 32, experts: int = 8, top_k: int = 2, lr: float = 0.5,
                    seed: int = 0) -> list[list[int]]:
    """Assignments routed to each expert (before capacity) at every step of a short SGD run,
    float64, capacity unlimited, one thread (the same numbers on any machine). The task: match
    a fixed random teacher's output (mean squared error) + aux_coef x the load-balancing loss.
    The router's logit of expert 0 gets +1.5 on a constant input feature (an unlucky
    initialisation); the random rest of the router decides as much (see the README)."""
    with one_thread():
        return _router_load_run(aux_coef, steps, tokens, hidden, ffn, experts, top_k, lr, seed)


def _router_load_run(aux_coef, steps, tokens, hidden, ffn, experts, top_k, lr, seed):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(hidden, experts, generator=g, dtype=torch.float64) * 0.5
    router[0, 0] += 1.5
    w_in = torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64) / hidden**0.5
    w_out = torch.randn(experts, ffn, hidden, generator=g, dtype=torch.float64) / ffn**0.5
    teacher = torch.randn(hidden, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    params = [t.requires_grad_() for t in (router, w_in, w_out)]
    loads = []
    for _ in range(steps):
        x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
        x[:, 0] = 1.0
        result = expert_parallel.moe_layer(x, *params, top_k, 0.0)
        loss = F.mse_loss(result.out, x @ teacher) + aux_coef * result.aux_loss
        loss.backward()
        loads.append(torch.bincount(result.routing.experts.flatten(), minlength=experts).tolist())
        with torch.no_grad():
            for param in params:
                param -= lr * param.grad
                param.grad = None
    return loads


def rank_loads(expert_load: list[int], ep: int) -> list[int]:
    """Rows each of ep ranks processes when experts are dealt in contiguous blocks."""
    per = len(expert_load) // ep
    return [sum(expert_load[r * per:(r + 1) * per]) for r in range(ep)]


def load_line(coef: float, loads: list[list[int]], ep: int = 4) -> str:
    """One line of the report: the loads at the first and the last step, the imbalance (max /
    mean) of the experts and of ep ranks holding them."""
    first, last = loads[0], loads[-1]
    return (f"aux coef {coef:<4}: step 0 imbalance {expert_parallel.load_imbalance(first):.2f} "
            f"(ranks {rank_loads(first, ep)}); step {len(loads) - 1} {last}, imbalance "
            f"{expert_parallel.load_imbalance(last):.2f}, per rank (ep {ep}) {rank_loads(last, ep)}")


def grouped_moe(x: torch.Tensor, router_weight: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, top_k: int, capacity_factor: float) -> torch.Tensor:
    """`moe_layer`'s output with ONE batched matmul per weight: the kept rows of each expert
    placed in a padded (E, C, d) buffer (slot = keep_mask's slot order), bmm, gelu, bmm,
    scattered back with the gates. Padding rows are zeros and computed for nothing."""
    num_experts, tokens = w_in.shape[0], x.shape[0]
    capacity = expert_parallel.expert_capacity(tokens, num_experts, top_k, capacity_factor)
    routing = expert_parallel.route(x, router_weight, top_k)
    keep = expert_parallel.keep_mask(routing.experts, num_experts, capacity)
    token = torch.arange(tokens, device=x.device)[:, None].expand_as(routing.experts)[keep]
    expert = routing.experts[keep]
    order = torch.argsort(expert, stable=True)
    token, expert, gate = token[order], expert[order], routing.gates[keep][order]
    starts = torch.cumsum(torch.bincount(expert, minlength=num_experts), 0) - torch.bincount(
        expert, minlength=num_experts)
    slot = torch.arange(expert.numel(), device=x.device) - starts[expert]
    buffer = x.new_zeros(num_experts, capacity, x.shape[1])
    buffer[expert, slot] = x[token]
    y = torch.bmm(F.gelu(torch.bmm(buffer, w_in)), w_out)
    return torch.zeros_like(x).index_add(0, token, y[expert, slot] * gate[:, None])


def time_loop_vs_grouped(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                         capacity_factor: float, device: str = "cpu",
                         dtype=torch.float32, repeats: int = 7) -> dict:
    """Seconds (the median of `repeats`, the two forms alternating after one warm-up call each)
    of the loop and the grouped matmul on the same inputs: wall clock ("loop_s", "grouped_s")
    and this process's CPU time ("loop_cpu_s", "grouped_cpu_s": on CPU with one thread, the
    wall time of a quiet machine, and far less disturbed by other processes on a busy one);
    and their max |difference| (float32: a different summation order, ~1e-6)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    router = torch.randn(hidden, experts, generator=g).to(device, dtype)
    w_in = (torch.randn(experts, hidden, ffn, generator=g) / hidden**0.5).to(device, dtype)
    w_out = (torch.randn(experts, ffn, hidden, generator=g) / ffn**0.5).to(device, dtype)
    args = (x, router, w_in, w_out, top_k, capacity_factor)
    forms = {"loop_s": lambda: expert_parallel.moe_layer(*args).out, "grouped_s": lambda: grouped_moe(*args)}
    outputs = {name: form() for name, form in forms.items()}  # the warm-up calls
    samples: dict[str, list[float]] = {key: [] for name in forms
                                       for key in (name, name.replace("_s", "_cpu_s"))}
    for _ in range(repeats):
        for name, form in forms.items():
            synchronize(device)
            started, cpu = time.perf_counter(), time.process_time()
            form()
            synchronize(device)
            samples[name].append(time.perf_counter() - started)
            samples[name.replace("_s", "_cpu_s")].append(time.process_time() - cpu)
    return {**{name: statistics.median(values) for name, values in samples.items()},
            "max_abs_diff": (outputs["loop_s"] - outputs["grouped_s"]).abs().max().item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int_in(1, 1 << 20), default=4096)
    parser.add_argument("--hidden", type=int_in(1, 16384), default=256)
    parser.add_argument("--ffn", type=int_in(1, 65536), default=512)
    parser.add_argument("--experts", type=int_in(1, 1024), default=64)
    parser.add_argument("--top-k", type=int_in(1, 64), default=2)
    parser.add_argument("--capacity-factor", type=float_in(0.0, 1e6), default=1.25)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    torch.set_num_threads(1)
    for coef in (0.0, 1.0):
        loads = router_load_run(coef)
        if coef == 0.0:
            print(f"step 0 expert loads {loads[0]} (the same for both runs)")
        print(load_line(coef, loads))
    timing = time_loop_vs_grouped(args.tokens, args.hidden, args.ffn, args.experts, args.top_k,
                                  args.capacity_factor, args.device)
    print(f"{args.experts} experts, {args.tokens} tokens, d {args.hidden}, f {args.ffn}, medians of 7: "
          f"loop {timing['loop_s'] * 1e3:.1f} ms ({timing['loop_cpu_s'] * 1e3:.1f} ms CPU), grouped "
          f"{timing['grouped_s'] * 1e3:.1f} ms ({timing['grouped_cpu_s'] * 1e3:.1f} ms CPU), "
          f"max |diff| {timing['max_abs_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
