"""What stands where a connection goes: the SDK's, the reference package's, or a mistake.

Also the reference's ``create_secure_channel_and_connect``, under its name.

The world helpers and ``DmEnvAdaptor`` take a ``Connection``; ``as_connection``
also lets through any object with the reference ``dm-env-rpc`` package's shape
(a blocking ``send(request)`` returning the inner response), wrapped as a
``ForeignConnection``, and refuses anything else with an error that says what
to pass (an ``AsyncConnection``, an un-awaited coroutine, ...).

A ``ForeignConnection`` sends one request at a time: ``send_async`` blocks
until the answer, and the wrapped ``send`` takes no timeout, so the SDK's
timeouts do not apply to it. The reference's errors become this SDK's
(``DmEnvRpcError`` with its subclasses by code, ``ConnectionClosedError`` for a
broken stream).
"""

from __future__ import annotations

import concurrent.futures
import inspect
from typing import Any

import grpc
from google.protobuf import message

from dm_env_rpc_client import errors
from dm_env_rpc_client.connection import (
    DEFAULT_CONNECT_TIMEOUT,
    Connection,
    ConnectionLike,
    connect,
)

_NOT_A_CONNECTION = (
    "{caller} takes a connection: dmr.connect(address), or an object with the reference "
    "package's send(request) method{address}; got {type_name}.{hint}"
)
_AWAITABLE_HINT = (
    " It is a coroutine or another awaitable (a missing `await`?). For asyncio use "
    "`env, name = await dmr.create_and_join_world_async(address_or_async_connection, ...)`."
)
_ASYNC_HINT = (
    " An AsyncConnection needs the asyncio environment: "
    "`env, name = await dmr.create_and_join_world_async(conn, ...)`; or connect with "
    "dmr.connect(address) for this sync one."
)
_STREAM_BROKE = "The wrapped connection's stream broke ({code}: {details})."


class _Status:
    """The fields of a ``google.rpc.Status`` that ``DmEnvRpcError.from_status`` reads."""

    def __init__(self, code: int, message: str, details: Any) -> None:
        self.code = code
        self.message = message
        self.details = list(details or ())


def _is_reference_error(exc: BaseException) -> bool:
    return (
        not isinstance(exc, errors.DmEnvRpcClientError)
        and type(exc).__name__ == "DmEnvRpcError"
        and all(hasattr(exc, name) for name in ("code", "message", "details"))
    )


class ForeignConnection:
    """A connection with only a blocking ``send(request)`` (the reference's), as the SDK's.

    Args:
      connection: e.g. a ``dm_env_rpc.v1.connection.Connection``.

    Attributes:
      wrapped: the connection given.
      address: its ``address`` attribute, if it has one.
    """

    def __init__(self, connection: Any) -> None:
        if not callable(getattr(connection, "send", None)):
            as_connection(connection, "ForeignConnection")  # raises, saying what to pass
        self.wrapped = connection
        self.address = getattr(connection, "address", None)

    def send(self, request: message.Message, timeout: float | None = None) -> Any:
        """Sends a request and waits for its response (``timeout`` cannot apply here).

        Raises:
          DmEnvRpcError: the server answered with an error (the SDK's class by code).
          ConnectionClosedError: the stream broke.
        """
        del timeout  # the wrapped send() takes none
        try:
            return self.wrapped.send(request)
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            raise errors.ConnectionClosedError(
                _STREAM_BROKE.format(code=getattr(code, "name", code), details=details),
                code=code,
                details=details,
            ) from exc
        except Exception as exc:
            if not _is_reference_error(exc):
                raise
            status = _Status(int(exc.code), str(exc.message), exc.details)  # type: ignore[attr-defined]
            raise errors.DmEnvRpcError.from_status(status) from exc

    def send_async(self, request: message.Message) -> concurrent.futures.Future[Any]:
        """Sends a request, waits for its response, and returns it as a finished Future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(self.send(request))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def close(self) -> None:
        """Closes the wrapped connection."""
        self.wrapped.close()

    def __repr__(self) -> str:
        return f"ForeignConnection({self.wrapped!r})"


def as_connection(connection: Any, caller: str, *, takes_address: bool = False) -> ConnectionLike:
    """The SDK connection for what was passed where a connection goes.

    Args:
      connection: a ``Connection``, ``LoopConnection`` or anything with both
        ``send`` and ``send_async``; or an object with only ``send(request)``.
      caller: the function's name, for the error message.
      takes_address: whether the caller also takes an address string (said in the message).

    Returns:
      ``connection`` itself, or a ``ForeignConnection`` around it.

    Raises:
      ArgumentTypeError: for anything else, saying what to pass.
    """
    send = getattr(connection, "send", None)
    if inspect.isawaitable(connection):
        hint = _AWAITABLE_HINT
        if inspect.iscoroutine(connection):
            connection.close()  # it can never run now: spare the "never awaited" warning
    elif inspect.iscoroutinefunction(send):
        hint = _ASYNC_HINT
    elif callable(send):
        if callable(getattr(connection, "send_async", None)):
            return connection  # type: ignore[no-any-return]
        return ForeignConnection(connection)
    else:
        hint = ""
    raise errors.ArgumentTypeError(
        _NOT_A_CONNECTION.format(
            caller=caller,
            address=", or an address string 'host:port'" if takes_address else "",
            type_name=type(connection).__name__,
            hint=hint,
        )
    )


def create_secure_channel_and_connect(
    server_address: str,
    credentials: grpc.ChannelCredentials | None = None,
    timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    metadata: Any = None,
) -> Connection:
    """Connects as the reference package's function of this name does (its arguments, in order).

    The same as ``dmr.connect(server_address, credentials=..., timeout=..., metadata=...,
    wait_for_ready=True)``: like the reference's, it waits for a server that is not up yet.
    Two differences from the reference: ``credentials`` None means the SDK's
    defaults (local credentials for loopback and ``unix:`` addresses; a remote
    host needs credentials), and ``timeout`` defaults to
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
