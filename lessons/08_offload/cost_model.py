"""Lesson 08, part 2 (after main.py): the cost model that plans what stays on the device.

One profiling step (ProTrain's memory-aware profiler in miniature: checks.py runs it with
lesson 07's tracker and a clock) fills a `Profile`. From it, for any (persistent chunks,
recomputed blocks) configuration of main.py's `ChunkManager`, without running it:

1. `static_bytes`: the device bytes alive when a step starts (states and chunk buffers);
2. `predict_peak`: static + the largest of the forward, backward and optimizer-step moments;
3. `count_fetches` and `fetched_numel`: one step's host-to-device chunk copies and the elements
   they move (each copies only its chunk's used part), through main.py's own LRU pool and
   prefetch plan (so the predicted numbers are the counted ones);
4. `predict_time`: the plain step plus what recomputation, copies and the host Adam add;
5. `plan`: the fastest configuration whose peak, times a safety factor, fits a memory budget,
   or `BudgetError` naming the smallest feasible budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from . import main as offload
from .main import OffloadConfig

ITEMSIZE = 4  # fp32 training: every state is 4 bytes per element
# The states priced here are torch.optim.Adam's (m and v: 2 x 4 bytes per element; its step
# counters are CPU scalars, host memory); another optimizer class changes that 8.

# ============================================================================ 1. the profile


@dataclasses.dataclass
class Profile:
    """What one profiling run (everything persistent, nothing recomputed) measures."""

    chunk_used: list[int]  # elements in each chunk
    block_chunks: list[list[int]]  # the chunks each block's weights live in
    chunk_numel: int
    fixed_numel: int  # parameters outside the blocks
    largest_fixed: int  # elements of the largest of them
    act_block: int  # bytes a block adds to the live set in forward (what it keeps + its output)
    act_input: int  # bytes of a block's input (what a recomputed block keeps)
    forward_extra: int = 0  # beyond static + blocks, at the end of forward (logits, loss, ...)
    backward_extra: int = 0  # beyond static + blocks, at the backward peak
    step_extra: int = 0  # beyond static + the Adam temporaries, at the optimizer step's peak
    t_plain_step: float = 0.0  # seconds: one step with everything persistent, nothing recomputed
    t_forward_block: float = 0.0  # one block's forward (what recomputing it costs)
    t_h2d_per_byte: float = 0.0  # a chunk fetch: pinned host -> device, non-blocking, then waited
    t_d2h_per_byte: float = 0.0  # a block's gradients: device -> host, as _grad_ready copies them
    t_adam_device: float = 0.0  # per element
    t_adam_host: float = 0.0  # per element
    chunk_largest: list[int] = dataclasses.field(default_factory=list)  # largest parameter in each
    # chunk (the optimizer steps parameters, not chunks); empty: a chunk counts as one tensor


# ============================================================================ 2. the predictions


def buffers_needed(profile: Profile, config: OffloadConfig) -> int:
    """A block's offloaded chunks plus one to prefetch the next block's (0 if none offloaded)."""
    if config.n_persist >= len(profile.chunk_used):
        return 0
    return max(sum(c >= config.n_persist for c in chunks) for chunks in profile.block_chunks) + 1


def static_bytes_formula(fixed_numel: int, persistent_numel: int, n_buffers: int, chunk_numel: int) -> int:
    """12F + 16 x persistent elements + 4 x B x C: fixed parameters with Adam's m and v (their
    gradients come and go within the step), persistent chunks with gradient, m and v, and the
    chunk buffers."""
    return 3 * ITEMSIZE * fixed_numel + 4 * ITEMSIZE * persistent_numel + ITEMSIZE * n_buffers * chunk_numel


def static_bytes(profile: Profile, config: OffloadConfig) -> int:
    """Device bytes alive when a step starts, for `config`."""
    return static_bytes_formula(profile.fixed_numel, sum(profile.chunk_used[:config.n_persist]),
                                buffers_needed(profile, config), profile.chunk_numel)


def predict_peak(profile: Profile, config: OffloadConfig) -> int:
    """Device peak = static + the largest of three moments:
    forward (its peak is at its end): every block's kept bytes (a recomputed block: only its input) + extras;
    backward of the last block: the earlier blocks' bytes + one whole block (rematerialised if
    it was recomputed) + extras;
    optimizer step: Adam's two temporaries as large as the largest device parameter + extras."""
    n_blocks = len(profile.block_chunks)
    kept = [profile.act_input if b < config.n_checkpoint else profile.act_block for b in range(n_blocks)]
    forward = sum(kept) + profile.forward_extra
    backward = sum(kept[:-1]) + profile.act_block + profile.backward_extra
    largest = max([profile.largest_fixed]
                  + (profile.chunk_largest or profile.chunk_used)[:config.n_persist])
    step = 2 * ITEMSIZE * largest + profile.step_extra
    return static_bytes(profile, config) + max(forward, backward, step)


