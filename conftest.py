"""pytest's hooks for the whole course.

* The CPU suite never touches a GPU: CUDA devices are hidden from the test process and
  everything it starts (so `pytest` on a GPU box tests exactly what it tests on a laptop; the
  GPU suite is `python -m course gpu`).
* The slowest test files are handed out first (longest first: two pytest-xdist workers then
  finish close together, instead of one running the planted bugs alone at the end); pyproject
  turns off xdist's own reordering by test count, which put the one-test files last.
* One intra-op thread per process (OMP_NUM_THREADS=1, unless set): the two workers, their
  grader processes and notebook kernels already keep both cores busy, and torch's default (a
  thread per core in every process) only made them fight (the whole run: 739 s -> 696 s).
* The launcher's forkserver (an import of torch and torch._dynamo, about 4.5 CPU seconds) is
  started at once only in a process that runs tests; every other process the suite starts (a
  script refusing a bad argument, a grader, a `python -m unittest`) starts one at its first
  `launch()`, if it launches at all (lessons/_prewarm.py's NO_PREWARM, spelled out here as
  course/__init__.py does: importing it would prewarm). Counted in one run: 52 forkservers,
  238 CPU seconds.
* A lesson test marked @torchrun_demo (lessons._testing) is left out when tests/test_torchrun.py
  is collected too: that file runs every such demo in one torchrun job and applies each test's
  check to its lesson's report (a job per lesson: 116 CPU seconds for ten; one job: 29).
* At the end, a table of seconds per lesson suite and per course-wide test module.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in every child

os.environ["_DTFS_NO_PREWARM"] = "1"  # inherited by every process the suite starts

from lessons._prewarm import prewarm  # noqa: E402

_SECONDS: dict[str, float] = defaultdict(float)
_COUNTS: dict[str, int] = defaultdict(int)


def _group(nodeid: str) -> str:
    match = re.match(r"lessons/([^/]+)/", nodeid)
    return match.group(1) if match else nodeid.split("::")[0]


TORCHRUN_DEMOS = "tests/test_torchrun.py"  # the lessons' torchrun demos in one job

# Longest first (a worker's seconds per file in a CI run of this suite at commit da8fe67,
# 2026-11-27: the planted bugs with the untouched workspaces 109, the notebooks 77, the
# runner 50, the site 47, lesson 13's files 47, 42, 29 and 14, the launcher 44, lesson 14 40,
# the doc numbers on plain kernels 38, the torchrun demos 27, lesson 01 26, lesson 10 18,
# lessons 07, 03 and 15 15-16): the two workers then end within a short file of each other
# (with lesson 14 last, one worker had waited 25 s for the other). Every other file (14 s or
# less) keeps its place after them.
SLOWEST_FIRST = ("tests/test_planted_bugs.py", "tests/test_notebooks.py", "tests/test_runner.py",
                 "tests/test_site.py", "lessons/13_capstone/tests/test_nd.py", "tests/test_launch.py",
                 "lessons/13_capstone/tests/test_capstone.py", "lessons/14_fault_tolerance/",
                 "tests/test_portability.py", "lessons/13_capstone/tests/test_planner.py",
                 TORCHRUN_DEMOS, "lessons/01_collectives/", "lessons/10_bypass_distillation/",
                 "lessons/07_memory/", "lessons/03_zero/", "lessons/15_profiling/",
                 "lessons/13_capstone/tests/test_simulate.py")


def pytest_configure(config):
    """The forkserver starts now (while this process imports the suites) where tests run: in an
    xdist worker, or here without xdist; pytest-xdist's controller runs none."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        prewarm(force=True)


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(SLOWEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(SLOWEST_FIRST))

    items.sort(key=rank)  # stable: the order inside a file is kept
    # tests/test_torchrun.py runs every @torchrun_demo lesson test's demo in one torchrun job
    # and applies the test's check: the lessons' own copies (a job each) are left out
    if any(item.nodeid.startswith(TORCHRUN_DEMOS) for item in items):
        own = [item for item in items if hasattr(getattr(item, "obj", None), "torchrun_check")]
        if own:
            config.hook.pytest_deselected(items=own)
            items[:] = [item for item in items if item not in own]


def pytest_runtest_logreport(report):
    _SECONDS[_group(report.nodeid)] += report.duration
    if report.when == "call":
        _COUNTS[_group(report.nodeid)] += 1


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS:
        return
    terminalreporter.section("seconds per lesson suite and course-wide module")
    for group in sorted(_SECONDS):
        terminalreporter.write_line(f"{group:<42} {_COUNTS[group]:>4} tests {_SECONDS[group]:>8.1f} s")
    terminalreporter.write_line(f"{'total':<42} {sum(_COUNTS.values()):>4} tests "
                                f"{sum(_SECONDS.values()):>8.1f} s")
