"""Opening worlds that fails part-way leaves and destroys what it made, before raising.

Against ``keeping_server``: a server that keeps worlds until DestroyWorld (as the
protocol allows) and holds at most a few, so a world left behind shows, and
fills it up for every later connect.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from conftest import wait_for
from keeping_server import keeping_server

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.server.catch import Catch
from dm_env_rpc_client.server.paddles import Paddles


def make_catch(settings: dict[str, Any]) -> Catch:
    return Catch(**settings)


def test_a_refused_connect_leaves_no_world_and_a_later_connect_works() -> None:
    with keeping_server(make_catch, max_worlds=8) as kept:
        with pytest.raises(errors.WorldError) as raised:
            BatchedEnvironment.connect(kept.address, 9, timeout=10)
        assert "is full" in str(raised.value) and "RESOURCE_EXHAUSTED" in str(raised.value)
        assert kept.worlds == 0
        with BatchedEnvironment.connect(kept.address, 8, timeout=10) as batch:
            assert len(batch) == 8 and kept.worlds == 8
            batch.reset()
        assert kept.worlds == 0


def test_an_unknown_requested_observation_leaves_no_world() -> None:
    with keeping_server(make_catch, max_worlds=8) as kept:
        with pytest.raises(errors.UnknownNameError):
            BatchedEnvironment.connect(
                kept.address, 4, timeout=10, requested_observations=["no_such_observation"]
            )
        assert kept.worlds == 0


def test_a_refused_join_leaves_no_world() -> None:
    with keeping_server(make_catch, max_worlds=8) as kept:
        kept.refuse_joins = True
        with pytest.raises(errors.WorldError):
            BatchedEnvironment.connect(kept.address, 3, timeout=10)
        assert kept.worlds == 0


def test_a_failed_restart_attempt_destroys_the_world_it_made() -> None:
    from dm_env_rpc_client import RestartPolicy

    policy = RestartPolicy(attempts=3, total=20.0, backoff=0.01, max_backoff=0.01)
    with (
        keeping_server(make_catch, max_worlds=20) as kept,
        BatchedEnvironment.connect(
            kept.address, 2, timeout=10, on_world_failure="restart", restart=policy
        ) as batch,
    ):
        batch.reset()
        kept.refuse_joins = kept.abort_steps = True
        with contextlib.suppress(errors.DmEnvRpcClientError):
            batch.step(batch.random_actions(), timeout=10)
        removed = lambda: sum(f.outcome == "removed" for f in batch.failures) == 2  # noqa: E731
        assert wait_for(removed, timeout=30), batch.failures
        # The two broken streams' worlds stay (the server keeps them); none of the six
        # attempts' worlds does.
        assert kept.worlds == 2, kept.worlds


@pytest.mark.parametrize("bridge", ["gymnasium_vector", "sb3", "ray_shard"])
def test_bridges_leave_no_world_when_opening_fails(bridge: str) -> None:
    if bridge == "sb3":
        pytest.importorskip(
            "stable_baselines3", reason="the sb3 extra (with torch) is not installed"
        )
    with keeping_server(make_catch, max_worlds=4) as kept:
        with pytest.raises(errors.WorldError):
            if bridge == "gymnasium_vector":
                from dm_env_rpc_client.integrations.gymnasium import GymnasiumVectorEnv

                GymnasiumVectorEnv(addresses=kept.address, num_envs=5, timeout=10)
            elif bridge == "sb3":
                from dm_env_rpc_client.integrations.sb3 import BatchedVecEnv

                BatchedVecEnv(addresses=kept.address, num_envs=5, timeout=10)
            else:
                from dm_env_rpc_client.integrations.ray._shards import _Shard

                _Shard(0, list(range(5)), [kept.address] * 5, None, {"timeout": 10})
        assert kept.worlds == 0


def test_the_gymnasium_env_leaves_no_world_when_its_join_fails() -> None:
    from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv

    with keeping_server(make_catch, max_worlds=4) as kept:
        kept.refuse_joins = True
        with pytest.raises(errors.DmEnvRpcError):
            GymnasiumEnv(address=kept.address, timeout=10)
        assert kept.worlds == 0


# --- multi-agent worlds: one world, N agents over N streams -------------------------------------


def make_paddles(settings: dict[str, Any]) -> Paddles:
    return Paddles(**settings)


PADDLES = {"num_agents": 2, "seed": 1}


def test_a_multi_agent_world_whose_last_join_is_refused_is_left_and_destroyed() -> None:
    """The server refuses the second agent (no agent 7 in a world of two): the first agent
    leaves and the world is destroyed before connect raises; with room for one world, the
    next connect works, so nothing was left behind."""
    with keeping_server(make_paddles, max_worlds=1) as kept:
        with pytest.raises(errors.WorldError, match="7"):
            dmr.MultiAgentWorld.connect(
                kept.address,
                2,
                create_world_settings=PADDLES,
                join_world_settings=[{"agent": 0}, {"agent": 7}],
                timeout=10,
            )
        assert kept.worlds == 0
        with dmr.MultiAgentWorld.connect(kept.address, 2, create_world_settings=PADDLES) as world:
            assert set(world.reset()) == {"agent_0", "agent_1"} and kept.worlds == 1
        assert kept.worlds == 0


def test_a_multi_agent_batch_whose_last_join_is_refused_leaves_and_destroys_every_world() -> None:
    """Three worlds of two agents: the server takes five joins and refuses the sixth; every
    joined agent leaves and all three worlds are destroyed before connect raises."""
    with keeping_server(make_paddles, max_worlds=3) as kept:
        kept.joins_allowed = 5
        with pytest.raises(errors.WorldError, match="no joins"):
            dmr.MultiAgentBatch.connect(kept.address, 3, 2, create_world_settings=PADDLES)
        assert kept.joins == 6 and kept.worlds == 0
        kept.joins_allowed = None
        with dmr.MultiAgentBatch.connect(
            kept.address, 3, 2, create_world_settings=PADDLES
        ) as batch:
            batch.reset_agents()
            assert kept.worlds == 3
        assert kept.worlds == 0
