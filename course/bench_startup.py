"""How long ranks take to start: `python -m course.bench_startup [--ranks 1 2 4 8] [--repeats 3]`.

Measures, for each start method of the shared launcher (lessons/_launch.py) side by side in one
run, the seconds from calling `launch()` to the moment the LAST rank enters the lesson's
function (every rank has imported what it needs and joined the process group):

* warm: the launching process already exists (a test suite, a notebook, the second launch of
  a demo); for forkserver the server has finished importing torch;
* fresh process: a new interpreter that imports torch and the launcher, then launches once,
  measured from the interpreter's start (what `python lessons/NN/main.py` pays).

A benchmark, not a test: the numbers depend on the machine and its load. The median of
`--repeats` runs is printed; start methods alternate so that both see the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
METHODS = ("spawn", "forkserver")

FRESH = """
import time, sys
started = time.time()
sys.path.insert(0, {root!r})
import torch, torch.distributed
from lessons._launch import launch
from course.bench_startup import entered
if __name__ == "__main__":
    times = launch(entered, {ranks}, device="cpu", timeout_s=300, method={method!r})
    print(max(times) - started)
"""


def entered(ctx) -> float:
    """A rank's first act: the wall-clock time at which lesson code starts."""
    return time.time()


def warm(method: str, ranks: int) -> float:
    from lessons._launch import launch
    called = time.time()
    times = launch(entered, ranks, device="cpu", timeout_s=300, method=method)
    return max(times) - called


def fresh(method: str, ranks: int) -> float:
    code = FRESH.format(root=str(REPO_ROOT), ranks=ranks, method=method)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return float(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.bench_startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    if any(r < 1 for r in args.ranks) or args.repeats < 1:
        parser.error("--ranks and --repeats must be positive")
    for method in METHODS:  # warm-up: the forkserver imports torch once, outside the timings
        warm(method, 1)
    rows = []
    for ranks in args.ranks:
        samples: dict[str, list[float]] = {f"{kind}_{m}": [] for kind in ("warm", "fresh")
                                           for m in METHODS}
        for _ in range(args.repeats):
            for method in METHODS:
                samples[f"warm_{method}"].append(warm(method, ranks))
                samples[f"fresh_{method}"].append(fresh(method, ranks))
        row = {"ranks": ranks, **{key: statistics.median(values) for key, values in samples.items()}}
        rows.append(row)
        print(f"{ranks} rank(s): warm spawn {row['warm_spawn']:.2f} s, forkserver "
              f"{row['warm_forkserver']:.2f} s | fresh process spawn {row['fresh_spawn']:.2f} s, "
              f"forkserver {row['fresh_forkserver']:.2f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
