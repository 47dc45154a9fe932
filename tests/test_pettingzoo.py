"""``integrations.pettingzoo.ParallelEnv`` against real multi-agent servers.

Two servers: the SDK's own (``dmr.serve`` of ``Paddles``) and a foreign one written on the
reference ``dm-env-rpc`` package (``ma_foreign_server``: a sync servicer whose lockstep step
blocks on a condition variable), each in lockstep and turns mode. PettingZoo's own checks
(``parallel_api_test``, ``parallel_seed_test``, ``api_test`` through ``parallel_to_aec``) run
against every one of them.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest
from ma_foreign_server import foreign_server

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server import serve
from dm_env_rpc_client.server.paddles import Paddles

pettingzoo = pytest.importorskip("pettingzoo")
from pettingzoo.test import api_test, parallel_api_test, parallel_seed_test  # noqa: E402

from dm_env_rpc_client.integrations.pettingzoo import ParallelEnv, aec_env  # noqa: E402

SERVERS = ["sdk-lockstep", "sdk-turns", "foreign-lockstep", "foreign-turns"]


@pytest.fixture(params=SERVERS)
def world(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(address, create_world_settings)`` of a multi-agent Paddles server."""
    kind, mode = request.param.split("-")
    settings = {"seed": 3, "num_agents": 2, "mode": mode}
    if kind == "sdk":
        with serve(lambda s: Paddles(**s), agent_timeout=20.0) as server:
            yield server.address, settings
    else:
        with foreign_server(barrier_timeout=20.0) as server:
            yield server.address, settings


@pytest.fixture
def foreign() -> Iterator[Any]:
    with foreign_server(barrier_timeout=20.0) as server:
        yield server


def _env(address: str, settings: dict[str, Any], **kwargs: Any) -> ParallelEnv:
    return ParallelEnv(address=address, num_agents=2, create_world_settings=settings, **kwargs)


