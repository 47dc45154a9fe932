"""The pipelined AsyncConnection, against the embedded server."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import threading
import time
from typing import Any

import grpc
import pytest
from conftest import sigstop, wait_for

from dm_env_rpc_client import errors, messages, tensors
from dm_env_rpc_client._fastpath.wire_step import read_step
from dm_env_rpc_client._proto import dm_env_rpc_pb2, properties_pb2
from dm_env_rpc_client.aio import AsyncConnection, connect_async
from dm_env_rpc_client.server import Server

State = dm_env_rpc_pb2.EnvironmentStateType


async def _join(conn: AsyncConnection, **settings: Any) -> Any:
    create = dm_env_rpc_pb2.CreateWorldRequest(
        settings={k: tensors.pack_tensor(v) for k, v in settings.items()}
    )
    world = (await conn.send(create, timeout=10)).world_name
    return (await conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world), timeout=10)).specs


def _subsets(uids: list[int]) -> list[list[int]]:
    return [[uid for bit, uid in enumerate(uids) if mask >> bit & 1] for mask in range(8)]


def test_hundred_tasks_pipelined_each_get_their_own(catch_server: Server) -> None:
    async def main() -> None:
        async with await connect_async(catch_server.address, timeout=10) as conn:
            specs = await _join(conn, rows=4)
            subsets = _subsets(sorted(specs.observations))

            async def task(k: int) -> None:
                request = dm_env_rpc_pb2.StepRequest(requested_observations=subsets[k % 8])
                for _ in range(20):
                    response = await conn.send(request, timeout=30)
                    assert sorted(response.observations) == subsets[k % 8]

            await asyncio.gather(*(task(k) for k in range(100)))
            # Order: one task's 2,000 sends without awaiting in between.
            sends = [
                asyncio.ensure_future(
                    conn.send(dm_env_rpc_pb2.StepRequest(requested_observations=subsets[i % 8]))
                )
                for i in range(2000)
            ]
            for index, response in enumerate(await asyncio.gather(*sends)):
                assert sorted(response.observations) == subsets[index % 8]

    asyncio.run(main())


def test_error_mid_pipeline_and_extensions(catch_server: Server) -> None:
    async def main() -> None:
        async with await connect_async(catch_server.address, timeout=10) as conn:
            await _join(conn, rows=100)
            requests = [dm_env_rpc_pb2.StepRequest() for _ in range(30)]
            requests[10] = dm_env_rpc_pb2.StepRequest(requested_observations=[999])
            results = await asyncio.gather(
                *(conn.send(r, timeout=10) for r in requests), return_exceptions=True
            )
            assert isinstance(results[10], errors.InvalidArgumentError)
            assert all(r.state == State.RUNNING for i, r in enumerate(results) if i != 10)
            request = properties_pb2.PropertyRequest(
                read_property=properties_pb2.ReadPropertyRequest(key="columns")
            )
            response = await conn.send(
                request, timeout=10, response_type=properties_pb2.PropertyResponse
            )
            assert tensors.unpack_tensor(response.read_property.value) == 5

    asyncio.run(main())


def test_killed_server_fails_pending_promptly(server_process) -> None:
    server = server_process()

    async def main() -> None:
        conn = await connect_async(server.address, timeout=20)
        await _join(conn)
        sigstop(server.process)
        sends = [asyncio.ensure_future(conn.send(dm_env_rpc_pb2.StepRequest())) for _ in range(100)]
        await asyncio.sleep(0)  # let the sends enqueue
        started = time.monotonic()
        server.kill()
        results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 5)
        assert time.monotonic() - started < 5
        assert all(isinstance(r, errors.ConnectionClosedError) for r in results)
        assert results[0].code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
        with pytest.raises(errors.ConnectionClosedError):
            await conn.send(dm_env_rpc_pb2.StepRequest(), timeout=5)
        await conn.aclose()

    asyncio.run(main())


def test_close_pending_timeouts_backpressure_and_no_threads_left(server_process) -> None:
    server = server_process()

    async def main() -> None:
        conn = await connect_async(server.address, timeout=20, max_in_flight=4)
        await _join(conn)
        sigstop(server.process)
        try:
            with pytest.raises(errors.RequestTimeoutError, match="StepRequest"):
                await conn.send(dm_env_rpc_pb2.StepRequest(), timeout=0.2)
            pending = [
                asyncio.ensure_future(conn.send(dm_env_rpc_pb2.StepRequest())) for _ in range(3)
            ]
            for _ in range(1000):  # let the three take their slots (a few loop turns)
                if conn._slots is not None and conn._slots.locked():
                    break
                await asyncio.sleep(0)
            with pytest.raises(errors.RequestTimeoutError, match="4 requests in flight"):
                await conn.send(dm_env_rpc_pb2.StepRequest(), timeout=0.2)
            started = time.monotonic()
            await conn.aclose()
            await conn.aclose()
            # aclose() cancels its tasks and closes the channel without waiting on the server:
            # a bound of 15 s fails on a hang, not on a loaded machine.
            assert time.monotonic() - started < 15
            results = await asyncio.gather(*pending, return_exceptions=True)
            assert all(isinstance(r, errors.ConnectionClosedError) for r in results)
            with pytest.raises(errors.ConnectionClosedError, match="closed"):
                await conn.send(dm_env_rpc_pb2.StepRequest(), timeout=1)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)

    before = set(threading.enumerate())
    asyncio.run(main())
    assert wait_for(lambda: set(threading.enumerate()) <= before, timeout=10)


def test_connect_timeout_and_constructor() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(errors.ConnectTimeoutError, match=address):
        asyncio.run(connect_async(address, timeout=0.5, wait_for_ready=True))
    with pytest.raises(errors.ConnectRefusedError, match=address):
        asyncio.run(connect_async(address, timeout=60))  # at once, not in 60 s
    with pytest.raises(TypeError, match="connect_async"):
        AsyncConnection()


def test_works_inside_a_running_loop_with_sync_calls_too(catch_server: Server) -> None:
    from dm_env_rpc_client.connection import connect

    async def main() -> None:
        # As in Jupyter: a loop is running, and sync and async connections are both used.
        with connect(catch_server.address, timeout=10) as sync_conn:
            world = sync_conn.send(dm_env_rpc_pb2.CreateWorldRequest(), timeout=10).world_name
            async with await connect_async(catch_server.address, timeout=10) as conn:
                request = dm_env_rpc_pb2.JoinWorldRequest(world_name=world)
                specs = (await conn.send(request, timeout=10)).specs
                assert len(specs.actions) == 1

    asyncio.run(main())


def test_submit_callback_takes_responses_in_order_and_survives_a_failing_callback(
    catch_server: Server,
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        reported: list[Any] = []
        loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
        async with await connect_async(catch_server.address, timeout=10) as conn:
            await _join(conn, rows=4)
            data = messages.envelope(dm_env_rpc_pb2.StepRequest())[0]
            got: list[tuple[int, Any, BaseException | None]] = []
            done = asyncio.Event()

            def callback(k: int, result: Any, error: BaseException | None) -> None:
                got.append((k, result, error))
                if k == 4:
                    done.set()
                if k == 1:
                    raise RuntimeError("a callback's own bug")

            for k in range(5):
                conn._submit_callback(data, read_step, functools.partial(callback, k))
            await asyncio.wait_for(done.wait(), 10)
            assert [k for k, _, _ in got] == [0, 1, 2, 3, 4]  # the reader went on after 1
            # Catch of 4 rows: the ball lands on the third step of a sequence.
            states = [State.RUNNING] * 3 + [State.TERMINATED, State.RUNNING]
            assert [(result.state, error) for _, result, error in got] == [
                (state, None) for state in states
            ]
            assert [str(exc) for exc in reported] == ["a callback's own bug"]
            assert (await conn.send(dm_env_rpc_pb2.StepRequest(), timeout=10)).state
        closed: list[BaseException | None] = []
        conn._submit_callback(data, read_step, lambda _, error: closed.append(error))
        assert closed == []  # never from within the call
        await asyncio.sleep(0)
        assert len(closed) == 1 and isinstance(closed[0], errors.ConnectionClosedError)

    asyncio.run(main())
