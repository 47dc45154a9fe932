"""Argument checks shared by the public entry points: addresses, seconds, counts, keywords.

Each check raises ``ArgumentTypeError`` or ``ArgumentValueError`` (``errors``)
before anything is sent or waited for, with a message that names the argument
and says what to pass instead::

    check_address("127.0.0.1", "address")   # ArgumentValueError: ... has no port ...
    check_seconds(-1, "timeout")            # ArgumentValueError: timeout=-1 ...

Addresses: ``host:port`` (``[::1]:port`` for IPv6), ``unix:PATH``, or any
other gRPC target with a scheme gRPC knows (``dns:``, ``ipv4:``, ``ipv6:``,
``unix-abstract:``, ``vsock:``). URL schemes (``http://``, ``grpc://``) are
refused: gRPC addresses have none, and TLS is a matter of credentials.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .. import errors
from .._proto import dm_env_rpc_pb2

F = TypeVar("F", bound=Callable[..., Any])

_GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")
_URL_SCHEMES = ("http", "https", "grpc", "grpcs", "tcp")
_EXAMPLE = "e.g. '127.0.0.1:50051'"

_ADDRESS_TYPE = "{name} takes one address, a string 'host:port' ({example}), not {kind}{hint}."
_SEVERAL = "; for several addresses use BatchedEnvironment.connect(addresses)"
_EMPTY = "{name} is empty: pass the server's 'host:port' ({example})."
_SPACES = "{name}={address!r} has spaces in it: pass 'host:port' without spaces ({example})."
_SCHEME = (
    "{name}={address!r} has a URL scheme: gRPC addresses have none. Pass {bare!r}; for TLS "
    "pass credentials (in the CLI, --tls), not https://."
)
_NO_PORT = "{name}={address!r} has no port: pass 'host:port' ({example}; IPv6 as '[::1]:50051')."
_BAD_PORT = "{name}={address!r}: the port {port!r} is not a whole number from {low} to 65535{why}."
_SECONDS_TYPE = "{name} is a number of seconds{none}, not {kind} {value!r}."
_SECONDS_VALUE = "{name}={value!r} cannot work: pass a finite number of seconds above 0{none}."
_COUNT_TYPE = "{name} is a whole number of at least {low}, not {kind} {value!r}."
_COUNT_VALUE = "{name}={value!r} cannot work: pass a whole number of at least {low}."
_UNKNOWN_KEYWORD = "{caller}() got an unexpected keyword argument {name!r}{suggestion}."


def kind(value: Any) -> str:
    """A short description of what ``value`` is, for messages: ``the list ['a:1']``."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def check_address(address: Any, name: str = "address", *, listen: bool = False) -> str:
    """``address`` if it has the shape of a gRPC address (see the module docs).

    Args:
      address: the value given.
      name: the argument's name, for the message.
      listen: an address to listen on (port 0 picks a free one) rather than to dial.

    Raises:
      ArgumentTypeError: not a string (a list of them names BatchedEnvironment.connect).
      ArgumentValueError: empty, spaces, a URL scheme, no port, or a port out of range.
    """
    if not isinstance(address, str):
        hint = _SEVERAL if isinstance(address, (list, tuple)) and not listen else ""
        raise errors.ArgumentTypeError(
            _ADDRESS_TYPE.format(name=name, example=_EXAMPLE, kind=kind(address), hint=hint)
        )
    if not address.strip():
        raise errors.ArgumentValueError(_EMPTY.format(name=name, example=_EXAMPLE))
    if any(char.isspace() for char in address):
        raise errors.ArgumentValueError(
            _SPACES.format(name=name, address=address, example=_EXAMPLE)
        )
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() in _URL_SCHEMES:
        raise errors.ArgumentValueError(
            _SCHEME.format(name=name, address=address, bare=rest.rstrip("/"))
        )
    if address.startswith(_GRPC_SCHEMES) or sep:
        return address  # a gRPC target of another kind: gRPC checks it
    if address.startswith("["):  # [IPv6]:port
        host, bracket, tail = address.partition("]")
        colon, port = tail[:1], tail[1:]
        host += bracket
    else:
        host, colon, port = address.rpartition(":")
    if not colon or not host or (":" in host.strip("[]") and not host.startswith("[")):
        raise errors.ArgumentValueError(
            _NO_PORT.format(name=name, address=address, example=_EXAMPLE)
        )
    low = 0 if listen else 1
    if not port.isdigit() or not low <= int(port) <= 65535:
        why = " (0 picks a free one)" if listen else ""
        raise errors.ArgumentValueError(
            _BAD_PORT.format(name=name, address=address, port=port, low=low, why=why)
        )
    return address


def check_seconds(value: Any, name: str = "timeout", *, allow_none: bool = True) -> float | None:
    """``value`` as seconds: a finite number above 0 (or None, waiting without end).

    Raises:
      ArgumentTypeError: not a number (a bool or a string included).
      ArgumentValueError: zero, negative, NaN or infinite.
    """
    none = " (or None to wait without end)" if allow_none else ""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise errors.ArgumentTypeError(
            _SECONDS_TYPE.format(name=name, none=none, kind=type(value).__name__, value=value)
        )
    seconds = float(value)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise errors.ArgumentValueError(_SECONDS_VALUE.format(name=name, value=value, none=none))
    return seconds


