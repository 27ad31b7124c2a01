"""Lesson 15's picture for the course site: one profiled step of lesson 02's BucketedDDP on
every rank, drawn from the traces alone (`rank_timeline`): with a bucket per layer, the
all-reduces run under backward; with one bucket, after it. The milliseconds are the building
machine's; the shapes teach."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

from lessons._launch import launch

from . import checks

PHASE_COLOURS = {"forward": "#d8e8f8", "backward": "#fde2c8", "optimizer": "#dff2d8"}


def plot_ddp_timelines(bucketed: list[dict], one_bucket: list[dict], path: Path, step: int = -1) -> None:
    """Rows (per variant, per rank; `checks.read_ddp` output) of one step each: the phase
    ranges as backgrounds, compute above, communication below, exposed communication hatched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from . import main as profiling

    rows = [(f"{name}, rank {rank}", row) for name, variant in (("bucket per layer", bucketed),
                                                                  ("one bucket", one_bucket))
            for rank, row in enumerate(variant)]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.6 * len(rows)))
    for y, (_, row) in enumerate(reversed(rows)):
        timeline = row["timeline"]
        start, end = timeline["steps"][step]

        def bars(intervals, start=start, end=end):
            return [((s - start) * 1e3, (e - s) * 1e3) for s, e in
                    profiling.intersect_intervals(intervals, [(start, end)])]
        for name, colour in PHASE_COLOURS.items():
            ax.broken_barh(bars(timeline["phases"][name]), (y - 0.4, 0.8), color=colour)
        ax.broken_barh(bars(timeline["compute"]), (y + 0.02, 0.3), color="#3b6ea5")
        ax.broken_barh(bars(timeline["comm"]), (y - 0.32, 0.3), color="#d1495b")
        exposed = profiling.subtract_intervals(timeline["comm"], timeline["compute"])
        ax.broken_barh(bars(exposed), (y - 0.32, 0.3), facecolor="none", edgecolor="black", hatch="///")
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)], fontsize=8)
    ax.set_xlabel("ms since the step began (each rank's trace, one step)")
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items()]
    handles += [Patch(color="#3b6ea5", label="compute (main thread's operators)"),
                Patch(color="#d1495b", label="communication (gloo's all-reduces)"),
                Patch(facecolor="none", edgecolor="black", hatch="///", label="exposed")]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / len(rows)),
              ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def site_figures(out_dir: Path) -> list[dict]:
    scratch = Path(tempfile.mkdtemp(prefix="lesson15-figure-"))
    try:
        width, steps = 512, 2
        caps = {"bucketed": width * width * 4, "one bucket": checks.ONE_BUCKET}
        per_rank = launch(checks.ddp_variants, 2, (str(scratch), width, steps, 1, caps), device="cpu",
                          timeout_s=300)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    bucketed = checks.read_ddp([r["bucketed"][0] for r in per_rank])
    one = checks.read_ddp([r["one bucket"][0] for r in per_rank])
    path = out_dir / "ddp_timeline.png"
    plot_ddp_timelines(bucketed, one, path)
    overlap = [statistics.mean(row["overlap"] or 0.0 for row in rows) for rows in (bucketed, one)]
    return [{
        "file": path.name,
        "alt": ("Four timelines, one per rank and variant, of one DDP step read from the "
                "profiler's traces: phases forward, backward and optimizer as colored "
                "backgrounds, the main thread's operators as blue bars, gloo's all-reduces as "
                "red bars. With a bucket per layer the red bars start during backward; with one "
                "bucket a single red bar starts after backward and is exposed (hatched)."),
        "caption": (f"Lesson 02's BucketedDDP on 2 CPU ranks, a 3-layer MLP of width {width}: "
                    f"overlap {overlap[0]:.0%} with a bucket per layer, {overlap[1]:.0%} with one "
                    "bucket, mean over ranks (overlap_fraction on the traces; "
                    "plot_ddp_timelines). Milliseconds from the machine that built this site."),
    }]
