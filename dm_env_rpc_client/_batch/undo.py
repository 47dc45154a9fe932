"""Undoing a failed open: the worlds a connect made are left and destroyed before it raises.

``ask`` sends one request on a batch stream, bounded; ``Made`` records what
opening one world made on its server (its stream, the world it created, whether
a join went out); ``undo_worlds`` leaves and destroys all of them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from .. import errors, messages
from .._proto import dm_env_rpc_pb2
from .._transport.loop import LoopConnection, LoopThread
from ..aio import AsyncConnection
from ..connection import _REQUEST_TIMEOUT

UNDO_TIMEOUT = 10.0  # seconds a failed connect waits at most for its leaves and destroys


async def ask(stream: AsyncConnection, request: Any, timeout: float | None) -> Any:
    """``stream.send(request, timeout)`` with less around it (no shield: the future is
    the request's own, and a request that timed out leaves its answer unread)."""
    data, expected = messages.envelope(request)
    try:
        return await asyncio.wait_for(stream._submit(data, expected), timeout)
    except asyncio.TimeoutError as exc:
        if isinstance(exc, errors.DmEnvRpcClientError):  # the request's own error: keep it
            raise
        name = type(request).__name__
        raise errors.RequestTimeoutError(
            _REQUEST_TIMEOUT.format(expected=name, timeout=timeout)
        ) from None


class Made:
    """What opening one world made on its server so far (for ``undo_worlds``)."""

    __slots__ = ("connection", "created", "joining")

    def __init__(self, connection: LoopConnection) -> None:
        self.connection = connection
        self.created: str | None = None  # the name of the world it created
        self.joining = False  # a JoinWorldRequest went out (it may have been joined)


def undo_worlds(runner: LoopThread, made: Mapping[int, Made], timeout: float | None) -> None:
    """Leaves every world a failed connect joined and destroys every one it created, all at
    once, each on its own stream, within ``UNDO_TIMEOUT`` s (or ``timeout`` if shorter); never
    raises (a refusal or a dead stream leaves nothing more to do)."""
    bound = UNDO_TIMEOUT if timeout is None else min(timeout, UNDO_TIMEOUT)
    undo = [record for record in made.values() if record.joining or record.created]
    if not undo or runner.closed:
        return

    async def undo_one(record: Made) -> None:
        stream = record.connection.async_connection
        if record.joining:
            with contextlib.suppress(Exception):
                await ask(stream, dm_env_rpc_pb2.LeaveWorldRequest(), bound)
        if record.created is not None:
            request = dm_env_rpc_pb2.DestroyWorldRequest(world_name=record.created)
            with contextlib.suppress(Exception):
                await ask(stream, request, bound)

    async def undo_all() -> None:
        await asyncio.gather(*(undo_one(record) for record in undo), return_exceptions=True)

    with contextlib.suppress(Exception):
        runner.run(undo_all(), timeout=2 * bound + 1.0)
