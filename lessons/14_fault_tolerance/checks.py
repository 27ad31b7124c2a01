"""Lesson 14's harness: every failure injected for real, detected, named and survived.

* `Fault`: the injected failures (a raised exception, a process that exits, a hang, a SIGTERM,
  a flipped bit, a slow rank), each on one rank at one step of the FIRST attempt only;
* `run_worker`: one rank of one attempt (recovery.train_resiliently on the capstone's model,
  float64, the Shakespeare corpus);
* the demo: one table, each failure against an uninterrupted run on the same machine;
* the CLI: `--out DIR` runs one job (self-spawned under `elastic_agent`, or one attempt per
  process under torchrun, whose agent restarts it), `--fault ... --fault-rank R --fault-step S`.

`python lessons/14_fault_tolerance/main.py` runs `main()` below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from lessons._checks import max_abs_diff
from lessons._launch import (
    RankContext,
    choose_device,
    device_for_extra_ranks,
    inject_fault,
    launch,
    under_torchrun,
)
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    lesson_parser,
    world_size_of,
)

from . import failure_model, nccl_hang, recovery

capstone, checkpointing = recovery.capstone, recovery.checkpointing

LESSON = "14_fault_tolerance"
FAULTS = ("crash", "hang", "exit", "sigterm", "bitflip", "slow")
# Resharding to fewer ranks sums each step's gradient in another order: float64 rounding
# (~1e-16 relative per step) grows through a few AdamW steps to about 1e-13 (measured 9.1e-14 on the
# dev machine); a wrong batch, LR or moment is 1e-4 or more.
RESHARD_TOLERANCE = 1e-10
SLOW_SECONDS = 0.4  # the injected straggler's extra time per step (a step takes ~0.05 s here)
# ... or SLOW_FACTOR x the rank's fastest step so far, if longer: on a loaded machine every
# rank's work grows with the load but a sleep does not, so a fixed 0.4 s stops being 2x the
# others' work (name_straggler's factor); 4x a whole step keeps the slow rank's work about
# 5x the others' at any load
SLOW_FACTOR = 4.0
FR_BUFFER = "2000"  # TORCH_FR_BUFFER_SIZE for the ranks: PyTorch's flight recorder, also on gloo
# Daly (2006), Figs. 3-5 (500 h of work, 5-minute saves, 10-minute restarts): MTBF in seconds,
# the optimum interval he prints in minutes, half a unit of its last digit
DALY_FIGURES = ((24 * 3600.0, 117.0, 0.5), (6 * 3600.0, 57.0, 0.5), (15 * 60.0, 9.1, 0.05))


def run_config(steps: int, seed: int) -> capstone.GPTRunConfig:
    """The capstone's run, small: 1 layer, hidden 32, 12 sequences of 32 characters per step
    (divisible by 1, 2, 3 and 4 ranks), no dropout (a resharded run then differs only by
    summation order)."""
    return capstone.GPTRunConfig(layers=1, hidden=32, heads=2, seq=32, global_batch=12, accum=1,
                                 steps=steps, lr=1e-2, warmup=2, dropout=0.0, seed=seed)


# ============================================================================ injected failures


@dataclasses.dataclass
class Fault:
    """`kind` on rank `rank` after step `step` of attempt 0 only (torchrun's restart count or
    our agent's): crash, hang and exit through the launcher's `inject_fault`; sigterm: the rank
    receives SIGTERM (a scheduler's notice); bitflip: one bit of one parameter flips in memory;
    slow: the rank sleeps max(SLOW_SECONDS, SLOW_FACTOR x its fastest step before) after this
    step and the next (a step: from one call to the next, the sleep excluded)."""

    kind: str | None
    rank: int
    step: int
    attempt: int = 0
    fired: bool = False
    last_call: float | None = None  # time.monotonic() at the end of the previous call
    fastest_step: float = 0.0  # seconds, the shortest step seen before the slow ones

    def __call__(self, ctx: RankContext, trainer) -> None:
        if self.kind is None or ctx.rank != self.rank or recovery.restart_count(self.attempt):
            return
        if self.kind == "slow" and trainer.step < self.step and self.last_call is not None:
            step = time.monotonic() - self.last_call
            self.fastest_step = min(self.fastest_step or step, step)
        if self.kind == "slow" and self.step <= trainer.step <= self.step + 1:
            time.sleep(max(SLOW_SECONDS, SLOW_FACTOR * self.fastest_step))
        self.last_call = time.monotonic()
        if self.fired or trainer.step != self.step:
            return
        self.fired = True  # a step replayed after a rollback does not fail again
        if self.kind in ("crash", "hang", "exit"):
            inject_fault(ctx, self.kind, self.rank)
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "bitflip":
            flip_bit(trainer.named[0][1], index=0, bit=40)


def flip_bit(param: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` of element `index` of a float64 tensor in place (bit 40 of the mantissa:
    a relative change of about 2^-12, small enough to train on silently)."""
    with torch.no_grad():
        flat = param.data.view(-1).view(torch.int64)
        flat[index] ^= 1 << bit


def load_corpus() -> tuple[torch.Tensor, int]:
    text = capstone.load_text()
    tokenizer = capstone.CharTokenizer(text)
    return tokenizer.encode(text), len(tokenizer.chars)


def run_worker(ctx: RankContext, config: dict, out: str, how: dict, fault: dict,
               attempt: int, slow: tuple[float, float] = (0.0, 0.0)) -> dict:
    """One rank of one attempt: the run in float64 with the failure `fault` armed; `slow` =
    (seconds to sleep after each step, seconds each shard write waits: to act on a run by
    hand, or to cut a save with SIGKILL)."""
    torch.set_default_dtype(torch.float64)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER)  # read at the first collective
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FR_BUFFER)  # NCCL's name in torch 2.11
    injected = Fault(**fault, attempt=attempt)
    data, vocab = load_corpus()

    def after_step(trainer) -> None:
        injected(ctx, trainer)
        time.sleep(slow[0])

    resilience = recovery.Resilience(**how, after_step=after_step)
    with slow_writes(slow[1]):
        result = recovery.train_resiliently(ctx, capstone.GPTRunConfig(**config), data, vocab,
                                            Path(out), resilience)
    return {**result, "attempt": recovery.restart_count(attempt)}


