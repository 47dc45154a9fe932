"""The server side of the properties extension: the ``Property`` hook and request handling.

An environment offers properties by defining ``dm_env_rpc_properties()``, which
returns ``{dotted key: Property}``. Keys nest on dots: ``"stats.episodes"`` makes
``"stats"`` a listable node. A read calls ``Property.read``; a write validates the
value against ``Property.spec`` and calls ``Property.write`` (a property without a
writer is read-only).

Errors: an unknown key is NOT_FOUND, a write to a read-only property is
PERMISSION_DENIED, a value of the wrong dtype or shape is INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from dm_env import specs as dm_specs

from .. import errors, specs, tensors
from .._base import checks as _checks
from .._proto import properties_pb2

_NOT_CALLABLE = (
    "Property's {name} is a function (read=lambda: value; write=lambda value: ...), not {kind}."
)


@dataclasses.dataclass(frozen=True)
class Property:
    """One property of an environment.

    Attributes:
      spec: the dm_env spec of its value (dtype, shape, bounds).
      read: returns the current value.
      write: sets a new value; None makes the property read-only.
      description: a human-readable description.
    """

    spec: dm_specs.Array
    read: Callable[[], Any]
    write: Callable[[Any], None] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        _checks.check_type(self.spec, dm_specs.Array, "spec", "a dm_env spec of the value")
        for name in ("read", "write"):
            value = getattr(self, name)
            if not callable(value) and (name == "read" or value is not None):
                raise errors.ArgumentTypeError(
                    _NOT_CALLABLE.format(name=name, kind=_checks.kind(value))
                )


class PropertyError(Exception):
    """A properties request failed; carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _children(table: Mapping[str, Property], key: str) -> list[str]:
    prefix = f"{key}." if key else ""
    found: dict[str, None] = {}
    for name in table:
        if name.startswith(prefix) and name != key:
            found[prefix + name[len(prefix) :].split(".")[0]] = None
    return list(found)


def _spec_of(table: Mapping[str, Property], key: str) -> properties_pb2.PropertySpec:
    prop = table.get(key)
    listable = bool(_children(table, key))
    out = properties_pb2.PropertySpec(is_listable=listable)
    if prop is None:
        out.spec.name = key
        return out
    out.spec.CopyFrom(specs.dm_env_spec_to_tensor_spec(prop.spec, key))
    out.is_readable = True
    out.is_writable = prop.write is not None
    out.description = prop.description
    return out


def handle(
    table: Mapping[str, Property], request: properties_pb2.PropertyRequest
) -> properties_pb2.PropertyResponse:
    """Answers one PropertyRequest against a property table.

    Raises:
      PropertyError: with NOT_FOUND, PERMISSION_DENIED or INVALID_ARGUMENT.
    """
    which = request.WhichOneof("payload")
    response = properties_pb2.PropertyResponse()
    if which == "list_property":
        key = request.list_property.key
        if key and key not in table and not _children(table, key):
            raise PropertyError(grpc.StatusCode.NOT_FOUND, f"No property {key!r} to list.")
        values = [_spec_of(table, child) for child in _children(table, key)]
        response.list_property.values.extend(values)
        return response
    if which not in ("read_property", "write_property"):
        raise PropertyError(grpc.StatusCode.INVALID_ARGUMENT, "Empty PropertyRequest.")
    key = getattr(request, which).key
    prop = table.get(key)
    if prop is None:
        known = ", ".join(sorted(table))
        raise PropertyError(
            grpc.StatusCode.NOT_FOUND, f"Unknown property {key!r}. Known properties: {known}."
        )
    if which == "read_property":
        value = prop.read()
        response.read_property.value.CopyFrom(tensors.pack_tensor(value, prop.spec.dtype))
        return response
    if prop.write is None:
        raise PropertyError(grpc.StatusCode.PERMISSION_DENIED, f"Property {key!r} is read-only.")
    try:
        tensor = request.write_property.value
        sent = tensors.get_tensor_type(tensor)
        if sent != prop.spec.dtype.type:
            raise ValueError(
                f"Property {key!r} takes dtype {prop.spec.dtype} but got {sent.__name__}."
            )
        value = tensors.unpack_tensor(tensor)
        expected = specs.dm_env_spec_to_tensor_spec(prop.spec, key)
        manager = specs.SpecManager({1: expected}, kind="property")
        manager.pack({key: value})  # validates dtype, shape and bounds
    except (TypeError, ValueError) as exc:
        raise PropertyError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
    prop.write(value)
    response.write_property.SetInParent()
    return response
