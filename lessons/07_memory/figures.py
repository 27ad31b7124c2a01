"""Lesson 07's picture for the course site: the bytes per parameter that a training step keeps,
by category (parameters, gradients, optimizer states), for each recipe the lesson measures with
its own tracker (`measure_model_states`): fp32 Adam, mixed-precision Adam, with an fp32
accumulation buffer, and Megatron's main_grad recipe. Counted bytes: the same on every machine."""

from __future__ import annotations

from pathlib import Path

from . import checks

RECIPES = {"fp32_adam": "fp32 Adam", "mixed_adam": "mixed-precision Adam",
           "mixed_adam_fp32_accum": "+ fp32 accumulation", "mixed_adam_main_grad": "main_grad (Megatron)"}
CATEGORIES = {"parameter": "#8ab6e6", "gradient": "#8fd18f", "optimizer": "#f2b36b"}


def site_figures(out_dir: Path) -> list[dict]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [checks.measure_model_states(recipe) for recipe in RECIPES]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for index, result in enumerate(measured):
        bottom = 0.0
        for category, color in CATEGORIES.items():
            value = result["breakdown"][category] / result["n_params"]
            if category == "optimizer":  # torch's 4-byte step counters are not per parameter
                value -= result["step_counter_bytes"] / result["n_params"]
            ax.bar(index, value, bottom=bottom, color=color, edgecolor="black", linewidth=0.5,
                   label=category if index == 0 else None)
            bottom += value
        ax.text(index, bottom + 0.3, f"{result['bytes_per_param']:.0f} B", ha="center")
    ax.set_xticks(range(len(measured)), list(RECIPES.values()), fontsize=8)
    ax.set_ylabel("bytes per parameter after a step")
    ax.set_ylim(0, 23)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = out_dir / "bytes_per_parameter.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    values = ", ".join(f"{RECIPES[r['recipe']]} {r['bytes_per_param']:.0f}" for r in measured)
    return [{
        "file": path.name,
        "alt": (f"Stacked bars of bytes per parameter kept after one training step, split into "
                f"parameters, gradients and optimizer states: {values} bytes."),
        "caption": (f"Model states per parameter, measured by the lesson's MemoryTracker "
                    f"(measure_model_states): {values} B/param."),
    }]
