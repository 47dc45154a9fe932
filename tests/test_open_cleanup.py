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

from dm_env_rpc_client import errors
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.server.catch import Catch


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
    with keeping_server(make_catch, max_worlds=4) as kept:
        with pytest.raises(errors.WorldError):
            if bridge == "gymnasium_vector":
                from dm_env_rpc_client.integrations.gymnasium import GymnasiumVectorEnv

                GymnasiumVectorEnv(addresses=kept.address, num_envs=5, timeout=10)
            elif bridge == "sb3":
                from dm_env_rpc_client.integrations.sb3 import BatchedVecEnv

                BatchedVecEnv(addresses=kept.address, num_envs=5, timeout=10)
            else:
                from dm_env_rpc_client.integrations._ray_shards import _Shard

                _Shard(0, list(range(5)), [kept.address] * 5, None, {"timeout": 10})
        assert kept.worlds == 0


def test_the_gymnasium_env_leaves_no_world_when_its_join_fails() -> None:
    from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv

    with keeping_server(make_catch, max_worlds=4) as kept:
        kept.refuse_joins = True
        with pytest.raises(errors.DmEnvRpcError):
            GymnasiumEnv(address=kept.address, timeout=10)
        assert kept.worlds == 0
