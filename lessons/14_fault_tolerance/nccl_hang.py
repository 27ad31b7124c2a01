"""NCCL's own watchdog and flight recorder on a real hang, on ONE GPU (the notebook's GPU part).

One GPU cannot hold two NCCL ranks, so the hang is not a missing peer: it is the rank's own GPU
stuck in a kernel (`torch.cuda._sleep`, a busy-wait of a given number of cycles) just before
collective #N. The all-reduce is enqueued behind it on the GPU and never starts; the host has
returned from `dist.all_reduce` at once (CUDA is asynchronous) and blocks only later, in
`torch.cuda.synchronize()`. Our Python-side watchdog (main.py's `Watchdog`) would see no
progress there; NCCL's watchdog thread polls the collective's CUDA events, declares it timed out
after the process group's `timeout`, dumps the flight recorder (`TORCH_NCCL_DUMP_ON_TIMEOUT`)
and tears the process down. The parent then reads the dump: the first N-1 entries are
"completed", #N is "scheduled" (enqueued, never started), and that is the diagnosis.

    python lessons/14_fault_tolerance/nccl_hang.py --out DIR [--timeout 5] [--collectives 4]

Needs a CUDA GPU (exit 2 without one). `read_dump` also reads gloo's recorder (the same
pickle: `torch._C._distributed_c10d._dump_fr_trace()`), but gloo's entries stay "scheduled"
(it records no start or completion), so `diagnose_dump` is for NCCL's.

Measured on one H100 (torch 2.11.0+cu130): the watchdog caught #5 after 5,087 ms of a 5 s
timeout, the dump held #1-#4 "completed" and #5 "scheduled", and the process was torn down
(SIGABRT) about 80 s after the timeout.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

PREFIX = "nccl_trace_rank_"  # the dump is PREFIX + rank, as TORCH_NCCL_DEBUG_INFO_TEMP_FILE says


def recorder_env(out: Path) -> dict:
    """The child's environment: a flight recorder of 2000 entries, kernel timing (so an entry
    that began is "started", not only "scheduled"), a dump on timeout to out/PREFIX{rank}.
    Both names of each setting: torch 2.11 reads TORCH_NCCL_*, newer ones TORCH_FR_* too."""
    with socket.socket() as s:  # a free port for the one-rank rendezvous (no fixed port)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dump = str(out / PREFIX)
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump, "TORCH_FR_DUMP_TEMP_FILE": dump,
            "TORCH_NCCL_ENABLE_TIMING": "1", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "20000",
            "PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN"}


def child(out: Path, timeout_s: float, collectives: int) -> None:
    """The rank: `collectives` all-reduces that complete, a dump of the recorder on demand
    (out/ondemand.pkl, the reference), then the GPU stalls for 4 x timeout and all-reduce
    #collectives+1 waits behind it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(collectives):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    (out / "ondemand.pkl").write_bytes(torch._C._distributed_c10d._dump_nccl_trace())
    print(f"{collectives} all-reduces completed; the GPU now stalls before #{collectives + 1}")
    torch.cuda._sleep(int(4 * timeout_s * 2e9))  # 4 x timeout at 2 GHz or less: not in time
    dist.all_reduce(x)  # returns at once: enqueued behind the stuck kernel
    print("all_reduce returned to Python (enqueued); the host now blocks in synchronize()")
    torch.cuda.synchronize()
    print("never printed: the watchdog tears the process down first")


def read_dump(path: Path) -> list[dict]:
    """The recorder's entries, oldest first, as (seq, op, sizes, state) rows. A missing or
    unreadable file: ValueError naming it."""
    try:
        data = pickle.loads(Path(path).read_bytes())
        entries = data["entries"]
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a flight-recorder dump ({exc.__class__.__name__}: {exc})") from None
    return [{"seq": e["collective_seq_id"], "op": e["profiling_name"], "sizes": e["input_sizes"],
             "state": e["state"], "group": e["process_group"][1]} for e in entries]


def diagnose_dump(rows: list[dict]) -> str:
    """One line: the first collective that did not complete, and what its state says."""
    stuck = [r for r in rows if r["state"] != "completed"]
    if not stuck:
        return f"all {len(rows)} recorded collectives completed"
    first = stuck[0]
    meaning = {"scheduled": "enqueued but never started: the GPU was busy before it (or a peer "
                            "never came)", "started": "started but never finished: a peer is "
                                                      "missing or the link is stuck"}
    return (f"collective #{first['seq']} {first['op']} {first['sizes']} is {first['state']}, "
            f"{meaning.get(first['state'], '')}; {len(rows) - len(stuck)} before it completed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=5.0, help="the process group's timeout (s)")
    parser.add_argument("--collectives", type=int, default=4, help="all-reduces before the hang")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.collectives < 1:
        parser.error("--timeout must be > 0 and --collectives >= 1")
    if args.child:
        child(args.out, args.timeout, args.collectives)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("nccl_hang.py needs a CUDA GPU (NCCL); none is visible here", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--child", "--out", str(args.out), "--timeout",
               str(args.timeout), "--collectives", str(args.collectives)]
    try:
        proc = subprocess.run(command, env=recorder_env(args.out), text=True,
                              capture_output=True, timeout=20 * args.timeout + 60)
    except subprocess.TimeoutExpired:
        print("the rank was not torn down by NCCL's watchdog in time", file=sys.stderr)
        return 1
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    print(f"rank exited with code {proc.returncode}; its last lines:")
    for line in [ln for ln in lines if "Watchdog" in ln or "timeout" in ln.lower()][:4] or lines[-6:]:
        print("   ", line[:300])
    dumps = sorted(p for p in args.out.iterdir() if p.name.startswith(PREFIX))
    for path in [args.out / "ondemand.pkl", *dumps]:
        if path.exists():
            rows = read_dump(path)
            print(f"{path.name}: {len(rows)} entries")
            for row in rows[-(args.collectives + 2):]:
                print(f"    #{row['seq']:<3} {row['op']:<18} {str(row['sizes']):<12} {row['state']}")
            print("   ", diagnose_dump(rows))
    if not dumps:
        print("no dump on timeout was written (the on-demand dump above is the recorder's view)")
    return 0 if dumps else 1


if __name__ == "__main__":
    sys.exit(main())
