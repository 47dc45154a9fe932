"""A shard's stepping loop with a user policy (random actions use the CLI's ``step_worlds``).

``step_with_policy(batch, steps=..., policy=...)`` resets every world, then
asks ``policy(timestep)`` for the actions of the worlds that just finished a
step and sends them, one step in flight per world, until ``steps`` steps have
come back. It counts and records like ``step_worlds`` and returns a ``RunStats``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dm_env_rpc_client._cli_run import EpisodeTally, RunStats
from dm_env_rpc_client.batched import BatchedEnvironment, BatchedTimeStep
from dm_env_rpc_client.recording import Recording

Policy = Callable[[BatchedTimeStep], Mapping[str, Any]]


def step_with_policy(
    batch: BatchedEnvironment,
    *,
    steps: int,
    policy: Policy,
    timeout: float,
    recording: Recording | None = None,
    stop: threading.Event | None = None,
    progress: Any = None,
) -> RunStats:
    """Steps every world with ``policy``'s actions; see the module docs.

    Args:
      batch: the worlds.
      steps: total steps over all worlds (the reset's FIRST steps not counted).
      policy: ``policy(timestep) -> actions`` for the worlds of ``timestep.env_ids``.
      timeout: seconds to wait for each step.
      recording: where to record the episodes (closed by the caller).
      stop: set it to end the run between steps.
      progress: a tqdm-like bar (``update(n)``), or None.

    Raises:
      RequestTimeoutError: a reset or step did not come back within ``timeout``.
      WorldError: a world failed.
    """
    stop = stop or threading.Event()
    stats = RunStats(worlds=len(batch), world_seeds=list(batch.world_seeds))
    tally = EpisodeTally(batch, stats, recording, in_episode=True)
    started = time.perf_counter()
    ready = batch.reset(timeout=timeout)
    if recording is not None:
        for position, world in enumerate(ready.env_ids):
            recording.add(int(world), None, ready.at(position))
    requested = 0
    while stats.steps < steps and not stop.is_set():
        ids = [int(world) for world in ready.env_ids][: steps - requested]
        if ids:
            actions = _head(policy(ready), len(ids))
            batch.send(actions, ids)
            for position, world in enumerate(ids):
                tally.sent[world].append(_index(actions, position))
            requested += len(ids)
        ready = batch.recv(1, timeout=timeout)
        tally.take(ready, progress)
    tally.finish(time.perf_counter() - started, interrupted=stop.is_set())
    return stats


def _head(actions: Any, count: int) -> Any:
    if isinstance(actions, Mapping):
        return {key: _head(value, count) for key, value in actions.items()}
    return np.asarray(actions)[:count]


def _index(actions: Any, position: int) -> Any:
    if isinstance(actions, Mapping):
        return {key: _index(value, position) for key, value in actions.items()}
    return np.asarray(actions)[position]
