"""What one server process spends, in CPU, to open and to close each world, next to gRPC's floor.

Run: ``python bench/server_cost.py [--worlds 1024] [--rounds 3] [--baseline DIR]``.
Each server kind runs alone in a process of its own, pinned to the first CPU (the
client to the second: ``--pin``, default), with room for the worlds; the client is
the raw gRPC floor's (``_lib/open_floor.py``: bare ``grpc.aio``, one stream per world,
64 being opened at a time, create then join, then every leave and destroy), the
same for every server, so the servers' CPU is all that differs. The kinds:

- ``SDK server``: this checkout's (``python -m dm_env_rpc_client.server``, Catch);
- ``SDK server, before``: the one of ``--baseline DIR`` (another commit's tree);
- ``reference-package server``: ``_lib/foreign_server.py`` (sync ``grpc.server``, a thread
  per stream, Catch);
- ``raw grpc.aio floor`` and ``raw sync grpc floor``: ``_lib/server_floor.py``, a bare
  server answering each request with pre-serialized bytes, no environment and no
  per-stream state: gRPC's own cost per stream on this machine.

Every kind is measured once per round, the kinds in a seeded shuffled order, each
in a fresh server process; reported are the medians over the rounds of the
server's CPU per world in connect and in close (from /proc, all its threads),
the share of the thread that runs Python (the event loop, or the pool's threads)
and of gRPC's own C threads, and the connect's ratio to the ``grpc.aio`` floor's
in the same round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    add_pin_argument,
    apply_pin,
    floor_server_process_info,
    foreign_server_process_info,
    pin,
    print_table,
    process_cpu_seconds,
    server_process_info,
    thread_cpu,
    tree_server_process_info,
)
from _lib.open_floor import open_close_floor

AIO_FLOOR = "raw grpc.aio floor"


def c_seconds(pid: int) -> float:
    """CPU seconds of ``pid``'s live gRPC C threads (by name); the rest of the process's CPU
    is its Python threads' (and of threads that ended: /proc counts them in the process)."""
    return sum(
        seconds
        for name, seconds in thread_cpu(pid).items()
        if name.startswith(("event_engine", "grpc", "default-executo", "resolver"))
    )


def kinds(baseline: str | None, room: str) -> dict[str, Callable[[], Any]]:
    """Each server kind's starter (a context manager yielding address and pid)."""
    workers = ("--max-workers", room)
    starters: dict[str, Callable[[], Any]] = {
        "SDK server": lambda: server_process_info("catch", *workers),
        "reference-package server": lambda: foreign_server_process_info("catch", *workers),
        AIO_FLOOR: lambda: floor_server_process_info("--kind", "aio"),
        "raw sync grpc floor": lambda: floor_server_process_info("--kind", "sync", *workers),
    }
    if baseline:
        starters["SDK server, before"] = lambda: tree_server_process_info(
            baseline, "catch", *workers
        )
    return starters


def measure(start: Callable[[], Any], worlds: int) -> dict[str, float]:
    """One server of a kind: its CPU ms per world in connect and close, and its threads'."""
    with start() as server:
        pin([server.pid])
        before = c_seconds(server.pid), process_cpu_seconds(server.pid)
        spent = open_close_floor([server.address], worlds, lambda: process_cpu_seconds(server.pid))
        c = c_seconds(server.pid) - before[0]
        total = process_cpu_seconds(server.pid) - before[1]
    per_world = 1e3 / worlds
    return {
        "connect": spent["connect"]["servers"] * per_world,
        "close": spent["close"]["servers"] * per_world,
        "python": (total - c) * per_world,
        "c": c * per_world,
        "wall": spent["connect"]["wall"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="DIR", help="also the SDK server of DIR's tree")
    add_pin_argument(parser)
    args = parser.parse_args()
    pinned = apply_pin(args.pin)
    rows = []
    for worlds in args.worlds:
        starters = kinds(args.baseline, str(worlds + 16))
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in starters}
        order, rng = list(starters), random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                samples[name].append(measure(starters[name], worlds))
                print(f"  {name}, {worlds:,} worlds: {samples[name][-1]}", file=sys.stderr)
        for name in starters:
            runs = samples[name]

            def median(key: str, runs: list[dict[str, float]] = runs) -> float:
                return statistics.median(run[key] for run in runs)

            ratio = statistics.median(
                run["connect"] / floor["connect"]
                for run, floor in zip(runs, samples[AIO_FLOOR], strict=True)
            )
            rows.append(
                [
                    name,
                    f"{worlds:,}",
                    f"{median('connect'):.3f} ms",
                    f"{ratio:.2f}x",
                    f"{median('close'):.3f} ms",
                    f"{median('python'):.3f} ms",
                    f"{median('c'):.3f} ms",
                    f"{median('wall'):.2f} s",
                ]
            )
    print_table(
        "Server CPU per world, one server process, the raw gRPC client "
        f"(medians of {args.rounds} rounds)",
        [
            "server",
            "worlds",
            "connect CPU/world",
            "vs grpc.aio floor",
            "close CPU/world",
            "Python threads",
            "gRPC C threads",
            "connect wall",
        ],
        rows,
    )
    print("\nPython threads and gRPC C threads: connect and close together, per world.")
    print(pinned)


if __name__ == "__main__":
    main()
