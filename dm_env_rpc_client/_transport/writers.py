"""A shared pool of writer tasks for many streams on one loop (a batch's).

An ``AsyncConnection`` on its own writes with a task of its own, started when
requests wait and ended when none do. A batch sending a step to each of 4,096
worlds at once would start 4,096 such tasks in one loop turn, and each of them
one ``grpc.aio`` write (about 17 objects the garbage collector tracks, kept until
gRPC reports the write done): some 35,000 tracked objects made in one burst. Python
runs a young-generation collection each time 700 more tracked objects are made
than freed, so every burst ran dozens of collections; each step's objects,
alive for the whole round trip at that size, were moved to the oldest
generation, whose collections scan the whole heap. Stepping cost grew with the
worlds through the collector alone.

``WritePool`` writes for every stream that has requests waiting with at most
``size`` tasks: a stream with waiting requests is queued once, and a task takes
the next queued stream as it finishes one, so writes start as others end (what a
write makes is freed as the next is made) and no task is made per stream. The
order of a stream's own requests is kept: one task writes a stream at a time.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Protocol

# Writer tasks per pool: enough that writes keep pace with a loop turn's responses (each write
# waits for gRPC's completion, a loop turn), few enough that their objects are not a burst.
POOL_SIZE = 64


class Writable(Protocol):
    """What the pool writes for: an ``AsyncConnection`` (``_write_queued`` writes its queue)."""

    _close_called: bool
    _writer: Any

    async def _write_queued(self) -> None: ...


class WritePool:
    """Writes the queued requests of many streams with at most ``size`` tasks (see the module).

    On the loop only. ``ready(stream)`` queues a stream whose requests wait
    (the stream marks itself as queued, so it is queued once). The tasks end
    when no stream waits; a batch's close ends its streams, and the loop's
    close any task still running.
    """

    def __init__(self, size: int = POOL_SIZE) -> None:
        self._ready: collections.deque[Writable] = collections.deque()
        self._size = size
        self._tasks: set[asyncio.Future[None]] = set()  # held: the loop keeps only weak ones
        # Tasks running, counted down as a task's last stream is written (in the task, not in
        # a done callback a loop turn later: a stream queued in between would find no task).
        self._running = 0

    def ready(self, stream: Writable) -> None:
        """Queues ``stream`` for writing; starts a task if fewer than ``size`` run."""
        self._ready.append(stream)
        if self._running < self._size:
            self._running += 1
            task = asyncio.ensure_future(self._work())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _work(self) -> None:
        ready = self._ready
        try:
            while ready:
                stream = ready.popleft()
                try:
                    await stream._write_queued()
                except asyncio.CancelledError:
                    # A stream closed under its write ends it with CancelledError (gRPC's word for
                    # a call cancelled here); this task's own cancellation ends the task.
                    if not stream._close_called:
                        raise
                finally:
                    stream._writer = None
        finally:
            self._running -= 1
