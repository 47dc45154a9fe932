"""The embedded server, driven with raw EnvironmentRequests over a plain gRPC stream."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import dm_env
import grpc
import numpy as np
import pytest
from conftest import wait_for
from dm_env import specs as dm_specs
from google.protobuf import any_pb2, struct_pb2
from raw_stream import RawStream, uid_of

from dm_env_rpc_client import environment, tensors
from dm_env_rpc_client._proto import dm_env_rpc_pb2, properties_pb2
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch

State = dm_env_rpc_pb2.EnvironmentStateType
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


@pytest.fixture
def stream(catch_server: Server) -> Iterator[RawStream]:
    raw = RawStream(catch_server.address)
    yield raw
    raw.close()


@pytest.fixture
def joined(stream: RawStream) -> tuple[RawStream, Any]:
    world = stream.create(rows=4, columns=3, seed=1)
    return stream, stream.join(world)


def test_create_world_names_are_unique(stream: RawStream) -> None:
    names = {stream.create() for _ in range(3)}
    assert len(names) == 3


def test_bad_create_settings_are_named(stream: RawStream) -> None:
    error = stream.error(
        create_world=dm_env_rpc_pb2.CreateWorldRequest(
            settings={"colour": tensors.pack_tensor("red")}
        )
    )
    assert error.code == INVALID_ARGUMENT
    assert "'colour'" in error.message and "TypeError" in error.message
    error = stream.error(
        create_world=dm_env_rpc_pb2.CreateWorldRequest(settings={"rows": tensors.pack_tensor(1)})
    )
    assert "'rows'" in error.message and "integer >= 2" in error.message


def test_join_gives_flattened_specs_with_reward_and_discount(joined) -> None:
    _, specs = joined
    assert {s.name for s in specs.actions.values()} == {"paddle"}
    assert sorted(s.name for s in specs.observations.values()) == ["board", "discount", "reward"]
    board = specs.observations[uid_of(specs.observations, "board")]
    assert list(board.shape) == [4, 3] and board.dtype == dm_env_rpc_pb2.DataType.FLOAT
    paddle = specs.actions[uid_of(specs.actions, "paddle")]
    assert paddle.dtype == dm_env_rpc_pb2.DataType.INT8
    assert paddle.min.int8s.array == b"\xff" and paddle.max.int8s.array == b"\x01"


def test_join_errors(catch_server: Server) -> None:
    first, second = RawStream(catch_server.address), RawStream(catch_server.address)
    try:
        world = first.create()
        first.join(world)
        error = second.error(join_world=dm_env_rpc_pb2.JoinWorldRequest(world_name=world))
        assert error.code == FAILED_PRECONDITION and repr(world) in error.message
        error = second.error(join_world=dm_env_rpc_pb2.JoinWorldRequest(world_name="nope"))
        assert error.code == NOT_FOUND and "'nope'" in error.message
        error = first.error(join_world=dm_env_rpc_pb2.JoinWorldRequest(world_name=world))
        assert error.code == FAILED_PRECONDITION and "already joined" in error.message
        request = dm_env_rpc_pb2.JoinWorldRequest(
            world_name=world, settings={"team": tensors.pack_tensor(1)}
        )
        assert "'team'" in second.error(join_world=request).message
    finally:
        first.close()
        second.close()


def test_default_world_is_joined_without_create(stream: RawStream) -> None:
    specs = stream.join("")
    response = stream.step(observations=[uid_of(specs.observations, "board")])
    assert response.state == State.RUNNING
    assert tensors.unpack_tensor(next(iter(response.observations.values()))).shape == (10, 5)


def _paddle(specs: Any, value: Any, dtype: Any = np.int8) -> dict[int, Any]:
    return {uid_of(specs.actions, "paddle"): tensors.pack_tensor(value, dtype)}


def test_step_sequence_terminates_and_restarts(joined) -> None:
    stream, specs = joined
    board, reward = uid_of(specs.observations, "board"), uid_of(specs.observations, "reward")
    discount = uid_of(specs.observations, "discount")
    first = stream.step(actions={999: tensors.pack_tensor(0)}, observations=[board, reward])
    assert first.state == State.RUNNING
    assert set(first.observations) == {board, reward}
    assert tensors.unpack_tensor(first.observations[reward]) == 0.0  # neutral on FIRST
    states = []
    for _ in range(3):
        response = stream.step(_paddle(specs, 0), observations=[reward, discount])
        states.append(response.state)
    assert states == [State.RUNNING, State.RUNNING, State.TERMINATED]
    assert tensors.unpack_tensor(response.observations[discount]) == 0.0
    assert tensors.unpack_tensor(response.observations[reward]) in (-1.0, 1.0)
    restarted = stream.step(actions={999: tensors.pack_tensor(0)}, observations=[board])
    assert restarted.state == State.RUNNING


def test_only_requested_observations_and_unknown_uid(joined) -> None:
    stream, _ = joined
    assert stream.step().observations == {}
    error = stream.error(step=dm_env_rpc_pb2.StepRequest(requested_observations=[77]))
    assert error.code == INVALID_ARGUMENT and "observation UID 77" in error.message


@pytest.mark.parametrize(
    ("actions", "match"),
    [
        (lambda s: {999: tensors.pack_tensor(np.int8(0))}, "Unknown action UID 999"),
        (lambda s: _paddle(s, 0, np.float32), "'paddle'.*expected dtype int8 but got float32"),
        (lambda s: _paddle(s, [0, 0], np.int8), "'paddle'.*shape"),
        (lambda s: _paddle(s, 2, np.int8), "'paddle'.*(bound|minimum|maximum)"),
    ],
)
def test_bad_actions_are_named(joined, actions, match: str) -> None:
    stream, specs = joined
    stream.step()  # start the sequence: its actions are ignored
    error = stream.error(step=dm_env_rpc_pb2.StepRequest(actions=actions(specs)))
    assert error.code == INVALID_ARGUMENT
    assert __import__("re").search(match, error.message), error.message
    assert stream.step(_paddle(specs, 1)).state == State.RUNNING  # the stream goes on


def test_truncation_is_interrupted(stream: RawStream) -> None:
    stream.join(stream.create(rows=10, max_steps=2))
    states = [stream.step().state for _ in range(4)]
    assert states == [State.RUNNING, State.RUNNING, State.INTERRUPTED, State.RUNNING]


def test_reset_and_reset_world(joined) -> None:
    stream, specs = joined
    stream.step()
    reset = stream.ok(reset=dm_env_rpc_pb2.ResetRequest())
    assert reset.specs == specs
    assert stream.step().state == State.RUNNING
    error = stream.error(reset=dm_env_rpc_pb2.ResetRequest(settings={"x": tensors.pack_tensor(1)}))
    assert error.code == INVALID_ARGUMENT and "'x'" in error.message
    error = stream.error(
        reset=dm_env_rpc_pb2.ResetRequest(settings={"seed": tensors.pack_tensor(-1)})
    )
    assert error.code == INVALID_ARGUMENT and "'seed'" in error.message
    stream.ok(leave_world=dm_env_rpc_pb2.LeaveWorldRequest())
    error = stream.error(reset=dm_env_rpc_pb2.ResetRequest())
    assert error.code == FAILED_PRECONDITION and "JoinWorldRequest" in error.message
    world = stream.create()
    stream.ok(reset_world=dm_env_rpc_pb2.ResetWorldRequest(world_name=world))
    error = stream.error(reset_world=dm_env_rpc_pb2.ResetWorldRequest(world_name="nope"))
    assert error.code == NOT_FOUND


def _first_ball_columns(stream: RawStream, reset: dict[str, Any], episodes: int) -> list[int]:
    """Resets with ``reset`` settings, then the ball's column in each episode's first board."""
    stream.ok(reset=dm_env_rpc_pb2.ResetRequest(settings=environment.pack_settings(reset)))
    columns = []
    for _ in range(episodes):
        first = stream.step(observations=[1])  # Catch's UID 1 is the board
        board = tensors.unpack_tensor(first.observations[1])
        columns.append(int(np.argmax(board[0])))
        while stream.step().state == State.RUNNING:
            pass
    return columns


def test_reset_settings_reach_the_environment_hook(stream: RawStream) -> None:
    stream.join(stream.create(rows=3, columns=50))
    seeded = _first_ball_columns(stream, {"seed": 7}, 3)
    other = _first_ball_columns(stream, {"seed": 8}, 3)
    assert _first_ball_columns(stream, {"seed": 7}, 3) == seeded != other
    world = stream.create(rows=3, columns=50)
    stream.ok(leave_world=dm_env_rpc_pb2.LeaveWorldRequest())
    stream.join(world)
    stream.ok(
        reset_world=dm_env_rpc_pb2.ResetWorldRequest(
            world_name=world, settings=environment.pack_settings({"seed": 7})
        )
    )
    assert _first_ball_columns(stream, {}, 3) == seeded


def test_reset_world_interrupts_the_other_connection(catch_server: Server) -> None:
    agent, host = RawStream(catch_server.address), RawStream(catch_server.address)
    try:
        world = host.create()
        agent.join(world)
        assert [agent.step().state for _ in range(2)] == [State.RUNNING] * 2
        host.ok(reset_world=dm_env_rpc_pb2.ResetWorldRequest(world_name=world))
        assert agent.step().state == State.INTERRUPTED
        assert agent.step().state == State.RUNNING
    finally:
        agent.close()
        host.close()


def test_leave_and_destroy(stream: RawStream) -> None:
    stream.ok(leave_world=dm_env_rpc_pb2.LeaveWorldRequest())  # not joined: a no-op
    world = stream.create()
    stream.join(world)
    error = stream.error(destroy_world=dm_env_rpc_pb2.DestroyWorldRequest(world_name=world))
    assert error.code == FAILED_PRECONDITION and "leave it" in error.message
    stream.ok(leave_world=dm_env_rpc_pb2.LeaveWorldRequest())
    stream.ok(destroy_world=dm_env_rpc_pb2.DestroyWorldRequest(world_name=world))
    error = stream.error(destroy_world=dm_env_rpc_pb2.DestroyWorldRequest(world_name=world))
    assert error.code == NOT_FOUND


def test_properties_extension(joined) -> None:
    stream, _ = joined

    def ok(**payload: Any) -> properties_pb2.PropertyResponse:
        response = stream.properties(**payload)
        assert response.WhichOneof("payload") == "extension", response.error
        out = properties_pb2.PropertyResponse()
        assert response.extension.Unpack(out)
        return out

    read = properties_pb2.ReadPropertyRequest
    assert tensors.unpack_tensor(ok(read_property=read(key="rows")).read_property.value) == 4
    listed = ok(list_property=properties_pb2.ListPropertyRequest()).list_property.values
    by_key = {value.spec.name: value for value in listed}
    assert set(by_key) == {"rows", "columns", "seed", "stats"}
    assert by_key["stats"].is_listable and not by_key["rows"].is_writable
    nested = ok(list_property=properties_pb2.ListPropertyRequest(key="stats"))
    writable = {v.spec.name for v in nested.list_property.values if v.is_writable}
    assert writable == {"stats.catch_reward", "stats.miss_reward"}
    write = properties_pb2.WritePropertyRequest
    ok(write_property=write(key="stats.catch_reward", value=tensors.pack_tensor(np.float32(5))))
    value = ok(read_property=read(key="stats.catch_reward")).read_property.value
    assert tensors.unpack_tensor(value) == 5.0

    cases = [
        ({"read_property": read(key="nope")}, NOT_FOUND, "'nope'"),
        (
            {"write_property": write(key="rows", value=tensors.pack_tensor(3))},
            PERMISSION_DENIED,
            "read-only",
        ),
        (
            {"write_property": write(key="stats.miss_reward", value=tensors.pack_tensor("x"))},
            INVALID_ARGUMENT,
            "float32",
        ),
    ]
    for payload, code, text in cases:
        response = stream.properties(**payload)
        assert response.error.code == code and text in response.error.message, response


def test_unsupported_extension(joined) -> None:
    stream, _ = joined
    other = any_pb2.Any()
    other.Pack(struct_pb2.Value(number_value=1))
    error = stream.error(extension=other)
    assert error.code == UNIMPLEMENTED and "not supported" in error.message


class _Nested(dm_env.Environment):
    """Nested, string and variable-length observations; raises on a magic action."""

    def __init__(self) -> None:
        self._count = 0

    def reset(self) -> dm_env.TimeStep:
        self._count = 0
        return dm_env.restart(self._obs())

    def step(self, action: Any) -> dm_env.TimeStep:
        if int(action["arm"]["force"]) == 7:
            raise RuntimeError("the arm broke")
        self._count += 1
        return dm_env.transition(np.float32(1.0), self._obs(), np.float32(0.5))

    def _obs(self) -> dict[str, Any]:
        return {
            "arm": {"angle": np.float64(self._count), "name": "left"},
            "trace": np.arange(self._count, dtype=np.int32),
        }

    def observation_spec(self) -> dict[str, Any]:
        return {
            "arm": {
                "angle": dm_specs.Array((), np.float64, name="angle"),
                "name": dm_specs.StringArray((), name="name"),
            },
            "trace": dm_specs.Array((-1,), np.int32, name="trace"),
        }

    def action_spec(self) -> dict[str, Any]:
        return {"arm": {"force": dm_specs.BoundedArray((), np.int32, 0, 10, name="force")}}


def test_nested_string_and_variable_observations_and_env_exceptions() -> None:
    with serve(lambda settings: _Nested()) as server:
        stream = RawStream(server.address)
        try:
            specs = stream.join("")
            names = {uid: s.name for uid, s in specs.observations.items()}
            assert sorted(names.values()) == [
                "arm.angle",
                "arm.name",
                "discount",
                "reward",
                "trace",
            ]
            trace_spec = specs.observations[uid_of(specs.observations, "trace")]
            assert list(trace_spec.shape) == [-1]
            stream.step()
            force = uid_of(specs.actions, "arm.force")
            response = stream.step(
                {force: tensors.pack_tensor(np.int32(3))}, observations=list(names)
            )
            values = {
                names[uid]: tensors.unpack_tensor(t) for uid, t in response.observations.items()
            }
            assert values["arm.name"] == "left" and values["arm.angle"] == 1.0
            assert values["trace"].tolist() == [0] and values["discount"] == 0.5
            error = stream.error(
                step=dm_env_rpc_pb2.StepRequest(actions={force: tensors.pack_tensor(np.int32(7))})
            )
            assert error.code == INTERNAL and "RuntimeError: the arm broke" in error.message
            response = stream.step(
                {force: tensors.pack_tensor(np.int32(1))}, observations=list(names)
            )
            values = {
                names[uid]: tensors.unpack_tensor(t) for uid, t in response.observations.items()
            }
            assert values["trace"].tolist() == [0, 1]
            error = stream.properties(read_property=properties_pb2.ReadPropertyRequest(key="x"))
            assert (
                error.error.code == UNIMPLEMENTED and "offers no properties" in error.error.message
            )
        finally:
            stream.close()


def test_two_clients_keep_separate_worlds(catch_server: Server) -> None:
    a, b = RawStream(catch_server.address), RawStream(catch_server.address)
    try:
        specs_a = a.join(a.create(rows=3, columns=3, seed=0))
        specs_b = b.join(b.create(rows=6, columns=4, seed=0))
        board_a = uid_of(specs_a.observations, "board")
        board_b = uid_of(specs_b.observations, "board")
        shape_a = tensors.unpack_tensor(a.step(observations=[board_a]).observations[board_a]).shape
        shape_b = tensors.unpack_tensor(b.step(observations=[board_b]).observations[board_b]).shape
        assert (shape_a, shape_b) == ((3, 3), (6, 4))
        assert [a.step().state for _ in range(2)][-1] == State.TERMINATED
        assert b.step().state == State.RUNNING
    finally:
        a.close()
        b.close()


def test_disconnect_leaves_and_destroys_created_worlds(catch_server: Server) -> None:
    owner, other = RawStream(catch_server.address), RawStream(catch_server.address)
    try:
        world = owner.create()
        owner.join(world)
        owner.close()

        def gone() -> bool:
            response = other.send(join_world=dm_env_rpc_pb2.JoinWorldRequest(world_name=world))
            return response.error.code == NOT_FOUND

        assert wait_for(gone, timeout=10)
    finally:
        other.close()


def _server_loop_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "dm_env_rpc_server-loop"}


def _server_loops() -> int:
    return len(_server_loop_threads())


def test_stop_ends_open_streams_and_leaves_no_thread() -> None:
    baseline = _server_loops()
    with serve(lambda settings: Catch(**settings)) as server:
        assert _server_loops() == baseline + 1  # one event loop serves every stream
        streams = [RawStream(server.address) for _ in range(3)]
        for raw in streams:
            raw.join(raw.create(seed=0))
        streams[0].close()  # a client goes away
        for raw in streams[1:]:
            assert raw.step().state == State.RUNNING
    assert wait_for(lambda: _server_loops() == baseline, timeout=10)
    for raw in streams[1:]:  # the streams still open when the server stopped have ended
        with pytest.raises(grpc.RpcError):
            raw.step()
        raw.close()


def test_stop_returns_while_a_step_never_does() -> None:
    entered, release = threading.Event(), threading.Event()

    class Stuck(Catch):
        def step(self, action: Any) -> dm_env.TimeStep:
            entered.set()
            release.wait(timeout=60)  # holds the server's event loop
            return super().step(action)

    server = serve(lambda settings: Stuck(**settings))
    raw = RawStream(server.address)
    try:
        raw.join(raw.create(seed=0))
        raw.step()  # the first step of a sequence resets
        raw.write(step=dm_env_rpc_pb2.StepRequest())
        assert entered.wait(timeout=10)
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 0})
        stopper.start()
        stopper.join(timeout=30)
        assert not stopper.is_alive(), "stop() hung on a step that never returns"
    finally:
        release.set()
        raw.close()


def test_a_port_in_use_is_refused_by_name(catch_server: Server) -> None:
    before = _server_loop_threads()
    with pytest.raises(OSError, match=f"'{catch_server.address}'; pick another port"):
        serve(lambda settings: Catch(**settings), catch_server.address)
    # The failed server's loop is gone: no loop thread that was not there before (compared by
    # identity, as an earlier test's server may still be ending its loop meanwhile).
    assert not _server_loop_threads() - before
    raw = RawStream(catch_server.address)
    try:
        assert raw.create(seed=0)  # the first server still serves
    finally:
        raw.close()


def test_streams_beyond_max_workers_are_refused() -> None:
    with serve(lambda settings: Catch(**settings), max_workers=1) as server:
        first = RawStream(server.address)
        try:
            first.join(first.create(seed=0))  # served before the second stream starts
            second = RawStream(server.address)
            with pytest.raises(grpc.RpcError) as refused:
                second.create(seed=0)
            second.close()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at most 1 streams" in refused.value.details()
            assert "--max-workers" in refused.value.details()
            assert first.step().state == State.RUNNING  # the first stream is untouched
        finally:
            first.close()


def test_pipelined_requests_are_answered_in_order(catch_server: Server) -> None:
    import dm_env_rpc_client as dmr

    with dmr.connect(catch_server.address, timeout=10) as conn:
        name = dmr.create_world(conn, {"rows": 3, "columns": 3, "seed": 0}, timeout=10)
        futures = [conn.send_async(dm_env_rpc_pb2.JoinWorldRequest(world_name=name))]
        futures += [conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(300)]
        futures.append(conn.send_async(dm_env_rpc_pb2.LeaveWorldRequest()))
        responses = [future.result(timeout=10) for future in futures]
    assert isinstance(responses[0], dm_env_rpc_pb2.JoinWorldResponse)
    assert isinstance(responses[-1], dm_env_rpc_pb2.LeaveWorldResponse)
    # 3 rows: every sequence is RUNNING, RUNNING, TERMINATED.
    states = [response.state for response in responses[1:-1]]
    assert states == [State.RUNNING, State.RUNNING, State.TERMINATED] * 100


def test_a_script_that_leaves_a_server_and_connections_open_still_exits() -> None:
    script = """
