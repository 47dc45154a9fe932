"""The properties extension: read, write and list a server's properties.

::

    props = env.properties            # or dmr.PropertiesExtension(connection)
    props.read("stats.episodes")      # or props["stats.episodes"]
    props.write("stats.catch_reward", 2.0)
    [spec.key for spec in props.list("stats")]

Server errors map to SDK errors that also subclass the built-ins: an unknown
key (NOT_FOUND) raises ``NotFoundError`` (a ``KeyError``), a read-only property
(PERMISSION_DENIED) ``PermissionDeniedError`` (a ``PermissionError``), a bad
value (INVALID_ARGUMENT) ``InvalidArgumentError`` (a ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from dm_env import specs as dm_specs

from . import errors, specs, tensors
from ._base import checks as _checks
from ._proto import properties_pb2
from ._transport.foreign import compatible


class PropertySpec(NamedTuple):
    """What a server says of one property."""

    key: str
    readable: bool
    writable: bool
    listable: bool
    spec: dm_specs.Array | None
    description: str

    @classmethod
    def from_proto(cls, proto: properties_pb2.PropertySpec) -> PropertySpec:
        """Converts a ``PropertySpec`` message."""
        has_type = proto.spec.dtype != 0
        return cls(
            key=proto.spec.name,
            readable=proto.is_readable,
            writable=proto.is_writable,
            listable=proto.is_listable,
            spec=specs.tensor_spec_to_dm_env_spec(proto.spec) if has_type else None,
            description=proto.description,
        )


_NOT_A_CONNECTION = (
    "PropertiesExtension(connection) takes a connection (dmr.connect(address), or env.connection), "
    "not a {kind}; or use env.properties."
)


class PropertiesExtension:
    """Reads, writes and lists properties over a connection.

    Args:
      connection: a ``Connection``, or any object with the reference's
        ``send(request)`` (a reference connection, a replaced ``send``).
    """

    def __init__(self, connection: Any) -> None:
        if not callable(getattr(connection, "send", None)):
            raise errors.ArgumentTypeError(_NOT_A_CONNECTION.format(kind=type(connection).__name__))
        self._connection = connection

    def _send(self, **payload: Any) -> properties_pb2.PropertyResponse:
        request = properties_pb2.PropertyRequest(**payload)
        connection: Any = compatible(self._connection)  # its send takes response_type
        return connection.send(request, response_type=properties_pb2.PropertyResponse)

    def read(self, key: str) -> Any:
        """Returns the value of a property (a NumPy value).

        Raises:
          NotFoundError: unknown key (also a KeyError).
          PermissionDeniedError: not readable (also a PermissionError).
        """
        _checks.check_type(key, str, "key", "one property's key, a string (e.g. 'seed')")
        response = self._send(read_property=properties_pb2.ReadPropertyRequest(key=key))
        return tensors.unpack_tensor(response.read_property.value)

    def write(self, key: str, value: Any) -> None:
        """Writes a property, packed with the dtype the server lists for it.

        Raises:
          NotFoundError: unknown key (also a KeyError).
          PermissionDeniedError: read-only (also a PermissionError).
          InvalidArgumentError: a bad value (also a ValueError).
        """
        _checks.check_type(key, str, "key", "one property's key, a string (e.g. 'seed')")
        parent = key.rpartition(".")[0]
        spec = self.specs(parent).get(key)
        dtype = spec.spec.dtype if spec is not None and spec.spec is not None else None
        tensor = tensors.pack_tensor(value, dtype)
        self._send(write_property=properties_pb2.WritePropertyRequest(key=key, value=tensor))

    def list(self, key: str = "") -> list[PropertySpec]:
        """Lists the properties under ``key`` ("" for the root)."""
        _checks.check_type(key, str, "key", "a property key, a string ('' for the root)")
        response = self._send(list_property=properties_pb2.ListPropertyRequest(key=key))
        return [PropertySpec.from_proto(value) for value in response.list_property.values]

    def specs(self, key: str = "") -> dict[str, PropertySpec]:
        """The properties under ``key``, by key."""
        return {spec.key: spec for spec in self.list(key)}

    def keys(self, key: str = "") -> Iterator[str]:
        """Every readable property key under ``key``, recursively."""
        for spec in self.list(key):
            if spec.readable:
                yield spec.key
            if spec.listable:
                yield from self.keys(spec.key)

    def __getitem__(self, key: str) -> Any:
        return self.read(key)

    def __setitem__(self, key: str, value: Any) -> None:
        self.write(key, value)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return key in self.specs(key.rpartition(".")[0])

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def __repr__(self) -> str:
        return f"PropertiesExtension({self._connection!r})"
