"""Assertions every lesson's test suite shares (the plumbing, not the lesson's ideas)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class SharedLaunchFailed(AssertionError):
    """A shared launch that failed once, reported again without being retried."""


_SELECTED: dict[str, frozenset[str] | None] = {"exercises": None}


def selected_exercises() -> frozenset[str] | None:
    """The exercises the grader is running alone (`course grade --exercise`, a planted bug, a
    mutant), or None when the whole suite runs. A suite that shares one launch among all its
    exercises launches only the selected ones' workers instead (the rest would be wasted)."""
    return _SELECTED["exercises"]


@contextlib.contextmanager
def selecting(exercises: frozenset[str] | None):
    """Within: `selected_exercises()` is `exercises` (the grader's side)."""
    previous, _SELECTED["exercises"] = _SELECTED["exercises"], exercises
    try:
        yield
    finally:
        _SELECTED["exercises"] = previous


def launch_once(fn: Callable) -> Callable:
    """`functools.cache` for a suite's shared launches that also remembers a failure: the first
    caller gets the error (a hang costs its deadline once), every later test of the class or of
    the module gets it again at once, named, instead of relaunching and waiting out the
    deadline again (five tests of a class sharing one hung launch cost one deadline, not five)."""
    results: dict = {}
    failures: dict = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key in failures:
            raise SharedLaunchFailed(f"{fn.__name__}{args or ''} failed earlier in this run and is not "
                                     f"retried: {failures[key]}")
        if key not in results:
            try:
                results[key] = fn(*args, **kwargs)
            except Exception as exc:
                failures[key] = f"{type(exc).__name__}: {exc}"
                raise
        return results[key]

    wrapper.cache_clear = lambda: (results.clear(), failures.clear())
    return wrapper


def assert_every_check_passes(case: unittest.TestCase, results_by_world: dict[int, list[dict]]) -> None:
    """Every named check of a demo worker passed on every rank, for every world size."""
    from lessons._report import merge_rank_checks  # imports torch: the grader itself does not

    for world, per_rank in results_by_world.items():
        for check in merge_rank_checks([result["checks"] for result in per_rank]):
            with case.subTest(world=world, check=check.name):
                case.assertTrue(check.passed, check.detail)


def rank_configurations(results_by_world: dict[int, list[dict]], prefix: str, dim: str):
    """(where, world, rank, key, value, per_rank) for every world size, rank and configuration
    key of a worker's result that starts with `prefix`; `where` names it ("cp=2 rank 1 ring/x")."""
    for world, per_rank in results_by_world.items():
        for rank, result in enumerate(per_rank):
            for key, value in result.items():
                if key.startswith(prefix):
                    yield f"{dim}={world} rank {rank} {key}", world, rank, key, value, per_rank


