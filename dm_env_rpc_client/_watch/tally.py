"""The watcher's accounting, done off the stepping thread: step counts, returns, latest steps.

The stepping thread only queues each batch's ``(env_ids, step_type, reward,
timestep)`` (``timestep`` None unless the watcher is capturing frames, so that
no observation is held); ``Tally.take`` counts a tick's worth of them later, on
the watcher's own thread, in one pass of array operations (its cost per tick
hardly grows with the steps in it, and the GIL is held for a fraction of a
millisecond):

- ``counts[w]``: steps world ``w`` returned in the run; a step's *index* is
  its world's count once it is counted (1 for a world's first step).
- ``returns``: a ``Log`` of ``(world, run_steps, return)``, one per finished
  episode (a LAST step after a FIRST one; a world cut by a restart has none),
  in the order of the run's steps.
- ``latest[w]``: ``(timestep, position, index)`` of the newest captured step
  of each world in ``wanted``, by reference (the frames are encoded from it, once).
- ``stepped``: the worlds that took a step in the last ``take``.

``Log`` is an append-only list that forgets its oldest items past ``cap``;
readers keep a cursor and take what came since.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


class Log:
    """An append-only list read by cursors; keeps the newest ``cap`` items.

    Args:
      cap: items kept; older ones are dropped (a cursor behind them skips them).
    """

    def __init__(self, cap: int) -> None:
        self.cap, self.start, self.items = cap, 0, list[Any]()

    def extend(self, items: Iterable[Any]) -> None:
        """Appends ``items``, then drops the oldest beyond ``cap``."""
        self.items.extend(items)
        extra = len(self.items) - self.cap
        if extra > 0:
            del self.items[:extra]
            self.start += extra

    @property
    def end(self) -> int:
        """The cursor after the newest item."""
        return self.start + len(self.items)

    def since(self, cursor: int) -> list[Any]:
        """The items from ``cursor`` on (those still kept)."""
        return self.items[max(0, cursor - self.start) :]


class Tally:
    """Counts queued batches of steps; see the module docs."""

    def __init__(self, returns_cap: int = 50_000) -> None:
        self.total = 0
        self.counts = np.zeros(0, np.int64)
        self.running = np.zeros(0, np.float64)  # each world's return so far in its episode
        self.in_episode = np.zeros(0, bool)  # a FIRST step came, and no LAST since
        self.returns = Log(returns_cap)
        self.latest: dict[int, tuple[Any, int, int]] = {}
        self.stepped: set[int] = set()

    def _grow(self, worlds: int) -> None:
        extra = worlds - len(self.counts)
        self.counts = np.concatenate([self.counts, np.zeros(extra, np.int64)])
        self.running = np.concatenate([self.running, np.zeros(extra, np.float64)])
        self.in_episode = np.concatenate([self.in_episode, np.zeros(extra, bool)])

    def take(self, items: Sequence[tuple[Any, Any, Any, Any]], wanted: set[int]) -> None:
        """Counts queued batches, in order; keeps captured steps of ``wanted`` worlds in ``latest``."""
        if not items:
            self.stepped = set()
            return
        ids = np.concatenate([item[0] for item in items]).astype(np.int64, copy=False)
        if not ids.size:
            self.stepped = set()
            return
        types = np.concatenate([item[1] for item in items])
        rewards = np.concatenate([item[2] for item in items]).astype(np.float64, copy=False)
        top = int(ids.max()) + 1
        if top > len(self.counts):
            self._grow(top)
        self._keep_latest(items, ids, wanted)
        self._count_returns(ids, types, rewards)
        np.add.at(self.counts, ids, 1)
        self.total += int(ids.size)
        self.stepped = set(np.unique(ids).tolist())

    def _keep_latest(self, items: Sequence[Any], ids: np.ndarray, wanted: set[int]) -> None:
        """``latest`` from the captured batches (those queued with their timestep), newest first."""
        left, end = set(wanted), int(ids.size)
        for env_ids, _, _, timestep in reversed(items):
            end -= len(env_ids)
            if timestep is None or not left:
                continue
            for position, world in reversed(list(enumerate(env_ids.tolist()))):
                if world in left:
                    left.discard(world)
                    seen = int(np.count_nonzero(ids[: end + position + 1] == world))
                    self.latest[world] = (timestep, position, int(self.counts[world]) + seen)

    def _count_returns(self, ids: np.ndarray, types: np.ndarray, rewards: np.ndarray) -> None:
        """Adds up each world's rewards in order; logs each finished episode's return.

        The steps are sorted by world (keeping their order), then cut into segments at
        each world's first step here and at each FIRST step; a segment's sum runs on from
        its world's ``running`` when it continues an episode, from 0 after a FIRST.
        """
        order = np.argsort(ids, kind="stable")
        world, kind = ids[order], types[order]
        first, last = kind == 0, kind == 2
        reward = np.where(first, 0.0, rewards[order])  # a FIRST step's reward starts nothing
        new_world = np.ones(world.size, bool)
        new_world[1:] = world[1:] != world[:-1]
        starts = np.flatnonzero(new_world | first)
        segment = np.cumsum(new_world | first) - 1
        sums = np.cumsum(reward)
        before = np.where(starts > 0, sums[starts - 1], 0.0)
        carried = ~first[starts]  # a world's first segment here, continuing from before
        start_world = world[starts]
        origin = np.where(carried, self.running[start_world], 0.0)
        live = np.where(carried, self.in_episode[start_world], True)
        running = origin[segment] + sums - before[segment]
        lasts = np.flatnonzero(last)
        if lasts.size:
            of = segment[lasts]
            once = np.ones(lasts.size, bool)  # only a segment's first LAST ends its episode
            once[1:] = of[1:] != of[:-1]
            ended = lasts[once & live[of]]
            steps = self.total + order[ended] + 1
            by_step = np.argsort(steps)
            self.returns.extend(
                zip(
                    world[ended][by_step].tolist(),
                    steps[by_step].tolist(),
                    np.round(running[ended][by_step], 6).tolist(),
                    strict=True,
                )
            )
        ends = np.flatnonzero(np.append(new_world[1:], True))  # each world's newest step here
        end_world, end_segment = world[ends], segment[ends]
        ended_here = np.zeros(starts.size, bool)
        ended_here[segment[lasts]] = True
        self.running[end_world] = running[ends]
        self.in_episode[end_world] = live[end_segment] & ~ended_here[end_segment]
