"""The pipelined asyncio connection, on ``grpc.aio``.

Same semantics as the sync ``Connection``: one stream, responses matched in
request order, errors per request, every pending request failed promptly when
the stream ends. Any number of tasks may ``await conn.send(...)`` at once; one
reader task serves them, and a writer task while requests wait to be written::

    import asyncio
    import dm_env_rpc_client as dmr
    from dm_env_rpc_client import dm_env_rpc_pb2

    async def main(address):
        async with await dmr.connect_async(address, timeout=10) as conn:
            world = (await conn.send(dm_env_rpc_pb2.CreateWorldRequest())).world_name
            await conn.send(dm_env_rpc_pb2.JoinWorldRequest(world_name=world))
            steps = [conn.send(dm_env_rpc_pb2.StepRequest()) for _ in range(100)]
            return await asyncio.gather(*steps)

It never calls ``asyncio.run``: it works inside a running loop (Jupyter).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import message

from . import errors, messages
from ._base.checks import check_metadata, check_seconds
from ._transport import ready as _ready
from ._transport.receivers import _Callback
from ._transport.writers import WritePool
from .connection import (
    _CLOSED,
    _IN_FLIGHT_TIMEOUT,
    _REQUEST_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    closed_error,
    create_channel,
)

_READER_CANCELLED = (
    "The connection's reader task was cancelled (its event loop is shutting down, as at the "
    "end of asyncio.run) before the connection was closed; open a new connection."
)


def _fail(future: asyncio.Future[Any] | _Callback, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _resolve(future: asyncio.Future[Any] | _Callback, result: Any) -> None:
    if not future.done():
        future.set_result(result)


class AsyncConnection:
    """A pipelined asyncio connection over one dm_env_rpc stream.

    Create it with ``await connect_async(...)``, or ``await AsyncConnection.open(channel)``
    for a ``grpc.aio`` channel you own.
    """

    __slots__ = (
        "_call",
        "_channel",
        "_close_called",
        "_closed_error",
        "_end_queued",
        "_limit",
        "_max_response_bytes",
        "_owns_channel",
        "_pending",
        "_pool",
        "_reader",
        "_reads_end",
        "_slots",
        "_writer",
        "_writes",
        "address",
    )

    def __init__(self) -> None:
        raise errors.ArgumentTypeError(
            "Use `await dmr.connect_async(address)` or `await AsyncConnection.open(channel)`."
        )

    @classmethod
    async def open(
        cls,
        channel: grpc.aio.Channel,
        metadata: Sequence[tuple[str, str]] | None = None,
        *,
        max_in_flight: int | None = None,
    ) -> AsyncConnection:
        """Opens the stream on a ``grpc.aio`` channel (which the caller keeps owning)."""
        self = object.__new__(cls)
        self._channel = channel
        self._owns_channel = False
        self.address = None
        self._pending = messages.PendingQueue(_resolve, _fail)
        self._closed_error = None
        self._close_called = False
        self._limit = max_in_flight
        self._max_response_bytes = None  # connect_async's cap, named when gRPC hides it
        self._slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        # Requests wait in a list; a writer task exists only while some wait (a parked task
        # and an asyncio.Queue per stream were about 5 KB of a world at 4,096 worlds).
        self._writes = []
        self._writer = None
        self._pool = None
        self._end_queued = False
        self._reads_end = False  # _last_requests: the reader ends once those are answered
        self._call = channel.stream_stream(messages.METHOD)(metadata=metadata)
        self._reader = asyncio.ensure_future(self._read_loop())
        return self

    _channel: grpc.aio.Channel | None
    _owns_channel: bool
    _max_response_bytes: int | None
    address: str | None
    _pending: messages.PendingQueue[asyncio.Future[Any] | _Callback]
    _closed_error: errors.ConnectionClosedError | None
    _close_called: bool
    _limit: int | None
    _slots: asyncio.Semaphore | None
    _writes: list[bytes | None]
    _end_queued: bool
    _reads_end: bool
    _call: Any
    _writer: asyncio.Future[None] | WritePool | None
    _pool: WritePool | None
    _reader: asyncio.Future[None]

    def _queue(self, data: bytes | None) -> None:
        """Queues request bytes (None: the end of writing) and starts the writer if it is idle."""
        self._writes.append(data)
        if self._writer is None:
            self._start_writer()

    def _start_writer(self) -> None:
        if self._pool is not None:  # a batch's stream: its pool's tasks write it
            self._writer = self._pool
            self._pool.ready(self)
        else:
            self._writer = asyncio.ensure_future(self._write_loop())

    def _end_writing(self) -> None:
        """Half-closes the stream after the queued requests (idempotent; on the loop)."""
        if not self._end_queued:
            self._end_queued = True
            self._queue(None)

    async def _write_loop(self) -> None:
        """Writes the queued requests, then ends (``_queue`` starts it again)."""
        try:
            await self._write_queued()
        except asyncio.CancelledError:
            pass
        finally:
            self._writer = None

    async def _write_queued(self) -> None:
        """Writes the queued requests in order (a writer task's work, or a ``WritePool``'s)."""
        try:
            while self._writes:
                writes, self._writes = self._writes, []  # those queued meanwhile wait their turn
                for data in writes:
                    if self._close_called:  # closed meanwhile: aclose lets go of the call
                        self._writes = []
                        return
                    if data is None:
                        await self._call.done_writing()
                        return
                    await self._call.write(data)
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self._writes = []
            if isinstance(exc, grpc.RpcError):
                self._shutdown(closed_error(exc, self._max_response_bytes))
            elif not self._call.done():
                self._shutdown(closed_error(None))
            # else the call has ended: the reader reads its real status and shuts down with it

    async def _read_loop(self) -> None:
        error: grpc.RpcError | None = None
        # Bound once: a batch's loop runs this once per step of every world.
        read, pending, eof, slots = self._call.read, self._pending, grpc.aio.EOF, self._slots
        oldest = pending._items.popleft  # PendingQueue.pop's, without its call
        try:
            while True:
                data = await read()
                if data is eof:
                    break
                try:
                    item = oldest()
                except IndexError:  # a response nobody asked for
                    self._shutdown(errors.ConnectionClosedError(messages.UNEXPECTED_RESPONSE))
                    self._call.cancel()
                    return
                if isinstance(item, _Callback):
                    item.answer(data)
                else:
                    pending.complete(item, data)
                if slots is not None:
                    slots.release()
                if not pending._items and self._reads_end:  # see _last_requests
                    if self._closed_error is None:
                        self._closed_error = errors.ConnectionClosedError(_CLOSED)
                    return
        except grpc.RpcError as exc:
            error = exc
        except asyncio.CancelledError:
            if not self._close_called:  # not by aclose(): by the end of the loop
                await self._close_as_the_loop_ends()
            return
        self._shutdown(closed_error(error, self._max_response_bytes))

    async def _close_as_the_loop_ends(self) -> None:
        """What ``aclose`` does, when the loop cancels the reader (``asyncio.run`` returning
        with this connection open): fail the pending requests (else what awaits them, as a
        ``step_iter``'s clean-up, waits forever), then end the call and the channel while the
        loop still runs. gRPC completes the operations of a call left open later, on a closed
        loop, and prints "Event loop is closed" from whichever loop runs next."""
        self._close_called = True
        self._end_queued = True  # the call is cancelled: no end of writing to send
        self._shutdown(errors.ConnectionClosedError(_READER_CANCELLED))
        self._call.cancel()
        if self._owns_channel and self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
        self._call = None
        self._channel = None

    def _shutdown(self, exc: errors.ConnectionClosedError) -> None:
        if self._closed_error is None:
            self._closed_error = exc
        self._pending.fail_all(self._closed_error)
        self._end_writing()
        if self._slots is not None:
            for _ in range(self._limit or 0):  # wake senders waiting for room
                self._slots.release()

    @property
    def closed(self) -> bool:
        """Whether the connection is closed."""
        return self._closed_error is not None

    async def send(
        self,
        request: message.Message,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        response_type: type | None = None,
    ) -> Any:
        """Sends a request and awaits its response (see ``Connection.send``).

        ``timeout`` defaults to ``DEFAULT_TIMEOUT`` (60 s); None waits until the
        response or the stream's end.

        Raises:
          DmEnvRpcError: the server answered with an error.
          RequestTimeoutError: no response within ``timeout``.
          ConnectionClosedError: the stream ended or was closed.
          ProtocolError: the server broke the protocol.
        """
        check_seconds(timeout)
        return await self._send(request, timeout, response_type, None)

    async def _send(
        self,
        request: message.Message,
        timeout: float | None,
        response_type: type | None,
        decode: Callable[[bytes], Any] | None,
    ) -> Any:
        """``send``; with ``decode``, the response is made by it (see ``_submit``)."""
        data, expected = messages.envelope(request)
        return await self._send_bytes(
            data, expected, type(request).__name__, timeout, response_type, decode
        )

    async def _send_bytes(
        self,
        data: bytes,
        expected: str,
        name: str,
        timeout: float | None,
        response_type: type | None,
        decode: Callable[[bytes], Any] | None,
    ) -> Any:
        """``_send`` for a request already serialized (``data``, as ``messages.envelope`` makes
        it; ``expected``: its response's payload field; ``name``: its type's, for a timeout)."""
        if self._closed_error is not None:
            raise self._closed_error
        if self._slots is not None:
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout)
            except asyncio.TimeoutError:
                raise errors.RequestTimeoutError(
                    _IN_FLIGHT_TIMEOUT.format(timeout=timeout, limit=self._limit)
                ) from None
        if self._closed_error is not None:
            raise self._closed_error
        future = self._submit(data, expected, response_type, decode)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            if future.done():  # the request's own error, a TimeoutError subclass: keep it
                raise
            raise errors.RequestTimeoutError(
                _REQUEST_TIMEOUT.format(expected=name, timeout=timeout)
            ) from None

    def _submit(
        self,
        data: bytes,
        expected: str,
        response_type: type | None = None,
        decode: Callable[[bytes], Any] | None = None,
    ) -> asyncio.Future[Any]:
        """Queues envelope bytes (from ``messages.envelope``) without waiting; on the loop.

        No backpressure: the caller bounds what it has in flight. Returns the
        response future, failed at once if the connection is closed. ``decode``
        makes the result from the response bytes in place of the usual parsing
        (as ``Connection._submit_bytes``; the steppers pass ``read_step``).
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_consume)  # an abandoned (timed-out) request logs nothing
        if self._closed_error is not None:
            future.set_exception(self._closed_error)
            return future
        self._pending.push(future, expected, response_type, decode)
        self._queue(data)
        return future

    def _submit_callback(
        self,
        data: bytes,
        decode: Callable[[bytes], Any] | None,
        callback: Callable[[Any, BaseException | None], None] | _Callback,
    ) -> None:
        """Queues envelope bytes; ``callback(result, error)`` takes the response; on the loop.

        As ``_submit`` with ``decode``, without a Future: the reader calls
        ``callback`` as it reads the response (with the result of
        ``decode(data)``, or the error), or as the connection ends (with the
        error). If the connection is closed already, it is called with the error
        on the loop's next turn, never from within this call. ``callback`` may be
        a ``_Callback`` itself (used as it is); ``decode`` may be None for one
        whose ``answer`` reads the response's bytes itself.
        """
        receiver = callback if isinstance(callback, _Callback) else _Callback(callback)
        if self._closed_error is not None:
            asyncio.get_running_loop().call_soon(receiver._call, None, self._closed_error)
            return
        receiver.decode = decode
        self._pending.push_item(receiver)
        self._writes.append(data)  # _queue's, inline: a batch's loop does this once a step
        if self._writer is None:
            self._start_writer()

    def _submit_receiver(self, data: bytes, receiver: _Callback) -> None:
        """``_submit_callback`` for a receiver whose ``answer`` reads the response's bytes
        itself (a batch's step): queued with no check of its kind and no ``decode``."""
        if self._closed_error is not None:
            asyncio.get_running_loop().call_soon(receiver._call, None, self._closed_error)
            return
        self._pending._items.append(receiver)
        self._writes.append(data)
        if self._writer is None:
            self._start_writer()

    def _last_requests(self) -> None:
        """No request follows those queued (a closing batch's leave and destroy, on the loop):
        the reader ends as it has read their answers, and the stream counts as closed.

        It ends quietly, with no read left waiting: cancelling the call then fails no read
        (a waiting read fails as the call is cancelled, and cancelling the reader's task
        throws into it: about a tenth of closing 4,096 worlds; issue 38). ``aclose`` (or
        ``_abort``) still cancels the call, and the reader of a stream whose answers never
        come."""
        self._reads_end = True

    async def aclose(self) -> None:
        """Closes the stream and fails pending requests (idempotent)."""
        tasks = self._abort()
        if not tasks:
            return
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_channel and self._channel is not None:
            await self._channel.close()
        # Let go of gRPC's objects: the core tears the TCP connection down only when they
        # are freed (until then a server shutting down would still find this client there).
        self._call = None
        self._channel = None

    def _abort(self) -> list[asyncio.Future[None]]:
        """``aclose`` up to the wait: fails pending requests, cancels the call and the tasks.

        Returns the tasks to await (none if closing was begun before): ``aclose``
        awaits them, a batch closing all its streams awaits all of theirs at once.
        """
        if self._close_called:
            return []
        self._close_called = True
        self._end_queued = True  # the call is cancelled: no end of writing to send
        self._shutdown(errors.ConnectionClosedError(_CLOSED))
        self._call.cancel()
        # A pool's writer ends on its own: the cancelled call fails its write, if any.
        writer = self._writer
        tasks = [writer, self._reader] if isinstance(writer, asyncio.Future) else [self._reader]
        for task in tasks:
            task.cancel()
        return tasks

    async def __aenter__(self) -> AsyncConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._pending)} pending"
        return f"AsyncConnection(address={self.address!r}, {state})"


