"""``dmr.MultiAgentWorld`` and ``dmr.MultiAgentBatch`` against a foreign multi-agent server.

The server (``ma_foreign_server``) is written on the reference ``dm-env-rpc`` package: a sync
gRPC servicer whose lockstep step blocks on a condition variable until every joined agent of
the world has acted, as most multi-agent servers in the wild do.
"""

from __future__ import annotations

from collections.abc import Iterator

import dm_env
import numpy as np
import pytest
from conftest import wait_for
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor
from dm_env_rpc.v1 import error as reference_error
from ma_foreign_server import ForeignServer, foreign_server

import dm_env_rpc_client as dmr

BARRIER_S = 2.0  # the server's bound on a waiting agent's step


@pytest.fixture
def server() -> Iterator[ForeignServer]:
    with foreign_server(barrier_timeout=BARRIER_S) as running:
        yield running


def _settings(num_agents: int = 2, mode: str = "lockstep", seed: int = 1) -> dict:
    return {"num_agents": num_agents, "mode": mode, "seed": seed}


def _nothing_left(server: ForeignServer) -> bool:
    return server.servicer.active_streams == 0 and not server.servicer.worlds


# --- the deadlock is real; the SDK's route is not --------------------------------------------


def test_stepping_agents_one_after_another_from_one_thread_deadlocks_the_reference_client(server):
    """The reference client, one DmEnvAdaptor per agent, stepped in turn from one thread: the
    first agent's step waits for the second, which is never sent, until the server gives up."""
    connections = [
        reference_connection.create_secure_channel_and_connect(server.address, timeout=10)
        for _ in range(2)
    ]
    try:
        name = reference_adaptor.create_world(connections[0], _settings())
        envs = [
            reference_adaptor.join_world(conn, name, {"agent": k})
            for k, conn in enumerate(connections)
        ]
        with pytest.raises(reference_error.DmEnvRpcError) as caught:
            for env in envs:  # never gets past the first
                env.reset()
        assert "did not act: agent_1" in str(caught.value)
        assert caught.value.code == 4  # DEADLINE_EXCEEDED
    finally:
        for conn in connections:
            conn.close()


def test_stepping_the_sdks_own_adaptors_one_after_another_deadlocks_too(server):
    with dmr.connect(server.address, timeout=10) as first, dmr.connect(server.address) as second:
        env, name = dmr.create_and_join_world(first, _settings(), {"agent": 0})
        other = dmr.join_world(second, name, {"agent": 1})
        with pytest.raises(dmr.DmEnvRpcError, match="did not act: agent_1"):
            env.reset()
        env.close()
        other.close()


@pytest.mark.parametrize("mode", ["lockstep", "turns"])
def test_the_sdks_multi_agent_world_steps_the_same_server(server, mode):
    with dmr.MultiAgentWorld.connect(
        server.address, 2, create_world_settings=_settings(mode=mode)
    ) as world:
        first = world.reset()
        assert set(first) == {"agent_0", "agent_1"}
        assert all(step.first() for step in first.values())
        kinds = []
        for _ in range(12):
            steps = world.step({"agent_0": {"paddle": 1}, "agent_1": {"paddle": -1}})
            kinds.append({step.step_type for step in steps.values()})
        # The ball lands on the 9th step of each episode (rows=10); both agents see it.
        assert kinds[8] == {dm_env.StepType.LAST} and kinds[9] == {dm_env.StepType.FIRST}
        assert all(len(kind) == 1 for kind in kinds)
    assert wait_for(lambda: _nothing_left(server))


# --- one world -------------------------------------------------------------------------------


