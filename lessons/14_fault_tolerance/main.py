"""Lesson 14: fault tolerance: the capstone's run, kept alive through failures.

At thousands of GPUs something fails every few hours, so a long run is a sequence of attempts.
The technique, in the order an operator meets it:

failure_model.py  1. How often: the job's MTBF from per-GPU failure rates, the checkpoint
                  interval (Young, Daly), the goodput, checked against runs with injected
                  failures; the 25-hour run that never saved.
main.py           2. Detect: a per-rank ring buffer of the collectives entered and completed
                  (`CollectiveRecorder`, PyTorch's flight recorder from scratch); `diagnose`,
                  which reads every rank's dump and names the rank the others wait for; a
                  store-based `Watchdog` that turns a silent hang into that diagnosis within a
                  bounded time, with every rank's stacks.
integrity.py      3. The failures that do not kill a process: preemption (SIGTERM, a grace
                  period, an emergency save), silent data corruption (replica fingerprints, a
                  vote, heal or roll back), stragglers (work time, not wall time).
recovery.py       4. Recover: an elastic agent restarts every rank (torchrun's, or
                  `elastic_agent`), and each attempt resumes from the latest verified checkpoint
                  (lessons 06 and 13) on the same number of ranks (bitwise) or fewer.

The harness (checks.py) injects each failure for real and checks that the run ends where an
uninterrupted one does.
"""

from __future__ import annotations

import collections
import faulthandler
import inspect
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# ============================================================================ 2. detect

# the collectives recorded, and the argument that holds each one's input tensor
RECORDED = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather": "tensor",
            "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input",
            "all_to_all_single": "input", "barrier": None}


class CollectiveRecorder:
    """A per-rank ring buffer of the last `capacity` collectives, the idea of PyTorch's flight
    recorder: while active (`with recorder:`), every call of torch.distributed's collectives in
    RECORDED appends {"seq" (per group, from 1), "op", "group" (its global ranks), "sizes"
    (input shapes), "dtype", "step", "state" ("entered", then "completed"), "t_enter",
    "t_done"}; an async call returns a Work whose wait() completes the entry. `blocked` sums
    the seconds this thread sat in a collective or a wait (a straggler's peers sit there).
    Cost: a dict per collective; nothing is communicated."""

    def __init__(self, capacity: int = 64):
        self.ring: collections.deque = collections.deque(maxlen=capacity)
        self.seq: dict[tuple, int] = collections.defaultdict(int)
        self.step, self.blocked, self._saved = 0, 0.0, {}

    def __enter__(self):
        for module in (dist, distributed_c10d):  # object collectives call distributed_c10d's
            for op in RECORDED:
                self._saved[(module, op)] = getattr(module, op)
                setattr(module, op, self._wrap(op, getattr(distributed_c10d, op)))
        return self

    def __exit__(self, *exc) -> None:
        for (module, op), original in self._saved.items():
            setattr(module, op, original)
        self._saved.clear()

    def _wrap(self, op: str, fn):
        signature = inspect.signature(fn)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group") or dist.group.WORLD
            tensor = bound.arguments.get(RECORDED[op]) if RECORDED[op] else None
            entry = self.enter(op, tuple(dist.get_process_group_ranks(group)), tensor)
            started = time.monotonic()
            result = fn(*args, **kwargs)
            if bound.arguments.get("async_op"):
                return RecordedWork(result, entry, self)
            self.blocked += time.monotonic() - started
            self.complete(entry)
            return result
        return recorded

    def enter(self, op: str, group: tuple, tensor: torch.Tensor | None) -> dict:
        self.seq[group] += 1
        entry = {"seq": self.seq[group], "op": op, "group": list(group),
                 "sizes": [list(tensor.shape)] if tensor is not None else [],
                 "dtype": str(tensor.dtype).replace("torch.", "") if tensor is not None else "",
                 "step": self.step, "state": "entered", "t_enter": time.monotonic(),
                 "t_done": None}
        self.ring.append(entry)
        return entry

    def complete(self, entry: dict) -> None:
        entry["state"], entry["t_done"] = "completed", time.monotonic()

    def dump(self) -> list[dict]:
        return [dict(entry) for entry in list(self.ring)]


class RecordedWork:
    """An async collective's Work: wait() blocks (time counted in `blocked`), then completes
    the entry. On CUDA, wait() only makes the current stream wait: "completed" then means
    enqueued, and NCCL's own flight recorder times the kernels with CUDA events."""

    def __init__(self, work, entry: dict, recorder: CollectiveRecorder):
        self.work, self.entry, self.recorder = work, entry, recorder

    def wait(self, *args, **kwargs):
        started = time.monotonic()
        result = self.work.wait(*args, **kwargs)
        self.recorder.blocked += time.monotonic() - started
        self.recorder.complete(self.entry)
        return result

    def __getattr__(self, name):
        return getattr(self.work, name)


