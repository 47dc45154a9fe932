"""What a run tells its observers: every batch of steps, and its restarts, relaunches, losses, errors.

``RunObserver`` is what ``dmr.collect(observers=...)`` takes; ``RunEvent`` is one
thing that happened to the run. ``Watch`` hands them out from the stepping
thread: ``steps`` once per received batch, ``poll`` once per pass of the loop.
Both cost one length check when nothing new happened, and nothing at all
without observers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from .. import errors
from ..batched import BatchedEnvironment, BatchedTimeStep

RESTART = "restart"
RELAUNCH = "relaunch"
WORLD_LOST = "world_lost"
ERROR = "error"
KINDS = (RESTART, RELAUNCH, WORLD_LOST, ERROR)


class RunEvent(NamedTuple):
    """One thing that happened to a run (``RunObserver.on_event``).

    Attributes:
      kind: ``"restart"`` (a world was made again after a failure), ``"relaunch"``
        (a launched server died and is started again), ``"world_lost"`` (a world
        could not be restored and left the batch) or ``"error"`` (the run ends
        with this error, raised to the caller).
      world: the world's index in the run, or None (a server's relaunch; an error
        that names no world).
      message: what happened, for people.
      time: when it was seen (``time.time()``).
    """

    kind: str
    world: int | None
    message: str
    time: float


@runtime_checkable
class RunObserver(Protocol):
    """Watches a run: ``dmr.collect(..., observers=[watcher])``.

    Both methods are called on the stepping thread. ``on_steps`` may block (that
    is how a watcher pauses the run) but must return once the run's ``stop`` is
    set.
    """

    def on_steps(self, timestep: BatchedTimeStep) -> None:
        """Called with every batch of steps received, before actions are chosen for them.

        Args:
          timestep: the steps, one per entry of ``timestep.env_ids``.
        """

    def on_event(self, event: RunEvent) -> None:
        """Called with each restart, relaunch, lost world and error of the run.

        Args:
          event: what happened.
        """


class Watch:
    """Hands a batch's steps and events to the run's observers.

    Args:
      batch: the worlds.
      observers: who to tell (none: every call is a no-op).
      first_world: the index of world 0 in the whole run (a shard's first world).
    """

    def __init__(
        self, batch: BatchedEnvironment, observers: Sequence[RunObserver], first_world: int = 0
    ) -> None:
        self.batch, self.observers, self.first_world = batch, tuple(observers), first_world
        self._failures = len(batch.failures)  # told up to here
        self._relaunches = len(batch.relaunches)

    def steps(self, timestep: BatchedTimeStep) -> None:
        """Tells every observer of ``timestep``."""
        for observer in self.observers:
            observer.on_steps(timestep)

    def poll(self) -> None:
        """Tells the observers of the restarts, losses and relaunches since the last call."""
        if not self.observers:
            return
        failures, relaunches = self.batch.failures, self.batch.relaunches
        while self._failures < len(failures):
            failure = failures[self._failures]
            self._failures += 1
            world = self.first_world + failure.index
            cause = f"{type(failure.cause).__name__}: {failure.cause}"
            if failure.outcome == "restarted":
                message = f"world {world}: {failure.address} -> {failure.new_address} ({cause})"
                self._tell(RunEvent(RESTART, world, message, failure.time))
            elif failure.outcome == "removed":
                message = f"world {world} at {failure.address} lost after {failure.attempts} "
                self._tell(
                    RunEvent(WORLD_LOST, world, message + f"attempts ({cause})", failure.time)
                )
        while self._relaunches < len(relaunches):
            relaunch = relaunches[self._relaunches]
            self._relaunches += 1
            message = f"server {relaunch.index} ({relaunch.address}): {relaunch.reason}"
            self._tell(RunEvent(RELAUNCH, None, message, relaunch.died))

    def error(self, error: BaseException) -> None:
        """Tells the observers of the error that ends the run (after the events before it)."""
        if not self.observers:
            return
        self.poll()
        index = getattr(error, "index", None) if isinstance(error, errors.WorldError) else None
        world = None if index is None else self.first_world + index
        self._tell(RunEvent(ERROR, world, f"{type(error).__name__}: {error}", time.time()))

    def _tell(self, event: RunEvent) -> None:
        for observer in self.observers:
            observer.on_event(event)