import numpy as np
import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.catch import Catch

server = dmr.serve(lambda settings: Catch(**settings))
conn = dmr.connect(server.address, timeout=10)
env, _ = dmr.create_and_join_world(conn, {}, {})
env.reset()
batch = dmr.BatchedEnvironment.connect([server.address], 2)
batch.send({"paddle": np.zeros(2, np.int8)}, [0, 1])
print("leaving everything open")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "leaving everything open" in result.stdout


@pytest.mark.parametrize("value", [0.5, -1.0, 1.0, 1.5, -5.0, float("nan"), float("inf")])
@pytest.mark.parametrize(
    "spec",
    [
        dm_specs.BoundedArray((), np.float32, -1.0, 1.0, name="x"),
        dm_specs.Array((), np.float32, name="x"),
        dm_specs.BoundedArray((), np.int8, -1, 1, name="x"),
    ],
    ids=["bounded float32", "float32", "bounded int8"],
)
def test_scalar_actions_are_checked_as_dm_env_checks_them(spec, value: float) -> None:
    # Scalar actions skip dm_env's validate() when in bounds; the outcome must not change.
    from dm_env_rpc_client.server._worlds import ServerError, World, _WireSpec

    if spec.dtype == np.int8 and not np.isfinite(value):
        return
    fast = _WireSpec(1, "x", spec)
    general = _WireSpec(1, "x", spec)
    general.scalar = False
    assert fast.scalar
    tensor = tensors.pack_tensor(np.asarray(value).astype(spec.dtype))

    def outcome(wire_spec: _WireSpec) -> object:
        try:
            decoded = World._decode(wire_spec, tensor)
        except ServerError as exc:
            return str(exc)
        return (type(decoded), decoded.dtype, decoded.shape, decoded.tobytes())

    assert outcome(fast) == outcome(general)


