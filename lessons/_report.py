"""Shared plumbing for a lesson's command line and its report of named checks.

Every lesson demo ends the same way: a table of named checks (passed on every rank or not),
a few metrics, an optional `--json PATH` file in the format of COURSE.md, and exit code 0 iff
every check passed. Bad arguments are argparse errors: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lessons._launch import (
    FAULTS,
    WorkerError,
    choose_device,
    end_torchrun_process,
    is_reporting_rank,
    launch,
    raised_at,
    under_torchrun,
)


@dataclasses.dataclass
class Check:
    """One named claim the demo verified: `passed` and a short human-readable `detail`."""

    name: str
    passed: bool
    detail: str = ""


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [low, high] (high None = unbounded), else a one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {bound}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float, high: float | None = None) -> Callable[[str], float]:
    """argparse type: a finite float in [low, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value == value) or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < low or (high is not None and value > high):
            bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: must be {bound}")
        return value

    parse.__name__ = "number"
    return parse


def lesson_parser(description: str, world_size: int = 4, max_world_size: int = 64,
                  faults: tuple[str, ...] = FAULTS) -> argparse.ArgumentParser:
    """The flags every multi-process lesson shares (COURSE.md, 'main.py'). `faults`: the
    choices of --fault (a lesson that injects more kinds of failure lists them).

    A lesson adds its own flags with `parser.add_argument`; `--help` lists them first (under
    "options"), then the shared run flags, then the plumbing (report, deadline, fault
    injection) in groups of their own.
    """
    parser = argparse.ArgumentParser(description=description)
    run = parser.add_argument_group("run (every lesson)")
    run.add_argument("--world-size", type=int_in(1, max_world_size), default=world_size,
                     help=f"ranks to spawn on this machine (default {world_size}; "
                          "under torchrun the world size is torchrun's)")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="auto: CUDA+NCCL when enough GPUs exist, else CPU+gloo")
    run.add_argument("--seed", type=int_in(0), default=0, help="random seed (default 0)")
    run.add_argument("--quick", action="store_true", help="smaller sizes (CI, notebooks)")
    plumbing = parser.add_argument_group("report and failure handling (every lesson)")
    plumbing.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    plumbing.add_argument("--timeout", type=float_in(1.0, 3600.0), default=60.0,
                          help="per-rank deadline in seconds (default 60)")
    plumbing.add_argument("--fault", choices=faults,
                          help="make one rank fail on purpose, to see how the run ends")
    plumbing.add_argument("--fault-rank", type=int_in(0), default=0,
                          help="the rank --fault applies to (default 0)")
    parser.set_defaults(_max_world_size=max_world_size)
    return parser


def world_size_of(args: argparse.Namespace) -> int:
    """The run's world size: torchrun's WORLD_SIZE under torchrun, else --world-size."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Cross-argument validation shared by lessons: exits 2 with one line on a bad combination.
    Returns the run's world size (`world_size_of`)."""
    limit = getattr(args, "_max_world_size", None)
    if under_torchrun() and limit is not None and int(os.environ["WORLD_SIZE"]) > limit:
        parser.error(f"this lesson runs at most {limit} process(es): under torchrun use "
                     f"--nproc-per-node={limit} (WORLD_SIZE is {os.environ['WORLD_SIZE']})")
    if args.fault is not None and args.fault_rank >= args.world_size and not under_torchrun():
        parser.error(f"--fault-rank {args.fault_rank} is not a rank of --world-size "
                     f"{args.world_size}")
    try:
        choose_device(args.device, args.world_size)
    except ValueError as exc:
        parser.error(str(exc))
    return world_size_of(args)


