"""Workers the launcher tests start: they must live in an importable module."""

import os
import signal
import time

import torch
import torch.distributed as dist


def sum_ranks(ctx):
    value = torch.tensor([ctx.rank + 1])
    dist.all_reduce(value)
    return {"rank": ctx.rank, "total": int(value), "pid": os.getpid()}


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


def die_on(ctx, bad_rank):
    """The rank kills itself with SIGKILL mid-collective (as `kill -9` would)."""
    dist.barrier()
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return ctx.rank


def return_tensor(ctx):
    return {"weights": torch.zeros(2)}
