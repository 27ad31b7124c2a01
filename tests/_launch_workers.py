"""Workers the launcher tests start: they must live in an importable module."""

import os
import signal
import time

import torch
import torch.distributed as dist


def sum_ranks(ctx):
    value = torch.tensor([ctx.rank + 1])
    dist.all_reduce(value)
    return {"rank": ctx.rank, "total": int(value), "pid": os.getpid(),
            "threads": torch.get_num_threads(), "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def group_id(ctx):
    """Which default group this rank is in (its Python object), to see that launch() reuses it."""
    return id(dist.group.WORLD)


def crash_on(ctx, bad_rank):
    if ctx.rank == bad_rank:
        raise ValueError(f"injected failure on rank {ctx.rank}")
    dist.barrier()
    return ctx.rank


def hang_on(ctx, bad_rank):
    if ctx.rank == bad_rank:
        time.sleep(3600)
    dist.barrier()
    return ctx.rank


def hang_in_phase(ctx, bad_rank):
    """Every rank says which configuration it is in; one hangs inside the second one."""
    from lessons._launch import phase
    for config in ("ep=1 top_k=1", "ep=2 top_k=2"):
        phase(config)
        if ctx.rank == bad_rank and config == "ep=2 top_k=2":
            time.sleep(3600)
        dist.barrier()
    return ctx.rank


def die_on(ctx, bad_rank):
    """The rank kills itself with SIGKILL mid-collective (as `kill -9` would)."""
    dist.barrier()
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return ctx.rank


def return_tensor(ctx):
    return {"weights": torch.zeros(2)}


if __name__ == "__main__":  # run by torchrun in tests/test_launch.py: two launches, one group
    import atexit
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from lessons._launch import launch

    # atexit runs last-registered first: this check runs after the launcher's destroy
    atexit.register(lambda: print("same group in both launches, destroyed at exit"
                                  if not dist.is_initialized() else "group left open"))
    first = launch(group_id, 0, device="cpu")
    second = launch(group_id, 0, device="cpu")
    assert first == second, (first, second)
    assert dist.is_initialized()
