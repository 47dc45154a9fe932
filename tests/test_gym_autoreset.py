"""GymnasiumVectorEnv's three autoreset modes and reset_mask, against gymnasium's own SyncVectorEnv."""

from __future__ import annotations

import threading
from typing import Any

import dm_env
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from test_gymnasium import _CountingCatch
from vector_helpers import over_two_servers

from dm_env_rpc_client import errors
from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv, GymnasiumVectorEnv
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch

SETTINGS = {"rows": 4, "columns": 7}
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def _pair(
    address: str, count: int, mode: AutoresetMode
) -> tuple[SyncVectorEnv, GymnasiumVectorEnv]:
    sync = SyncVectorEnv(
        [
            lambda: GymnasiumEnv(address=address, create_world_settings=SETTINGS)
            for _ in range(count)
        ],
        autoreset_mode=mode,
    )
    ours = GymnasiumVectorEnv(
        addresses=address, num_envs=count, create_world_settings=SETTINGS, autoreset_mode=mode
    )
    return sync, ours


def _same_infos(have: dict[str, Any], want: dict[str, Any]) -> None:
    """Every key gymnasium's SyncVectorEnv gives is in ours, with the same mask and values."""
    for key, value in want.items():
        if key.startswith("_"):
            np.testing.assert_array_equal(have[key], value, err_msg=key)
        elif key == "final_obs":
            for index in np.flatnonzero(want["_final_obs"]):
                np.testing.assert_array_equal(have[key][index]["board"], value[index]["board"])
        elif isinstance(value, dict):
            _same_infos(have[key], value)
        else:
            mask = want[f"_{key}"]
            np.testing.assert_array_equal(have[key][mask], value[mask], err_msg=key)


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.name)
def test_each_mode_matches_sync_vector_env_step_by_step(catch_server: Server, mode: Any) -> None:
    count, steps = 3, 30
    rng = np.random.default_rng(0)
    actions = rng.integers(-1, 2, (steps, count)).astype(np.int8)
    sync, ours = _pair(catch_server.address, count, mode)
    assert ours.metadata["autoreset_mode"] == ours.autoreset_mode == mode
    try:
        want, want_infos = sync.reset(seed=11)
        have, have_infos = ours.reset(seed=11)
        np.testing.assert_array_equal(have["board"], want["board"])
        _same_infos(have_infos, want_infos)
        ended, reseed = 0, 100
        for step in range(steps):
            want_step = sync.step({"paddle": actions[step]})
            have_step = ours.step({"paddle": actions[step]})
            np.testing.assert_array_equal(have_step[0]["board"], want_step[0]["board"])
            for index in (1, 2, 3):
                np.testing.assert_array_equal(have_step[index], want_step[index])
            _same_infos(have_step[4], want_step[4])
            done = have_step[2] | have_step[3]
            ended += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                # Seeded resets are ResetRequests; unseeded ones of worlds at their LAST step
                # are their pipelined autoreset steps: both must match gymnasium's resets.
                seeded = reseed % 2 == 0
                seeds = [reseed + i if done[i] and seeded else None for i in range(count)]
                reseed += 1
                want, want_infos = sync.reset(seed=seeds, options={"reset_mask": done.copy()})
                have, have_infos = ours.reset(seed=seeds, options={"reset_mask": done.copy()})
                np.testing.assert_array_equal(have["board"], want["board"])
                _same_infos(have_infos, want_infos)
        assert ended >= count * 3  # many episode ends were compared
    finally:
        sync.close()
        ours.close()


