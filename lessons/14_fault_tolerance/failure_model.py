"""Lesson 14, part 1: how often a run fails, how often to save, and what is left of it.

A job of N GPUs fails when any of them does: its mean time between failures (MTBF) is one GPU's
divided by N. Between failures the run saves every `interval` seconds of compute (lesson 06's
checkpoints); a failure costs a restart and the compute since the last save. Daly's model gives
the expected wall-clock time of that process, `simulate_run` injects the failures and measures
it, and the goodput (useful compute over wall-clock time) follows. The interval that maximises
it is Young's sqrt(2 C M) (lesson 06 holds Young's and Daly's formulas; imported here).
"""

from __future__ import annotations

import importlib
import math
import random

exact_resume = importlib.import_module("lessons.06_checkpointing.exact_resume")  # Young, Daly
young_interval, daly_interval = exact_resume.young_interval, exact_resume.daly_interval

HOUR = 3600.0
# Llama 3 (arXiv 2407.21783, section 3.3.4 and Table 5): a 54-day snapshot of 405B pre-training
# on up to 16K H100s; 466 job interruptions, 47 planned, 419 unexpected.
LLAMA3 = {"days": 54, "gpus": 16_384, "interruptions": 466, "planned": 47, "unexpected": 419}


# ============================================================================ 1. the failure model


# exercise failure-model (3 points): The job's MTBF, and the expected wall-clock time of a run
# hint: a job fails when ANY of its GPUs does: rates add, MTBFs divide. A segment of length L
#   completes in M e^(R/M) (e^(L/M) - 1) on average; add it up over the run's segments.
def job_mtbf(gpu_mtbf: float, gpus: int) -> float:
    """Mean time between failures of a synchronous job of `gpus` devices that each fail
    independently (Poisson) with mean time `gpu_mtbf`: the job stops when any one does, so the
    rates add: M_job = gpu_mtbf / gpus (same unit as gpu_mtbf). ValueError if gpus < 1."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    return gpu_mtbf / gpus


# exercise failure-model (continued)
def segment_time(length: float, restart: float, mtbf: float) -> float:
    """Expected wall-clock time to get through `length` seconds of work that a failure
    (Poisson, mean `mtbf`) sends back to its start, each failure costing a `restart` that can
    itself fail: M e^(R/M) (e^(L/M) - 1). Renewal argument: an attempt lasts
    E[min(T, L)] = M (1 - e^(-L/M)) and fails with probability 1 - e^(-L/M), after which a
    restart takes M (e^(R/M) - 1) on average; solving E = ... + P(fail) (restart + E) gives the
    formula (Daly 2006's complete model, per segment). As mtbf -> inf it tends to `length`."""
    return mtbf * math.exp(restart / mtbf) * math.expm1(length / mtbf)


# exercise failure-model (continued)
def expected_wall_time(work: float, interval: float, save: float, restart: float,
                       mtbf: float) -> float:
    """Expected wall-clock seconds to finish `work` seconds of compute when the run saves after
    every `interval` seconds of compute (each save costs `save`), and a failure sends it back
    to the last save after a `restart`. The run is ceil(work / interval) segments: every full
    one is `interval + save` long (work, then its save), the last one is the remaining work
    with no save after it (the run ends). interval >= work means no checkpoint at all: one
    segment of `work`. Sum of `segment_time(L_i, restart, mtbf)`. ValueError unless
    work, interval, mtbf > 0 and save, restart >= 0."""
    if work <= 0 or interval <= 0 or mtbf <= 0 or save < 0 or restart < 0:
        raise ValueError("need work, interval, mtbf > 0 and save, restart >= 0")
    full = math.ceil(work / interval) - 1
    last = work - full * interval
    return full * segment_time(interval + save, restart, mtbf) + segment_time(last, restart, mtbf)


def goodput(work: float, interval: float, save: float, restart: float, mtbf: float) -> float:
    """Useful compute over expected wall-clock time: work / expected_wall_time(...) (Llama 3's
    "effective training time" is this ratio, measured)."""
    return work / expected_wall_time(work, interval, save, restart, mtbf)


def first_order_loss(interval: float, save: float, mtbf: float) -> float:
    """Young's first-order share of time lost: C / tau (saving) + tau / (2 M) (on average half
    an interval redone per failure). Its minimum is at tau = sqrt(2 C M), where it is
    sqrt(2 C / M)."""
    return save / interval + interval / (2.0 * mtbf)


def simulate_run(work: float, interval: float, save: float, restart: float, mtbf: float,
                 rng: random.Random) -> tuple[float, int]:
    """Inject failures into a run and measure it: walk the segments of `expected_wall_time`;
    draw the time to the next failure from an exponential of mean `mtbf` (Poisson failures:
    memoryless, so a fresh draw after each event is exact); a failure during a segment (work or
    its save) or during a restart loses the time spent, then a restart follows. Returns (wall
    seconds, failures). The mean over many runs converges to `expected_wall_time(...)`."""
    full = math.ceil(work / interval) - 1
    segments = [interval + save] * full + [work - full * interval]
    wall, failures = 0.0, 0
    for length in segments:
        while True:  # attempts at this segment
            lost, failed = _failed_attempts(length, mtbf, rng, at_most=1)
            wall, failures = wall + lost, failures + failed
            if not failed:
                break
            lost, failed = _failed_attempts(restart, mtbf, rng)  # the restart itself may fail
            wall, failures = wall + lost + restart, failures + failed
        wall += length
    return wall, failures


def _failed_attempts(length: float, mtbf: float, rng: random.Random,
                     at_most: int | None = None) -> tuple[float, int]:
    """Try `length` seconds until an attempt sees no failure (or `at_most` failures): the
    seconds spent in the failed attempts and their number."""
    lost, failed = 0.0, 0
    while at_most is None or failed < at_most:
        until_failure = rng.expovariate(1.0 / mtbf)
        if until_failure >= length:
            break
        lost, failed = lost + until_failure, failed + 1
    return lost, failed


def best_interval(work: float, save: float, restart: float, mtbf: float) -> float:
    """The interval minimising `expected_wall_time` (no closed form for a finite run; Young's
    is its first-order limit): a log-spaced scan of 200 values between save / 10 and
    min(work, 40 mtbf) (past 40 MTBFs a segment costs e^40 times its length), then three
    finer scans around the best one."""
    low, high = save / 10.0 if save else work / 1e6, min(work, 40.0 * mtbf)
    best = low
    for _ in range(4):
        grid = [low * (high / low) ** (i / 199) for i in range(200)]
        best = min(grid, key=lambda tau: expected_wall_time(work, tau, save, restart, mtbf))
        step = (high / low) ** (1 / 199)
        low, high = best / step, best * step
    return best