@contextlib.contextmanager
def slow_writes(seconds: float):
    """Every checkpoint shard written while active waits `seconds` first (a slow filesystem)."""
    if not seconds:
        yield
        return
    real = checkpointing.write_shard

    def write(step_dir, rank, world, payload):
        time.sleep(seconds)
        return real(step_dir, rank, world, payload)
    with mock.patch.object(checkpointing, "write_shard", write):
        yield


def batch_worker(ctx: RankContext, config: dict, runs: list[tuple[str, dict, dict]]) -> list[dict]:
    """Several whole runs in one launch (failures that kill no process): (out, how, fault)."""
    return [run_worker(ctx, config, out, how, fault, 0) for out, how, fault in runs]


def start_job(config: dict, out: Path, how: dict, fault: dict, device: str, timeout: float,
              slow: tuple[float, float] = (0.0, 0.0)):
    """What `elastic_agent` starts: every rank of one attempt, self-spawned."""
    def start(world: int, attempt: int) -> list[dict]:
        return launch(run_worker, world, (config, str(out), how, fault, attempt, slow),
                      device=device, timeout_s=timeout)
    return start


# ============================================================================ the demo's rows


def timed_job(config, out, how, fault, world, device, timeout, max_restarts=1, min_world=None):
    """Run one job under our elastic agent; (outcome, seconds)."""
    started = time.monotonic()
    outcome = recovery.elastic_agent(start_job(config, out, how, fault, device, timeout),
                                     world, max_restarts, min_world)
    return outcome, time.monotonic() - started


def restart_row(kind: str, reference: dict, outcome: dict, rank: int, step: int,
                tolerance: float | None = None) -> Check:
    """A killed attempt (crash, exit, hang) restarted from the latest checkpoint: the first
    attempt's error names the rank, the last one resumed and ended on the reference's digest
    (or within `tolerance` of its weights after resharding)."""
    attempts = outcome["attempts"]
    first, final = attempts[0]["error"] or "", outcome["results"][0]
    named = f"rank {rank} failed" in first
    if tolerance is None:
        same = all(r["sha256"] == reference["sha256"] for r in outcome["results"])
        detail = f"sha256 {'==' if same else '!='} uninterrupted"
    else:
        gap = max_abs_diff(final["params"], reference["params"])
        same, detail = gap <= tolerance, f"max |diff| {gap:.1e} <= {tolerance:g} (resharded)"
    worlds = " -> ".join(str(a["world"]) for a in attempts)
    ok = named and len(attempts) == 2 and final["resumed_from"] is not None and same
    return Check(f"{kind} on rank {rank} at step {step}: detected, restarted, survived", ok,
                 f"{first.split(' (then')[0][:90]}; ranks {worlds}; resumed from step "
                 f"{final['resumed_from']}; {detail}")