def test_same_step_takes_as_many_server_steps_as_next_step() -> None:
    """Per episode, one server step per world per vector step plus its autoreset step."""
    counts = {}
    with serve(lambda settings: _CountingCatch(**settings)) as server:
        for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
            envs = GymnasiumVectorEnv(
                addresses=[server.address],
                num_envs=2,
                create_world_settings={"rows": 3},  # episodes of two steps
                autoreset_mode=mode,
            )
            envs.reset(seed=0)
            _CountingCatch.calls = 0
            paddles = {"paddle": np.zeros(2, np.int8)}
            episodes = 0
            while episodes < 6:
                _, _, terminations, _, infos = envs.step(paddles)
                episodes += int(terminations.sum())
                if mode == AutoresetMode.SAME_STEP and terminations.any():
                    assert infos["_final_obs"].tolist() == terminations.tolist()
            if mode == AutoresetMode.NEXT_STEP:
                envs.step(paddles)  # the autoreset step SAME_STEP took inside its last step
            counts[mode] = _CountingCatch.calls
            envs.close()
    # NEXT_STEP: 3 vector steps per episode (2 + the autoreset step); SAME_STEP: 2 vector
    # steps, and the autoreset step is taken inside the second.
    assert counts[AutoresetMode.NEXT_STEP] == counts[AutoresetMode.SAME_STEP] == 6 * 3


def test_reset_mask_resets_only_the_masked_worlds(catch_server: Server) -> None:
    envs = GymnasiumVectorEnv(
        addresses=catch_server.address, num_envs=3, create_world_settings={"rows": 6}
    )
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(3, np.int8)}
    before, *_ = envs.step(zeros)
    assert (before["board"][:, 1].max(axis=1) == 1.0).all()  # every ball fell one row
    mask = np.array([False, True, False])
    observations, infos = envs.reset(seed=[None, 5, None], options={"reset_mask": mask})
    np.testing.assert_array_equal(observations["board"][[0, 2]], before["board"][[0, 2]])
    assert observations["board"][1, 0].max() == 1.0  # world 1 alone starts again: ball on top
    assert infos["_env_id"].tolist() == mask.tolist() and infos["_discount"].tolist() == [0, 1, 0]
    after, *_ = envs.step(zeros)
    assert [int(np.argmax(after["board"][i].max(axis=1))) for i in range(3)] == [2, 1, 2]
    for bad in ([False, True, False], np.array([1, 0, 0]), np.zeros(2, bool), np.zeros(3, bool)):
        with pytest.raises(ValueError, match="reset_mask"):
            envs.reset(options={"reset_mask": bad})
    envs.close()


def test_disabled_refuses_to_step_a_world_that_ended(catch_server: Server) -> None:
    envs = GymnasiumVectorEnv(
        addresses=catch_server.address,
        num_envs=2,
        create_world_settings={"rows": 3},
        autoreset_mode="Disabled",
    )
    assert envs.autoreset_mode == AutoresetMode.DISABLED
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(2, np.int8)}
    envs.step(zeros)
    _, _, terminations, _, _ = envs.step(zeros)
    assert terminations.all()
    with pytest.raises(errors.DmEnvRpcClientError, match=r"World\(s\) \[0, 1\].*reset_mask"):
        envs.step(zeros)
    envs.reset(options={"reset_mask": np.array([True, True])})
    _, _, terminations, _, _ = envs.step(zeros)
    assert not terminations.any()
    with pytest.raises(ValueError, match="autoreset_mode must be one of"):
        GymnasiumVectorEnv(addresses=catch_server.address, autoreset_mode="Sometimes")
    envs.close()


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_a_restarted_world_behaves_per_mode(server_process: Any, mode: Any) -> None:
    envs, servers = over_two_servers(
        server_process,
        GymnasiumVectorEnv,
        create_world_settings={"rows": 20},
        timeout=10,
        connect_kwargs={"on_world_failure": "restart"},
        autoreset_mode=mode,
    )
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(2, np.int8)}
    envs.step(zeros)
    servers[1].kill()
    for _ in range(20):  # world 1 comes back on the other server, within a few steps
        observations, _, terminations, truncations, infos = envs.step(zeros)
        if "restarted" in infos:
            break
    assert infos["restarted"].tolist() == [False, True]
    assert truncations.tolist() == [False, True] and not terminations.any()
    first = observations["board"][1].copy()
    assert first[0].max() == 1.0  # the new episode's first observation
    if mode == AutoresetMode.SAME_STEP:
        # The cut episode has no last observation: final_obs is the new first one too.
        assert infos["_final_obs"].tolist() == [False, True]
        np.testing.assert_array_equal(infos["final_obs"][1]["board"], first)
        observations, _, _, truncations, _ = envs.step(zeros)  # a real step at once
        assert observations["board"][1, 1].max() == 1.0 and not truncations.any()
    else:
        with pytest.raises(errors.DmEnvRpcClientError, match=r"World\(s\) \[1\]"):
            envs.step(zeros)
        observations, _ = envs.reset(seed=[None, 3], options={"reset_mask": np.array([0, 1], bool)})
        assert observations["board"][1, 0].max() == 1.0
        observations, _, _, truncations, _ = envs.step(zeros)
        assert observations["board"][1, 1].max() == 1.0 and not truncations.any()
    envs.close()


