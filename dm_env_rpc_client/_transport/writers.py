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
``size`` writers: a stream with waiting requests is queued once, and a writer takes
the next queued stream as it finishes one, so writes start as others end (what a
write makes is freed as the next is made) and nothing is made per stream. The
order of a stream's own requests is kept: one writer writes a stream at a time.
A writer (``_Writer``) is not an asyncio task: it runs a stream's write coroutine
itself, as a task would (``send`` up to the gRPC future it waits for, then again
from that future's done callback), without a task's object, its first step's
and its done callback's loop turns (at 64 worlds, a writer was started for about
every other step; issue 38). The writers a burst of ``ready`` calls asks for (a send to
thousands of worlds) are started together, in one loop callback. In the text below, "task"
means such a writer.

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

# Writers per pool: enough that a send's writes start in few waves (each write waits for
# gRPC's completion, a loop turn; issue 38, at 1,024 worlds, a send to 512 of them: client
# CPU per step 1.25x the bare grpc.aio floor's with 64 writers, 1.19x with 256, 1.16x with
# 1,024 at load 10 to 20, less apart on a quieter machine; the client's RSS 43, 44 and 46 KB
# a world: each stream written at once keeps more of gRPC's memory), few enough that their objects are not a burst the collector scans (a writer
# per stream cost 2.5 µs a step in it at 4,096 worlds). Read when a pool is made.
POOL_SIZE = 256
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
    The writers end when no stream waits; a batch's close ends its streams, and a writer
    waiting on a closed stream's write goes on as gRPC fails that write.
    """

    def __init__(self, size: int | None = None) -> None:
        size = POOL_SIZE if size is None else size
        self._ready: collections.deque[Writable] = collections.deque()
        self._size = size
        self._limit = size  # tasks allowed now: size, or one more than those found held
        self._tasks: set[_Writer] = set()  # the writers running
        # Tasks running, counted down as a task's last stream is written (in the task, not in
        # a done callback a loop turn later: a stream queued in between would find no task).
        self._running = 0
        self._starting = 0  # of those, the writers to start on the loop's next turn
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
        # Counted now, started on the loop's next turn together with every other writer a
        # burst of ready() calls asks for (a send to 512 worlds: one callback, not 512).
        self._running += 1
        self._starting += 1
        if self._starting == 1:
            asyncio.get_running_loop().call_soon(self._start_writers)

    def _start_writers(self) -> None:
        try:
            while self._starting:
                self._starting -= 1
                writer = _Writer(self)
                self._tasks.add(writer)
                writer.step()
        finally:
            if self._starting:  # a writer raised (step re-raises): the rest on the next turn
                asyncio.get_running_loop().call_soon(self._start_writers)

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

    def _ended(self, writer: _Writer) -> None:
        """``writer`` found no stream waiting and ended (in its last step, not a loop turn
        later: a stream queued in between would find no writer)."""
        self._tasks.discard(writer)
        self._running -= 1
        if self._running < self._size:  # fewer writers than the pool has room for: none held
            self._limit = self._size


class _Writer:
    """One of a pool's writers: writes the queued streams one at a time, as a task would,
    without one (see the module): ``step`` runs the current stream's ``_write_queued``
    coroutine up to its next wait and is called again as what it waits for is done."""

    __slots__ = ("_coroutine", "_pool", "_stream")

    def __init__(self, pool: WritePool) -> None:
        self._pool = pool
        self._stream: Writable | None = None
        self._coroutine: Any = None

    def step(self, _done: Any = None) -> None:
        """Runs the writes on to their next wait (the loop's call, or a wait's done callback)."""
        ready = self._pool._ready
        while True:
            coroutine = self._coroutine
            if coroutine is None:
                if not ready:
                    self._pool._ended(self)
                    return
                self._stream = ready.popleft()
                coroutine = self._coroutine = self._stream._write_queued()
            try:
                waits = coroutine.send(None)
            except (StopIteration, asyncio.CancelledError):
                # Written, or the stream's call was cancelled under its write (gRPC's word for
                # a call closed here: its reader ends the stream); a stream's own errors end
                # in _write_queued. The next stream, if any.
                self._next()
                continue
            except BaseException:
                self._next()
                self._pool._ended(self)
                raise
            if getattr(waits, "_asyncio_future_blocking", None):
                waits._asyncio_future_blocking = False
                waits.add_done_callback(self.step)
            else:  # a bare yield (asyncio.sleep(0)): on the loop's next turn
                asyncio.get_running_loop().call_soon(self.step)
            return

    def _next(self) -> None:
        """The current stream is written: its writer is free, and this one takes the next."""
        stream = self._stream
        self._coroutine = None
        if stream is not None:
            stream._writer = None
