"""One exception tree for the whole SDK.

Every error the SDK raises derives from :class:`DmEnvRpcClientError`. Where a
built-in exception describes the problem too, the SDK error also subclasses it,
so ``except ValueError`` keeps working::

    DmEnvRpcClientError
    +-- TensorError
    |   +-- TensorTypeError (TypeError)
    |   |   +-- UnsupportedDtypeError
    |   +-- TensorValueError (ValueError)
    |       +-- RaggedArrayError
    |       +-- IntegerRangeError
    |       +-- ShapeError
    |       +-- EmptyTensorError
    +-- SpecError (ValueError)
    |   +-- UnknownNameError
    |   +-- UnknownUidError
    |   +-- DuplicateNameError
    |   +-- SpecValidationError
    |   +-- BoundsError
    +-- DmEnvRpcError                  a server answered with an error Status
    |   +-- NotFoundError (KeyError)
    |   +-- PermissionDeniedError (PermissionError)
    |   +-- InvalidArgumentError (ValueError)
    +-- DmEnvRpcConnectionError (ConnectionError)
    |   +-- ConnectionClosedError (grpc.RpcError)  the stream ended or broke; its gRPC status
    |   |   +-- AuthenticationError    refused: a missing or wrong token, or a TLS handshake
    |   |   +-- ResponseTooLargeError    an answer over max_response_bytes ended the stream
    |   +-- ConnectTimeoutError (TimeoutError)
    |   +-- ConnectRefusedError (ConnectionRefusedError)   nothing listens at the address
    +-- RequestTimeoutError (TimeoutError, and concurrent.futures' and asyncio's where they differ)
    +-- ProtocolError                  the server broke the protocol
    |   +-- ObservationError           a step response's observations contradict the specs
    +-- WorldError                     one world of a batch failed; names index and address
    |   +-- WorldTimeoutError (TimeoutError)   it passed its deadline
    +-- RecordingError (OSError)       a recording folder that is not usable
    +-- ServerLaunchError (OSError)    a launched server did not start or answer
    +-- ArgumentError                  a call got an argument it cannot use
        +-- ArgumentTypeError (TypeError)    the wrong kind of thing (a string for an object)
        +-- ArgumentValueError (ValueError)  the right kind, a bad value (port 99999, -1 s)

Transport errors are converted at the boundary with ``raise ... from exc``: no
raw ``grpc.RpcError`` or ``StopIteration`` reaches a user. Server errors keep
their code, message and details and survive pickling.

Code written for the reference ``dm-env-rpc`` package catches its
``dm_env_rpc.v1.error.DmEnvRpcError``. Once that package is imported (by the
user; this SDK never imports it), every ``DmEnvRpcError`` this SDK builds is
also an instance of the reference class, so such ``except`` clauses keep
working. Its ``code`` is an ``ErrorCode``: it equals both the ``grpc.StatusCode``
and the reference's int (``error.code == 9`` and ``error.code ==
grpc.StatusCode.FAILED_PRECONDITION`` both hold).

A broken or ended stream raises ``ConnectionClosedError``, which is also a
``grpc.RpcError`` (the reference lets gRPC's own error through there), so loaders
that retry on ``except grpc.RpcError`` while a server starts keep retrying; like
gRPC's errors, its ``code()`` and ``details()`` can be called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Sequence
from typing import Any

import grpc

# Where the reference package keeps its server error class (never imported here).
_REFERENCE_ERROR_MODULE = "dm_env_rpc.v1.error"


class DmEnvRpcClientError(Exception):
    """The root of every error raised by dm_env_rpc_client."""


# --- Tensors --------------------------------------------------------------------------


class TensorError(DmEnvRpcClientError):
    """A value cannot be packed into, or unpacked from, a Tensor."""


class TensorTypeError(TensorError, TypeError):
    """A value has a type the Tensor codec does not support."""


class UnsupportedDtypeError(TensorTypeError):
    """A NumPy dtype (or Python type) that dm_env_rpc has no payload for."""


class TensorValueError(TensorError, ValueError):
    """A value of a supported type that is still not a valid Tensor."""


class RaggedArrayError(TensorValueError):
    """Nested sequences of unequal lengths."""


class IntegerRangeError(TensorValueError):
    """An integer does not fit the requested integer dtype."""


class ShapeError(TensorValueError):
    """A shape is invalid or does not match the element count."""


class EmptyTensorError(TensorValueError):
    """A Tensor message with no payload set."""


# --- Specs ----------------------------------------------------------------------------


class SpecError(DmEnvRpcClientError, ValueError):
    """A problem with TensorSpecs or with values checked against them."""


class UnknownNameError(SpecError):
    """A name that is not in the specs; the message lists the known names."""


class UnknownUidError(SpecError):
    """A UID that is not in the specs; the message lists the known UIDs."""


class DuplicateNameError(SpecError):
    """Two specs share a name."""


class SpecValidationError(SpecError):
    """A value has the wrong dtype, shape or bounds for its spec."""


class BoundsError(SpecError):
    """Invalid bounds: non-numeric dtype, min > max, NaN, or unrepresentable."""


# --- Server errors --------------------------------------------------------------------


def _status_code(code: int | grpc.StatusCode) -> grpc.StatusCode:
    if isinstance(code, ErrorCode):
        return code.status
    if isinstance(code, grpc.StatusCode):
        return code
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


class ErrorCode(int):
    """A status code that is at once the reference package's int and a ``grpc.StatusCode``.

    ``code == 9``, ``code == grpc.StatusCode.FAILED_PRECONDITION``, ``code.name``,
    ``code.value[0]`` and ``code.status`` (the ``grpc.StatusCode``) all work, and
    ``code()`` returns the ``grpc.StatusCode``, as a ``grpc.RpcError``'s ``code()``
    does. It hashes as the ``grpc.StatusCode`` (a set or dict of ``grpc.StatusCode``
    finds it; one of ints does not), and ``is`` never holds: compare with ``==``.
    Made from a ``grpc.StatusCode`` or its int: ``ErrorCode(grpc.StatusCode.NOT_FOUND)``.
    """

    status: grpc.StatusCode

    def __new__(cls, status: grpc.StatusCode | int) -> ErrorCode:
        if isinstance(status, bool) or not isinstance(status, (grpc.StatusCode, int)):
            raise ArgumentTypeError(
                f"ErrorCode takes a grpc.StatusCode or its int, e.g. "
                f"ErrorCode(grpc.StatusCode.NOT_FOUND); got {type(status).__name__} {status!r}."
            )
        status = _status_code(status)
        code = super().__new__(cls, status.value[0])
        code.status = status
        return code

    @property
    def name(self) -> str:
        """The status name, e.g. ``"NOT_FOUND"``."""
        return self.status.name

    @property
    def value(self) -> tuple[int, str]:
        """As ``grpc.StatusCode.value``: ``(int, "lower-case name")``."""
        return self.status.value  # type: ignore[no-any-return]

    def __call__(self) -> grpc.StatusCode:
        return self.status

    def __eq__(self, other: object) -> bool:
        if isinstance(other, grpc.StatusCode):
            return self.status is other
        return int(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.status)

    def __repr__(self) -> str:
        return f"<ErrorCode.{self.status.name}: {int(self)}>"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (_error_code, (int(self),))


def _error_code(code: int | grpc.StatusCode | None) -> ErrorCode | None:
    """``code`` as an ``ErrorCode`` (None stays None)."""
    if code is None or isinstance(code, ErrorCode):
        return code
    return ErrorCode(_status_code(code))


class _Details(str):
    """A details string that can also be called, as a ``grpc.RpcError``'s ``details()``."""

    def __call__(self) -> str:
        return str(self)