_released = threading.Event()


class _Ending(Catch):
    """World 0: its autoreset (a reset after its first one) releases world 1's step."""

    resets = 0

    def reset(self) -> dm_env.TimeStep:
        _Ending.resets += 1
        if _Ending.resets > 1:
            _released.set()
        return super().reset()


class _Waiting(Catch):
    """World 1: its second step waits for world 0's autoreset step to reach its server."""

    steps = 0
    released = False

    def step(self, action: Any) -> dm_env.TimeStep:
        _Waiting.steps += 1
        if _Waiting.steps == 2:
            _Waiting.released = _released.wait(timeout=5)
        return super().step(action)


def test_same_step_sends_the_autoreset_step_as_the_last_step_lands() -> None:
    """World 0's reset reaches its server while world 1's step of that vector step is pending."""
    _released.clear()
    _Ending.resets, _Waiting.steps, _Waiting.released = 0, 0, False
    with (
        serve(lambda settings: _Ending(**settings)) as first,
        serve(lambda settings: _Waiting(**settings)) as second,
    ):
        envs = GymnasiumVectorEnv(
            addresses=[first.address, second.address],
            num_envs=2,
            create_world_settings={"rows": 3},  # episodes of two steps
            autoreset_mode=AutoresetMode.SAME_STEP,
            timeout=20,
        )
        envs.reset(seed=0)
        zeros = {"paddle": np.zeros(2, np.int8)}
        envs.step(zeros)
        observations, _, terminations, _, infos = envs.step(zeros)
        assert _Waiting.released  # world 1 answered only after world 0's reset arrived
        assert terminations.all() and infos["_final_obs"].all()
        assert (observations["board"][:, 0].max(axis=1) == 1.0).all()  # both start again
        envs.close()


def test_same_step_keeps_the_healthy_worlds_steps_when_one_fails(server_process: Any) -> None:
    envs, servers = over_two_servers(
        server_process,
        GymnasiumVectorEnv,
        create_world_settings={"rows": 3},
        timeout=10,
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(2, np.int8)}
    envs.step(zeros)
    servers[1].kill()
    with pytest.raises(errors.WorldError, match=r"step_wait\(\) returns them"):
        envs.step(zeros)
    observations, rewards, terminations, truncations, infos = envs.step_wait()
    # World 0 ended: its row starts the next episode, its last board is in final_obs.
    assert terminations.tolist() == [True, False] and abs(rewards[0]) == 1.0
    assert infos["_final_obs"].tolist() == [True, False]
    assert observations["board"][0, 0].max() == 1.0
    assert infos["final_obs"][0]["board"][-1].max() == 1.0  # the ball reached the bottom row
    # World 1 has a stand-in row, truncated, and no autoreset.
    assert truncations.tolist() == [False, True] and infos["_error"].tolist() == [False, True]
    envs.close()
