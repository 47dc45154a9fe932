"""The watcher's accounting, done off the stepping thread: step counts, returns, latest steps.

The stepping thread only queues each batch's ``(env_ids, step_type, reward,
timestep)`` (``timestep`` None unless the watcher is capturing frames, so that
no observation is held); ``Tally.take`` counts a tick's worth of them later, on
the watcher's own thread, in order (a plain loop: at the few thousand steps a
second of a run, cheaper than array operations on a tick's many small batches):

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
        self.counts: list[int] = []
        self.running: list[float] = []  # each world's return so far in its episode
        self.in_episode: list[bool] = []  # a FIRST step came, and no LAST since
        self.returns = Log(returns_cap)
        self.latest: dict[int, tuple[Any, int, int]] = {}
        self.stepped: set[int] = set()

    def _grow(self, worlds: int) -> None:
        extra = worlds - len(self.counts)
        self.counts += [0] * extra
        self.running += [0.0] * extra
        self.in_episode += [False] * extra

    def take(self, items: Sequence[tuple[Any, Any, Any, Any]], wanted: set[int]) -> None:
        """Counts queued batches, in order; keeps captured steps of ``wanted`` worlds in ``latest``."""
        counts, running, in_episode = self.counts, self.running, self.in_episode
        finished: list[tuple[int, int, float]] = []
        stepped: set[int] = set()
        for env_ids, step_types, rewards, timestep in items:
            ids = env_ids.tolist()
            stepped.update(ids)
            if ids and max(ids) >= len(counts):
                self._grow(max(ids) + 1)
            for world, step_type, reward in zip(
                ids, step_types.tolist(), rewards.tolist(), strict=True
            ):
                counts[world] += 1
                self.total += 1
                if step_type == 0:
                    running[world], in_episode[world] = 0.0, True
                else:
                    running[world] += reward
                    if step_type == 2 and in_episode[world]:
                        in_episode[world] = False
                        finished.append((world, self.total, round(running[world], 6)))
            if timestep is not None:
                for position, world in enumerate(ids):
                    if world in wanted:
                        self.latest[world] = (timestep, position, counts[world])
        if finished:
            self.returns.extend(finished)
        self.stepped = stepped
