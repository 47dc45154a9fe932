"""integrations.sb3: ``BatchedVecEnv`` against real servers, checked with SB3's own tools.

Stable-Baselines3 needs torch, which the default tier does not install: every test that
imports SB3 is in the training tier (``pytest -m training``), except the one that checks
the ImportError a user without the extra gets.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import dm_env
import gymnasium
import numpy as np
import pytest
from dm_env import specs as dm_specs
from vector_helpers import over_two_servers

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch

ROOT = pathlib.Path(__file__).resolve().parent.parent
training = pytest.mark.training


@pytest.fixture
def sb3() -> Any:
    pytest.importorskip("stable_baselines3", reason="the training tier needs '.[training]'")
    import torch

    torch.set_num_threads(1)  # the machine's cores belong to the servers too
    from dm_env_rpc_client.integrations import sb3

    return sb3


def test_without_the_extra_the_import_error_names_it_and_the_core_never_imports_it() -> None:
    code = (
        "import sys\n"
        "import dm_env_rpc_client, dm_env_rpc_client.integrations.gymnasium\n"
        "assert 'stable_baselines3' not in sys.modules, 'the core imported SB3'\n"
        "sys.modules['stable_baselines3'] = None  # as if it were not installed\n"
        "import dm_env_rpc_client.integrations.sb3\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "pip install 'dm_env_rpc_client[sb3]'" in result.stderr
    assert "the core imported SB3" not in result.stderr


def _paddle_moves(env: gymnasium.Env[Any, Any]) -> gymnasium.Env[Any, Any]:
    return gymnasium.wrappers.TransformAction(
        env, lambda move: np.int8(move - 1), gymnasium.spaces.Discrete(3)
    )


@training
@pytest.mark.parametrize(
    "settings", [{"rows": 4}, {"rows": 8, "max_steps": 3}], ids=["terminated", "truncated"]
)
def test_step_by_step_as_sb3s_dummy_vec_env_of_gymnasium_envs(
    sb3: Any, catch_server: Server, settings: dict[str, int]
) -> None:
    """SB3's own DummyVecEnv over GymnasiumEnvs is the reference: same seeds, same actions,
    the same observations, rewards, dones, terminal observations and truncation flags."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    count = 3
    address = catch_server.address
    ours = sb3.BatchedVecEnv(addresses=[address], num_envs=count, create_world_settings=settings)
    theirs = DummyVecEnv(
        [
            lambda: _paddle_moves(
                GymnasiumEnv(address=address, create_world_settings=settings, unwrap_single=True)
            )
            for _ in range(count)
        ]
    )
    assert ours.observation_space == theirs.observation_space
    assert ours.action_space == theirs.action_space
    assert ours.seed(11) == theirs.seed(11) == [11, 12, 13]
    np.testing.assert_array_equal(ours.reset(), theirs.reset())
    rng = np.random.default_rng(0)
    ends = truncations = 0
    for _ in range(20):
        actions = rng.integers(0, 3, count)
        mine, reference = ours.step(actions), theirs.step(actions)
        for got, want in zip(mine[:3], reference[:3], strict=True):
            np.testing.assert_array_equal(got, want)
        for got_info, want_info in zip(mine[3], reference[3], strict=True):
            assert got_info["TimeLimit.truncated"] == want_info["TimeLimit.truncated"]
            truncations += bool(want_info["TimeLimit.truncated"])
            assert ("terminal_observation" in got_info) == ("terminal_observation" in want_info)
            if "terminal_observation" in want_info:
                ends += 1
                np.testing.assert_array_equal(
                    got_info["terminal_observation"], want_info["terminal_observation"]
                )
    assert ends >= 2 * count
    assert truncations == (ends if "max_steps" in settings else 0)
    ours.close()
    theirs.close()


