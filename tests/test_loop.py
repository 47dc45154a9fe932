"""LoopThread and LoopConnection: a sync connection whose stream lives on a background loop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import assert_killing_fails_pending, run_child, sigstop

from dm_env_rpc_client import errors
from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client._transport.loop import LoopConnection, LoopThread
from dm_env_rpc_client.environment import create_and_join_world
from dm_env_rpc_client.server import Server

State = dm_env_rpc_pb2.EnvironmentStateType


@pytest.fixture
def runner() -> Iterator[LoopThread]:
    loop_thread = LoopThread(name="test-loop")
    yield loop_thread
    loop_thread.close()


def _open(runner: LoopThread, address: str) -> LoopConnection:
    return runner.run(LoopConnection.open(runner, address, timeout=20), timeout=30)


def _join(conn: LoopConnection) -> None:
    world = conn.send(dm_env_rpc_pb2.CreateWorldRequest(), timeout=10).world_name
    conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world), timeout=10)


def test_pipelined_requests_in_order_and_errors_per_request(
    runner: LoopThread, catch_server: Server
) -> None:
    with _open(runner, catch_server.address) as conn:
        _join(conn)
        requests = [dm_env_rpc_pb2.StepRequest(requested_observations=[1]) for _ in range(2000)]
        requests[1000] = dm_env_rpc_pb2.StepRequest(requested_observations=[999])
        futures = [conn.send_async(request) for request in requests]
        # 10 rows: a sequence is 10 steps; the failed request does not move the world.
        pattern = [State.RUNNING] * 9 + [State.TERMINATED]
        seen = 0
        for index, future in enumerate(futures):
            if index == 1000:
                error = future.exception(timeout=30)
                assert isinstance(error, errors.InvalidArgumentError)
                assert "observation UID 999" in str(error)
                continue
            assert future.result(timeout=30).state == pattern[seen % 10], index
            seen += 1


def test_many_threads_share_one_loop_connection(runner: LoopThread, catch_server: Server) -> None:
    with _open(runner, catch_server.address) as conn:
        _join(conn)
        failures: list[str] = []

        def worker(uid: int) -> None:
            request = dm_env_rpc_pb2.StepRequest(requested_observations=[uid])
            futures = [conn.send_async(request) for _ in range(300)]
            for future in futures:
                if list(future.result(timeout=60).observations) != [uid]:
                    failures.append(f"thread {uid} got another thread's response")

        threads = [threading.Thread(target=worker, args=(uid,)) for uid in (1, 2, 3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert failures == []


def test_a_killed_server_fails_pending_requests_promptly(
    runner: LoopThread, server_process
) -> None:
    server = server_process()
    conn = _open(runner, server.address)
    _join(conn)
    sigstop(server.process)  # hold the requests in flight
    futures = [conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(50)]
    with pytest.raises(errors.RequestTimeoutError, match="StepRequest request within 0.2 s"):
        conn.send(dm_env_rpc_pb2.StepRequest(), timeout=0.2)
    assert not any(future.done() for future in futures)
    assert_killing_fails_pending(server, conn, futures)
    conn.close()
    conn.close()  # idempotent


def test_close_fails_pending_and_later_sends(runner: LoopThread, server_process) -> None:
    server = server_process()
    conn = _open(runner, server.address)
    _join(conn)
    sigstop(server.process)
    try:
        futures = [conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(5)]
        started = time.monotonic()
        conn.close()
        assert time.monotonic() - started < 5
        for future in futures:
            assert isinstance(future.exception(timeout=5), errors.ConnectionClosedError)
        error = conn.send_async(dm_env_rpc_pb2.StepRequest()).exception(timeout=5)
        assert isinstance(error, errors.ConnectionClosedError)
        assert "closed" in str(error)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def test_adaptor_over_a_loop_connection(runner: LoopThread, catch_server: Server) -> None:
    with _open(runner, catch_server.address) as conn:
        env, _ = create_and_join_world(conn, {"rows": 3, "seed": 2}, {}, timeout=10)
        first = env.reset()
        assert first.first() and first.observation["board"].shape == (3, 5)
        steps = list(env.step_iter([{"paddle": np.int8(0)}] * 6, in_flight=4))
        assert [int(t.step_type) for t in steps] == [1, 2, 0, 1, 2, 0]
        env.close()


def test_unreachable_server_times_out_naming_the_address(runner: LoopThread) -> None:
    with pytest.raises(errors.ConnectTimeoutError, match="127.0.0.1:1 within 0.3 s"):
        runner.run(LoopConnection.open(runner, "127.0.0.1:1", timeout=0.3), timeout=10)


def test_loop_thread_run_timeout_and_close() -> None:
    loop_thread = LoopThread(name="test-loop-close")
    assert loop_thread.run(asyncio.sleep(0, result=7), timeout=5) == 7
    with pytest.raises(errors.RequestTimeoutError, match="within 0.1 s"):
        loop_thread.run(asyncio.sleep(30), timeout=0.1)
    loop_thread.close()
    loop_thread.close()  # idempotent
    assert not any(t.name == "test-loop-close" for t in threading.enumerate())
    with pytest.raises(errors.ConnectionClosedError, match="event loop is closed"):
        loop_thread.call(print)
    with pytest.raises(errors.ConnectionClosedError, match="event loop is closed"):
        loop_thread.run(asyncio.sleep(0))


def test_close_leaves_no_pending_grpc_task(
    catch_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    import gc

    for _ in range(10):  # the leftover task only sometimes outlives the close
        runner = LoopThread()
        conn = _open(runner, catch_server.address)
        _join(conn)
        conn.close()
        runner.close()
        gc.collect()  # a task still pending when its loop stopped is reported as it is freed
    destroyed = [r for r in caplog.records if "Task was destroyed" in r.getMessage()]
    assert not destroyed


_CLOSE_WITH_STEPS_IN_FLIGHT = """
import sys
import numpy as np
import dm_env_rpc_client as dmr
from dm_env_rpc_client.random_actions import random_action
from dm_env_rpc_client.server._subprocess import server_subprocess

