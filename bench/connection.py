"""Connection throughput: the reference send loop, this SDK (lockstep, pipelined, asyncio), raw gRPC.

Run: ``python bench/connection.py [--steps N]``. The server runs in a separate
process (Catch, and an environment with a float32[100,000] observation). For
each, one table: steps per second and client CPU µs per step (all client
threads), with ratios against the reference loop (a) and the raw floor (d).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from _common import Measurement, measure, print_table, server_process
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_rpc_pb2 as ref_pb2

from dm_env_rpc_client import connect, connect_async, dm_env_rpc_pb2
from dm_env_rpc_client.messages import METHOD

WINDOWS = (8, 32)


def _step_request(specs: Any) -> dm_env_rpc_pb2.StepRequest:
    return dm_env_rpc_pb2.StepRequest(requested_observations=sorted(specs.observations))


def reference_loop(address: str) -> Any:
    channel = grpc.insecure_channel(address)
    conn = reference_connection.Connection(channel)
    world = conn.send(ref_pb2.CreateWorldRequest()).world_name
    specs = conn.send(ref_pb2.JoinWorldRequest(world_name=world)).specs
    request = ref_pb2.StepRequest(requested_observations=sorted(specs.observations))

    def run(steps: int) -> None:
        for _ in range(steps):
            conn.send(request)

    return run, lambda: (conn.close(), channel.close())


def _ours(address: str) -> tuple[Any, dm_env_rpc_pb2.StepRequest]:
    conn = connect(address, timeout=30)
    world = conn.send(dm_env_rpc_pb2.CreateWorldRequest()).world_name
    specs = conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world)).specs
    return conn, _step_request(specs)


def ours_loop(address: str) -> Any:
    conn, request = _ours(address)

    def run(steps: int) -> None:
        for _ in range(steps):
            conn.send(request)

    return run, conn.close


def ours_pipelined(address: str, window: int) -> Any:
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


def ours_asyncio(address: str, window: int) -> Any:
    loop = _LOOP

    async def setup() -> Any:
        conn = await connect_async(address, timeout=30)
        world = (await conn.send(dm_env_rpc_pb2.CreateWorldRequest())).world_name
        specs = (await conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world))).specs
        return conn, _step_request(specs)

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


def raw_floor(address: str, window: int) -> Any:
    """Pre-serialized requests and undecoded responses over a bare gRPC stream."""
    channel = grpc.insecure_channel(address)
    outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()
    call = channel.stream_stream(METHOD)(iter(outgoing.get, None))
    responses: Iterator[bytes] = iter(call)

    def send(message: Any) -> Any:
        outgoing.put(dm_env_rpc_pb2.EnvironmentRequest(**message).SerializeToString())
        return dm_env_rpc_pb2.EnvironmentResponse.FromString(next(responses))

    world = send({"create_world": dm_env_rpc_pb2.CreateWorldRequest()}).create_world.world_name
    specs = send({"join_world": dm_env_rpc_pb2.JoinWorldRequest(world_name=world)}).join_world.specs
    data = dm_env_rpc_pb2.EnvironmentRequest(step=_step_request(specs)).SerializeToString()

    def run(steps: int) -> None:
        slots = threading.Semaphore(window)
        done = threading.Event()

        def reader() -> None:
            for _ in range(steps):
                next(responses)
                slots.release()
            done.set()

        thread = threading.Thread(target=reader)
        thread.start()
        for _ in range(steps):
            slots.acquire()
            outgoing.put(data)
        done.wait()
        thread.join()

    def close() -> None:
        outgoing.put(None)
        call.cancel()
        channel.close()

    return run, close


def bench(address: str, steps: int) -> list[list[Any]]:
    results: dict[str, Measurement] = {}

    def record(name: str, factory: Any) -> None:
        run, close = factory
        run(min(steps, 200))  # warm up
        results[name] = measure(run, steps)
        close()

    record("(a) reference send loop", reference_loop(address))
    record("(b) SDK send loop", ours_loop(address))
    record("(d) raw floor, lockstep", raw_floor(address, 1))
    for window in WINDOWS:
        record(f"(c) SDK pipelined sync, {window}", ours_pipelined(address, window))
        record(f"(c) SDK pipelined asyncio, {window}", ours_asyncio(address, window))
        record(f"(d) raw floor, {window}", raw_floor(address, window))
    reference = results["(a) reference send loop"]
    rows = []
    for name, m in results.items():
        window = name.rsplit(", ", 1)[-1]
        floor = results.get(f"(d) raw floor, {window}") if window.isdigit() else None
        if name.startswith("(b)"):
            floor = results["(d) raw floor, lockstep"]
        rows.append(
            [
                name,
                m.steps_per_second,
                m.cpu_us_per_step,
                f"{m.steps_per_second / reference.steps_per_second:.2f}x",
                f"{m.steps_per_second / floor.steps_per_second:.0%}" if floor else "",
                f"{m.cpu_us_per_step / floor.cpu_us_per_step:.2f}x" if floor else "",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    header = ["client", "steps/s", "CPU µs/step", "vs (a)", "vs floor steps/s", "CPU vs floor"]
    with server_process("--env", "catch") as address:
        print_table("Catch (board float32[10, 5])", header, bench(address, args.steps))
    with server_process("--env", "large", "--size", "100000") as address:
        print_table(
            "float32[100,000] observation", header, bench(address, max(100, args.steps // 10))
        )


if __name__ == "__main__":
    main()
