"""Observations a server sends are checked against its specs, the same way on every path.

A faulty raw-gRPC server (``tests.faulty``) answers a step whose paddle action
is 1 correctly (its board filled with 1.0), and breaks its specs on a step
whose paddle is -1, in one way per test: a requested observation missing, an
unknown UID, an int64 payload for a float32 spec, a shape of (52428800, 1) for
a [2, 3] spec, too few elements. Lockstep ``step``, ``step_async``,
``step_iter`` (one at a time and several decoded together) and the batch must
all raise an ``ObservationError`` naming the observation; the good steps before
it arrive.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors, tensors
from dm_env_rpc_client._fastpath.decode import ObservationPlan
from dm_env_rpc_client._proto import dm_env_rpc_pb2 as pb
from dm_env_rpc_client.batched import BatchedEnvironment
from tests.faulty import faulty_server, lifecycle

PADDLE, BOARD, REWARD = 1, 2, 3
GOOD, BAD = {"paddle": 1}, {"paddle": -1}


def _specs() -> pb.ActionObservationSpecs:
    specs = pb.ActionObservationSpecs()
    specs.actions[PADDLE].CopyFrom(pb.TensorSpec(name="paddle", shape=[], dtype=pb.DataType.INT8))
    specs.observations[BOARD].CopyFrom(
        pb.TensorSpec(name="board", shape=[2, 3], dtype=pb.DataType.FLOAT)
    )
    specs.observations[REWARD].CopyFrom(
        pb.TensorSpec(name="reward", shape=[], dtype=pb.DataType.FLOAT)
    )
    return specs


def _good(paddle: int) -> pb.StepResponse:
    response = pb.StepResponse(state=pb.EnvironmentStateType.RUNNING)
    board = response.observations[BOARD]
    board.shape[:] = [2, 3]
    board.floats.array[:] = [float(paddle)] * 6
    reward = response.observations[REWARD]
    reward.floats.array[:] = [0.5]
    return response


def _missing(response: pb.StepResponse) -> None:
    del response.observations[BOARD]


def _unknown(response: pb.StepResponse) -> None:
    response.observations[99].floats.array[:] = [1.0]


def _int64(response: pb.StepResponse) -> None:
    board = response.observations[BOARD]
    board.ClearField("floats")
    board.int64s.array[:] = [1] * 6


def _huge_shape(response: pb.StepResponse) -> None:
    board = response.observations[BOARD]
    board.shape[:] = [52428800, 1]  # the payload is not that large: refused before decoding


def _few_elements(response: pb.StepResponse) -> None:
    del response.observations[BOARD].floats.array[5:]


def _unknown_field(response: pb.StepResponse) -> None:
    """The board's FloatArray holds, instead of its array, an unknown field of its size:
    the bytes are where the array's would be, but they are not its values."""
    floats = response.observations[BOARD].floats
    body = np.full(6, 7.0, np.float32).tobytes()
    floats.Clear()
    floats.MergeFromString(bytes([2 << 3 | 2, len(body)]) + body)


FAULTS: dict[str, tuple[Callable[[pb.StepResponse], None], str]] = {
    "missing": (_missing, "lacks the requested observation 'board'"),
    "unknown uid": (_unknown, "observation UID 99, which is not in the server's specs"),
    "int64 for float32": (_int64, "'board' (UID 2) as int64s (INT64 (int64)) but its spec"),
    "huge shape": (_huge_shape, "'board' (UID 2) with shape [52428800, 1] but its spec"),
    "too few elements": (
        _few_elements,
        "'board' (UID 2) with shape [2, 3] (6 elements) but a payload of 5",
    ),
    "unknown field for the array": (_unknown_field, "(6 elements) but a payload of 0 elements"),
}


def _serving(modify: Callable[[int, pb.StepResponse], None]) -> Any:
    """A faulty server answering each step with ``_good(paddle)``, changed by ``modify``
    (``paddle`` is the step's action, 0 for the reset's first step)."""
    specs = _specs()

    def answer(request: pb.EnvironmentRequest) -> pb.EnvironmentResponse:
        ordinary = lifecycle(request, specs)
        if ordinary is not None:
            return ordinary
        action = request.step.actions.get(PADDLE)
        paddle = int(np.frombuffer(action.int8s.array, np.int8)[0]) if action else 0
        response = _good(paddle)
        modify(paddle, response)
        return pb.EnvironmentResponse(step=response)

    return faulty_server(answer)


