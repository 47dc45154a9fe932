"""The gymnasium bridge against real embedded servers: spaces, GymnasiumEnv, the VectorEnv."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import dm_env
import gymnasium
import numpy as np
import pytest
from dm_env import specs as dm_specs
from faulty import Counter
from gymnasium import error as gym_error
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import vector as vector_wrappers
from vector_helpers import over_two_servers
from zoo import SPACELESS, Zoo

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client.integrations import gymnasium as dgym
from dm_env_rpc_client.integrations.gymnasium import (
    AnyText,
    GymnasiumEnv,
    GymnasiumVectorEnv,
    spaces_from_specs,
)
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch
from dm_env_rpc_client.server.envs import LargeObservation


def _tensor_spec(spec: dm_specs.Array, name: str = "x") -> Any:
    return dmr.dm_env_spec_to_tensor_spec(spec, name)


@pytest.fixture
def zoo_server() -> Iterator[Server]:
    with serve(lambda settings: Zoo(**settings)) as server:
        yield server


def _zoo_names(server: Server) -> list[str]:
    with dmr.connect(server.address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, {}, {})
        names = [
            name
            for name in env.observation_manager.names()
            if name.split(".")[0] not in SPACELESS and name not in ("reward", "discount")
        ]
        env.close()
    return names


# --- packaging ---------------------------------------------------------------------------


def test_missing_gymnasium_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n.startswith("dm_env_rpc_client.integrations.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ImportError, match=r"pip install 'dm_env_rpc_client\[gymnasium\]'"):
        importlib.import_module("dm_env_rpc_client.integrations.gymnasium")


def test_the_core_never_imports_integrations() -> None:
    code = (
        "import sys, dm_env_rpc_client, dm_env_rpc_client.server, dm_env_rpc_client.cli;"
        "assert not [m for m in sys.modules if 'integrations' in m or m == 'gymnasium'], "
        "sorted(sys.modules)"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- spaces_from_specs: one test per row of the table -----------------------------------


def test_bounded_is_a_box_with_its_dtype_and_bounds_broadcast() -> None:
    space = dgym.space_from_spec(
        _tensor_spec(dm_specs.BoundedArray((2, 3), np.int32, -4, 9), "pos")
    )
    assert isinstance(space, spaces.Box) and space.dtype == np.int32 and space.shape == (2, 3)
    assert (space.low == -4).all() and (space.high == 9).all()
    per_element = dgym.space_from_spec(
        _tensor_spec(dm_specs.BoundedArray((2,), np.float32, [0.0, -1.0], [1.0, 2.0]))
    )
    assert per_element.low.tolist() == [0.0, -1.0] and per_element.high.tolist() == [1.0, 2.0]


def test_discrete_keeps_its_dtype() -> None:
    space = dgym.space_from_spec(_tensor_spec(dm_specs.DiscreteArray(5, dtype=np.uint8)))
    assert isinstance(space, spaces.Discrete) and space.n == 5 and space.start == 0
    assert space.dtype == np.uint8 and space.sample().dtype == np.uint8


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.float32, np.float64]
)
def test_unbounded_spans_the_dtype(dtype: Any) -> None:
    space = dgym.space_from_spec(_tensor_spec(dm_specs.Array((2,), dtype)))
    assert isinstance(space, spaces.Box) and space.dtype == dtype
    if np.dtype(dtype).kind == "f":
        assert np.isneginf(space.low).all() and np.isposinf(space.high).all()
    else:
        info = np.iinfo(dtype)
        assert (space.low == info.min).all() and (space.high == info.max).all()
    space.seed(0)
    assert all(space.contains(space.sample()) for _ in range(20))


def test_bool_is_a_bool_box() -> None:
    space = dgym.space_from_spec(_tensor_spec(dm_specs.Array((3,), np.bool_)))
    assert isinstance(space, spaces.Box) and space.dtype == np.bool_ and space.shape == (3,)
    assert space.contains(np.array([True, False, True]))


def test_scalar_string_is_text_that_admits_any_string() -> None:
    space = dgym.space_from_spec(_tensor_spec(dm_specs.StringArray(()), "label"))
    assert isinstance(space, AnyText) and isinstance(space, spaces.Text)
    for text in ["", "héllo wörld ✓", "\x00\n\t", "日本語", "x" * 10_000]:
        assert space.contains(text)
    assert not space.contains(b"bytes") and not space.contains(3)
    space.seed(1)
    assert all(space.contains(space.sample()) for _ in range(20))


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        (dm_specs.StringArray((2,)), "string array of shape [2]"),
        (dmr.specs.VariableArray((-1, 3), np.float32), "variable shape [-1, 3]"),
        (dm_specs.Array((), np.object_), "proto tensor"),
    ],
)
def test_tensors_without_a_space_are_named_with_the_way_out(spec: Any, what: str) -> None:
    with pytest.raises(
        errors.SpecError, match=f"observation .cam.trace. is .*{re.escape(what)}"
    ) as info:
        spaces_from_specs({1: _tensor_spec(spec, "cam.trace")})
    assert "requested_observations=" in str(info.value)
    with pytest.raises(errors.SpecError, match=r"action 'cam.trace'.*actions=\[\.\.\.\]"):
        spaces_from_specs([_tensor_spec(spec, "cam.trace")], kind="action")


def test_dotted_names_nest_and_names_select() -> None:
    tensor_specs = {
        1: _tensor_spec(dm_specs.Array((), np.float32), "arm.joint"),
        2: _tensor_spec(dm_specs.DiscreteArray(3), "arm.grip.mode"),
        3: _tensor_spec(dm_specs.StringArray((2,)), "labels"),
    }
    space = spaces_from_specs(tensor_specs, names=["arm.joint", "arm.grip.mode"])
    assert isinstance(space, spaces.Dict)
    assert isinstance(space["arm"]["joint"], spaces.Box)
    assert isinstance(space["arm"]["grip"]["mode"], spaces.Discrete)
    with pytest.raises(errors.UnknownNameError, match="'arm.elbow'.*arm.joint"):
        spaces_from_specs(tensor_specs, names=["arm.elbow"])


# --- the invariants, against the zoo ----------------------------------------------------


def _same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    else:
        assert np.asarray(a).dtype == np.asarray(b).dtype or isinstance(a, str), (a, b)
        np.testing.assert_array_equal(a, b)


def test_zoo_samples_are_accepted_and_observations_fit(zoo_server: Server) -> None:
    env = GymnasiumEnv(
        address=zoo_server.address,
        requested_observations=_zoo_names(zoo_server),
        create_world_settings={"length": 5},
    )
    env.action_space.seed(0)
    observation, _ = env.reset(seed=0)
    assert env.observation_space.contains(observation)
    endings = 0
    for step in range(40):
        action = env.action_space.sample()
        observation, _reward, terminated, truncated, _info = env.step(action)
        assert env.observation_space.contains(observation), (step, observation)
        if step % 6 != 5:  # not the first step of an episode, which ignores its action
            _same(action, observation["act"])
        endings += terminated
        assert not truncated
    assert endings == 40 // 6
    env.close()


def test_actions_left_out_are_left_to_the_server(zoo_server: Server) -> None:
    env = GymnasiumEnv(
        address=zoo_server.address,
        requested_observations=["act.i8", "act.text"],
        actions=["i8", "arm.grip"],
    )
    assert set(env.action_space.spaces) == {"i8", "arm"}
    env.reset()
    observation, *_ = env.step({"i8": np.int8(-3), "arm": {"grip": np.uint8(1)}})
    assert observation["act"]["i8"] == -3
    assert observation["act"]["text"] == ""  # the server's default for an action left out
    env.close()


def test_zoo_without_requested_observations_names_the_tensor(zoo_server: Server) -> None:
    with pytest.raises(errors.SpecError, match="'(strings|ragged|proto)'.*requested_observations"):
        GymnasiumEnv(address=zoo_server.address)
    # The failed construction destroyed its world and closed its connection: a new one works.
    GymnasiumEnv(address=zoo_server.address, requested_observations=["level"]).close()


def test_embedded_catch_samples_are_accepted(catch_server: Server) -> None:
    env = GymnasiumEnv(address=catch_server.address, unwrap_single=True)
    assert env.action_space == spaces.Box(-1, 1, (), np.int8)
    assert env.observation_space == spaces.Box(0.0, 1.0, (10, 5), np.float32)
    env.action_space.seed(3)
    env.reset(seed=3)
    for _ in range(30):
        observation, *_ = env.step(env.action_space.sample())
        assert env.observation_space.contains(observation)
    env.close()


# --- GymnasiumEnv ------------------------------------------------------------------------


def _episode(env: GymnasiumEnv, seed: int | None) -> list[Any]:
    observation, _ = env.reset(seed=seed)
    frames = [observation["board"]]
    terminated = truncated = False
    while not (terminated or truncated):
        observation, _, terminated, truncated, _ = env.step({"paddle": np.int8(1)})
        frames.append(observation["board"])
    return frames


def test_the_same_seed_gives_the_same_episode(catch_server: Server) -> None:
    env = GymnasiumEnv(address=catch_server.address, create_world_settings={"columns": 50})
    first = _episode(env, 7)
    unseeded = _episode(env, None)  # the server's RNG goes on
    again = _episode(env, 7)
    other = _episode(env, 8)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first[0], other[0]) and not np.array_equal(first[0], unseeded[0])
    assert env.np_random_seed == 8
    env.close()


def test_the_seed_setting_is_configurable_and_a_refusal_warns_once() -> None:
    with serve(lambda settings: LargeObservation(size=2, length=3)) as server:
        env = GymnasiumEnv(address=server.address)
        with pytest.warns(UserWarning, match="refused the reset setting 'seed'"):
            env.reset(seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            env.reset(seed=2)  # no second warning, no setting sent
            quiet = GymnasiumEnv(address=server.address, seed_setting=None)
            quiet.reset(seed=1)
        with pytest.raises(errors.InvalidArgumentError, match="'colour'"):
            env.reset(options={"settings": {"colour": 1}})
        env.close()
        quiet.close()


def test_a_step_after_a_timeout_gets_its_own_answer() -> None:
    """A server that answers one step late: that step raises RequestTimeoutError, and the
    next one gets its own answer (count 3), not the late one (count 2)."""
    Counter.gate.clear()
    Counter.gate_at = 2  # the second step answers late
    try:
        with serve(lambda settings: Counter(**settings)) as server:
            env = GymnasiumEnv(address=server.address, timeout=0.3, seed_setting=None)
            try:
                env.reset()
                assert env.step({"a": 0})[0]["count"] == 1
                with pytest.raises(errors.RequestTimeoutError):
                    env.step({"a": 0})
                Counter.gate.set()
                for count in (3, 4):
                    observation, _, terminated, truncated, _ = env.step({"a": 0})
                    assert observation["count"] == count
                    assert not terminated and not truncated
            finally:
                env.close()
    finally:
        Counter.gate.set()
        Counter.gate_at = -1


def test_termination_and_truncation_come_from_the_server_state(catch_server: Server) -> None:
    env = GymnasiumEnv(address=catch_server.address, create_world_settings={"rows": 3})
    env.reset(seed=0)
    assert env.step({"paddle": 0})[2:4] == (False, False)
    _, reward, terminated, truncated, info = env.step({"paddle": 0})
    assert (terminated, truncated) == (True, False) and abs(reward) == 1.0
    assert info[dgym.DISCOUNT_KEY] == 0.0
    env.close()
    env = GymnasiumEnv(
        address=catch_server.address, create_world_settings={"rows": 10, "max_steps": 2}
    )
    env.reset()
    env.step({"paddle": 0})
    _, _, terminated, truncated, info = env.step({"paddle": 0})
    assert (terminated, truncated) == (False, True) and info["discount"] == 1.0
    # Stepping on after the end starts the next episode, as the protocol does.
    observation, reward, terminated, truncated, info = env.step({"paddle": 0})
    assert (reward, terminated, truncated, info) == (0.0, False, False, {"discount": 1.0})
    assert observation["board"][0].max() == 1.0  # the ball is back in the top row
    env.close()


def test_large_observations_are_read_from_the_wire_and_copied_once(monkeypatch) -> None:
    """GymnasiumEnv.step takes the adaptor's own step: the 400 KB observation is read from
    the response's bytes (not parsed into a message) into an array of its own, and an
    episode's end is still TERMINATED or INTERRUPTED from the server's state."""
    from dm_env_rpc_client._fastpath import wire_step as _wire_step

    walked = []
    original = _wire_step._walk
    monkeypatch.setattr(_wire_step, "_TEMPLATES", {})
    monkeypatch.setattr(_wire_step, "_MAX_TEMPLATES", 0)  # every step walked: counted here
    monkeypatch.setattr(_wire_step, "_walk", lambda *args: walked.append(1) or original(*args))
    expected = LargeObservation(size=100_000, length=3, seed=4)
    with serve(lambda settings: LargeObservation(size=100_000, length=3, seed=4)) as server:
        env = GymnasiumEnv(address=server.address, timeout=10)
        try:
            env.reset()
            ends = []
            for _ in range(3):
                observation, reward, terminated, truncated, _ = env.step({"delta": 0.5})
                ends.append((terminated, truncated))
                values = observation["values"]
                assert np.array_equal(values, expected.reset().observation["values"])
                assert values.flags.writeable and reward == 1.0
                assert not isinstance(_viewed(values), bytes)  # a copy, not the response
        finally:
            env.close()
    assert ends == [(False, False), (False, False), (False, True)]  # the third truncates
    assert len(walked) == 4  # every step (reset's first one too) read from its wire bytes


def _viewed(values: np.ndarray) -> Any:
    base = values.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def test_truncation_with_a_discount_below_one_is_still_truncation(zoo_server: Server) -> None:
    env = GymnasiumEnv(
        address=zoo_server.address,
        requested_observations=["level"],
        create_world_settings={"length": 2, "truncate": True},
    )
    env.reset()
    env.step(env.action_space.sample())
    _, _, terminated, truncated, info = env.step(env.action_space.sample())
    assert (terminated, truncated) == (False, True) and info["discount"] == 0.5
    env.close()


def test_render_returns_the_image_observation(zoo_server: Server) -> None:
    names = _zoo_names(zoo_server)
    assert "rgb_array" in GymnasiumEnv.metadata["render_modes"]
    env = GymnasiumEnv(
        address=zoo_server.address, requested_observations=names, render_mode="rgb_array"
    )
    observation, _ = env.reset(seed=0)
    np.testing.assert_array_equal(env.render(), observation["camera"])
    observation, *_ = env.step(env.action_space.sample())
    frame = env.render()
    assert frame.dtype == np.uint8 and frame.shape == (4, 6, 3)
    np.testing.assert_array_equal(frame, observation["camera"])
    env.close()
    chosen = GymnasiumEnv(
        address=zoo_server.address,
        requested_observations=names,
        render_mode="rgb_array",
        render_observation="act.f32",
    )
    observation, _ = chosen.reset()
    np.testing.assert_array_equal(chosen.render(), observation["act"]["f32"])
    chosen.close()
    with pytest.raises(ValueError, match="render_observation 'nope'"):
        GymnasiumEnv(
            address=zoo_server.address, requested_observations=names, render_observation="nope"
        )
    with pytest.raises(ValueError, match="render_mode must be"):
        GymnasiumEnv(address=zoo_server.address, requested_observations=names, render_mode="human")


def test_render_without_an_image_says_what_to_do(catch_server: Server) -> None:
    with pytest.raises(
        ValueError, match="needs an image observation.*none among .'board'.*render_observation="
    ):
        GymnasiumEnv(address=catch_server.address, render_mode="rgb_array")
    env = GymnasiumEnv(address=catch_server.address)
    env.reset()
    assert env.render() is None  # render_mode None
    env.close()


def test_construction_from_an_adaptor_leaves_it_to_the_caller(catch_server: Server) -> None:
    with dmr.connect(catch_server.address, timeout=10) as conn:
        adaptor, _ = dmr.create_and_join_world(conn, {"rows": 4}, {})
        env = GymnasiumEnv(adaptor)
        assert env.dm_env is adaptor
        env.reset(seed=1)
        env.step({"paddle": 1})
        env.close()
        env.close()
        assert adaptor.step({"paddle": 0}).observation["board"].shape == (4, 5)
        adaptor.close()
    with pytest.raises(ValueError, match="either a DmEnvAdaptor or address=, not neither"):
        GymnasiumEnv()


def test_close_is_idempotent_and_destroys_the_owned_world(catch_server: Server) -> None:
    env = GymnasiumEnv(address=catch_server.address, create_world_settings={"rows": 4})
    world = env.dm_env.world_name
    env.reset()
    env.close()
    env.close()
    with pytest.raises(errors.ConnectionClosedError):
        env.step({"paddle": 0})
    with dmr.connect(catch_server.address, timeout=10) as conn, pytest.raises(errors.NotFoundError):
        dmr.join_world(conn, str(world))


def test_failures_raise_the_sdk_errors(server_process: Any) -> None:
    server = server_process("catch")
    env = GymnasiumEnv(address=server.address, timeout=10)
    env.reset()
    with pytest.raises(errors.SpecValidationError, match="'paddle'"):
        env.step({"paddle": np.int8(5)})
    with pytest.raises(errors.UnknownNameError, match="'wheel'"):
        env.step({"wheel": 1})
    server.kill()
    with pytest.raises(errors.DmEnvRpcConnectionError):
        env.step({"paddle": np.int8(0)})
    env.close()
    with pytest.raises(errors.ConnectRefusedError, match="connection refused"):
        GymnasiumEnv(address=server.address, timeout=30)  # the port is closed: at once
    with pytest.raises(errors.ConnectTimeoutError, match="last attempt was refused"):
        GymnasiumEnv(address=server.address, timeout=0.5, connect_kwargs={"wait_for_ready": True})


def test_gymnasium_env_checker_passes(catch_server: Server, zoo_server: Server) -> None:
    made = gymnasium.make(
        "dm_env_rpc_client.integrations.gymnasium:DmEnvRpc-v0",
        address=catch_server.address,
        create_world_settings={"rows": 4},
    )
    assert made.spec is not None and made.spec.nondeterministic
    check_env(made.unwrapped, skip_render_check=True)
    made.close()
    zoo = GymnasiumEnv(
        address=zoo_server.address,
        requested_observations=_zoo_names(zoo_server),
        render_mode="rgb_array",
    )
    check_env(zoo)
    zoo.close()


def test_make_and_make_vec_build_from_an_address(catch_server: Server) -> None:
    env = gymnasium.make(dgym.ENV_ID, address=catch_server.address, unwrap_single=True)
    observation, _ = env.reset(seed=0)
    assert observation.shape == (10, 5)
    env.close()
    envs = gymnasium.make_vec(
        dgym.ENV_ID,
        3,
        vectorization_mode="vector_entry_point",
        address=catch_server.address,
        create_world_settings={"rows": 4},
    )
    assert isinstance(envs, GymnasiumVectorEnv) and envs.num_envs == 3
    observations, _infos = envs.reset(seed=0)
    assert observations["board"].shape == (3, 4, 5)
    envs.close()


# --- GymnasiumVectorEnv ------------------------------------------------------------------


class _CountingCatch(Catch):
    """Catch that counts the times the server stepped or reset it."""

    calls = 0

    def reset(self) -> dm_env.TimeStep:
        _CountingCatch.calls += 1
        return super().reset()

    def step(self, action: Any) -> dm_env.TimeStep:
        _CountingCatch.calls += 1
        return super().step(action)


def test_vector_spaces_metadata_and_info_format(catch_server: Server) -> None:
    envs = GymnasiumVectorEnv(addresses=catch_server.address, num_envs=3)
    assert envs.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert envs.single_observation_space == spaces.Dict(
        {"board": spaces.Box(0.0, 1.0, (10, 5), np.float32)}
    )
    assert envs.observation_space["board"].shape == (3, 10, 5)
    assert envs.action_space["paddle"] == spaces.Box(-1, 1, (3,), np.int8)
    observations, infos = envs.reset(seed=0)
    assert envs.observation_space.contains(observations)
    assert infos["env_id"].tolist() == [0, 1, 2] and infos["_env_id"].all()
    observations, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
    assert rewards.dtype == np.float64 and terminations.dtype == truncations.dtype == np.bool_
    assert set(infos) == {"discount", "_discount", "env_id", "_env_id"}
    assert infos["_discount"].all() and (infos["discount"] == 1.0).all()
    envs.close()
    envs.close()


def test_vector_autoreset_is_next_step_with_no_extra_round_trip() -> None:
    with serve(lambda settings: _CountingCatch(**settings)) as server:
        envs = GymnasiumVectorEnv(
            addresses=[server.address], num_envs=2, create_world_settings={"rows": 3}
        )
        envs.reset(seed=0)
        _CountingCatch.calls = 0
        paddles = {"paddle": np.zeros(2, np.int8)}
        _, _, terminations, _, _ = envs.step(paddles)
        assert not terminations.any()
        _, rewards, terminations, truncations, infos = envs.step(paddles)
        assert terminations.all() and not truncations.any() and (np.abs(rewards) == 1).all()
        observations, rewards, terminations, truncations, infos = envs.step(
            {"paddle": np.ones(2, np.int8)}  # ignored: these steps start the next episodes
        )
        assert (rewards == 0).all() and not terminations.any() and not truncations.any()
        assert infos["_discount"].all() and (infos["discount"] == 1.0).all()  # as after a reset
        assert (observations["board"][:, 0].max(axis=1) == 1.0).all()  # balls in the top row
        assert (observations["board"][:, -1, 2] == 1.0).all()  # paddles back in the middle
        assert _CountingCatch.calls == 3 * 2  # one server step per world per step(), no more
        envs.close()


def test_vector_truncation(catch_server: Server) -> None:
    envs = GymnasiumVectorEnv(
        addresses=[catch_server.address],
        num_envs=2,
        create_world_settings={"max_steps": 2},
        unwrap_single=True,
    )
    envs.reset()
    zeros = np.zeros(2, np.int8)
    envs.step(zeros)
    _, _, terminations, truncations, infos = envs.step(zeros)
    assert truncations.all() and not terminations.any() and (infos["discount"] == 1.0).all()
    envs.close()


def test_vector_matches_sync_vector_env_of_gymnasium_envs(catch_server: Server) -> None:
    settings = {"rows": 4, "columns": 7}
    count, steps = 4, 40
    rng = np.random.default_rng(0)
    actions = rng.integers(-1, 2, (steps, count)).astype(np.int8)
    sync = SyncVectorEnv(
        [
            lambda: GymnasiumEnv(address=catch_server.address, create_world_settings=settings)
            for _ in range(count)
        ],
        autoreset_mode=AutoresetMode.NEXT_STEP,
    )
    ours = GymnasiumVectorEnv(
        addresses=catch_server.address, num_envs=count, create_world_settings=settings
    )
    try:
        expected, _ = sync.reset(seed=11)
        got, _ = ours.reset(seed=11)
        np.testing.assert_array_equal(got["board"], expected["board"])
        ended = 0
        for step in range(steps):
            want = sync.step({"paddle": actions[step]})
            have = ours.step({"paddle": actions[step]})
            np.testing.assert_array_equal(have[0]["board"], want[0]["board"])
            for index in (1, 2, 3):
                np.testing.assert_array_equal(have[index], want[index])
            mask = want[4].get("_discount", np.zeros(count, bool))
            np.testing.assert_array_equal(have[4]["_discount"], mask)
            if mask.any():
                want_discount = want[4]["discount"][mask]
                np.testing.assert_array_equal(have[4]["discount"][mask], want_discount)
            ended += int(have[2].sum())
        assert ended >= count * 5  # many autoresets were compared
    finally:
        sync.close()
        ours.close()


def test_step_async_and_step_wait(catch_server: Server) -> None:
    envs = GymnasiumVectorEnv(addresses=[catch_server.address], num_envs=2, unwrap_single=True)
    envs.reset(seed=0)
    with pytest.raises(gymnasium.error.NoAsyncCallError):
        envs.step_wait()
    envs.step_async(np.zeros(2, np.int8))
    assert envs.batch.pending() == 2  # sent at once, both worlds in flight
    with pytest.raises(gymnasium.error.AlreadyPendingCallError):
        envs.step_async(np.zeros(2, np.int8))
    observations, *_ = envs.step_wait()
    assert observations.shape == (2, 10, 5) and envs.batch.pending() == 0
    envs.step_async(np.zeros(2, np.int8))
    observations, _ = envs.reset(seed=1)  # drops the step in flight first
    assert envs.batch.pending() == 0 and observations[:, 0].max() == 1.0
    envs.close()


def test_a_bad_action_batch_sends_nothing(catch_server: Server) -> None:
    envs = GymnasiumVectorEnv(addresses=[catch_server.address], num_envs=3)
    envs.reset()
    bad = [
        {"paddle": np.array([0, 5, 0], np.int8)},  # out of bounds
        {"paddle": np.zeros(2, np.int8)},  # one row short
        {"paddle": np.zeros(3, np.int64)},  # wrong dtype
        {"wheel": np.zeros(3, np.int8)},  # no paddle
    ]
    for actions in bad:
        with pytest.raises(errors.SpecValidationError, match="'paddle'") as info:
            envs.step(actions)
        if "paddle" in actions:
            assert f"{actions['paddle'].dtype} {actions['paddle'].shape}" in str(info.value)
        assert envs.batch.pending() == 0
    _, rewards, *_ = envs.step({"paddle": np.zeros(3, np.int8)})
    assert rewards.shape == (3,)
    envs.close()


def test_vector_wrappers_work(catch_server: Server) -> None:
    envs = GymnasiumVectorEnv(
        addresses=[catch_server.address],
        num_envs=2,
        create_world_settings={"rows": 4},
        unwrap_single=True,
    )
    wrapped = vector_wrappers.NormalizeObservation(vector_wrappers.RecordEpisodeStatistics(envs))
    observations, _ = wrapped.reset(seed=0)
    assert observations.shape == (2, 4, 5)
    episodes = []
    for _ in range(8):
        observations, _, _, _, infos = wrapped.step(np.zeros(2, np.int8))
        assert observations.shape == (2, 4, 5) and observations.dtype == np.float32
        if "episode" in infos:
            episodes.append(infos)
    assert episodes, "RecordEpisodeStatistics saw no episode end"
    for infos in episodes:
        mask = infos["_episode"]
        assert (infos["episode"]["l"][mask] == 3).all()
        assert set(np.abs(infos["episode"]["r"][mask])) == {1.0}
    wrapped.close()
    assert envs.closed


def test_vector_over_a_given_batch_and_its_errors(catch_server: Server) -> None:
    batch = dmr.BatchedEnvironment.connect([catch_server.address], 2)
    with pytest.raises(ValueError, match="num_envs=3 but the BatchedEnvironment has 2"):
        GymnasiumVectorEnv(batch, num_envs=3)
    envs = GymnasiumVectorEnv(batch)
    observations, _ = envs.reset(seed=[4, None])
    assert observations["board"].shape == (2, 10, 5)
    with pytest.raises(ValueError, match="one seed per world"):
        envs.reset(seed=[1, 2, 3])
    envs.close()
    batch.reset()  # the batch is the caller's: still open
    batch.close()
    with pytest.raises(ValueError, match="not neither"):
        GymnasiumVectorEnv()


# --- the training tier -------------------------------------------------------------------


@pytest.mark.training
def test_sb3_ppo_trains_on_remote_catch_as_the_docs_show() -> None:
    """docs/gymnasium.md's Stable-Baselines3 example (its ```py block) runs as it is."""
    pytest.importorskip("stable_baselines3", reason="the training tier needs '.[training]'")
    import torch

    torch.set_num_threads(1)  # the machine's cores belong to the servers too
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "gymnasium.md").read_text()
    (block,) = re.findall(r"^```py\n(.*?)^```", page, re.M | re.S)
    namespace: dict[str, Any] = {"__name__": "docs_gymnasium_sb3"}
    exec(compile(block, "gymnasium.md[sb3]", "exec"), namespace)
    model = namespace["model"]
    assert model.num_timesteps >= 3072
    assert int(namespace["action"]) in (0, 1, 2)
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with serve(lambda settings: Catch(**settings)) as server:  # and on the bare env
        for unwrap_single in (True, False):
            env = GymnasiumEnv(address=server.address, unwrap_single=unwrap_single)
            sb3_check_env(env)
            env.close()


