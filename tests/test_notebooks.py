"""Every lesson's notebook executes top to bottom on CPU in quick mode (COURSE_QUICK=1).

Two kernels run the fifteen notebooks between them, each taking the next notebook when it is
free. A kernel starting and importing torch and matplotlib is a third of a quick notebook's
time, so a kernel is not started per notebook: before each notebook it is put back to the state
of a fresh one (`RESET` below: an empty user namespace, the environment, working directory and
sys.path it started with, no lesson module imported, torch's RNG and defaults as at start, no
process group, no figure). What stays is what a learner's kernel would import anyway (torch,
matplotlib, IPython), already imported."""

from __future__ import annotations

import asyncio
import os
import unittest
from unittest import mock

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from tests._course import REPO_ROOT, lessons

KERNELS = 2

# conftest.py's NO_PREWARM reaches every kernel: importing `lessons` there starts no forkserver
# (torch imported once more: ~4 CPU seconds) in a notebook that never launches ranks (07, 08);
# a notebook that does starts it at its first launch(), as the launcher always can.
KERNEL_ENV = {"COURSE_QUICK": "1"}

# Run as the first cell of every notebook: the first time it records the fresh kernel's state,
# afterwards it restores it.
RESET = """\
_fresh_namespace = dict(get_ipython().user_ns)
import os as _os, sys as _sys, torch as _torch
if not hasattr(_sys, "_course_fresh_kernel"):
    _sys._course_fresh_kernel = (dict(_os.environ), list(_sys.path), _os.getcwd(),
                                 set(_sys.modules), _torch.get_rng_state(),
                                 _torch.get_default_dtype(), _torch.get_num_threads(),
                                 _fresh_namespace)
else:
    _env, _path, _cwd, _modules, _rng, _dtype, _threads, _ = _sys._course_fresh_kernel
    import torch.distributed as _dist
    if _dist.is_available() and _dist.is_initialized():
        _dist.destroy_process_group()
    if "matplotlib.pyplot" in _sys.modules:
        _sys.modules["matplotlib.pyplot"].close("all")
    _os.environ.clear()
    _os.environ.update(_env)
    _sys.path[:] = _path
    _os.chdir(_cwd)
    for _name in [name for name in _sys.modules if name not in _modules
                  and name.split(".")[0] in ("lessons", "course", "quizzes")]:
        del _sys.modules[_name]
    _torch.set_rng_state(_rng)
    _torch.set_default_dtype(_dtype)
    _torch.set_num_threads(_threads)
    _torch.set_grad_enabled(True)
# %reset empties the namespace, then IPython puts back its own names but not all of a fresh
# kernel's (__spec__, which multiprocessing reads): those come back from the first snapshot
get_ipython().run_line_magic("reset", "-f")
get_ipython().user_ns.update({key: value for key, value
                              in __import__("sys")._course_fresh_kernel[-1].items()
                              if key not in get_ipython().user_ns})
"""


async def _execute_all(paths: list) -> dict:
    """Execute every notebook, KERNELS kernels at once, each kernel reset before each notebook
    (RESET); {path: executed notebook (without the reset cell) or the exception it raised}."""
    queue = list(paths)
    results: dict = {}

    async def lane():
        km = AsyncKernelManager(kernel_name="python3")
        await km.start_kernel(cwd=str(paths[0].parent))
        try:
            while queue:
                path = queue.pop(0)
                notebook = nbformat.read(path, as_version=4)
                notebook.cells.insert(0, nbformat.v4.new_code_cell(RESET))
                client = NotebookClient(notebook, km=km, timeout=300, kernel_name="python3",
                                        resources={"metadata": {"path": str(path.parent)}})
                try:
                    await client.async_execute()  # raises CellExecutionError naming the cell
                    notebook.cells.pop(0)
                    results[path] = notebook
                except Exception as exc:  # reported per notebook below
                    results[path] = exc
                finally:
                    if client.kc is not None:
                        client.kc.stop_channels()
                if isinstance(results[path], Exception) or not await km.is_alive():
                    await km.restart_kernel(now=True)  # a failed, hung or dead kernel: a new one
        finally:
            await km.shutdown_kernel(now=True)

    await asyncio.gather(*(lane() for _ in range(KERNELS)))
    return results


class TestNotebooks(unittest.TestCase):
    def test_every_notebook_runs_in_quick_mode(self):
        paths = [REPO_ROOT / lesson["paths"]["notebook"] for lesson in lessons()]
        with mock.patch.dict(os.environ, KERNEL_ENV):
            results = asyncio.run(_execute_all(paths))
        for path in paths:
            with self.subTest(notebook=path.name):
                notebook = results[path]
                if isinstance(notebook, Exception):
                    raise notebook
                self.assertTrue(any("parameters" in cell.get("metadata", {}).get("tags", [])
                                    for cell in notebook.cells), "no parameters cell")
                errors = [output for cell in notebook.cells if cell.cell_type == "code"
                          for output in cell.get("outputs", []) if output.output_type == "error"]
                self.assertEqual(errors, [])


if __name__ == "__main__":
    unittest.main()
