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

A stream whose server stops reading holds its task: its write waits for HTTP/2
flow control once its unread requests pass the stream's window (64 KB unless
the server's gRPC grew it; large actions). Were ``size`` such streams to stall at
once, every other stream of the batch would wait until they failed (the batch's
``step_timeout`` watchdog, keepalive, close). So when a stream is queued while
every task is busy, one check is armed ``STALL_CHECK_S`` later: if no task has
taken a queued stream since, the tasks running are held, and the pool takes one
task more than it runs and starts it; the check is armed again while streams
wait. A held task ends as its stream fails (closed by the watchdog or close,
which cancels the call and so its write), and the pool is back to ``size`` once
fewer than ``size`` run. While nothing stalls this costs one timer per
``STALL_CHECK_S`` while streams wait for a task, and nothing per write.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Protocol

# Writer tasks per pool: enough that writes keep pace with a loop turn's responses (each write
# waits for gRPC's completion, a loop turn), few enough that their objects are not a burst.
POOL_SIZE = 64
# Seconds streams wait for a busy pool, no task taking one, before the pool starts one task more.
STALL_CHECK_S = 0.1


class Writable(Protocol):
    """What the pool writes for: an ``AsyncConnection`` (``_write_queued`` writes its queue)."""

    _close_called: bool
    _writer: Any

    async def _write_queued(self) -> None: ...


class WritePool:
    """Writes the queued requests of many streams with ``size`` tasks, more if held (see the module).

    On the loop only. ``ready(stream)`` queues a stream whose requests wait
    (the stream marks itself as queued, so it is queued once); a pool whose
    tasks are all held by stalled writes starts more, one per ``STALL_CHECK_S``.
    The tasks end when no stream waits; a batch's close ends its streams, and the loop's
    close any task still running.
    """

    def __init__(self, size: int = POOL_SIZE) -> None:
        self._ready: collections.deque[Writable] = collections.deque()
        self._size = size
        self._limit = size  # tasks allowed now: size, or one more than those found held
        self._tasks: set[asyncio.Future[None]] = set()  # held: the loop keeps only weak ones
        # Tasks running, counted down as a task's last stream is written (in the task, not in
        # a done callback a loop turn later: a stream queued in between would find no task).
        self._running = 0
        self._check: asyncio.TimerHandle | None = None  # armed while streams wait for a task

    def ready(self, stream: Writable) -> None:
        """Queues ``stream`` for writing; starts a task if fewer than allowed run, else arms
        the stall check (see the module)."""
        self._ready.append(stream)
        if self._running < self._limit:
            self._start()
        elif self._check is None:
            self._arm(self._ready[0])

    def _start(self) -> None:
        self._running += 1
        task = asyncio.ensure_future(self._work())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _arm(self, head: Writable) -> None:
        loop = asyncio.get_running_loop()
        self._check = loop.call_later(STALL_CHECK_S, self._stall_check, head)

    def _stall_check(self, head: Writable) -> None:
        """``head`` was the first stream waiting ``STALL_CHECK_S`` ago: still first, no task
        took a stream since, and one more task starts."""
        self._check = None
        ready = self._ready
        if not ready or self._running < self._limit:
            return  # nothing waits, or a task was started for it meanwhile
        if ready[0] is head:
            self._limit = self._running + 1
            self._start()
            if len(ready) < 2:  # the new task takes the one waiting
                return
            head = ready[1]  # the first to wait once the new task took its stream
        else:
            head = ready[0]
        self._arm(head)

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
            if self._running < self._size:  # fewer tasks than the pool has room for: none held
                self._limit = self._size
