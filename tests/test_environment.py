"""DmEnvAdaptor and the world helpers, against the embedded server."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
import unittest
from collections.abc import Iterator
from typing import Any

import dm_env
import numpy as np
import pytest
from compare import assert_same
from conftest import sigstop
from dm_env import specs as dm_specs
from dm_env import test_utils
from faulty import counting_server

from dm_env_rpc_client import errors, tensors
from dm_env_rpc_client._adaptor.stacked import StackedDecoder
from dm_env_rpc_client._fastpath.decode import ObservationPlan
from dm_env_rpc_client._proto import dm_env_rpc_pb2, properties_pb2
from dm_env_rpc_client.connection import Connection, connect
from dm_env_rpc_client.environment import (
    DmEnvAdaptor,
    create_and_join_world,
    create_world,
    destroy_world,
    join_world,
    leave_world,
    reset_world,
)
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch

StepType = dm_env.StepType


class Nested(dm_env.Environment):
    """Nested actions and observations, a string and a variable-length observation."""

    def __init__(self, length: int = 5) -> None:
        self._length = length
        self._t = 0

    def reset(self) -> dm_env.TimeStep:
        self._t = 0
        return dm_env.restart(self._obs())

    def step(self, action: Any) -> dm_env.TimeStep:
        self._t += 1
        if self._t >= self._length:
            return dm_env.termination(np.float32(1.0), self._obs())
        return dm_env.transition(np.float32(0.5), self._obs(), np.float32(0.9))

    def _obs(self) -> dict[str, Any]:
        return {
            "body": {"x": np.float32(self._t), "name": "walker"},
            "history": np.arange(self._t, dtype=np.int64),
        }

    def observation_spec(self) -> dict[str, Any]:
        return {
            "body": {
                "x": dm_specs.Array((), np.float32, name="x"),
                "name": dm_specs.StringArray((), name="name"),
            },
            "history": dm_specs.Array((-1,), np.int64, name="history"),
        }

    def action_spec(self) -> dict[str, Any]:
        return {
            "arm": {
                "force": dm_specs.BoundedArray((2,), np.float32, -1.0, 1.0, name="force"),
                "grip": dm_specs.DiscreteArray(3, name="grip"),
            }
        }

    def reward_spec(self) -> dm_specs.Array:
        return dm_specs.Array((), np.float32, name="reward")

    def discount_spec(self) -> dm_specs.BoundedArray:
        return dm_specs.BoundedArray((), np.float32, 0.0, 1.0, name="discount")


class _ServedEnvTest(test_utils.EnvironmentTestMixin):
    make_env: Any = None

    def setUp(self) -> None:
        self._server = serve(type(self).make_env)
        self._conn = connect(self._server.address, timeout=10)
        super().setUp()  # type: ignore[misc]

    def tearDown(self) -> None:
        super().tearDown()  # type: ignore[misc]
        self._conn.close()
        self._server.stop()

    def make_object_under_test(self) -> DmEnvAdaptor:
        return create_and_join_world(self._conn, {}, {}).env


class CatchMixinTest(_ServedEnvTest, unittest.TestCase):
    make_env = staticmethod(lambda settings: Catch(rows=4, **settings))


class NestedMixinTest(_ServedEnvTest, unittest.TestCase):
    make_env = staticmethod(lambda settings: Nested(**settings))


@pytest.fixture
def conn(catch_server: Server) -> Iterator[Connection]:
    with connect(catch_server.address, timeout=10) as connection:
        yield connection


def test_step_types_rewards_and_discounts(conn: Connection) -> None:
    env, _ = create_and_join_world(conn, {"rows": 3, "seed": 0}, {})
    first = env.reset()
    assert first.step_type == StepType.FIRST and first.reward is None
    assert set(first.observation) == {"board"}
    assert first.observation["board"].shape == (3, 5)
    mid = env.step({"paddle": 0})
    assert mid.step_type == StepType.MID and mid.reward == 0.0 and mid.discount == 1.0
    last = env.step({"paddle": 0})
    assert last.step_type == StepType.LAST and last.reward in (-1.0, 1.0) and last.discount == 0.0
    assert env.step({"paddle": 0}).step_type == StepType.FIRST  # the next sequence


def test_requested_observations_and_reward_on_request(conn: Connection) -> None:
    world = create_world(conn, {"rows": 3})
    env = join_world(conn, world, requested_observations=["board", "reward"])
    env.reset()
    step = env.step({"paddle": 1})
    assert (
        set(step.observation) == {"board", "reward"} and step.reward == step.observation["reward"]
    )
    env.close()
    with pytest.raises(errors.UnknownNameError, match="'nope'.*'board'"):
        join_world(conn, world, requested_observations=["nope"])
    leave_world(conn)


def test_unknown_action_and_validation_errors(conn: Connection) -> None:
    env, _ = create_and_join_world(conn, {}, {})
    env.reset()
    with pytest.raises(errors.UnknownNameError, match="Known names: 'paddle'"):
        env.step({"stick": 1})
    with pytest.raises(errors.SpecValidationError, match=r"'paddle' must lie in \[-1, 1\]"):
        env.step({"paddle": 3})
    assert env.step({"paddle": -1}).step_type == StepType.MID


def test_state_transition_errors_name_both_states(conn: Connection) -> None:
    env, _ = create_and_join_world(conn, {"rows": 3}, {})
    env._last_state = dm_env_rpc_pb2.EnvironmentStateType.TERMINATED
    response = dm_env_rpc_pb2.StepResponse(state=dm_env_rpc_pb2.EnvironmentStateType.INTERRUPTED)
    with pytest.raises(errors.ProtocolError, match="TERMINATED to INTERRUPTED.*sequence"):
        env.step_response(response)


def test_no_discount_observation_gives_state_based_discount(conn: Connection) -> None:
    world = create_world(conn, {"rows": 3, "max_steps": 1})
    env = join_world(conn, world, requested_observations=["board"])
    env._has_discount = False
    env._hidden = ["reward"]
    env._uids = [env.observation_manager.name_to_uid(n) for n in ("board", "reward")]
    env._plan = ObservationPlan(env._wire_specs.observations, env._uids)
    first = env.reset()
    assert first.discount is None
    truncated = env.step({"paddle": 0})
    assert truncated.step_type == StepType.LAST and truncated.discount == 1.0  # INTERRUPTED


def test_pipelined_stepping_across_sequence_boundaries(conn: Connection) -> None:
    env, _ = create_and_join_world(conn, {"rows": 3, "seed": 5}, {})
    steps = list(env.step_iter([{"paddle": 0}] * 12, in_flight=5))
    types = [step.step_type for step in steps]
    assert types == [StepType.FIRST, StepType.MID, StepType.LAST] * 4
    futures = [env.step_async({"paddle": 1}) for _ in range(6)]
    assert [f.result(timeout=10).step_type for f in futures] == [
        StepType.FIRST,
        StepType.MID,
        StepType.LAST,
    ] * 2
    with pytest.raises(ValueError, match="in_flight"):
        list(env.step_iter([{}], in_flight=0))


def test_step_async_makes_each_timestep_in_the_thread_that_asks(conn: Connection) -> None:
    """The reader thread only files responses (in order); the TimeStep is made on the first
    ``result()`` or ``exception()``, once, in the caller's thread, whatever order they come in."""
    env, _ = create_and_join_world(conn, {"rows": 3, "seed": 5}, {})
    made = []
    timestep_of = env._timestep

    def recording(step_type: Any, response: Any) -> Any:
        made.append(threading.current_thread())
        return timestep_of(step_type, response)

    env._timestep = recording  # type: ignore[method-assign]
    futures = [env.step_async({"paddle": 1}) for _ in range(7)]
    assert futures[-1].exception(timeout=10) is None
    results = [future.result(timeout=10) for future in reversed(futures)][::-1]
    assert [t.step_type for t in results] == [StepType.FIRST, StepType.MID, StepType.LAST] * 2 + [
        StepType.FIRST
    ]
    assert made == [threading.current_thread()] * 7  # once each, here
    assert futures[0].result() is results[0]  # made once
    seen = []
    env.step_async({"paddle": 1}).add_done_callback(lambda f: seen.append(f.result().step_type))
    assert env.step({"paddle": 0}).step_type == StepType.LAST
    assert seen == [StepType.MID]


