"""BatchedEnvironment over several real servers, including one killed mid-run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dm_env_rpc_client import errors
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.server import Server


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
    with pytest.raises(errors.WorldError, match="World 0 at 127.0.0.1:1 failed"):
        BatchedEnvironment.connect(["127.0.0.1:1"], 1, timeout=0.5)
    with pytest.raises(ValueError, match="at least one"):
        BatchedEnvironment([])