def test_worlds_of_equal_specs_share_their_wire_specs_and_others_do_not(stream: RawStream) -> None:
    from dm_env_rpc_client.server._registry import Registry

    registry = Registry(lambda settings: Catch(**settings))
    small, also_small = (registry.create({"rows": 4}, creator=None) for _ in range(2))
    large = registry.create({"rows": 6}, creator=None)
    small_again = registry.create({"rows": 4, "seed": 3}, creator=None)
    assert also_small.specs is small.specs and also_small.actions is small.actions
    assert small_again.observations is not small.observations  # made again after a large one
    assert large.specs is not small.specs
    boards = [world.observation_by_name["board"].shape for world in (small, large, small_again)]
    assert boards == [(4, 5), (6, 5), (4, 5)]
    # On the wire too: each join gives its own world's board, whatever was created before it.
    for rows in (4, 4, 6, 4):
        world = stream.create(rows=rows)
        specs = stream.join(world)
        board = next(s for s in specs.observations.values() if s.name == "board")
        assert tuple(board.shape) == (rows, 5)
        stream.send(leave_world=dm_env_rpc_pb2.LeaveWorldRequest())


def test_the_server_accepts_the_fast_keepalive_pings() -> None:
    """gRPC's default server policy takes one ping per 5 minutes while idle; the SDK's server
    takes one per 5 s, so dmr.FAST_KEEPALIVE_OPTIONS (10 s) never earns a strike. The option's
    name is checked against grpcio's own (a misspelled channel option is silently ignored)."""
    import pathlib

    from dm_env_rpc_client import FAST_KEEPALIVE_OPTIONS
    from dm_env_rpc_client import server as server_module

    options = dict(server_module._OPTIONS)
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= 5_000
    assert dict(FAST_KEEPALIVE_OPTIONS)["grpc.keepalive_time_ms"] >= 10_000
    known = b"".join(
        p.read_bytes() for p in pathlib.Path(grpc.__file__).parent.glob("_cython/*.so")
    )
    for name in options:
        assert name.encode() in known, name