_BRIDGED: dict[tuple[type, type], type] = {}


def _bridged(cls: type) -> type:
    """``cls``, also deriving from the reference's DmEnvRpcError if that package is loaded."""
    module = sys.modules.get(_REFERENCE_ERROR_MODULE)
    reference = getattr(module, "DmEnvRpcError", None)
    if not isinstance(reference, type) or issubclass(cls, reference):
        return cls
    key = (cls, reference)
    bridged = _BRIDGED.get(key)
    if bridged is None:
        # Plain class attributes shadow the reference's read-only properties, so
        # that __init__ can set code, message and details on the instance.
        namespace = {
            "code": None,
            "message": None,
            "details": None,
            "_sdk_class": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        bridged = _BRIDGED[key] = type(cls.__name__, (cls, reference), namespace)
    return bridged


# str() of a server error shows at most this many characters of the server's message (a server
# may send megabytes); the whole message stays on ``.message``.
MAX_MESSAGE_SHOWN = 2000
_CUT = "... [{cut} more characters; the whole message is in the error's .message]"


def _shown(message: str) -> str:
    """``message``, cut to ``MAX_MESSAGE_SHOWN`` characters with a note of what was cut."""
    if len(message) <= MAX_MESSAGE_SHOWN:
        return message
    return message[:MAX_MESSAGE_SHOWN] + _CUT.format(cut=len(message) - MAX_MESSAGE_SHOWN)


class DmEnvRpcError(DmEnvRpcClientError):
    """The server answered a request with an error ``google.rpc.Status``.

    Only the request that got the error fails; the connection stays usable.
    When the reference ``dm-env-rpc`` package is imported, instances are also
    instances of its ``DmEnvRpcError`` (see the module docs).

    ``str(error)`` shows at most ``MAX_MESSAGE_SHOWN`` characters of the
    message (with a note of how many more there are); ``message`` keeps it whole.

    Attributes:
      code: the status code, an ``ErrorCode``: equal to the ``grpc.StatusCode`` and
        to its int (the reference's ``code``). A code outside gRPC's range (0-16)
        is ``UNKNOWN`` here, as gRPC has it.
      raw_code: the code exactly as the server sent it (an int), which differs
        from ``code`` only for a code outside gRPC's range.
      message: the server's message, whole.
      details: the status details (``google.protobuf.Any`` messages).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> DmEnvRpcError:
        return super().__new__(_bridged(cls), *args)  # type: ignore[no-any-return]

    def __init__(
        self,
        code: int | grpc.StatusCode,
        message: str,
        details: Sequence[Any] = (),
    ) -> None:
        self.code: ErrorCode = ErrorCode(_status_code(code))
        self.raw_code = int(code.value[0] if isinstance(code, grpc.StatusCode) else code)
        self.message = message
        self.details = list(details)
        # Not super(): with the reference's class among the bases it takes other arguments.
        BaseException.__init__(self, code, message, details)

    def __str__(self) -> str:
        return f"{self._code_text()}: {_shown(self.message)}"

    def __repr__(self) -> str:
        message = _shown(self.message)
        return f"{type(self).__name__}(code={self._code_text()}, message={message!r})"

    def _code_text(self) -> str:
        if self.raw_code != int(self.code):
            return f"{self.code.name} (the server's code {self.raw_code})"
        return self.code.name

    def __reduce__(self) -> tuple[Any, ...]:
        details = [(d.type_url, d.value) for d in self.details]
        cls = getattr(type(self), "_sdk_class", type(self))  # bridged classes pickle as ours
        return (_rebuild_server_error, (cls, self.raw_code, self.message, details))

    @classmethod
    def from_status(cls, status: Any) -> DmEnvRpcError:
        """Builds the most specific error for a ``google.rpc.Status``."""
        error_cls = _ERROR_BY_CODE.get(_status_code(status.code), DmEnvRpcError)
        return error_cls(status.code, status.message, list(status.details))


def _rebuild_server_error(
    cls: type[DmEnvRpcError], code: int, message: str, details: list[tuple[str, bytes]]
) -> DmEnvRpcError:
    from google.protobuf import any_pb2

    return cls(code, message, [any_pb2.Any(type_url=t, value=v) for t, v in details])


class NotFoundError(DmEnvRpcError, KeyError):
    """The server answered NOT_FOUND (for example an unknown property key)."""

    __str__ = DmEnvRpcError.__str__


class PermissionDeniedError(DmEnvRpcError, PermissionError):
    """The server answered PERMISSION_DENIED (for example a read-only property)."""

    __str__ = DmEnvRpcError.__str__


class InvalidArgumentError(DmEnvRpcError, ValueError):
    """The server answered INVALID_ARGUMENT (for example a bad value)."""

    __str__ = DmEnvRpcError.__str__


_ERROR_BY_CODE: dict[grpc.StatusCode, type[DmEnvRpcError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
}


# --- Transport ------------------------------------------------------------------------


class DmEnvRpcConnectionError(DmEnvRpcClientError, ConnectionError):
    """The connection to the server failed."""


class ConnectionClosedError(DmEnvRpcConnectionError, grpc.RpcError):
    """The stream ended, broke, or was closed; pending and later requests fail.

    Also a ``grpc.RpcError``: where the reference package lets gRPC's own error
    through (a stream that breaks, a server still starting that answers
    UNAVAILABLE), code written for it catches this one.

    Attributes:
      code: the gRPC status code of the stream's end as an ``ErrorCode`` (compare
        it with ``grpc.StatusCode``s or ints, or call it: ``error.code()``), or
        None after ``close()``.
      details: the gRPC status details string, if any (``error.details()`` works too).
    """

    def __init__(
        self,
        message: str,
        code: int | grpc.StatusCode | None = None,
        details: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = _error_code(code)
        self.details = None if details is None else _Details(details)

    def __reduce__(self) -> tuple[Any, ...]:
        details = None if self.details is None else str(self.details)
        return (type(self), (self.args[0], self.code, details))


class AuthenticationError(ConnectionClosedError):
    """The server would not let this client in, or the TLS handshake failed.

    The server ended the stream with UNAUTHENTICATED (no token, or a wrong one:
    its message says which; ``code`` is UNAUTHENTICATED), or the connection
    ended in its TLS handshake (``code`` is UNAVAILABLE): the server wants a
    client certificate it trusts (mutual TLS), the client does not trust the
    server's certificate, or one side speaks TLS and the other does not. The
    message says what to pass. Nothing is retried: the same call fails the same way.
    """


class ResponseTooLargeError(ConnectionClosedError):
    """An answer was larger than the connection's ``max_response_bytes``; gRPC ended the stream.

    Its ``code`` is RESOURCE_EXHAUSTED and its ``details`` gRPC's ("Received
    message larger than max (N vs. M)"); the message says what to change.
    """


class ConnectTimeoutError(DmEnvRpcConnectionError, TimeoutError):
    """The server could not be reached before the timeout."""


class ConnectRefusedError(DmEnvRpcConnectionError, ConnectionRefusedError):
    """Nothing accepts connections at the address (the port is closed)."""


# Python 3.11 made concurrent.futures.TimeoutError and asyncio.TimeoutError the built-in one;
# before, each is a class of its own, and ``except`` of either still catches this error.
_TIMEOUTS = tuple(
    dict.fromkeys((TimeoutError, concurrent.futures.TimeoutError, asyncio.TimeoutError))
)


class RequestTimeoutError(DmEnvRpcClientError, *_TIMEOUTS):  # type: ignore[misc]
    """A request got no response before its timeout.

    Also a ``TimeoutError``, ``concurrent.futures.TimeoutError`` and
    ``asyncio.TimeoutError`` (one class since Python 3.11), so code that catches
    any of them keeps working.
    """


class ProtocolError(DmEnvRpcClientError):
    """The server broke the dm_env_rpc protocol (for example a mismatched response)."""


class ObservationError(ProtocolError):
    """A step response's observations contradict the server's specs.

    A requested observation is missing, a UID is not in the specs, or a tensor's
    dtype or shape is not its spec's. The message names the observation.

    Attributes:
      name: the observation's name (None for a UID not in the specs).
      uid: the observation's UID.
      position: for a run of responses decoded together (``step_iter``, a batch),
        the position of the offending response in it; None for a single step.
    """

    def __init__(self, message: str, name: str | None, uid: int, position: int | None) -> None:
        super().__init__(message)
        self.name = name
        self.uid = uid
        self.position = position

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.name, self.uid, self.position))


class WorldError(DmEnvRpcClientError):
    """One world of a batch failed.

    Attributes:
      index: the world's index in the batch.
      address: the server address of that world.
      reset_steps: from ``BatchedEnvironment.reset``, the FIRST steps (a
        ``BatchedTimeStep``) of the worlds that did reset, or None.
    """

    def __init__(self, message: str, index: int, address: str | None) -> None:
        super().__init__(message)
        self.index = index
        self.address = address
        self.reset_steps: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.index, self.address), self.__dict__)


class WorldTimeoutError(WorldError, TimeoutError):
    """One world of a batch passed its deadline (its cause is a ``RequestTimeoutError``)."""


class RecordingError(DmEnvRpcClientError, OSError):
    """A recording folder is missing, not a folder, not empty, or cannot be created."""


class ServerLaunchError(DmEnvRpcClientError, OSError):
    """A launched server process could not start, exited, or never answered (``dmr.launch``).

    The message names the command, the exit code, the tail of its output and its log file.
    """


# --- Arguments ------------------------------------------------------------------------


class ArgumentError(DmEnvRpcClientError):
    """A call got an argument it cannot use, found before anything is sent.

    The message names the argument and says what to pass instead.
    """


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong kind: a string where an object goes, an instance where a
    factory goes, a list where a string goes, or a keyword the call does not take."""


class ArgumentValueError(ArgumentError, ValueError):
    """An argument of the right kind with a value that cannot work: an address without a
    port, a port above 65535, a negative timeout."""
