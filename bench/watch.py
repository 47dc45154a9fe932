"""What watching costs a run: no watcher, a watcher with no page open, a page open on 16 worlds.

Run: ``python bench/watch.py [--steps N] [--rounds R] [--page chromium|sse]``. 16 Catch
worlds on two server processes, stepped by ``dmr.collect`` (the ``run`` command's loop,
8 steps in flight per world), interleaved in rounds (``_lib.common.measure_interleaved``):

- ``none``: no observer;
- ``watcher, no page``: a started ``Watcher`` that nobody looks at (targets: no
  measurable cost, and not one frame encoded);
- ``page on 16 worlds``: the same with the page open on all 16 worlds: headless
  Debian Chromium driven by Playwright (``--page chromium``, the default when
  /usr/bin/chromium and playwright are there), or a child process that reads the
  Server-Sent Events stream and decodes every frame as the page would (``--page sse``).
  Target: at least 0.95 of ``none``'s steps/s. "frames/s per world" is what the page
  received during the timed steps, per shown world (target: at least 10).

Part 2 (``--part own``) measures the watcher alone, with no run to share the cores with:
batches of 16 Catch-like steps fed to ``on_steps`` at ``--own-rate`` steps/s for 5 s, this
process's CPU per step (the watcher's threads, the feeding loop's included: "no watcher" is
that loop alone), with no page, the stream reader, and Chromium (whose CPU is its own
processes'). Against the client's ~200 µs of CPU per step of part 1, it says what watching
costs where part 1's steps/s are too noisy to tell.

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

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    DEFAULT_ROUNDS,
    measure_interleaved,
    print_table,
    process_cpu_seconds,
    server_processes,
)

# isort: split
import numpy as np

import dm_env_rpc_client as dmr
from dm_env_rpc_client._adaptor.stacked import BatchedTimeStep
from dm_env_rpc_client.watch import Watcher
from tests.browser import CHROMIUM, CHROMIUM_ARGS

WORLDS = 16
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


def _catch_batches(count: int) -> list[Any]:
    """``count`` batches of 16 Catch-like steps (boards, rewards, a LAST every 10th step)."""
    rng = np.random.default_rng(0)
    ids = np.arange(WORLDS)
    batches = []
    for index in range(count):
        step_type = np.full(WORLDS, (0, 1, 1, 1, 1, 1, 1, 1, 1, 2)[index % 10], np.uint8)
        board = (rng.random((WORLDS, 10, 5)) > 0.9).astype(np.float32)
        reward = np.where(step_type == 2, 1.0, 0.0)
        batches.append(BatchedTimeStep(step_type, reward, np.ones(WORLDS), {"board": board}, ids))
    return batches


def own_cost(
    page_kind: str | None, rate: float, seconds: float, *, watch: bool = True
) -> tuple[float, float, float]:
    """The watcher's own CPU, all its threads, per step: batches fed at ``rate`` steps/s.

    Returns (this process's CPU µs per step, the feeding loop's included: ``watch=False``
    feeds no watcher, which measures the loop alone; the page's CPU µs per step; frames per
    second per shown world).
    """
    batches = _catch_batches(100)
    with Watcher() as watcher:
        observe = watcher.on_steps if watch else lambda timestep: None
        page = _Page(page_kind, watcher.url) if page_kind else None
        try:
            deadline = time.monotonic() + 30
            while page is not None and page.frames() == 0 and time.monotonic() < deadline:
                watcher.on_steps(batches[0])
                time.sleep(0.01)
            frames0, page0 = (page.frames(), page.cpu()) if page else (0, 0.0)
            cpu0 = time.process_time()
            start = time.monotonic()
            fed = 0
            while time.monotonic() - start < seconds:
                due = start + fed / rate
                time.sleep(max(0.0, due - time.monotonic()))
                observe(batches[(fed // WORLDS) % len(batches)])
                fed += WORLDS
            wall = time.monotonic() - start
            cpu = time.process_time() - cpu0
            frames = (page.frames() - frames0) / WORLDS / wall if page else 0.0
            page_cpu = (page.cpu() - page0) / fed * 1e6 if page else 0.0
        finally:
            if page is not None:
                page.close()
    # The feeding loop costs next to nothing (it sleeps): what the process spent is the watcher's.
    return cpu / fed * 1e6, page_cpu, frames


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
    parser.add_argument("--part", choices=("both", "run", "own"), default="both")
    parser.add_argument("--own-rate", type=float, default=4000.0, help="steps/s fed in part 2")
    args = parser.parse_args()
    if args.part != "own":
        run_part(args)
    if args.part != "run":
        own_part(args)


def run_part(args: Any) -> None:
    """Part 1: a run's steps/s with no watcher, a watcher and no page, a page on 16 worlds."""
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
                        dmr.collect(batch, WORLDS * 10, pipeline=8, seed=0, observers=[watcher])
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
                    dmr.collect(batch, steps, pipeline=8, seed=0, observers=observers)
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


def own_part(args: Any) -> None:
    """Part 2: the watcher's own CPU per step, with no page and with one."""
    rows = []
    floor, _, _ = own_cost(None, args.own_rate, 5.0, watch=False)
    rows.append(["no watcher (the feeding loop alone)", f"{floor:.1f}", "-", "-"])
    for kind in (None, "sse", *(["chromium"] if args.page == "chromium" else [])):
        client, page_cpu, frames = own_cost(kind, args.own_rate, 5.0)
        name = "no page" if kind is None else f"page on 16 worlds ({kind})"
        rows.append(
            [
                name,
                f"{client:.1f}",
                f"{page_cpu:.1f}" if kind else "-",
                f"{frames:.1f}" if kind else "-",
            ]
        )
    print_table(
        f"The watcher alone: batches of 16 Catch steps fed at {args.own_rate:,.0f} steps/s for 5 s",
        [
            "variant",
            "watcher CPU µs/step (all its threads)",
            "page CPU µs/step",
            "frames/s per world",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
