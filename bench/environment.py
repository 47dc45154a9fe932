"""DmEnvAdaptor.step, lockstep and pipelined, against the reference DmEnvAdaptor and raw gRPC.

Run: ``python bench/environment.py [--steps N] [--rounds R]``. Two servers, each in
a process of its own: the SDK's event-loop server, and a foreign one written on
the reference package with a sync gRPC handler (``_lib/foreign_server.py``), as most
servers in the wild are; each serves Catch, and an environment with a
float32[100,000] observation. In each of R rounds, in a seeded shuffled order,
every adaptor is set up, warmed up, timed and closed (only the one being timed
is connected). One table per environment, both servers in it: steps per second,
wall-clock µs per step, client CPU µs per step (all client threads) and server
CPU µs per step (the server process, from /proc), each the median over the
rounds (in lockstep, wall minus client and server CPU is the time in transport:
the kernel, the loopback and the wake-ups; pipelined, the three overlap); the ratio against
the reference adaptor, and, for the pipelined rows, against the raw gRPC floor
at the same window (steps/s and client CPU per step), each the median of the
per-round ratios, so drift between rounds cancels. The float32[100,000] table also
has ``step_async`` and ``step_iter`` at 16 in flight with ``copy_observations=False``
(read-only views of the response bytes where the payload is aligned, else a copy).

Regression guards (issue 28: no compiled extension, so the pure-Python costs
measured are kept as ceilings, not goals): after the tables, client CPU per
step of ``step_iter`` and ``step_async`` at 16 in flight over the raw gRPC floor
at 16, per server, against ``CPU_GUARDS``, each row PASS or FAIL; the script
exits with status 1 if any row fails.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    DEFAULT_ROUNDS,
    SERVERS,
    ServerInfo,
    Variant,
    VariantFactory,
    add_pin_argument,
    any_server_process_info,
    apply_pin,
    measure_interleaved,
    print_table,
)

# isort: split
import grpc
import numpy as np
from _lib.floors import raw_floor
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

import dm_env_rpc_client as dmr

REFERENCE = "reference DmEnvAdaptor.step"


def reference(address: str, action: dict[str, Any]) -> Variant:
    channel = grpc.insecure_channel(address)
    conn = reference_connection.Connection(channel)
    env, _ = reference_adaptor.create_and_join_world(conn, {}, {})
    env.reset()

    def run(steps: int) -> None:
        for _ in range(steps):
            env.step(action)

    def close() -> None:
        env.close()
        conn.close()
        channel.close()

    return run, close


def ours(
    address: str,
    action: dict[str, Any],
    in_flight: int | None,
    use_async: bool = False,
    copy_observations: bool = True,
) -> Variant:
    conn = dmr.connect(address, timeout=30)
    env, _ = dmr.create_and_join_world(conn, {}, {}, copy_observations=copy_observations)
    env.reset()

    def run(steps: int) -> None:
        if in_flight is None:
            for _ in range(steps):
                env.step(action)
        elif use_async:
            pending: collections.deque[Any] = collections.deque()
            for _ in range(steps):
                if len(pending) >= in_flight:
                    pending.popleft().result()
                pending.append(env.step_async(action))
            for future in pending:
                future.result()
        else:
            for _ in env.step_iter([action] * steps, in_flight=in_flight):
                pass

    def close() -> None:
        env.close()
        conn.close()

    return run, close


WINDOWS = (8, 16, 32)
ASYNC_WINDOW = 16
# Client CPU per step over the raw gRPC floor's, at most (at ASYNC_WINDOW in flight):
# (table, SDK path) -> ceiling.
CPU_GUARDS = {
    ("Catch", "step_iter"): 1.25,
    ("Catch", "step_async"): 1.3,
    ("float32[100,000] observation", "step_iter"): 1.35,
    ("float32[100,000] observation", "step_async"): 1.65,
}


def bench(
    server: ServerInfo,
    action: dict[str, Any],
    steps: int,
    rounds: int,
    windows: tuple[int, ...],
    views: bool = False,
    ratios: dict[str, float] | None = None,
) -> list[list[Any]]:
    """The table's rows for one server; ``views`` adds the copy_observations=False rows.

    ``ratios`` (if given) gets each SDK path's client CPU per step over the floor's at
    ``ASYNC_WINDOW`` in flight, by path (``step_iter``, ``step_async``), for the guards.
    """
    address = server.address
    variants: dict[str, VariantFactory] = {
        REFERENCE: functools.partial(reference, address, action),
        "SDK DmEnvAdaptor.step (lockstep)": functools.partial(ours, address, action, None),
        f"SDK step_async, {ASYNC_WINDOW} in flight": functools.partial(
            ours, address, action, ASYNC_WINDOW, True
        ),
    }
    floors = {ASYNC_WINDOW, *windows}
    for window in windows:
        variants[f"SDK step_iter, {window} in flight"] = functools.partial(
            ours, address, action, window
        )
    if views:
        for use_async, kind in ((True, "step_async"), (False, "step_iter")):
            variants[f"SDK {kind}, {ASYNC_WINDOW} in flight, copy_observations=False"] = (
                functools.partial(ours, address, action, ASYNC_WINDOW, use_async, False)
            )
    for window in sorted(floors):
        variants[f"raw gRPC floor, {window} in flight"] = functools.partial(
            raw_floor, address, window
        )
    results = measure_interleaved(
        variants, steps, rounds=rounds, warmup=min(steps, 100), server_pid=server.pid
    )
    if ratios is not None:
        floor_name = f"raw gRPC floor, {ASYNC_WINDOW} in flight"
        for path in ("step_iter", "step_async"):
            name = f"SDK {path}, {ASYNC_WINDOW} in flight"
            ratios[path] = results.ratio(name, floor_name, "cpu_us_per_step")
    rows = []
    for name in results.names:
        window = re.search(r"(\d+) in flight", name)
        floor = f"raw gRPC floor, {window[1]} in flight" if window else None
        rows.append(
            [
                name,
                results.median(name, "steps_per_second"),
                1e6 / results.median(name, "steps_per_second"),
                results.median(name, "cpu_us_per_step"),
                results.median(name, "server_cpu_us_per_step"),
                f"{results.ratio(name, REFERENCE):.2f}x",
                f"{results.ratio(name, floor):.0%}" if floor else "",
                f"{results.ratio(name, floor, 'cpu_us_per_step'):.2f}x" if floor else "",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS))
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    add_pin_argument(parser)
    args = parser.parse_args()
    pinned = apply_pin(args.pin)
    header = [
        "server",
        "adaptor",
        "steps/s",
        "wall µs/step",
        "client CPU µs/step",
        "server CPU µs/step",
        "vs reference",
        "vs floor steps/s",
        "CPU vs floor",
    ]
    large_steps = max(100, args.steps // 10)
    windows = tuple(sorted({*args.windows, ASYNC_WINDOW}))  # the guards' window is always run
    checks = []
    for title, env, extra, action, steps, views in (
        ("Catch", "catch", (), {"paddle": np.int8(1)}, args.steps, False),
        (
            "float32[100,000] observation",
            "large",
            ("--size", "100000"),
            {"delta": np.float32(0.5)},
            large_steps,
            True,
        ),
    ):
        rows = []
        for name in args.servers:
            ratios: dict[str, float] = {}
            with any_server_process_info(name, env, *extra) as server:
                rows += [
                    [SERVERS[name], *row]
                    for row in bench(server, action, steps, args.rounds, windows, views, ratios)
                ]
            for path, ratio in ratios.items():
                ceiling = CPU_GUARDS[title, path]
                verdict = "PASS" if ratio <= ceiling else "FAIL"
                checks.append([title, SERVERS[name], path, f"{ratio:.2f}x", f"{ceiling}x", verdict])
        print_table(title, header, rows)
    print(
        f"\nMedians over {args.rounds} interleaved rounds; steps per variant per round: "
        f"{args.steps:,} (Catch), {large_steps:,} (float32[100,000])."
    )
    print(pinned)
    print_table(
        f"CPU regression guards: client CPU per step vs the raw gRPC floor, {ASYNC_WINDOW} in flight",
        ["table", "server", "path", "measured", "at most", "verdict"],
        checks,
    )
    if any(check[-1] == "FAIL" for check in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
