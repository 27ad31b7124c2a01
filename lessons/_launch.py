"""The one shared launcher: every lesson starts its ranks through `launch()`.

Process lifecycle is where distributed teaching code usually breaks, so it lives here once:

* **Self-spawn** (the laptop path): `world_size` children are started from a *forkserver* that
  imported torch once (`import torch` costs seconds of CPU per process; a fork of a process
  that already holds it costs milliseconds), falling back to the *spawn* start method where
  forkserver does not exist (`COURSE_START_METHOD=spawn` forces it). The forkserver is a fresh
  interpreter that never touches CUDA, so ranks may use CUDA. Ranks meet through a rendezvous
  *file* in a fresh temporary directory (never a fixed port), so two runs cannot collide.
* **Join torchrun** (the GPU-box path): when RANK and WORLD_SIZE are set, the current process
  *is* one rank; it joins the group (env:// rendezvous) instead of spawning. The group is
  created once per process (with `device_id` on CUDA) and destroyed at exit, however many
  times a lesson calls `launch()`.
* **Deadlines everywhere**: every child has a process-group timeout and a faulthandler alarm
  that dumps its stacks and exits; it also exits if its parent disappears. The parent polls its
  children, and on the first failure (exception, non-zero exit, signal) or at the deadline it
  kills every remaining child and raises `WorkerError` naming the rank and the cause.
* **Plain results**: a worker's return value must be plain Python data (no tensors). It is
  pickled to a file in the run directory and read by the parent after the child exited, so no
  live tensor ever crosses a queue from a process that may already be gone.

Usage (from a lesson)::

    def worker(ctx: RankContext, numel: int) -> dict:
        ...  # torch.distributed is initialised here; ctx.rank, ctx.world_size, ctx.device
        return {"ok": True}

    results = launch(worker, world_size=4, args=(1000,))   # list, one entry per rank
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lessons._prewarm import NO_PREWARM as _NO_PREWARM
from lessons._prewarm import PRELOAD as _PRELOAD
from lessons._prewarm import prewarm, start_method  # noqa: F401 (both part of the API)

# torch 2.13 names the one-tensor collectives all_gather_single and reduce_scatter_single (the
# old all_gather_into_tensor and reduce_scatter_tensor now warn); torch 2.11, the CUDA build on
# the course's GPU box, has only the old names. Every rank imports this module, so one spelling
# runs on both.
if not hasattr(dist, "all_gather_single"):
    dist.all_gather_single = dist.all_gather_into_tensor
if not hasattr(dist, "reduce_scatter_single"):
    dist.reduce_scatter_single = dist.reduce_scatter_tensor

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT_S = 120.0
_POLL_S = 0.02
_STACK_DUMP_GRACE_S = 1.0
# A rank's own alarm (dump its stacks and exit) rings this long after its collectives' timeout:
# a peer of a hung rank must first raise its communication error and report it as a symptom.
# With the two at the same instant, a loaded machine let the alarm kill a peer mid-raise, and
# the peer was reported as hung too. Below the parent's 5 s, so the alarm still rings first.
_ALARM_AFTER_TIMEOUT_S = 2.0


class WorkerError(RuntimeError):
    """A rank failed, died or hung. `rank` is the first rank found failing (None if unknown)."""

    def __init__(self, message: str, rank: int | None = None, cause: str = ""):
        super().__init__(message)
        self.rank = rank
        self.cause = cause


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a worker knows about its place in the group."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    launched_by: str  # "spawn" or "torchrun"


# ----------------------------------------------------------------------------- device choice


_PHASE: dict[str, Any] = {"file": None, "text": ""}


def _write_atomically(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` so that a reader finds the old file or the new one, never half."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
    os.replace(tmp, path)


def phase(text: str) -> None:
    """Say what this rank is doing now ("dispatch-combine ep=2 top_k=2"), in a worker that
    loops over configurations: if the rank fails or hangs, the launcher's error names the last
    phase it set, so a deadline says which configuration hung. Cheap (a small file write on a
    spawned rank; kept in memory under torchrun)."""
    _PHASE["text"] = text
    if _PHASE["file"] is not None:
        _write_atomically(_PHASE["file"], text)


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_device(requested: str, world_size: int) -> tuple[str, str]:
    """Map `--device {auto,cpu,cuda}` to (device type, backend).

    auto -> ("cuda", "nccl") when at least one GPU per local rank is visible (`world_size` GPUs
    for self-spawn; torchrun's --nproc-per-node on this node), else ("cpu", "gloo"). Asking for
    cuda without enough GPUs is a ValueError with a one-line reason. Only counts devices: the
    parent process never initialises CUDA.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {requested!r}: use auto, cpu or cuda")
    if requested == "cpu":
        return "cpu", "gloo"
    gpus = torch.cuda.device_count()
    if under_torchrun():
        needed = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        what = f"torchrun --nproc-per-node={needed} needs {needed} GPU(s) on this node"
    else:
        needed, what = world_size, f"--device cuda with {world_size} rank(s) needs {world_size} GPU(s)"
    if gpus >= needed:
        return "cuda", "nccl"
    if requested == "cuda":
        raise ValueError(f"{what}, found {gpus}")
    return "cpu", "gloo"


def device_for_extra_ranks(requested: str, world_size: int) -> str:
    """The device of a demo's extra launch on `world_size` ranks (lesson 06's reshard target,
    lesson 14's replicas) when the learner asked for `requested`: the same, except "cuda" with
    fewer GPUs than ranks (one GPU, world 1 -> 2), where it runs on the CPU with gloo instead
    of failing. What such a launch checks (a checkpoint's bytes, replicas' fingerprints) does
    not depend on the device; the demo says where it ran. That is "auto"'s rule."""
    return choose_device("auto" if requested == "cuda" else requested, world_size)[0]


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


# ----------------------------------------------------------------------------- the worker side


def _importable(fn: Callable) -> tuple[str, str]:
    """(module, name) a spawned child can import. A lesson run as a script has module
    `__main__`; the child must import it by its package name (lessons.NN_slug.main)."""
    module = fn.__module__
    if module == "__main__":
        path = Path(getattr(sys.modules["__main__"], "__file__", "") or ".").resolve()
        if path.is_relative_to(REPO_ROOT) and path.suffix == ".py":
            module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        # else: a script outside the course; spawn re-runs it as the child's __main__
    return module, fn.__qualname__


def _check_plain(value: Any, where: str = "result") -> None:
    """Refuse tensors in results: they must come back as plain data (or through files)."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where} is a torch.Tensor; return plain data (e.g. .tolist())")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")


def _watch_parent(parent_pid: int) -> None:
    """Exit this child when the launching process is gone (a killed launcher must not leave
    orphans). A forkserver child's OS parent is the forkserver, so watch the launcher itself:
    multiprocessing's parent sentinel closes when the launcher dies (spawn and forkserver)."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(3)
    while True:  # no sentinel: poll the launcher's pid
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        time.sleep(0.2)


def _child_main(rank: int, spec: dict) -> None:
    """Entry point of one spawned rank (runs in the child process)."""
    run_dir = Path(spec["run_dir"])
    stack_file = open(run_dir / f"rank{rank}.stacks", "w")  # noqa: SIM115 (lives as long as the process)
    faulthandler.enable(stack_file)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.dump_traceback_later(spec["timeout_s"] + _ALARM_AFTER_TIMEOUT_S, exit=True,
                                      file=stack_file)
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    _PHASE["file"] = run_dir / f"rank{rank}.phase"
    try:
        os.environ.update(spec["env"])  # a forkserver child has the server's environment
        device = torch.device("cpu")
        if spec["device_type"] == "cpu":
            torch.set_num_threads(1)
        if spec["device_type"] == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        module = importlib.import_module(spec["module"])
        fn = getattr(module, spec["name"])
        dist.init_process_group(
            spec["backend"],
            init_method=f"file://{run_dir / 'rendezvous'}",
            rank=rank,
            world_size=spec["world_size"],
            timeout=datetime.timedelta(seconds=spec["timeout_s"]),
            device_id=device if device.type == "cuda" else None,
        )
        ctx = RankContext(rank, spec["world_size"], device, spec["backend"], "spawn")
        result = fn(ctx, *spec["args"])
        _check_plain(result)
        dist.barrier()  # nobody closes its sockets while a peer may still be receiving
        dist.destroy_process_group()
        _write_atomically(run_dir / f"rank{rank}.result", pickle.dumps(result))
    except BaseException as exc:  # report every failure, then exit non-zero
        # The rank has its error in hand: its own deadline must not kill it mid-report (a peer
        # timing out in a collective at the deadline was then taken for a hung rank); the
        # parent's deadline, 5 s later, still bounds the report.
        faulthandler.cancel_dump_traceback_later()
        # The error's first line at once: naming where it was raised reads source files
        # (linecache), slow on a loaded machine, and the deadline may kill us meanwhile.
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        _write_atomically(run_dir / f"rank{rank}.error", summary + "\n")
        _write_atomically(run_dir / f"rank{rank}.error", summary + raised_at(exc.__traceback__)
                          + "\n" + traceback.format_exc())
        stack_file.flush()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    stack_file.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- the parent side


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _short_path(path: str) -> str:
    """A source path as a reader finds it: relative to the repository (or to its `lessons/`
    folder in a learner's workspace), else the file name."""
    marker = f"{os.sep}lessons{os.sep}"
    return path[path.rindex(marker) + 1:] if marker in path else Path(path).name


def raised_at(tb) -> str:
    """" (raised in fn, lessons/NN_slug/file.py:line)" for the innermost frame of an exception's
    traceback that is lesson code (not torch's, not the launcher's); empty if none is."""
    frames = [frame for frame in traceback.extract_tb(tb)
              if f"{os.sep}lessons{os.sep}" in frame.filename and not frame.filename.endswith("_launch.py")]
    if not frames:
        return ""
    return f" (raised in {frames[-1].name}, {_short_path(frames[-1].filename)}:{frames[-1].lineno})"


def _innermost_frame(stack_text: str, module: str = "") -> str:
    """Where a rank was stuck, from the last faulthandler dump: the innermost Python frame,
    then (if different) the innermost frame in the lesson of the worker `module`
    ("lessons.12_expert_parallel.tests.workers" -> lessons/12_expert_parallel/), so a hang
    inside lesson 01's ring names the lesson function that called it."""
    dumps = [block for block in stack_text.split("\n\n")
             if "File " in block and "_watch_parent" not in block]
    if not dumps:
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', dumps[-1])
    if not frames:
        return ""
    path, line, func = frames[0]  # faulthandler prints the most recent call first
    where = f"{func} ({_short_path(path)}:{line})"
    parts = module.split(".")
    if len(parts) > 1 and parts[0] == "lessons":  # the worker's lesson: its technique first
        lesson = f"{os.sep}lessons{os.sep}{parts[1]}{os.sep}"
        ours = [frame for frame in frames if lesson in frame[0]]
        technique = [frame for frame in ours if f"{os.sep}tests{os.sep}" not in frame[0]]
        caller = (technique or ours or [None])[0]
    else:
        caller = None
    if caller is not None and caller != frames[0]:
        where += f", called from {caller[2]} ({_short_path(caller[0])}:{caller[1]})"
    # waiting inside torch.distributed (a collective, the rendezvous) is a symptom of a peer
    return f"torch.distributed: {where}" if "/torch/distributed/" in path else where


def _kill_all(processes: list) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=5)


