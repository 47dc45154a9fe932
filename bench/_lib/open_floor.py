"""The raw gRPC floor of opening and closing many worlds (no SDK code: bare ``grpc.aio``).

``open_close_floor(addresses, worlds)`` does what ``BatchedEnvironment.connect``
and ``close`` must do, with nothing else: on one event loop, one stream per world
on one channel per server, up to 64 worlds being opened at a time per server;
each world's CreateWorldRequest (with its seed), its JoinWorldRequest once the
name is back, each as pre-built bytes, responses taken as bytes and parsed only
for the world's name; then every world's Leave and Destroy written at once,
their answers awaited, and every stream cancelled. Python's garbage collector is
off throughout (as the SDK holds it off while opening and closing: with thousands
of streams open its collections cost more than anything here), and each seed is
a Tensor made directly. Whatever the SDK spends beyond it is the SDK's own cost.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from dm_env_rpc_client import dm_env_rpc_pb2
from dm_env_rpc_client.messages import METHOD

OPENING_PER_SERVER = 64


def _request(**payload: Any) -> bytes:
    return dm_env_rpc_pb2.EnvironmentRequest(**payload).SerializeToString()


async def _open_close(
    addresses: Sequence[str], worlds: int, servers_cpu: Callable[[], float]
) -> dict[str, dict[str, float]]:
    channels = {address: grpc.aio.insecure_channel(address) for address in addresses}
    for channel in channels.values():
        await channel.channel_ready()
    gates = {address: asyncio.Semaphore(OPENING_PER_SERVER) for address in addresses}
    calls: list[Any] = [None] * worlds
    names: list[str] = [""] * worlds

    async def open_one(index: int) -> None:
        address = addresses[index % len(addresses)]
        async with gates[address]:
            call = calls[index] = channels[address].stream_stream(METHOD)()
            seed = dm_env_rpc_pb2.Tensor(int64s=dm_env_rpc_pb2.Tensor.Int64Array(array=[index]))
            settings = {"seed": seed}
            await call.write(
                _request(create_world=dm_env_rpc_pb2.CreateWorldRequest(settings=settings))
            )
            created = dm_env_rpc_pb2.EnvironmentResponse.FromString(await call.read())
            names[index] = created.create_world.world_name
            await call.write(
                _request(join_world=dm_env_rpc_pb2.JoinWorldRequest(world_name=names[index]))
            )
            await call.read()

    async def close_one(index: int) -> None:
        call = calls[index]
        await call.write(_request(leave_world=dm_env_rpc_pb2.LeaveWorldRequest()))
        await call.write(
            _request(destroy_world=dm_env_rpc_pb2.DestroyWorldRequest(world_name=names[index]))
        )
        await call.read()
        await call.read()
        call.cancel()

    def clock() -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), servers_cpu()

    def spent(since: tuple[float, float, float]) -> dict[str, float]:
        now = clock()
        return {"wall": now[0] - since[0], "cpu": now[1] - since[1], "servers": now[2] - since[2]}

    started = clock()
    await asyncio.gather(*(open_one(index) for index in range(worlds)))
    connect = spent(started)
    started = clock()
    await asyncio.gather(*(close_one(index) for index in range(worlds)))
    await asyncio.gather(*(channel.close() for channel in channels.values()))
    return {"connect": connect, "close": spent(started)}


def open_close_floor(
    addresses: Sequence[str], worlds: int, servers_cpu: Callable[[], float]
) -> dict[str, dict[str, float]]:
    """Opens ``worlds`` worlds over ``addresses`` and closes them: for each, the wall, this
    process's CPU and the servers' CPU (``servers_cpu()``, CPU seconds so far) in seconds."""
    gc.disable()
    try:
        return asyncio.run(_open_close(addresses, worlds, servers_cpu))
    finally:
        gc.enable()
