"""Large StepResponses read from their wire bytes give exactly what protobuf parsing gives."""

from __future__ import annotations

import asyncio
from typing import Any

import dm_env
import numpy as np
import pytest
from dm_env import specs as dm_specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors, messages, tensors
from dm_env_rpc_client._fastpath import wire_step as _wire_step
from dm_env_rpc_client._fastpath.decode import ObservationPlan
from dm_env_rpc_client._fastpath.wire_step import LARGE, WireStep, WireTensor, read_step
from dm_env_rpc_client._proto import dm_env_rpc_pb2 as pb

SIZE = 100_000
# The payloads _wire_step walks: (NumPy dtype, DataType).
WALKED = [
    (np.float32, pb.DataType.FLOAT),
    (np.float64, pb.DataType.DOUBLE),
    (np.uint8, pb.DataType.UINT8),
    (np.int8, pb.DataType.INT8),
]


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


@pytest.mark.parametrize(("dtype", "data_type"), WALKED)
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


def _viewed_bytes(values: np.ndarray) -> bytes | None:
    """The response bytes ``values`` is a view of; None for an array with memory of its own."""
    base = values.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, bytes) else None


@pytest.mark.parametrize("copy_observations", [None, False])
def test_every_stepper_walks_large_steps_once(
    monkeypatch: pytest.MonkeyPatch, copy_observations: bool | None
) -> None:
    """The sync and asyncio adaptors and the batch read large steps from their wire bytes,
    and give exactly the server's arrays: writable and their own (one copy) by default,
    read-only views of the response bytes (no copy) with copy_observations=False."""
    walked = []  # each large step read from its wire bytes: walked, or by its walk's template
    original, by_template = _wire_step._walk, _wire_step._Template.read

    def read(template: Any, data: bytes) -> Any:
        step = by_template(template, data)
        if step is not None:
            walked.append(1)
        return step

    monkeypatch.setattr(_wire_step, "_walk", lambda *args: walked.append(1) or original(*args))
    monkeypatch.setattr(_wire_step._Template, "read", read)
    kwargs = {} if copy_observations is None else {"copy_observations": copy_observations}

    def check(values: np.ndarray, count: int, views: bool = copy_observations is False) -> None:
        assert values.dtype == np.float32 and values.shape == (SIZE,)
        assert np.array_equal(values, _expected(count))
        assert values.flags.writeable != views and values.flags.aligned
        data = _viewed_bytes(values)
        assert (data is not None) == views
        if views:
            assert np.shares_memory(values, np.frombuffer(data, np.uint8))
            with pytest.raises(ValueError, match="read-only"):
                values[0] = 0.0

    with dmr.serve(_Ramp) as server:
        env, _ = dmr.create_and_join_world(server.address, {}, {}, timeout=10, **kwargs)
        env.reset()
        check(env.step({}).observation["values"], 1)
        check(env.step_async({}).result(10).observation["values"], 2)
        for count, timestep in enumerate(env.step_iter([{}] * 4, in_flight=4), start=3):
            check(timestep.observation["values"], count)
        env.close()
        assert len(walked) >= 7

        async def main() -> None:
            env, _ = await dmr.create_and_join_world_async(
                server.address, {}, {}, timeout=10, **kwargs
            )
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
                    check(row, count, views=False)  # the batch stacks: one copy
        assert len(walked) >= 6


def _laid_out(values: np.ndarray, aligned: bool) -> tuple[bytes, int]:
    """A step response with ``values`` at a UID that puts its payload on (or off) its
    dtype's boundary in memory: the UID's varint length moves the payload."""
    for uid in (1, 200, 20_000, 2_000_000, 200_000_000):
        step = pb.StepResponse(state=pb.EnvironmentStateType.RUNNING)
        step.observations[uid].CopyFrom(tensors.pack_tensor(values))
        data = pb.EnvironmentResponse(step=step).SerializeToString()
        address = np.frombuffer(data, np.uint8).ctypes.data + data.index(values.tobytes())
        if (address % values.itemsize == 0) == aligned:
            return data, uid
    raise AssertionError(f"no UID puts {values.dtype} {'on' if aligned else 'off'} its boundary")


