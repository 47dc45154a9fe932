"""The SDK against a dm_env_rpc server on another gRPC stack: Node.js @grpc/grpc-js (issue 37).

The server (tests/node_server/server.js, started by ``node_peer.node_server``) shares no HTTP/2
or protobuf code with grpcio, keeps worlds until they are destroyed, and can advertise an
HTTP/2 stream limit. The core paths run against it: lockstep, pipelined, batched, ``check``,
``run --address`` and the Gymnasium bridge. Skipped, with the reason, without ``node`` or
without ``npm ci`` in tests/node_server (.ci/run does it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import dm_env
import numpy as np
import pytest
from conftest import process_gone, run_child, wait_for
from node_peer import NODE_SKIP_REASON, node_server
from raw_stream import RawStream

import dm_env_rpc_client as dmr
from dm_env_rpc_client._proto import dm_env_rpc_pb2

pytestmark = pytest.mark.skipif(NODE_SKIP_REASON is not None, reason=str(NODE_SKIP_REASON))


@pytest.fixture(scope="module")
def node() -> Any:
    """One Node server for the module's tests that need no special options."""
    with node_server() as server:
        yield server


def _episode(env: dmr.DmEnvAdaptor, move: int) -> list[Any]:
    timestep = env.reset()
    steps = [timestep]
    while not timestep.last():
        timestep = env.step({"paddle": np.int8(move)})
        steps.append(timestep)
    return steps


def test_lockstep_episodes_are_right_and_seeded(node) -> None:
    with dmr.connect(node.address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, {"seed": 5, "rows": 6}, {})
        assert env.observation_spec()["board"].shape == (6, 5)
        assert env.action_spec()["paddle"].dtype == np.int8
        first = _episode(env, 1)
        assert [t.step_type for t in first] == [dm_env.StepType.FIRST] + [
            dm_env.StepType.MID
        ] * 4 + [dm_env.StepType.LAST]
        assert first[-1].reward in (-1.0, 1.0) and first[-1].discount == 0.0
        assert first[0].observation["board"].sum() == 2.0  # the ball and the paddle
        env.close()
    with dmr.connect(node.address, timeout=10) as conn:  # the same seed, the same episode
        again, _ = dmr.create_and_join_world(conn, {"seed": 5, "rows": 6}, {})
        boards = [t.observation["board"] for t in _episode(again, 1)]
        assert all(
            np.array_equal(a, t.observation["board"]) for a, t in zip(boards, first, strict=True)
        )
        again.close()


def test_pipelined_send_async_and_step_iter_keep_request_order(node) -> None:
    with dmr.connect(node.address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, {"seed": 1, "rows": 4}, {})
        futures = [env.step_async({"paddle": np.int8(0)}) for _ in range(60)]
        types = [future.result(timeout=10).step_type for future in futures]
        # Episodes of rows - 1 = 3 moves: FIRST, MID, MID, LAST, again and again.
        step_type = dm_env.StepType
        cycle = [step_type.FIRST, step_type.MID, step_type.MID, step_type.LAST]
        assert types == cycle * 15
        steps = list(env.step_iter([{"paddle": np.int8(1)}] * 40, in_flight=16))
        assert [t.step_type for t in steps] == cycle * 10
        env.close()
    with dmr.connect(node.address, timeout=10) as conn:  # raw requests, 16 in flight
        env, _ = dmr.create_and_join_world(conn, {"seed": 1, "rows": 4}, {})
        request = dm_env_rpc_pb2.StepRequest(requested_observations=[1])
        responses = [r.result(timeout=10) for r in [conn.send_async(request) for _ in range(16)]]
        ball_rows = [
            int(np.argmax(np.reshape(r.observations[1].floats.array, (4, 5)).any(1)))
            for r in responses
        ]
        assert ball_rows == [0, 1, 2, 3] * 4  # the ball's row: each answer is its own request's
        terminated = dm_env_rpc_pb2.TERMINATED
        assert [r.state == terminated for r in responses] == [False, False, False, True] * 4
        env.close()


def test_a_batch_of_many_worlds_steps(node) -> None:
    with dmr.BatchedEnvironment.connect(node.address, 256, seed=0, timeout=60) as envs:
        first = envs.reset()
        assert first.first().all() and first.observation["board"].shape == (256, 10, 5)
        total = 0
        for _ in range(4):
            step = envs.step({"paddle": np.zeros(256, np.int8)})
            total += len(step.env_ids)
        assert total == 256 * 4
        assert envs.world_seeds == list(range(256))


def test_map_uint64_keys_beyond_32_bits_come_back_as_numbers(node) -> None:
    """protobufjs decodes map<uint64, ...> keys as 8-byte hash strings: the server turns them
    back into the numbers the client sent."""
    stream = RawStream(node.address)
    try:
        stream.join(stream.create(seed=0))
        stream.step()  # the first step ignores its actions
        big = 2**40 + 5
        error = stream.error(
            step=dm_env_rpc_pb2.StepRequest(actions={big: dmr.pack_tensor(np.int8(0))})
        )
        assert error.code == 3 and str(big) in error.message
        moved = stream.step({1: dmr.pack_tensor(np.int8(1))}, observations=[1, 2, 3])
        assert sorted(moved.observations) == [1, 2, 3]
    finally:
        stream.close()


