"""Executes docs/quickstart.ipynb in a real kernel and stores it with its outputs.

The notebook is committed executed, so the docs site and repository viewers show
its pictures, tables and progress bar. tests/test_notebook.py executes it again
and checks that the committed outputs are current; when a change to the SDK or
to the notebook changes them, run this script and commit the result::

    python scripts/execute_notebook.py
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "docs" / "quickstart.ipynb"


def execute(path: pathlib.Path, workdir: str) -> nbformat.NotebookNode:
    """The notebook at ``path``, executed top to bottom (outputs and widget state filled in)."""
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    notebook.metadata.pop("widgets", None)
    client = NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": workdir}},
        store_widget_state=True,
    )
    client.execute()  # raises CellExecutionError when a cell raises
    return notebook


def main() -> int:
    with tempfile.TemporaryDirectory() as workdir:
        notebook = execute(NOTEBOOK, workdir)
    nbformat.write(notebook, NOTEBOOK)
    print(f"wrote {NOTEBOOK}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
