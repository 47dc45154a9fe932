"""A background asyncio loop, and a sync connection facade over ``AsyncConnection`` on it.

``LoopThread`` runs one asyncio event loop in a daemon thread. ``LoopConnection``
is a ``ConnectionLike`` (``send``, ``send_async`` returning a
``concurrent.futures.Future``, ``close``) whose stream lives on that loop, so a
``DmEnvAdaptor`` works over it unchanged::

    runner = LoopThread()
    conn = runner.run(LoopConnection.open(runner, address, timeout=10))
    env, _ = dmr.create_and_join_world(conn, {}, {})
    ...
    conn.close()
    runner.close()

Many streams share the one thread. The threaded ``Connection`` pays for a
reader thread and gRPC's own request-consuming thread per stream, and with
dozens of streams those threads spend the client's CPU passing the GIL around;
on one loop, every stream's responses are handled in turn by a single thread
(``BatchedEnvironment`` uses this). The loop is private: only coroutines and
callbacks of this module run on it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
from google.protobuf import message

from .. import errors, messages
from ..aio import AsyncConnection, open_when_ready
from ..connection import _CLOSED, create_channel, wait_response

T = TypeVar("T")

_LOOP_CLOSED = "The background event loop is closed; open a new connection."
_LOOP_TIMEOUT = "The background event loop did not finish {what} within {timeout} s."


class LoopThread:
    """One asyncio event loop running in a daemon thread. ``close()`` is idempotent."""

    def __init__(self, name: str = "dm_env_rpc_client-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        # Calls from other threads, drained in one loop callback per burst (see call()).
        self._calls: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._drain_scheduled = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # Keeps gRPC's asyncio layer up while the loop runs (see _anchor_channel).
        self._anchor: grpc.aio.Channel | None = self.run(_anchor_channel(), timeout=30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs a coroutine on the loop and waits for its result.

        Raises:
          ConnectionClosedError: the loop is closed.
          RequestTimeoutError: no result within ``timeout`` (the coroutine is cancelled).
        """
        if self._closed:
            coroutine.close()
            raise errors.ConnectionClosedError(_LOOP_CLOSED)
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (e.g. ConnectTimeoutError)
                raise
            future.cancel()
            raise errors.RequestTimeoutError(
                _LOOP_TIMEOUT.format(what=getattr(coroutine, "__name__", "a call"), timeout=timeout)
            ) from None

    def call(self, function: Callable[..., Any], *args: Any) -> None:
        """Schedules ``function(*args)`` on the loop, in call order; returns at once.

        A burst of calls (one per world of a batch) costs one wake-up of the
        loop, not one each: only the first call of a burst schedules the drain.
        Called on the loop's own thread with no drain due, it runs at once.

        Raises:
          ConnectionClosedError: the loop is closed.
        """
        if self._closed:
            raise errors.ConnectionClosedError(_LOOP_CLOSED)
        self._calls.append((function, args))
        if not self._drain_scheduled and threading.get_ident() == self._thread.ident:
            self._drain()  # on the loop itself (a run stepped from there): now, in order
        elif not self._drain_scheduled:
            # Safe without a lock: _drain clears the flag *before* it empties the
            # deque, so a call that saw the flag set is drained by that pass.
            self._drain_scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # "Event loop is closed"
                raise errors.ConnectionClosedError(_LOOP_CLOSED) from None

    def _drain(self) -> None:
        self._drain_scheduled = False
        calls = self._calls
        while calls:
            function, args = calls.popleft()
            try:
                function(*args)
            except Exception as exc:  # one failed call must not strand the ones after it
                self.loop.call_exception_handler(
                    {"message": "dm_env_rpc_client: a loop call failed", "exception": exc}
                )

    def close(self, timeout: float = 5.0) -> None:
        """Stops the loop and joins its thread. Close the connections on it first."""
        if self._closed:
            return
        if threading.current_thread() is not self._thread:
            # Tasks left on the loop (gRPC's own, finishing a call) would be reported as
            # "destroyed but pending" once the loop stops: end them first.
            with contextlib.suppress(Exception):
                self.run(_end_tasks(), timeout)
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            # Nothing runs the loop now: gRPC may shut its poller down (if this was its
            # last channel), removing the poller's reader from the loop and closing its fd.
            self._anchor = None
            _retire(self.loop)

    def __repr__(self) -> str:
        return f"LoopThread({'closed' if self._closed else 'running'})"


