"""A run's events as a watcher takes them: ``RunEvent``, and the batch's failures turned into them.

``RunEvent`` is the stepping loop's event (``kind``, ``world``, ``message``,
``time``): ``"restart"``, ``"relaunch"``, ``"world_lost"`` or ``"error"``.
``FailureEvents(batch).new()`` returns the events of the failures and server
relaunches the batch recorded since the last call (``batch.failures`` is
appended to once a restart ends, ``batch.relaunches`` when a launched server's
death is seen): cheap to call after every step, it compares two lengths.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class RunEvent(NamedTuple):
    """One thing that happened to a run, for its observers.

    Attributes:
      kind: ``"restart"``, ``"relaunch"``, ``"world_lost"`` or ``"error"``.
      world: the world's index in the run, None for the run as a whole.
      message: what happened, for a person.
      time: when (``time.time()``).
    """

    kind: str
    world: int | None
    message: str
    time: float


class FailureEvents:
    """The ``RunEvent``s of a batch's ``failures`` and ``relaunches``, each reported once.

    Args:
      batch: a ``BatchedEnvironment`` (anything with ``failures`` and ``relaunches``).
      first_world: the index of the batch's world 0 in the run.
    """

    def __init__(self, batch: Any, first_world: int = 0) -> None:
        self._batch, self._first = batch, first_world
        self._failures = len(batch.failures)
        self._relaunches = len(batch.relaunches)

    def new(self) -> list[RunEvent]:
        """The events recorded since the last call, oldest first."""
        failures, relaunches = self._batch.failures, self._batch.relaunches
        if len(failures) == self._failures and len(relaunches) == self._relaunches:
            return []
        events = []
        for failure in failures[self._failures :]:
            world = self._first + failure.index
            cause = f"{type(failure.cause).__name__}: {failure.cause}"
            if failure.outcome == "restarted":
                kind = "restart"
                text = f"restarted: {failure.address} -> {failure.new_address} ({cause})"
            elif failure.outcome == "removed":
                kind, text = "world_lost", f"lost (could not be restored): {cause}"
            else:
                kind, text = "error", f"failed at {failure.address}: {cause}"
            events.append(RunEvent(kind, world, f"world {world} {text}", failure.time))
        for relaunch in relaunches[self._relaunches :]:
            text = f"server {relaunch.index} ({relaunch.address}) died: {relaunch.reason}"
            events.append(RunEvent("relaunch", None, text.split(";")[0], relaunch.died))
        self._failures, self._relaunches = len(failures), len(relaunches)
        return events