def hang_row(reference: dict, outcome: dict, diagnostics: Path, rank: int, step: int,
             deadline: float, seconds: float) -> tuple[Check, Check]:
    """The watchdog named the hung rank (its verdict, its stacks), the run recovered; and
    our ring buffer agrees with PyTorch's flight recorder on the same collectives."""
    dumps = sorted(diagnostics.glob("rank*.json"))
    verdicts = [json.loads(p.read_text())["verdict"] for p in dumps]
    stacks = (diagnostics / f"rank{rank}.stacks")
    in_fault = stacks.exists() and "inject_fault" in stacks.read_text()
    named = bool(verdicts) and all(v["culprits"] == [rank] for v in verdicts)
    final, error = outcome["results"][0], outcome["attempts"][0]["error"] or ""
    same = final["sha256"] == reference["sha256"]
    ok = named and in_fault and f"rank {rank} failed: WatchdogTimeout" in error and same
    message = verdicts[0]["message"] if verdicts else "no diagnosis written"
    detect = Check(f"hang on rank {rank} at step {step}: watchdog ({deadline:g} s) named it, "
                   "restarted, survived", ok,
                   f"{message[:150]}; stacks: {'in inject_fault' if in_fault else 'MISSING'}; "
                   f"{len(outcome['attempts'])} attempts in {seconds:.1f} s; sha256 "
                   f"{'==' if same else '!='} uninterrupted")
    return detect, compare_with_flight_recorder(diagnostics)


def compare_with_flight_recorder(diagnostics: Path) -> Check:
    """Every collective of the default group in our dump == PyTorch's flight recorder's entry
    with the same sequence number (op family and input sizes), on every rank that wrote both."""
    compared, mismatches = 0, []
    for ours_path in sorted(diagnostics.glob("rank*.json")):
        fr_path = ours_path.with_suffix(".fr.pkl")
        if not fr_path.exists():
            continue
        ours = json.loads(ours_path.read_text())
        theirs = {e["seq"]: e for e in nccl_hang.read_dump(fr_path) if e["group"] == "default_pg"}
        world = len(ours["entries"][-1]["group"]) if ours["entries"] else 0
        for entry in ours["entries"]:
            if len(entry["group"]) != world or entry["seq"] not in theirs:
                continue
            fr = theirs[entry["seq"]]
            compared += 1
            if not same_collective(entry, fr):
                mismatches.append(f"#{entry['seq']} {entry['op']} {entry['sizes']} vs "
                                  f"{fr['op']} {fr['sizes']}")
    return Check("our ring buffer == PyTorch's flight recorder (same seq, op, sizes)",
                 compared > 0 and not mismatches,
                 f"{compared} collectives compared" + (f"; {mismatches[:2]}" if mismatches else ""))


def same_collective(ours: dict, fr: dict) -> bool:
    """Our entry and a flight-recorder row (`nccl_hang.read_dump`) describe the same call: the
    op's family (torch names all_gather_into_tensor "all_gather", barrier an all_reduce of one
    element...)."""
    name = fr["op"].split(":", 1)[1]
    family = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "barrier": "barrier"}.get(ours["op"], ours["op"])
    if ours["op"] == "barrier":
        return "barrier" in name or name == "all_reduce"
    return name.startswith(family) and (not ours["sizes"] or ours["sizes"] == fr["sizes"])