class LoopWakingCondition(threading.Condition):
    """A ``threading.Condition`` whose ``notify`` also wakes a coroutine: ``waiter``, a future
    of a loop that waits as a thread would (a batch's run stepped from its own loop,
    ``_stepping.receive``). Set ``waiter`` with the lock held; a notify resolves it once."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waiter: asyncio.Future[None] | None = None

    def notify(self, n: int = 1) -> None:
        super().notify(n)
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            loop = waiter.get_loop()
            if asyncio._get_running_loop() is loop:
                _resolve(waiter)
            else:
                loop.call_soon_threadsafe(_resolve, waiter)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def call_on_loop(function: Callable[..., Any], *args: Any) -> Any:
    """Runs ``function(*args)`` on the loop (for ``LoopThread.run``)."""
    return function(*args)


async def _anchor_channel() -> grpc.aio.Channel:
    """A never-used aio channel, created on the running loop, for ``LoopThread`` to hold.

    gRPC's asyncio layer counts its live channels and servers; when the last one is freed,
    on whatever thread drops it, it shuts its completion poller down at once: it removes the
    poller's reader from every loop and closes the poller's socket. Done from another thread
    while the loop runs, that races the loop: a ``_handle_events`` callback already taken up
    by the loop then reads the closed socket and the loop prints "Exception in callback
    PollerCompletionQueue._handle_events ... OSError: [Errno 9] Bad file descriptor" (seen
    after Ctrl-C in ``run``, where the batch's channels were freed on the main thread before
    its loop stopped; grpc/grpc#34139 is the same poller shutdown racing a loop at exit).
    Holding one channel of our own until the loop has stopped means the poller shuts down,
    if it does, only when no loop of ours is running. The channel never connects (gRPC
    channels connect on their first call) and costs no socket.
    """
    return grpc.aio.insecure_channel("127.0.0.1:1")


# gRPC's asyncio layer has one completion poller per process, shared by every event loop. A
# call or channel cancelled on a loop completes its last operations a moment later, and the
# poller hands each completion to its own loop with call_soon_threadsafe: on a closed loop that
# raises "Event loop is closed" inside another loop's callback (printed as a traceback, and
# the rest of that callback's completions wait for the next one). So a stopped loop is closed
# only once RETIRE_S has passed, when nothing of it can still be in gRPC's hands; until then,
# a late completion lands in its queue and is dropped with it.
RETIRE_S = 5.0
_retired: collections.deque[tuple[float, asyncio.AbstractEventLoop]] = collections.deque()
_retired_lock = threading.Lock()


def _retire(loop: asyncio.AbstractEventLoop) -> None:
    """Closes ``loop`` later: now, the loops retired more than ``RETIRE_S`` ago."""
    now = time.monotonic()
    with _retired_lock:
        while _retired and now - _retired[0][0] >= RETIRE_S:
            _retired.popleft()[1].close()
        _retired.append((now, loop))


async def _end_tasks() -> None:
    """Cancels every other task on the running loop and waits for them to end."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _copy_outcome(target: concurrent.futures.Future[Any], source: asyncio.Future[Any]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.set_exception(errors.ConnectionClosedError(_CLOSED))
        return
    exc = source.exception()
    if exc is None:
        target.set_result(source.result())
    else:
        target.set_exception(exc)


class LoopConnection:
    """A sync, thread-safe ``ConnectionLike`` over an ``AsyncConnection`` on a ``LoopThread``.

    Create it with ``runner.run(LoopConnection.open(runner, address, ...))``.
    The ``runner`` is shared, not owned: close it after its connections.
    """

    def __init__(self, runner: LoopThread, connection: AsyncConnection) -> None:
        self._runner = runner
        self._connection = connection
        self.address = connection.address

    @classmethod
    async def open(
        cls,
        runner: LoopThread,
        address: str,
        *,
        channel: grpc.aio.Channel | None = None,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Any = None,
        insecure: bool = False,
        metadata: Any = None,
        wait_for_ready: bool = True,
        tls: bool = False,
    ) -> LoopConnection:
        """Opens a stream (on ``channel`` if given, which the caller keeps owning).

        Must run on ``runner``'s loop. Raises ``ConnectTimeoutError`` if the
        server does not answer within ``timeout``; without ``wait_for_ready``,
        ``ConnectRefusedError`` at once if the port refuses.
        """
        owns = channel is None
        if channel is None:
            channel = create_channel(
                address, credentials=credentials, options=options, insecure=insecure, aio=True
            )
        connection = await open_when_ready(
            channel,
            address,
            owns_channel=owns,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
            tls=tls or credentials is not None,
        )
        return cls(runner, connection)

    @property
    def closed(self) -> bool:
        """Whether the stream is closed."""
        return self._connection.closed or self._runner.closed

    @property
    def async_connection(self) -> AsyncConnection:
        """The ``AsyncConnection`` underneath; use it only on the runner's loop."""
        return self._connection

    def _submit(
        self,
        data: bytes,
        expected: str,
        response_type: type | None,
        result: concurrent.futures.Future[Any],
    ) -> None:
        sent = self._connection._submit(data, expected, response_type)
        sent.add_done_callback(functools.partial(_copy_outcome, result))

    def _submit_bytes(
        self,
        data: bytes,
        expected: str,
        decode: Callable[[bytes], Any],
        future: concurrent.futures.Future[Any] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Sends envelope bytes; a Future (``future`` if given) of ``decode(response bytes)``,
        as ``Connection._submit_bytes`` (a step's answer walked by ``read_step``, not parsed)."""
        result: concurrent.futures.Future[Any] = future or concurrent.futures.Future()

        def submit() -> None:
            sent = self._connection._submit(data, expected, None, decode)
            sent.add_done_callback(functools.partial(_copy_outcome, result))

        try:
            self._runner.call(submit)
        except errors.ConnectionClosedError as exc:
            result.set_exception(exc)
        return result

    def send_async(
        self, request: message.Message, *, response_type: type | None = None
    ) -> concurrent.futures.Future[Any]:
        """Sends a request and returns a Future of its response, at once (see ``Connection``)."""
        data, expected = messages.envelope(request)
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            self._runner.call(self._submit, data, expected, response_type, result)
        except errors.ConnectionClosedError as exc:
            result.set_exception(exc)
        return result

    def send(
        self,
        request: message.Message,
        timeout: float | None = None,
        *,
        response_type: type | None = None,
    ) -> Any:
        """Sends a request and waits for its response (see ``Connection.send``)."""
        return wait_response(
            self.send_async(request, response_type=response_type), timeout, request
        )

    def close(self) -> None:
        """Closes the stream (idempotent); fails pending requests."""
        if self._runner.closed:
            return
        self._runner.run(self._connection.aclose(), timeout=10)

    def __enter__(self) -> LoopConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._connection._pending)} pending"
        return f"LoopConnection(address={self.address!r}, {state})"