def _spawn(fn: Callable, world_size: int, args: tuple, device_type: str, backend: str,
           timeout_s: float, method: str) -> list[Any]:
    module, name = _importable(fn)
    run_dir = Path(tempfile.mkdtemp(prefix="dtfs-run-"))
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", _NO_PREWARM: "1"}
    loopback = _loopback_interface()
    if loopback and backend == "gloo":
        child_env["GLOO_SOCKET_IFNAME"] = loopback
    spec = {
        "module": module, "name": name, "args": args, "run_dir": str(run_dir),
        "world_size": world_size, "device_type": device_type, "backend": backend,
        "timeout_s": timeout_s, "parent_pid": os.getpid(), "env": child_env,
    }
    saved_env = {key: os.environ.get(key) for key in child_env}
    os.environ.update(child_env)  # spawned children inherit the environment at start
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)
    ctx = mp.get_context(method)
    processes = []
    try:
        for rank in range(world_size):
            proc = ctx.Process(target=_child_main, args=(rank, spec), name=f"rank{rank}",
                               daemon=True)
            proc.start()
            processes.append(proc)
        _wait(processes, run_dir, timeout_s, f"{module}.{name}")
        results = []
        for rank in range(world_size):
            with open(run_dir / f"rank{rank}.result", "rb") as handle:
                results.append(pickle.load(handle))
        return results
    finally:
        _kill_all(processes)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(run_dir, ignore_errors=True)


