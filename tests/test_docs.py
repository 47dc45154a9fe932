"""Every ```python block of the guide pages runs, and prints what the page says: docs cannot
drift from the code.

A ```python block followed by an ```output block (blank lines between them allowed) must print
that output: it is compared as doctest compares, with ``...`` matching anything (timings, ports)
and runs of whitespace equal.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib.util
import io
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# A page whose examples need an optional package says so in a comment, e.g.
# <!-- test_docs needs: stable_baselines3 -->; without it here its blocks are skipped, with
# the reason, and a training-tier test runs them (tests/test_sb3.py for docs/sb3.md).
_NEEDS = re.compile(r"^<!-- test_docs needs: ([\w., ]+) -->$", re.M)
_BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:[ \t]*\n)*(?:```output\n(.*?)^```)?", re.M | re.S)
_OUTPUT = re.compile(r"^```output\n", re.M)
_CHECKER = doctest.OutputChecker()
_OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_BLOCK_NEEDS = re.compile(r"# needs: (.*)\n")


def test_every_guide_page_has_a_runnable_example() -> None:
    without = [
        p.name for p in PAGES if p.name not in ("api.md",) and not _BLOCK.search(p.read_text())
    ]
    assert without == []


def test_the_guide_list_and_the_site_nav_name_every_page() -> None:
    """docs/index.md's guide list, in mkdocs.yml's order (the README lists them too)."""
    index = (DOCS / "index.md").read_text()
    guide = index[index.index("## Guide") :]
    listed = re.findall(r"^- \[[^]]+\]\(([a-z0-9_]+\.md)\)", guide, re.M)
    nav = re.findall(
        r"^ {6}- [^:]+: ([a-z0-9_]+\.md)$", (DOCS.parent / "mkdocs.yml").read_text(), re.M
    )
    assert listed[:-1] == nav  # the guide list ends with the API reference
    assert sorted([*listed, "index.md"]) == [p.name for p in PAGES]


def test_the_cli_page_lists_every_run_option() -> None:
    from dm_env_rpc_client import cli

    parser = cli.build_parser()
    text = (DOCS / "cli.md").read_text()
    table = text[text.index("| option | meaning |") :].split("\n\n")[0]
    run = parser.parse_args(["run"]).parsers["run"]
    flags = [f for action in run._actions for f in action.option_strings if f.startswith("--")]
    missing = [f for f in flags if f not in ("--help", "--debug") and f"`{f}" not in table]
    assert missing == [], "add these options to docs/cli.md's table of run options"


def test_every_output_block_follows_a_python_block() -> None:
    """An output block anywhere else would never be checked."""
    for page in PAGES:
        text = page.read_text()
        checked = {m.start(2) for m in _BLOCK.finditer(text) if m.group(2) is not None}
        loose = [m.end() for m in _OUTPUT.finditer(text) if m.end() not in checked]
        assert loose == [], f"{page.name}: an ```output block not right after a ```python block"


def test_the_output_checker_compares() -> None:
    assert _CHECKER.check_output("steps/s  ...\nworlds 4\n", "steps/s 123.4\nworlds  4\n", _OPTIONS)
    assert not _CHECKER.check_output("worlds 4\n", "worlds 5\n", _OPTIONS)


# A page whose examples record several runs and train a learner needs more than the default
# 120 s on a loaded machine: datasets.md took 48 to 88 s alone at load 10 to 20, and ran over
# 120 s (in its DQN's backward) when the whole file ran at load 26 to 29. Its data and its
# training are seeded and the same on every run; only the time moves.
# rllink.md starts a local Ray and builds a PPO learner twice (one world's agent and
# multi-agent Paddles): its multi-agent example alone took 135 s at load 28.
_LONGER = {"datasets.md": 300, "rllink.md": 300}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.timeout(_LONGER[page.name]))
        if page.name in _LONGER
        else page
        for page in PAGES
    ],
    ids=lambda p: p.name,
)
def test_page_examples_run(page: pathlib.Path, tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = page.read_text()
    for needs in _NEEDS.findall(text):
        missing = [m for m in needs.replace(",", " ").split() if not importlib.util.find_spec(m)]
        if missing:
            pytest.skip(f"{page.name}'s examples need {missing}; the training tier runs them")
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for index, match in enumerate(_BLOCK.finditer(text)):
        needs = _BLOCK_NEEDS.match(match.group(1))
        if needs and any(importlib.util.find_spec(name) is None for name in needs[1].split()):
            continue  # a block for an optional extra ("# needs: minari"), run where it is installed
        name = f"{page.name}[block {index}]"
        code = compile(match.group(1), name, "exec")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code, namespace)
        expected = match.group(2)
        if expected is not None and not _CHECKER.check_output(
            expected, printed.getvalue(), _OPTIONS
        ):
            example = doctest.Example(match.group(1), expected)
            diff = _CHECKER.output_difference(example, printed.getvalue(), _OPTIONS)
            pytest.fail(f"{name} printed other than its output block says:\n{diff}")