@pytest.mark.parametrize(
    "value",
    [
        np.int64(-5),
        np.int32(7),
        np.uint64(2**64 - 1),
        np.uint32(3),
        np.float64(0.1),
        np.float32(0.1),
        np.bool_(True),
        np.int8(-1),
        "text",
        np.arange(3, dtype=np.int64),
        np.zeros((2, 1), np.float32),
        np.ones((1,), np.int32),
    ],
    ids=repr,
)
def test_settings_are_what_unpack_tensor_gives(value: Any) -> None:
    """A setting is unpack_tensor's value (type, dtype, shape, bits), nested by its dotted
    name (unpack_tensor reads a one-element scalar straight from the message: test_tensors)."""
    from dm_env_rpc_client.server._session import _settings

    packed = tensors.pack_tensor(value)
    read = _settings({"a.b": packed})["a"]["b"]
    general = tensors.unpack_tensor(packed)
    assert type(read) is type(general)
    assert np.asarray(read).dtype == np.asarray(general).dtype
    assert np.asarray(read).shape == np.asarray(general).shape
    assert np.asarray(read).tobytes() == np.asarray(general).tobytes()
    # A one-element Tensor with a shape stays an array.
    shaped = dm_env_rpc_pb2.Tensor(int64s=dm_env_rpc_pb2.Tensor.Int64Array(array=[4]), shape=[1])
    assert _settings({"n": shaped})["n"].shape == (1,)