def _decoded_without_copy(data: bytes, uid: int, data_type: int) -> tuple[np.ndarray, Any]:
    """``values`` as a plan with copy=False decodes it: one step, and a run of two."""
    spec = pb.TensorSpec(name="values", shape=[SIZE // 4, 4], dtype=data_type)
    plan = ObservationPlan({uid: spec}, [uid], copy=False)
    run = plan.columns([read_step(data), read_step(data)])["values"]
    return plan.decode(read_step(data).observations)["values"], run


@pytest.mark.parametrize(("dtype", "data_type"), WALKED)
def test_aligned_payloads_are_read_only_views(dtype: type, data_type: int) -> None:
    values = (np.arange(SIZE) % 100).astype(dtype).reshape(SIZE // 4, 4)
    data, uid = _laid_out(values, aligned=True)
    one, run = _decoded_without_copy(data, uid, data_type)
    assert isinstance(run, list)  # not stacked into one [2, ...] array (that would copy)
    for decoded in (one, *run):
        np.testing.assert_array_equal(decoded, values)
        assert not decoded.flags.writeable and _viewed_bytes(decoded) is data


@pytest.mark.parametrize(("dtype", "data_type"), WALKED[:2])  # float and double: wider than a byte
def test_unaligned_payloads_are_copied_even_without_copy_observations(
    dtype: type, data_type: int
) -> None:
    """Where the server's layout puts a payload off its dtype's boundary, a view would be
    unaligned: copy_observations=False still gives an aligned, writable copy (a run of
    steps stacked, as by default)."""
    values = np.arange(SIZE, dtype=dtype).reshape(SIZE // 4, 4)
    data, uid = _laid_out(values, aligned=False)
    one, run = _decoded_without_copy(data, uid, data_type)
    assert isinstance(run, np.ndarray) and run.shape == (2, *values.shape)
    for decoded in (one, *run):
        np.testing.assert_array_equal(decoded, values)
        assert decoded.flags.aligned and decoded.flags.writeable
        assert _viewed_bytes(decoded) is None


def test_a_wire_dtype_other_than_the_native_one_is_copied() -> None:
    """A big-endian host's float32 is not the wire's little-endian one: a copy, converted."""
    values = np.arange(SIZE, dtype="<f4")
    data = bytes(4) + values.tobytes()
    tensor = WireTensor(data, "floats", np.dtype("<f4"), np.dtype(">f4"), 4, SIZE)
    tensor.shape = [SIZE]
    out = tensor.array(copy=False)
    assert out.dtype == np.dtype(">f4") and out.flags.writeable
    np.testing.assert_array_equal(out, values)


def _step_bytes(state: int, observations: dict[int, Any], shape: list[int] | None = None) -> bytes:
    step = pb.StepResponse(state=state)
    for uid, value in observations.items():
        step.observations[uid].CopyFrom(tensors.pack_tensor(value))
    if shape is not None:
        step.observations[1].shape[:] = shape
    return pb.EnvironmentResponse(step=step).SerializeToString()


def _same_as_protobuf(data: bytes, specs: dict[int, pb.TensorSpec]) -> WireStep:
    step = read_step(data)
    parsed = messages.unwrap(data, "step")
    assert isinstance(step, WireStep) and step.state == parsed.state
    plan = ObservationPlan(specs, sorted(specs))
    fast, slow = plan.decode(step.observations), plan.decode(parsed.observations)
    assert fast.keys() == slow.keys()
    for name in fast:
        np.testing.assert_array_equal(fast[name], slow[name])
        assert np.asarray(fast[name]).dtype == np.asarray(slow[name]).dtype
    return step


def test_the_next_steps_of_a_walked_shape_are_read_by_its_template(monkeypatch) -> None:
    """After one walk, responses of the same structure are read without walking, exactly;
    any other response of that length is walked (or parsed) as before."""
    rng = np.random.default_rng(7)
    specs = {
        1: pb.TensorSpec(name="values", shape=[SIZE // 4, 4], dtype=pb.DataType.FLOAT),
        2: pb.TensorSpec(name="reward", shape=[], dtype=pb.DataType.FLOAT),
        7: pb.TensorSpec(name="label", shape=[], dtype=pb.DataType.STRING),
    }

    def draw(state: int = 1, label: str = "a", shape: list[int] | None = None) -> bytes:
        values = rng.random((SIZE // 4, 4)).astype(np.float32)
        reward = np.float32(rng.normal())
        return _step_bytes(state, {1: values, 2: reward, 7: label}, shape)

    monkeypatch.setattr(_wire_step, "_TEMPLATES", {})
    walks = []
    original = _wire_step._walk
    monkeypatch.setattr(_wire_step, "_walk", lambda *args: walks.append(1) or original(*args))
    _same_as_protobuf(draw(), specs)
    assert len(walks) == 1
    for state in (1, 2, 3, 1):  # RUNNING, TERMINATED, INTERRUPTED: the state byte varies
        assert _same_as_protobuf(draw(state, label="b"), specs).state == state
    assert len(walks) == 1  # all by the template
    # Same length, other structure: the shape's dims swapped (4 and 25,000 keep their
    # varint lengths), so the template does not match and the step is walked again.
    swapped = draw(shape=[4, SIZE // 4])
    assert len(swapped) == len(draw())
    step = read_step(swapped)
    assert step.observations[1].shape == [4, SIZE // 4] and len(walks) == 2
    # An error of a learned length is not a step: it is raised, as before.
    error = pb.EnvironmentResponse()
    error.error.code = 3
    size = len(draw())
    error.error.message = "x" * (size - 32)
    while len(error.SerializeToString()) < size:  # the varints' lengths grow with it
        error.error.message += "x"
    data = error.SerializeToString()
    assert len(data) == size
    with pytest.raises(errors.DmEnvRpcError, match="xxx"):
        read_step(data)


@pytest.mark.parametrize(("dtype", "data_type"), WALKED)
def test_templates_read_every_walked_dtype_exactly(dtype: type, data_type: int) -> None:
    rng = np.random.default_rng(int(data_type))
    specs = {
        1: pb.TensorSpec(name="values", shape=[SIZE], dtype=data_type),
        9: pb.TensorSpec(name="more", shape=[SIZE // 2], dtype=data_type),
    }
    for _ in range(3):  # the first is walked, the next two read by its template
        first = (rng.random(SIZE) * 100).astype(dtype)
        second = (rng.random(SIZE // 2) * 100).astype(dtype)
        _same_as_protobuf(_step_bytes(1, {1: first, 9: second}), specs)