@pytest.mark.parametrize("in_flight", [3, 64])
@pytest.mark.parametrize("env_name", ["catch", "nested"])
def test_lockstep_and_pipelined_give_identical_timesteps(env_name: str, in_flight: int) -> None:
    make = {"catch": lambda s: Catch(**s), "nested": lambda s: Nested(**s)}[env_name]
    settings = {"rows": 4, "seed": 9} if env_name == "catch" else {"length": 4}
    rng = np.random.default_rng(0)
    if env_name == "catch":
        actions = [{"paddle": int(a)} for a in rng.integers(-1, 2, 30)]
    else:
        actions = [{"arm": {"force": np.zeros(2, np.float32), "grip": 1}} for _ in range(30)]

    def run(how: str) -> list[dm_env.TimeStep]:
        with serve(make) as server, connect(server.address, timeout=10) as conn:
            env, _ = create_and_join_world(conn, settings, {}, timeout=10)
            first = [env.reset()]
            if how == "step_iter":
                return first + list(env.step_iter(actions, in_flight=in_flight))
            if how == "one batch":  # every response in before decoding: all in one batch
                window = collections.deque()
                for action in actions:
                    request = env.step_request(action)
                    window.append((request, conn.send_async(request)))
                for _, future in window:
                    future.result(timeout=10)
                return first + list(env._finished_steps(window, StackedDecoder(env), 1))
            return first + [env.step(action) for action in actions]

    lockstep = run("lockstep")
    for how in ("step_iter", "one batch"):
        for a, b in zip(lockstep, run(how), strict=True):
            assert_same(a.step_type, b.step_type)
            assert_same(a.reward, b.reward)
            assert_same(a.discount, b.discount)
            assert_same(a.observation, b.observation)