def assert_argument_error(case: unittest.TestCase, parse_args: Callable, argv: list[str],
                          fragment: str) -> str:
    """`parse_args(argv)` exits 2 with exactly one 'error:' line containing `fragment`."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), case.assertRaises(SystemExit) as caught:
        parse_args(argv)
    case.assertEqual(caught.exception.code, 2)
    errors = [line for line in stderr.getvalue().splitlines() if "error:" in line]
    case.assertEqual(len(errors), 1, stderr.getvalue())
    case.assertIn(fragment, errors[0])
    return stderr.getvalue()


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close): for torchrun's
    rendezvous endpoint in tests, so two test runs on one machine never share a fixed port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_under_torchrun(script: Path, args: list[str], nproc_per_node: int = 2, nnodes: int = 1,
                       timeout: float = 240.0) -> dict:
    """Run a lesson's main.py under torchrun on this machine's CPUs and return its `--json`
    report (written by global rank 0).

    nnodes=1: `torchrun --standalone --nproc-per-node=N`. nnodes=2: two torchrun processes on
    loopback, as two nodes would run them (`--nnodes=2 --node-rank=i`, c10d rendezvous on
    127.0.0.1 at a free port). Raises AssertionError with the tail of every process's output
    when any exits non-zero; every process is killed at `timeout`.
    """
    with tempfile.TemporaryDirectory(prefix="dtfs-torchrun-") as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": _loopback_name()}
        base = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
        lesson_args = [str(script), *args, "--device", "cpu", "--json", str(report)]
        if nnodes == 1:
            commands = [[*base, "--standalone", *lesson_args]]
        else:
            endpoint = f"127.0.0.1:{free_port()}"
            commands = [[*base, f"--nnodes={nnodes}", f"--node-rank={node}", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint={endpoint}", f"--rdzv-id=test-{os.getpid()}",
                         f"--rdzv-conf=is_host={1 if node == 0 else 0}", "--max-restarts=0",
                         *lesson_args] for node in range(nnodes)]
        procs = [subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for command in commands]
        outputs = []
        try:
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
                except subprocess.TimeoutExpired:
                    outputs.append(f"(killed after {timeout:g} s)")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
        codes = [proc.returncode for proc in procs]
        if any(code != 0 for code in codes) or not report.exists():
            tails = "\n".join(f"--- torchrun node {node} (exit {code}):\n{output[-3000:]}"
                              for node, (code, output) in enumerate(zip(codes, outputs)))
            raise AssertionError(f"torchrun run failed: {rank_error(outputs)} "
                                 f"(exit codes {codes}; {' '.join(lesson_args)})\n{tails}")
        return json.loads(report.read_text())


def rank_error(outputs: list[str]) -> str:
    """The failing rank's own error from torchrun's output: the one-line "error: rank N
    failed: ..." a lesson prints, else the last exception line a rank printed (torchrun's
    own ChildFailedError summary is skipped: it only says that a child failed)."""
    text = "\n".join(outputs)
    ours = re.findall(r"^(?:\[[^\]]*\]:?\s*)?error: (rank \d+ failed: .+)$", text, re.MULTILINE)
    if ours:
        return ours[0].strip()
    raised = [line.strip() for line in re.findall(
        r"^(?:\[[^\]]*\]:?\s*)?((?:[A-Za-z_.]+)?(?:Error|Exception|Interrupt)\b: .+)$", text, re.MULTILINE)
        if "ChildFailedError" not in line]
    return raised[0] if raised else "no rank printed an error (see the output below)"


def descendants(pid: int) -> list[int]:
    """PIDs of every live process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    except OSError:
        return False


def rank_of(pid: int) -> int | None:
    """A launcher child's rank, read from the per-rank stack file it keeps open."""
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.endswith(".stacks") and "/rank" in target:
                return int(target.rsplit("/rank", 1)[1].split(".")[0])
    except OSError:
        return None
    return None


def spawned_workers(pid: int) -> list[int]:
    """Descendants that are launcher ranks: processes holding a rank's stack file open (forked
    from the forkserver or spawned; not the forkserver itself, not the resource tracker)."""
    return [child for child in descendants(pid) if rank_of(child) is not None]


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a test's unique directory: torchrun
    agents and their workers carry it in their arguments)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _loopback_name() -> str:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), "lo")


def in_file_order(module_name: str):
    """A `load_tests` for a test module: unittest (and so the grader) runs its TestCase
    classes in the order the file defines them, as pytest does, instead of alphabetically.
    Put an exercise's in-process checks above its launches: the grader stops an exercise at
    its first failure, so a planted bug that a check in this process catches costs no ranks.
    Usage, at the module's end: `load_tests = in_file_order(__name__)`."""
    def load_tests(loader: unittest.TestLoader, tests, pattern) -> unittest.TestSuite:
        module = sys.modules[module_name]
        classes = [value for value in vars(module).values() if isinstance(value, type)
                   and issubclass(value, unittest.TestCase) and value.__module__ == module_name]
        return unittest.TestSuite(loader.loadTestsFromTestCase(cls) for cls in classes)
    return load_tests


def exercise(exercise_id: str):
    """Tag a test method or a TestCase class with the exercise it grades (lessons/_grading.py);
    untagged tests grade the lesson's "integration" criterion."""
    def tag(obj):
        obj._exercise = exercise_id
        return obj
    return tag
