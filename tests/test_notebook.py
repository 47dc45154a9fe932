"""docs/quickstart.ipynb runs top to bottom in a real Jupyter kernel."""

from __future__ import annotations

import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quickstart_notebook_runs(tmp_path: pathlib.Path) -> None:
    notebook = nbformat.read(ROOT / "docs" / "quickstart.ipynb", as_version=4)
    client = NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError when a cell raises
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    html = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert any("DmEnvAdaptor" in page and "paddle" in page for page in html)
    assert any("data:image/png;base64," in page for page in html)  # the board as a picture
    assert any("image/png" in out.get("data", {}) for out in outputs)  # the returns plot
