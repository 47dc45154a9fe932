"""Multi-agent worlds on another gRPC stack: the Node.js @grpc/grpc-js test server's lockstep mode.

tests/node_server/server.js serves a world of ``num_agents >= 2`` as a multi-agent world: one
JoinWorld per stream, one paddle per agent under one ball, and a lockstep step that answers no
agent until every joined agent has acted (the waiting stream's later requests wait behind it),
bounded by ``--agent-timeout``. ``dmr.MultiAgentWorld`` and ``dmr.MultiAgentBatch`` run against
it: the deadlock of one thread stepping agents in turn is real there too, the SDK's route is
not; join settings, ResetWorld, a leave, a barrier that never completes, a world's close; and
``check``'s every rule, its multi-agent group included, passes on the server's 2-agent worlds.
Skipped, with the reason, without ``node`` or ``npm ci`` in tests/node_server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dm_env
import numpy as np
import pytest
from node_peer import NODE_SKIP_REASON, node_server
from raw_stream import RawStream

import dm_env_rpc_client as dmr
from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client.conformance import check_server

pytestmark = pytest.mark.skipif(NODE_SKIP_REASON is not None, reason=str(NODE_SKIP_REASON))

BARRIER_S = 1.5  # the server's bound on a step waiting at the barrier
ROWS = 5  # an episode: FIRST, 3 MID, LAST


@pytest.fixture(scope="module")
def node() -> Iterator[Any]:
    with node_server(agent_timeout=BARRIER_S) as server:
        yield server


def _settings(agents: int = 2, seed: int = 1) -> dict[str, int]:
    return {"num_agents": agents, "seed": seed, "rows": ROWS}


def test_one_thread_stepping_agents_in_turn_deadlocks_until_the_barrier_gives_up(node):
    with dmr.connect(node.address, timeout=10) as first, dmr.connect(node.address) as second:
        env, name = dmr.create_and_join_world(first, _settings(), {"agent": 0})
        other = dmr.join_world(second, name, {"agent": 1})
        with pytest.raises(dmr.DmEnvRpcError, match="did not act: agent_1") as caught:
            env.reset()
        assert caught.value.code == 4  # DEADLINE_EXCEEDED
        other.close()  # first: a world is not destroyed while an agent is joined
        env.close()


@pytest.mark.parametrize("agents", [2, 3])
def test_a_world_steps_every_agent_at_once_with_its_own_paddle_and_reward(node, agents):
    with dmr.MultiAgentWorld.connect(
        node.address, agents, create_world_settings=_settings(agents), timeout=10
    ) as world:
        assert world.agents == [f"agent_{k}" for k in range(agents)]
        assert world.action_spec()["agent_1"]["paddle"].dtype == np.int8
        first = world.reset()
        assert all(step.first() for step in first.values())
        moves = [-1, 1, 0][:agents]
        kinds = []
        for _ in range(ROWS):
            steps = world.step({f"agent_{k}": {"paddle": m} for k, m in enumerate(moves)})
            kinds.append({step.step_type for step in steps.values()})
        assert kinds[: ROWS - 1] == [{dm_env.StepType.MID}] * 3 + [{dm_env.StepType.LAST}]
        assert kinds[-1] == {dm_env.StepType.FIRST}
        # Each board shows the ball and the agent's own paddle, moved its own way.
        board = {name: step.observation["board"] for name, step in steps.items()}
        assert np.argmax(board["agent_0"][-1]) == 2 and np.argmax(board["agent_1"][-1]) == 2
        assert repr(world).startswith("MultiAgentWorld('world_")


def test_the_agents_rewards_differ_by_their_paddles(node):
    """Over a few episodes the agent that follows the ball and the one that does not differ."""
    with dmr.MultiAgentWorld.connect(
        node.address, 2, create_world_settings=_settings(seed=4), timeout=10
    ) as world:
        steps = world.reset()
        returns = {name: 0.0 for name in world.agents}
        for _ in range(5 * ROWS):
            ball = int(np.argmax(steps["agent_0"].observation["board"].max(axis=0)[:]))
            paddles = {n: int(np.argmax(s.observation["board"][-1])) for n, s in steps.items()}
            follow = int(np.sign(ball - paddles["agent_0"]))
            steps = world.step({"agent_0": {"paddle": follow}, "agent_1": {"paddle": -1}})
            for name, step in steps.items():
                returns[name] += step.reward or 0.0
        assert returns["agent_0"] > returns["agent_1"]


def test_join_settings_pick_agents_and_bad_picks_get_the_servers_named_errors(node):
    with dmr.connect(node.address, timeout=10) as matchmaker:
        name = dmr.create_world(matchmaker, _settings())
        joins = [{"agent": 1}, {"agent": 0}]
        with dmr.MultiAgentWorld.connect(
            node.address, 2, world_name=name, join_world_settings=joins, timeout=10
        ) as world:
            assert world.agents == ["agent_1", "agent_0"]
            assert all(step.first() for step in world.reset().values())
            with dmr.connect(node.address, timeout=10) as late:  # the world is full
                with pytest.raises(dmr.DmEnvRpcError, match="is full") as caught:
                    dmr.join_world(late, name, {})
                assert caught.value.code == 8  # RESOURCE_EXHAUSTED
            with pytest.raises(dmr.DmEnvRpcError, match="joined; leave it first"):
                dmr.destroy_world(matchmaker, name)  # agents still joined
        with pytest.raises(dmr.WorldError, match="out of range"):
            dmr.MultiAgentWorld.connect(
                node.address, 2, world_name=name, join_world_settings=[{"agent": 0}, {"agent": 5}]
            )
        dmr.destroy_world(matchmaker, name)  # every agent left on close: it may go now


def test_a_taken_agent_is_already_exists(node):
    with dmr.connect(node.address, timeout=10) as one, dmr.connect(node.address) as two:
        env, name = dmr.create_and_join_world(one, _settings(), {"agent": 0})
        with pytest.raises(dmr.DmEnvRpcError, match="agent_0 of world .* is taken") as caught:
            dmr.join_world(two, name, {"agent": 0})
        assert caught.value.code == 6  # ALREADY_EXISTS
        env.close()


def test_reset_world_between_episodes_and_mid_episode_gives_every_agent_a_first_step(node):
    with dmr.MultiAgentWorld.connect(
        node.address, 2, create_world_settings=_settings(), timeout=10
    ) as world:
        first = world.reset_world({"seed": 9})  # no episode running yet
        assert all(step.first() for step in first.values())
        ball = np.argmax(first["agent_0"].observation["board"][0])
        world.step({name: {"paddle": 1} for name in world.agents})
        again = world.reset_world({"seed": 9})  # mid-episode: interrupted, then FIRST
        assert all(step.first() for step in again.values())
        assert np.argmax(again["agent_1"].observation["board"][0]) == ball


def test_a_barrier_that_never_completes_is_a_named_bounded_error_and_a_leave_lets_go(node):
    """A third agent joined over a raw stream never steps: the SDK's agents get the server's
    DEADLINE_EXCEEDED naming it; once it leaves, the other two go on."""
    with dmr.connect(node.address, timeout=10) as matchmaker:
        name = dmr.create_world(matchmaker, _settings(agents=3))
        idle = RawStream(node.address)
        try:
            idle.ok(join_world=dm_env_rpc_pb2.JoinWorldRequest(world_name=name))
            with dmr.MultiAgentWorld.connect(
                node.address, 2, world_name=name, timeout=10, step_timeout=10.0
            ) as world:
                with pytest.raises(dmr.WorldError, match="did not act: agent_0") as caught:
                    world.reset()
                assert "World 0 (agent " in str(caught.value)
                idle.ok(leave_world=dm_env_rpc_pb2.LeaveWorldRequest())
                assert all(step.first() for step in world.reset().values())
                steps = world.step({n: {"paddle": 0} for n in world.agents})
                assert all(step.mid() for step in steps.values())
        finally:
            idle.close()
        dmr.destroy_world(matchmaker, name)


def test_a_batch_of_node_worlds_by_agent_and_collect(node):
    with dmr.MultiAgentBatch.connect(
        node.address,
        3,
        2,
        create_world_settings={"num_agents": 2, "rows": ROWS},
        seed=5,
        timeout=10,
    ) as batch:
        assert batch.world_seeds == [5, 5, 6, 6, 7, 7]
        first = batch.reset_agents()
        assert first["agent_0"].env_ids.tolist() == [0, 1, 2]
        steps = batch.step_agents({a: {"paddle": np.ones(3, np.int8)} for a in batch.agents})
        assert (steps["agent_1"].step_type == int(dm_env.StepType.MID)).all()
        stats = dmr.collect(batch, steps=6 * 20, seed=0, timeout=10.0)
        assert stats.steps == 120 and batch.pending() == 0
        assert stats.episodes == 6 * 3  # every agent ends an episode every 5 steps (FIRST too)
        batch.reset_worlds({"seed": 1}, [1])


def test_an_agent_whose_stream_dies_mid_barrier_lets_the_others_go_on(node):
    """The SDK's two agents wait at the barrier for a third, joined over a raw stream; that
    stream dies (the Node server takes it as a leave), and their steps are answered."""
    with dmr.connect(node.address, timeout=10) as matchmaker:
        name = dmr.create_world(matchmaker, _settings(agents=3))
        third = RawStream(node.address)
        third.ok(join_world=dm_env_rpc_pb2.JoinWorldRequest(world_name=name))
        with dmr.MultiAgentWorld.connect(
            node.address, 2, world_name=name, timeout=10, step_timeout=10.0
        ) as world:
            world.batch.send_agents({n: [{}] for n in world.agents})  # both wait for agent 2
            third.close()
            steps = world.batch.recv_agents(timeout=BARRIER_S)  # within the barrier's bound
            assert all(step.step_type.tolist() == [0] for step in steps.values())  # FIRST
            assert all(s.mid() for s in world.step({n: {} for n in world.agents}).values())
        dmr.destroy_world(matchmaker, name)


def test_check_passes_every_rule_multi_agent_group_included(node):
    """On worlds of 2 agents (a world's barrier waits for its joined agents only, so the
    one-agent rules step alone) every rule passes, the multi-agent group's four too."""
    report = check_server(
        node.address,
        create_world_settings={"num_agents": 2},
        latency_steps=20,
        episode_steps=100,
        timeout=5.0,
    )
    statuses = {finding.rule: finding.status for finding in report.findings}
    assert {rule: s for rule, s in statuses.items() if s != "pass"} == {}
    assert len([rule for rule in statuses if rule.startswith("multi-agent.")]) == 4
    detail = report.by_rule()["multi-agent.reset-world"].detail
    assert detail == "both agents INTERRUPTED, then RUNNING"
