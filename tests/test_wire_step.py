"""Large StepResponses read from their wire bytes give exactly what protobuf parsing gives."""

from __future__ import annotations

import asyncio

import dm_env
import numpy as np
import pytest
from dm_env import specs as dm_specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client import _wire_step, errors, messages, tensors
from dm_env_rpc_client._decode import ObservationPlan
from dm_env_rpc_client._proto import dm_env_rpc_pb2 as pb
from dm_env_rpc_client._wire_step import LARGE, WireStep, WireTensor, read_step

SIZE = 100_000


def _specs(dtype: int, shape: list[int]) -> dict[int, pb.TensorSpec]:
    return {
        1: pb.TensorSpec(name="values", shape=shape, dtype=dtype),
        2: pb.TensorSpec(name="reward", shape=[], dtype=pb.DataType.FLOAT),
        7: pb.TensorSpec(name="label", shape=[], dtype=pb.DataType.STRING),
    }


def _response(values: np.ndarray, **overrides: object) -> pb.EnvironmentResponse:
    step = pb.StepResponse(state=pb.EnvironmentStateType.RUNNING)
    step.observations[1].CopyFrom(tensors.pack_tensor(values))
    for key, value in overrides.items():
        setattr(step.observations[1], key, value)
    step.observations[2].CopyFrom(tensors.pack_tensor(np.float32(0.25)))
    step.observations[7].CopyFrom(tensors.pack_tensor("hello"))
    return pb.EnvironmentResponse(step=step)


def _both(data: bytes, specs: dict[int, pb.TensorSpec]) -> tuple[object, dict, dict]:
    plan = ObservationPlan(specs, [1, 2, 7])
    walked = read_step(data)
    parsed = messages.unwrap(data, "step")
    return walked, plan.decode(walked.observations), plan.decode(parsed.observations)


