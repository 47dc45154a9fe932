"""``BackgroundWriter``: a ``recording.EpisodeWriter`` run on a thread of its own.

``Recording(..., background=True)`` (as ``run --record`` makes it) wraps its writer
in one, so the episodes of a run are cut and written while its batch steps.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

from .. import errors


class BackgroundWriter:
    """Runs ``writer``'s work on a thread of its own, so episodes are cut and written while
    the batch steps.

    At most ``depth`` jobs wait; past that, ``call`` waits for the thread. An
    error of the thread is raised by the next ``call`` or by ``close``.

    Args:
      writer: the writer to run on the thread.
      depth: how many jobs (episodes, or blocks of steps to cut) may wait.
    """

    def __init__(self, writer: Any, depth: int = 64) -> None:
        self.writer = writer
        self._queue: queue.Queue[Callable[[], Any] | None] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="episode-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._error is None:
                try:
                    job()
                except BaseException as exc:  # raised again in the caller's thread
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise errors.RecordingError(f"Writing an episode failed: {error}") from error

    def call(self, function: Callable[..., Any], *args: Any) -> None:
        """Queues ``function(*args)`` for the thread (waits while ``depth`` jobs wait)."""
        self._raise()
        self._queue.put(functools.partial(function, *args))

    def write(self, episode: Any) -> None:
        """Queues ``episode`` for the writer (waits while ``depth`` jobs wait)."""
        self.call(self.writer.write, episode)

    def close(self) -> None:
        """Runs what waits, then closes the writer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        try:
            self._raise()
        finally:
            self.writer.close()
