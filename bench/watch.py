"""What watching costs a run: no watcher, a watcher with no page open, a page open on 16 worlds.

Run: ``python bench/watch.py [--steps N] [--rounds R] [--page chromium|sse]``. 16 Catch
worlds on two server processes, stepped by the ``run`` command's loop (``step_worlds``,
8 steps in flight per world), interleaved in rounds (``_common.measure_interleaved``):

- ``none``: no observer;
- ``watcher, no page``: a started ``Watcher`` that nobody looks at (targets: no
  measurable cost, and not one frame encoded);
- ``page on 16 worlds``: the same with the page open on all 16 worlds: headless
  Debian Chromium driven by Playwright (``--page chromium``, the default when
  /usr/bin/chromium and playwright are there), or a child process that reads the
  Server-Sent Events stream and decodes every frame as the page would (``--page sse``).
  Target: at least 0.95 of ``none``'s steps/s. "frames/s per world" is what the page
  received during the timed steps, per shown world (target: at least 10).

Ratios are medians of per-round ratios. The machine is shared (2 cores, other
engineers' work on them): absolute steps/s drift, the ratios are what to read. The
browser's own CPU is in its processes, not in "client CPU µs/step", but it competes
for the same cores, which is what the steps/s ratio shows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import Any

# _common first: it sets GRPC_VERBOSITY before grpc is imported.
from _common import (
    DEFAULT_ROUNDS,
    measure_interleaved,
    print_table,
    process_cpu_seconds,
    server_processes,
)

# isort: split
import dm_env_rpc_client as dmr
from dm_env_rpc_client._cli.run import step_worlds
from dm_env_rpc_client.watch import Watcher

WORLDS = 16
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# A stand-in page: reads the stream, decodes each frame's pixels, counts frames.
SSE_READER = r"""
import base64, json, sys, urllib.request
stream = urllib.request.urlopen(sys.argv[1] + "stream", timeout=30)
frames = 0
for line in stream:
    if line.startswith(b"data: "):
        for frame in json.loads(line[6:])["frames"]:
            if frame["image"]:
                base64.b64decode(frame["image"]["data"])
            frames += 1
        print(frames, flush=True)
"""


def _descendants(pid: int) -> list[int]:
    """The processes started, directly or not, by ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with (
                contextlib.suppress(OSError, IndexError, ValueError),
                open(f"/proc/{entry}/stat") as stat,
            ):
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], {pid}
    while frontier:
        children = {child for child, parent in parents.items() if parent in frontier}
        found += sorted(children)
        frontier = children
    return found


def _cpu(pids: set[int]) -> float:
    """CPU seconds of the processes ``pids`` (those still running)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += process_cpu_seconds(pid)
    return total


class _Page:
    """A page open on the watcher: a browser tab, or the stand-in stream reader."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind, self._frames, self._stop = kind, 0, False
        before = set(_descendants(os.getpid()))  # the servers, which are not the page's
        if kind == "chromium":
            from playwright.sync_api import sync_playwright

            self._playwright = sync_playwright().start()
            self._browser = self._playwright.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS
            )
            self._page = self._browser.new_page()
            self._page.goto(url)
        else:
            self._process = subprocess.Popen(
                [sys.executable, "-c", SSE_READER, url], stdout=subprocess.PIPE, text=True
            )
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        self.pids = set(_descendants(os.getpid())) - before

    def cpu(self) -> float:
        """CPU seconds of the page's processes so far."""
        return _cpu(self.pids)

    def _read(self) -> None:
        for line in self._process.stdout:  # type: ignore[union-attr]
            self._frames = int(line)

    def frames(self) -> int:
        """Frames the page received so far, over every world."""
        if self.kind == "chromium":
            return int(
                self._page.evaluate("Object.values(watch.received).reduce((a, b) => a + b, 0)")
            )
        return self._frames

    def close(self) -> None:
        if self.kind == "chromium":
            self._browser.close()
            self._playwright.stop()
        else:
            self._process.kill()
            self._process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    try:
        import playwright  # noqa: F401

        have_chromium = os.path.exists(CHROMIUM)
    except ImportError:
        have_chromium = False
    parser.add_argument(
        "--page", choices=("chromium", "sse"), default="chromium" if have_chromium else "sse"
    )
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"page on 16 worlds": []}
    encoded: dict[str, int] = {}
    page_cpu: list[float] = []

    with server_processes("sdk", 2) as servers:
        addresses = [server.address for server in servers]

        def variant(name: str) -> Any:
            def factory() -> Any:
                batch = dmr.BatchedEnvironment.connect(addresses, WORLDS, seed=0)
                batch.reset()
                watcher = Watcher().start() if name != "none" else None
                page = _Page(args.page, watcher.url) if name == "page on 16 worlds" else None
                if page is not None:  # the page is showing frames before the timing starts
                    deadline = time.monotonic() + 30
                    while page.frames() == 0 and time.monotonic() < deadline:
                        step_worlds(
                            batch,
                            steps=WORLDS * 10,
                            pipeline=8,
                            timeout=30,
                            seed=0,
                            observers=[watcher],
                        )
                    if page.frames() == 0:
                        raise RuntimeError("the page received no frame within 30 s")
                observers = [] if watcher is None else [watcher]
                timing: dict[str, float] = {}

                def run(steps: int) -> None:
                    timing["frames"], timing["start"] = (
                        page.frames() if page else 0,
                        time.monotonic(),
                    )
                    timing["cpu"], timing["steps"] = page.cpu() if page else 0.0, steps
                    step_worlds(
                        batch, steps=steps, pipeline=8, timeout=30, seed=0, observers=observers
                    )
                    timing["end"] = time.monotonic()
                    timing["cpu"] = (page.cpu() if page else 0.0) - timing["cpu"]

                def close() -> None:
                    if page is not None:
                        received = page.frames() - timing["frames"]
                        rates[name].append(received / WORLDS / (timing["end"] - timing["start"]))
                        page_cpu.append(timing["cpu"] / timing["steps"] * 1e6)
                        page.close()
                    if watcher is not None:
                        encoded[name] = encoded.get(name, 0) + watcher.frames_encoded
                        watcher.close()
                    batch.close()

                return run, close

            return factory

        names = ["none", "watcher, no page", "page on 16 worlds"]
        rounds = measure_interleaved(
            {name: variant(name) for name in names}, args.steps, rounds=args.rounds
        )
    rows = []
    for name in names:
        frames = rates.get(name)
        rows.append(
            [
                name,
                rounds.median(name),
                f"{rounds.ratio(name, 'none'):.3f}",
                rounds.median(name, "cpu_us_per_step"),
                "-" if name == "none" else str(encoded.get(name, 0)),
                f"{sorted(frames)[len(frames) // 2]:.1f}" if frames else "-",
                f"{sorted(page_cpu)[len(page_cpu) // 2]:.1f}" if frames else "-",
            ]
        )
    print_table(
        f"Watching {WORLDS} Catch worlds on 2 servers, {args.steps:,} steps x {rounds.rounds} "
        f"rounds, page: {args.page}",
        [
            "variant",
            "steps/s",
            "ratio to none",
            "client CPU µs/step",
            "frames encoded",
            "frames/s per world",
            "page CPU µs/step",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
