"""Request/response envelopes and in-order response matching, without I/O.

Shared by the sync ``Connection`` and the asyncio ``AsyncConnection``:

- ``envelope(request)`` serializes a request as ``EnvironmentRequest`` wire bytes.
  A plain dm_env_rpc request (``StepRequest``, ...) goes into its field of the
  ``payload`` oneof; an ``EnvironmentRequest`` goes as it is; any other protobuf
  message is an extension, wrapped in ``google.protobuf.Any``. The bytes are
  built by prefixing the request's own serialization with its field's tag, so
  the request is serialized once and never copied into an envelope message.
- ``unwrap(data, expected, response_type)`` parses ``EnvironmentResponse``
  bytes and returns the payload for the request it answers, or raises:
  ``DmEnvRpcError`` (from ``error``) or ``ProtocolError`` (a payload of
  another kind).
- ``PendingQueue``: the FIFO of requests awaiting responses. The server answers
  in request order, so each response belongs to the oldest pending request.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from google.protobuf import any_pb2, message

from . import errors
from ._codec.payload import _varint
from ._proto import dm_env_rpc_pb2

EXTENSION = "extension"
METHOD = "/dm_env_rpc.v1.Environment/Process"

# Request type -> (EnvironmentRequest field, wire tag bytes of that field).
_REQUEST_FIELDS: dict[type, tuple[str, bytes]] = {}
_RESPONSE_TYPES: dict[str, type] = {}
for _field in dm_env_rpc_pb2.EnvironmentRequest.DESCRIPTOR.oneofs_by_name["payload"].fields:
    _message_name = _field.message_type.name if _field.message_type else ""
    if _message_name == "Any":
        continue
    _request_type = getattr(dm_env_rpc_pb2, _message_name)
    _REQUEST_FIELDS[_request_type] = (_field.name, bytes([_field.number << 3 | 2]))
    _RESPONSE_TYPES[_field.name] = getattr(
        dm_env_rpc_pb2, _message_name.replace("Request", "Response")
    )
_EXTENSION_TAG = bytes([15 << 3 | 2])
_REQUEST_NAMES = {kind.__name__ for kind in _REQUEST_FIELDS} | {"EnvironmentRequest"}

_MISMATCH = (
    "The server answered a {expected} request with a {actual} response. Responses must "
    "come in request order; the server or a proxy broke the protocol."
)
_EMPTY_RESPONSE = "The server sent an EnvironmentResponse with no payload for a {expected} request."
_BAD_EXTENSION = (
    "Expected an extension response of type {expected} but got {actual!r}; check the "
    "response_type you passed."
)
UNEXPECTED_RESPONSE = (
    "The server sent a response with no request pending; the stream is out of step and was closed."
)
_UNEXPECTED = UNEXPECTED_RESPONSE


def as_reference_request(request: message.Message) -> message.Message:
    """``request`` as the reference's ``send(request)`` takes it.

    A dm_env_rpc request (matched by name, so either package's class), an
    ``EnvironmentRequest`` or an ``Any`` as it is; any other message, an
    extension's such as a ``PropertyRequest``, packed into an ``Any``.
    """
    name = type(request).__name__
    if name in _REQUEST_NAMES or isinstance(request, any_pb2.Any):
        return request
    packed = any_pb2.Any()
    packed.Pack(request)
    return packed


def envelope(request: message.Message) -> tuple[bytes, str]:
    """Serializes a request as EnvironmentRequest bytes.

    Args:
      request: a dm_env_rpc request (``StepRequest``, ...), an
        ``EnvironmentRequest``, or any other message (sent as an extension).

    Returns:
      ``(wire bytes, the payload field the response must carry)``.

    Raises:
      TypeError: if ``request`` is not a protobuf message, or is an empty
        EnvironmentRequest.
    """
    known = _REQUEST_FIELDS.get(type(request))
    if known is not None:
        field, tag = known
        body = request.SerializeToString()
        return tag + _varint(len(body)) + body, field
    if isinstance(request, dm_env_rpc_pb2.EnvironmentRequest):
        which = request.WhichOneof("payload")
        if which is None:
            raise TypeError("The EnvironmentRequest has no payload; set one of its fields.")
        return request.SerializeToString(), which
    if not isinstance(request, message.Message):
        raise TypeError(
            f"Requests must be protobuf messages (e.g. dm_env_rpc_pb2.StepRequest), "
            f"not {type(request).__name__}."
        )
    if isinstance(request, any_pb2.Any):
        packed = request
    else:
        packed = any_pb2.Any()
        packed.Pack(request)
    body = packed.SerializeToString()
    return _EXTENSION_TAG + _varint(len(body)) + body, EXTENSION


def unwrap(data: bytes, expected: str, response_type: type | None = None) -> Any:
    """Parses EnvironmentResponse bytes and returns the payload for ``expected``.

    Args:
      data: the serialized EnvironmentResponse.
      expected: the payload field of the request (from ``envelope``).
      response_type: for extensions, a message class to unpack the Any into;
        None returns the Any.

    Raises:
      DmEnvRpcError: the server answered with an error Status.
      ProtocolError: the payload is of another kind than the request.
    """
    response = dm_env_rpc_pb2.EnvironmentResponse.FromString(data)
    field = response.WhichOneof("payload")
    if field == expected:
        payload = getattr(response, field)
        if field == EXTENSION and response_type is not None:
            unpacked = response_type()
            if not payload.Unpack(unpacked):
                raise errors.ProtocolError(
                    _BAD_EXTENSION.format(expected=response_type.__name__, actual=payload.type_url)
                )
            return unpacked
        return payload
    if field == "error":
        raise errors.DmEnvRpcError.from_status(response.error)
    if field is None:
        raise errors.ProtocolError(_EMPTY_RESPONSE.format(expected=expected))
    raise errors.ProtocolError(_MISMATCH.format(expected=expected, actual=field))


def response_type_for(request: message.Message) -> type | None:
    """The response message class of a plain dm_env_rpc request, if it is one."""
    known = _REQUEST_FIELDS.get(type(request))
    return None if known is None else _RESPONSE_TYPES[known[0]]


F = TypeVar("F")
F_co = TypeVar("F_co", covariant=True)


class Pending(NamedTuple, Generic[F]):
    """A request awaiting its response (``decode``: replaces ``unwrap`` for it, see ``push``)."""

    future: F
    expected: str
    response_type: type | None
    decode: Callable[[bytes], Any] | None = None


class PendingLike(Protocol[F_co]):
    """What ``PendingQueue`` holds: a ``Pending``, or a receiver that is its own (``push_item``)."""

    @property
    def future(self) -> F_co: ...

    @property
    def expected(self) -> str: ...

    @property
    def response_type(self) -> type | None: ...

    @property
    def decode(self) -> Callable[[bytes], Any] | None: ...


class PendingQueue(Generic[F]):
    """The FIFO of pending requests; the caller provides the locking.

    Args:
      resolve: ``resolve(future, result)`` completes a future with a result.
      fail: ``fail(future, exception)`` completes a future with an exception.
    """

    def __init__(
        self, resolve: Callable[[F, Any], None], fail: Callable[[F, BaseException], None]
    ) -> None:
        self._items: collections.deque[PendingLike[F]] = collections.deque()
        self._resolve = resolve
        self._fail = fail

    def __len__(self) -> int:
        return len(self._items)

    def push(
        self,
        future: F,
        expected: str,
        response_type: type | None,
        decode: Callable[[bytes], Any] | None = None,
    ) -> None:
        """Queues a request; ``decode(data)``, if given, makes its result from the response bytes.

        ``decode`` runs where responses are read, in response order, instead of
        ``unwrap``; it must raise as ``unwrap`` does for an error or mismatch.
        """
        self._items.append(Pending(future, expected, response_type, decode))

    def push_item(self, item: PendingLike[F]) -> None:
        """Queues a request that is its own pending item (no ``Pending`` made for it: a batch's
        step in flight is one object the garbage collector tracks, not two)."""
        self._items.append(item)

    def pop(self) -> PendingLike[F]:
        """The oldest pending request.

        Raises:
          ProtocolError: if none is pending (a response nobody asked for).
        """
        try:
            return self._items.popleft()
        except IndexError:
            raise errors.ProtocolError(_UNEXPECTED) from None

    def complete(self, pending: PendingLike[F], data: bytes) -> None:
        """Completes one pending request with its response bytes."""
        if pending.decode is not None:
            try:
                result = pending.decode(data)
            except Exception as exc:  # its own errors, as they are (e.g. from a reward override)
                self._fail(pending.future, exc)
            else:
                self._resolve(pending.future, result)
            return
        try:
            result = unwrap(data, pending.expected, pending.response_type)
        except errors.DmEnvRpcClientError as exc:
            self._fail(pending.future, exc)
        except Exception as exc:  # a response that does not parse
            self._fail(
                pending.future,
                errors.ProtocolError(f"The server sent an unreadable response: {exc}"),
            )
        else:
            self._resolve(pending.future, result)

    def fail_all(self, exc: BaseException) -> None:
        """Fails every pending request with ``exc`` and empties the queue."""
        while self._items:
            self._fail(self._items.popleft().future, exc)
