"""The world requests that need no adaptor, over any connection: create, leave, destroy, reset.

Each takes a ``Connection`` or any object with the reference package's
``send(request)`` (``_transport.foreign.compatible``), and a ``timeout``. Importable from
``environment`` (and ``dmr``) with ``join_world`` and ``create_and_join_world``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._base.checks import check_seconds, check_world_name
from .._proto import dm_env_rpc_pb2
from .._transport.foreign import as_connection, compatible
from ..connection import DEFAULT_TIMEOUT, ConnectionLike
from .core import pack_settings


def create_world(
    connection: ConnectionLike,
    create_world_settings: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> str:
    """Creates a world and returns its name. Settings: nested dicts of Python or NumPy values.

    Args:
      connection: a ``Connection``, or an object with the reference package's
        ``send(request)``.
      create_world_settings: the CreateWorldRequest settings.
      timeout: seconds to wait for the response (default ``DEFAULT_TIMEOUT``,
        60 s; None waits until the response or the stream's end).

    Raises:
      RequestTimeoutError: no response within ``timeout`` seconds.
      InvalidArgumentError: the server refused the settings.
    """
    connection = compatible(as_connection(connection, "create_world"))
    check_seconds(timeout)
    settings = pack_settings(create_world_settings, "create_world_settings")
    request = dm_env_rpc_pb2.CreateWorldRequest(settings=settings)
    return connection.send(request, timeout).world_name


def leave_world(connection: ConnectionLike, *, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Leaves the joined world (a no-op when not joined); ``timeout`` as for ``create_world``."""
    connection = compatible(as_connection(connection, "leave_world"))
    connection.send(dm_env_rpc_pb2.LeaveWorldRequest(), check_seconds(timeout))


def destroy_world(
    connection: ConnectionLike, world_name: str, *, timeout: float | None = DEFAULT_TIMEOUT
) -> None:
    """Destroys a world (it must not be joined); ``timeout`` as for ``create_world``."""
    connection = compatible(as_connection(connection, "destroy_world"))
    request = dm_env_rpc_pb2.DestroyWorldRequest(world_name=check_world_name(world_name))
    connection.send(request, check_seconds(timeout))


def reset_world(
    connection: ConnectionLike,
    world_name: str,
    settings: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> None:
    """Resets a world for every joined connection, optionally with new settings.

    ``timeout`` as for ``create_world``.
    """
    connection = compatible(as_connection(connection, "reset_world"))
    request = dm_env_rpc_pb2.ResetWorldRequest(
        world_name=check_world_name(world_name), settings=pack_settings(settings)
    )
    connection.send(request, check_seconds(timeout))
