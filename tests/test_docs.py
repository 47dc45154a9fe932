"""Every ```python block of the guide pages runs: docs cannot drift from the code."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_NEEDS = re.compile(r"# needs: (.*)\n")


def test_every_guide_page_has_a_runnable_example() -> None:
    without = [
        p.name for p in PAGES if p.name not in ("api.md",) and not _BLOCK.search(p.read_text())
    ]
    assert without == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_examples_run(page: pathlib.Path, tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for index, match in enumerate(_BLOCK.finditer(page.read_text())):
        needs = _NEEDS.match(match.group(1))
        if needs and any(importlib.util.find_spec(name) is None for name in needs[1].split()):
            continue  # a block for an optional extra ("# needs: minari"), run where it is installed
        code = compile(match.group(1), f"{page.name}[block {index}]", "exec")
        exec(code, namespace)
