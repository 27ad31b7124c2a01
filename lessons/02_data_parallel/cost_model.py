"""Lesson 02, part 2: what data parallelism costs, per step and per rank.

main.py builds four ways to average the gradient; they move the same bytes and differ in how
many messages they send and when. In reading order:

1. Bytes: 2(p-1)/p x Psi x b per rank with a ring (lesson 01), whatever the variant.
2. Messages: one all-reduce per bucket; the exact count, and a closed-form bound on it.
3. Time: after backward (naive, flat), nothing hides the communication; bucketed and
   overlapped, every bucket but the last can hide behind the rest of backward.
"""

from __future__ import annotations

import importlib
import math

from .main import assign_buckets_by_size

collectives = importlib.import_module("lessons.01_collectives.main")  # lesson 01's technique

# ============================================================================ 1. bytes


def ddp_bytes_per_rank(num_params: float, bytes_per_param: int, world_size: int) -> float:
    """Bytes each rank sends per step to all-reduce the gradient with a ring (lesson 01):
    2(p-1)/p x Psi x b, the same for the naive, flat and bucketed variants."""
    return collectives.ring_all_reduce_bytes_formula(num_params * bytes_per_param, world_size)


# ============================================================================ 2. messages


def count_buckets(sizes_bytes: list[int], cap_bytes: int, first_cap_bytes: int | None = None) -> int:
    """How many all-reduces (one per bucket) a backward launches: exactly
    len(assign_buckets_by_size(...)); see `bucket_count_bound` for the closed form."""
    return len(assign_buckets_by_size(sizes_bytes, cap_bytes, first_cap_bytes))


def bucket_count_bound(total_bytes: int, cap_bytes: int, num_tensors: int) -> int:
    """An upper bound on `count_buckets` under the close-at-cap rule:
    n <= min(ceil(Psi b / cap), n_tensors). Every closed bucket holds at least the cap and an
    open last one is not empty; big tensors make the count smaller (the README's example: 3
    buckets where the bound is 13)."""
    return min(math.ceil(total_bytes / cap_bytes), num_tensors) if num_tensors else 0


# ============================================================================ 3. time


def step_time_after_backward(t_forward: float, t_backward: float, t_all_reduce: float,
                             t_optimizer: float) -> float:
    """Step time when the gradient is all-reduced after backward (naive, flat): nothing hides
    the communication. T = T_fwd + T_bwd + T_AR(all) + T_opt (seconds)."""
    return t_forward + t_backward + t_all_reduce + t_optimizer


def all_reduces_end(ready_s: list[float], all_reduce_s: list[float]) -> float:
    """When the last bucket's all-reduce ends (seconds after backward starts), with bucket i
    ready at r_i and taking A_i alone, launched in index order and run one at a time:
    start_i = max(r_i, end_{i-1}), end_i = start_i + A_i; so end_last = max_i (r_i + sum_{j>=i} A_j)."""
    end = 0.0
    for ready, seconds in zip(ready_s, all_reduce_s):
        end = max(ready, end) + seconds
    return end


def step_time_overlapped(t_forward: float, t_backward: float, ready_s: list[float],
                         all_reduce_s: list[float], t_optimizer: float) -> float:
    """Step time of bucketed, overlapped DDP:
    T = T_fwd + max(T_bwd, end_last) + T_opt, end_last from `all_reduces_end`.
    The last bucket is ready only when backward ends (r_last = T_bwd), so
    T >= T_fwd + max(T_bwd + A_last, r_0 + sum_i A_i) + T_opt: the last bucket is always exposed,
    and forward and the optimizer step hide nothing (no gradient exists before backward, and
    the step needs every average).
    Assumes all-reduces run one at a time (one communication stream) at their stand-alone speed,
    and communication does not slow computation (on a GPU it shares memory bandwidth and SMs,
    on a CPU the cores)."""
    return t_forward + max(t_backward, all_reduces_end(ready_s, all_reduce_s)) + t_optimizer
