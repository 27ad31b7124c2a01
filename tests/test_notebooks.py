"""Every lesson's notebook executes top to bottom on CPU in quick mode (COURSE_QUICK=1).

Two notebooks run at a time: much of a notebook's time is its kernel starting and importing
torch, which overlaps well with another notebook's work even on two cores."""

from __future__ import annotations

import asyncio
import os
import unittest
from unittest import mock

import nbformat
from nbclient import NotebookClient

from tests._course import REPO_ROOT, lessons

AT_A_TIME = 2


# conftest.py's NO_PREWARM reaches every kernel: importing `lessons` there starts no forkserver
# (torch imported once more: ~4 CPU seconds) in a notebook that never launches ranks (07, 08);
# a notebook that does starts it at its first launch(), as the launcher always can.
KERNEL_ENV = {"COURSE_QUICK": "1"}


async def _execute_all(paths: list) -> dict:
    """Execute each notebook (a fresh kernel each), AT_A_TIME at once; {path: notebook or error}."""
    gate = asyncio.Semaphore(AT_A_TIME)

    async def one(path):
        async with gate:
            notebook = nbformat.read(path, as_version=4)
            client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                                    resources={"metadata": {"path": str(path.parent)}})
            try:
                await client.async_execute()  # raises CellExecutionError naming the failing cell
            except Exception as exc:  # reported per notebook below
                return path, exc
            return path, notebook

    return dict(await asyncio.gather(*(one(path) for path in paths)))


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