# exercise read-the-dumps (4 points): Read every rank's ring buffer and name who the others wait for
# hint: per group, the highest seq any member entered; a member whose last seq is lower never
#   entered it (behind); members that all entered it but disagree on (op, sizes) are mismatched.
def diagnose(dumps: list[dict | None]) -> dict:
    """Read every rank's dump (index = global rank: {"rank", "step", "entries": the ring
    buffer, oldest first}; None for a rank that sent none: dead or frozen) and say why the
    run is stuck. Returns {"kind", "culprits" (sorted global ranks), "message" (one line)},
    the first that applies:
    "dead": some dumps are None: culprits = those ranks.
    "behind": in some group (the ranks of an entry), the highest seq any member entered is s;
      members whose last seq in that group is below s never entered collective #s: they are
      the culprits; the message names each one's rank, step and last collective, and the
      collective #s (op, group) the others wait in.
    "mismatch": every member entered #s but their (op, sizes) differ: culprits = the members
      whose (op, sizes) differs from the most common one (all of them on a tie); the message
      names collective #s, its group and every member's op and sizes.
    "waiting": every member entered the same #s and it is not completed anywhere: no rank is
      behind (a transport or network hang); culprits = [].
    "stuck": no collective is pending: culprits = the ranks at the lowest step (stuck in
      compute between collectives).
    Groups are compared among their members only (a subgroup's seq is its own counter)."""
    dead = [rank for rank, dump in enumerate(dumps) if dump is None]
    if dead:
        return {"kind": "dead", "culprits": dead,
                "message": f"rank(s) {dead}: no heartbeat (dead or frozen)"}
    last: dict[tuple, dict[int, dict]] = collections.defaultdict(dict)  # group -> rank -> entry
    for dump in dumps:
        for entry in dump["entries"]:
            last[tuple(entry["group"])][dump["rank"]] = entry
    for group, entries in sorted(last.items()):
        top = max(entry["seq"] for entry in entries.values())
        waiting = sorted(r for r, e in entries.items() if e["seq"] == top)
        wanted = entries[waiting[0]]
        behind = sorted(r for r in group if r not in entries or entries[r]["seq"] < top)
        if behind:
            where = "; ".join(
                f"rank {r} at step {dumps[r]['step']}, last "
                + (f"{entries[r]['op']} #{entries[r]['seq']} ({entries[r]['state']})"
                   if r in entries else "nothing") for r in behind)
            return {"kind": "behind", "culprits": behind,
                    "message": f"{where}: never entered {wanted['op']} #{top} on group "
                               f"{list(group)}, which rank(s) {waiting} wait in"}
        signatures = collections.Counter((e["op"], str(e["sizes"])) for e in entries.values())
        if len(signatures) > 1:
            common, count = signatures.most_common(1)[0]
            odd = [r for r, e in entries.items() if (e["op"], str(e["sizes"])) != common]
            culprits = sorted(odd if count * 2 > len(entries) else entries)
            detail = ", ".join(f"rank {r} {e['op']} {e['sizes']}" for r, e in sorted(entries.items()))
            return {"kind": "mismatch", "culprits": culprits,
                    "message": f"collective #{top} on group {list(group)} differs: {detail}"}
    pending = [(g, e) for g, entries in sorted(last.items()) for e in entries.values()
               if e["state"] != "completed"]
    if pending:
        group, entry = pending[0]
        return {"kind": "waiting", "culprits": [],
                "message": f"every rank of group {list(group)} waits in {entry['op']} "
                           f"#{entry['seq']}: no rank is behind (a transport or network hang)"}
    lowest = min(dump["step"] for dump in dumps)
    stuck = [d["rank"] for d in dumps if d["step"] == lowest]
    return {"kind": "stuck", "culprits": stuck,
            "message": f"rank(s) {stuck} stuck at step {lowest} outside any collective"}


class WatchdogTimeout(RuntimeError):
    """Raised in the main thread of a rank the watchdog named: the run cannot progress."""


