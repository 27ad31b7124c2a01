"""Lesson 05's pictures for the course site: every schedule's timeline, drawn by the lesson's
own simulator (`simulate_schedule`) and `plot_gantt`, at p = 4 stages and m = 8 micro-batches."""

from __future__ import annotations

from pathlib import Path

from . import checks
from . import main as pipeline

STAGES, MICROBATCHES, CHUNKS = 4, 8, 2
WHAT = {
    "gpipe": "GPipe: every forward, then every backward",
    "1f1b": "1F1B: warm-up, one forward one backward, cool-down",
    "interleaved": "Interleaved 1F1B with two chunks per device",
    "zb_h1": "Zero bubble (ZB-H1): backward split into B and W",
}


def site_figures(out_dir: Path) -> list[dict]:
    figures = []
    for kind in pipeline.SCHEDULES:
        timeline = pipeline.simulate_schedule(kind, STAGES, MICROBATCHES, CHUNKS)
        path = out_dir / f"{kind}.png"
        checks.plot_gantt(timeline, f"{kind}, p={STAGES}, m={MICROBATCHES}", path)
        figures.append({
            "file": path.name,
            "alt": (f"{WHAT.get(kind, kind)}: one row per device, boxes for forward (blue), "
                    f"backward (green) and weight-gradient (orange) work on micro-batches 0-"
                    f"{MICROBATCHES - 1}; white gaps are the bubble, "
                    f"{timeline.bubble_fraction:.1%} of the time"),
            "caption": f"{WHAT.get(kind, kind)} (p = {STAGES}, m = {MICROBATCHES}): bubble "
                       f"{timeline.bubble_fraction:.1%}, simulated by simulate_schedule().",
        })
    return figures
