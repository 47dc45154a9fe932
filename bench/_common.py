"""Shared benchmark helpers: server subprocesses, timing, and table printing."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def server_process(*args: str) -> Iterator[str]:
    """Runs ``python -m dm_env_rpc_client.server`` in a subprocess; yields its address."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dm_env_rpc_client.server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.match(r"Serving \w+ on (\S+)", line)
        if match is None:
            raise RuntimeError(f"unexpected server output: {line!r}")
        yield match.group(1)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


class Measurement(NamedTuple):
    steps_per_second: float
    cpu_us_per_step: float


def measure(run: Callable[[int], Any], steps: int, repeats: int = 3) -> Measurement:
    """Best of ``repeats``: wall-clock steps/s and client CPU µs/step (all threads)."""
    best: Measurement | None = None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run(steps)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        result = Measurement(steps / wall, cpu / steps * 1e6)
        if best is None or result.steps_per_second > best.steps_per_second:
            best = result
    assert best is not None
    return best


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints a Markdown table."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        cells = [f"{cell:,.1f}" if isinstance(cell, float) else str(cell) for cell in row]
        print("| " + " | ".join(cells) + " |")