def preemption_row(reference: dict, first: list[dict], second: list[dict], rank: int,
                   step: int, grace: float) -> Check:
    events = [e for r in first for e in r["events"] if e["kind"] == "preempted"]
    stopped = {e["step"] for e in events}
    same = all(r["sha256"] == reference["sha256"] for r in second)
    ok = (len(events) == len(first) and stopped == {step} and all(e["saved"] for e in events)
          and second[0]["resumed_from"] == step and same)
    left = min((e["left"] for e in events), default=float("nan"))
    return Check(f"sigterm on rank {rank} at step {step}: every rank stopped there, "
                 "emergency save, resumed, survived", ok,
                 f"stopped at steps {sorted(stopped)} with {left:.1f} of {grace:g} s left; "
                 f"resumed from step {second[0]['resumed_from']}; sha256 "
                 f"{'==' if same else '!='} uninterrupted")


def sdc_row(reference: dict, results: list[dict], rank: int, step: int) -> Check:
    events = [e for e in results[0]["events"] if e["kind"] == "sdc"]
    world = len(results)
    expected = "replica" if world >= 3 else "checkpoint"
    suspects = [e["suspects"] for e in events]
    named = suspects == [[rank]] if world >= 3 else suspects == [list(range(world))]
    same = all(r["sha256"] == reference["sha256"] for r in results)
    ok = named and bool(events) and events[0]["healed"] == expected and same
    how = (f"named rank {suspects[0][0] if suspects else '?'} by majority, healed from a "
           "healthy replica" if world >= 3 else "2 replicas differ, no majority: rolled back "
           "to the last checkpoint they agreed on")
    return Check(f"bitflip on rank {rank} at step {step}: fingerprints differ, healed", ok,
                 f"{how}; sha256 {'==' if same else '!='} uninterrupted; events {len(events)}")


def straggler_row(results: list[dict], rank: int, step: int) -> tuple[Check, dict]:
    rows = [s for s in results[0]["steps"] if step <= s["step"] <= step + 1]
    named = [s["straggler"] for s in rows]
    base = [s for s in results[0]["steps"] if s["step"] < step]
    cost = {"step_s": statistics.mean(s["seconds"] for s in rows),
            "max_work_s": statistics.mean(s["max_work"] for s in rows),
            "mean_work_s": statistics.mean(s["mean_work"] for s in rows),
            "before_step_s": statistics.mean(s["seconds"] for s in base) if base else None}
    ok = named == [rank, rank] and cost["step_s"] >= cost["max_work_s"] * 0.9
    return Check(f"slow rank {rank} at steps {step}-{step + 1}: named, its cost measured", ok,
                 f"named {named}; step {cost['step_s']:.2f} s ~ max work "
                 f"{cost['max_work_s']:.2f} s, not the mean {cost['mean_work_s']:.2f} s"), cost


def simulation_checks(runs: int = 2000, seed: int = 0) -> tuple[list[Check], dict]:
    """Daly's expected wall time against runs with injected failures (4 standard errors: a
    mean of `runs` draws is within that of its expectation but for 6e-5 of the time)."""
    checks, metrics = [], {}
    work, mtbf, restart, save = 25 * failure_model.HOUR, 24 * failure_model.HOUR, 600.0, 60.0
    for label, interval in (("no checkpoint", work),
                            ("Young's interval", failure_model.young_interval(save, mtbf))):
        rng = random.Random(seed)
        walls = [failure_model.simulate_run(work, interval, save, restart, mtbf, rng)[0]
                 for _ in range(runs)]
        mean, error = statistics.mean(walls), statistics.stdev(walls) / math.sqrt(runs)
        expected = failure_model.expected_wall_time(work, interval, save, restart, mtbf)
        metrics[label] = {"expected_h": expected / 3600, "simulated_h": mean / 3600,
                          "stderr_h": error / 3600}
        checks.append(Check(f"25 h of work, MTBF 24 h, {label}: Daly's model == {runs} "
                            "simulated runs", abs(mean - expected) <= 4 * error,
                            f"expected {expected / 3600:.2f} h, simulated {mean / 3600:.2f} "
                            f"+- {error / 3600:.2f} h (goodput {work / expected:.0%})"))
    best = [failure_model.best_interval(500 * 3600.0, 300.0, 600.0, m) / 60 for m, _, _ in DALY_FIGURES]
    checks.append(Check("the model's best interval == Daly's published optima (117, 57, 9.1 min)",
                        all(abs(b - want) <= half for b, (_, want, half) in zip(best, DALY_FIGURES)),
                        ", ".join(f"{b:.2f}" for b in best) + " min (500 h, save 5 min, restart "
                        "10 min; MTBF 24 h, 6 h, 15 min)"))
    return checks, metrics


