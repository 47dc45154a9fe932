"""Work per step that does not grow with the batch: ``recv`` and the CLI's run loop.

``recv`` takes only from the worlds that had steps filed (not a look at every
world), and returns them as before: by world index, each world's oldest step
first, whichever order they were sent or finished in. The CLI's loop
(``dmr.collect``) sends to the worlds that steps came back from, and looks at
every world only when one failed; it still gives each world its exact share of
the steps, and goes on without a removed world.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
from faulty import refusing_servers

import dm_env_rpc_client as dmr
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.server import Server


def _drain(batch: BatchedEnvironment) -> list[int]:
    seen: list[int] = []
    while batch.pending():
        seen += batch.recv(batch.pending(), timeout=10).env_ids.tolist()
    return seen


def test_recv_returns_worlds_in_index_order_oldest_first(catch_server: Server) -> None:
    with BatchedEnvironment.connect([catch_server.address], 6) as batch:
        batch.reset()
        batch.send({"paddle": np.zeros(3, np.int8)}, [5, 2, 4])
        batch.send({"paddle": np.zeros(2, np.int8)}, [4, 0])
        result = batch.recv(5, timeout=10)
        assert result.env_ids.tolist() == [0, 2, 4, 4, 5]
        assert result.step_type.tolist() == [1] * 5  # each world's first step after reset
        # A world drained by recv(env_ids=...) in between is not taken twice, and one
        # partly drained keeps its later step for the next recv.
        batch.send({"paddle": np.zeros(4, np.int8)}, [3, 1, 3, 1])
        batch.send({"paddle": np.zeros(1, np.int8)}, [2])
        assert batch.recv(env_ids=[1, 3], timeout=10).env_ids.tolist() == [1, 3]
        assert sorted(_drain(batch)) == [1, 2, 3]
        assert batch.pending() == 0 and len(batch.latencies) == 5 + 2 + 3


class _Counting(BatchedEnvironment):
    """Counts the looks at every world (``live_ids``) and at one world (``in_flight``)."""

    looks = 0
    world_looks = 0

    @property
    def live_ids(self) -> list[int]:
        type(self).looks += 1
        return super().live_ids

    def in_flight(self, index: int) -> int:
        type(self).world_looks += 1
        return super().in_flight(index)


def test_the_run_loop_looks_at_every_world_only_at_the_start(catch_server: Server) -> None:
    worlds, steps = 16, 16 * 40 + 5
    _Counting.looks = _Counting.world_looks = 0
    with _Counting.connect([catch_server.address], worlds, seed=3) as batch:
        stats = dmr.collect(batch, steps=steps, pipeline=2, timeout=30, seed=3)
        assert stats.steps == steps and batch.pending() == 0
        # Once to start, not once per pass; and about two looks at a world per step it takes
        # (is there room for one more, before and after it is sent), not one at every world.
        assert _Counting.looks == 1
        assert _Counting.world_looks <= 2 * steps + 2 * worlds, _Counting.world_looks
    # The same steps again play the same episodes (each world its own actions).
    with BatchedEnvironment.connect([catch_server.address], worlds, seed=3) as again:
        assert dmr.collect(again, steps=steps, pipeline=2, timeout=30, seed=3).returns == (
            stats.returns
        )


def test_the_run_loop_goes_on_without_a_removed_world(
    server_process: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, servers = refusing_servers(server_process, tmp_path, monkeypatch)

    class KillAt:
        total, killed_at = 0, None

        def update(self, count: int) -> None:
            self.total += count
            if self.killed_at is None and self.total >= 200:
                flag.touch()  # both servers refuse CreateWorld from now on
                servers[1].kill()  # worlds 1 and 3: gone for good
                self.killed_at = self.total

    bar = KillAt()
    policy = dmr.RestartPolicy(
        attempts=3, total=10.0, backoff=0.01, max_backoff=0.05, connect_timeout=0.5
    )
    with BatchedEnvironment.connect(
        [s.address for s in servers], 4, seed=0, on_world_failure="restart", restart=policy
    ) as batch:
        stats = dmr.collect(batch, steps=2000, pipeline=2, timeout=30, seed=0, progress=bar.update)
        assert batch.live_ids == [0, 2] and batch.pending() == 0
    assert bar.killed_at is not None
    # Worlds 0 and 2 took their shares (500 each), worlds 1 and 3 what they took before
    # (about 50 each); their steps in flight were not sent again.
    assert 1000 + 2 * 30 <= stats.steps <= 1000 + 2 * 100 and not stats.interrupted
    assert stats.worlds_lost == 2 and stats.unfinished <= 2
