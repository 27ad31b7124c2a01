"""Lesson 01's picture for the course site: ring all-reduce time against message size, measured
(ours and torch's, `bench_worker` at the quick sizes on 4 CPU ranks) beside the alpha-beta model
fitted to our points (`fit_alpha_beta`, weighted by 1/t). Timings are the building machine's."""

from __future__ import annotations

from pathlib import Path

from lessons._launch import launch

from . import bench
from . import main as collectives

WORLD, SIZES = 4, [1 << exponent for exponent in range(12, 21, 2)]  # 4 KiB .. 1 MiB


def site_figures(out_dir: Path) -> list[dict]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = launch(bench.bench_worker, WORLD, (SIZES, 0.1), device="cpu", timeout_s=300)[0]["rows"]
    alpha, beta = bench.fit_alpha_beta(rows, WORLD)
    sizes = [row["bytes"] for row in rows]
    model = [collectives.alpha_beta_seconds("ring_all_reduce", size, WORLD, alpha, beta)
             for size in sizes]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.loglog(sizes, [row["ring_s"] * 1e3 for row in rows], "o-", label="our ring all-reduce")
    ax.loglog(sizes, [row["torch_s"] * 1e3 for row in rows], "s-", label="torch all_reduce (gloo)")
    ax.loglog(sizes, [t * 1e3 for t in model], "--",
              label=f"model 2(p-1)a + 2(p-1)/p S b: a={alpha * 1e6:.0f} us, 1/b={1 / beta / 1e9:.2f} GB/s"
              if beta > 0 else "alpha-beta model")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"{WORLD} CPU ranks, float32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "all_reduce_time.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [{
        "file": path.name,
        "alt": ("Log-log plot of all-reduce time against message size from 4 KiB to 1 MiB on 4 "
                "CPU ranks: our ring and torch's all_reduce as measured points, and the fitted "
                "alpha-beta line, flat where the per-message latency dominates and rising "
                "linearly where bandwidth does."),
        "caption": (f"Measured ring all-reduce time (bench_worker) with the alpha-beta model fitted "
                    f"to it (fit_alpha_beta): alpha = {alpha * 1e6:.0f} us per message; timings "
                    f"from the machine that built this site."),
    }]