def test_vector_over_zoo_adaptors_with_requested_observations(zoo_server: Server) -> None:
    names = _zoo_names(zoo_server)
    with contextlib.ExitStack() as stack:
        adaptors = []
        for _ in range(3):
            conn = stack.enter_context(dmr.connect(zoo_server.address, timeout=10))
            adaptor, _ = dmr.create_and_join_world(conn, {}, {}, requested_observations=names)
            adaptors.append(adaptor)
        envs = GymnasiumVectorEnv(dmr.BatchedEnvironment(adaptors))
        envs.action_space.seed(0)
        observations, _ = envs.reset(seed=0)
        assert envs.observation_space.contains(observations)
        for _ in range(10):
            actions = envs.action_space.sample()
            observations, *_ = envs.step(actions)
            assert envs.observation_space.contains(observations)
        assert isinstance(observations["act"]["text"], tuple)
        envs.close()
        for adaptor in adaptors:
            adaptor.close()


def test_a_restarted_world_is_truncated_then_autoreset(server_process: Any) -> None:
    envs, servers = over_two_servers(
        server_process,
        GymnasiumVectorEnv,
        create_world_settings={"rows": 20},
        timeout=10,
        connect_kwargs={"on_world_failure": "restart"},
    )
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(2, np.int8)}
    _, _, _, _, infos = envs.step(zeros)
    assert "restarted" not in infos
    servers[1].kill()
    for _ in range(20):  # world 1 comes back on the other server, within a few steps
        observations, rewards, terminations, truncations, infos = envs.step(zeros)
        if "restarted" in infos:
            break
    assert infos["restarted"].tolist() == [False, True] and infos["_restarted"].all()
    # Its episode was cut short: truncated on this step, with the failure in infos.
    assert truncations.tolist() == [False, True] and not terminations.any()
    assert rewards[1] == 0.0 and infos["_failure"].tolist() == [False, True]
    failure = infos["failure"][1]
    assert failure.outcome == "restarted" and failure.address == servers[1].address
    assert failure.new_address == servers[0].address
    first = observations["board"][1].copy()
    assert first[0].max() == 1.0  # the new episode's first observation: the ball on top
    assert envs.observation_space.contains(observations)
    # The next step is its autoreset step (NEXT_STEP): the same observation, reward 0, not
    # truncated again, and the world was sent nothing (the ball did not fall).
    observations, rewards, terminations, truncations, infos = envs.step(zeros)
    assert "restarted" not in infos and not truncations.any() and not terminations.any()
    assert rewards[1] == 0.0 and infos["_discount"].all() and infos["discount"][1] == 1.0
    np.testing.assert_array_equal(observations["board"][1], first)
    observations, _, _, truncations, infos = envs.step(zeros)  # then it steps again
    assert observations["board"][1, 1].max() == 1.0 and not truncations.any()
    assert infos["_discount"].all()
    envs.close()


