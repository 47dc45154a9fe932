"""The offline learner of docs/datasets.md trains on a recorded Minari dataset (training tier)."""

from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("minari")
pytest.importorskip("torchrl")

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "datasets.md"
_BLOCK = re.compile(r"^```python\n(# needs: [^\n]*torchrl[^\n]*\n.*?)^```", re.M | re.S)


@pytest.mark.training
def test_the_docs_offline_learner_lowers_its_loss(tmp_path, monkeypatch) -> None:
    (block,) = _BLOCK.findall(PAGE.read_text())
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_datasets_learner"}
    exec(compile(block, f"{PAGE.name}[learner]", "exec"), namespace)  # asserts after < before
    assert namespace["after"] < namespace["before"]  # type: ignore[operator]
    assert len(namespace["data"]) > 1000  # type: ignore[arg-type]