def _wait(processes: list, run_dir: Path, timeout_s: float, worker: str = "") -> None:
    """Poll until every rank exited 0; on the first failure or at the deadline raise."""
    deadline = time.monotonic() + timeout_s + 5.0  # children time out first and say why
    while True:
        codes = [proc.exitcode for proc in processes]
        if any(code not in (None, 0) for code in codes):
            time.sleep(0.2)  # let simultaneous failures land, then pick the root cause
            _raise_root_cause(processes, run_dir, timeout_s, worker)
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            _raise_root_cause(processes, run_dir, timeout_s, worker)
        time.sleep(_POLL_S)


def _raise_root_cause(processes: list, run_dir: Path, timeout_s: float, worker: str = "") -> None:
    """Kill every rank, then raise a WorkerError naming the rank that started the trouble.

    Peers of a failed rank fail too (lost connection, timeout in a collective), so a rank whose
    cause mentions a communication error or that sits inside torch.distributed is a *symptom*;
    a rank that is merely still running (hung, or slow to start) ranks after one that raised
    or exited; the root cause is the first rank that failed anywhere else.
    """
    alive = [rank for rank, proc in enumerate(processes) if proc.is_alive()]
    for rank in alive:  # ask each still-running rank where it is before killing it
        try:
            os.kill(processes[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if alive:
        time.sleep(_STACK_DUMP_GRACE_S)
    _kill_all(processes)

    def cause_of(rank: int) -> str:
        error_file = run_dir / f"rank{rank}.error"
        stacks_file = run_dir / f"rank{rank}.stacks"
        stacks = stacks_file.read_text() if stacks_file.exists() else ""
        if error_file.exists():  # drop gloo's "[.../pair.cc:553] " source-location prefix
            return re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", error_file.read_text().splitlines()[0])
        if rank in alive:
            return f"hung: still running after {timeout_s:g} s, in {_innermost_frame(stacks, worker)}"
        if "Timeout" in stacks:
            return (f"hung: no result within its {timeout_s:g} s deadline, in "
                    f"{_innermost_frame(stacks, worker)}")
        return _describe_exit(processes[rank].exitcode)

    def doing(rank: int) -> str:  # the last phase() the rank set, if any
        phase_file = run_dir / f"rank{rank}.phase"
        text = phase_file.read_text().strip() if phase_file.exists() else ""
        return f", while {text!r}" if text else ""

    causes = {rank: cause_of(rank) + doing(rank) for rank in range(len(processes))
              if rank in alive or processes[rank].exitcode != 0}

    def is_symptom(rank: int) -> bool:
        text = causes[rank].lower()
        return any(word in text for word in ("connection", "gloo", "nccl", "timed out",
                                              "broken pipe", "peer", "torch.distributed:"))

    def is_hung(rank: int) -> bool:  # a rank still busy (even importing) is late, not wrong
        return causes[rank].startswith("hung")

    ordered = sorted(causes, key=lambda rank: (is_symptom(rank), is_hung(rank), rank))
    root = ordered[0]
    message = f"rank {root} failed: {causes[root]}"
    others = [r for r in ordered[1:] if not is_symptom(r)]  # independent failures: in full
    symptoms = sorted(r for r in ordered[1:] if is_symptom(r))  # peers that lost `root`: briefly
    if others:
        message += " (then " + "; ".join(f"rank {r}: {causes[r][:160]}" for r in others) + ")"
    if symptoms:
        message += (f" (rank{'s' if len(symptoms) > 1 else ''} {', '.join(map(str, symptoms))} "
                    f"then failed in communication, as peers of a failed rank do)")
    if worker:
        message += f" [worker {worker}, {len(processes)} rank{'s' if len(processes) > 1 else ''}]"
    raise WorkerError(message, rank=root, cause=causes[root])


# ----------------------------------------------------------------------------- torchrun side


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def end_torchrun_process(code: int) -> None:
    """End a torchrun rank's process with exit status `code`: destroy the group, flush, then
    os._exit, as every multiprocessing child ends. A normal interpreter exit runs C++ static
    destructors, and with a gloo group and torch._dynamo loaded (every torch optimizer imports
    it) a rank then sometimes aborts ("terminate called without an active exception", SIGABRT;
    seen 1 run in 12 to 40 with torch 2.13 on a loaded 2-core machine) after its work is done."""
    _destroy_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _join_torchrun(fn: Callable, args: tuple, device_type: str, backend: str,
                   timeout_s: float) -> list[Any]:
    """Run `fn` as this torchrun process's rank. The default group is created on the first
    call and kept for the next ones (a lesson may launch several times), destroyed at exit."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(1)  # as a spawned rank: one core each, the same results anywhere
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        atexit.register(_destroy_group)
    elif dist.get_backend() != backend:
        raise RuntimeError(f"this torchrun process already joined a {dist.get_backend()} group; "
                           f"it cannot switch to {backend} (one --device per run)")
    result = fn(RankContext(rank, world_size, device, backend, "torchrun"), *args)
    _check_plain(result)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    return gathered


def launch(fn: Callable[..., Any], world_size: int, args: tuple = (), device: str = "auto",
           timeout_s: float = DEFAULT_TIMEOUT_S, method: str | None = None) -> list[Any]:
    """Run `fn(ctx, *args)` on every rank and return the results, one per rank.

    Starts `world_size` processes (`method`: "forkserver" or "spawn", default `start_method()`),
    or joins the torchrun group when RANK/WORLD_SIZE are set (then `world_size` is taken from
    the environment). A CPU rank runs one intra-op thread either way. Raises WorkerError naming
    the failing rank within about `timeout_s` seconds; no child outlives this call.
    """
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    device_type, backend = choose_device(device, world_size)
    if under_torchrun():
        return _join_torchrun(fn, args, device_type, backend, timeout_s)
    return _spawn(fn, world_size, args, device_type, backend, timeout_s, method or start_method())


FAULTS = ("crash", "hang", "exit")


def inject_fault(ctx: RankContext, fault: str | None, fault_rank: int) -> None:
    """Make rank `fault_rank` fail on purpose, to see (and test) how a run ends when one does.

    crash: raise an exception; hang: sleep forever (peers then wait in their next collective);
    exit: leave the process abruptly with os._exit(13), as a segfault or OOM kill would.
    """
    if fault is None or ctx.rank != fault_rank:
        return
    if fault == "crash":
        raise RuntimeError(f"injected crash on rank {ctx.rank}")
    if fault == "hang":
        while True:
            time.sleep(1)
    if fault == "exit":
        os._exit(13)
    raise ValueError(f"unknown fault {fault!r}; use one of {FAULTS}")


@contextlib.contextmanager
def one_thread():
    """Run the body with one intra-op thread (what every CPU rank gets), then restore: work in
    the parent process then gives the same floating-point results on any machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def is_reporting_rank() -> bool:
    """True in the process that should print the report (the parent, or torchrun's rank 0)."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0

