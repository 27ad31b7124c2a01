"""Every lesson's notebook executes top to bottom on CPU in quick mode (COURSE_QUICK=1)."""

from __future__ import annotations

import os
import unittest
from unittest import mock

import nbformat
from nbclient import NotebookClient

from tests._course import REPO_ROOT, lessons


class TestNotebooks(unittest.TestCase):
    def test_every_notebook_runs_in_quick_mode(self):
        for lesson in lessons():
            path = REPO_ROOT / lesson["paths"]["notebook"]
            with self.subTest(notebook=path.name), mock.patch.dict(os.environ,
                                                                   {"COURSE_QUICK": "1"}):
                notebook = nbformat.read(path, as_version=4)
                self.assertTrue(any("parameters" in cell.get("metadata", {}).get("tags", [])
                                    for cell in notebook.cells), "no parameters cell")
                client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                                        resources={"metadata": {"path": str(path.parent)}})
                client.execute()  # raises CellExecutionError naming the failing cell
                errors = [output for cell in notebook.cells if cell.cell_type == "code"
                          for output in cell.get("outputs", []) if output.output_type == "error"]
                self.assertEqual(errors, [])


if __name__ == "__main__":
    unittest.main()
