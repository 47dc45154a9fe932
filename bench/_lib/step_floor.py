"""The raw gRPC floor of stepping many worlds at once (no SDK code on the step path).

``step_floor(addresses, worlds, steps, warmup)`` does what ``scale.py``'s batch
does while it steps, with nothing else: on one ``grpc.aio`` event loop, one
channel per server (the SDK's ``create_channel``: the same credentials and
options), one bidi stream per world, each world created and joined (up to 64
opening at a time per server), then every world keeps ``IN_FLIGHT`` steps in
flight: one task per stream reads each response as undecoded bytes and writes
the same pre-serialized ``EnvironmentRequest`` (a Catch step) again at once.
The timed part is from the ``warmup``-th step per world (counted over all) to
``steps`` steps later: the process's CPU (all threads, gRPC's included) over
those steps, and each world's steps among them (their spread: how evenly the
servers answered worlds that nothing on the client holds back). Whatever the SDK spends beyond it is the SDK's own cost; whatever
the floor's cost per step grows with the worlds is gRPC's.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dm_env_rpc_client import dm_env_rpc_pb2, pack_tensor
from dm_env_rpc_client.connection import create_channel
from dm_env_rpc_client.messages import METHOD

IN_FLIGHT = 2
OPENING_PER_SERVER = 64


class GcTime:
    """CPU seconds spent in Python's garbage collector (any thread) within ``with``: the
    collecting thread's own CPU time (``time.thread_time``) from each collection's start to
    its end, so a loaded machine that preempts the process mid-collection does not inflate it
    (wall time did, up to tenfold)."""

    def __enter__(self) -> GcTime:
        self.seconds, self._started = 0.0, 0.0
        self.by_generation = [0.0, 0.0, 0.0]
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            spent = time.thread_time() - self._started
            self.seconds += spent
            self.by_generation[info["generation"]] += spent


def spreads(counts: np.ndarray, servers: int) -> dict[str, float]:
    """The most steps any world took over the fewest (``spread``), and the largest such
    ratio among the worlds of one server (``server_spread``; world ``i`` is on server
    ``i % servers``)."""

    def spread(part: np.ndarray) -> float:
        return float(part.max() / max(1, part.min()))

    return {
        "spread": spread(counts),
        "server_spread": max(
            spread(counts[first::servers]) for first in range(min(servers, len(counts)))
        ),
    }


def _request(**payload: Any) -> bytes:
    return dm_env_rpc_pb2.EnvironmentRequest(**payload).SerializeToString()


def _step_bytes(specs: Any) -> bytes:
    """A Catch step: the paddle held still, every observation requested."""
    uid = next(uid for uid, spec in specs.actions.items() if spec.name == "paddle")
    step = dm_env_rpc_pb2.StepRequest(
        actions={uid: pack_tensor(np.int8(0))},
        requested_observations=sorted(specs.observations),
    )
    return _request(step=step)


async def _step(
    addresses: Sequence[str],
    worlds: int,
    steps: int,
    warmup: int,
    threads: Callable[[], dict[str, float]] | None,
    per_connection: int | None,
) -> dict[str, Any]:
    # World i is on server i % len(addresses), on that server's connection (its position
    # among the server's worlds) // per_connection: the batch's layout (_batch.channels).
    per = per_connection or worlds
    keys = [(addresses[i % len(addresses)], i // len(addresses) // per) for i in range(worlds)]
    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection each, as the batch's channels
    channels = {
        key: create_channel(key[0], aio=True, options=own if per_connection else None)
        for key in dict.fromkeys(keys)
    }
    for channel in channels.values():
        await channel.channel_ready()
    gates = {address: asyncio.Semaphore(OPENING_PER_SERVER) for address in addresses}
    calls: list[Any] = [None] * worlds
    specs: list[Any] = [None] * worlds

    async def open_one(index: int) -> None:
        address = addresses[index % len(addresses)]
        async with gates[address]:
            call = calls[index] = channels[keys[index]].stream_stream(METHOD)()
            seed = {"seed": pack_tensor(index)}
            await call.write(
                _request(create_world=dm_env_rpc_pb2.CreateWorldRequest(settings=seed))
            )
            name = dm_env_rpc_pb2.EnvironmentResponse.FromString(await call.read())
            join = dm_env_rpc_pb2.JoinWorldRequest(world_name=name.create_world.world_name)
            await call.write(_request(join_world=join))
            joined = dm_env_rpc_pb2.EnvironmentResponse.FromString(await call.read())
            specs[index] = joined.join_world.specs

    await asyncio.gather(*(open_one(index) for index in range(worlds)))
    data = _step_bytes(specs[0])
    check = calls[0]
    await check.write(data)  # one step, decoded, so a refused request shows here
    answer = dm_env_rpc_pb2.EnvironmentResponse.FromString(await check.read())
    if answer.WhichOneof("payload") != "step":
        raise SystemExit(f"the floor's step request was refused: {answer}")

    start_at, stop_at = warmup * worlds, warmup * worlds + steps
    done = 0
    counts = np.zeros(worlds, np.int64)  # each world's steps in the timed part
    marks: list[tuple[float, float, dict[str, float]]] = []
    stop = False

    async def run(index: int, call: Any) -> None:
        nonlocal done, stop
        for _ in range(IN_FLIGHT):
            await call.write(data)
        while True:
            await call.read()
            done += 1
            if start_at < done <= stop_at:
                counts[index] += 1
            if done in (start_at, stop_at):
                marks.append(
                    (time.perf_counter(), time.process_time(), threads() if threads else {})
                )
                stop = done == stop_at
            if stop:
                break
            await call.write(data)
        for _ in range(IN_FLIGHT - 1):  # the rest in flight, so the streams end clean
            await call.read()

    with GcTime() as collecting:
        await asyncio.gather(*(run(index, call) for index, call in enumerate(calls)))
    for call in calls:
        call.cancel()
    await asyncio.gather(*(channel.close() for channel in channels.values()))
    (wall0, cpu0, before), (wall1, cpu1, after) = marks
    per_thread = {
        name: (after[name] - before.get(name, 0.0)) / steps * 1e6
        for name in after
        if after[name] > before.get(name, 0.0)
    }
    return {
        "cpu_us": (cpu1 - cpu0) / steps * 1e6,
        "steps_s": steps / (wall1 - wall0),
        "threads_us": {**per_thread, "(of which gc)": collecting.seconds / done * 1e6},
        **spreads(counts, len(addresses)),
    }


def step_floor(
    addresses: Sequence[str],
    worlds: int,
    steps: int,
    warmup: int,
    threads: Callable[[], dict[str, float]] | None = None,
    per_connection: int | None = None,
) -> dict[str, Any]:
    """Steps ``worlds`` worlds over ``addresses`` on bare ``grpc.aio`` (see the module docs);
    returns this process's CPU µs per step (``cpu_us``), steps per second (``steps_s``), the
    worlds' step counts' ``spread`` and ``server_spread`` (``spreads``) and,
    with ``threads`` (CPU seconds by thread name so far), CPU µs per step by thread.
    ``per_connection``: at most this many streams on one HTTP/2 connection, laid out as a
    batch's (``_batch.channels``); None: one connection per server."""
    return asyncio.run(_step(addresses, worlds, steps, warmup, threads, per_connection))
