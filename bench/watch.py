"""What watching costs a run: no watcher, a watcher with no page open, a page open on 16 worlds.

Run: ``python bench/watch.py [--steps N] [--rounds R] [--page chromium|sse]
[--layout split|shared|both] [--part run|own|both]``. 16 Catch worlds on two server
processes, stepped by ``dmr.collect`` (the ``run`` command's loop, 8 steps in flight per
world) on one open batch, in segments of ``--steps`` steps; each round runs the three
variants once, in a shuffled order, so that they see the same drift:

- ``none``: no observer;
- ``watcher, no page``: a started ``Watcher`` that nobody looks at (targets: no
  measurable cost, and not one batch kept or frame encoded);
- ``page on 16 worlds``: a second watcher, with a page open on all 16 worlds: headless
  Debian Chromium driven by Playwright (``--page chromium``, the default when
  /usr/bin/chromium and playwright are there), or a child process that reads the
  Server-Sent Events stream and decodes every frame as the page would (``--page sse``).
  Target: at least 0.95 of ``none``'s steps/s, with at least 10 frames/s per world
  counted by the page itself (``watch.received``) during the timed steps.

Layouts (``taskset``-style affinity of every thread): ``split`` puts the run (this
process: client and watchers; and both servers) on the first CPU and the browser (every
process of it, Playwright's driver included) on the last one, as when the page is on the
user's machine; ``shared`` lets every process use every CPU, as on one laptop.

Columns: steps/s and its ratio to ``none`` (medians of per-round ratios, with quartiles);
the same ratio from CPU counters (client plus servers, per step); one minus the watcher's
share of the run's CPU (its threads' CPU from /proc's schedstat plus ``on_steps``' own
time on the stepping thread, against ``none``'s client plus servers CPU per step); the
frames the page received per world per second; the page's processes' CPU per step.

Part 2 (``--part own``) measures the watcher alone, with no run to share the cores with:
batches of 16 Catch-like steps fed to ``on_steps`` at ``--own-rate`` steps/s for 5 s, this
process's CPU per step (the watcher's threads, the feeding loop's included: "no watcher" is
that loop alone), with no page, the stream reader, and Chromium (whose CPU is its own
processes').

The machine may be shared (2 cores, other engineers' work on them): steps/s drift by
more than the watcher costs; the CPU columns are what hold. The load average is printed
before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
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
    parser.add_argument("--steps", type=int, default=2_000, help="steps per segment")
    parser.add_argument("--rounds", type=int, default=11)
    try:
        import playwright  # noqa: F401

        have_chromium = os.path.exists(CHROMIUM)
    except ImportError:
        have_chromium = False
    parser.add_argument(
        "--page", choices=("chromium", "sse"), default="chromium" if have_chromium else "sse"
    )
    parser.add_argument(
        "--layout",
        choices=("split", "shared", "both"),
        default="both",
        help="split: the run (client and servers) on one CPU, the page on another; "
        "shared: every process on every CPU",
    )
    parser.add_argument("--part", choices=("both", "run", "own"), default="both")
    parser.add_argument("--own-rate", type=float, default=4000.0, help="steps/s fed in part 2")
    args = parser.parse_args()
    print(f"Load before: {_load()}")
    if args.part != "own":
        for layout in ("split", "shared") if args.layout == "both" else (args.layout,):
            run_part(args, layout)
    if args.part != "run":
        own_part(args)
    print(f"\nLoad after: {_load()}")


def _load() -> str:
    """The machine's load averages (1, 5, 15 min) and CPUs, as ``uptime`` says them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def _pin_all(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of every process ``pids`` onto ``cpus`` (as ``taskset -a -p``)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task), cpus)


def _thread_seconds(native_id: int) -> float:
    """CPU seconds of one of this process's threads (/proc's schedstat: nanoseconds)."""
    return _schedstat(f"/proc/self/task/{native_id}/schedstat")


