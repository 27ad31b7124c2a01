"""Several lessons' demos in one torchrun job: `torchrun --standalone --nproc-per-node=2
lessons/_torchrun_demos.py PLAN.json`, where PLAN.json lists [main.py path, [its arguments]].

Each process joins torchrun's group once and runs each lesson's harness in turn, as
`python main.py ARGS` would under torchrun (lessons._report.run_body: the lesson's launch()
joins the group already made instead of spawning). torch, torch._dynamo and the group are paid
for once instead of once per lesson (tests/test_torchrun.py; lessons._testing.torchrun_demo).
Before each demo, rank 0 prints "=== demo N: main.py ARGS". The job stops at the first demo
that fails: after a rank's failure the other rank may be waiting in a collective, so the job
ends (exit 1) and torchrun stops every process; the demos after it do not run.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: lessons/ must be importable
    sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from lessons._launch import end_torchrun_process  # noqa: E402
from lessons._report import harness_of, run_body  # noqa: E402

GROUP_TIMEOUT_S = 600  # every demo's collectives: the longest of the lessons' --timeout values and more


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    # the group every demo joins (launch() keeps one it finds): made here, with a deadline that
    # fits every lesson, not the first demo's own --timeout
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    for number, (script, args) in enumerate(plan):
        if os.environ["RANK"] == "0":
            print(f"=== demo {number}: {script} {' '.join(args)}", flush=True)
        code = run_body(functools.partial(harness_of(script).main, args))
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    end_torchrun_process(main(sys.argv[1]))