def fetched_chunks(profile: Profile, config: OffloadConfig) -> list[int]:
    """The chunks copied host-to-device in one step, in order: blocks 0..L-1 forward, then
    L-1..0 backward (a recomputed block twice: its backward pre-hook, then its forward again),
    through the same LRU pool and prefetch rule (access_plan) the manager uses."""
    n_buffers = buffers_needed(profile, config)
    if n_buffers == 0:
        return []
    pool = offload.BufferPool(n_buffers)  # main.py's pool and plan, looked up when called
    n_blocks = len(profile.block_chunks)
    backward, fetched = [], []
    for block in reversed(range(n_blocks)):  # a recomputed block runs its forward again
        backward += [block, block] if block < config.n_checkpoint else [block]
    for block, direction in [(b, 1) for b in range(n_blocks)] + [(b, -1) for b in backward]:
        for chunks, keep in offload.access_plan(profile.block_chunks, config.n_persist, block,
                                                direction, pool):
            fetched += [chunk for chunk, _, new in pool.acquire(chunks, keep) if new]
    return fetched


def count_fetches(profile: Profile, config: OffloadConfig) -> int:
    """Host-to-device chunk copies in one step."""
    return len(fetched_chunks(profile, config))


def fetched_numel(profile: Profile, config: OffloadConfig) -> int:
    """Elements those copies move: each copies its chunk's used elements, not the whole
    buffer (the last chunk of a block is often short), so sum(chunk_used[c]) over fetches."""
    return sum(profile.chunk_used[chunk] for chunk in fetched_chunks(profile, config))


def predict_time(profile: Profile, config: OffloadConfig) -> float:
    """Seconds per step, from the profiled plain step, for a manager that does everything one
    thing after another (as this lesson's does), so the terms add:

    T = T_plain + n_checkpoint x T_forward_block                 (recomputation)
        + fetched elements x 4 B x t_h2d                         (chunk fetches)
        + offloaded elements x 4 B x t_d2h                       (gradients to the host)
        + offloaded elements x (t_adam_host - t_adam_device)     (the host Adam)

    An approximation, not ProTrain's model, which overlaps copies with compute and the host
    Adam with backward (T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim); exercise 3)."""
    offloaded = sum(profile.chunk_used[config.n_persist:])
    return (profile.t_plain_step + config.n_checkpoint * profile.t_forward_block
            + fetched_numel(profile, config) * ITEMSIZE * profile.t_h2d_per_byte
            + offloaded * ITEMSIZE * profile.t_d2h_per_byte
            + offloaded * (profile.t_adam_host - profile.t_adam_device))


# ============================================================================ 3. the planner


def all_configs(profile: Profile) -> list[OffloadConfig]:
    return [OffloadConfig(p, c) for p, c in itertools.product(range(len(profile.chunk_used) + 1),
                                                              range(len(profile.block_chunks) + 1))]


class BudgetError(ValueError):
    """No configuration fits the memory budget."""


SAFETY = 1.10  # ProTrain's fragmentation factor (alpha), as Axolotl's integration applies it


# exercise planner (3 points): The budget a configuration needs, and the planner
# hint: required = ceil(safety x predict_peak); keep the configurations whose requirement fits,
#   pick the fastest by predict_time (ties: -n_persist, then n_checkpoint)
def required_budget(profile: Profile, config: OffloadConfig, safety: float = SAFETY) -> int:
    """The budget `config` needs: ceil(safety x predicted peak). The factor covers what the
    model does not see: the allocator's fragmentation and rounding, transients, model error."""
    return math.ceil(safety * predict_peak(profile, config))


# exercise planner (continued)
def plan(profile: Profile, budget_bytes: int, safety: float = SAFETY) -> OffloadConfig:
    """The configuration with the smallest predicted time whose required_budget fits
    `budget_bytes` (ties: more persistent chunks, then fewer recomputed blocks).

    Exhaustive: (chunks + 1) x (blocks + 1) configurations, each O(blocks) to predict. Raises
    BudgetError naming the smallest feasible budget (and its configuration) when none fits."""
    configs = all_configs(profile)
    fitting = [c for c in configs if required_budget(profile, c, safety) <= budget_bytes]
    if not fitting:
        smallest = min(configs, key=lambda c: required_budget(profile, c, safety))
        raise BudgetError(f"no configuration fits a budget of {budget_bytes:,} bytes; the smallest "
                          f"feasible budget is {required_budget(profile, smallest, safety):,} bytes "
                          f"(n_persist={smallest.n_persist}, n_checkpoint={smallest.n_checkpoint}, "
                          f"predicted peak x {safety:.2f})")
    return min(fitting, key=lambda c: (predict_time(profile, c), -c.n_persist, c.n_checkpoint))
