"""An address's worlds spread over as many HTTP/2 connections as its stream limit needs.

The server here advertises at most 100 concurrent streams per connection
(``grpc.max_concurrent_streams``), as Google front ends do; gRPC queues a stream
beyond that until another ends.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from keeping_server import keeping_server

from dm_env_rpc_client import errors
from dm_env_rpc_client._batch.channels import ChannelPool
from dm_env_rpc_client.batched import DEFAULT_STREAMS_PER_CONNECTION, BatchedEnvironment
from dm_env_rpc_client.server.catch import Catch

LIMIT = [("grpc.max_concurrent_streams", 100)]


def make_catch(settings: dict[str, Any]) -> Catch:
    return Catch(**settings)


def test_the_default_fits_the_lowest_common_limit() -> None:
    assert DEFAULT_STREAMS_PER_CONNECTION == 100


def test_1024_worlds_open_on_a_server_of_100_streams_per_connection() -> None:
    with keeping_server(make_catch, options=LIMIT) as kept:
        with BatchedEnvironment.connect(kept.address, 1024, timeout=20, seed=0) as batch:
            assert len(batch) == 1024 and kept.worlds == 1024
            assert len(batch._channels) == 11  # ceil(1024 / 100) connections
            first = batch.reset()
            step = batch.step(batch.random_actions())
            assert len(first.step_type) == len(step.step_type) == 1024
        assert kept.worlds == 0


def test_run_with_101_worlds_against_a_server_of_100_streams_per_connection() -> None:
    with keeping_server(make_catch, options=LIMIT) as kept:
        command = [sys.executable, "-m", "dm_env_rpc_client", "run", "--address", kept.address]
        command += ["--num-envs", "101", "--steps", "404", "--json", "--timeout", "20"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["steps"] >= 404
        assert kept.worlds == 0


def test_a_stream_limit_is_named_with_what_to_pass() -> None:
    with keeping_server(make_catch, options=LIMIT) as kept:
        with pytest.raises(errors.WorldError) as raised:
            BatchedEnvironment.connect(kept.address, 101, timeout=3, max_streams_per_connection=101)
        text = str(raised.value)
        assert "100 other streams on the same HTTP/2 connection" in text, text
        assert "max_streams_per_connection=100" in text, text
        assert "start it with room for 101 streams" not in text
        assert kept.worlds == 0


@pytest.mark.parametrize("value", [0, 1.5, "100"])
def test_a_bad_cap_is_refused_by_name(value: Any) -> None:
    with pytest.raises(errors.ArgumentError, match="max_streams_per_connection"):
        BatchedEnvironment.connect("127.0.0.1:1", 1, max_streams_per_connection=value)


def test_the_pool_fills_its_newest_channel_then_reuses_the_room_streams_left() -> None:
    # ChannelPool alone (no stream opens: its channels are only handed out).
    made: list[str] = []

    def make(address: str, extra: Any) -> Any:
        made.append(address)
        return object()

    pool = ChannelPool(make, 2, {})
    slots = [pool.acquire("a:1")[1] for _ in range(5)]
    assert [slot.key for slot in slots] == ["a:1", "a:1", "a:1#1", "a:1#1", "a:1#2"]
    slots[0].released = True  # a stream of the first channel ended
    assert pool.acquire("a:1")[1].key == "a:1#2"  # the newest has room: no scan
    assert pool.acquire("a:1")[1].key == "a:1"  # the newest is full: the first has room
    assert pool.acquire("a:1")[1].key == "a:1#3"  # every one full: another channel
    assert pool.acquire("b:2")[1].key == "b:2"
    assert len(made) == 5
