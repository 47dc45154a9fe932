"""The pipelined sync Connection, against the embedded server (in-process and in a subprocess)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import trustme
from conftest import assert_killing_fails_pending, run_child, sigstop, wait_for
from google.protobuf import any_pb2

from dm_env_rpc_client import errors, tensors
from dm_env_rpc_client._proto import dm_env_rpc_pb2, properties_pb2
from dm_env_rpc_client.aio import connect_async
from dm_env_rpc_client.connection import Connection, connect
from dm_env_rpc_client.environment import create_and_join_world
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch

State = dm_env_rpc_pb2.EnvironmentStateType


def _join(conn: Any, **settings: Any) -> Any:
    create = dm_env_rpc_pb2.CreateWorldRequest(
        settings={k: tensors.pack_tensor(v) for k, v in settings.items()}
    )
    world = conn.send(create, timeout=10).world_name
    return conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world), timeout=10).specs


@pytest.fixture
def conn(catch_server: Server) -> Iterator[Connection]:
    with connect(catch_server.address, timeout=10) as connection:
        yield connection


def _subsets(uids: list[int]) -> list[list[int]]:
    return [[uid for bit, uid in enumerate(uids) if mask >> bit & 1] for mask in range(8)]


def test_ten_thousand_pipelined_steps_arrive_in_order(conn: Connection) -> None:
    specs = _join(conn, rows=4, seed=3)
    subsets = _subsets(sorted(specs.observations))
    futures = [
        conn.send_async(dm_env_rpc_pb2.StepRequest(requested_observations=subsets[i % 8]))
        for i in range(10_000)
    ]
    pattern = [State.RUNNING, State.RUNNING, State.RUNNING, State.TERMINATED]
    for index, future in enumerate(futures):
        response = future.result(timeout=60)
        assert sorted(response.observations) == subsets[index % 8], index
        assert response.state == pattern[index % 4], index


def test_eight_threads_each_get_their_own_responses(conn: Connection) -> None:
    specs = _join(conn, rows=6)
    subsets = _subsets(sorted(specs.observations))
    failures: list[str] = []

    def worker(k: int) -> None:
        request = dm_env_rpc_pb2.StepRequest(requested_observations=subsets[k])
        futures = [conn.send_async(request) for _ in range(1000)]
        for future in futures:
            if sorted(future.result(timeout=60).observations) != subsets[k]:
                failures.append(f"thread {k} got another thread's response")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []


def test_an_error_mid_pipeline_fails_only_its_request(conn: Connection) -> None:
    _join(conn, rows=100)
    requests = [dm_env_rpc_pb2.StepRequest() for _ in range(50)]
    requests[25] = dm_env_rpc_pb2.StepRequest(requested_observations=[999])
    futures = [conn.send_async(request) for request in requests]
    for index, future in enumerate(futures):
        if index == 25:
            error = future.exception(timeout=10)
            assert isinstance(error, errors.InvalidArgumentError)
            assert "observation UID 999" in str(error)
        else:
            assert future.result(timeout=10).state == State.RUNNING
    assert conn.send(dm_env_rpc_pb2.StepRequest(), timeout=10).state == State.RUNNING


def test_extension_responses_as_any_or_unpacked(conn: Connection) -> None:
    _join(conn)
    request = properties_pb2.PropertyRequest(
        read_property=properties_pb2.ReadPropertyRequest(key="rows")
    )
    raw = conn.send(request, timeout=10)
    assert isinstance(raw, any_pb2.Any)
    unpacked = conn.send(request, timeout=10, response_type=properties_pb2.PropertyResponse)
    assert tensors.unpack_tensor(unpacked.read_property.value) == 10
    with pytest.raises(errors.ProtocolError, match="ListPropertyResponse"):
        conn.send(request, timeout=10, response_type=properties_pb2.ListPropertyResponse)


def test_killing_the_server_fails_pending_requests_promptly(server_process) -> None:
    server = server_process()
    with connect(server.address, timeout=20) as conn:
        _join(conn)
        sigstop(server.process)  # hold the requests in flight
        futures = [conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(100)]
        assert not any(future.done() for future in futures)
        assert_killing_fails_pending(server, conn, futures)


def test_close_with_pending_sends_timeouts_and_backpressure(server_process) -> None:
    server = server_process()
    conn = connect(server.address, timeout=20, max_in_flight=4)
    _join(conn)
    sigstop(server.process)
    try:
        with pytest.raises(errors.RequestTimeoutError, match="StepRequest"):
            conn.send(dm_env_rpc_pb2.StepRequest(), timeout=0.2)
        futures = [conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(3)]
        with pytest.raises(errors.RequestTimeoutError, match="4 requests in flight"):
            conn.send_async(dm_env_rpc_pb2.StepRequest(), timeout=0.2)
        started = time.monotonic()
        conn.close()
        conn.close()  # idempotent
        # close() joins the reader for at most 5 s, then closes the channel: a bound of 15 s
        # fails on a hang, not on a loaded machine (where the suite runs beside other work).
        assert time.monotonic() - started < 15
        for future in futures:
            assert isinstance(future.exception(timeout=0), errors.ConnectionClosedError)
        with pytest.raises(errors.ConnectionClosedError, match="closed"):
            conn.send(dm_env_rpc_pb2.StepRequest(), timeout=1)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def test_requests_after_close_fail_at_once_however_many_with_backpressure(
    server_process,
) -> None:
    # With max_in_flight, close() wakes the senders waiting for room, and each took a slot
    # it never gave back: once more requests came than close() had released, the next one
    # waited for room for ever (a step with timeout=None hung the caller).
    server = server_process()
    conn = connect(server.address, timeout=20, max_in_flight=2)
    _join(conn)
    sigstop(server.process)  # hold the requests in flight
    try:
        held = [conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(2)]
        waiting: list[Any] = []
        sender = threading.Thread(
            target=lambda: waiting.append(conn.send_async(dm_env_rpc_pb2.StepRequest())),
            daemon=True,
        )
        sender.start()
        slots: Any = conn._slots
        assert wait_for(lambda: bool(slots._cond._waiters))  # it waits for room
        conn.close()
        sender.join(timeout=10)
        assert not sender.is_alive()
        later: list[Any] = []
        after = threading.Thread(
            target=lambda: later.extend(
                conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(8)
            ),
            daemon=True,
        )
        after.start()
        after.join(timeout=10)
        assert not after.is_alive(), "a request after close() waits for room"
        assert len(later) == 8
        for future in [*held, *waiting, *later]:
            assert isinstance(future.exception(timeout=0), errors.ConnectionClosedError)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def test_no_threads_or_channels_left_after_close(server_process) -> None:
    server = server_process()  # out of process, so every new thread here is the client's
    before = set(threading.enumerate())
    conn = connect(server.address, timeout=20)
    _join(conn)
    channel = conn._channel
    conn.close()
    assert wait_for(lambda: set(threading.enumerate()) <= before, timeout=10), [
        t.name for t in set(threading.enumerate()) - before
    ]
    with pytest.raises(ValueError, match="closed channel"):
        channel.unary_unary("/x/y")(b"", timeout=1)


@pytest.mark.parametrize("ended_by", ["close", "server"])
def test_close_frees_the_grpc_call(server_process, ended_by: str) -> None:
    # gRPC's finalizer of a call takes the call's lock. Left to the interpreter's exit (the
    # call in a reference cycle, or its connection never freed), it could wait for ever on a
    # lock that a daemon gRPC thread held when the exit stopped it: the `specs` command hung
    # at exit in 1 run of 50 to 800. So close() frees the call, with no garbage collection.
    server = server_process()
    gc.disable()
    try:
        conn = connect(server.address, timeout=20)
        _join(conn)
        call = weakref.ref(conn._call)
        if ended_by == "server":
            server.kill()  # the reader ends on the call's error, which is the call itself
            assert wait_for(lambda: conn.closed, timeout=30)
        conn.close()
        assert call() is None
    finally:
        gc.enable()


_OPEN_AT_EXIT = """
import atexit, os, signal, sys
connections = []
# Registered before the SDK is imported, so it runs after the SDK's own exit handler.
atexit.register(lambda: print("closed at exit:", connections[0].closed, flush=True))
from dm_env_rpc_client.connection import connect
from dm_env_rpc_client._proto import dm_env_rpc_pb2
conn = connect(sys.argv[1], timeout=20)
connections.append(conn)
if sys.argv[2] != "0":  # the server stopped, with requests waiting for it
    os.kill(int(sys.argv[2]), signal.SIGSTOP)
    futures = [conn.send_async(dm_env_rpc_pb2.CreateWorldRequest()) for _ in range(20)]
