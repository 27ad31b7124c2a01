"""Lesson 14's picture for the course site: goodput against the checkpoint interval at Llama 3's
failure rate, from Daly's model (`failure_model.goodput`) and from runs with injected failures
(`failure_model.simulate_run`), with Young's interval marked."""

from __future__ import annotations

import random
from pathlib import Path

from . import failure_model as fm


def goodput_curve(path: Path, save: float = 60.0, restart: float = 600.0, runs: int = 200,
                  seed: int = 0) -> dict:
    """Draw the figure; return the numbers it shows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    llama = fm.LLAMA3
    mtbf = llama["days"] * 24 / llama["unexpected"] * fm.HOUR
    work = 2 * 24 * fm.HOUR  # two days of compute: enough segments, quick to simulate
    intervals = [save * 2 ** (k / 2) for k in range(2, 17)]
    model = [fm.goodput(work, tau, save, restart, mtbf) for tau in intervals]
    rng = random.Random(seed)
    points = intervals[::2]
    simulated = [work / (sum(fm.simulate_run(work, tau, save, restart, mtbf, rng)[0]
                             for _ in range(runs)) / runs) for tau in points]
    young = fm.young_interval(save, mtbf)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot([t / 60 for t in intervals], [100 * g for g in model], label="Daly's model")
    ax.plot([t / 60 for t in points], [100 * g for g in simulated], "o",
            label=f"{runs} runs with injected failures")
    ax.axvline(young / 60, color="gray", linestyle="--",
               label=f"Young: sqrt(2CM) = {young / 60:.0f} min")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of compute)")
    ax.set_ylabel("goodput (%)")
    ax.set_title(f"MTBF {mtbf / 3600:.2f} h, save {save:.0f} s, restart {restart / 60:.0f} min")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"young_min": young / 60, "best": max(model), "mtbf_h": mtbf / 3600}


def site_figures(out_dir: Path) -> list[dict]:
    path = out_dir / "goodput.png"
    numbers = goodput_curve(path)
    return [{
        "file": path.name,
        "alt": ("Goodput against the checkpoint interval on a log scale: Daly's model as a curve "
                "and simulated runs with injected failures as dots on it, highest near Young's "
                f"interval of {numbers['young_min']:.0f} minutes."),
        "caption": (f"At Llama 3's rate (one unexpected interruption every "
                    f"{numbers['mtbf_h']:.2f} h), a 60 s save and a 10-minute restart, goodput "
                    f"peaks at {100 * numbers['best']:.1f}% near Young's interval; saving much "
                    "more or much less often loses more. goodput_curve()."),
    }]