@pytest.fixture(params=list(FAULTS))
def fault(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    breaks, message = FAULTS[request.param]

    def modify(paddle: int, response: pb.StepResponse) -> None:
        if paddle == -1:
            breaks(response)

    with _serving(modify) as address:
        yield address, message


def _check(error: BaseException, message: str) -> None:
    assert isinstance(error, errors.ObservationError), repr(error)
    assert isinstance(error, errors.ProtocolError)
    assert not isinstance(error, errors.EmptyTensorError)
    assert message in str(error), str(error)
    assert "fix the server" in str(error) or "request fewer" in str(error)


@pytest.fixture
def env(fault: tuple[str, str]) -> Iterator[Any]:
    address, _ = fault
    with dmr.connect(address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, timeout=10)
        first = env.reset()
        assert first.first() and first.observation["board"].shape == (2, 3)  # no action: paddle 0
        yield env


def test_lockstep_step(env: Any, fault: tuple[str, str]) -> None:
    assert env.step(GOOD).observation["board"][0, 0] == 1.0
    with pytest.raises(errors.ObservationError) as caught:
        env.step(BAD)
    _check(caught.value, fault[1])
    assert caught.value.position is None


def test_step_async(env: Any, fault: tuple[str, str]) -> None:
    good, bad = env.step_async(GOOD), env.step_async(BAD)
    assert good.result(timeout=10).observation["board"][0, 0] == 1.0
    with pytest.raises(errors.ObservationError) as caught:
        bad.result(timeout=10)
    _check(caught.value, fault[1])
    assert bad.exception() is caught.value  # the Future failed, whichever is asked first
    later = env.step_async(BAD)
    _check(later.exception(timeout=10), fault[1])  # type: ignore[arg-type]
    with pytest.raises(errors.ObservationError):
        later.result()


@pytest.mark.parametrize("in_flight", [1, 4])
def test_step_iter(env: Any, fault: tuple[str, str], in_flight: int) -> None:
    received = []
    with pytest.raises(errors.ObservationError) as caught:
        for timestep in env.step_iter([GOOD, BAD] + [GOOD] * 4, in_flight=in_flight):
            received.append(timestep)
    _check(caught.value, fault[1])
    # The good step before the bad one is delivered, whether decoded alone or in a run.
    assert [float(t.observation["board"][0, 0]) for t in received] == [1.0]


def test_batch(fault: tuple[str, str]) -> None:
    address, message = fault
    with BatchedEnvironment.connect([address, address], timeout=10) as envs:
        assert envs.reset().observation["board"].shape == (2, 2, 3)
        board = envs.step({"paddle": np.ones(2, np.int8)}).observation["board"]
        assert board[:, 0, 0].tolist() == [1.0, 1.0]
        with pytest.raises(errors.WorldError) as caught:
            envs.step({"paddle": np.array([1, -1], np.int8)})
    assert caught.value.index == 1
    _check(caught.value.__cause__, message)  # type: ignore[arg-type]
    assert "board" in str(caught.value) or "99" in str(caught.value)


def test_observation_error_pickles() -> None:
    error = errors.ObservationError("bad board", "board", 2, 3)
    clone = pickle.loads(pickle.dumps(error))
    assert (str(clone), clone.name, clone.uid, clone.position) == ("bad board", "board", 2, 3)


@pytest.mark.parametrize(
    ("dtype", "data_type", "shape"),
    [
        (np.float32, pb.DataType.FLOAT, [2, 3]),
        (np.float64, pb.DataType.DOUBLE, []),
        (np.float32, pb.DataType.FLOAT, [0]),
        (np.float32, pb.DataType.FLOAT, [300]),  # a two-byte length varint
    ],
)
def test_stacked_columns_equal_each_tensor_unpacked(
    dtype: type, data_type: int, shape: list
) -> None:
    rng = np.random.default_rng(5)
    plan = ObservationPlan({1: pb.TensorSpec(name="x", shape=shape, dtype=data_type)}, [1])
    responses = []
    for _ in range(5):
        step = pb.StepResponse(state=pb.RUNNING)
        step.observations[1].CopyFrom(tensors.pack_tensor(rng.standard_normal(shape).astype(dtype)))
        responses.append(step)
    column = plan.columns(responses)["x"]
    expected = np.stack([tensors.unpack_tensor(r.observations[1]) for r in responses])
    assert isinstance(column, np.ndarray) and column.dtype == dtype
    assert column.shape == (5, *shape) and np.array_equal(column, expected)
    assert column.flags.writeable and column.flags.c_contiguous


def test_wrong_element_counts_that_add_up_are_still_refused() -> None:
    """Two worlds' boards of 5 and 7 floats (the spec says 6): joined, they have the size of
    two good ones. The stacked decode must check each, not the sum, or a step is wrong."""

    def modify(paddle: int, response: pb.StepResponse) -> None:
        if paddle in (2, -1):  # 2: 5 floats, -1: 7 floats
            response.observations[BOARD].floats.array[:] = [0.0] * (5 if paddle == 2 else 7)

    with (
        _serving(modify) as address,
        BatchedEnvironment.connect([address, address], timeout=10) as envs,
    ):
        envs.reset()
        with pytest.raises(errors.WorldError) as caught:
            envs.step({"paddle": np.array([2, -1], np.int8)})
    assert caught.value.index == 0
    _check(caught.value.__cause__, "(6 elements) but a payload of 5 elements")  # type: ignore[arg-type]
    board = pb.TensorSpec(name="board", shape=[2, 3], dtype=pb.DataType.FLOAT)
    tensors_ = [pb.Tensor(shape=[2, 3]) for _ in range(2)]
    tensors_[0].floats.array[:] = [0.0] * 5
    tensors_[1].floats.array[:] = [0.0] * 7
    assert tensors.stack_tensors(tensors_, board.dtype, board.shape) is None


def test_batch_refuses_bad_steps_after_it_learned_the_layout(fault: tuple[str, str]) -> None:
    """The batch decodes runs of same-shaped responses by their byte layout (``_fastpath.layout``) once
    it has checked one; a bad response after that is refused exactly as before."""
    address, message = fault
    with BatchedEnvironment.connect([address, address], timeout=10) as envs:
        envs.reset()
        for paddle in (1, 0, 1):
            board = envs.step({"paddle": np.full(2, paddle, np.int8)}).observation["board"]
            assert board.tolist() == [[[float(paddle)] * 3] * 2] * 2
        assert envs._decoder is not None and envs._decoder._plan._layout is not None
        with pytest.raises(errors.WorldError) as caught:
            envs.step({"paddle": np.array([1, -1], np.int8)})
    assert caught.value.index == 1
    _check(caught.value.__cause__, message)  # type: ignore[arg-type]


def _random_response(rng: np.random.Generator, specs: dict[int, pb.TensorSpec]) -> pb.StepResponse:
    step = pb.StepResponse(state=int(rng.choice([pb.RUNNING, pb.TERMINATED, pb.INTERRUPTED])))
    for uid, spec in specs.items():
        dtype = tensors.DATA_TYPE_TO_NUMPY[spec.dtype]
        if dtype.kind == "f":
            value = rng.standard_normal(list(spec.shape)).astype(dtype)
            value.flat[:1] = np.nan  # NaN payloads decode bit for bit
        else:
            value = rng.integers(0, 2 if dtype.kind == "b" else 100, list(spec.shape)).astype(dtype)
        step.observations[uid].CopyFrom(tensors.pack_tensor(value))
    return step


def test_runs_decoded_by_layout_equal_each_tensor_unpacked() -> None:
    rng = np.random.default_rng(7)
    specs = {
        1: pb.TensorSpec(name="board", shape=[10, 5], dtype=pb.DataType.FLOAT),
        2: pb.TensorSpec(name="reward", shape=[], dtype=pb.DataType.DOUBLE),
        3: pb.TensorSpec(name="pixels", shape=[4, 40], dtype=pb.DataType.UINT8),  # 2-byte length
        4: pb.TensorSpec(name="signed", shape=[3], dtype=pb.DataType.INT8),
        5: pb.TensorSpec(name="flags", shape=[2], dtype=pb.DataType.BOOL),
        6: pb.TensorSpec(name="empty", shape=[0], dtype=pb.DataType.FLOAT),
    }
    plan = ObservationPlan(specs, sorted(specs))
    for run in range(4):
        responses = [_random_response(rng, specs) for _ in range(1 + run * 3)]
        columns = plan.columns(responses)
        assert plan._layout is not None  # learned from the first run, used by the rest
        # (the first run is decoded tensor by tensor: its bools come as a list)
        for uid, spec in specs.items():
            expected = np.stack([tensors.unpack_tensor(r.observations[uid]) for r in responses])
            column = columns[spec.name] if run else np.asarray(columns[spec.name])
            assert isinstance(column, np.ndarray) and column.dtype == expected.dtype
            assert column.shape == expected.shape and column.tobytes() == expected.tobytes()
            assert column.flags.writeable and column.flags.c_contiguous


def test_a_run_that_does_not_fit_the_layout_is_decoded_and_checked_as_before() -> None:
    specs = {1: pb.TensorSpec(name="board", shape=[2, 3], dtype=pb.DataType.FLOAT)}
    plan = ObservationPlan(specs, [1])
    rng = np.random.default_rng(8)
    plan.columns([_random_response(rng, specs) for _ in range(2)])
    layout = plan._layout
    assert layout is not None
    # Another layout that is still right (an unrequested known UID would be, too): a board
    # sent as one broadcast element. Same total length as nothing else: decoded tensor by tensor.
    broadcast = _random_response(rng, specs)
    broadcast.observations[1].floats.array[:] = [2.5]
    column = plan.columns([_random_response(rng, specs), broadcast])["board"]
    assert np.array_equal(np.asarray(column[1]), np.full((2, 3), 2.5, np.float32))
    # A wrong shape whose bytes have the layout's length: refused, naming the position.
    wrong = _random_response(rng, specs)
    wrong.observations[1].shape[:] = [3, 2]
    assert len(wrong.SerializeToString()) == layout.length
    with pytest.raises(errors.ObservationError) as caught:
        plan.columns([_random_response(rng, specs), wrong])
    assert caught.value.position == 1 and "with shape [3, 2]" in str(caught.value)


def test_single_responses_decoded_by_layout_equal_the_checked_decode() -> None:
    """Lockstep ``step`` and ``step_async`` decode one response at a time by the layout too:
    the same values, types (NumPy scalars for scalar specs) and writable arrays."""
    rng = np.random.default_rng(9)
    specs = {
        1: pb.TensorSpec(name="board", shape=[10, 5], dtype=pb.DataType.FLOAT),
        2: pb.TensorSpec(name="reward", shape=[], dtype=pb.DataType.FLOAT),
        3: pb.TensorSpec(name="flag", shape=[], dtype=pb.DataType.BOOL),
        4: pb.TensorSpec(name="byte", shape=[], dtype=pb.DataType.INT8),
        5: pb.TensorSpec(name="pixels", shape=[3, 50], dtype=pb.DataType.UINT8),
        6: pb.TensorSpec(name="empty", shape=[0], dtype=pb.DataType.DOUBLE),
    }
    plan = ObservationPlan(specs, sorted(specs))
    checked = ObservationPlan(specs, sorted(specs))  # never given whole responses: no layout
    for _ in range(6):
        response = _random_response(rng, specs)
        fast = plan.decode_response(response)
        assert plan._layout is not None  # learned from the first response
        slow = checked.decode(response.observations)
        assert fast.keys() == slow.keys()
        for name, value in slow.items():
            assert type(fast[name]) is type(value), name
            assert np.asarray(fast[name]).tobytes() == np.asarray(value).tobytes(), name
            if isinstance(value, np.ndarray):
                assert fast[name].shape == value.shape
                # (byte payloads decode to read-only views when checked one by one)
                assert fast[name].flags.writeable or not value.flags.writeable
    wrong = _random_response(rng, specs)
    wrong.observations[1].shape[:] = [5, 10]
    with pytest.raises(errors.ObservationError, match=r"with shape \[5, 10\]"):
        plan.decode_response(wrong)
