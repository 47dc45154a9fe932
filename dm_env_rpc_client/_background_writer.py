"""``BackgroundWriter``: a ``recording.EpisodeWriter`` run on a thread of its own.

``Recording(..., background=True)`` (as ``run --record`` makes it) wraps its writer
in one, so the episode files of a run are written while its batch steps.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from dm_env_rpc_client import errors


class BackgroundWriter:
    """Hands episodes to ``writer`` on a thread of its own, so files are written while the
    batch steps (a writer's file system calls release the GIL).

    At most ``depth`` episodes wait; past that, ``write`` waits for the thread. An
    error of the thread is raised by the next ``write`` or by ``close``.

    Args:
      writer: the writer to run on the thread.
      depth: how many finished episodes may wait to be written.
    """

    def __init__(self, writer: Any, depth: int = 64) -> None:
        self.writer = writer
        self._queue: queue.Queue[Any] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="episode-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        while (episode := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self.writer.write(episode)
                except BaseException as exc:  # raised again in the caller's thread
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise errors.RecordingError(f"Writing an episode failed: {error}") from error

    def write(self, episode: Any) -> None:
        """Queues ``episode`` (waits while ``depth`` episodes wait)."""
        self._raise()
        self._queue.put(episode)

    def close(self) -> None:
        """Writes what waits, then closes the writer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        try:
            self._raise()
        finally:
            self.writer.close()
