"""What stands where a connection goes: the SDK's, the reference package's, or a mistake.

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

``compatible`` is what every request of the adaptor, the world helpers and the
properties extension goes through: an SDK connection whose ``send`` and
``send_async`` are its class's own is used as it is (pipelined, with the SDK's
timeouts, steps as bytes); anything else, such as a ``Connection`` whose
``send`` was replaced on the instance (``connection.send = lambda request:
...``, as the Unity-task loaders do), a subclass that overrides ``send``, or a
``MagicMock``, is driven through its ``send(request)`` alone, so that it sees
every request, with the one argument the reference passes.
"""

from __future__ import annotations

import concurrent.futures
import inspect
from typing import Any

import grpc
from google.protobuf import any_pb2, message

from .. import errors, messages
from ..connection import Connection, ConnectionLike

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


_SDK_CLASSES: set[type] = set()  # classes whose send and send_async are the SDK's own


def _defined_here(cls: type, name: str) -> bool:
    module = getattr(getattr(cls, name, None), "__module__", None) or ""
    return module.startswith("dm_env_rpc_client.")


def is_sdk_class(cls: type) -> bool:
    """Whether ``cls``'s ``send`` and ``send_async`` are the SDK's own (not a subclass's)."""
    if cls in _SDK_CLASSES:
        return True
    if _defined_here(cls, "send") and _defined_here(cls, "send_async"):
        _SDK_CLASSES.add(cls)  # only the few SDK classes: never a mock's class of its own
        return True
    return False


def is_sdk_connection(connection: Any) -> bool:
    """Whether ``connection`` is an SDK connection with its class's ``send`` and ``send_async``.

    False for a connection whose ``send`` or ``send_async`` was replaced on the
    instance, for a subclass that overrides them, and for anything not the SDK's.
    """
    if not is_sdk_class(type(connection)):
        return False
    own = getattr(connection, "__dict__", None)
    return not own or ("send" not in own and "send_async" not in own)


def compatible(connection: Any) -> ConnectionLike:
    """``connection`` if ``is_sdk_connection``, else a ``ForeignConnection`` around it."""
    if is_sdk_connection(connection):
        return connection  # type: ignore[no-any-return]
    return ForeignConnection(connection)


def note_destroyed(connection: Any, world_name: str) -> None:
    """Tells an SDK ``Connection`` that an adaptor's ``close`` destroyed ``world_name``.

    The reference's adaptor never destroys its world, so code written for it
    sends its own DestroyWorldRequest after ``env.close()``; the connection
    answers that one request itself (``Connection._destroyed_on_close``).
    """
    if issubclass(type(connection), Connection):  # a mock's class is none, even with spec=
        connection._destroyed_on_close(world_name)


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

    Every request goes to ``connection.send(request)``, looked up at each call, with
    that one argument: a ``send`` replaced later, or a mock's, sees them all.

    Args:
      connection: e.g. a ``dm_env_rpc.v1.connection.Connection``, or an SDK
        ``Connection`` whose ``send`` was replaced on the instance.

    Attributes:
      wrapped: the connection given.
      address: its ``address`` attribute, if it has one.
    """

    def __init__(self, connection: Any) -> None:
        if not callable(getattr(connection, "send", None)):
            as_connection(connection, "ForeignConnection")  # raises, saying what to pass
        self.wrapped = connection
        self.address = getattr(connection, "address", None)

    def send(
        self,
        request: message.Message,
        timeout: float | None = None,
        *,
        response_type: type | None = None,
    ) -> Any:
        """Sends a request and waits for its response (``timeout`` cannot apply here).

        Args:
          request: as for ``Connection.send``.
          timeout: ignored: the wrapped ``send`` takes none.
          response_type: for extensions, the message class to unpack the
            ``google.protobuf.Any`` response into.

        Raises:
          DmEnvRpcError: the server answered with an error (the SDK's class by code).
          ConnectionClosedError: the stream broke.
        """
        del timeout  # the wrapped send() takes none
        response = self._send(request)
        if response_type is not None and isinstance(response, any_pb2.Any):
            unpacked = response_type()
            response.Unpack(unpacked)
            return unpacked
        return response

    def _send(self, request: message.Message) -> Any:
        try:
            return self.wrapped.send(messages.as_reference_request(request))
        except errors.DmEnvRpcClientError:
            raise  # an SDK connection's own errors (a ConnectionClosedError is a grpc.RpcError)
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

    def send_async(
        self, request: message.Message, *, response_type: type | None = None
    ) -> concurrent.futures.Future[Any]:
        """Sends a request, waits for its response, and returns it as a finished Future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(self.send(request, response_type=response_type))
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
      connection: an SDK connection (``Connection``, ``LoopConnection``), or any
        object with the reference's blocking ``send(request)``.
      caller: the function's name, for the error message.
      takes_address: whether the caller also takes an address string (said in the message).

    Returns:
      ``connection`` itself if it is of an SDK connection class (its instance's
      ``send`` may still be replaced: see ``compatible``), else a
      ``ForeignConnection`` around it (a reference connection, a mock, another
      object with ``send``), driven through ``send(request)`` alone.

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
        if is_sdk_class(type(connection)) or issubclass(type(connection), Connection):
            return connection  # type: ignore[no-any-return]  # compatible() sees overrides
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
