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
* At the end, a table of seconds per lesson suite and per course-wide test module.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in every child

import lessons  # noqa: E402,F401  (starts the launcher's forkserver now, before `course` may import it)

_SECONDS: dict[str, float] = defaultdict(float)
_COUNTS: dict[str, int] = defaultdict(int)


def _group(nodeid: str) -> str:
    match = re.match(r"lessons/([^/]+)/", nodeid)
    return match.group(1) if match else nodeid.split("::")[0]


# Slowest first (the planted bugs with the untouched workspaces, the notebooks, lesson 13's
# files, the site, the runner, the doc numbers on plain kernels); every other file keeps its
# place after them.
SLOWEST_FIRST = ("tests/test_planted_bugs.py", "tests/test_notebooks.py", "lessons/13_capstone/",
                 "tests/test_site.py", "tests/test_runner.py", "tests/test_portability.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(SLOWEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(SLOWEST_FIRST))

    items.sort(key=rank)  # stable: the order inside a file is kept


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