def test_vector_env_from_addresses_with_requested_observations(zoo_server: Server) -> None:
    names = _zoo_names(zoo_server)
    with pytest.raises(errors.SpecError, match="Leave it out: pass requested_observations"):
        GymnasiumVectorEnv(addresses=zoo_server.address, num_envs=2, timeout=10)
    envs = GymnasiumVectorEnv(
        addresses=zoo_server.address, num_envs=2, requested_observations=names, timeout=10
    )
    envs.action_space.seed(0)
    observations, _ = envs.reset(seed=0)
    assert envs.observation_space.contains(observations)
    assert "strings" not in envs.single_observation_space.spaces
    for _ in range(6):
        observations, *_ = envs.step(envs.action_space.sample())
        assert envs.observation_space.contains(observations)
    envs.close()
    with pytest.raises(
        errors.UnknownNameError, match="'camra'. Known names: 'act.arm.grip', .*'camera'"
    ):
        GymnasiumVectorEnv(
            addresses=zoo_server.address, num_envs=2, requested_observations=["camra"]
        )
    with (
        dmr.BatchedEnvironment.connect(zoo_server.address, 1, requested_observations=names) as b,
        pytest.raises(ValueError, match="pass it to BatchedEnvironment.connect"),
    ):
        GymnasiumVectorEnv(b, requested_observations=names)