with server_subprocess("catch") as server:
    for _ in range(int(sys.argv[1])):
        batch = dmr.BatchedEnvironment.connect(server.address, 16, timeout=30)
        rng = np.random.default_rng(0)
        batch.reset()
        for _ in range(8):
            batch.send([random_action(batch.action_spec(), rng) for _ in range(16)], range(16))
        batch.close()  # steps in flight: gRPC completes their calls as the streams close
"""


def test_closing_a_batch_with_steps_in_flight_prints_nothing() -> None:
    # gRPC shuts its asyncio poller down when its last channel is freed, from that thread:
    # freed on the main thread while the batch's loop still ran, the loop sometimes read the
    # poller's closed socket ("Exception in callback PollerCompletionQueue._handle_events ...
    # OSError: [Errno 9] Bad file descriptor"; 18 of 30 closes before the fix). The loop now
    # holds a channel of its own until it has stopped.
    done = run_child([sys.executable, "-c", _CLOSE_WITH_STEPS_IN_FLIGHT, "8"], timeout=100)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr


# A program that never calls close(), with steps in flight when it ends. "threads": a batch
# (its loop in a daemon thread) and a sync step_iter; "asyncio": twice asyncio.run of an
# AsyncConnection's world, left with an async step_iter and steps in flight.
_EXIT_WITHOUT_CLOSE = """
import asyncio, itertools, sys
import numpy as np
import dm_env_rpc_client as dmr

address, variant = sys.argv[1:]
keep = []
if variant == "threads":
    batch = dmr.BatchedEnvironment.connect([address], 8, timeout=20)
    batch.reset()
    for _ in range(4):
        batch.send({"paddle": np.zeros(8, np.int8)}, list(range(8)))
    env, _ = dmr.create_and_join_world(dmr.connect(address, timeout=20), {}, {})
    env.reset()
    steps = env.step_iter(itertools.repeat({"paddle": 0}), in_flight=16)
    next(steps)
    keep += [batch, env, steps]
else:
    async def main():
        env, _ = await dmr.create_and_join_world_async(address, {}, {})
        await env.reset()
        steps = env.step_iter(itertools.repeat({"paddle": 0}), in_flight=16)
        await steps.__anext__()
        keep.extend(asyncio.ensure_future(env.step({"paddle": 0})) for _ in range(8))
        keep.extend([env, steps])
    asyncio.run(main())
    asyncio.run(main())
"""


def test_a_program_that_exits_without_close_with_steps_in_flight_prints_nothing(
    server_process,
) -> None:
    # asyncio.run cancels the AsyncConnection's reader as it ends: the pending steps were
    # then never failed, and the async step_iter's clean-up (run by asyncio.run) waited for
    # them forever: the program hung at its end. Six runs of each, two at a time.
    address = server_process().address
    for _ in range(6):
        pair = [
            subprocess.Popen(
                [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, address, variant],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for variant in ("threads", "asyncio")
        ]
        try:
            for process in pair:
                try:
                    _, err = process.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{process.args[-1]}: the program did not end within 30 s")
                assert (process.returncode, err) == (0, ""), process.args[-1]
        finally:
            for process in pair:
                process.kill()
                process.wait()