@training
def test_sb3s_vec_env_wrappers_and_checks_take_it(sb3: Any, catch_server: Server) -> None:
    """SB3 has no checker for VecEnvs (``check_env`` takes one gymnasium env): its wrappers
    and helpers are what checks one. VecCheckNan raises on a NaN or inf, VecMonitor counts
    episodes from dones, VecFrameStack stacks terminal observations, VecNormalize keeps
    running statistics."""
    from stable_baselines3.common.env_util import is_wrapped
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.utils import check_for_correct_spaces, is_vectorized_observation
    from stable_baselines3.common.vec_env import (
        VecCheckNan,
        VecFrameStack,
        VecMonitor,
        VecNormalize,
    )

    envs = sb3.BatchedVecEnv(
        addresses=[catch_server.address], num_envs=4, create_world_settings={"rows": 5}
    )
    check_for_correct_spaces(
        envs, gymnasium.spaces.Box(0.0, 1.0, (5, 5), np.float32), envs.action_space
    )
    assert envs.action_space == gymnasium.spaces.Discrete(3)
    assert envs.env_is_wrapped(Monitor) == [False] * 4 and not is_wrapped(envs, Monitor)
    wrapped = VecNormalize(
        VecFrameStack(VecMonitor(VecCheckNan(envs, raise_exception=True)), n_stack=2)
    )
    wrapped.seed(0)
    observation = wrapped.reset()
    assert observation.shape == (4, 5, 10)
    assert is_vectorized_observation(observation, wrapped.observation_space)
    rng = np.random.default_rng(1)
    episodes = []
    for _ in range(12):
        observation, _, dones, infos = wrapped.step(rng.integers(0, 3, 4))
        assert is_vectorized_observation(observation, wrapped.observation_space)
        for done, info in zip(dones, infos, strict=True):
            if done:
                assert info["terminal_observation"].shape == (5, 10)  # stacked by VecFrameStack
                episodes.append(info["episode"])
    assert len(episodes) >= 8
    assert {episode["l"] for episode in episodes} == {4}
    assert {episode["r"] for episode in episodes} <= {-1.0, 1.0}
    assert wrapped.obs_rms.count > 12 * 4  # VecNormalize saw every step
    checker = VecCheckNan(envs, raise_exception=True)
    checker.reset()  # (VecCheckNan reads its last observations, which reset sets)
    with pytest.raises(ValueError, match="found nan in actions"):  # and refuses before sending
        checker.step(np.array([np.nan] * 4))
    assert envs.batch.pending() == 0
    wrapped.close()


@training
def test_get_set_attr_env_method_seed_and_env_is_wrapped_round_trip(
    sb3: Any, catch_server: Server
) -> None:
    envs = sb3.BatchedVecEnv(addresses=[catch_server.address], num_envs=3)
    assert envs.get_attr("index") == [0, 1, 2]
    assert envs.get_attr("address", indices=[2]) == [catch_server.address]
    assert envs.get_attr("render_mode") == [None] * 3 and envs.render_mode is None
    # A name the RemoteWorld lacks is the DmEnvAdaptor's.
    assert envs.get_attr("env") == envs.batch.envs
    assert envs.has_attr("observation_spec") and not envs.has_attr("no_such_thing")
    with pytest.raises(AttributeError):
        envs.get_attr("no_such_thing")
    envs.set_attr("label", "b", indices=1)
    envs.set_attr("level", 7)
    assert envs.get_attr("label", indices=[1]) == ["b"]
    assert envs.get_attr("level") == [7, 7, 7]
    with pytest.raises(AttributeError):
        envs.get_attr("label", indices=0)
    (spec,) = envs.env_method("action_spec", indices=[0])
    assert spec["paddle"].minimum == -1
    assert envs.env_method("render") == [None] * 3
    with pytest.raises(ValueError, match="use the VecEnv's own"):
        envs.env_method("reset")
    assert envs.env_is_wrapped(gymnasium.Wrapper, indices=[0, 2]) == [False, False]
    # seed(): one seed per world, used by the next reset only, as GymnasiumEnv.reset(seed=).
    assert envs.seed(40) == [40, 41, 42]
    first = envs.reset()
    single = GymnasiumEnv(address=catch_server.address, unwrap_single=True)
    for index in range(3):
        np.testing.assert_array_equal(first[index], single.reset(seed=40 + index)[0])
    assert envs._seeds == [None] * 3  # spent
    trajectories = []
    for _ in range(2):
        envs.seed(5)
        steps = [envs.reset()]
        steps += [envs.step(np.array([0, 1, 2]))[0] for _ in range(15)]
        trajectories.append(np.stack(steps))
    np.testing.assert_array_equal(*trajectories)
    single.close()
    envs.close()
    envs.close()  # idempotent


class _Image(dm_env.Environment):
    """A world with an image observation whose pixels are its step count."""

    def __init__(self) -> None:
        self._count = 0

    def reset(self) -> dm_env.TimeStep:
        self._count = 0
        return dm_env.restart(self._frame())

    def step(self, action: Any) -> dm_env.TimeStep:
        self._count += 1
        return dm_env.transition(0.0, self._frame())

    def _frame(self) -> dict[str, np.ndarray]:
        return {"frame": np.full((4, 6, 3), self._count, np.uint8)}

    def observation_spec(self) -> dict[str, dm_specs.Array]:
        return {"frame": dm_specs.BoundedArray((4, 6, 3), np.uint8, 0, 255, "frame")}

    def action_spec(self) -> dict[str, dm_specs.Array]:
        return {"move": dm_specs.BoundedArray((), np.float32, -1.0, 1.0, "move")}