def test_a_failed_world_raises_and_the_healthy_steps_are_kept(server_process: Any) -> None:
    envs, servers = over_two_servers(
        server_process,
        GymnasiumVectorEnv,
        create_world_settings={"rows": 3},  # episodes of two steps
        timeout=10,
    )
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(2, np.int8)}
    _, _, terminations, _, _ = envs.step(zeros)
    assert not terminations.any()
    servers[1].kill()
    with pytest.raises(errors.WorldError, match=r"step_wait\(\) returns them") as info:
        envs.step(zeros)
    assert info.value.index == 1 and info.value.address == servers[1].address
    with pytest.raises(gym_error.AlreadyPendingCallError, match=r"call step_wait\(\) again"):
        envs.step(zeros)  # nothing is sent over the kept steps
    observations, rewards, terminations, truncations, infos = envs.step_wait()
    # World 0's step of that vector step reaches the user: the LAST step of its episode.
    assert terminations.tolist() == [True, False] and abs(rewards[0]) == 1.0
    assert infos["_discount"].tolist() == [True, False] and infos["discount"][0] == 0.0
    # World 1 has a stand-in row: its episode is over for this env, the error says why.
    assert truncations.tolist() == [False, True] and rewards[1] == 0.0
    assert infos["_error"].tolist() == [False, True] and infos["error"][1].index == 1
    assert isinstance(infos["error"][1].__cause__, errors.DmEnvRpcConnectionError)
    assert envs.observation_space.contains(observations)
    assert envs.batch.pending() == 0
    with pytest.raises(errors.WorldError, match="World 1"):
        envs.step(zeros)  # under "raise" a failed world takes no more steps
    assert envs.batch.pending() == 0
    envs.close()


