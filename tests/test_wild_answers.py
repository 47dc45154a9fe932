"""Servers in the wild: a stalled step_async, odd error codes, huge messages, step_iter's actions.

Each test runs against a raw gRPC server (``faulty``) that answers as told.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import wait_for
from faulty import faulty_server, lifecycle, two_step_specs

from dm_env_rpc_client import errors
from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client.aio import connect_async
from dm_env_rpc_client.aio_environment import create_and_join_world_async
from dm_env_rpc_client.connection import connect
from dm_env_rpc_client.environment import create_and_join_world


def stepping(
    received: list[str], refuse: int | None = None, gate: threading.Event | None = None
) -> Any:
    """An answer for two_step_specs worlds: step ``n`` (the reset's first step is 1) observes
    ``x = [n, 0]``; step ``refuse`` is refused; with ``gate``, steps after the first wait
    for it. Every request's kind is appended to ``received``."""
    specs = two_step_specs()

    def answer(request: Any) -> Any:
        received.append(request.WhichOneof("payload"))
        done = lifecycle(request, specs)
        if done is not None:
            return done
        count = received.count("step")
        if gate is not None and count > 1:
            gate.wait(30)
        if count == refuse:
            refused = dm_env_rpc_pb2.EnvironmentResponse()
            refused.error.code, refused.error.message = 3, "refused step"
            return refused
        tensor = dm_env_rpc_pb2.Tensor(shape=[2])
        tensor.floats.array.extend([float(count), 0.0])
        step = dm_env_rpc_pb2.StepResponse(state=dm_env_rpc_pb2.RUNNING, observations={1: tensor})
        return dm_env_rpc_pb2.EnvironmentResponse(step=step)

    return answer


# --- 3: step_async(...).result(timeout) -----------------------------------------------------


def test_a_step_async_result_that_times_out_raises_a_named_error() -> None:
    gate = threading.Event()
    with faulty_server(stepping([], gate=gate)) as address, connect(address) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=10)
        env.reset()
        future = env.step_async({"a": 0})
        with pytest.raises(errors.RequestTimeoutError, match="still in flight") as raised:
            future.result(timeout=0.05)
        assert isinstance(raised.value, concurrent.futures.TimeoutError)
        assert isinstance(raised.value, TimeoutError)
        with pytest.raises(errors.RequestTimeoutError):
            future.exception(timeout=0.05)
        gate.set()
        assert future.result(timeout=10).observation["x"][0] == 2  # waiting again gets it
        env.close()


def test_request_timeout_error_is_every_timeout_flavour() -> None:
    assert issubclass(errors.RequestTimeoutError, concurrent.futures.TimeoutError)
    assert issubclass(errors.RequestTimeoutError, asyncio.TimeoutError)
    assert issubclass(errors.RequestTimeoutError, TimeoutError)


# --- 5: error codes outside gRPC's range; huge messages -------------------------------------


def refusing_create(code: int, message: str) -> Any:
    def answer(request: Any) -> Any:
        refused = dm_env_rpc_pb2.EnvironmentResponse()
        refused.error.code, refused.error.message = code, message
        return refused

    return answer


def refusal(code: int, message: str) -> errors.DmEnvRpcError:
    """The error of a CreateWorldRequest the server refuses with ``code`` and ``message``."""
    with (
        faulty_server(refusing_create(code, message)) as address,
        connect(address) as conn,
        pytest.raises(errors.DmEnvRpcError) as raised,
    ):
        create_and_join_world(conn, {}, {}, timeout=10)
    return raised.value


def test_a_code_outside_grpcs_range_is_kept() -> None:
    error = refusal(1042, "custom failure")
    assert error.raw_code == 1042 and error.code == 2  # UNKNOWN, as gRPC has it
    assert str(error) == "UNKNOWN (the server's code 1042): custom failure"
    assert pickle.loads(pickle.dumps(error)).raw_code == 1042


def test_a_code_in_range_reads_as_before() -> None:
    error = refusal(9, "no")
    assert error.raw_code == 9 and str(error) == "FAILED_PRECONDITION: no"


def test_a_megabyte_message_is_cut_in_str_and_kept_whole() -> None:
    message = "m" * 1_000_000
    error = refusal(13, message)
    text = str(error)
    assert len(text) < errors.MAX_MESSAGE_SHOWN + 200
    assert "998000 more characters" in text and ".message" in text
    assert len(repr(error)) < errors.MAX_MESSAGE_SHOWN + 200
    assert error.message == message


# --- 6: step_iter takes no action it does not send -------------------------------------------


class Counted:
    """An iterator of ``{"a": 0}`` actions that counts how many were taken."""

    def __init__(self, count: int) -> None:
        self.taken = 0
        self._count = count

    def __iter__(self) -> Iterator[dict[str, int]]:
        return self

    def __next__(self) -> dict[str, int]:
        if self.taken >= self._count:
            raise StopIteration
        self.taken += 1
        return {"a": 0}


@pytest.mark.parametrize("in_flight", [1, 2, 4])
def test_step_iter_raising_has_taken_only_actions_it_sent(in_flight: int) -> None:
    received: list[str] = []
    with faulty_server(stepping(received, refuse=4)) as address, connect(address) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=10)
        env.reset()  # step 1
        actions = Counted(20)
        with pytest.raises(errors.DmEnvRpcError, match="refused step"):
            for _ in env.step_iter(actions, in_flight=in_flight):
                pass
        # every action taken reached the server (its step counted there), none more
        sent = lambda: received.count("step") - 1  # noqa: E731
        assert wait_for(lambda: sent() == actions.taken, timeout=5), (sent(), actions.taken)
        # the iterator resumes where step_iter left it
        assert actions.taken < 20 and next(actions) == {"a": 0}


def test_step_iter_hands_back_an_action_it_could_not_send() -> None:
    with faulty_server(stepping([])) as address, connect(address) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=10)
        env.reset()
        with pytest.raises(errors.SpecValidationError) as raised:
            list(env.step_iter(iter([{"a": 0}, {"a": 5}, {"a": 1}])))
        assert raised.value.unsent_action == {"a": 5}


def test_async_step_iter_raising_has_taken_only_actions_it_sent() -> None:
    received: list[str] = []

    async def main(address: str) -> Counted:
        conn = await connect_async(address)
        env, _ = await create_and_join_world_async(conn, {}, {}, timeout=10)
        await env.reset()
        actions = Counted(20)
        with pytest.raises(errors.DmEnvRpcError, match="refused step"):
            async for _ in env.step_iter(actions, in_flight=2):
                pass
        await conn.aclose()
        return actions

    with faulty_server(stepping(received, refuse=4)) as address:
        actions = asyncio.run(main(address))
        sent = lambda: received.count("step") - 1  # noqa: E731
        assert wait_for(lambda: sent() == actions.taken, timeout=5), (sent(), actions.taken)
