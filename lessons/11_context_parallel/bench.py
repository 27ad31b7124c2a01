"""Lesson 11's benchmark: the causal attention work of each ring rank, contiguous against
zig-zag, timed in one process (`python -m lessons.11_context_parallel.bench`).

Rank r's compute in the ring is its queries against every key block it receives, tile by tile
(`tiles(...)`, fully masked tiles skipped). Replaying exactly those tiles for every rank in one
process times the compute alone: in a real ring every step also waits for the slowest rank,
which hides who did the work. On CPU the clock is the thread's CPU time. Each rank's replay is
timed `--repeats` times, the ranks and layouts taking turns (so a slow spell of the machine
falls on all of them), and the median is kept. Beside it: one full tile and one diagonal
(half-masked) tile timed alone, and the time they predict for each rank (full tiles x full +
diagonal tiles x diagonal). Timings report; they never decide a check.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lessons._checks import synchronize
from lessons._report import int_in

from . import blockwise
from . import main as context_parallel


def rank_tiles(seq: int, cp: int, rank: int, layout: str, device: str = "cpu") -> list:
    """Rank `rank`'s forward tiles over all cp held blocks: (query slice, key slice, mask)."""
    q_pos = context_parallel.sequence_positions(seq, cp, rank, layout).to(device)
    half = seq // (2 * cp)
    return [tile for source in range(cp) for tile in blockwise.tiles(
        q_pos, context_parallel.sequence_positions(seq, cp, source, layout).to(device), True, half, half)]


def rank_compute(seq: int, cp: int, rank: int, layout: str, heads: int, head_dim: int,
                 device: str = "cpu"):
    """(tiles, full tiles, diagonal tiles, run): `run()` computes rank `rank`'s forward tiles."""
    generator = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(heads, seq // cp, head_dim, generator=generator).to(device) for _ in range(3))
    tiles = rank_tiles(seq, cp, rank, layout, device)

    def run() -> None:
        for qs, ks, mask in tiles:
            blockwise.attend_block(q[:, qs], k[:, ks], v[:, ks], mask)

    diagonal = sum(mask is not None for _, _, mask in tiles)
    return len(tiles), len(tiles) - diagonal, diagonal, run


def timed(run, device: str) -> float:
    """Seconds of `run()`: on CPU the CPU time of this thread (torch runs on one thread here),
    so other processes sharing the machine do not count; on CUDA wall time between syncs."""
    clock = time.thread_time if device == "cpu" else time.perf_counter
    synchronize(device)
    started = clock()
    run()
    synchronize(device)
    return clock() - started


def ratio(values: list[float]) -> float:
    """max / mean: how much longer the slowest rank takes than the average one."""
    return max(values) / statistics.mean(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int_in(2, 1 << 20), default=4096)
    parser.add_argument("--cp", type=int_in(1, 64), default=4)
    parser.add_argument("--heads", type=int_in(1, 256), default=4)
    parser.add_argument("--head-dim", type=int_in(1, 1024), default=64)
    parser.add_argument("--repeats", type=int_in(1, 1000), default=21, help="timings per rank (median)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.seq % (2 * args.cp):
        parser.error(f"--seq {args.seq} is not divisible by 2 x --cp = {2 * args.cp}")
    torch.set_num_threads(1)
    ranks = {(layout, r): rank_compute(args.seq, args.cp, r, layout, args.heads, args.head_dim, args.device)
             for layout in context_parallel.LAYOUTS for r in range(args.cp)}
    size = args.seq // (2 * args.cp)
    q, k, v = (torch.randn(args.heads, size, args.head_dim).to(args.device) for _ in range(3))
    positions = torch.arange(size, device=args.device)
    mask = blockwise.causal_mask(positions, positions)  # a diagonal tile: its upper half masked
    one = {"full": lambda: blockwise.attend_block(q, k, v),
           "diagonal": lambda: blockwise.attend_block(q, k, v, mask)}
    jobs = {**{key: entry[3] for key, entry in ranks.items()}, **one}
    for run in jobs.values():  # warm up
        run()
    times = {key: [] for key in jobs}
    keys = list(jobs)
    for repeat in range(args.repeats):  # take turns, starting one further each round
        for key in keys[repeat % len(keys):] + keys[:repeat % len(keys)]:
            times[key].append(timed(jobs[key], args.device))
    median = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    print(f"cp {args.cp}, seq {args.seq}, {args.heads} heads of {args.head_dim}, float32, "
          f"1 thread, median of {args.repeats} per rank; one {size} x {size} tile: full "
          f"{median['full']:.2f} ms, diagonal {median['diagonal']:.2f} ms")
    for layout in context_parallel.LAYOUTS:
        rows = [ranks[(layout, r)] for r in range(args.cp)]
        ms = [median[(layout, r)] for r in range(args.cp)]
        predicted = [full * median["full"] + diag * median["diagonal"] for _, full, diag, _ in rows]
        work = context_parallel.causal_work_per_rank(args.cp, layout)
        tiles = [t for t, _, _, _ in rows]
        print(f"{layout:10s} tiles {tiles}  ms {[round(m, 1) for m in ms]}  predicted "
              f"{[round(p, 1) for p in predicted]}  max/mean: measured "
              f"{ratio(ms):.2f}, predicted {ratio(predicted):.2f}, tiles {ratio(tiles):.2f}, "
              f"FLOPs {ratio(work):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