def _random(env: ParallelEnv, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {agent: int(rng.integers(env.action_space(agent).n)) for agent in env.agents}


# --- PettingZoo's own checks -----------------------------------------------------------------


def test_parallel_api_test(world):
    env = _env(*world)
    try:
        parallel_api_test(env, num_cycles=60)
    finally:
        env.close()


def test_parallel_seed_test(world):
    made: list[ParallelEnv] = []

    def make() -> ParallelEnv:
        made.append(_env(*world))
        return made[-1]

    try:
        parallel_seed_test(make, num_cycles=40)
    finally:
        for env in made:
            env.close()
    assert len(made) >= 2  # two envs compared


def test_api_test_through_parallel_to_aec(world):
    env = aec_env(address=world[0], num_agents=2, create_world_settings=world[1])
    try:
        api_test(env, num_cycles=60)
    finally:
        env.close()


# --- episodes --------------------------------------------------------------------------------


def test_finished_agents_leave_agents_and_the_episode_ends_for_all(world):
    with_env = _env(*world)
    try:
        observations, infos = with_env.reset(seed=5)
        assert with_env.agents == with_env.possible_agents == ["agent_0", "agent_1"]
        assert set(observations) == set(infos) == {"agent_0", "agent_1"}
        for agent, observation in observations.items():
            assert with_env.observation_space(agent).contains(observation)
        steps = 0
        while with_env.agents:
            before = list(with_env.agents)
            _, rewards, terminations, truncations, _ = with_env.step(_random(with_env, steps))
            steps += 1
            assert set(rewards) == set(terminations) == set(truncations) == set(before)
            assert with_env.agents == [a for a in before if not (terminations[a] or truncations[a])]
        # Paddles ends the episode for every agent at once, with discount 0: terminated.
        assert all(terminations.values()) and not any(truncations.values())
        assert 3 <= steps <= 9  # the ball falls to the bottom row (in turns, a row a turn)
        with pytest.raises(dmr.ArgumentValueError, match="Call reset"):
            with_env.step({})
        with_env.reset()
        assert with_env.agents == ["agent_0", "agent_1"]
    finally:
        with_env.close()


def test_reset_with_a_seed_replays_the_episode(world):
    env = _env(*world)
    try:

        def episode(seed: int) -> list[np.ndarray]:
            observations, _ = env.reset(seed=seed)
            boards = [observations["agent_0"]]
            while env.agents:
                observations, *_ = env.step({a: 1 for a in env.agents})
                boards.append(observations["agent_0"])
            return boards

        first, other, again = episode(11), episode(12), episode(11)
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
        # Some seed among a few starts the ball in another column.
        others = [episode(seed)[0] for seed in range(20, 26)] + [other[0]]
        assert any(not np.array_equal(first[0], board) for board in others)
    finally:
        env.close()


# --- copies make worlds of their own ---------------------------------------------------------


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_a_copy_makes_its_own_world_and_both_step(world, dumps):
    env = _env(*world)
    try:
        env.reset(seed=1)
        copy = pickle.loads(dumps(env))
        try:
            assert copy.agents == [] and copy.world_name is None  # nothing opened yet
            assert copy.possible_agents == env.possible_agents
            assert copy.action_space("agent_0") == env.action_space("agent_0")
            copy.reset(seed=1)
            assert copy.world_name is not None and copy.world_name != env.world_name
            for _ in range(3):
                a = env.step({agent: 2 for agent in env.agents})
                b = copy.step({agent: 2 for agent in copy.agents})
                for agent in ("agent_0", "agent_1"):  # same seed, same actions, two worlds
                    assert np.array_equal(a[0][agent], b[0][agent])
        finally:
            copy.close()
        env.step({agent: 0 for agent in env.agents})  # the original's world is untouched
    finally:
        env.close()


def test_a_copy_of_a_closed_env_opens_again(world):
    env = _env(*world)
    env.close()
    copy = cloudpickle.loads(cloudpickle.dumps(env))
    try:
        observations, _ = copy.reset()
        assert set(observations) == {"agent_0", "agent_1"}
    finally:
        copy.close()


# --- bad input: a named error, nothing sent --------------------------------------------------


def test_a_missing_or_unknown_agents_action_is_refused_before_anything_is_sent(foreign):
    env = _env(foreign.address, {"seed": 1})
    try:
        env.reset(seed=1)
        sent = foreign.servicer.steps_received
        with pytest.raises(dmr.ArgumentValueError, match="no action for \\['agent_1'\\]"):
            env.step({"agent_0": 1})
        with pytest.raises(dmr.ArgumentValueError, match="'agent_9'.*not in env.agents"):
            env.step({"agent_0": 1, "agent_1": 1, "agent_9": 1})
        with pytest.raises(dmr.ArgumentValueError, match="no action for"):
            env.step({})
        assert foreign.servicer.steps_received == sent  # nothing was written
        assert env.agents == ["agent_0", "agent_1"]
        env.step({"agent_0": 1, "agent_1": 1})  # the episode goes on
        assert foreign.servicer.steps_received == sent + 2
    finally:
        env.close()


def test_an_action_outside_its_space_is_refused_before_anything_is_sent(foreign):
    env = _env(foreign.address, {"seed": 1})
    try:
        env.reset()
        sent = foreign.servicer.steps_received
        with pytest.raises(dmr.ArgumentValueError, match="agent_1.*Discrete\\(3\\)"):
            env.step({"agent_0": 1, "agent_1": 7})
        assert foreign.servicer.steps_received == sent
    finally:
        env.close()


def test_step_before_reset_and_after_close_are_named_errors(foreign):
    env = _env(foreign.address, {"seed": 1})
    with pytest.raises(dmr.ArgumentValueError, match="Call reset\\(\\) before step"):
        env.step({"agent_0": 1, "agent_1": 1})
    assert foreign.servicer.steps_received == 0
    env.close()
    env.close()  # idempotent
    for call in (lambda: env.reset(), lambda: env.step({"agent_0": 1, "agent_1": 1})):
        with pytest.raises(dmr.ArgumentValueError, match="closed; make a new one"):
            call()
    assert not foreign.servicer.worlds or all(w.destroyed for w in foreign.servicer.worlds.values())


def test_render_mode_other_than_none_is_refused(foreign):
    with pytest.raises(dmr.ArgumentValueError, match="render_mode must be None"):
        _env(foreign.address, {}, render_mode="human")
    assert foreign.servicer.steps_received == 0


# --- SuperSuit's vector env ------------------------------------------------------------------


def test_supersuit_vec_env_shapes():
    ss = pytest.importorskip("supersuit")
    with serve(lambda s: Paddles(**s), agent_timeout=20.0) as server:
        parallel = ParallelEnv(
            address=server.address, num_agents=3, create_world_settings={"seed": 2, "num_agents": 3}
        )
        vec = ss.pettingzoo_env_to_vec_env_v1(parallel)
        vec = ss.concat_vec_envs_v1(vec, 2, num_cpus=0, base_class="gymnasium")
        try:
            assert vec.num_envs == 6  # 2 copies x 3 agents
            observations, _ = vec.reset(seed=0)
            assert observations.shape == (6, 10, 5) and observations.dtype == np.float32
            rng = np.random.default_rng(0)
            total = 0
            for _ in range(12):  # past one episode's end (9 steps): the copies reset themselves
                actions = rng.integers(0, 3, size=6)
                observations, rewards, terminations, truncations, _ = vec.step(actions)
                assert observations.shape == (6, 10, 5)
                assert rewards.shape == terminations.shape == truncations.shape == (6,)
                total += int(terminations.sum())
            assert total == 6  # every agent of both copies finished one episode
        finally:
            vec.close()
            parallel.close()