@training
def test_render_tiles_each_worlds_latest_image(sb3: Any, catch_server: Server) -> None:
    with serve(lambda settings: _Image()) as server:
        envs = sb3.BatchedVecEnv(addresses=[server.address], num_envs=4, render_mode="rgb_array")
        assert envs.action_space == gymnasium.spaces.Box(-1.0, 1.0, (), np.float32)
        envs.reset()
        envs.step(np.zeros(4, np.float32))
        envs.step(np.zeros(4, np.float32))
        assert envs.get_attr("render_mode") == ["rgb_array"] * 4
        images = envs.get_images()
        assert len(images) == 4 and all((image == 2).all() for image in images)
        tiled = envs.render()
        assert tiled.shape == (8, 12, 3) and (tiled == 2).all()
        assert (envs.env_method("render", indices=3)[0] == 2).all()
        envs.close()
    with pytest.raises(ValueError, match="needs an image observation"):
        sb3.BatchedVecEnv(addresses=[catch_server.address], render_mode="rgb_array")


class _Paced(dm_env.Environment):
    """World 0 ends on its first step; world 1's first step answers only once world 0 was
    sent the step that starts its next episode (or after 10 s, with observation -1)."""

    def __init__(self, role: int, started: threading.Event) -> None:
        self._role, self._started = role, started
        self._steps = 0

    def reset(self) -> dm_env.TimeStep:
        if self._role == 0 and self._steps:
            self._started.set()  # the step after LAST: the pipelined reset arrived
        self._steps = 0
        return dm_env.restart(np.zeros(1, np.float32))

    def step(self, action: Any) -> dm_env.TimeStep:
        self._steps += 1
        if self._role == 0:
            return dm_env.termination(1.0, np.full(1, 5.0, np.float32))
        seen = self._started.wait(10)
        return dm_env.transition(0.0, np.full(1, 1.0 if seen else -1.0, np.float32))

    def observation_spec(self) -> dm_specs.Array:
        return dm_specs.Array((1,), np.float32, "o")

    def action_spec(self) -> dm_specs.Array:
        return dm_specs.BoundedArray((), np.int8, -1, 1, "paddle")


@pytest.fixture
def paced_servers() -> Iterator[list[str]]:
    """Two servers (an embedded server steps its worlds one at a time, on one event loop)."""
    started = threading.Event()
    with (
        serve(lambda settings: _Paced(0, started)) as first,
        serve(lambda settings: _Paced(1, started)) as second,
    ):
        yield [first.address, second.address]


@training
def test_the_reset_of_an_ended_world_is_sent_before_the_others_answer(
    sb3: Any, paced_servers: list[str]
) -> None:
    """Pipelining: world 1 answers only after world 0's reset reached the server, so a
    VecEnv that waited for every world before sending resets would see -1 here."""
    envs = sb3.BatchedVecEnv(addresses=paced_servers, timeout=30)
    envs.reset()
    observations, rewards, dones, infos = envs.step(np.array([1, 1]))
    assert observations.tolist() == [[0.0], [1.0]]  # world 0: its next episode's first
    assert rewards.tolist() == [1.0, 0.0] and dones.tolist() == [True, False]
    assert infos[0]["terminal_observation"].tolist() == [5.0]
    assert not infos[0]["TimeLimit.truncated"]
    assert "terminal_observation" not in infos[1]
    envs.close()


@training
def test_bad_actions_and_calls_out_of_order_send_nothing(sb3: Any, catch_server: Server) -> None:
    envs = sb3.BatchedVecEnv(addresses=[catch_server.address], num_envs=2)
    envs.reset()
    with pytest.raises(errors.SpecValidationError, match=r"shape \(2,\)"):
        envs.step_async(np.zeros(3, np.int64))
    with pytest.raises(errors.SpecValidationError, match=r"values \[3\]"):
        envs.step_async(np.array([0, 3]))
    with pytest.raises(errors.SpecValidationError, match="non-integer"):
        envs.step_async(np.array([0.5, 1.0]))
    assert envs.batch.pending() == 0
    with pytest.raises(errors.DmEnvRpcClientError, match="without step_async"):
        envs.step_wait()
    envs.step_async(np.array([[0], [2]]))  # SB3's [n, 1] shape of a Discrete action
    with pytest.raises(errors.DmEnvRpcClientError, match="twice"):
        envs.step_async(np.array([0, 2]))
    envs.step_wait()
    envs.step_async(np.array([1, 1]))
    envs.reset()  # drops the step in flight
    assert envs.batch.pending() == 0
    envs.step(np.array([1, 1]))
    envs.close()
    with pytest.raises(ValueError, match="not neither"):
        sb3.BatchedVecEnv()
    batch = dmr.BatchedEnvironment.connect([catch_server.address], 2)
    with pytest.raises(ValueError, match="num_envs=3 but"):
        sb3.BatchedVecEnv(batch, num_envs=3)
    envs = sb3.BatchedVecEnv(batch, discrete_actions=False)
    assert envs.action_space == gymnasium.spaces.Box(-1, 1, (), np.int8)
    envs.reset()
    envs.step(np.array([-1, 1], np.int8))
    envs.close()
    batch.step({"paddle": np.zeros(2, np.int8)})  # the caller's batch: still open
    batch.close()


