"""Functions that lesson 09's tests run on spawned ranks (importable by their dotted name)."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from lessons._checks import max_abs_diff

C = importlib.import_module("lessons.09_osft.checks")
B = importlib.import_module("lessons.09_osft.bench")


def sharded(ctx) -> dict:
    checks, metrics = C.sharded_checks(ctx, 0)  # the demo's seed: the README quotes it
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


def all_reduce_bench(ctx) -> list[dict]:
    return B.bench_all_reduce_worker(ctx, [(4, 64), (2, 256)], 1)


# ---------------------------------------------------------------- per exercise (learner mode)
# Each worker builds its inputs and the single-process truth with plain torch (orthonormal
# factors from a QR), so it grades one exercise alone: the U side does not need the learner's
# svd_split or factored projection, the V side not the U side.
M = importlib.import_module("lessons.09_osft.main")


def _gap(got, want) -> float:
    """max |got - want|, infinite when the shapes differ (no broadcasting can hide a wrong one)."""
    return float("inf") if tuple(got.shape) != tuple(want.shape) else max_abs_diff(got, want)


def _orthonormal(rows: int, cols: int, generator) -> torch.Tensor:
    """(rows, cols) with orthonormal columns (rows >= cols), float64."""
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=generator, dtype=torch.float64))
    return q


def _u_modules(shapes):
    generator = torch.Generator().manual_seed(7)
    modules = []
    for n_rows, k_high, k_low in shapes:
        u_high = _orthonormal(n_rows, k_high, generator)
        d_u = torch.randn(n_rows, k_low, generator=generator, dtype=torch.float64)
        modules.append((d_u, u_high, d_u - u_high @ (u_high.T @ d_u)))
    return modules


def shard_group(ctx, members):
    """(group, rank in it, its size) for the ranks `members` (None: the world, group None).
    Every rank creates the group (torch requires it); a rank outside it gets (None, -1, 0)."""
    if members is None:
        return None, ctx.rank, ctx.world_size
    group = dist.new_group(members)
    if ctx.rank not in members:
        return None, -1, 0
    return group, dist.get_rank(group), len(members)


def sharded_u(ctx, shapes, members=None) -> dict:
    """`sharded_project_u` per module and batched on this rank's chunks against one process,
    the rows split over `members` (a subgroup; None: the world). Ranks outside it idle."""
    group, rank, world = shard_group(ctx, members)
    if world == 0:
        return {"idle": True}
    modules = _u_modules(shapes)

    def chunk(tensor):
        return M.chunk_rows(tensor, rank, world)
    comm = M.Collectives(group)
    gaps = [_gap(M.sharded_project_u(chunk(d_u), chunk(u_high), comm), chunk(want))
            for d_u, u_high, want in modules]
    per_module = comm.all_reduces
    comm = M.Collectives(group)
    batched = M.sharded_project_u_batched([(chunk(d_u), chunk(u_high)) for d_u, u_high, _ in modules], comm)
    batch_gaps = [_gap(b, chunk(want)) for b, (_, _, want) in zip(batched, modules)]
    return {"gaps": gaps, "per_module": per_module, "batch_gaps": batch_gaps,
            "batched_calls": comm.all_reduces, "batched_count": len(batched)}


class _NoAllReduce(M.Collectives):
    """The V side has no partial sums: an all-reduce there is the lesson's bug. Refuse it on
    every rank at once (before any rank enters the collective, so nothing hangs)."""

    def all_reduce(self, tensor):
        raise AssertionError("the V side called all_reduce: each rank's dV_local V_high_local^T "
                             "is a different block of the coefficients, not a partial sum")


def sharded_v(ctx, shapes, strict: bool, members=None) -> dict:
    """`Collectives.all_gather_rows` on a known tensor, then `sharded_project_v` per module on
    this rank's chunks against one process, the rows split over `members` (None: the world;
    ranks outside idle). strict: all_reduce raises (see _NoAllReduce)."""
    group, rank, world = shard_group(ctx, members)
    if world == 0:
        return {"idle": True}
    generator = torch.Generator().manual_seed(11)
    comm = _NoAllReduce(group) if strict else M.Collectives(group)
    rows = torch.arange(7 * 3, dtype=torch.float64).view(7, 3)
    gathered = comm.all_gather_rows(M.chunk_rows(rows, rank, world), 7)
    gather_ok = tuple(gathered.shape) == (7, 3) and bool(torch.equal(gathered, rows))
    gather_calls = comm.all_gathers
    gaps = []
    for k_high, k_low, n_cols in shapes:
        v_high = _orthonormal(n_cols, k_high, generator).T.contiguous()  # (k_h, M), orthonormal rows
        d_v = torch.randn(k_low, n_cols, generator=generator, dtype=torch.float64)
        want = M.chunk_rows(d_v - (d_v @ v_high.T) @ v_high, rank, world)
        got = M.sharded_project_v(M.chunk_rows(d_v, rank, world), M.chunk_rows(v_high, rank, world),
                                  comm, k_high)
        gaps.append(_gap(got, want))
    return {"gather_ok": gather_ok, "gather_calls": gather_calls, "gaps": gaps,
            "all_reduces": comm.all_reduces, "all_gathers": comm.all_gathers}
