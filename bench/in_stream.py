"""What a microsecond of Python costs on the client's CPU while it streams steps.

Run: ``python bench/in_stream.py [--steps N] [--rounds R] [--servers ...] [--no-pin]``.
One fixed piece of pure Python (``probe``: a small dict, a tuple, a short loop:
the kind of work the SDK does per step) is timed by its thread's CPU clock, in
four places on the client's CPU:

- alone: back to back, with no stream open (what ``timeit`` would say);
- on the raw gRPC floor's sending thread, once per step (16 in flight);
- between the steps of SDK ``step_iter`` and of SDK ``step_async`` (16 in flight).

Each serves Catch and the float32[100,000] observation, on each server. The
ratio "vs alone" is how much slower the same Python runs once gRPC's threads
(and, on the large profile, its 400 KB copies) share the CPU with it: the
factor by which every microsecond a client adds per step, measured alone,
grows in the stream. The client CPU of the benchmarks' tables is spent there.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    DEFAULT_ROUNDS,
    SERVERS,
    add_pin_argument,
    any_server_process_info,
    apply_pin,
    pin,
    print_table,
)
from _lib.floors import raw_floor

import dm_env_rpc_client as dmr

WINDOW = 16


def probe() -> int:
    """About 1.5 µs of pure Python (alone): no I/O, no allocation beyond small objects."""
    fields = {"step": 1, "reward": 0.0, "discount": 1.0}
    pair = (fields["step"], fields["reward"])
    total = 0
    for i in range(30):
        total += i * 3 % 7
    return total + pair[0]


class Probe:
    """Times ``probe()`` by this thread's CPU clock; ``mean`` in µs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0

    def __call__(self, *_: Any) -> None:
        clock = time.thread_time
        start = clock()
        probe()
        self.seconds += clock() - start
        self.count += 1

    @property
    def mean(self) -> float:
        return self.seconds / max(1, self.count) * 1e6


def alone(steps: int) -> float:
    timed = Probe()
    for _ in range(steps):
        timed()
    return timed.mean


def on_floor(address: str, steps: int) -> float:
    timed = Probe()
    run, close = raw_floor(address, WINDOW, each=timed)
    try:
        run(min(steps, 300))  # warm up
        timed.seconds, timed.count = 0.0, 0
        run(steps)
    finally:
        close()
    return timed.mean


def on_sdk(address: str, action: dict[str, Any], steps: int, use_async: bool) -> float:
    timed = Probe()
    conn = dmr.connect(address, timeout=30)
    env, _ = dmr.create_and_join_world(conn, {}, {})
    try:
        env.reset()

        def run(count: int) -> None:
            if use_async:
                pending: collections.deque[Any] = collections.deque()
                for _ in range(count):
                    if len(pending) >= WINDOW:
                        timed(pending.popleft().result())
                    pending.append(env.step_async(action))
                for future in pending:
                    timed(future.result())
            else:
                for timestep in env.step_iter([action] * count, in_flight=WINDOW):
                    timed(timestep)

        run(min(steps, 300))  # warm up
        timed.seconds, timed.count = 0.0, 0
        run(steps)
    finally:
        env.close()
        conn.close()
    return timed.mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    add_pin_argument(parser)
    args = parser.parse_args()
    pinned = apply_pin(args.pin)
    header = ["profile", "server", "where probe() runs", "probe µs (thread CPU)", "vs alone"]
    rows = []
    large_steps = max(100, args.steps // 5)
    for title, env, extra, action, steps in (
        ("Catch", "catch", (), {"paddle": np.int8(1)}, args.steps),
        (
            "float32[100,000]",
            "large",
            ("--size", "100000"),
            {"delta": np.float32(0.5)},
            large_steps,
        ),
    ):
        for name in args.servers:
            with any_server_process_info(name, env, *extra) as server:
                pin([server.pid])
                address = server.address
                places: dict[str, Callable[[], float]] = {
                    "alone (no stream)": functools.partial(alone, steps),
                    "raw floor's sending thread": functools.partial(on_floor, address, steps),
                    "between SDK step_iter steps": functools.partial(
                        on_sdk, address, action, steps, False
                    ),
                    "between SDK step_async steps": functools.partial(
                        on_sdk, address, action, steps, True
                    ),
                }
                means: dict[str, list[float]] = {place: [] for place in places}
                for _ in range(args.rounds):
                    for place, measure in places.items():
                        means[place].append(measure())
                base = statistics.median(means["alone (no stream)"])
                for place, values in means.items():
                    median = statistics.median(values)
                    rows.append([title, SERVERS[name], place, median, f"{median / base:.2f}x"])
    print_table("The same Python, alone and in the stream", header, rows)
    print(
        f"\nMedians over {args.rounds} rounds; probes per place per round: {args.steps:,} "
        f"(Catch), {large_steps:,} (float32[100,000])."
    )
    print(pinned)


if __name__ == "__main__":
    main()