class _RefusesRight(Catch):
    """Catch whose server refuses a move to the right, before anything moves."""

    def step(self, action: Any) -> dm_env.TimeStep:
        if int(action["paddle"]) == 1:
            raise ValueError("this world does not move right")
        return super().step(action)


def test_a_refused_step_keeps_the_other_worlds_steps_and_the_world_goes_on() -> None:
    with serve(lambda settings: _RefusesRight(**settings)) as server:
        envs = GymnasiumVectorEnv(
            addresses=[server.address],
            num_envs=3,
            create_world_settings={"rows": 3},
            timeout=10,
        )
        envs.reset(seed=0)
        zeros = np.zeros(3, np.int8)
        envs.step({"paddle": zeros})
        with pytest.raises(errors.WorldError, match="World 1 .*does not move right") as info:
            envs.step({"paddle": np.array([0, 1, 0], np.int8)})
        assert info.value.index == 1
        observations, rewards, terminations, truncations, infos = envs.step_wait()
        assert terminations.tolist() == [True, False, True]  # worlds 0 and 2 ended an episode
        assert envs.observation_space.contains(observations)
        assert not truncations.any()  # world 1 was refused a step; its episode goes on
        assert infos["_error"].tolist() == [False, True, False]
        assert isinstance(infos["error"][1].__cause__, errors.DmEnvRpcError)
        _, rewards, terminations, truncations, infos = envs.step({"paddle": zeros})
        # Worlds 0 and 2 start their next episodes; world 1 takes its second step now.
        assert terminations.tolist() == [False, True, False] and "error" not in infos
        assert rewards[[0, 2]].tolist() == [0.0, 0.0] and abs(rewards[1]) == 1.0
        envs.close()


