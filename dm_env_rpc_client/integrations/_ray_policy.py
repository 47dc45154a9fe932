"""A shard's stepping loop with a user policy (random actions use the CLI's ``step_worlds``).

``step_with_policy(batch, steps=..., policy=...)`` resets every world, then
asks ``policy(timestep)`` for the actions of the worlds that just finished a
step and sends them, one step in flight per world, until ``steps`` steps have
been sent and answered. It counts and records like ``step_worlds`` (the same
``EpisodeTally``) and returns a ``RunStats``, and it meets failures the same
way: under ``on_world_failure="restart"`` a restarted world goes on from its
FIRST step, and a world removed from the batch (not restorable) stops taking
steps while the others go on (its cut episode recorded truncated, its
unanswered step not sent again, so ``steps`` may end one short per removed
world); ``restarts`` and ``worlds_lost`` list them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import errors
from .._adaptor.stacked import unstack
from .._cli.run import EpisodeTally, RunStats, recv_until_stopped, send_unless_removed
from ..batched import BatchedEnvironment, BatchedTimeStep
from ..recording import Recording

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
    first_world: int = 0,
) -> RunStats:
    """Steps every world with ``policy``'s actions; see the module docs.

    Args:
      batch: the worlds.
      steps: total steps over all worlds (the reset's FIRST steps not counted).
      policy: ``policy(timestep) -> actions`` for the worlds of ``timestep.env_ids``.
      timeout: seconds to wait for the reset, and without any finished step.
      recording: where to record the episodes (closed by the caller).
      stop: set it to end the run between steps.
      progress: a tqdm-like bar (``update(n)``), or None.
      first_world: the index of world 0 in the whole run (a shard's first world).

    Raises:
      RequestTimeoutError: the reset, or any step, did not come back within
        ``timeout``; names the worlds waited on.
      WorldError: a world failed (under ``on_world_failure="raise"``).
    """
    stop = stop or threading.Event()
    stats = RunStats(worlds=len(batch.envs), world_seeds=list(batch.world_seeds))
    tally = EpisodeTally(batch, stats, recording, in_episode=True, first_world=first_world)
    started = time.perf_counter()
    first = batch.reset(timeout=timeout)
    if recording is not None:
        for position, world in enumerate(first.env_ids):
            recording.add(int(world), None, first.at(position))
    ready: BatchedTimeStep | None = first  # None after a removed world's refusal
    requested = 0
    while stats.steps < steps and not stop.is_set():
        live = set(batch.live_ids)
        tally.let_go_of_removed(live)
        if ready is not None:
            positions = [p for p, world in enumerate(ready.env_ids) if int(world) in live]
            positions = positions[: steps - requested]
            if positions:
                actions = _take(policy(ready), positions)
                ids = [int(ready.env_ids[p]) for p in positions]
                if not send_unless_removed(batch, actions, ids):
                    continue  # a world was removed meanwhile: choose again without it
                for world, action in zip(ids, unstack(actions, len(ids)), strict=True):
                    tally.sent[world].append(action)
                requested += len(ids)
        if not batch.pending():
            break  # every step sent and answered, or lost with a removed world
        try:
            ready = recv_until_stopped(batch, timeout, stop, first_world)
        except errors.WorldError as error:
            if error.index in batch.live_ids:
                raise
            ready = None  # a world was removed: the loop above lets it go
            continue
        if ready is None:
            break  # stopped
        tally.take(ready, progress)
    tally.finish(time.perf_counter() - started, interrupted=stop.is_set())
    return stats


def _take(actions: Any, positions: Sequence[int]) -> Any:
    """The actions at ``positions`` of the batch axis, nested like ``actions``."""
    if isinstance(actions, Mapping):
        return {key: _take(value, positions) for key, value in actions.items()}
    return np.asarray(actions)[list(positions)]
