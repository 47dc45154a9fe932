"""The documentation site builds in strict mode and its API page covers every public name."""

from __future__ import annotations

import os
import pathlib
import sys

from conftest import run_child

import dm_env_rpc_client as dmr

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_strict_build_covers_every_public_name(tmp_path: pathlib.Path) -> None:
    site = tmp_path / "site"
    result = run_child(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        timeout=100,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    api = (site / "api" / "index.html").read_text()
    missing = [name for name in dmr.__all__ if name not in api]
    assert missing == []
    for page in (
        "tensors",
        "connection",
        "environment",
        "batched",
        "cli",
        "server",
        "notebooks",
        "architecture",
    ):
        assert (site / page / "index.html").exists(), page