@pytest.mark.parametrize(
    ("dtype", "data_type"),
    [
        (np.float32, pb.DataType.FLOAT),
        (np.float64, pb.DataType.DOUBLE),
        (np.uint8, pb.DataType.UINT8),
        (np.int8, pb.DataType.INT8),
    ],
)
def test_large_payloads_are_walked_and_equal(dtype: type, data_type: int) -> None:
    rng = np.random.default_rng(0)
    values = (rng.random((SIZE // 4, 4)) * 100).astype(dtype)
    data = _response(values).SerializeToString()
    assert len(data) >= LARGE
    walked, fast, slow = _both(data, _specs(data_type, [SIZE // 4, 4]))
    assert isinstance(walked, WireStep)
    assert isinstance(walked.observations[1], WireTensor)
    assert walked.state == pb.EnvironmentStateType.RUNNING
    assert fast.keys() == slow.keys()
    np.testing.assert_array_equal(fast["values"], values)
    assert fast["values"].dtype == values.dtype and fast["values"].shape == values.shape
    assert fast["values"].flags.writeable and fast["values"].flags.aligned
    assert fast["reward"] == slow["reward"] == np.float32(0.25)
    assert fast["label"] == slow["label"] == "hello"


def test_columns_of_walked_payloads_stack_them() -> None:
    values = np.arange(SIZE, dtype=np.float32)
    specs = _specs(pb.DataType.FLOAT, [SIZE])
    plan = ObservationPlan(specs, [1, 2, 7])
    data = [_response(values + i).SerializeToString() for i in range(3)]
    columns = plan.columns([read_step(d) for d in data])
    expected = plan.columns([messages.unwrap(d, "step") for d in data])
    np.testing.assert_array_equal(columns["values"], expected["values"])
    assert columns["values"].shape == (3, SIZE)
    assert list(columns["label"]) == ["hello"] * 3


@pytest.mark.parametrize(
    "case",
    ["small", "inferred shape", "broadcast", "repeated field", "error", "other payload"],
)
def test_other_encodings_are_parsed_by_protobuf(case: str) -> None:
    values = np.arange(SIZE, dtype=np.float32)
    specs = _specs(pb.DataType.FLOAT, [SIZE])
    if case == "small":
        data = _response(values[:10]).SerializeToString()
        specs = _specs(pb.DataType.FLOAT, [10])
    elif case == "inferred shape":
        response = _response(values)
        response.step.observations[1].shape[:] = [-1]
        data = response.SerializeToString()
    elif case == "broadcast":
        response = _response(values)
        response.step.observations[1].floats.array[:] = [1.5]  # one value for every element
        response.step.observations[7].strings.array[:] = ["y" * LARGE]  # keeps it large
        data = response.SerializeToString()
    elif case == "repeated field":
        data = _response(values).SerializeToString() * 2  # protobuf merges the two
    elif case == "error":
        error = pb.EnvironmentResponse()
        error.error.code = 3
        error.error.message = "x" * LARGE
        with pytest.raises(errors.DmEnvRpcError, match="xxx"):
            read_step(error.SerializeToString())
        return
    else:
        response = pb.EnvironmentResponse()
        response.reset.specs.observations[1].name = "x" * LARGE
        with pytest.raises(errors.ProtocolError, match="step request with a reset response"):
            read_step(response.SerializeToString())
        return
    step = read_step(data)
    # (A broadcast payload is small: parsed by protobuf inside a walked response.)
    assert isinstance(step, WireStep) == (case == "broadcast")
    assert len(data) >= LARGE or case == "small"
    plan = ObservationPlan(specs, [1, 2, 7])
    decoded = plan.decode(step.observations)
    assert decoded["values"].shape == tuple(specs[1].shape)
    expected = (
        np.full(SIZE, 1.5, np.float32) if case == "broadcast" else values[: specs[1].shape[0]]
    )
    np.testing.assert_array_equal(decoded["values"], expected)


class _Ramp(dm_env.Environment):
    """Observation ``values``: float32[SIZE], step ``k`` holds ``k + arange(SIZE) / SIZE``."""

    def __init__(self, **_: object) -> None:
        self._count = 0

    def _values(self) -> np.ndarray:
        return (self._count + np.arange(SIZE, dtype=np.float32) / SIZE).astype(np.float32)

    def reset(self) -> dm_env.TimeStep:
        self._count = 0
        return dm_env.restart({"values": self._values()})

    def step(self, action: object) -> dm_env.TimeStep:
        self._count += 1
        return dm_env.transition(0.5, {"values": self._values()})

    def observation_spec(self) -> dict:
        return {"values": dm_specs.Array((SIZE,), np.float32, name="values")}

    def action_spec(self) -> dict:
        return {}


def _expected(count: int) -> np.ndarray:
    return (count + np.arange(SIZE, dtype=np.float32) / SIZE).astype(np.float32)


def test_every_stepper_walks_large_steps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync and asyncio adaptors and the batch read large steps from their wire bytes
    (one copy), and give exactly the server's arrays, writable and their own."""
    walked = []
    original = _wire_step._walk
    monkeypatch.setattr(_wire_step, "_walk", lambda data: walked.append(1) or original(data))

    def check(values: np.ndarray, count: int) -> None:
        assert values.dtype == np.float32 and values.flags.writeable
        assert np.array_equal(values, _expected(count))

    with dmr.serve(_Ramp) as server:
        env, _ = dmr.create_and_join_world(server.address, {}, {}, timeout=10)
        env.reset()
        check(env.step({}).observation["values"], 1)
        for count, timestep in enumerate(env.step_iter([{}] * 4, in_flight=2), start=2):
            check(timestep.observation["values"], count)
        env.close()
        assert len(walked) >= 6

        async def main() -> None:
            env, _ = await dmr.create_and_join_world_async(server.address, {}, {}, timeout=10)
            await env.reset()
            check((await env.step({})).observation["values"], 1)
            count = 2
            async for timestep in env.step_iter([{}] * 4, in_flight=2):
                check(timestep.observation["values"], count)
                count += 1
            await env.aclose()

        walked.clear()
        asyncio.run(main())
        assert len(walked) >= 6

        walked.clear()
        with dmr.BatchedEnvironment.connect(server.address, 2) as envs:
            envs.reset()
            for count in (1, 2, 3):
                batch = envs.step({}, timeout=10)
                assert batch.observation["values"].shape == (2, SIZE)
                for row in batch.observation["values"]:
                    check(row, count)
        assert len(walked) >= 6
