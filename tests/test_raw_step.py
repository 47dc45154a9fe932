"""A batch's step answers read on its loop without parsing (``_fastpath.raw_step``): the state
read from its byte only where the learned layout proves it is the state, else parsed as before."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors, tensors
from dm_env_rpc_client._batch import core as _core
from dm_env_rpc_client._fastpath import layout as _layout
from dm_env_rpc_client._fastpath.decode import ObservationPlan
from dm_env_rpc_client._fastpath.raw_step import RawStep, read_answer
from dm_env_rpc_client._proto import dm_env_rpc_pb2 as pb
from dm_env_rpc_client.server import Server

SPECS = {
    1: pb.TensorSpec(name="board", shape=[3, 2], dtype=pb.DataType.FLOAT),
    2: pb.TensorSpec(name="reward", shape=[], dtype=pb.DataType.FLOAT),
}


def _step(board: np.ndarray, state: int = pb.EnvironmentStateType.RUNNING) -> pb.StepResponse:
    step = pb.StepResponse(state=state)
    step.observations[1].CopyFrom(tensors.pack_tensor(board.astype(np.float32)))
    step.observations[2].CopyFrom(tensors.pack_tensor(np.float32(0.5)))
    return step


def _wire(step: pb.StepResponse) -> bytes:
    return pb.EnvironmentResponse(step=step).SerializeToString()


@pytest.fixture
def learned() -> _layout.Layout:
    plan = ObservationPlan(SPECS, [1, 2])
    body = _step(np.zeros((3, 2))).SerializeToString()
    layout = _layout.learn(body, plan.columns_spec)
    assert layout is not None and layout.state_at == 1
    return layout


def test_an_answer_that_fits_the_layout_is_read_without_parsing(
    learned: _layout.Layout,
) -> None:
    board = np.arange(6).reshape(3, 2)
    for state in (pb.EnvironmentStateType.RUNNING, pb.EnvironmentStateType.TERMINATED):
        answer = read_answer(_wire(_step(board, state)), learned)
        assert isinstance(answer, RawStep) and answer._message is None  # nothing parsed
        assert answer.state == state
        assert answer.body == _step(board, state).SerializeToString()
        # What recv reads of it parses on demand, to what the server sent.
        np.testing.assert_array_equal(tensors.unpack_tensor(answer.observations[1]), board)


def test_an_answer_that_does_not_fit_is_parsed_as_before(learned: _layout.Layout) -> None:
    board = np.ones((3, 2))
    # A state field again after the observations (protobuf keeps the last): longer, parsed.
    # Its first byte says RUNNING; it is TERMINATED.
    twice = _step(board).SerializeToString() + pb.StepResponse(state=2).SerializeToString()
    answer = read_answer(b"\x1a" + bytes([len(twice)]) + twice, learned)
    assert answer.state == pb.EnvironmentStateType.TERMINATED and answer._message is not None
    # Another shape: parsed, and its bytes kept for the plan to learn from.
    other = read_answer(_wire(_step(np.ones((2, 2)))), learned)
    assert other._message is not None and other.body == _step(np.ones((2, 2))).SerializeToString()
    # No layout yet: parsed.
    assert read_answer(_wire(_step(board)), None)._message is not None


def _frame_reads(frame: _layout.Frame, data: bytes) -> int | None:
    """What the batch's loop reads of an answer by its layout's frame (``BatchCore._landed_data``'s
    check): the state, or None where it falls back to ``read_answer``."""
    if len(data) != frame.length or data[frame.state_at] >= 0x80:
        return None
    if any(data[start:stop] != expected for start, stop, expected in frame.runs):
        return None
    return data[frame.state_at]


def test_the_loop_reads_by_the_frame_exactly_what_read_answer_reads(
    learned: _layout.Layout,
) -> None:
    frame = learned.frame
    assert frame is not None
    board = np.arange(6).reshape(3, 2)
    for state in (pb.EnvironmentStateType.RUNNING, pb.EnvironmentStateType.TERMINATED):
        data = _wire(_step(board, state))
        assert _frame_reads(frame, data) == state == read_answer(data, learned).state
        assert data[frame.body_at :] == _step(board, state).SerializeToString()
    # Every byte outside the payloads and the state: changed, the frame no longer fits (the
    # step field's tag and length included), and read_answer parses or refuses it.
    data = _wire(_step(board))
    varying = {frame.state_at}
    for slot in learned._slots:
        varying.update(range(frame.body_at + slot.start, frame.body_at + slot.stop))
    for position in set(range(len(data))) - varying:
        changed = bytearray(data)
        changed[position] ^= 0x01
        assert _frame_reads(frame, bytes(changed)) is None, position
    # The same answer with its length written in two bytes (valid protobuf): not the frame.
    body = _step(board).SerializeToString()
    padded = bytes([data[0], len(body) | 0x80, 0]) + body
    assert _frame_reads(frame, padded) is None
    assert read_answer(padded, learned).state == pb.EnvironmentStateType.RUNNING


def test_an_error_or_another_payload_raises_as_parsing_does(learned: _layout.Layout) -> None:
    error = pb.EnvironmentResponse(error={"code": 3, "message": "bad paddle"})
    with pytest.raises(errors.DmEnvRpcError, match="bad paddle"):
        read_answer(error.SerializeToString(), learned)
    reset = pb.EnvironmentResponse(reset=pb.ResetResponse())
    with pytest.raises(errors.ProtocolError):
        read_answer(reset.SerializeToString(), learned)


def test_a_batch_reads_its_answers_states_on_the_loop_and_decodes_the_same(
    catch_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two batches over the same seeded worlds: one whose loop reads states by the layout's
    # frame, one that parses every answer (no plan): the same steps, observations and states.
    read: list[bytes] = []

    def counted(data: bytes, layout: Any) -> Any:
        read.append(data)
        return read_answer(data, layout)

    monkeypatch.setattr(_core, "read_answer", counted)
    results = []
    for fast in (True, False):
        read.clear()
        with dmr.BatchedEnvironment.connect([catch_server.address], 3, seed=5) as batch:
            if not fast:
                batch._plan = None
            steps = [batch.reset()]
            for turn in range(30):
                steps.append(batch.step({"paddle": np.full(3, turn % 3 - 1, np.int8)}))
            if fast:
                assert batch._plan is not None and batch._plan._layout is not None
                # Once the layout is learned (from the first answers), none takes read_answer.
                assert len(read) < 10
            else:
                assert len(read) == 3 * 30  # every step (the reset answers another way)
            results.append(steps)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a.step_type, b.step_type)
        np.testing.assert_array_equal(a.state, b.state)
        np.testing.assert_array_equal(a.observation["board"], b.observation["board"])
        np.testing.assert_array_equal(a.reward, b.reward)
