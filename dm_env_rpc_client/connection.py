"""The pipelined, thread-safe connection to a dm_env_rpc server.

One ``Connection`` is one gRPC bidirectional stream. ``send_async`` writes a
request and returns a ``concurrent.futures.Future`` at once; a reader thread
matches each response to the oldest pending request, so many requests can be
in flight::

    import dm_env_rpc_client as dmr
    from dm_env_rpc_client import dm_env_rpc_pb2

    with dmr.connect("127.0.0.1:50051", timeout=10) as conn:
        futures = [conn.send_async(dm_env_rpc_pb2.StepRequest()) for _ in range(8)]
        responses = [future.result(timeout=10) for future in futures]

A server error fails only its own request (``DmEnvRpcError``). When the stream
ends or breaks, every pending and later request fails promptly with
``ConnectionClosedError`` carrying the gRPC status. ``close()`` is idempotent.
A server that requires a token (``dmr.serve(..., token=)``) takes it as metadata,
``dmr.connect(address, metadata=dmr.token_metadata(token))``; without it, or with a
wrong one, the first request fails with ``AuthenticationError``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf import message

from . import errors, messages
from ._base import checks as _checks
from ._base.tokens import TOKEN_ENV as TOKEN_ENV
from ._base.tokens import token_metadata as token_metadata
from ._proto import dm_env_rpc_pb2
from ._transport import ready as _ready
from ._transport.channel import DEFAULT_OPTIONS as DEFAULT_OPTIONS
from ._transport.channel import FAST_KEEPALIVE_DETECTION_S as FAST_KEEPALIVE_DETECTION_S
from ._transport.channel import FAST_KEEPALIVE_OPTIONS as FAST_KEEPALIVE_OPTIONS
from ._transport.channel import KEEPALIVE_DETECTION_S as KEEPALIVE_DETECTION_S
from ._transport.channel import create_channel as create_channel
from ._transport.channel import is_local as is_local

Metadata = Sequence[tuple[str, str]]  # gRPC metadata, as the reference names it


DEFAULT_CONNECT_TIMEOUT = 30.0  # seconds connect() waits for a server by default
DEFAULT_TIMEOUT = 60.0  # seconds a request waits for its response unless told otherwise

_CLOSED = "The connection is closed; open a new one with dmr.connect()."
_STREAM_ENDED = "The server ended the stream ({code}: {details}){advice}"
_REOPEN = "; open a new connection."
_UNAUTHENTICATED = "The server refused this client (UNAUTHENTICATED: {details}){advice}"
# For servers whose message does not say it (the SDK's own does).
_PASS_TOKEN = (
    " Pass the server's token: metadata=dmr.token_metadata(token) in Python, or "
    "--token-file FILE or the DMR_TOKEN environment variable on the command line."
)
_TOO_LARGE = (
    "The server's answer is larger than this connection takes ({details}: max_response_bytes, "
    "or the channel option grpc.max_receive_message_length), so gRPC ended the stream. Raise "
    "max_response_bytes (None takes any size), or ask for less (requested_observations=)."
)
_CORE_ERROR = "Internal error from Core"  # grpc.aio's details for a write to a cut call
_MAYBE_TOO_LARGE = (
    " This connection takes answers of at most {cap:,} bytes (max_response_bytes), and gRPC "
    "says only this when it cut the stream for a larger answer while a request was being "
    "written: raise max_response_bytes (None takes any size), or ask for less."
)
_CHANNEL_NOT_ADDRESS = (
    "Connection(channel) wraps a grpc.Channel you opened, not the address {address!r}: "
    "to connect to an address, use dmr.connect({address!r})."
)
_REQUEST_TIMEOUT = "No response to the {expected} request within {timeout} s."
_IN_FLIGHT_TIMEOUT = (
    "Timed out after {timeout} s waiting for room among {limit} requests in flight."
)
_END = object()
_OPEN: weakref.WeakSet[Connection] = weakref.WeakSet()  # open connections, closed at exit


class ConnectionLike(Protocol):
    """What the environment adaptor needs of a connection."""

    def send(self, request: message.Message, timeout: float | None = None) -> Any: ...

    def send_async(self, request: message.Message) -> concurrent.futures.Future[Any]: ...

    def close(self) -> None: ...


ConnectionType = ConnectionLike  # the reference's name for it, for annotations


def closed_error(exc: grpc.RpcError | None, cap: int | None = None) -> errors.ConnectionClosedError:
    """The ConnectionClosedError for a stream that ended (exc None: ended cleanly); ``cap``, a
    connection's max_response_bytes, is named when grpc.aio hides a cut for it as INTERNAL."""
    if exc is None:
        return errors.ConnectionClosedError(
            _STREAM_ENDED.format(code="OK", details="the server closed the stream", advice=_REOPEN),
            grpc.StatusCode.OK,
            None,
        )
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        advice = "" if "token_metadata" in str(details) else _PASS_TOKEN
        message = _UNAUTHENTICATED.format(details=details, advice=advice)
        return errors.AuthenticationError(message, code, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in str(details):
        return errors.ResponseTooLargeError(_TOO_LARGE.format(details=details), code, details)
    if cap is not None and code == grpc.StatusCode.INTERNAL and details == _CORE_ERROR:
        advice = _REOPEN + _MAYBE_TOO_LARGE.format(cap=cap)
    else:  # RESOURCE_EXHAUSTED: a new connection would be refused too, as the details say
        advice = "." if code == grpc.StatusCode.RESOURCE_EXHAUSTED else _REOPEN
    return errors.ConnectionClosedError(
        _STREAM_ENDED.format(code=name, details=details, advice=advice),
        code,
        details,
    )


def wait_response(
    future: concurrent.futures.Future[Any], timeout: float | None, request: message.Message | str
) -> Any:
    """The result of a sent request's future; a timeout raises RequestTimeoutError naming it.

    ``request``: the request, or its type's name (for a request sent as bytes).
    """
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        if future.done():  # the request's own error, a TimeoutError subclass: keep it
            raise
        raise request_timeout(request, timeout) from None


def request_timeout(
    request: message.Message | str, timeout: float | None
) -> errors.RequestTimeoutError:
    """The error for ``request`` (or a request of the type so named) getting no response
    within ``timeout`` seconds."""
    name = request if isinstance(request, str) else type(request).__name__
    return errors.RequestTimeoutError(_REQUEST_TIMEOUT.format(expected=name, timeout=timeout))


def _fail(future: concurrent.futures.Future[Any], exc: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # done or cancelled
        future.set_exception(exc)


def _resolve(future: concurrent.futures.Future[Any], result: Any) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by its owner
        future.set_result(result)


class Connection:
    """A pipelined connection over one dm_env_rpc stream. Thread-safe.

    Args:
      channel: an open ``grpc.Channel``; the caller keeps ownership.
      metadata: gRPC metadata for the stream.
      max_in_flight: if set, ``send_async`` blocks while this many requests are
        pending (backpressure).

    A connection still open when the interpreter exits is closed then.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        metadata: Metadata | None = None,
        *,
        max_in_flight: int | None = None,
    ) -> None:
        if isinstance(channel, str):
            raise errors.ArgumentTypeError(_CHANNEL_NOT_ADDRESS.format(address=channel))
        if max_in_flight is not None:
            _checks.check_count(max_in_flight, "max_in_flight")
        self._channel = channel
        self._owns_channel = False
        self.address: str | None = None
        self._lock = threading.Lock()
        self._pending: messages.PendingQueue[concurrent.futures.Future[Any]] = (
            messages.PendingQueue(_resolve, _fail)
        )
        self._closed_error: errors.ConnectionClosedError | None = None
        self._close_called = False
        self._destroyed: set[str] = set()  # worlds an adaptor's close() destroyed
        self._limit = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight) if max_in_flight else None
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        stream = channel.stream_stream(messages.METHOD)
        call = stream(self._request_iterator(), metadata=metadata)
        self._call: Any = call  # None once closed (see close())
        self._reader = threading.Thread(
            target=self._read, args=(call,), name="dm_env_rpc_client-reader", daemon=True
        )
        self._reader.start()
        _OPEN.add(self)

    def _request_iterator(self) -> Iterator[bytes]:
        get = self._requests.get
        while True:
            data = get()
            if data is _END:
                return
            yield data

    def _read(self, call: Any) -> None:
        pending, lock, slots = self._pending, self._lock, self._slots
        try:
            for data in call:
                with lock:
                    item = pending.pop()
                pending.complete(item, data)
                if slots is not None:
                    slots.release()
        except grpc.RpcError as exc:
            # The call is the exception: keeping it (or its traceback, which holds this
            # frame and so the connection) would make a reference cycle of the call.
            closed = closed_error(exc)
            exc.__traceback__ = None
        except errors.ProtocolError as exc:
            self._shutdown(errors.ConnectionClosedError(str(exc)))
            call.cancel()
            return
        else:
            closed = closed_error(None)
        self._shutdown(closed)

    def _shutdown(self, exc: errors.ConnectionClosedError) -> None:
        with self._lock:
            if self._closed_error is None:
                self._closed_error = exc
            self._pending.fail_all(self._closed_error)
        self._requests.put(_END)
        if self._slots is not None:
            # Wake senders blocked on backpressure; they will see the closed state.
            for _ in range(self._limit or 0):
                try:
                    self._slots.release()
                except ValueError:
                    break

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (by ``close()`` or because the stream ended)."""
        return self._closed_error is not None

    def send_async(
        self,
        request: message.Message,
        *,
        response_type: type | None = None,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Sends a request and returns a Future of its response, at once.

        Args:
          request: a dm_env_rpc request (e.g. ``StepRequest``), an
            ``EnvironmentRequest``, or another message to send as an extension.
          response_type: for extensions, the message class to unpack the
            response into (otherwise the response is a ``google.protobuf.Any``).
          timeout: with ``max_in_flight``, how long to wait for room.

        Returns:
          A Future of the response payload (e.g. a ``StepResponse``). It fails
          with ``DmEnvRpcError`` for a server error, ``ProtocolError`` for a
          mismatched response, ``ConnectionClosedError`` when the stream ends.
        """
        if timeout is not None:
            _checks.check_seconds(timeout)
        if self._destroyed:
            done = self._answer_destroyed(request)
            if done is not None:
                return done
        data, expected = messages.envelope(request)
        return self._queue(data, expected, response_type, timeout, None, None)

    def _destroyed_on_close(self, world_name: str) -> None:
        """Notes that an adaptor's ``close()`` destroyed ``world_name`` over this connection.

        Code written for the reference package, whose adaptor never destroys its
        world, destroys it itself after ``env.close()``: that one
        DestroyWorldRequest is answered here, as done, instead of with the
        server's NOT_FOUND. A CreateWorldRequest forgets the notes (the server
        may give the name again).
        """
        with self._lock:
            self._destroyed.add(world_name)

    def _answer_destroyed(self, request: message.Message) -> concurrent.futures.Future[Any] | None:
        """The finished Future of a DestroyWorldRequest for a world ``close()`` destroyed."""
        kind = type(request)
        with self._lock:
            if kind is dm_env_rpc_pb2.CreateWorldRequest:
                self._destroyed.clear()
            elif kind is dm_env_rpc_pb2.DestroyWorldRequest and (
                request.world_name in self._destroyed  # type: ignore[attr-defined]
            ):
                self._destroyed.discard(request.world_name)  # type: ignore[attr-defined]
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                future.set_result(dm_env_rpc_pb2.DestroyWorldResponse())
                return future
        return None

    def _submit_bytes(
        self,
        data: bytes,
        expected: str,
        decode: Callable[[bytes], Any],
        future: concurrent.futures.Future[Any] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """``send_async`` for a request already serialized, its result made by ``decode``.

        ``data`` is the request as ``messages.envelope`` makes it, ``expected`` the
        payload field of its response. ``decode(response bytes)`` runs on the
        reader thread, in response order, in place of the usual parsing (see
        ``messages.PendingQueue.push``): the adaptor sends its steps this way
        (``AdaptorCore._step_data``) and reads their responses, with one Future
        per step (``future``, if given: the adaptor's own kind).
        """
        return self._queue(data, expected, None, None, decode, future)

    def _queue(
        self,
        data: bytes,
        expected: str,
        response_type: type | None,
        timeout: float | None,
        decode: Callable[[bytes], Any] | None,
        future: concurrent.futures.Future[Any] | None,
    ) -> concurrent.futures.Future[Any]:
        """Queues a serialized request: waits for room (``max_in_flight``), then files its
        Future and writes it, or fails the Future at once if the connection is closed."""
        if future is None:
            future = concurrent.futures.Future()
        slots = self._slots
        if slots is not None:
            if self._closed_error is not None:  # closed: fail at once, not wait for room
                future.set_exception(self._closed_error)
                return future
            if not slots.acquire(timeout=timeout):
                raise errors.RequestTimeoutError(
                    _IN_FLIGHT_TIMEOUT.format(timeout=timeout, limit=self._limit)
                )
        with self._lock:
            if self._closed_error is not None:
                if slots is not None:
                    # The room goes back: no response will free it, and a later request
                    # that found none left would wait for ever.
                    with contextlib.suppress(ValueError):  # already full
                        slots.release()
                future.set_exception(self._closed_error)
                return future
            self._pending.push(future, expected, response_type, decode)
            self._requests.put(data)
        return future

    def send(
        self,
        request: message.Message,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        response_type: type | None = None,
    ) -> Any:
        """Sends a request and waits for its response.

        Args:
          request: as for ``send_async``.
          timeout: seconds to wait (default ``DEFAULT_TIMEOUT``, 60 s); None waits
            until the response or the stream's end (a stopped or unreachable
            server ends it within ``KEEPALIVE_DETECTION_S``, 350 s).
          response_type: as for ``send_async``.

        Returns:
          The response payload.

        Raises:
          DmEnvRpcError: the server answered with an error.
          RequestTimeoutError: no response within ``timeout``.
          ConnectionClosedError: the stream ended or was closed.
          ProtocolError: the server broke the protocol.
        """
        _checks.check_seconds(timeout)
        future = self.send_async(request, response_type=response_type, timeout=timeout)
        return wait_response(future, timeout, request)

    def close(self) -> None:
        """Closes the stream: half-closes it, fails pending requests, closes an owned channel.

        Idempotent; never blocks for long.
        """
        with self._lock:
            if self._close_called:
                return
            self._close_called = True
        self._shutdown(errors.ConnectionClosedError(_CLOSED))
        call, self._call = self._call, None
        call.cancel()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
        # The call is dropped here, so that gRPC's finalizer of it (which takes the call's
        # lock) runs now, while gRPC's threads run. Left to the interpreter's exit, it can
        # wait for ever on a lock that a daemon gRPC thread held when the exit stopped it.
        del call
        if self._owns_channel:
            self._channel.close()
            self._owns_channel = False
        _OPEN.discard(self)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._pending)} pending"
        return f"Connection(address={self.address!r}, {state})"


@atexit.register
def _close_open_connections() -> None:
    """Closes the connections still open when the interpreter exits, while gRPC's threads
    still run (see ``Connection.close``)."""
    for connection in list(_OPEN):
        connection.close()


@_checks.keywords_checked
def connect(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    metadata: Metadata | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    insecure: bool = False,
    max_in_flight: int | None = None,
    wait_for_ready: bool = False,
    max_response_bytes: int | None = None,
) -> Connection:
    """Connects to a dm_env_rpc server.

    A port that refuses connections fails at once (``ConnectRefusedError``),
    as a person at a notebook expects. To wait for a server that is still
    starting (a container, a process just launched), pass
    ``wait_for_ready=True``: connect then retries with backoff until the server
    answers or ``timeout`` passes. A host that does not answer at all is waited
    for up to ``timeout`` either way.

    Args:
      address: ``host:port`` or ``unix:path``.
      credentials: channel credentials for TLS. Loopback and unix addresses use
        local credentials by default.
      timeout: seconds to wait for the server (default ``DEFAULT_CONNECT_TIMEOUT``,
        30 s); None waits indefinitely.
      metadata: gRPC metadata for the stream; ``dmr.token_metadata(token)`` carries
        the token of a server that requires one.
      options: extra gRPC channel options (override the defaults).
      insecure: allow plaintext to a remote host.
      max_in_flight: bound on pending requests (see ``Connection``).
      wait_for_ready: retry a refused port until ``timeout`` (gRPC's term):
        for a server that is still starting.
      max_response_bytes: the largest answer taken, in bytes (None: any size,
        the default). A larger one ends the stream: its request and every
        pending one fail with ``ResponseTooLargeError``.

    Returns:
      A Connection that owns its channel.

    Raises:
      ArgumentError: an address of the wrong shape (no port, a URL scheme, ...),
        or a timeout that is not a number of seconds above 0.
      ConnectRefusedError: nothing listens at the address (without ``wait_for_ready``).
      ConnectTimeoutError: the server did not answer within ``timeout``.
      AuthenticationError: the TLS handshake failed: the server's certificate is not
        trusted, or the server wants a client certificate it trusts (mutual TLS). A
        missing or wrong token shows on the first request instead (the same error).
      DmEnvRpcConnectionError: plaintext to a remote host without ``insecure=True``.
    """
    _checks.check_seconds(timeout)
    _checks.check_metadata(metadata)
    if max_in_flight is not None:
        _checks.check_count(max_in_flight, "max_in_flight")
    channel = create_channel(
        address,
        credentials=credentials,
        options=options,
        insecure=insecure,
        max_response_bytes=max_response_bytes,
    )
    verdict = _ready.wait_ready(channel, timeout, wait_for_ready, tls=credentials is not None)
    if verdict is not None:
        error = _ready.connect_error(verdict, address, timeout, channel)
        channel.close()
        raise error
    connection = Connection(channel, metadata, max_in_flight=max_in_flight)
    connection._owns_channel = True
    connection.address = address
    return connection


def create_secure_channel_and_connect(
    server_address: str,
    credentials: grpc.ChannelCredentials | None = None,
    timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    metadata: Metadata | None = None,
) -> Connection:
    """Connects as the reference package's function of this name does (its arguments, in order).

    The same as ``dmr.connect(server_address, credentials=..., timeout=..., metadata=...,
    wait_for_ready=True)``: like the reference's, it waits for a server that is not up yet.
    Two differences from the reference: ``credentials`` None means the SDK's
    defaults (local credentials for loopback, ``0.0.0.0``/``[::]`` (this host) and
    ``unix:`` addresses, as the reference's default; a remote host needs
    credentials), and ``timeout`` defaults to
    ``DEFAULT_CONNECT_TIMEOUT`` (30 s) instead of waiting forever.

    Args:
      server_address: ``host:port`` or ``unix:path``.
      credentials: channel credentials, e.g. ``grpc.ssl_channel_credentials()``.
      timeout: seconds to wait for the server; None waits indefinitely.
      metadata: gRPC metadata for the stream.

    Returns:
      A ``Connection`` that owns its channel.

    Raises:
      ConnectTimeoutError: the server did not answer within ``timeout``.
    """
    return connect(
        server_address,
        credentials=credentials,
        timeout=timeout,
        metadata=metadata,
        wait_for_ready=True,
    )