def test_reset_refreshes_specs_and_close_is_idempotent(conn: Connection) -> None:
    env, world = create_and_join_world(conn, {}, {})
    env.reset()
    env.step({"paddle": 0})
    assert env.reset().step_type == StepType.FIRST
    assert env.action_spec()["paddle"].dtype == np.int8
    assert isinstance(env.discount_spec(), dm_specs.BoundedArray)
    env.close()
    env.close()
    with pytest.raises(errors.ConnectionClosedError, match="closed"):
        env.step({"paddle": 0})
    # close destroyed the world it created; the reference's adaptor does not, so code written
    # for it destroys the world itself afterwards: that one request is answered as done (issue
    # 24), a second one gets the server's NOT_FOUND.
    destroy_world(conn, world)
    with pytest.raises(errors.NotFoundError):
        destroy_world(conn, world)


def test_reset_sends_its_settings(conn: Connection) -> None:
    env, _ = create_and_join_world(conn, {"rows": 2, "columns": 40}, {})

    def first_boards(seed: int) -> list[list[float]]:
        boards = [env.reset(settings={"seed": seed}).observation["board"][0].tolist()]
        boards += [env.step({"paddle": 0}).observation["board"][0].tolist() for _ in range(4)]
        return boards  # rows=2: every other step is FIRST, each with a new ball

    assert first_boards(3) == first_boards(3) != first_boards(4)
    with pytest.raises(errors.InvalidArgumentError, match="'colour'"):
        env.reset(settings={"colour": 1})
    env.close()


def test_helpers_accept_nested_numpy_settings_and_reset_world(conn: Connection) -> None:
    world = create_world(conn, {"rows": np.int64(5), "columns": 4})
    env = join_world(conn, world)
    assert env.observation_spec()["board"].shape == (5, 4)
    env.reset()
    reset_world(conn, world)
    # The server starts a new sequence: the ball is back in the top row (the adaptor
    # cannot tell this from a MID step: ResetWorld from a joined connection acts like Reset).
    assert env.step({"paddle": 0}).observation["board"][0].max() == 1.0
    env.close()
    destroy_world(conn, world)


def test_create_and_join_cleans_up_and_raises_the_join_error(conn: Connection) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="'team'"):
        create_and_join_world(conn, {}, {"team": 1})
    # The world it created was destroyed: only the next one exists.
    with pytest.raises(errors.NotFoundError, match=r"Known worlds: \(none\)"):
        destroy_world(conn, "world-1")


def test_properties_through_the_adaptor(conn: Connection) -> None:
    env, _ = create_and_join_world(conn, {"rows": 7}, {})
    props = env.properties
    assert props.read("rows") == 7 and props["columns"] == 5
    props.write("stats.catch_reward", 2.5)
    assert props["stats.catch_reward"] == 2.5
    assert "stats.episodes" in props and "stats.nope" not in props
    assert sorted(props) == [
        "columns",
        "rows",
        "seed",
        "stats.catch_reward",
        "stats.episodes",
        "stats.miss_reward",
    ]
    listed = props.specs("stats")
    assert listed["stats.miss_reward"].writable and not listed["stats.episodes"].writable
    with pytest.raises(KeyError):
        props.read("nope")
    with pytest.raises(errors.NotFoundError, match="'nope'"):
        props["nope"] = 1
    with pytest.raises(PermissionError, match="read-only"):
        props.write("rows", 3)
    with pytest.raises(errors.TensorTypeError, match="FLOAT"):
        props.write("stats.miss_reward", "high")  # refused before sending
    wrong = properties_pb2.WritePropertyRequest(
        key="stats.miss_reward", value=tensors.pack_tensor(np.int32(1))
    )
    with pytest.raises(errors.InvalidArgumentError, match="float32") as info:
        props._send(write_property=wrong)  # the server's INVALID_ARGUMENT
    assert isinstance(info.value, ValueError)


