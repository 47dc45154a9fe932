"""docs/quickstart.ipynb runs top to bottom in a real kernel, and its committed outputs are current."""

from __future__ import annotations

import importlib.util
import pathlib
import re
from typing import Any

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "docs" / "quickstart.ipynb"
WIDGET = "application/vnd.jupyter.widget-view+json"
_ADDRESS = re.compile(r"127\.0\.0\.1:\d+")


def _execute() -> Any:
    spec = importlib.util.spec_from_file_location(
        "execute_notebook", ROOT / "scripts" / "execute_notebook.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.execute


def _normalized(output: dict[str, Any]) -> tuple[Any, ...]:
    """What of an output must not change between runs (ports, widget ids and plots' bytes may)."""
    kind = output["output_type"]
    if kind == "stream":
        return (kind, output["name"], _ADDRESS.sub("ADDRESS", output["text"]))
    data = output.get("data", {})
    if WIDGET in data:  # a progress bar: its text is its first frame, its id is random
        return (kind, WIDGET)
    shown = {
        mime: None if mime.startswith("image/") else _ADDRESS.sub("ADDRESS", str(value))
        for mime, value in data.items()
    }
    return (kind, tuple(sorted(shown.items())))


def _outputs(notebook: Any) -> list[list[tuple[Any, ...]]]:
    return [
        [_normalized(output) for output in cell.outputs]
        for cell in notebook.cells
        if cell.cell_type == "code"
    ]


def test_quickstart_notebook_runs_and_its_committed_outputs_are_current(
    tmp_path: pathlib.Path,
) -> None:
    committed = nbformat.read(NOTEBOOK, as_version=4)
    notebook = _execute()(NOTEBOOK, str(tmp_path))  # raises CellExecutionError on an error
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    assert not [out for out in outputs if out.get("name") == "stderr"]  # no IProgress warning
    html = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert any("DmEnvAdaptor" in page and "paddle" in page for page in html)
    assert any("data:image/png;base64," in page for page in html)  # the board as a picture
    assert any(page.count("data:image/png;base64,") == 4 for page in html)  # the batch's grid
    assert any("image/png" in out.get("data", {}) for out in outputs)  # the returns plot
    bars = [out for out in outputs if WIDGET in out.get("data", {})]
    assert len(bars) == 1  # tqdm's bar is one widget, not lines of text
    assert committed.metadata.get("widgets"), "the committed notebook keeps the bar's state"
    assert _outputs(committed) == _outputs(notebook), (
        "docs/quickstart.ipynb is not current: run python scripts/execute_notebook.py and commit it"
    )
