"""What the fault handling costs on the happy path: the batch with and without it, one run.

Run: ``python bench/fault_cost.py [--steps N] [--rounds R] [--worlds W] [--servers ...]``.
16 Catch worlds (by default) on 2 server processes, first the SDK's, then a foreign
one written on the reference package (``_lib/foreign_server.py``); nothing fails. The same
send/recv loop as ``bench/batched.py`` (8 steps in flight per world), with the batch
connected three ways, interleaved in rounds:

- (a) ``on_world_failure="raise", step_timeout=None``: no watchdog, nothing to restart;
- (b) ``on_world_failure="raise"`` with the default ``step_timeout`` (30 s): the library's
  defaults, the watchdog running;
- (c) ``on_world_failure="restart"`` with the default ``step_timeout``: what ``run`` uses.

(b)/(a) and (c)/(a) are the happy-path cost of stall detection and of the restart policy.
"""

from __future__ import annotations

import argparse

from _lib.common import (
    DEFAULT_ROUNDS,
    SERVERS,
    measure_interleaved,
    print_table,
    server_processes,
)
from batched import ours

VARIANTS = {
    "(a) raise, no step_timeout": {"on_world_failure": "raise", "step_timeout": None},
    "(b) raise, step_timeout 30 s (the defaults)": {"on_world_failure": "raise"},
    "(c) restart, step_timeout 30 s (run's policy)": {"on_world_failure": "restart"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6400)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--worlds", type=int, default=16)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    args = parser.parse_args()
    base = next(iter(VARIANTS))
    rows = []
    for server_key in args.servers:
        with server_processes(server_key) as servers:
            addresses = [server.address for server in servers]
            factories = {
                name: (lambda kwargs=kwargs, at=addresses: ours(at, args.worlds, **kwargs))
                for name, kwargs in VARIANTS.items()
            }
            results = measure_interleaved(
                factories, args.steps, rounds=args.rounds, server_pid=[s.pid for s in servers]
            )
        rows += [
            (
                SERVERS[server_key],
                name,
                f"{results.median(name):,.1f}",
                f"{results.median(name, 'cpu_us_per_step'):,.1f}",
                f"{results.ratio(name, base):.2f}x",
                f"{results.ratio(name, base, 'cpu_us_per_step'):.2f}x",
            )
            for name in VARIANTS
        ]
    print_table(
        f"Happy-path cost of fault handling: {args.worlds} Catch worlds on 2 server processes",
        ["servers", "batch", "steps/s", "client CPU µs/step", "steps/s vs (a)", "CPU vs (a)"],
        rows,
    )
    print(
        f"\nMedians over {args.rounds} interleaved rounds of {args.steps:,} steps; "
        "ratios taken within each round, against (a) on the same servers."
    )


if __name__ == "__main__":
    main()
