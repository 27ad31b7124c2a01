"""The capstone's picture for the course site: the loss curve of the default CPU run (2 ranks,
the demo's configuration), trained by the lesson's own code and drawn by `plot_losses`. In quick
mode (COURSE_QUICK=1: the site's tests) the same run is cut to QUICK_STEPS steps (the same curves,
held-out points at the start, every steps/4 and the end); the built site keeps the default run."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from . import checks

QUICK_STEPS = 16


def site_figures(out_dir: Path) -> list[dict]:
    quick = ["--steps", str(QUICK_STEPS)] if os.environ.get("COURSE_QUICK") == "1" else []
    args = checks.parse_args(["--device", "cpu", *quick])
    config = checks.config_from(args)
    scratch = Path(tempfile.mkdtemp(prefix="capstone-figure-"))
    try:
        first = checks.run(args, config, scratch / "checkpoints", False, None, 0)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    path = out_dir / "loss.png"
    checks.plot_losses(first, path)
    start, end = first["val_losses"][0][1], first["val_losses"][-1][1]
    return [{
        "file": path.name,
        "alt": (f"Training loss per step (mean over ranks) and held-out loss of the default "
                f"capstone run over {config.steps} steps: the held-out cross-entropy falls from "
                f"{start:.2f} to {end:.2f} nats per character."),
        "caption": (f"The default CPU run ({args.world_size} ranks, {config.steps} steps, "
                    f"{first['params']:,} parameters): held-out loss {start:.3f} -> {end:.3f} "
                    f"nats/char; plot_losses()."),
    }]
