"""Aggregate random-action steps per second over 1, 4 and 16 Catch worlds.

Run: ``python bench/batched.py [--steps N] [--rounds R]``. Two server processes
hold the worlds (round-robin), first two of the SDK's event-loop server, then
two of a foreign one written on the reference package with a sync gRPC handler
(``_lib/foreign_server.py``). This SDK's ``BatchedEnvironment`` (pipelined
send/recv, 8 steps in flight per world) against a loop over the reference
``DmEnvAdaptor`` (one step per world in turn) and against a raw multi-stream
floor: the same number of bare gRPC streams, one HTTP/2 channel per server
address, on one asyncio event loop (as the batch runs its streams), writing one
pre-serialized step request and taking undecoded responses, 8 in flight per
stream. They are interleaved in rounds: in each round, in a seeded shuffled
order, each client is set up, warmed up, timed and closed. Steps/s, client CPU
and server CPU (both server processes) are medians over the rounds; the ratios
are medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    DEFAULT_ROUNDS,
    SERVERS,
    add_pin_argument,
    apply_pin,
    measure_interleaved,
    print_table,
    server_processes,
)

# isort: split
import grpc
import numpy as np
from _lib.floors import step_request
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

from dm_env_rpc_client import dm_env_rpc_pb2
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.messages import METHOD

WORLDS = (1, 4, 16)
WINDOW = 8
REFERENCE = "reference loop"
OURS = f"SDK batched, {WINDOW} in flight/world"
FLOOR = f"raw multi-stream floor, {WINDOW} in flight/stream"


def reference_loop(addresses: list[str], count: int) -> Any:
    channels, conns, envs = [], [], []
    for index in range(count):
        channel = grpc.insecure_channel(addresses[index % len(addresses)])
        conn = reference_connection.Connection(channel)
        env, _ = reference_adaptor.create_and_join_world(conn, {}, {})
        env.reset()
        channels.append(channel)
        conns.append(conn)
        envs.append(env)
    rng = np.random.default_rng(0)

    def run(steps: int) -> None:
        for _ in range(steps // count):
            for env in envs:
                env.step({"paddle": np.int8(rng.integers(-1, 2))})

    def close() -> None:
        for env, conn, channel in zip(envs, conns, channels, strict=True):
            env.close()
            conn.close()
            channel.close()

    return run, close


def ours(addresses: list[str], count: int, **connect_kwargs: Any) -> Any:
    batch = BatchedEnvironment.connect(addresses, count, **connect_kwargs)
    batch.reset()
    dtype = batch.action_spec()["paddle"].dtype
    rng = np.random.default_rng(0)

    def run(steps: int) -> None:
        sent = received = 0
        while received < steps:
            while sent < steps:  # top every world up to WINDOW steps in flight
                ids = [w for w in range(count) if batch.in_flight(w) < WINDOW][: steps - sent]
                if not ids:
                    break
                batch.send({"paddle": rng.integers(-1, 2, len(ids)).astype(dtype)}, ids)
                sent += len(ids)
            wanted = min(max(1, count // 2), sent - received)
            received += len(batch.recv(wanted, timeout=30).env_ids)

    return run, batch.close


_LOOP = asyncio.new_event_loop()  # one loop for every floor run: grpc.aio binds to it


def raw_multi_stream_floor(addresses: list[str], count: int) -> Any:
    """``count`` bare streams on one event loop, round-robin over one channel per address."""
    loop = _LOOP
    Request, Response = dm_env_rpc_pb2.EnvironmentRequest, dm_env_rpc_pb2.EnvironmentResponse

    async def open_streams() -> tuple[list[Any], list[Any], bytes]:
        channels = [grpc.aio.insecure_channel(address) for address in addresses]
        calls = [channels[i % len(channels)].stream_stream(METHOD)() for i in range(count)]
        data = b""
        for call in calls:
            await call.write(
                Request(create_world=dm_env_rpc_pb2.CreateWorldRequest()).SerializeToString()
            )
            world = Response.FromString(await call.read()).create_world.world_name
            join = dm_env_rpc_pb2.JoinWorldRequest(world_name=world)
            await call.write(Request(join_world=join).SerializeToString())
            specs = Response.FromString(await call.read()).join_world.specs
            request = step_request(specs)
            paddle = dm_env_rpc_pb2.Tensor(int8s=dm_env_rpc_pb2.Tensor.Int8Array(array=b"\x01"))
            request.actions[min(specs.actions)].CopyFrom(paddle)
            data = Request(step=request).SerializeToString()
        return channels, calls, data

    channels, calls, data = loop.run_until_complete(open_streams())

    async def stream(call: Any, steps: int) -> None:
        for _ in range(min(WINDOW, steps)):
            await call.write(data)
        for received in range(steps):
            await call.read()  # undecoded bytes
            if received + WINDOW < steps:
                await call.write(data)

    def run(steps: int) -> None:
        share = [steps // count + (i < steps % count) for i in range(count)]

        async def all_streams() -> None:
            await asyncio.gather(*(stream(call, n) for call, n in zip(calls, share, strict=True)))

        loop.run_until_complete(all_streams())

    def close() -> None:
        async def shut() -> None:
            for call in calls:
                call.cancel()
            for channel in channels:
                await channel.close()

        async def end_leftovers() -> None:
            # gRPC's call-status tasks of the cancelled calls, ended from inside the loop
            # (a gather made outside it may pick another loop).
            current = asyncio.current_task()
            leftover = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
            for task in leftover:
                task.cancel()
            await asyncio.gather(*leftover, return_exceptions=True)

        loop.run_until_complete(shut())
        loop.run_until_complete(end_leftovers())

    return run, close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3200)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    add_pin_argument(parser)
    args = parser.parse_args()
    pinned = apply_pin(args.pin)
    rows = []
    for server_name in args.servers:
        with server_processes(server_name) as servers:
            addresses = [server.address for server in servers]
            for count in args.worlds:
                results = measure_interleaved(
                    {
                        REFERENCE: lambda count=count, addresses=addresses: reference_loop(
                            addresses, count
                        ),
                        OURS: lambda count=count, addresses=addresses: ours(addresses, count),
                        FLOOR: lambda count=count, addresses=addresses: raw_multi_stream_floor(
                            addresses, count
                        ),
                    },
                    args.steps,
                    rounds=args.rounds,
                    server_pid=[server.pid for server in servers],
                )
                for name in (REFERENCE, OURS, FLOOR):
                    rows.append(
                        [
                            SERVERS[server_name],
                            count,
                            name,
                            results.median(name),
                            results.median(name, "cpu_us_per_step"),
                            results.median(name, "server_cpu_us_per_step"),
                            f"{results.ratio(name, REFERENCE):.2f}x",
                            f"{results.ratio(name, FLOOR):.0%}",
                            f"{results.ratio(name, FLOOR, 'cpu_us_per_step'):.2f}x",
                        ]
                    )
    print_table(
        "Aggregate steps/s, Catch, 2 server processes",
        [
            "servers",
            "worlds",
            "client",
            "steps/s",
            "client CPU µs/step",
            "server CPU µs/step",
            "vs reference loop",
            "vs floor steps/s",
            "CPU vs floor",
        ],
        rows,
    )
    print(f"\nMedians over {args.rounds} interleaved rounds of {args.steps:,} steps per client.")
    print(pinned)


if __name__ == "__main__":
    main()