def check_count(value: Any, name: str, *, low: int = 1) -> int:
    """``value`` as a whole number of at least ``low``.

    Raises:
      ArgumentTypeError: not a whole number (a bool, a float or a string included).
      ArgumentValueError: below ``low``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise errors.ArgumentTypeError(
            _COUNT_TYPE.format(name=name, low=low, kind=type(value).__name__, value=value)
        )
    if value < low:
        raise errors.ArgumentValueError(_COUNT_VALUE.format(name=name, value=value, low=low))
    return int(value)


def unknown_keyword(caller: str, name: str, known: Iterable[str]) -> errors.ArgumentTypeError:
    """The error for a keyword ``caller`` does not take, suggesting the closest of ``known``."""
    close = difflib.get_close_matches(name, list(known), n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return errors.ArgumentTypeError(
        _UNKNOWN_KEYWORD.format(caller=caller, name=name, suggestion=suggestion)
    )


def check_keywords(caller: str, kwargs: Mapping[str, Any], function: Callable[..., Any]) -> None:
    """Refuses keywords of ``kwargs`` (passed on to ``function``) that it does not take.

    Raises:
      ArgumentTypeError: naming the keyword and the closest one ``function`` takes.
    """
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for name in kwargs:
        if name not in parameters:
            raise unknown_keyword(caller, name, parameters)


def keywords_checked(function: F) -> F:
    """``function``, raising ``ArgumentTypeError`` with a suggestion for a misspelled keyword.

    Only a call that cannot bind is converted (Python's TypeError then comes from the call
    itself, with no frame of ``function`` in its traceback); a TypeError from inside
    ``function`` passes unchanged. It costs one call frame, so it is for entry points, not for
    what a step runs.
    """

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except TypeError as exc:
            if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                raise  # raised inside the function
            parameters = inspect.signature(function).parameters
            for name in kwargs:
                if name not in parameters:
                    caller = function.__qualname__
                    raise unknown_keyword(caller, name, parameters) from None
            raise

    return checked  # type: ignore[return-value]


def check_type(value: Any, expected: type | tuple[type, ...], name: str, what: str) -> None:
    """Refuses ``value`` unless it is an ``expected``: "``name`` is ``what``, not ...".

    Raises:
      ArgumentTypeError: naming the argument, what goes there, and what came.
    """
    if not isinstance(value, expected):
        raise errors.ArgumentTypeError(f"{name} is {what}, not {kind(value)}.")


def check_tensor_spec(spec: Any, name: str = "spec") -> None:
    """Refuses anything but a dm_env_rpc ``TensorSpec`` message.

    Raises:
      ArgumentTypeError: naming the argument and what goes there.
    """
    what = "a dm_env_rpc TensorSpec (e.g. one of env.action_manager's specs)"
    check_type(spec, dm_env_rpc_pb2.TensorSpec, name, what)


_WORLD_NAME = (
    "{name} is one world's name, a string (e.g. the one create_world returned), not {kind}."
)
_SETTINGS = "{name} is a dict of settings (e.g. {{'seed': 1}}) or None, not {kind}."
_SPECS = (
    "specs is the world's ActionObservationSpecs (a JoinWorldResponse's specs), not {kind}. "
    "To create a world with settings and join it, call "
    "dmr.create_and_join_world(connection, create_world_settings={{...}})."
)
_REQUESTED = (
    "requested_observations is a list of observation names (e.g. ['board']) or None, "
    "not {kind}{hint}."
)
_EXTENSIONS = "extensions is a dict {{attribute name: extension}} or None, not {kind}."


def check_world_name(value: Any, name: str = "world_name") -> str:
    """``value`` if it is a string (a world's name).

    Raises:
      ArgumentTypeError: anything else (a list of names included).
    """
    if not isinstance(value, str):
        raise errors.ArgumentTypeError(_WORLD_NAME.format(name=name, kind=kind(value)))
    return value


def check_settings(value: Any, name: str = "settings") -> None:
    """Refuses settings that are not a mapping (or None).

    Raises:
      ArgumentTypeError: naming the argument and what goes there.
    """
    if value is not None and not isinstance(value, Mapping):
        raise errors.ArgumentTypeError(_SETTINGS.format(name=name, kind=kind(value)))


def check_adaptor_arguments(
    specs: Any, requested_observations: Any, extensions: Any, timeout: Any
) -> None:
    """Refuses a wrong kind of thing for the adaptors' arguments, before anything is sent.

    Raises:
      ArgumentTypeError: specs that are not ActionObservationSpecs, names that are one
        string or not a list, extensions that are not a dict, timeout not a number.
      ArgumentValueError: a timeout that is not above 0.
    """
    if not isinstance(specs, dm_env_rpc_pb2.ActionObservationSpecs):
        raise errors.ArgumentTypeError(_SPECS.format(kind=kind(specs)))
    names = requested_observations
    if names is not None and (isinstance(names, (str, bytes)) or not isinstance(names, Iterable)):
        hint = f": pass [{names!r}]" if isinstance(names, str) else ""
        raise errors.ArgumentTypeError(_REQUESTED.format(kind=kind(names), hint=hint))
    if extensions is not None and not isinstance(extensions, Mapping):
        raise errors.ArgumentTypeError(_EXTENSIONS.format(kind=kind(extensions)))
    check_seconds(timeout)


_METADATA = (
    "metadata is gRPC metadata, a list of (key, value) pairs of strings "
    "(e.g. [('authorization', 'Bearer ...')]), not {kind}{hint}."
)


def check_metadata(metadata: Any) -> None:
    """Refuses gRPC metadata that is not a sequence of ``(key, value)`` pairs (or None).

    Raises:
      ArgumentTypeError: a dict (pass ``list(d.items())``), a string, or pairs of another shape.
    """
    if metadata is None:
        return
    pairs = not isinstance(metadata, (str, bytes, Mapping)) and isinstance(metadata, Iterable)
    if pairs:
        pairs = all(isinstance(p, tuple) and len(p) == 2 for p in metadata)
    if not pairs:
        hint = ": pass list(metadata.items())" if isinstance(metadata, Mapping) else ""
        raise errors.ArgumentTypeError(_METADATA.format(kind=kind(metadata), hint=hint))