def test_per_agent_join_settings_specs_and_observations(server):
    joins = [{"agent": "agent_1"}, {"agent": 0}]
    settings = _settings(num_agents=2)
    with dmr.MultiAgentWorld.connect(
        server.address, 2, create_world_settings=settings, join_world_settings=joins
    ) as world:
        assert world.agents == ["agent_1", "agent_0"]
        paddle = world.action_spec()["agent_1"]["paddle"]
        assert paddle.dtype == np.int8 and (paddle.minimum, paddle.maximum) == (-1, 1)
        assert world.observation_spec()["agent_0"]["board"].shape == (10, 8)
        steps = world.reset()
        board_1, board_0 = (
            steps["agent_1"].observation["board"],
            steps["agent_0"].observation["board"],
        )
        # Each agent sees its own paddle at 1.0 and the other's at 0.5.
        assert board_0[9, 0] == 1.0 and board_0[9, 4] == 0.5
        assert board_1[9, 4] == 1.0 and board_1[9, 0] == 0.5
        assert repr(world).startswith("MultiAgentWorld('paddles-")


def test_joining_a_world_made_elsewhere_leaves_it_on_close(server):
    """A matchmaker makes the world and hands out its name; the agents join it."""
    with dmr.connect(server.address, timeout=10) as matchmaker:
        name = dmr.create_world(matchmaker, _settings(num_agents=3))
        with dmr.MultiAgentWorld.connect(server.address, 3, world_name=name) as world:
            assert world.world_name == name
            assert world.agents == ["agent_0", "agent_1", "agent_2"]
            assert all(step.first() for step in world.reset().values())
            world.step({agent: {"paddle": 0} for agent in world.agents})
        assert wait_for(lambda: server.servicer.active_streams == 1)
        assert name in server.servicer.worlds  # left, not destroyed: the matchmaker's
        assert not server.servicer.worlds[name].joined
        dmr.destroy_world(matchmaker, name)
    assert wait_for(lambda: _nothing_left(server))


def test_reset_world_interrupts_every_agent_then_starts_again_reseeded(server):
    with dmr.MultiAgentWorld.connect(server.address, 2, create_world_settings=_settings()) as world:
        world.reset()
        world.step({agent: {"paddle": 0} for agent in world.agents})
        first = world.reset_world({"seed": 7})
        assert all(step.first() for step in first.values())
        ball = np.argwhere(first["agent_0"].observation["board"][0])[0, 0]
        again = world.reset_world({"seed": 7})
        assert np.argwhere(again["agent_0"].observation["board"][0])[0, 0] == ball


@pytest.mark.parametrize(
    ("actions", "message"),
    [
        ({"agent_0": {"paddle": 1}, "agent_1": {}, "agent_7": {}}, "'agent_7', which this world"),
        ({"agent_0": {"paddle": 1}}, "nothing for 'agent_1'"),
        ({"agent_0": {"paddle": 1}, "agent_1": {"paddle": 5}}, "paddle"),
    ],
)
def test_bad_actions_are_refused_by_name_before_anything_is_sent(server, actions, message):
    with dmr.MultiAgentWorld.connect(server.address, 2, create_world_settings=_settings()) as world:
        world.reset()
        sent = server.servicer.steps_received
        with pytest.raises(dmr.DmEnvRpcClientError, match=message):
            world.step(actions)
        assert server.servicer.steps_received == sent  # no agent's step went out
        steps = world.step({"agent_0": {"paddle": 1}, "agent_1": {}})  # and the world goes on
        assert all(step.mid() for step in steps.values())


def test_a_step_not_a_dict_by_agent_is_refused(server):
    world = dmr.MultiAgentWorld.connect(server.address, 2, create_world_settings=_settings())
    with world, pytest.raises(dmr.ArgumentTypeError, match="dict {agent name: action}"):
        world.step([{"paddle": 1}, {"paddle": 0}])


def test_an_open_that_fails_part_way_leaves_and_destroys_what_it_made(server):
    joins = [{"agent": 0}, {"agent": 5}]  # the second is out of range
    with pytest.raises(dmr.WorldError, match="agent 5 is out of range") as caught:
        dmr.MultiAgentWorld.connect(
            server.address, 2, create_world_settings=_settings(), join_world_settings=joins
        )
    assert caught.value.index == 0
    assert wait_for(lambda: _nothing_left(server))