class Watchdog:
    """One thread per rank. Every `poll` seconds it publishes this rank's heartbeat under the
    store key f"{prefix}{rank}" ({"rank", "pid", "beat", "step", "entries": the recorder's
    last 8 entries}) and reads every rank's. A rank whose beat stops for `deadline` seconds is
    dead; when NO rank's (step, entries) changed for `deadline` seconds, the run is stuck.
    Either way (`fire`): `diagnose` the heartbeats, write this rank's full dump, the verdict,
    PyTorch's flight recorder (where the backend records one) and every thread's stack into
    `out_dir`, and mark it done in the store; then a rank the verdict names waits for every
    live rank's dump (at most `deadline` seconds) and raises WatchdogTimeout in its main thread
    (or, if that thread sits in C code, exits with code 86 3 s later); the others give it
    deadline + 1.5 s to go (their collective then fails) and exit with code 86 if still stuck.
    Detection within deadline + poll seconds of the last progress."""

    EXIT_CODE = 86

    def __init__(self, store, rank: int, world: int, recorder: CollectiveRecorder,
                 deadline: float, out_dir: Path, prefix: str = "hb/"):
        self.store, self.rank, self.world, self.recorder = store, rank, world, recorder
        self.deadline, self.poll = deadline, max(0.05, deadline / 8)
        self.out_dir, self.prefix, self.beat = Path(out_dir), prefix, 0
        self.verdict: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        signal.signal(signal.SIGUSR2, self._raise_in_main)  # main thread only
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self.verdict is None:  # a fired watchdog ends the process
            self._thread.join()

    def heartbeat(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "beat": self.beat,
                "step": self.recorder.step, "entries": self.recorder.dump()[-8:]}

    def _publish(self) -> None:
        self.beat += 1
        self.store.set(f"{self.prefix}{self.rank}", json.dumps(self.heartbeat()))

    def _run(self) -> None:
        try:
            self._watch()
        except (RuntimeError, OSError):  # the store went away with the run: nothing to watch
            pass

    def _watch(self) -> None:
        keys = [f"{self.prefix}{r}" for r in range(self.world)]
        seen: dict[int, tuple] = {}  # rank -> (beat, progress, when its beat last changed)
        progress_at = started = time.monotonic()
        while not self._stop.wait(self.poll):
            self._publish()
            now, beats = time.monotonic(), {}
            for rank, key in enumerate(keys):
                if self.store.check([key]):
                    beats[rank] = json.loads(self.store.get(key))
            for rank, beat in beats.items():
                progress = (beat["step"], json.dumps(beat["entries"]))
                old = seen.get(rank)
                if old is None or old[1] != progress:
                    progress_at = now
                seen[rank] = (beat["beat"], progress,
                              now if old is None or old[0] != beat["beat"] else old[2])
            dead = [r for r in range(self.world)
                    if now - (seen[r][2] if r in seen else started) > self.deadline]
            if dead or now - progress_at > self.deadline:
                self.fire([None if r in dead else beats[r] for r in range(self.world)])
                return

    def fire(self, heartbeats: list[dict | None]) -> None:
        """Diagnose, dump, then end this rank (see the class docstring)."""
        self.verdict = diagnose(heartbeats)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        dump = {**self.heartbeat(), "entries": self.recorder.dump(), "verdict": self.verdict}
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(dump, indent=1))
        with open(self.out_dir / f"rank{self.rank}.stacks", "w") as handle:
            faulthandler.dump_traceback(handle, all_threads=True)
        try:  # PyTorch's own recorder: NCCL with TORCH_NCCL_TRACE_BUFFER_SIZE, gloo with TORCH_FR_BUFFER_SIZE
            c10d = torch._C._distributed_c10d  # NCCL's buffer has its own dump (nccl_hang.py reads one)
            nccl = dist.is_initialized() and dist.get_backend() == "nccl"
            (self.out_dir / f"rank{self.rank}.fr.pkl").write_bytes(
                c10d._dump_nccl_trace() if nccl else c10d._dump_fr_trace())
        except (AttributeError, RuntimeError):
            pass
        self.store.set(f"{self.prefix}dumped/{self.rank}", "1")
        culprit = self.rank in self.verdict["culprits"]
        if culprit:  # wait (a deadline at most) for every live rank's dump, then go first
            live = [f"{self.prefix}dumped/{r}" for r, beat in enumerate(heartbeats) if beat]
            until = time.monotonic() + self.deadline
            while not self.store.check(live) and time.monotonic() < until:
                time.sleep(0.05)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
        time.sleep(3.0 if culprit else 1.5 + self.deadline)
        os._exit(self.EXIT_CODE)

    def _raise_in_main(self, signum, frame) -> None:
        raise WatchdogTimeout(f"watchdog: {self.verdict['message'] if self.verdict else 'stuck'}")


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