def launch_checks(worker: Callable, args: argparse.Namespace,
                  worker_args: tuple) -> tuple[list[Any], list[Check]]:
    """A demo's ranks: `worker(ctx, *worker_args, args.fault, args.fault_rank)` on
    args.world_size ranks of args.device, within args.timeout. Returns (each rank's result, in
    rank order; the ranks' "checks" merged by `merge_rank_checks`)."""
    results = launch(worker, args.world_size, (*worker_args, args.fault, args.fault_rank),
                     device=args.device, timeout_s=args.timeout)
    return results, merge_rank_checks([r["checks"] for r in results])


def merge_rank_checks(per_rank: list[list[dict]]) -> list[Check]:
    """A check passes iff it passed on every rank; the detail comes from the first failing
    rank (or rank 0). Every rank must report the same check names in the same order."""
    names = [item["name"] for item in per_rank[0]]
    for rank, checks in enumerate(per_rank):
        if [item["name"] for item in checks] != names:
            raise ValueError(f"rank {rank} reported different checks than rank 0")
    merged = []
    for index, name in enumerate(names):
        failing = [(rank, checks[index]) for rank, checks in enumerate(per_rank)
                   if not checks[index]["passed"]]
        if failing:
            rank, item = failing[0]
            merged.append(Check(name, False, f"rank {rank}: {item['detail']}"))
        else:
            merged.append(Check(name, True, per_rank[0][index]["detail"]))
    return merged


@dataclasses.dataclass
class Report:
    lesson: str
    device: str
    backend: str
    world_size: int
    checks: list[Check]
    metrics: dict[str, Any]
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def to_json(self) -> dict:
        return {
            "lesson": self.lesson, "passed": self.passed, "device": self.device,
            "backend": self.backend, "world_size": self.world_size,
            "seconds": round(self.seconds, 3),
            "checks": [dataclasses.asdict(check) for check in self.checks],
            "metrics": self.metrics,
        }


def print_report(report: Report, console: Console | None = None) -> None:
    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    table = Table(title=f"{report.lesson}: {report.world_size} rank(s), {report.device}/"
                        f"{report.backend}", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for check in report.checks:
        table.add_row(check.name, "[green]PASS[/]" if check.passed else "[red]FAIL[/]",
                      check.detail)
    console.print(table)
    verdict = "[green]all checks passed[/]" if report.passed else "[red]some checks FAILED[/]"
    console.print(f"{verdict} in {report.seconds:.1f} s")


def finish(report: Report, json_path: Path | None, started: float) -> int:
    """Print the report (on the reporting rank), write --json, return the exit code."""
    report.seconds = time.monotonic() - started
    if is_reporting_rank():
        print_report(report)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.passed else 1


def harness_of(main_file: str | Path, harness: str = "checks"):
    """The harness module beside a lesson's `main.py` (`lessons.NN_slug.checks`), imported by
    package name."""
    folder = Path(main_file).resolve().parent
    package = ".".join(folder.relative_to(Path(__file__).resolve().parent.parent).parts)
    return importlib.import_module(f"{package}.{harness}")


def run_harness(main_file: str, harness: str = "checks") -> None:
    """What a lesson's `main.py` does when run as a script: import its sibling harness module
    (`harness_of`) and run that module's `main()` through `run_main`. The technique file stays
    free of checks and CLI code."""
    run_main(harness_of(main_file, harness).main)


def run_body(body: Callable[[], int]) -> int:
    """A lesson's main body's exit code; a failed rank becomes one clear line and exit code 1.
    Under torchrun this process is a rank: an exception in it prints its traceback, then
    "error: rank N failed: <the exception>" (the line a test or a reader looks for)."""
    try:
        return body()
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not under_torchrun():
            raise
        traceback.print_exc()
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500] + raised_at(exc.__traceback__)
        print(f"error: rank {os.environ['RANK']} failed: {summary}", file=sys.stderr)
        return 1


def run_main(body: Callable[[], int]) -> None:
    """Run a lesson's main body as a script (`run_body`), then exit with its code."""
    try:
        code = run_body(body)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        code = 130
    if under_torchrun():
        end_torchrun_process(code)
    sys.exit(code)
