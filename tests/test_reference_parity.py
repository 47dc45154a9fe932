"""The same scripted episodes through this SDK and the reference DmEnvAdaptor (test-only peer)."""

from __future__ import annotations

from typing import Any

import dm_env
import grpc
import numpy as np
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

from dm_env_rpc_client.connection import connect
from dm_env_rpc_client.environment import create_and_join_world
from dm_env_rpc_client.server import Server

# The script: actions, with "reset" for a reset in the middle of an episode.
SCRIPT: list[Any] = [1, 0, -1, 1, "reset", 0, 0, 1, -1, 0, 1, 1, 0, "reset", -1, 0, 0, 0, 1]
SETTINGS = {"rows": 5, "columns": 4, "seed": 11, "max_steps": 3}  # truncation after 3 steps


def _run(env: Any) -> list[dm_env.TimeStep]:
    steps = [env.reset()]
    for action in SCRIPT:
        if action == "reset":
            steps.append(env.reset())
        else:
            steps.append(env.step({"paddle": np.int8(action)}))
    env.close()
    return steps


def test_identical_timesteps_to_the_reference_adaptor(catch_server: Server) -> None:
    with connect(catch_server.address, timeout=10) as conn:
        ours = _run(create_and_join_world(conn, SETTINGS, {}).env)
    channel = grpc.insecure_channel(catch_server.address)
    with reference_connection.Connection(channel) as ref_conn:
        theirs = _run(reference_adaptor.create_and_join_world(ref_conn, SETTINGS, {})[0])
    channel.close()

    kinds = {step.step_type for step in ours}
    assert kinds == {dm_env.StepType.FIRST, dm_env.StepType.MID, dm_env.StepType.LAST}
    assert any(
        s.step_type == dm_env.StepType.LAST and s.discount == 1.0 for s in ours
    )  # truncation
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.step_type == b.step_type, index
        assert a.reward == b.reward, index
        if a.step_type == dm_env.StepType.FIRST:
            # A documented difference: dm_env says FIRST has no discount; the reference
            # passes the server's discount observation through.
            assert a.discount is None and b.discount == 1.0
        else:
            assert a.discount == b.discount, index
        assert a.observation.keys() == b.observation.keys()
        assert np.array_equal(a.observation["board"], b.observation["board"]), index
        assert a.observation["board"].dtype == b.observation["board"].dtype