# ============================================================================ the demo


def demo(args, config: capstone.GPTRunConfig) -> Report:
    """Every failure, each injected on rank args.fault_rank (or the last rank) after step
    args.fault_step of the first attempt, against an uninterrupted run on the same machine."""
    world = world_size_of(args)
    device, backend = choose_device(args.device, world)
    replicas = max(world, 2)  # silent corruption and stragglers need a replica to compare
    rank, step = args.fault_rank, args.fault_step
    conf = dataclasses.asdict(config)
    how = {"save_every": args.save_every, "check_every": args.check_every, "deadline": 0.0,
           "grace": args.grace}
    fault = {"rank": min(rank, replicas - 1), "step": step}
    scratch = Path(tempfile.mkdtemp(prefix="lesson14-"))
    try:
        batch = [(str(scratch / "base"), how, {**fault, "kind": None}),  # on `replicas` ranks
                 (str(scratch / "slow"), how, {**fault, "kind": "slow"}),
                 (str(scratch / "sdc"), how, {**fault, "kind": "bitflip"})]
        batch_device = device_for_extra_ranks(args.device, replicas)  # a type, as `device` is
        if batch_device != device:
            print(f"the replica runs: {replicas} ranks on {batch_device} ({replicas} ranks need "
                  f"{replicas} GPUs); the killed runs on {world} rank(s) on {device}")
        per_rank = launch(batch_worker, replicas, (conf, batch), device=batch_device,
                          timeout_s=args.timeout)
        base, slow, sdc = ([r[i] for r in per_rank] for i in range(3))
        reference = base[0]
        if replicas != world:  # the killed runs compare with a run on `world` ranks
            alone = [(str(scratch / "base-alone"), how, {**fault, "kind": None})]
            reference = launch(batch_worker, world, (conf, alone), device=args.device,
                               timeout_s=args.timeout)[0][0]
        checks, metrics = simulation_checks()
        checks.append(Check("every rank ends with the same weights (uninterrupted run)",
                            len({r["sha256"] for r in base}) == 1, reference["sha256"][:16]))
        for kind in ("crash", "exit"):
            shrink = kind == "exit" and world > 1  # the exited rank's machine is gone
            outcome, _ = timed_job(conf, scratch / kind, how, {**fault, "rank": rank, "kind": kind},
                                   world, args.device, args.timeout,
                                   min_world=world - 1 if shrink else None)
            checks.append(restart_row(kind + (f" (restart on {world - 1} ranks)" if shrink else ""),
                                      reference, outcome, rank, step,
                                      RESHARD_TOLERANCE if shrink else None))
        hang_how = {**how, "deadline": args.watchdog}
        outcome, seconds = timed_job(conf, scratch / "hang", hang_how,
                                     {**fault, "rank": rank, "kind": "hang"}, world, args.device,
                                     args.timeout)
        checks += hang_row(reference, outcome, scratch / "hang" / "diagnostics" / "attempt0",
                           rank, step, args.watchdog, seconds)
        start = start_job(conf, scratch / "sigterm", how, {**fault, "rank": rank,
                                                           "kind": "sigterm"}, args.device,
                          args.timeout)
        first = start(world, 0)
        second = start(world, 1)  # the scheduler requeues the job
        checks.append(preemption_row(reference, first, second, rank, step, args.grace))
        checks.append(sdc_row(base[0], sdc, fault["rank"], step))
        row, straggler = straggler_row(slow, fault["rank"], step)
        checks.append(row)
        check_cost = statistics.mean(s for r in base for s in r["check_seconds"])
        step_cost = statistics.mean(s["seconds"] for s in base[0]["steps"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    metrics = {"final_param_sha256": reference["sha256"], "simulation": metrics,
               "straggler": straggler, "check_seconds": check_cost, "step_seconds": step_cost,
               "check_overhead": check_cost / (args.check_every * step_cost),
               "headline": f"{sum(c.passed for c in checks if c.name.split()[0] in FAULTS)} of "
                           f"{len(FAULTS)} failures survived; replica "
                           f"check {check_cost * 1e3:.1f} ms per {args.check_every} step(s) of "
                           f"{step_cost * 1e3:.0f} ms"}
    return Report(LESSON, device, backend, world, checks, metrics)


# ============================================================================ one job (--out)


def job(args, config: capstone.GPTRunConfig) -> Report:
    """A real run into args.out: self-spawned under `elastic_agent`, or this process's rank
    of one torchrun attempt (torchrun's agent restarts the attempts)."""
    how = {"save_every": args.save_every, "check_every": args.check_every,
           "deadline": args.watchdog, "grace": args.grace}
    fault = {"kind": args.fault, "rank": args.fault_rank, "step": args.fault_step}
    conf = dataclasses.asdict(config)
    world = world_size_of(args)
    device, backend = choose_device(args.device, world)
    slow = (args.sleep_per_step, args.save_delay)
    if under_torchrun():
        results = launch(run_worker, world, (conf, str(args.out), how, fault, 0, slow),
                         device=args.device, timeout_s=args.timeout)
        attempts = [{"world": world, "error": None}]
    else:  # a scheduler's SIGTERM to this process goes on to the ranks; this one waits for them
        previous = signal.signal(signal.SIGTERM, forward_to_ranks)
        try:
            outcome = recovery.elastic_agent(start_job(conf, args.out, how, fault, args.device,
                                                       args.timeout, slow),
                                             world, args.max_restarts, args.min_world_size)
        finally:
            signal.signal(signal.SIGTERM, previous)
        results, attempts = outcome["results"], outcome["attempts"]
    manifest = checkpointing.verify_checkpoint(checkpointing.read_latest(args.out / "checkpoints"),
                                               None, True, config.fingerprint())
    first = results[0]
    preempted = [e for e in first["events"] if e["kind"] == "preempted"]
    checks = [
        Check("every rank ends with the same weights", len({r["sha256"] for r in results}) == 1,
              first["sha256"][:16]),
        Check("the run reached its last step" if not preempted else
              "preempted: every rank stopped at one step and the checkpoint verifies",
              first["step"] == config.steps or (bool(preempted) and manifest["step"] == first["step"]),
              f"step {first['step']} of {config.steps}; latest checkpoint step {manifest['step']}"),
    ]
    diagnosis = args.out / "diagnostics" / "attempt0" / f"rank{args.fault_rank}.json"
    verdict = json.loads(diagnosis.read_text())["verdict"]["message"] if diagnosis.exists() else None
    if len(attempts) > 1:
        checks.append(Check(f"attempt 0 failed ({args.fault} on rank {args.fault_rank} at step "
                            f"{args.fault_step}), the agent restarted it from the latest "
                            "checkpoint", first["resumed_from"] is not None,
                            f"{(attempts[0]['error'] or '')[:100]}; ranks "
                            f"{' -> '.join(str(a['world']) for a in attempts)}; resumed from "
                            f"step {first['resumed_from']}"))
    metrics = {"final_param_sha256": first["sha256"], "step": first["step"], "diagnosis": verdict,
               "restart_count": first["attempt"], "attempts": attempts,
               "resumed_from": first["resumed_from"], "events": first["events"],
               "stragglers": sorted({s["straggler"] for s in first["steps"]
                                     if s["straggler"] is not None}),
               "headline": f"step {first['step']}, attempt {first['attempt']}, resumed from "
                           f"{first['resumed_from']}"}
    return Report(LESSON, device, backend, len(results), checks, metrics)


def forward_to_ranks(signum, frame) -> None:
    """The launching process's SIGTERM handler: pass the notice on to every live rank."""
    for child in multiprocessing.active_children():
        if child.name.startswith("rank") and child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)


# ============================================================================ the command line


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Fault tolerance for the capstone's run: the failure arithmetic, a "
                           "watchdog and a collective ring buffer that name a hung rank, "
                           "elastic restarts from verified checkpoints, preemption, silent data "
                           "corruption and stragglers.", world_size=3, faults=FAULTS)
    parser.add_argument("--fault-step", type=int_in(1), default=3,
                        help="the step after which --fault fires, first attempt only (default 3)")
    parser.add_argument("--steps", type=int_in(2, 100_000), default=6, help="training steps (default 6)")
    parser.add_argument("--save-every", type=int_in(1), default=2, help="checkpoint every N steps")
    parser.add_argument("--check-every", type=int_in(0), default=1,
                        help="compare the replicas' fingerprints every N steps (0: never; must "
                             "divide --save-every)")
    parser.add_argument("--watchdog", type=float_in(0.0, 3600.0), default=None,
                        help="seconds without progress before the watchdog names the stuck "
                             "rank (0: off; default 2 in the demo, 10 with --out)")
    parser.add_argument("--grace", type=float_in(0.0, 3600.0), default=30.0,
                        help="seconds between SIGTERM and the expected SIGKILL (default 30)")
    parser.add_argument("--out", type=Path, default=None,
                        help="run one job into this directory (checkpoints, diagnostics) "
                             "instead of the demo (--fault alone: a temporary one); required "
                             "under torchrun")
    parser.add_argument("--resume", action="store_true", help="continue OUT's checkpoints")
    parser.add_argument("--max-restarts", type=int_in(0, 100), default=1,
                        help="self-spawned job: restarts after a failure (torchrun: its own flag)")
    parser.add_argument("--sleep-per-step", type=float_in(0.0, 60.0), default=0.0,
                        help="slow the run down, to signal or kill it by hand")
    parser.add_argument("--save-delay", type=float_in(0.0, 60.0), default=0.0,
                        help="each shard write waits this long (a slow filesystem: cut a save "
                             "with SIGKILL and see `latest` keep the previous checkpoint)")
    parser.add_argument("--min-world-size", type=int_in(1), default=None,
                        help="self-spawned job: restart on one rank fewer after a failure, down "
                             "to this many (torchrun: --nnodes=MIN:MAX)")
    parser.set_defaults(fault_rank=None)
    args = parser.parse_args(argv)
    if args.fault_rank is None:  # the last rank: the others then wait for it
        args.fault_rank = world_size_of(args) - 1
    world = check_args(parser, args)
    if args.fault is not None and args.fault_rank >= world:
        parser.error(f"--fault-rank {args.fault_rank} is not a rank of {world}")
    if args.fault_step > args.steps:
        parser.error(f"--fault-step {args.fault_step} is after the last step ({args.steps})")
    if args.check_every and args.save_every % args.check_every:
        parser.error(f"--check-every {args.check_every} must divide --save-every "
                     f"{args.save_every} (a checkpoint is only saved where the replicas agreed)")
    if args.min_world_size is not None and args.min_world_size > world:
        parser.error(f"--min-world-size {args.min_world_size} is above the world size {world}")
    if args.out is None and under_torchrun():
        parser.error("--out is required under torchrun (every rank writes to one directory)")
    if args.out is None and args.resume:
        parser.error("--resume needs --out")
    args.demo = args.out is None and args.fault is None
    if args.watchdog is None:
        args.watchdog = 2.0 if args.demo else 10.0
    if args.demo and args.fault_step >= args.steps:
        parser.error(f"the demo needs --fault-step below --steps ({args.fault_step} >= {args.steps})")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    config = run_config(args.steps, args.seed)
    if args.demo:
        return finish(demo(args, config), args.json, started)
    if args.out is None:  # --fault without --out: one job in a temporary directory
        with tempfile.TemporaryDirectory(prefix="lesson14-job-") as tmp:
            args.out = Path(tmp)
            return finish(job(args, config), args.json, started)
    latest = args.out / "checkpoints" / "latest"
    if latest.exists() and not args.resume and recovery.restart_count() == 0:
        print(f"error: {args.out} already holds checkpoints: pass --resume to continue them, "
              "or choose another --out", file=sys.stderr)
        return 2
    try:
        report = job(args, config)
    except checkpointing.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return finish(report, args.json, started)


def py_spy_executable() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment used without being
    activated, as CI runs `.venv/bin/python`); None where it is not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def py_spy_dump(pid: int, timeout: float = 30.0) -> str | None:
    """`py-spy dump --pid PID`: every thread's Python stack of a live process, read from outside
    (ptrace), without its cooperation; None where py-spy is not installed."""
    exe = py_spy_executable()
    if exe is None:
        return None
    proc = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=timeout)
    return proc.stdout + proc.stderr


if __name__ == "__main__":
    from lessons._report import run_main
    run_main(main)
