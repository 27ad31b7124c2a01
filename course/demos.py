"""How `python -m course run` runs the lesson demos: in this process, torch imported once.

`python lessons/NN_slug/main.py` pays for `import torch` twice before its first check: in its own
process, and in the launcher's forkserver that its ranks are forked from (seconds of CPU each,
lessons/_prewarm.py). Thirteen demos in thirteen processes pay it 26 times. `course run` pays it
once: this process imports torch and starts the forkserver once, then calls each lesson's
harness (`lessons.NN_slug.checks.main(argv)`, what `main.py` hands over to) in turn. The ranks are
still separate processes, forked from the server; every demo keeps its deadlines, its fault
handling and its report. Its output is captured as a subprocess's would be: the harness's prints
through `sys.stdout` and `sys.stderr`, the ranks' through the file the forkserver was started
with as its standard output and error. A demo past its timeout is interrupted in the main thread
(its launch then kills its ranks) and reported with exit code 124.

`course run --isolated` runs each demo in a fresh `python main.py` process
instead: nothing shared, slower. Both give the same checks and metrics (the course's test
compares one lesson's reports).
"""

from __future__ import annotations

import _thread
import contextlib
import importlib
import io
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from course import REPO_ROOT


class DemoTimeout(BaseException):
    """A demo ran past its timeout (a BaseException, so that no demo's `except Exception`
    swallows it; its launch's `finally` kills its ranks on the way out)."""


def harness_module(lesson: dict) -> str:
    """`lessons.NN_slug.checks`: the module a lesson's main.py hands its `__main__` over to
    (lessons._report.run_harness)."""
    folder = Path(lesson["paths"]["script"]).parent
    return ".".join(folder.parts) + ".checks"


class InProcessDemos:
    """Runs demos one after another in this process; `close()` removes the ranks' output file.
    Only with the forkserver start method (the ranks' output is captured through the server's
    file descriptors); `usable()` says whether it is the start method here."""

    def __init__(self):
        from lessons._prewarm import prewarm

        if not self.usable():
            raise RuntimeError("in-process demos need the forkserver start method")
        handle, name = tempfile.mkstemp(prefix="course-run-ranks-", suffix=".log")
        os.close(handle)
        self.ranks_log = Path(name)
        handle = os.open(name, os.O_WRONLY | os.O_APPEND)  # ranks write at once: appends only
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:  # the server, and every rank forked from it, writes to the log
            os.dup2(handle, 1)
            os.dup2(handle, 2)
            prewarm(force=True)  # now, whatever NO_PREWARM says: the ranks' output goes to the log
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, handle):
                os.close(fd)

    @staticmethod
    def usable() -> bool:
        from lessons._prewarm import start_method

        try:
            return start_method() == "forkserver"
        except ValueError:
            return False

    def run(self, lesson: dict, argv: list[str], timeout: float) -> tuple[int, str, float]:
        """One demo: (exit code, its output, seconds), as `python main.py *argv` would give."""
        from lessons._report import run_body

        started = time.monotonic()
        offset = self.ranks_log.stat().st_size
        captured = io.StringIO()
        def interrupt():
            _thread.interrupt_main(signal.SIGALRM)  # runs on_timeout in the main thread

        def on_timeout(signum, frame):
            raise DemoTimeout(f"(stopped after {timeout:g} s)")

        # Not SIGINT: a process started in the background by a non-interactive shell (`cmd &`,
        # as CI runners do) inherits SIGINT ignored, and interrupt_main(SIGINT) then does
        # nothing. SIGALRM's handler is ours for the demo's length.
        previous = signal.signal(signal.SIGALRM, on_timeout)
        timer = threading.Timer(timeout, interrupt)
        saved_argv, saved_cwd = sys.argv, os.getcwd()
        sys.argv = [lesson["paths"]["script"], *argv]  # argparse's prog, as the script's
        os.chdir(REPO_ROOT)  # where `--isolated` runs a demo too
        code = 1
        try:
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                timer.start()
                try:
                    code = run_body(lambda: importlib.import_module(harness_module(lesson)).main(argv))
                except SystemExit as exc:  # argparse: one line, exit 2
                    code = exc.code if isinstance(exc.code, int) else 1
                except DemoTimeout as exc:
                    print(exc, file=sys.stderr)
                    code = 124
                except Exception:  # a bug in the demo's own process: its traceback, exit 1
                    traceback.print_exc()
                    code = 1
                finally:
                    timer.cancel()
        finally:
            signal.signal(signal.SIGALRM, previous)
            sys.argv = saved_argv
            os.chdir(saved_cwd)
        with open(self.ranks_log, errors="replace") as handle:
            handle.seek(offset)
            ranks = handle.read()
        return code, ranks + captured.getvalue(), time.monotonic() - started

    def close(self) -> None:
        self.ranks_log.unlink(missing_ok=True)

