"""``dmr.MultiAgentWorld`` and ``dmr.MultiAgentBatch`` against the SDK's own multi-agent server
(``server/paddles.py``, CONTRACTS.md section 2); skipped until that server is in the tree."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import dm_env
import numpy as np
import pytest
from dm_env import specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.multiagent import MultiAgentEnvironment

paddles = pytest.importorskip(
    "dm_env_rpc_client.server.paddles", reason="the SDK's multi-agent server (branch ma-server)"
)


@pytest.fixture
def server() -> Iterator[dmr.Server]:
    with dmr.serve(paddles.Paddles) as running:
        yield running


@pytest.mark.parametrize("mode", ["lockstep", "turns"])
def test_a_world_of_the_sdks_server_steps_every_agent_at_once(server, mode):
    settings = {"seed": 1, "num_agents": 3, "mode": mode}
    with dmr.MultiAgentWorld.connect(server.address, 3, create_world_settings=settings) as world:
        paddle = world.action_spec()["agent_2"]["paddle"]
        assert paddle.dtype == np.int8 and (paddle.minimum, paddle.maximum) == (-1, 1)
        assert world.observation_spec()["agent_0"]["board"].dtype == np.float32
        assert all(step.first() for step in world.reset().values())
        kinds = set()
        for _ in range(40):
            steps = world.step({agent: {"paddle": 1} for agent in world.agents})
            kinds |= {step.step_type for step in steps.values()}
            if mode == "lockstep":  # the agents agree (in turns, each sees the end at its turn)
                assert len({step.step_type for step in steps.values()}) == 1
        assert dm_env.StepType.MID in kinds
        assert all(step.first() for step in world.reset_world({"seed": 2}).values())


def test_picked_agents_and_a_matchmakers_world(server):
    with dmr.connect(server.address, timeout=10) as matchmaker:
        name = dmr.create_world(matchmaker, {"seed": 1, "num_agents": 2})
        joins = [{"agent": "agent_1"}, {"agent": 0}]
        with dmr.MultiAgentWorld.connect(
            server.address, 2, world_name=name, join_world_settings=joins
        ) as world:
            assert world.agents == ["agent_1", "agent_0"]
            assert all(step.first() for step in world.reset().values())
            world.step({"agent_0": {"paddle": 0}, "agent_1": {"paddle": 0}})
        dmr.destroy_world(matchmaker, name)


def test_a_batch_of_the_sdks_worlds_and_collect(server):
    with dmr.MultiAgentBatch.connect(
        server.address, 3, 2, create_world_settings={"num_agents": 2}, seed=5
    ) as batch:
        batch.reset_agents()
        actions = {agent: {"paddle": np.ones(3, np.int8)} for agent in batch.agents}
        steps = batch.step_agents(actions)
        assert steps["agent_1"].env_ids.tolist() == [0, 1, 2]
        assert dmr.collect(batch, steps=6 * 20, seed=0).steps == 120


def test_connect_takes_the_option_groups_and_their_keywords_alone(server):
    """``connection=`` and ``failure_policy=`` do what their keywords do, as for
    ``BatchedEnvironment.connect``; the keywords alone still work."""
    settings = {"num_agents": 2}
    with dmr.MultiAgentBatch.connect(
        server.address,
        3,
        2,
        create_world_settings=settings,
        connection=dmr.ConnectionOptions(max_streams_per_connection=2, metadata=[("k", "v")]),
        failure_policy=dmr.FailurePolicy("restart", step_timeout=7.0),
    ) as batch:
        assert len(batch._channels) == 3  # 6 agent streams, 2 on each connection
        assert (batch._policy, batch._step_timeout) == ("restart", 7.0)
        assert batch.step_agents({a: [{}] * 3 for a in batch.agents})["agent_0"].env_ids.size == 3
    with dmr.MultiAgentWorld.connect(
        server.address, 2, create_world_settings=settings, step_timeout=4.0, insecure=True
    ) as world:
        assert world.batch._step_timeout == 4.0
        assert all(step.first() for step in world.reset().values())


def test_steps_cut_by_agent_are_the_same_either_way(server):
    """A round's steps of every agent of every world are cut by strided views; any other batch
    by its env_ids: both give each agent the same steps."""
    with dmr.MultiAgentBatch.connect(
        server.address, 3, 3, create_world_settings={"num_agents": 3}, seed=2
    ) as batch:
        batch.reset_agents()
        worlds, slots = batch._slots(None)
        batch.send({"paddle": np.array([1, 0, -1] * 3, np.int8)}, slots)
        flat = batch.recv(len(slots), timeout=10, env_ids=slots)
        strided, by_ids = batch._by_agent(flat, worlds), batch._by_agent(flat)
        for name in batch.agents:
            assert strided[name].env_ids.tolist() == by_ids[name].env_ids.tolist() == [0, 1, 2]
            np.testing.assert_array_equal(
                strided[name].observation["board"], by_ids[name].observation["board"]
            )
            np.testing.assert_array_equal(strided[name].reward, by_ids[name].reward)
        assert batch._slots(None) == (worlds, slots) and batch._slots(worlds)[1] is slots


class Uneven(MultiAgentEnvironment):
    """Two agents with specs of their own: a ``nudge`` in [-1, 1] that observes how far it
    moved (an int32), and a ``shove`` in [-3, 3] that observes a ``force`` (two float32s).
    Every action it is given is kept in ``taken``."""

    taken: ClassVar[list[dict[str, int]]] = []

    def agent_names(self) -> tuple[str, str]:
        return ("nudge", "shove")

    def action_spec(self) -> dict[str, Any]:
        return {
            "nudge": {"push": specs.BoundedArray((), np.int8, -1, 1, name="push")},
            "shove": {"push": specs.BoundedArray((), np.int8, -3, 3, name="push")},
        }

    def observation_spec(self) -> dict[str, Any]:
        return {
            "nudge": {"moved": specs.Array((), np.int32, name="moved")},
            "shove": {"force": specs.Array((2,), np.float32, name="force")},
        }

    def _timesteps(self, kind: Any, pushes: Mapping[str, int]) -> dict[str, dm_env.TimeStep]:
        force = np.full(2, pushes["shove"], np.float32)
        return {
            "nudge": kind({"moved": np.int32(pushes["nudge"])}),
            "shove": kind({"force": force}),
        }

    def reset(self) -> dict[str, dm_env.TimeStep]:
        return self._timesteps(dm_env.restart, {"nudge": 0, "shove": 0})

    def step(self, actions: Mapping[str, Any]) -> dict[str, dm_env.TimeStep]:
        pushes = {name: int(action["push"]) for name, action in actions.items()}
        Uneven.taken.append(pushes)
        return self._timesteps(lambda observation: dm_env.transition(0.0, observation), pushes)


_ROLES = [{"agent": "nudge"}, {"agent": "shove"}]


def test_agents_that_observe_things_of_their_own_get_their_own():
    """A batch whose agents' observation specs differ: each agent's steps hold its own
    observations (its names, dtypes and shapes), whether cut from a round of the batch or
    from ``dmr.collect``'s flat batches, and a ``MultiAgentWorld`` of it steps too."""
    with (
        dmr.serve(lambda settings: Uneven()) as served,
        dmr.MultiAgentBatch.connect(
            served.address, 2, 2, join_world_settings=_ROLES, timeout=10
        ) as batch,
    ):
        first = batch.reset_agents()
        assert list(first["nudge"].observation) == ["moved"]
        assert first["shove"].observation["force"].shape == (2, 2)
        pushes = {"nudge": {"push": np.int8([1, -1])}, "shove": {"push": np.int8([3, -2])}}
        steps = batch.step_agents(pushes)
        moved, force = steps["nudge"].observation["moved"], steps["shove"].observation["force"]
        assert moved.dtype == np.int32 and moved.tolist() == [1, -1]
        assert force.dtype == np.float32 and force.tolist() == [[3, 3], [-2, -2]]
        assert list(steps["shove"].observation) == ["force"]
        assert dmr.collect(batch, 2 * 2 * 10, seed=1, timeout=10).steps == 40
    with (
        dmr.serve(lambda settings: Uneven()) as served,
        dmr.MultiAgentWorld.connect(served.address, 2, join_world_settings=_ROLES) as world,
    ):
        assert world.reset()["nudge"].observation == {"moved": 0}
        step = world.step({"nudge": {"push": 0}, "shove": {"push": 2}})
        assert step["shove"].observation["force"].tolist() == [2.0, 2.0]
        assert list(step["nudge"].observation) == ["moved"]


def test_random_actions_draw_each_agent_from_its_own_spec():
    """``dmr.collect``'s random actions for a world whose agents' action specs differ: each
    agent's come from its own spec (the shove reaches past the nudge's bounds, neither passes
    its own), reproducibly from the seed."""
    runs, picks = [], _ROLES
    for _ in range(2):
        Uneven.taken = []
        with (
            dmr.serve(lambda settings: Uneven()) as served,
            dmr.MultiAgentBatch.connect(
                served.address, 2, 2, join_world_settings=picks, timeout=10
            ) as batch,
        ):
            assert batch.action_specs()["shove"]["push"].maximum == 3
            stats = dmr.collect(batch, 2 * 2 * 40, seed=5, timeout=10)
            assert stats.steps == 160
        runs.append(sorted(tuple(sorted(step.items())) for step in Uneven.taken))
    nudges = [step["nudge"] for step in Uneven.taken]
    shoves = [step["shove"] for step in Uneven.taken]
    assert set(nudges) <= {-1, 0, 1} and len(set(nudges)) == 3
    assert set(shoves) <= set(range(-3, 4)) and {-3, 3} & set(shoves)
    assert runs[0] == runs[1]
