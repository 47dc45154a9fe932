"""Entry points one step off the documented path: addresses, wrong shapes, failed joins."""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle
import socket
from collections.abc import Iterator
from typing import Any, ClassVar

import grpc
import numpy as np
import pytest

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client.server import Server
from dm_env_rpc_client.server.catch import Catch


class RecordedCatch(Catch):
    """Catch that tells which instances are alive (the server closes destroyed worlds)."""

    alive: ClassVar[set[int]] = set()

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        RecordedCatch.alive.add(id(self))

    def close(self) -> None:
        RecordedCatch.alive.discard(id(self))


@pytest.fixture
def recorded_server() -> Iterator[Server]:
    RecordedCatch.alive = set()
    with dmr.serve(RecordedCatch) as server:
        yield server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- addresses where connections go -----------------------------------------------------


def test_batched_connect_takes_one_address_string(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(catch_server.address, num_envs=2, timeout=10) as envs:
        assert len(envs) == 2
        assert envs.addresses == [catch_server.address] * 2
        batch = envs.step({"paddle": np.zeros(2, np.int8)})
        assert batch.observation["board"].shape[0] == 2


def test_create_and_join_world_takes_an_address_and_owns_that_connection(
    catch_server: Server,
) -> None:
    env, world_name = dmr.create_and_join_world(catch_server.address, {"seed": 1}, {}, timeout=10)
    assert world_name.startswith("world-")
    assert env.reset().first()
    assert env.step({"paddle": 1}).mid()
    connection = env.connection
    assert isinstance(connection, dmr.Connection) and not connection.closed
    env.close()
    assert connection.closed
    env.close()  # still idempotent


def test_join_world_takes_an_address(catch_server: Server) -> None:
    with dmr.connect(catch_server.address, timeout=10) as conn:
        name = dmr.create_world(conn, {"seed": 2}, timeout=10)
        env = dmr.join_world(catch_server.address, name, {}, timeout=10)
        assert env.reset().first()
        env.close()
        assert env.connection.closed
        dmr.destroy_world(conn, name, timeout=10)


def test_an_address_where_nothing_listens_is_refused_at_once() -> None:
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(errors.ConnectRefusedError, match=f"{address} \\(connection refused\\)"):
        dmr.create_and_join_world(address, {}, {}, timeout=30)


def test_connecting_waits_a_finite_time_by_default() -> None:
    for function in (dmr.connect, dmr.connect_async, dmr.create_secure_channel_and_connect):
        default = inspect.signature(function).parameters["timeout"].default
        assert default == dmr.DEFAULT_CONNECT_TIMEOUT, function
    assert math.isfinite(dmr.DEFAULT_CONNECT_TIMEOUT) and dmr.DEFAULT_CONNECT_TIMEOUT > 0


_WAIT_FOR_A_RESPONSE = [
    dmr.Connection.send,
    dmr.AsyncConnection.send,
    dmr.DmEnvAdaptor.__init__,
    dmr.AsyncDmEnvAdaptor.__init__,
    dmr.create_world,
    dmr.leave_world,
    dmr.destroy_world,
    dmr.reset_world,
    dmr.create_world_async,
    dmr.leave_world_async,
    dmr.destroy_world_async,
    dmr.reset_world_async,
]


@pytest.mark.parametrize("function", _WAIT_FOR_A_RESPONSE, ids=lambda f: f.__qualname__)
def test_every_request_waits_a_finite_time_by_default(function: Any) -> None:
    assert inspect.signature(function).parameters["timeout"].default == dmr.DEFAULT_TIMEOUT
    assert math.isfinite(dmr.DEFAULT_TIMEOUT) and dmr.DEFAULT_TIMEOUT > 0


def test_the_join_helpers_give_adaptors_the_default_timeout(catch_server: Server) -> None:
    """create/join helpers take the adaptor's keywords: without ``timeout`` they are bounded too."""
    env, _ = dmr.create_and_join_world(catch_server.address, {}, {})
    assert env._timeout == dmr.DEFAULT_TIMEOUT
    env.close()

    async def main() -> None:
        env, name = await dmr.create_and_join_world_async(catch_server.address, {}, {})
        assert env._timeout == dmr.DEFAULT_TIMEOUT
        await env.aclose()
        async with await dmr.connect_async(catch_server.address, timeout=10) as conn:
            name = await dmr.create_world_async(conn, {})
            joined = await dmr.join_world_async(conn, name)
            assert joined._timeout == dmr.DEFAULT_TIMEOUT
            await joined.aclose()
            await dmr.destroy_world_async(conn, name)

    asyncio.run(main())


@pytest.mark.parametrize("thing", [42, None, object()])
def test_not_a_connection_says_what_to_pass(thing: Any) -> None:
    with pytest.raises(TypeError, match=r"dmr\.connect\(address\).*address string"):
        dmr.create_and_join_world(thing, {}, {})


def test_an_unawaited_coroutine_says_await_and_warns_nothing(catch_server: Server) -> None:
    coroutine = dmr.connect_async(catch_server.address, timeout=10)
    with pytest.raises(TypeError, match="coroutine"):
        dmr.create_and_join_world(coroutine, {}, {})
    assert inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED


def test_an_async_connection_says_to_use_a_sync_one(catch_server: Server) -> None:
    async def attempt() -> str:
        async with await dmr.connect_async(catch_server.address, timeout=10) as aconn:
            with pytest.raises(TypeError, match="AsyncConnection") as info:
                dmr.create_and_join_world(aconn, {}, {})
            return str(info.value)

    assert "dmr.connect" in asyncio.run(attempt())


# --- wrong action shapes -------------------------------------------------------------------


@pytest.mark.parametrize("action", [1, np.int8(1), [1]])
def test_a_bare_action_shows_the_dict_form(catch_server: Server, action: Any) -> None:
    env, _ = dmr.create_and_join_world(catch_server.address, {"seed": 3}, {}, timeout=10)
    try:
        env.reset()
        with pytest.raises(errors.SpecValidationError) as info:
            env.step(action)
        message = str(info.value)
        shown = "[1]" if isinstance(action, list) else "1"
        assert f"env.step({{'paddle': {shown}}})" in message
        assert "np." not in message  # a plain number, as typed
        assert env.step({"paddle": 1}).mid()  # nothing was sent: the env steps on
    finally:
        env.close()


def test_batched_steps_take_a_list_of_per_world_dicts(catch_server: Server) -> None:
    settings = {"seed": 5}
    with (
        dmr.BatchedEnvironment.connect(
            [catch_server.address], 4, create_world_settings=settings, timeout=10
        ) as listed,
        dmr.BatchedEnvironment.connect(
            [catch_server.address], 4, create_world_settings=settings, timeout=10
        ) as stacked,
    ):
        listed.reset()
        stacked.reset()
        for paddle in (1, -1, 0):
            a = listed.step([{"paddle": paddle}] * 4)
            b = stacked.step({"paddle": np.full(4, paddle, np.int8)})
            assert np.array_equal(a.observation["board"], b.observation["board"])
            assert np.array_equal(a.step_type, b.step_type)


@pytest.mark.parametrize(
    "actions",
    [[{"paddle": 0}] * 3, np.zeros(4, np.int8), [0, 0, 0, 0]],
    ids=["three-of-four", "bare-array", "bare-numbers"],
)
def test_batched_actions_of_another_shape_show_the_stacked_form(
    catch_server: Server, actions: Any
) -> None:
    with dmr.BatchedEnvironment.connect([catch_server.address], 4, timeout=10) as envs:
        envs.reset()
        with pytest.raises(errors.SpecValidationError, match=r"envs\.step\(\{'paddle': np\.array"):
            envs.step(actions)
        assert envs.pending() == 0  # nothing was sent
        envs.step({"paddle": np.zeros(4, np.int8)})


# --- a class where a factory goes ----------------------------------------------------------


def test_serve_takes_an_environment_class_with_settings_as_keywords() -> None:
    with dmr.serve(Catch) as server, dmr.connect(server.address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, {"rows": 4, "columns": 3, "seed": 1}, {})
        assert env.reset().observation["board"].shape == (4, 3)
        env.close()
        with pytest.raises(errors.InvalidArgumentError, match="'colour'"):
            dmr.create_and_join_world(conn, {"colour": 1}, {})


# --- failed joins leave the connection usable ----------------------------------------------


def _usable(conn: dmr.Connection) -> None:
    env, _ = dmr.create_and_join_world(conn, {"seed": 1}, {}, timeout=10)
    assert env.reset().first()
    assert env.step({"paddle": 0}).mid()
    env.close()


@pytest.mark.parametrize(
    ("create", "join", "kwargs", "error", "match"),
    [
        ({}, {}, {"requested_observation": ["board"]}, TypeError, "requested_observations"),
        ({}, {}, {"requested_observations": ["bord"]}, errors.UnknownNameError, "bord"),
        ({}, {"bogus": 1}, {}, errors.InvalidArgumentError, "bogus"),
        ({"rows": -1}, {}, {}, errors.InvalidArgumentError, "rows"),
    ],
    ids=["misspelled-keyword", "unknown-observation", "join-refused", "create-refused"],
)
def test_a_failed_create_and_join_leaves_nothing_behind(
    recorded_server: Server,
    create: dict[str, Any],
    join: dict[str, Any],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with dmr.connect(recorded_server.address, timeout=10) as conn:
        with pytest.raises(error, match=match):
            dmr.create_and_join_world(conn, create, join, timeout=10, **kwargs)
        assert RecordedCatch.alive == set()  # never made, or destroyed again
        _usable(conn)
        assert RecordedCatch.alive == set()


def test_join_world_leaves_again_when_the_adaptor_cannot_be_made(
    recorded_server: Server,
) -> None:
    with dmr.connect(recorded_server.address, timeout=10) as conn:
        name = dmr.create_world(conn, {}, timeout=10)
        with pytest.raises(errors.UnknownNameError):
            dmr.join_world(conn, name, {}, requested_observations=["bord"], timeout=10)
        env = dmr.join_world(conn, name, {}, timeout=10)  # not "already joined"
        assert env.reset().first()
        env.close()
        dmr.destroy_world(conn, name, timeout=10)
        assert RecordedCatch.alive == set()


# --- the reference switch ------------------------------------------------------------------


def test_a_reference_connection_works_where_a_connection_goes(catch_server: Server) -> None:
    reference_connection = pytest.importorskip("dm_env_rpc.v1.connection")
    reference_error = pytest.importorskip("dm_env_rpc.v1.error")
    ref_conn = reference_connection.create_secure_channel_and_connect(
        catch_server.address, timeout=10
    )
    with ref_conn:
        env, _ = dmr.create_and_join_world(ref_conn, {"seed": 4}, {})
        assert env.reset().first()
        assert env.step({"paddle": -1}).mid()
        steps = list(env.step_iter([{"paddle": 0}] * 3, in_flight=2))
        assert len(steps) == 3
        env.close()
        with pytest.raises(errors.InvalidArgumentError) as info:
            dmr.create_and_join_world(ref_conn, {"colour": 1}, {})
        assert isinstance(info.value, reference_error.DmEnvRpcError)
        _usable_reference = dmr.create_and_join_world(ref_conn, {}, {})[0]
        _usable_reference.close()


def test_sdk_server_errors_are_reference_errors_once_it_is_imported(
    catch_server: Server,
) -> None:
    reference_error = pytest.importorskip("dm_env_rpc.v1.error")
    with dmr.connect(catch_server.address, timeout=10) as conn:
        try:
            dmr.create_and_join_world(conn, {"colour": 1}, {})
        except reference_error.DmEnvRpcError as exc:  # the reference's except clause
            assert isinstance(exc, dmr.InvalidArgumentError)
            assert isinstance(exc, ValueError)
            assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "colour" in exc.message
            clone = pickle.loads(pickle.dumps(exc))
            assert isinstance(clone, reference_error.DmEnvRpcError)
            assert clone.message == exc.message
        else:
            pytest.fail("no error")


def test_create_secure_channel_and_connect_under_the_reference_name(
    catch_server: Server,
) -> None:
    with dmr.create_secure_channel_and_connect(catch_server.address) as conn:
        assert isinstance(conn, dmr.Connection)
        _usable(conn)