class _Stalls(Catch):
    """Catch whose step with the paddle moved left waits at a gate (its server stays alive)."""

    gate = threading.Event()

    def step(self, action: Any) -> dm_env.TimeStep:
        if int(action["paddle"]) == -1:
            _Stalls.gate.wait(60)
        return super().step(action)


def test_a_world_restarted_after_a_timeout_is_truncated_once() -> None:
    _Stalls.gate.clear()
    with (
        serve(lambda settings: Catch(**settings)) as server,
        serve(lambda settings: _Stalls(**settings)) as stalling,
    ):
        envs = GymnasiumVectorEnv(
            addresses=[server.address, stalling.address],  # world 1 on the stalling server
            num_envs=2,
            create_world_settings={"rows": 20},
            timeout=30,
            connect_kwargs={"on_world_failure": "restart", "step_timeout": None},
        )
        try:
            envs.reset(seed=0)
            zeros = {"paddle": np.zeros(2, np.int8)}
            envs.step(zeros)
            envs.step_async({"paddle": np.array([0, -1], np.int8)})  # world 1 stalls
            with pytest.raises(errors.WorldTimeoutError) as info:
                envs.step_wait(timeout=15)
            assert info.value.index == 1
            _, rewards, terminations, truncations, infos = envs.step_wait()
            assert truncations.tolist() == [False, True]  # its episode was cut short
            assert infos["_error"].tolist() == [False, True] and rewards[1] == 0.0
            # The next vector step is world 1's autoreset step: the FIRST step of the world
            # the batch made again, which answers the step that timed out.
            observations, rewards, terminations, truncations, infos = envs.step(zeros)
            assert not truncations.any() and not terminations.any() and rewards[1] == 0.0
            assert infos["restarted"].tolist() == [False, True]
            assert isinstance(infos["failure"][1].cause, errors.RequestTimeoutError)
            assert observations["board"][1, 0].max() == 1.0  # the ball on top
            observations, _, _, truncations, infos = envs.step(zeros)
            assert not truncations.any() and "restarted" not in infos
            assert observations["board"][1, 1].max() == 1.0  # it falls: world 1 steps again
        finally:
            _Stalls.gate.set()
            envs.close()