def test_errors_are_statuses_and_the_stream_goes_on(node) -> None:
    with dmr.connect(node.address, timeout=10) as conn:
        with pytest.raises(dmr.NotFoundError, match="no world named 'nowhere'"):
            dmr.join_world(conn, "nowhere")
        with pytest.raises(dmr.InvalidArgumentError, match="unknown settings"):
            dmr.create_world(conn, {"bogus": 1})
        env, _ = dmr.create_and_join_world(conn, {}, {})
        env.reset()
        with pytest.raises(dmr.InvalidArgumentError, match="paddle"):
            conn.send(dm_env_rpc_pb2.StepRequest(actions={1: dmr.pack_tensor(np.float64(1.0))}))
        assert env.step({"paddle": np.int8(0)}).mid()  # the stream still answers
        env.close()


def test_worlds_are_kept_until_destroyed() -> None:
    with node_server(max_worlds=2) as server:
        with dmr.connect(server.address, timeout=10) as conn:
            names = [dmr.create_world(conn, {"seed": i}) for i in range(2)]
        # The stream that made them ended; they are still there, and there is no room.
        with dmr.connect(server.address, timeout=10) as conn:
            with pytest.raises(dmr.DmEnvRpcError, match="at most 2 worlds") as info:
                dmr.create_world(conn, {})
            assert info.value.code == 8  # RESOURCE_EXHAUSTED
            env = dmr.join_world(conn, names[0])
            assert env.reset().first()
            env.close()
            for name in names:
                dmr.destroy_world(conn, name)
            dmr.destroy_world(conn, dmr.create_world(conn, {}))  # room again


def test_separate_connections_are_not_held_by_the_stream_limit() -> None:
    """A stream limit is per HTTP/2 connection: worlds on connections of their own all open."""
    with node_server(max_concurrent_streams=2) as server:
        conns = [dmr.connect(server.address, timeout=10) for _ in range(5)]
        try:
            envs = [
                dmr.create_and_join_world(conn, {"seed": i}, {}, timeout=10)[0]
                for i, conn in enumerate(conns)
            ]
            assert all(env.reset().first() for env in envs)
            for env in envs:
                env.close()
        finally:
            for conn in conns:
                conn.close()


def test_a_batch_opens_more_worlds_than_the_stream_limit() -> None:
    with (
        node_server(max_concurrent_streams=100) as server,
        dmr.BatchedEnvironment.connect(server.address, 150, timeout=3) as envs,
    ):
        assert envs.reset().first().all()
        assert len(envs.step({"paddle": np.zeros(150, np.int8)}).env_ids) == 150


def test_a_failed_batch_connect_leaves_no_world_behind() -> None:
    with node_server(max_worlds=4) as server:
        with pytest.raises(dmr.WorldError):  # the join refuses its setting, after each create
            dmr.BatchedEnvironment.connect(server.address, 4, join_world_settings={"bogus": 1})
        with dmr.BatchedEnvironment.connect(server.address, 4, timeout=5) as envs:
            assert envs.reset().first().all()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_child([sys.executable, "-m", "dm_env_rpc_client", *args], timeout=90)


def test_check_passes_every_rule(node) -> None:
    result = _cli("check", node.address, "--json", "--latency-steps", "20")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["conforms"] is True
    # One agent per world (a second JoinWorld is refused): the multi-agent group is skipped.
    statuses = {f["rule"]: f["status"] for f in report["findings"]}
    group = {rule: statuses.pop(rule) for rule in list(statuses) if rule.startswith("multi-agent.")}
    assert set(statuses.values()) == {"pass"}
    assert set(group.values()) == {"skip"} and len(group) == 4


def test_run_against_the_address(node) -> None:
    result = _cli("run", "--address", node.address, "--num-envs", "8", "--steps", "400", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["steps"] == 400 and summary["episodes"] > 0


def test_the_gymnasium_bridge(node) -> None:
    pytest.importorskip("gymnasium", reason="needs the gymnasium extra")
    from gymnasium.utils.env_checker import check_env

    from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv

    env = GymnasiumEnv(address=node.address, create_world_settings={"rows": 5})
    try:
        check_env(env, skip_render_check=True)
        observation, _ = env.reset(seed=1)
        assert observation["board"].shape == (5, 5)
        done, steps = False, 0
        while not done:
            observation, reward, terminated, truncated, _ = env.step({"paddle": np.int8(0)})
            done, steps = terminated or truncated, steps + 1
        assert terminated and reward in (-1.0, 1.0) and steps == 4
    finally:
        env.close()
    from dm_env_rpc_client.integrations.gymnasium import GymnasiumVectorEnv

    envs = GymnasiumVectorEnv(
        addresses=[node.address], num_envs=4, create_world_settings={"rows": 3}
    )
    try:
        observations, _ = envs.reset(seed=0)
        assert observations["board"].shape == (4, 3, 5)
        ended = np.zeros(4, bool)
        for _ in range(2):  # 3 rows: every episode ends at the second step
            _, rewards, terminated, truncated, _ = envs.step({"paddle": np.zeros(4, np.int8)})
            ended |= terminated
        assert ended.all() and not truncated.any() and set(rewards.tolist()) <= {-1.0, 1.0}
    finally:
        envs.close()


_ORPHAN = """
import sys
sys.path.insert(0, sys.argv[1])
from node_peer import node_server
with node_server() as server:
    print(server.process.pid, flush=True)
    sys.stdin.read()  # until killed
"""


def test_the_server_dies_with_a_sigkilled_parent() -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, tests],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not process_gone(pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_for(lambda: process_gone(pid), timeout=10)
    finally:
        if parent.poll() is None:
            parent.kill()
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.close()
        parent.stdout.close()