def test_two_agents_picking_the_same_agent_are_refused_before_connecting(server):
    with pytest.raises(dmr.ArgumentValueError, match="both named 'agent_1'"):
        dmr.MultiAgentWorld.connect(
            server.address, 2, join_world_settings=[{"agent": 1}, {"agent": "agent_1"}]
        )
    with pytest.raises(dmr.ArgumentValueError, match="3 settings for 2 agents"):
        dmr.MultiAgentWorld.connect(server.address, 2, join_world_settings=[{}, {}, {}])


def test_close_leaves_every_agent_and_destroys_the_world_and_is_idempotent(server):
    world = dmr.MultiAgentWorld.connect(server.address, 2, create_world_settings=_settings())
    world.reset()
    assert len(server.servicer.worlds) == 1
    world.close()
    world.close()
    assert wait_for(lambda: _nothing_left(server))


# --- many worlds -----------------------------------------------------------------------------


def test_a_batch_of_worlds_steps_by_agent_and_as_a_flat_batch_of_agent_slots(server):
    with dmr.MultiAgentBatch.connect(
        server.address, 3, 2, create_world_settings={"num_agents": 2}, seed=10
    ) as batch:
        assert batch.num_worlds == 3 and len(batch) == 6 and batch.agents == ["agent_0", "agent_1"]
        assert batch.world_seeds == [10, 10, 11, 11, 12, 12]
        first = batch.reset_agents()
        assert first["agent_1"].env_ids.tolist() == [0, 1, 2]
        assert first["agent_0"].first().all()
        actions = {agent: {"paddle": np.ones(3, np.int8)} for agent in batch.agents}
        steps = batch.step_agents(actions)
        assert steps["agent_0"].observation["board"].shape == (3, 10, 8)
        assert (steps["agent_0"].step_type == dm_env.StepType.MID).all()
        # The flat face: slot w * 2 + a is agent a of world w, all sent at once (collect's shape).
        flat = batch.step({"paddle": np.zeros(6, np.int8)})
        assert flat.env_ids.tolist() == list(range(6))
        # Pipelined: two steps in flight for every agent, received in order.
        batch.send_agents(actions)
        batch.send_agents(actions)
        assert batch.pending() == 12
        batch.recv_agents()
        last = batch.recv_agents()
        assert (last["agent_1"].step_type == dm_env.StepType.MID).all()
    assert wait_for(lambda: _nothing_left(server))


def test_a_batch_over_several_servers_puts_each_worlds_agents_together():
    with (
        foreign_server() as one,
        foreign_server() as two,
        dmr.MultiAgentBatch.connect(
            [one.address, two.address], 4, 2, create_world_settings={"num_agents": 2}
        ) as batch,
    ):
        assert len(one.servicer.worlds) == 2 and len(two.servicer.worlds) == 2
        assert (
            batch.addresses
            == [one.address] * 2 + [two.address] * 2 + [one.address] * 2 + [two.address] * 2
        )
        steps = batch.step_agents({a: [{}] * 4 for a in batch.agents})
        assert steps["agent_0"].env_ids.tolist() == [0, 1, 2, 3]


def test_dmr_collect_drives_a_multi_agent_batch_without_deadlock(server):
    """``dmr.collect`` steps the batch's agent slots as it steps any batch; with random actions
    each slot takes its share, so every lockstep round completes (8 in flight per agent)."""
    with dmr.MultiAgentBatch.connect(
        server.address, 2, 3, create_world_settings={"num_agents": 3}, seed=1
    ) as batch:
        stats = dmr.collect(batch, steps=6 * 30, seed=1)
        assert stats.steps == 180
        assert stats.episodes >= 6 * 2  # every agent of both worlds ends an episode every 9 steps
