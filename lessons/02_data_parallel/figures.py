"""Lesson 02's picture for the course site: the bucket timelines and the step times of the
quick benchmark (`bench_worker` and `plot_bench`, 2 CPU ranks, a small MLP). Timings come
from the machine that builds the site: the shapes teach, the milliseconds are that machine's."""

from __future__ import annotations

from pathlib import Path

from lessons._launch import launch

from . import bench

WIDTH, STEPS, CAPS_BYTES = 256, 4, [1 << 16, 3 << 17, 25 << 20]


def site_figures(out_dir: Path) -> list[dict]:
    result = launch(bench.bench_worker, 2, (WIDTH, STEPS, CAPS_BYTES), device="cpu",
                    timeout_s=300)[0]
    path = out_dir / "buckets.png"
    bench.plot_bench(result, path)
    return [{
        "file": path.name,
        "alt": ("Left: for each bucket cap, a bar for backward compute and a bar for the wait on "
                "the all-reduces after it, with markers where each bucket's all-reduce was "
                "launched and where it finished. Right: measured median step time of each "
                "variant (no communication, flat after backward, bucketed at three caps, torch "
                "DDP) beside the cost model's prediction."),
        "caption": (f"Bucketed, overlapped all-reduce on {result['params']:,} float32 parameters, "
                    f"2 CPU ranks (bench_worker, plot_bench); milliseconds from the machine that "
                    f"built this site."),
    }]
