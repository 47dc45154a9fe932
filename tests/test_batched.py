"""BatchedEnvironment over several real servers, including one killed mid-run."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import sigstop, wait_for

from dm_env_rpc_client import errors
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.connection import connect
from dm_env_rpc_client.environment import create_and_join_world
from dm_env_rpc_client.random_actions import random_action
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch


def test_step_stacks_along_the_batch_axis(catch_server: Server) -> None:
    with BatchedEnvironment.connect(
        [catch_server.address], 3, create_world_settings={"rows": 3, "columns": 4}
    ) as batch:
        first = batch.reset()
        assert first.step_type.tolist() == [0, 0, 0] and np.isnan(first.reward).all()
        assert first.observation["board"].shape == (3, 3, 4)
        mid = batch.step({"paddle": np.array([-1, 0, 1], np.int8)})
        assert mid.step_type.tolist() == [1, 1, 1] and mid.discount.tolist() == [1.0] * 3
        last = batch.step({"paddle": np.zeros(3, np.int8)})
        assert last.last().all() and set(last.reward.tolist()) <= {-1.0, 1.0}
        again = batch.step({"paddle": np.zeros(3, np.int8)})  # the next sequence, automatically
        assert again.first().all()
        assert again.at(1).reward is None and again.at(1).observation["board"].shape == (3, 4)
        with pytest.raises(errors.SpecValidationError, match="batch size 2 but 3 worlds"):
            batch.step({"paddle": np.zeros(2, np.int8)})


def test_send_recv_collects_whichever_finish_first(catch_server: Server) -> None:
    with BatchedEnvironment.connect([catch_server.address], 4) as batch:
        batch.send({"paddle": np.zeros(4, np.int8)}, [0, 1, 2, 3])
        batch.send({"paddle": np.zeros(2, np.int8)}, [1, 3])  # two in flight for worlds 1 and 3
        assert batch.pending() == 6
        seen = []
        while batch.pending():
            result = batch.recv(1, timeout=10)
            seen.extend(result.env_ids.tolist())
        assert sorted(seen) == [0, 1, 1, 2, 3, 3]
        with pytest.raises(ValueError, match="in flight"):
            batch.recv(1)
        assert len(batch.latencies) == 6


def test_a_killed_server_is_named_by_index_and_address(server_process) -> None:
    servers = [server_process() for _ in range(2)]
    addresses = [server.address for server in servers]
    with BatchedEnvironment.connect(addresses, 4, timeout=20) as batch:
        batch.reset()
        for _ in range(5):
            batch.step({"paddle": np.zeros(4, np.int8)})
        servers[1].kill()  # worlds 1 and 3 live there
        started = time.monotonic()
        with pytest.raises(errors.WorldError) as info:
            for _ in range(100):
                batch.step({"paddle": np.zeros(4, np.int8)}, timeout=10)
        assert time.monotonic() - started < 10
        error = info.value
        assert error.index in (1, 3) and error.address == addresses[1]
        assert f"World {error.index} at {addresses[1]} failed" in str(error)
        assert isinstance(error.__cause__, errors.ConnectionClosedError)


def test_connect_failure_names_the_world() -> None:
    with pytest.raises(errors.WorldError, match="World 0 at 127.0.0.1:1 failed") as info:
        BatchedEnvironment.connect(["127.0.0.1:1"], 1, timeout=0.5, wait_for_ready=True)
    assert isinstance(info.value.__cause__, errors.ConnectTimeoutError)
    with pytest.raises(errors.WorldError, match="connection refused") as info:
        BatchedEnvironment.connect(["127.0.0.1:1"], 1, timeout=60)  # at once, not in 60 s
    assert isinstance(info.value.__cause__, errors.ConnectRefusedError)
    assert not _loop_threads()  # the loop of the failed batch is gone
    with pytest.raises(ValueError, match="at least one"):
        BatchedEnvironment([])


class _Gate(Catch):
    """Catch whose steps wait until the test opens the gate (a world that is slow on demand)."""

    gate = threading.Event()

    def step(self, action: Any) -> Any:
        if not self.gate.wait(timeout=30):
            raise RuntimeError("the test never opened the gate")
        return super().step(action)


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dm_env_rpc_client-batched"]


def test_worlds_share_one_loop_thread_and_close_leaves_none() -> None:
    before = len(_loop_threads())
    with serve(lambda settings: Catch(**settings)) as server:
        batch = BatchedEnvironment.connect([server.address], 8)
        assert len(_loop_threads()) == before + 1  # eight streams, one thread
        batch.reset()
        for _ in range(20):
            result = batch.step({"paddle": np.ones(8, np.int8)})
        assert result.observation["board"].shape[0] == 8
        batch.close()
        batch.close()  # idempotent
        assert wait_for(lambda: len(_loop_threads()) == before, timeout=5)


def test_recv_waits_for_the_slowest_only_when_asked(catch_server: Server) -> None:
    _Gate.gate.clear()
    with (
        serve(lambda settings: _Gate(**settings)) as slow,
        BatchedEnvironment.connect([catch_server.address, slow.address], 2) as batch,
    ):
        _Gate.gate.set()
        batch.reset()
        _Gate.gate.clear()
        batch.send({"paddle": np.zeros(2, np.int8)}, [0, 1])
        fast = batch.recv(1, timeout=10)  # world 0 answers; world 1 waits at the gate
        assert fast.env_ids.tolist() == [0]
        with pytest.raises(errors.RequestTimeoutError, match="Fewer than 1 steps finished"):
            batch.recv(1, timeout=0.2)
        batch.send({"paddle": np.zeros(1, np.int8)}, [0])
        with pytest.raises(
            errors.WorldTimeoutError, match="World 1 at .* no response within 0.2 s"
        ):
            batch.recv(timeout=0.2, env_ids=[1])
        with pytest.raises(ValueError, match="World 0 has 1 steps in flight; cannot receive 2"):
            batch.recv(env_ids=[0, 0])
        _Gate.gate.set()
        # World 1 failed on its timeout: its late answer is dropped, never handed to a later step.
        late = batch.recv(1, timeout=10)
        assert late.env_ids.tolist() == [0] and batch.pending() == 0
        with pytest.raises(errors.WorldError, match="World 1 .* failed before"):
            batch.send({"paddle": np.zeros(1, np.int8)}, [1])


def test_wraps_adaptors_made_by_hand(catch_server: Server) -> None:
    with (
        connect(catch_server.address, timeout=10) as one,
        connect(catch_server.address, timeout=10) as two,
    ):
        envs = [create_and_join_world(conn, {"seed": 5}, {}).env for conn in (one, two)]
        batch = BatchedEnvironment(envs)
        assert batch.addresses == [catch_server.address] * 2
        first = batch.reset(timeout=10)
        assert first.first().all()
        steps = [batch.step({"paddle": np.zeros(2, np.int8)}, timeout=10) for _ in range(3)]
        # Same seed, same actions: the two worlds agree step for step.
        for step in steps:
            board = step.observation["board"]
            np.testing.assert_array_equal(board[0], board[1])
        batch.close()


def test_close_is_bounded_when_a_server_hangs(server_process) -> None:
    server = server_process()
    batch = BatchedEnvironment.connect([server.address], 2, timeout=20)
    batch.reset()
    sigstop(server.process)
    try:
        batch.send({"paddle": np.zeros(2, np.int8)}, [0, 1])
        started = time.monotonic()
        batch.close(timeout=1)
        assert time.monotonic() - started < 8
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (where, a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype == object:
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y, where)
    else:
        np.testing.assert_array_equal(a, b, err_msg=where)


@pytest.mark.parametrize("env_name", ["catch", "nested"])
def test_batch_decoding_equals_one_timestep_per_world(env_name: str) -> None:
    from test_environment import Nested

    make = {"catch": lambda s: Catch(**s), "nested": lambda s: Nested(**s)}[env_name]
    settings = {"rows": 4, "seed": 7} if env_name == "catch" else {"length": 4}
    rng = np.random.default_rng(0)
    with (
        serve(make) as server,
        BatchedEnvironment.connect([server.address], 3, create_world_settings=settings) as fast,
        connect(server.address, timeout=10) as c0,
        connect(server.address, timeout=10) as c1,
        connect(server.address, timeout=10) as c2,
    ):
        slow = BatchedEnvironment(
            [create_and_join_world(c, settings, {}, timeout=10).env for c in (c0, c1, c2)]
        )
        assert fast._decoder is not None and slow._decoder is None
        spec = fast.action_spec()
        _assert_same(fast.reset()._asdict(), slow.reset()._asdict(), "reset")
        # Put world 0 one step ahead, so the worlds are at different points of their episodes.
        ahead = _stacked([random_action(spec, 1)])
        fast.send(ahead, [0])
        slow.send(ahead, [0])
        _assert_same(
            fast.recv(env_ids=[0], timeout=10)._asdict(),
            slow.recv(env_ids=[0], timeout=10)._asdict(),
            "ahead",
        )
        for step in range(12):
            actions = _stacked([random_action(spec, rng) for _ in range(3)])
            got, want = fast.step(actions, timeout=10), slow.step(actions, timeout=10)
            _assert_same(got._asdict(), want._asdict(), f"step {step}")
        slow.close()


def _stacked(actions: list[Any]) -> Any:
    first = actions[0]
    if isinstance(first, dict):
        return {key: _stacked([a[key] for a in actions]) for key in first}
    return np.stack([np.asarray(a) for a in actions])