@training
def test_a_failed_world_is_restarted_and_reported_as_a_truncation(
    sb3: Any, server_process: Any
) -> None:
    envs, servers = over_two_servers(
        server_process, sb3.BatchedVecEnv, create_world_settings={"rows": 30}, timeout=30
    )
    before = envs.reset()
    servers[1].kill()
    for _ in range(25):  # world 1 comes back on the other server, within a few steps
        observations, rewards, dones, infos = envs.step(np.array([1, 1]))
        if infos[1].get("restarted"):
            break
        before = observations
    assert infos[1]["restarted"] and dones.tolist() == [False, True]
    assert infos[1]["TimeLimit.truncated"] and rewards[1] == 0.0
    np.testing.assert_array_equal(infos[1]["terminal_observation"], before[1])
    assert observations[1][0].max() == 1.0  # the new episode's first: the ball on top
    failure = infos[1]["failure"]
    assert failure.outcome == "restarted" and failure.new_address == servers[0].address
    assert "restarted" not in infos[0]
    envs.step(np.array([1, 1]))  # and it goes on
    envs.close()


@training
def test_under_raise_a_failed_world_raises_and_the_vec_env_wants_a_reset(
    sb3: Any, server_process: Any
) -> None:
    envs, servers = over_two_servers(
        server_process, sb3.BatchedVecEnv, on_world_failure="raise", timeout=30
    )
    envs.reset()
    servers[1].kill()
    with pytest.raises(errors.WorldError) as raised:
        for _ in range(25):
            envs.step(np.array([1, 1]))
    assert raised.value.index == 1
    with pytest.raises(errors.DmEnvRpcClientError, match=r"Call reset\(\)"):
        envs.step_async(np.array([1, 1]))
    with pytest.raises(errors.WorldError):
        envs.reset()
    envs.close()


def _mean_return(sb3_model: Any, envs: Any, episodes: int, rng: Any) -> float:
    """The mean return of ``episodes`` episodes: the model's greedy actions, else random ones."""
    returns: list[float] = []
    envs.seed(123)
    observation = envs.reset()
    totals = np.zeros(envs.num_envs)
    while len(returns) < episodes:
        if sb3_model is None:
            actions = rng.integers(0, 3, envs.num_envs)
        else:
            actions, _ = sb3_model.predict(observation, deterministic=True)
        observation, rewards, dones, _ = envs.step(actions)
        totals += rewards
        returns.extend(totals[dones])
        totals[dones] = 0.0
    return float(np.mean(returns[:episodes]))


@training
def test_ppo_trains_on_remote_catch_and_beats_random(sb3: Any) -> None:
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecMonitor

    with serve(lambda settings: Catch(**settings)) as server:
        envs = sb3.BatchedVecEnv(
            addresses=[server.address], num_envs=8, create_world_settings={"rows": 5}
        )
        random_return = _mean_return(None, envs, 200, np.random.default_rng(0))
        model = PPO("MlpPolicy", VecMonitor(envs), n_steps=128, batch_size=256, n_epochs=4, seed=0)
        model.learn(total_timesteps=16_384)
        trained_return = _mean_return(model, envs, 200, None)
        envs.close()
    print(f"random {random_return:.3f}, trained {trained_return:.3f}")
    assert random_return < 0.0  # about -0.5: a random paddle misses most balls
    assert trained_return > random_return + 0.5


@training
def test_docs_page_runs(sb3: Any, tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    """docs/sb3.md's ```python blocks (skipped in the default tier: no SB3 there) run here."""
    monkeypatch.chdir(tmp_path)
    page = (ROOT / "docs" / "sb3.md").read_text()
    namespace: dict[str, object] = {"__name__": "docs_sb3"}
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.M | re.S)
    assert blocks
    for index, block in enumerate(blocks):
        exec(compile(block, f"sb3.md[block {index}]", "exec"), namespace)