def _schedstat(path: str) -> float:
    """The CPU seconds in a /proc schedstat file (nanoseconds), 0 when it is gone."""
    with contextlib.suppress(OSError, ValueError), open(path) as stat:
        return int(stat.read().split()[0]) / 1e9
    return 0.0


def _servers_seconds(pids: list[int]) -> float:
    """CPU seconds of every thread of the processes ``pids`` (nanosecond counters)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                total += _schedstat(f"/proc/{pid}/task/{task}/schedstat")
    return total


def _watcher_seconds(watcher: Watcher | None) -> float:
    """CPU seconds of ``watcher``'s threads now alive: counting and encoding, serving, and
    (if it has pages open) streaming."""
    if watcher is None:
        return 0.0
    threads = [watcher._thread, watcher._server._thread if watcher._server else None]
    if watcher.subscribers:
        threads += [t for t in threading.enumerate() if t.name == "dm_env_rpc_client-watch-stream"]
    return sum(_thread_seconds(t.native_id) for t in threads if t is not None and t.native_id)


class _Timed:
    """Forwards a watcher's ``on_steps`` and adds up the stepping thread's CPU in it."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher, self.seconds = watcher, 0.0

    def on_steps(self, timestep: Any) -> None:
        start = time.thread_time()
        self.watcher.on_steps(timestep)
        self.seconds += time.thread_time() - start

    def on_event(self, event: Any) -> None:
        self.watcher.on_event(event)


VARIANTS = ("none", "watcher, no page", "page on 16 worlds")


