"""Lesson 11's benchmark: the causal attention work of each ring rank, contiguous against
zig-zag, timed in one process (`python -m lessons.11_context_parallel.bench`).

Rank r's compute in the ring is its queries against every key block it receives, tile by tile
(`tiles(...)`, fully masked tiles skipped). Replaying exactly those tiles for every rank in one
process times the compute alone: in a real ring every step also waits for the slowest rank,
which hides who did the work. Timings report; they never decide a check.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lessons._checks import best_time
from lessons._report import int_in

from . import main as context_parallel


def rank_compute(seq: int, cp: int, rank: int, layout: str, heads: int, head_dim: int,
                 device: str = "cpu") -> tuple[int, float]:
    """(tiles, seconds) of rank `rank`'s forward tiles over all cp held blocks (best of 3)."""
    generator = torch.Generator().manual_seed(rank)
    n = seq // cp
    q, k, v = (torch.randn(heads, n, head_dim, generator=generator).to(device) for _ in range(3))
    q_pos = context_parallel.sequence_positions(seq, cp, rank, layout).to(device)
    blocks = [context_parallel.sequence_positions(seq, cp, source, layout).to(device)
              for source in range(cp)]

    def run() -> int:
        count = 0
        for k_pos in blocks:
            for qs, ks, mask in context_parallel.tiles(q_pos, k_pos, True):
                context_parallel.attend_block(q[:, qs], k[:, ks], v[:, ks], mask)
                count += 1
        return count

    return run(), best_time(run, 3, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int_in(2, 1 << 20), default=4096)
    parser.add_argument("--cp", type=int_in(1, 64), default=4)
    parser.add_argument("--heads", type=int_in(1, 256), default=4)
    parser.add_argument("--head-dim", type=int_in(1, 1024), default=64)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.seq % (2 * args.cp):
        parser.error(f"--seq {args.seq} is not divisible by 2 x --cp = {2 * args.cp}")
    torch.set_num_threads(1)
    for layout in context_parallel.LAYOUTS:
        rows = [rank_compute(args.seq, args.cp, r, layout, args.heads, args.head_dim, args.device)
                for r in range(args.cp)]
        seconds = [s for _, s in rows]
        print(f"{layout:10s} tiles {[t for t, _ in rows]}  ms {[round(s * 1e3, 1) for s in seconds]}  "
              f"max/mean {max(seconds) / (sum(seconds) / len(seconds)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