async def connect_async(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    metadata: Sequence[tuple[str, str]] | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    insecure: bool = False,
    max_in_flight: int | None = None,
    wait_for_ready: bool = False,
    max_response_bytes: int | None = None,
) -> AsyncConnection:
    """Connects to a dm_env_rpc server with asyncio (arguments as for ``connect``).

    A port that refuses fails at once unless ``wait_for_ready=True``, as for ``connect``.

    Args:
      address: ``host:port`` or ``unix:path``.
      credentials: channel credentials for TLS (loopback and unix: local credentials).
      timeout: seconds to wait for the server (default 30 s); None waits indefinitely.
      metadata: gRPC metadata for the stream (``dmr.token_metadata(token)``).
      options: extra gRPC channel options (override the defaults).
      insecure: allow plaintext to a remote host.
      max_in_flight: bound on pending requests.
      wait_for_ready: retry a refused port until ``timeout``.
      max_response_bytes: the largest answer taken, in bytes (None: any size,
        the default). A larger one ends the stream: its request and every
        pending one fail with ``ResponseTooLargeError`` (or, when a request
        was being written as gRPC cut the stream, ``grpc.aio``'s INTERNAL: a
        ``ConnectionClosedError`` whose message names the cap).

    Returns:
      An AsyncConnection that owns its channel.

    Raises:
      ArgumentError: an address of the wrong shape, a bad timeout, or a
        ``max_response_bytes`` that is not a whole number of at least 1.
      ConnectRefusedError: nothing listens at the address (without ``wait_for_ready``).
      ConnectTimeoutError: the server did not answer within ``timeout``.
      AuthenticationError: the TLS handshake failed (see ``connect``).
      DmEnvRpcConnectionError: plaintext to a remote host without ``insecure=True``.
    """
    check_seconds(timeout)
    channel = create_channel(
        address,
        credentials=credentials,
        options=options,
        insecure=insecure,
        aio=True,
        max_response_bytes=max_response_bytes,
    )
    connection = await open_when_ready(
        channel,
        address,
        owns_channel=True,
        timeout=timeout,
        metadata=metadata,
        max_in_flight=max_in_flight,
        wait_for_ready=wait_for_ready,
        tls=credentials is not None,
    )
    connection._max_response_bytes = max_response_bytes
    return connection


async def open_when_ready(
    channel: grpc.aio.Channel,
    address: str,
    *,
    owns_channel: bool,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    max_in_flight: int | None = None,
    wait_for_ready: bool = True,
    tls: bool = False,
) -> AsyncConnection:
    """Waits until ``channel`` is ready, then opens a stream on it.

    ``tls``: the channel has TLS credentials (a server that hangs up in the handshake
    then fails at once, ``AuthenticationError``).

    With ``owns_channel`` the connection closes the channel when it closes (and
    a timeout closes it at once). Without ``wait_for_ready``, a port that
    refuses fails at once (any other failure of the first attempt waits).

    Raises:
      ConnectRefusedError: the port refuses (without ``wait_for_ready``).
      ConnectTimeoutError: the server did not answer within ``timeout``.
    """
    check_metadata(metadata)
    verdict = await _ready.wait_ready_async(channel, timeout, wait_for_ready, tls)
    if verdict is not None:
        error = await _ready.connect_error_async(verdict, address, timeout, channel)
        if owns_channel:
            await channel.close()
        raise error
    connection = await AsyncConnection.open(channel, metadata, max_in_flight=max_in_flight)
    connection._owns_channel = owns_channel
    connection.address = address
    return connection
