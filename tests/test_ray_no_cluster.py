"""The Ray integration's pieces that run without a Ray: no cluster is started here.

- Without ``ray.init``, a fleet and a sharded run say so (``FleetError``). Tested in this
  process, where Ray is imported already and not initialized (``test_ray.py``'s module
  fixture shuts its Ray down by now). It used to run in a subprocess, which had to import
  Ray from scratch (its 44 MB core library) within 60 s on a loaded machine, and which
  inherited the environment ``ray.init`` had changed in this process (``RAY_AUTH_MODE``,
  ``PYTHONBREAKPOINT``); it failed twice under load.
- The stepping loop with a policy (``dmr.collect(policy=...)``, as the shards call it) meets
  failures as it does with random actions.
  It steps a ``BatchedEnvironment`` in this process, against real servers in
  subprocesses; a world is removed from the batch by killing its server while the other
  server refuses to make worlds (``tests.faulty.refusing_catch``).
"""

from __future__ import annotations

import collections
import pathlib
from typing import Any

import numpy as np
import pytest
from faulty import refusing_servers

import dm_env_rpc_client as dmr

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
rayi = pytest.importorskip("dm_env_rpc_client.integrations.ray")

STEPS = 2000
FIRST_WORLD = 10  # the shard's worlds are 10 to 13 of a larger run


def test_without_ray_initialized_the_fleet_and_the_run_say_so() -> None:
    assert not ray.is_initialized(), "an earlier test left Ray initialized"
    with pytest.raises(rayi.FleetError, match=r"call ray.init\(\) first"):
        rayi.ServerFleet(print, 1)
    with pytest.raises(rayi.FleetError, match=r"call ray.init\(\) first"):
        rayi.run_sharded(["127.0.0.1:1"], num_worlds=1, num_shards=1, steps=1)
    assert not ray.is_initialized()  # neither started a Ray on its way to the error


def towards_ball(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
    """Moves each paddle towards its ball: every episode is caught (return 1)."""
    actions = []
    for board in timestep.observation["board"]:
        column = board[:-1].max(axis=0).argmax()
        actions.append(np.sign(column - board[-1].argmax()))
    return {"paddle": np.asarray(actions, np.int8)}


class _KillAt:
    """A progress bar that, once ``at`` steps came back, runs ``kill`` (once)."""

    def __init__(self, at: int, kill: Any) -> None:
        self.at, self.kill, self.total, self.killed_at = at, kill, 0, None

    def update(self, count: int) -> None:
        self.total += count
        if self.killed_at is None and self.total >= self.at:
            self.kill()
            self.killed_at = self.total


def test_the_policy_loop_goes_on_without_a_removed_world(
    server_process: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, servers = refusing_servers(server_process, tmp_path, monkeypatch)

    def kill() -> None:
        flag.touch()  # from now on both servers refuse CreateWorld
        servers[1].kill()  # worlds 1 and 3 (11 and 13 in the run): gone for good

    bar = _KillAt(200, kill)
    policy = dmr.RestartPolicy(
        attempts=3, total=10.0, backoff=0.01, max_backoff=0.05, connect_timeout=0.5
    )
    recording = dmr.Recording(tmp_path / "rec", 4, first_world=FIRST_WORLD)
    with dmr.BatchedEnvironment.connect(
        [s.address for s in servers], 4, seed=0, on_world_failure="restart", restart=policy
    ) as batch:
        stats = dmr.collect(
            batch,
            STEPS,
            policy=towards_ball,
            timeout=30,
            record=recording,
            progress=bar.update,
        )
        assert batch.live_ids == [0, 2]
    recording.close()
    assert bar.killed_at is not None and bar.killed_at < 300
    # The batch went on without them: each removed world's one step in flight is not sent
    # again, so the run may end one step short per removed world, not more.
    assert STEPS - 2 <= stats.steps <= STEPS and not stats.interrupted
    assert stats.worlds_lost == 2 and stats.restarts == []
    assert stats.unfinished <= 2  # the removed worlds' cut episodes are not counted
    finished: collections.Counter[int] = collections.Counter()
    for episode in dmr.iter_episodes(tmp_path / "rec"):
        assert episode.world is not None
        finished[episode.world] += not episode.truncated
    assert stats.episodes == sum(finished.values()) and set(stats.returns) == {1.0}
    # Worlds 10 and 12 played on long after 11 and 13 were removed (about 50 steps in).
    assert min(finished[10], finished[12]) > 3 * max(finished[11], finished[13], 1)