def test_nested_environment_round_trip() -> None:
    with serve(lambda settings: Nested()) as server, connect(server.address, timeout=10) as conn:
        env, _ = create_and_join_world(conn, {}, {})
        assert set(env.action_spec()["arm"]) == {"force", "grip"}
        assert isinstance(env.action_spec()["arm"]["grip"], dm_specs.DiscreteArray)
        env.reset()
        step = env.step({"arm": {"force": np.array([0.5, -0.5], np.float32), "grip": 2}})
        assert step.observation["body"]["name"] == "walker"
        assert step.observation["history"].tolist() == [0]
        assert step.reward == 0.5 and step.discount == pytest.approx(0.9)
        assert "DmEnvAdaptor(world=" in repr(env) and "arm.force" in repr(env)


def test_flat_tensors_when_not_nested(catch_server: Server) -> None:
    with serve(lambda settings: Nested()) as server, connect(server.address, timeout=10) as conn:
        env = join_world(conn, "", nested_tensors=False)
        assert set(env.action_spec()) == {"arm.force", "arm.grip"}
        env.reset()
        step = env.step({"arm.force": np.zeros(2, np.float32), "arm.grip": 1})
        assert set(step.observation) == {"body.x", "body.name", "history"}


def test_every_adaptor_call_can_time_out(server_process) -> None:
    server = server_process()
    with connect(server.address, timeout=20) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=1)
        env.reset()
        sigstop(server.process)
        try:
            started = time.monotonic()
            with pytest.raises(errors.RequestTimeoutError, match="StepRequest request within 1 s"):
                env.step({"paddle": 1})
            with pytest.raises(errors.RequestTimeoutError, match="ResetRequest request within 0.2"):
                env.reset(timeout=0.2)
            with pytest.raises(errors.RequestTimeoutError, match="CreateWorldRequest"):
                create_and_join_world(conn, {}, {}, timeout=0.2)
            closing = time.monotonic()
            env.close(timeout=0.2)  # gives up quietly on a hung server
            assert time.monotonic() - closing < 2
            assert time.monotonic() - started < 15
        finally:
            os.kill(server.process.pid, signal.SIGCONT)


def test_driving_the_connection_yourself(conn: Connection) -> None:
    env, _ = create_and_join_world(conn, {"rows": 3}, {})
    env.reset()
    futures = [conn.send_async(env.step_request({"paddle": 0})) for _ in range(4)]
    timesteps = [env.step_response(future.result(timeout=10)) for future in futures]
    assert [t.step_type for t in timesteps] == [
        StepType.MID,
        StepType.LAST,
        StepType.FIRST,
        StepType.MID,
    ]
    with pytest.raises(errors.UnknownNameError, match="paddle"):
        env.step_request({"padle": 0})
    env.close()
    with pytest.raises(errors.ConnectionClosedError, match="environment is closed"):
        env.step_request({"paddle": 0})


def test_step_async_futures_carry_the_adaptors_own_errors_as_they_are(conn: Connection) -> None:
    # step_async over a Connection makes the TimeStep on the reader thread; an error of the
    # adaptor's own code there (here a reward override) reaches the Future unchanged, not as
    # a ProtocolError about the server's response.
    class Broken(DmEnvAdaptor):
        def reward(self, state: int, step_type: dm_env.StepType, observations: Any) -> Any:
            if step_type == dm_env.StepType.MID:
                raise KeyError("no reward today")
            return super().reward(state, step_type, observations)

    world = create_world(conn, {"rows": 5})
    specs = conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world)).specs
    env = Broken(conn, specs, world_name=world)
    assert env.reset().first()
    future = env.step_async({"paddle": 0})
    with pytest.raises(KeyError, match="no reward today"):
        future.result(timeout=10)
    env.close()


def test_a_refused_step_in_the_window_loses_none_before_it() -> None:
    """step_iter yields every step answered before a refused one, then raises its error;
    the steps after it still move the state machine on (count 9 ends the episode)."""
    with counting_server(refuse=5, delay=0.0) as address:
        env, _ = create_and_join_world(address, {}, {}, timeout=10)
        env.reset()
        got = []
        with pytest.raises(errors.InvalidArgumentError, match="refused step"):
            for timestep in env.step_iter([{}] * 8, in_flight=8):
                got.append(float(timestep.observation["x"][0]))
        assert got == [2.0, 3.0, 4.0]
        after = env.step({})
        assert after.observation["x"][0] == 10.0  # the answer to this request, not a late one
        assert after.first()  # count 9 was LAST, though it was never yielded
        env.close()


def test_stopping_step_iter_early_keeps_the_state_machine_in_step() -> None:
    with counting_server(refuse=None, delay=0.02) as address:
        env, _ = create_and_join_world(address, {}, {}, timeout=10)
        env.reset()
        for timestep in env.step_iter([{}] * 8, in_flight=8):
            assert timestep.observation["x"][0] == 2.0
            break  # steps 3 to 9 are still in flight or unread
        after = env.step({})
        assert after.observation["x"][0] == 10.0
        assert after.first()  # count 9 was LAST
        env.close()
