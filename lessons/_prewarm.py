"""Start the launcher's forkserver early, before this process imports torch.

`import torch` costs seconds of CPU. The launcher (lessons/_launch.py) forks ranks from a
forkserver that imported torch once; started here, at the first import of the `lessons`
package, the server imports torch on one core while this process imports it on the other, so
the first `launch()` finds it ready. This module imports no torch and never touches CUDA.
"""

from __future__ import annotations

import multiprocessing
import os

NO_PREWARM = "_DTFS_NO_PREWARM"  # set in the forkserver and in ranks: they never prewarm
# torch._dynamo: building any torch optimizer imports it (as long again as torch itself)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "lessons._launch", "lessons._report",
           "lessons._checks"]


def start_method() -> str:
    """How ranks are started: "forkserver" (torch imported once, ranks forked from it) where
    the platform has it, else "spawn"; the environment variable COURSE_START_METHOD overrides."""
    method = os.environ.get("COURSE_START_METHOD", "").strip()
    if method:
        if method not in ("forkserver", "spawn"):
            raise ValueError(f"COURSE_START_METHOD={method!r}: use forkserver or spawn")
        return method
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def prewarm(force: bool = False) -> None:
    """Start the forkserver now (cheap, idempotent). A no-op under torchrun (no ranks to fork),
    under spawn, in the forkserver itself and inside a launched rank; also where NO_PREWARM is
    set (a process that may never launch: the server would import torch for nothing, and the
    first `launch()` starts it anyway), unless `force` (`course run` starts it while its ranks'
    output goes to a file)."""
    if ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or (NO_PREWARM in os.environ and not force) \
            or multiprocessing.parent_process() is not None:
        return
    try:
        if start_method() != "forkserver":
            return
    except ValueError:
        return  # launch() reports a bad COURSE_START_METHOD
    from multiprocessing import forkserver
    multiprocessing.set_forkserver_preload(PRELOAD)
    saved = os.environ.get(NO_PREWARM)
    os.environ[NO_PREWARM] = "1"  # the server inherits it: it must not start a server itself
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop(NO_PREWARM, None)
        else:
            os.environ[NO_PREWARM] = saved