def run_part(args: Any, layout: str) -> None:
    """Part 1: a run's steps/s with no watcher, a watcher and no page, a page on 16 worlds.

    One batch of 16 worlds steps in short segments, the three variants in a shuffled order
    each round: ``none`` (no observer), an idle watcher nobody looks at, and a second
    watcher with a page open on it. The page stays open (and its watcher serves it) through
    the other variants' segments, so the rounds are seconds apart, not a browser start
    apart; what that idle page costs the other variants (a push of counters 15 times a
    second, no frames) is inside the ratio, against the page.
    """
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    cpus = sorted(os.sched_getaffinity(0))
    run_cpus, page_cpus = ({cpus[0]}, {cpus[-1]}) if layout == "split" else (set(cpus), set(cpus))
    rng = random.Random(0)
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(server_processes("sdk", 2))
        server_pids = [server.pid for server in servers]
        _pin_all([os.getpid(), *server_pids], run_cpus)
        batch = dmr.BatchedEnvironment.connect([s.address for s in servers], WORLDS, seed=0)
        stack.callback(batch.close)
        batch.reset()
        idle = stack.enter_context(Watcher())
        watched = stack.enter_context(Watcher())
        page = _Page(args.page, watched.url)
        stack.callback(page.close)
        _pin_all(page.pids, page_cpus)
        observers = {"none": [], "watcher, no page": [_Timed(idle)]}
        observers["page on 16 worlds"] = [_Timed(watched)]
        deadline = time.monotonic() + 30
        while page.frames() < WORLDS and time.monotonic() < deadline:
            dmr.collect(batch, WORLDS * 10, pipeline=8, seed=0, observers=observers[VARIANTS[2]])
        if page.frames() < WORLDS:
            raise RuntimeError("the page received no frames within 30 s")
        for _ in range(args.rounds):
            order = list(VARIANTS)
            rng.shuffle(order)
            for name in order:
                timed = observers[name][0] if observers[name] else None
                dmr.collect(batch, 200, pipeline=8, seed=0, observers=observers[name])  # warm
                gc.collect()
                before = _sample(page, timed, server_pids, watched)
                dmr.collect(batch, args.steps, pipeline=8, seed=0, observers=observers[name])
                after = _sample(page, timed, server_pids, watched)
                sample = {key: after[key] - before[key] for key in before}
                samples[name].append(sample)
        encoded = {"watcher, no page": idle.frames_encoded, "page on 16 worlds": 0}
        encoded["page on 16 worlds"] = watched.frames_encoded
    rows = []
    steps = args.steps
    for name in VARIANTS:
        runs = samples[name]
        ratios = [
            (steps / run["wall"]) / (steps / base["wall"])
            for run, base in zip(runs, samples["none"], strict=True)
        ]
        cpu_ratios = [
            (base["client"] + base["servers"]) / (run["client"] + run["servers"])
            for run, base in zip(runs, samples["none"], strict=True)
        ]
        watched_row = name == "page on 16 worlds"
        # The share of the run's core the watcher's threads take, from CPU counters alone:
        # what the ratio is on a core of its own, without the other engineers' noise.
        base_us = [(b["client"] + b["servers"]) / steps * 1e6 for b in samples["none"]]
        share = [b / (b + _own(r) / steps * 1e6) for r, b in zip(runs, base_us, strict=True)]
        rows.append(
            [
                name,
                _median([steps / run["wall"] for run in runs]),
                _spread(ratios),
                _spread(cpu_ratios),
                "-" if name == "none" else f"{_median(share):.3f}",
                _median([run["client"] / steps * 1e6 for run in runs]),
                _median([run["servers"] / steps * 1e6 for run in runs]),
                "-" if name == "none" else f"{_median([_own(r) / steps * 1e6 for r in runs]):.2f}",
                "-"
                if name == "none"
                else f"{_median([r['on_steps'] / steps * 1e6 for r in runs]):.2f}",
                "-" if name == "none" else str(encoded[name]),
                f"{_median([r['frames'] / WORLDS / r['wall'] for r in runs]):.1f}"
                if watched_row
                else "-",
                f"{_median([r['page'] / steps * 1e6 for r in runs]):.1f}" if watched_row else "-",
            ]
        )
    background = _median([r["page watcher"] / steps * 1e6 for r in samples["none"]])
    where = (
        f"the run (client and 2 servers) on CPU {min(run_cpus)}, the page on CPU {min(page_cpus)}"
        if layout == "split"
        else "every process on every CPU"
    )
    print_table(
        f"Watching {WORLDS} Catch worlds on 2 servers, segments of {args.steps:,} steps, "
        f"{args.rounds} rounds, page: {args.page}; {where}",
        [
            "variant",
            "steps/s",
            "ratio to none (quartiles)",
            "CPU ratio to none, client+servers (quartiles)",
            "1 - watcher's share of the run's CPU",
            "client CPU µs/step",
            "servers CPU µs/step",
            "watcher CPU µs/step",
            "of it on the stepping thread",
            "frames encoded",
            "frames/s per world (page side)",
            "page CPU µs/step",
        ],
        rows,
    )
    print(
        f"\nThe page's watcher, serving the open page with no frames, during `none`'s segments: "
        f"{background:.2f} µs/step (in `none`'s numbers, against the page)."
    )


def _own(run: dict[str, float]) -> float:
    return run["watcher"] + run["on_steps"]


def _sample(
    page: _Page, timed: _Timed | None, server_pids: list[int], watched: Watcher
) -> dict[str, float]:
    """Counters now: wall, this process's CPU, the servers', the watchers', the page's."""
    return {
        "wall": time.monotonic(),
        "client": time.process_time(),
        "servers": _servers_seconds(server_pids),
        "watcher": _watcher_seconds(timed.watcher if timed else None),
        "page watcher": _watcher_seconds(watched),
        "on_steps": timed.seconds if timed else 0.0,
        "frames": page.frames(),
        "page": page.cpu(),
    }


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _spread(values: list[float]) -> str:
    """The median and, in brackets, the lower and upper quartiles."""
    if len(values) < 4:
        return f"{_median(values):.3f}"
    low, _, high = statistics.quantiles(values, n=4)
    return f"{_median(values):.3f} ({low:.2f}-{high:.2f})"


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
