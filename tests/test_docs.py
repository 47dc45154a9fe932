"""Every ```python block of the guide pages runs: docs cannot drift from the code."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
# A page whose examples need an optional package says so in a comment, e.g.
# <!-- test_docs needs: stable_baselines3 -->; without it here its blocks are skipped, with
# the reason, and a training-tier test runs them (tests/test_sb3.py for docs/sb3.md).
_NEEDS = re.compile(r"^<!-- test_docs needs: ([\w., ]+) -->$", re.M)


def test_every_guide_page_has_a_runnable_example() -> None:
    without = [
        p.name for p in PAGES if p.name not in ("api.md",) and not _BLOCK.search(p.read_text())
    ]
    assert without == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_examples_run(page: pathlib.Path, tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = page.read_text()
    for needs in _NEEDS.findall(text):
        missing = [m for m in needs.replace(",", " ").split() if not importlib.util.find_spec(m)]
        if missing:
            pytest.skip(f"{page.name}'s examples need {missing}; the training tier runs them")
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for index, match in enumerate(_BLOCK.finditer(text)):
        code = compile(match.group(1), f"{page.name}[block {index}]", "exec")
        exec(code, namespace)