"""


@pytest.mark.parametrize("stopped", [False, True], ids=["answering", "stopped server"])
def test_a_connection_left_open_is_closed_at_exit(server_process, stopped: bool) -> None:
    server = server_process()
    pid = server.process.pid if stopped else 0
    try:
        # A hang at exit fails here, with the child's output (run_child's timeout).
        result = run_child([sys.executable, "-c", _OPEN_AT_EXIT, server.address, str(pid)], 60)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "closed at exit: True"


def test_user_owned_channel_stays_open(catch_server: Server) -> None:
    channel = grpc.insecure_channel(catch_server.address)
    with Connection(channel) as conn:
        _join(conn)
    with Connection(channel) as again:
        _join(again)
    channel.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_connect_timeout_names_the_address() -> None:
    address = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(errors.ConnectTimeoutError, match=address) as info:
        connect(address, timeout=0.5, wait_for_ready=True)  # waits; without it, refused at once
    assert "refused" in str(info.value)
    assert time.monotonic() - started < 5


def test_connect_retries_until_a_late_server_comes_up() -> None:
    port = _free_port()
    result: dict[str, Any] = {}

    def dial() -> None:
        try:
            result["conn"] = connect(f"127.0.0.1:{port}", timeout=20, wait_for_ready=True)
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=dial)
    thread.start()
    assert not wait_for(lambda: bool(result), timeout=0.5)  # nothing listens yet
    with serve(lambda settings: Catch(**settings), f"127.0.0.1:{port}"):
        thread.join(timeout=20)
        assert "error" not in result, result
        with result["conn"] as conn:
            assert _join(conn).actions


def test_remote_plaintext_needs_an_explicit_flag() -> None:
    with pytest.raises(errors.DmEnvRpcConnectionError, match="insecure=True"):
        connect("192.0.2.1:50051", timeout=0.1)


def test_non_message_requests_are_refused(conn: Connection) -> None:
    with pytest.raises(TypeError, match="protobuf messages"):
        conn.send_async("step")  # type: ignore[arg-type]


def test_tls_end_to_end_and_plaintext_to_tls_times_out() -> None:
    authority = trustme.CA()
    cert = authority.issue_cert("localhost")
    chain = b"".join(blob.bytes() for blob in cert.cert_chain_pems)
    server_credentials = grpc.ssl_server_credentials([(cert.private_key_pem.bytes(), chain)])
    client_credentials = grpc.ssl_channel_credentials(authority.cert_pem.bytes())
    with serve(
        lambda settings: Catch(**settings), "localhost:0", credentials=server_credentials
    ) as server:
        with connect(server.address, credentials=client_credentials, timeout=20) as conn:
            env, _ = create_and_join_world(conn, {"seed": 0}, {}, timeout=10)
            assert env.reset().first()
            assert env.step({"paddle": 1}).mid()
            env.close()

        async def over_asyncio() -> int:
            aconn = await connect_async(server.address, credentials=client_credentials, timeout=20)
            async with aconn:
                world = (await aconn.send(dm_env_rpc_pb2.CreateWorldRequest())).world_name
                join = await aconn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world))
                return len(join.specs.actions)

        assert asyncio.run(over_asyncio()) == 1
        # Without TLS, the handshake never completes: a bounded, named failure.
        with pytest.raises(errors.ConnectTimeoutError, match="localhost"):
            connect(server.address, timeout=1)
