"""Large answers: a payload that contradicts its shape is refused unread; a cap on the answer size.

The memory this saves is measured by ``bench/answer_memory.py`` (not here: no
timing or memory targets in tests).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from faulty import faulty_server, float_specs, lifecycle

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors, tensors
from dm_env_rpc_client._fastpath import wire_step
from dm_env_rpc_client._proto import dm_env_rpc_pb2

N = 100_000  # a 400 KB observation: walked from the wire bytes (wire_step.LARGE is 64 KB)


def answering(elements: int) -> Any:
    """Every step observes ``x``, declared float32[N] (as its spec), with ``elements`` floats."""
    specs = float_specs((N,))
    step = dm_env_rpc_pb2.EnvironmentResponse()
    tensor = step.step.observations[1]
    tensor.shape[:] = [N]
    tensor.floats.array[:] = np.zeros(elements, np.float32)
    step.step.state = dm_env_rpc_pb2.RUNNING

    def answer(request: Any) -> Any:
        return lifecycle(request, specs) or step

    return answer


@pytest.fixture
def never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any decode of a payload fails the test: a refusal must come before one."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a payload was decoded")

    monkeypatch.setattr(wire_step.WireTensor, "array", refuse)
    monkeypatch.setattr(wire_step.WireTensor, "view", refuse)
    monkeypatch.setattr(tensors, "unpack_tensor", refuse)


BAD = f"with shape [{N}] ({N:,} elements) but a payload of {N - 1:,} elements"


@pytest.mark.usefixtures("never_decoded")
def test_lockstep_refuses_a_payload_short_of_its_shape_before_decoding() -> None:
    with faulty_server(answering(N - 1)) as address, dmr.connect(address) as conn:
        env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=10)
        with pytest.raises(errors.ObservationError, match="refused before anything") as raised:
            env.reset()
        assert BAD in str(raised.value) and raised.value.name == "x"


@pytest.mark.usefixtures("never_decoded")
def test_step_iter_and_the_batch_refuse_it_the_same_way() -> None:
    with faulty_server(answering(N - 1)) as address:
        with dmr.connect(address) as conn:
            env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=10)
            with pytest.raises(errors.ObservationError) as raised:
                list(env.step_iter([{}] * 4, in_flight=4))
            assert BAD in str(raised.value)
        with dmr.BatchedEnvironment.connect(address, 2, timeout=10, seed_setting=None) as batch:
            with pytest.raises(errors.WorldError) as world_error:
                batch.reset()
            assert BAD in str(world_error.value.__cause__)


def test_the_walk_marks_the_payload_bad_without_copying_it() -> None:
    data = answering(N - 1)(dm_env_rpc_pb2.EnvironmentRequest(step={})).SerializeToString()
    step = wire_step.read_step(data)
    tensor = step.observations[1]
    assert isinstance(tensor, wire_step.WireTensor)
    assert tensor.bad == N - 1 and tensor._data is data  # a place in the answer, not a copy


def test_a_good_large_answer_still_decodes() -> None:
    with faulty_server(answering(N)) as address, dmr.connect(address) as conn:
        env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=10)
        assert env.reset().observation["x"].shape == (N,)


def test_an_answer_over_max_response_bytes_is_named() -> None:
    with faulty_server(answering(N)) as address:
        with dmr.connect(address, max_response_bytes=100_000) as conn:
            env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=10)
            with pytest.raises(errors.ResponseTooLargeError, match="max_response_bytes") as raised:
                env.reset()
            assert isinstance(raised.value, errors.ConnectionClosedError)
            assert raised.value.code == dmr.ErrorCode(8)  # RESOURCE_EXHAUSTED
        with dmr.connect(address, max_response_bytes=1_000_000) as conn:  # room for it
            env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=10)
            assert env.reset().observation["x"].shape == (N,)
        with dmr.BatchedEnvironment.connect(
            address, 2, timeout=10, seed_setting=None, max_response_bytes=100_000
        ) as batch:
            with pytest.raises(errors.WorldError) as world_error:
                batch.reset()
            assert isinstance(world_error.value.__cause__, errors.ResponseTooLargeError)


def test_connect_async_takes_max_response_bytes_too() -> None:
    """As ``dmr.connect``: a larger answer fails its request with ResponseTooLargeError, and
    every pending one with a ConnectionClosedError; with room for it, it decodes. (With requests
    being written as gRPC cuts the stream, ``grpc.aio`` may report INTERNAL instead: a race in
    gRPC that the SDK cannot see past; the message then names the connection's cap.)"""

    async def reset(address: str, cap: int) -> Any:
        async with await dmr.connect_async(address, timeout=10, max_response_bytes=cap) as conn:
            env, _ = await dmr.create_and_join_world_async(conn, {}, {}, timeout=10)
            return await env.reset()

    async def pending(address: str) -> list[Any]:
        async with await dmr.connect_async(address, timeout=10, max_response_bytes=100_000) as conn:
            env, _ = await dmr.create_and_join_world_async(conn, {}, {}, timeout=10)
            steps = (env.step({}) for _ in range(3))
            return await asyncio.gather(env.reset(), *steps, return_exceptions=True)

    with faulty_server(answering(N)) as address:
        with pytest.raises(errors.ResponseTooLargeError, match="max_response_bytes") as raised:
            asyncio.run(reset(address, 100_000))
        assert raised.value.code == dmr.ErrorCode(8)  # RESOURCE_EXHAUSTED
        assert asyncio.run(reset(address, 1_000_000)).observation["x"].shape == (N,)
        failed = [e for _ in range(8) for e in asyncio.run(pending(address))]  # 8: races too
        for error in failed:  # the size error, or gRPC's INTERNAL, which then names the cap
            assert isinstance(error, errors.ConnectionClosedError), failed
            if not isinstance(error, errors.ResponseTooLargeError):
                assert "at most 100,000 bytes (max_response_bytes)" in str(error), failed


@pytest.mark.parametrize("value", [0, -5, 1.5, "1MB"])
def test_a_bad_max_response_bytes_is_refused_by_name(value: Any) -> None:
    with pytest.raises(errors.ArgumentError, match="max_response_bytes"):
        dmr.connect("127.0.0.1:1", max_response_bytes=value)
    with pytest.raises(errors.ArgumentError, match="max_response_bytes"):
        asyncio.run(dmr.connect_async("127.0.0.1:1", max_response_bytes=value))
    with pytest.raises(errors.ArgumentError, match="max_response_bytes"):
        dmr.BatchedEnvironment.connect("127.0.0.1:1", 1, max_response_bytes=value)
