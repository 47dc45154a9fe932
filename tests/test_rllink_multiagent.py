"""The RLlink client on multi-agent worlds: one policy shared by every agent of every world.

``run_rllink(..., num_agents=2)`` steps a ``MultiAgentBatch`` of Paddles worlds for the
stand-in learner (``rllink_peer.FakeLearner``), on the SDK's server and on the foreign
server written on the reference package (``ma_foreign_server``: a sync servicer whose
lockstep barrier is a ``threading.Condition``). Each agent of each world ships episodes
of its own; whole worlds step; counts are exact and nothing is lost or sent twice; a
world cut by a failure ships its agents' episodes truncated. Agents whose specs differ
cannot share a policy: a named error. Real RLlib PPO on Paddles is in
``test_rllink_training.py``.
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import dm_env
import numpy as np
import pytest
from dm_env import specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.multiagent import MultiAgentEnvironment
from dm_env_rpc_client.server.paddles import Paddles

pytest.importorskip(
    "ray.rllib", exc_type=ImportError, reason="needs RLlib: pip install -e '.[rllib]'"
)
gymnasium = pytest.importorskip("gymnasium")
rayi = pytest.importorskip("dm_env_rpc_client.integrations.ray")
from conftest import run_child, wait_for  # noqa: E402
from keeping_server import keeping_server  # noqa: E402
from ma_foreign_server import ForeignServer, foreign_server  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from rllink_peer import FakeLearner  # noqa: E402

BOARD = gymnasium.spaces.Box(0.0, 1.0, (50,), np.float32)  # Paddles' 10 x 5 board, flattened
MOVES = gymnasium.spaces.Discrete(3)  # a paddle's move -1, 0, 1 as 0, 1, 2
AGENTS = 2
CLI = [sys.executable, "-m", "dm_env_rpc_client"]


class Target(NamedTuple):
    address: str
    settings: dict[str, Any]  # lockstep Paddles worlds of AGENTS agents with a 10 x 5 board
    foreign: ForeignServer | None


@pytest.fixture(params=["sdk", "foreign"])
def paddles(request: pytest.FixtureRequest) -> Iterator[Target]:
    settings = {"num_agents": AGENTS, "mode": "lockstep", "rows": 10, "columns": 5}
    if request.param == "sdk":
        with dmr.serve(Paddles, agent_timeout=10.0) as served:
            yield Target(served.address, settings, None)
    else:
        with foreign_server(barrier_timeout=10.0) as server:
            yield Target(server.address, settings, server)


def ppo_config(batch: int = 64) -> Any:
    return (
        PPOConfig()
        .environment(observation_space=BOARD, action_space=MOVES)
        .training(train_batch_size_per_learner=batch)
        .debugging(seed=0)
    )


def whole_worlds(calls: list[list[int]]) -> Any:
    """A policy that moves every paddle right, noting the slots it was asked for."""

    def policy(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
        calls.append(timestep.env_ids.tolist())
        return {"paddle": np.ones(len(timestep.env_ids), np.int8)}

    return policy


def _shipped_once_by_agent(learner: FakeLearner) -> dict[tuple[int, str], int]:
    """Every chunk is shipped once; the env steps the learner got, by (world, agent)."""
    keys = [(episode.id_, episode.t_started) for episode in learner.episodes]
    assert not [key for key, count in collections.Counter(keys).items() if count > 1]
    steps: collections.Counter[tuple[int, str]] = collections.Counter()
    for episode in learner.episodes:
        episode.validate()
        steps[(episode.custom_data["world"], episode.custom_data["agent"])] += len(episode)
    return dict(steps)


def test_each_agent_ships_its_own_episodes_and_whole_worlds_step(paddles: Target) -> None:
    learner = FakeLearner(ppo_config(), weights={})
    calls: list[list[int]] = []
    try:
        stats = rayi.run_rllink(
            [paddles.address],
            learner.address,
            num_envs=3,
            num_agents=AGENTS,
            policy=whole_worlds(calls),
            rounds=3,
            create_world_settings=paddles.settings,
            say=print,
        )
        assert wait_for(lambda: learner.batches == 3)  # EPISODES are not answered: poll
    finally:
        learner.close()
    assert stats.worlds == 3 and stats.agents == AGENTS and stats.rounds == 3
    for slots in calls:  # whole worlds only: agent 2w and 2w + 1 together
        assert sorted(slots) == sorted({s - s % 2 for s in slots} | {s | 1 for s in slots})
    by_agent = _shipped_once_by_agent(learner)
    assert stats.steps_shipped == sum(by_agent.values()) >= 3 * 64
    assert stats.steps == stats.steps_shipped + stats.unshipped_steps
    assert stats.unconfirmed_steps == 0 and stats.truncated_by_failure == 0
    assert sorted(by_agent) == [(w, f"agent_{a}") for w in range(3) for a in range(AGENTS)]
    for world in range(3):  # a world's agents took the same steps, and all were shipped
        assert by_agent[(world, "agent_0")] == by_agent[(world, "agent_1")] > 0
    for episode in learner.episodes:
        assert episode.custom_data["behavior"] == "external"
        assert np.asarray(episode.get_observations()).shape[1:] == (50,)
        assert set(np.asarray(episode.get_actions()).tolist()) == {2}  # +1 as Discrete(3)
    ended: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
    for episode in learner.episodes:
        if episode.is_terminated:  # both agents' episodes of a world end at the same step
            ended[episode.custom_data["agent"]].add((episode.custom_data["world"], episode.t))
    assert ended["agent_0"] and ended["agent_0"] == ended["agent_1"]


def test_a_cut_world_ships_every_agents_episode_truncated() -> None:
    """Agent 1's stream of one world is aborted mid-round: the world is made again, and both
    agents' open episodes go to the learner truncated, each step once."""
    learner = FakeLearner(ppo_config(batch=128), weights={})
    calls: list[list[int]] = []
    settings = {"num_agents": AGENTS, "rows": 10, "columns": 5}
    with foreign_server(barrier_timeout=10.0) as server:
        policy = whole_worlds(calls)

        def abort_once(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
            mid = bool(np.all(timestep.step_type == 1))
            if len(calls) >= 12 and mid and server.servicer.abort_agent is None and not cut:
                cut.append(True)
                server.servicer.abort_mid_episode = True  # its episode has steps to cut
                server.servicer.abort_agent = 1  # the next agent 1 to step mid-episode
            return policy(timestep)

        cut: list[bool] = []
        try:
            stats = rayi.run_rllink(
                [server.address],
                learner.address,
                num_envs=2,
                num_agents=AGENTS,
                policy=abort_once,
                rounds=3,
                timeout=10.0,
                create_world_settings=settings,
                restart=dmr.RestartPolicy(attempts=3, backoff=0.05),
            )
            assert wait_for(lambda: learner.batches == 3)
        finally:
            learner.close()
    assert cut and len(stats.restarts) == 1 and stats.worlds_lost == 0
    assert stats.truncated_by_failure + stats.cut_after_ship == AGENTS
    truncated = [e for e in learner.episodes if e.is_truncated]
    assert len(truncated) == stats.truncated_by_failure and all(len(e) for e in truncated)
    assert len({e.custom_data["world"] for e in truncated}) <= 1  # one world's agents
    by_agent = _shipped_once_by_agent(learner)
    assert stats.steps_shipped == sum(by_agent.values())
    assert stats.steps == stats.steps_shipped + stats.unshipped_steps


class _Unequal(MultiAgentEnvironment):
    """Two agents whose observations differ in shape: no shared policy fits both."""

    def agent_names(self) -> tuple[str, ...]:
        return ("left", "right")

    def action_spec(self) -> dict[str, Any]:
        move = specs.BoundedArray((), np.int8, -1, 1, name="paddle")
        return {name: {"paddle": move} for name in self.agent_names()}

    def observation_spec(self) -> dict[str, Any]:
        return {
            name: {"board": specs.Array((size,), np.float32, name="board")}
            for name, size in (("left", 50), ("right", 40))
        }

    def reset(self) -> dict[str, dm_env.TimeStep]:
        return {
            "left": dm_env.restart({"board": np.zeros(50, np.float32)}),
            "right": dm_env.restart({"board": np.zeros(40, np.float32)}),
        }

    def step(self, actions: Any) -> dict[str, dm_env.TimeStep]:
        return self.reset()


def test_agents_whose_specs_differ_are_refused_by_name() -> None:
    learner = FakeLearner(ppo_config(), weights={})
    try:
        with keeping_server(lambda settings: _Unequal()) as kept:
            with pytest.raises(
                rayi.SpaceMismatchError,
                match=r"observation 'board' is float32 \(40,\) for agent 'agent_1' and float32 "
                r"\(50,\) for agent 'agent_0'.*requested_observations.*multi-agent RLlink",
            ):
                rayi.run_rllink(
                    [kept.address], learner.address, num_agents=2, policy="random", rounds=1
                )
            assert kept.worlds == 0  # left and destroyed before the error came out
    finally:
        learner.close()


@pytest.mark.training
def test_one_forward_pass_acts_for_every_agent_of_every_world(
    paddles: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On-policy: the learner's module acts; each pass covers whole worlds, most of them at once."""
    from dm_env_rpc_client.integrations.ray import _rllink_module

    sizes: list[int] = []
    act = _rllink_module.ModuleActor.act

    def counted(self: Any, obs: np.ndarray) -> Any:
        sizes.append(len(obs))
        return act(self, obs)

    monkeypatch.setattr(_rllink_module.ModuleActor, "act", counted)
    learner = FakeLearner(ppo_config())
    try:
        stats = rayi.run_rllink(
            [paddles.address],
            learner.address,
            num_envs=4,
            num_agents=AGENTS,
            rounds=2,
            create_world_settings=paddles.settings,
            say=print,
        )
    finally:
        learner.close()
    assert stats.weight_updates == 2 and stats.behavior == "rl_module"
    assert all(size % AGENTS == 0 for size in sizes)  # whole worlds
    assert max(sizes) == 4 * AGENTS  # every agent of every world in one pass
    by_agent = _shipped_once_by_agent(learner)
    assert stats.steps_shipped == sum(by_agent.values()) >= 2 * 64
    for episode in learner.episodes:
        logp = episode.get_extra_model_outputs("action_logp")
        assert len(logp) == len(episode) and np.all(np.asarray(logp) <= 0)


def test_the_cli_serves_multi_agent_worlds(paddles: Target) -> None:
    learner = FakeLearner(ppo_config(), weights={})
    settings = [f"--create-setting={key}={value}" for key, value in paddles.settings.items()]
    try:
        done = run_child(
            [
                *CLI,
                "run",
                *("--address", paddles.address, "--num-envs", "2", *settings, "--json"),
                *("--rllib-server", learner.address, "--rllib-agents", "2"),
                *("--rllib-policy", "random", "--rllib-rounds", "2"),
            ],
            timeout=100,
        )
        assert wait_for(lambda: learner.batches == 2)
    finally:
        learner.close()
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["worlds"] == 2 and summary["agents"] == 2 and summary["rounds"] == 2
    assert summary["steps_shipped"] == sum(len(e) for e in learner.episodes) >= 128
    assert {e.custom_data["agent"] for e in learner.episodes} == {"agent_0", "agent_1"}
