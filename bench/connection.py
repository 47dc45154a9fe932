"""Connection throughput: the reference send loop, this SDK (lockstep, pipelined, asyncio), raw gRPC.

Run: ``python bench/connection.py [--steps N] [--rounds R]``. Two servers, each in
a process of its own: the SDK's event-loop server, and a foreign one written on
the reference package with a sync gRPC handler (``_lib/foreign_server.py``), as most
servers in the wild are; each serves Catch, and an environment with a
float32[100,000] observation. In each of R rounds, in a seeded shuffled order, every client is set up,
warmed up, timed and closed (only the one being timed is connected). For each environment,
one table, both servers in it: steps per second, client CPU µs per step (all client threads) and
server CPU µs per step (the server process, from /proc), each the median over
the rounds, and ratios against the reference loop (a) and against the raw floor
(d) at the same window (the lockstep floor for (b)), each the median of the
per-round ratios, so drift between rounds cancels (and the lowest and highest
per-round ratio against the floor).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
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
from _lib.floors import raw_floor, step_request
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_rpc_pb2 as ref_pb2

from dm_env_rpc_client import connect, connect_async, dm_env_rpc_pb2

WINDOWS = (8, 16, 32)


def reference_loop(address: str) -> Variant:
    channel = grpc.insecure_channel(address)
    conn = reference_connection.Connection(channel)
    world = conn.send(ref_pb2.CreateWorldRequest()).world_name
    specs = conn.send(ref_pb2.JoinWorldRequest(world_name=world)).specs
    request = ref_pb2.StepRequest(requested_observations=sorted(specs.observations))

    def run(steps: int) -> None:
        for _ in range(steps):
            conn.send(request)

    def close() -> None:
        conn.close()
        channel.close()

    return run, close


def _ours(address: str) -> tuple[Any, dm_env_rpc_pb2.StepRequest]:
    conn = connect(address, timeout=30)
    world = conn.send(dm_env_rpc_pb2.CreateWorldRequest()).world_name
    specs = conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world)).specs
    return conn, step_request(specs)


def ours_loop(address: str) -> Variant:
    conn, request = _ours(address)

    def run(steps: int) -> None:
        for _ in range(steps):
            conn.send(request)

    return run, conn.close


def ours_pipelined(address: str, window: int) -> Variant:
    conn, request = _ours(address)

    def run(steps: int) -> None:
        pending: collections.deque[Any] = collections.deque()
        for _ in range(steps):
            if len(pending) >= window:
                pending.popleft().result()
            pending.append(conn.send_async(request))
        for future in pending:
            future.result()

    return run, conn.close


_LOOP = asyncio.new_event_loop()  # one loop for every asyncio run: grpc.aio binds to it


def ours_asyncio(address: str, window: int) -> Variant:
    loop = _LOOP

    async def setup() -> Any:
        conn = await connect_async(address, timeout=30)
        world = (await conn.send(dm_env_rpc_pb2.CreateWorldRequest())).world_name
        specs = (await conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world))).specs
        return conn, step_request(specs)

    conn, request = loop.run_until_complete(setup())

    async def steps_async(steps: int) -> None:
        pending: collections.deque[Any] = collections.deque()
        for _ in range(steps):
            if len(pending) >= window:
                await pending.popleft()
            pending.append(asyncio.ensure_future(conn.send(request)))
        await asyncio.gather(*pending)

    def close() -> None:
        loop.run_until_complete(conn.aclose())

    return (lambda steps: loop.run_until_complete(steps_async(steps))), close


def bench(server: ServerInfo, steps: int, rounds: int, windows: tuple[int, ...]) -> list[list[Any]]:
    address = server.address
    variants: dict[str, VariantFactory] = {
        "(a) reference send loop": functools.partial(reference_loop, address),
        "(b) SDK send loop": functools.partial(ours_loop, address),
        "(d) raw floor, lockstep": functools.partial(raw_floor, address, 1),
    }
    for window in windows:
        variants[f"(c) SDK pipelined sync, {window}"] = functools.partial(
            ours_pipelined, address, window
        )
        variants[f"(c) SDK pipelined asyncio, {window}"] = functools.partial(
            ours_asyncio, address, window
        )
        variants[f"(d) raw floor, {window}"] = functools.partial(raw_floor, address, window)
    results = measure_interleaved(variants, steps, rounds=rounds, server_pid=server.pid)
    reference = "(a) reference send loop"
    rows = []
    for name in results.names:
        suffix = name.rsplit(", ", 1)[-1]
        floor = f"(d) raw floor, {suffix}" if suffix.isdigit() else None
        if name.startswith("(b)"):
            floor = "(d) raw floor, lockstep"
        rows.append(
            [
                name,
                results.median(name, "steps_per_second"),
                results.median(name, "cpu_us_per_step"),
                results.median(name, "server_cpu_us_per_step"),
                f"{results.ratio(name, reference):.2f}x",
                f"{results.ratio(name, floor):.0%}" if floor else "",
                f"{results.ratio(name, floor, 'cpu_us_per_step'):.2f}x" if floor else "",
                _spread(results, name, floor) if floor else "",
            ]
        )
    return rows


def _spread(results: Any, name: str, floor: str) -> str:
    """The lowest and highest per-round steps/s ratio against the floor."""
    ratios = [
        sample.steps_per_second / base.steps_per_second
        for sample, base in zip(results.samples[name], results.samples[floor], strict=True)
    ]
    return f"{min(ratios):.0%} to {max(ratios):.0%}"


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
        "client",
        "steps/s",
        "client CPU µs/step",
        "server CPU µs/step",
        "vs (a)",
        "vs floor steps/s",
        "CPU vs floor",
        "vs floor, rounds' range",
    ]
    large_steps = max(100, args.steps // 10)
    windows = tuple(args.windows)
    for title, env, extra, steps in (
        ("Catch (board float32[10, 5])", "catch", (), args.steps),
        ("float32[100,000] observation", "large", ("--size", "100000"), large_steps),
    ):
        rows = []
        for name in args.servers:
            with any_server_process_info(name, env, *extra) as server:
                rows += [
                    [SERVERS[name], *row] for row in bench(server, steps, args.rounds, windows)
                ]
        print_table(title, header, rows)
    print(
        f"\nMedians over {args.rounds} interleaved rounds; steps per variant per round: "
        f"{args.steps:,} (Catch), {large_steps:,} (float32[100,000])."
    )
    print(pinned)


if __name__ == "__main__":
    main()
