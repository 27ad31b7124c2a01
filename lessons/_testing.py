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
from collections.abc import Callable, Mapping
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


class LazyWorlds(Mapping):
    """{world size: one launch's per-rank results}, each world launched when it is first read
    (through `launch_world(world)`, under launch_once: its result or failure is remembered, never
    relaunched). Iteration goes through the worlds in order, so a test that stops at its first
    failure launches no world after the failing one: the grader's first-failure mode ends a
    test at its first failing subTest (a planted bug caught on 2 ranks costs no 3- or 4-rank
    launch). A whole suite reads every world: the same launches as an eager dict."""

    def __init__(self, worlds, launch_world: Callable[[int], list]):
        self._worlds = tuple(worlds)
        self._launch = launch_once(launch_world)

    def __getitem__(self, world: int) -> list:
        if world not in self._worlds:
            raise KeyError(world)
        return self._launch(world)

    def __iter__(self):
        return iter(self._worlds)

    def __len__(self) -> int:
        return len(self._worlds)


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
        lesson_args = [str(script), *args, "--device", "cpu", "--json", str(report)]
        codes, outputs = _torchrun(lesson_args, nproc_per_node, nnodes, timeout)
        if any(code != 0 for code in codes) or not report.exists():
            tails = "\n".join(f"--- torchrun node {node} (exit {code}):\n{output[-3000:]}"
                              for node, (code, output) in enumerate(zip(codes, outputs)))
            raise AssertionError(f"torchrun run failed: {rank_error(outputs)} "
                                 f"(exit codes {codes}; {' '.join(lesson_args)})\n{tails}")
        return json.loads(report.read_text())


def _torchrun(script_and_args: list[str], nproc_per_node: int, nnodes: int,
              timeout: float) -> tuple[list[int | None], list[str]]:
    """Start `torchrun ... script args` (one process per node, on loopback), wait up to
    `timeout` in all, kill what is left: (each node's exit code, each node's output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": _loopback_name()}
    base = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1:
        commands = [[*base, "--standalone", *script_and_args]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        commands = [[*base, f"--nnodes={nnodes}", f"--node-rank={node}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", f"--rdzv-id=test-{os.getpid()}",
                     f"--rdzv-conf=is_host={1 if node == 0 else 0}", "--max-restarts=0",
                     *script_and_args] for node in range(nnodes)]
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
    return [proc.returncode for proc in procs], outputs


def torchrun_demo(args: list[str]):
    """Decorate a lesson's test `test_x(self, report)` that checks the report of its demo
    (`main.py args --device cpu --json ...`) run under torchrun on one node with two processes.
    Run alone (the lesson's suite, the grader), the test makes that torchrun run itself
    (run_under_torchrun). The whole course's suite instead runs every such demo in one torchrun
    job (tests/test_torchrun.py: two processes that run the lessons' harnesses one after
    another, torch imported once), hands each test's check its lesson's report, and leaves the
    lessons' own copies out (conftest.py): a torchrun job costs its agent and two interpreters
    importing torch and torch._dynamo, about 7 CPU seconds before the demo's first step."""
    def wrap(check: Callable):
        @functools.wraps(check)
        def test(self):
            check(self, run_under_torchrun(lesson_script(check), args, nproc_per_node=2))
        test.torchrun_args = list(args)
        test.torchrun_check = check
        return test
    return wrap


def lesson_script(fn: Callable) -> Path:
    """The main.py of the lesson whose test module defines `fn` (lessons/NN_slug/tests/x.py)."""
    return Path(sys.modules[fn.__module__].__file__).resolve().parent.parent / "main.py"


def run_demos_under_torchrun(demos: list[tuple[Path, list[str]]], timeout: float = 600.0
                             ) -> tuple[dict[Path, dict], int | None, str]:
    """Run each lesson's demo (its main.py's harness with `args`) in turn in one torchrun job
    on one node with two processes (lessons/_torchrun_demos.py). Returns ({script: its --json
    report} for the demos that wrote one, the index of the demo the job stopped in or None when
    every demo passed, and what went wrong: the failing rank's own error and the job's output).
    The job stops at the first demo that fails (its ranks' state is then unknown): the demos
    after it do not run."""
    with tempfile.TemporaryDirectory(prefix="dtfs-torchrun-demos-") as tmp:
        plan, reports = [], {}
        for number, (script, args) in enumerate(demos):
            reports[script] = Path(tmp) / f"report-{number}.json"
            plan.append([str(script), [*args, "--device", "cpu", "--json", str(reports[script])]])
        (Path(tmp) / "plan.json").write_text(json.dumps(plan))
        driver = REPO_ROOT / "lessons" / "_torchrun_demos.py"
        codes, outputs = _torchrun([str(driver), str(Path(tmp) / "plan.json")], 2, 1, timeout)
        found = {script: json.loads(path.read_text()) for script, path in reports.items() if path.exists()}
    if codes[0] == 0:
        return found, None, ""
    started = [int(n) for n in re.findall(r"^=== demo (\d+):", outputs[0], re.MULTILINE)]
    stopped = started[-1] if started else 0
    return found, stopped, (f"{rank_error(outputs)} (torchrun exit {codes[0]})\n"
                            f"--- the job's output:\n{outputs[0][-3000:]}")


_PEER_GONE = re.compile(r"Connection (reset|closed) by peer|Broken pipe|peer.*(closed|gone)", re.IGNORECASE)


def rank_error(outputs: list[str]) -> str:
    """The failing rank's own error from torchrun's output: the one-line "error: rank N
    failed: ..." a lesson prints (a rank's own error before one that only says its peer went
    away: "Connection reset by peer"), else the last exception line a rank printed (torchrun's
    own ChildFailedError summary is skipped: it only says that a child failed)."""
    text = "\n".join(outputs)
    ours = re.findall(r"^(?:\[[^\]]*\]:?\s*)?error: (rank \d+ failed: .+)$", text, re.MULTILINE)
    if ours:  # the root cause first: a rank that failed on its own, not from a peer's exit
        return min(ours, key=lambda line: bool(_PEER_GONE.search(line))).strip()
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
