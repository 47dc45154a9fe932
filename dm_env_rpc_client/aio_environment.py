"""``AsyncDmEnvAdaptor``: a remote dm_env_rpc world for asyncio, and the async world helpers.

The asyncio counterpart of ``DmEnvAdaptor``, over an ``AsyncConnection``. It
shares all of its non-I/O logic with the sync adaptor (``AdaptorCore``: the
step-type state machine, reward/discount routing, packing and decoding), so the
TimeSteps are the same; only the waiting is ``await``::

    import dm_env_rpc_client as dmr

    async def play(address):
        env, world_name = await dmr.create_and_join_world_async(address, {"seed": 1}, {})
        async with env:                      # leaves and destroys the world at the end
            timestep = await env.reset()
            timestep = await env.step({"paddle": 1})
            async for timestep in env.step_iter([{"paddle": 0}] * 100, in_flight=8):
                ...

``step_iter`` keeps up to ``in_flight`` steps on the wire and yields their
TimeSteps in request order; it takes a plain or an async iterable of actions.
Nothing calls ``asyncio.run``: it works inside a running loop (Jupyter).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

import dm_env

from . import errors
from ._adaptor.core import AdaptorCore, pack_settings
from ._adaptor.keywords import check_adaptor_kwargs
from ._adaptor.stacked import StackedDecoder
from ._base import checks as _checks
from ._fastpath.wire_step import read_step
from ._proto import dm_env_rpc_pb2
from .aio import AsyncConnection, connect_async
from .connection import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT

_NOT_ASYNC = (
    "{caller} takes an AsyncConnection (await dmr.connect_async(address)) or an address "
    "string 'host:port'; got {type_name}.{hint}"
)
_SYNC_HINT = " For a sync Connection use dmr.create_and_join_world and DmEnvAdaptor."
_AWAIT_HINT = " It is a coroutine: `await` it first (a missing `await`?)."


def _async_connection(connection: Any, caller: str) -> AsyncConnection:
    if isinstance(connection, AsyncConnection):
        return connection
    hint = ""
    if asyncio.iscoroutine(connection):
        hint = _AWAIT_HINT
        connection.close()  # it can never run now: spare the "never awaited" warning
    elif callable(getattr(connection, "send", None)):
        hint = _SYNC_HINT
    raise errors.ArgumentTypeError(
        _NOT_ASYNC.format(caller=caller, type_name=type(connection).__name__, hint=hint)
    )


class AsyncDmEnvAdaptor(AdaptorCore):
    """A joined dm_env_rpc world for asyncio: ``await env.reset()``, ``await env.step(action)``.

    The methods and TimeSteps are those of ``DmEnvAdaptor`` (specs, ``reward()``
    and ``discount()`` overrides, ``step_request``/``step_response``), with
    ``reset``, ``step`` and ``aclose`` awaitable and ``step_iter`` an async
    iterator.

    Args:
      connection: an ``AsyncConnection``.
      specs: the ``ActionObservationSpecs`` from the JoinWorldResponse.
      requested_observations: observation names to return; None returns all
        (without ``reward`` and ``discount``, which go into the TimeStep).
      nested_tensors: give and take nested dicts for dotted names.
      validate: check actions against their specs before sending.
      world_name: the joined world's name.
      destroy_on_close: also destroy the world on ``aclose()``.
      timeout: seconds to wait for each response in ``step``, ``reset``,
        ``step_iter`` and ``aclose`` (default ``DEFAULT_TIMEOUT``, 60 s; as
        ``DmEnvAdaptor``); None waits until the response or the stream's end
        (a stopped or unreachable server ends it within
        ``KEEPALIVE_DETECTION_S``, 350 s).
      copy_observations: False gives large observations as read-only views of
        the response's bytes, without a copy, where they are aligned (as
        ``DmEnvAdaptor``, in ``step``, ``step_iter`` and ``reset``).
    """

    def __init__(
        self,
        connection: AsyncConnection,
        specs: dm_env_rpc_pb2.ActionObservationSpecs,
        requested_observations: Iterable[str] | None = None,
        nested_tensors: bool = True,
        *,
        validate: bool = True,
        world_name: str | None = None,
        destroy_on_close: bool = False,
        timeout: float | None = DEFAULT_TIMEOUT,
        copy_observations: bool = True,
    ) -> None:
        self._connection = _async_connection(connection, "AsyncDmEnvAdaptor")
        _checks.check_adaptor_arguments(specs, requested_observations, None, timeout)
        self._timeout = timeout
        self._destroy_on_close = destroy_on_close
        self._owns_connection = False  # set by the helpers that connected to an address
        super().__init__(
            specs,
            requested_observations,
            nested_tensors,
            validate=validate,
            world_name=world_name,
            copy_observations=copy_observations,
        )

    @property
    def connection(self) -> AsyncConnection:
        """The connection this environment talks over."""
        return self._connection

    async def reset(
        self, timeout: float | None = None, *, settings: Mapping[str, Any] | None = None
    ) -> dm_env.TimeStep:
        """Starts a new sequence: a ResetRequest, then the first step.

        Args:
          timeout: seconds to wait for each of the two responses (default: the
            adaptor's ``timeout``).
          settings: ResetRequest settings (nested dicts of Python or NumPy values).

        Raises:
          InvalidArgumentError: the server refused the settings.
          RequestTimeoutError: no response within the timeout.
        """
        self._check_open()
        timeout = self._timeout if timeout is None else _checks.check_seconds(timeout)
        request = dm_env_rpc_pb2.ResetRequest(settings=pack_settings(settings))
        self._reset_done(await self._connection.send(request, timeout))
        return await self._step({}, timeout)

    async def step(self, action: Mapping[str, Any]) -> dm_env.TimeStep:
        """Takes one step with an action keyed by name (nested dicts for dotted names).

        Raises:
          UnknownNameError: for an action name not in the specs (lists the known ones).
          SpecValidationError: for a wrong dtype, shape or bound, or an action that is
            not a dict.
          DmEnvRpcError: the server refused the step.
          ProtocolError: an impossible state transition.
          RequestTimeoutError: no response within the adaptor's ``timeout``.
        """
        return await self._step(action, self._timeout)

    async def _step(self, action: Mapping[str, Any], timeout: float | None) -> dm_env.TimeStep:
        # As bytes (most actions without building messages), as in the sync adaptor; read_step:
        # a large payload is copied at most once (_wire_step).
        data, expected, name = self._step_data(action)
        response = await self._connection._send_bytes(
            data, expected, name, timeout, None, read_step
        )
        return self.step_response(response)

    async def step_iter(
        self,
        actions: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
        in_flight: int = 8,
    ) -> AsyncIterator[dm_env.TimeStep]:
        """Steps through ``actions`` with up to ``in_flight`` requests pending; yields in order.

        As ``DmEnvAdaptor.step_iter``: each wait for the oldest step also takes
        every later step that has already finished, and decodes their
        observations together. If the loop stops early, the steps still in
        flight are awaited (their TimeSteps dropped) so that the state machine
        stays in step with the server.

        Args:
          actions: an iterable or async iterable of actions.
          in_flight: the most steps on the wire at once.

        As there, an action is taken from ``actions`` only when there is room to
        send it; one taken that could not be sent is on the error as
        ``unsent_action``.

        Raises:
          UnknownNameError: for an action name not in the specs.
          SpecValidationError: for a wrong dtype, shape or bound.
          DmEnvRpcError: the server refused a step.
          ProtocolError: a response of a state no step type describes (the
            steps before it are yielded first).
          ObservationError: a response contradicts the specs (the steps before
            it are yielded first).
          RequestTimeoutError: a step took longer than the adaptor's ``timeout``.
        """
        _checks.check_count(in_flight, "in_flight")
        decoder = StackedDecoder(self)
        window: collections.deque[tuple[str, asyncio.Future[Any]]] = collections.deque()
        source = _aiter(actions)
        try:
            while True:
                while len(window) >= in_flight:  # an error here takes no action
                    for timestep in self._run_timesteps(await self._finished(window), decoder):
                        yield timestep
                try:
                    action = await source.__anext__()
                except StopAsyncIteration:
                    break
                try:
                    data, expected, name = self._step_data(action)
                    slots = self._connection._slots  # a max_in_flight of the connection's own
                    if slots is not None:
                        await asyncio.wait_for(slots.acquire(), self._timeout)
                except BaseException as exc:
                    exc.unsent_action = action  # type: ignore[attr-defined]
                    raise
                window.append((name, self._connection._submit(data, expected, None, read_step)))
            while window:
                for timestep in self._run_timesteps(await self._finished(window), decoder):
                    yield timestep
        finally:
            if window:  # stopped early: keep the state machine in step with the server
                with contextlib.suppress(Exception):
                    for _ in self._run_timesteps(await self._finished(window, True), decoder):
                        pass

    async def _finished(
        self,
        window: collections.deque[tuple[str, asyncio.Future[Any]]],
        everything: bool = False,
    ) -> list[Any]:
        """The responses of the oldest step of ``window`` (awaiting it) and every finished one after it."""
        name, future = window.popleft()
        try:
            responses = [await asyncio.wait_for(asyncio.shield(future), self._timeout)]
        except asyncio.TimeoutError:
            if future.done():
                raise
            raise errors.RequestTimeoutError(
                f"No response to the {name} request within {self._timeout} s."
            ) from None
        while window and (everything or window[0][1].done()):
            if everything:
                await window[0][1]
            if window[0][1].exception() is not None:
                break
            responses.append(window.popleft()[1].result())
        return responses

    async def aclose(self, timeout: float | None = None) -> None:
        """Leaves the world (once; idempotent), and destroys it if ``destroy_on_close``.

        As ``DmEnvAdaptor.close``: an adaptor made from an address also closes
        the connection it opened; a closed stream or a response that does not
        come within ``timeout`` ends the call quietly (a dead or hung server);
        a server that refuses the LeaveWorldRequest still gets the
        DestroyWorldRequest, then its error is raised.

        Args:
          timeout: seconds to wait for each response (default: the adaptor's
            ``timeout``, at most ``CLOSE_TIMEOUT``, 10 s).

        Raises:
          DmEnvRpcError: the server refused to leave or destroy the world.
        """
        timeout = self._close_timeout(timeout)  # a wrong timeout raises before anything closes
        if self._closed:
            return
        self._closed = True
        refused: errors.DmEnvRpcError | None = None
        try:
            try:
                await self._connection.send(dm_env_rpc_pb2.LeaveWorldRequest(), timeout)
            except errors.DmEnvRpcError as exc:
                refused = exc  # still destroy the world below
            if self._destroy_on_close and self.world_name is not None:
                request = dm_env_rpc_pb2.DestroyWorldRequest(world_name=self.world_name)
                await self._connection.send(request, timeout)
        except (errors.ConnectionClosedError, errors.RequestTimeoutError):
            pass  # the server is gone or hung: nothing more to do
        finally:
            if self._owns_connection:
                await self._connection.aclose()
        if refused is not None:
            raise refused

    async def __aenter__(self) -> AsyncDmEnvAdaptor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def _aiter(
    actions: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
) -> AsyncIterator[Mapping[str, Any]]:
    if isinstance(actions, AsyncIterable):
        async for action in actions:
            yield action
    else:
        for action in actions:
            yield action


# --- async world helpers -------------------------------------------------------------------


async def create_world_async(
    connection: AsyncConnection,
    create_world_settings: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> str:
    """Creates a world and returns its name (``create_world`` for asyncio).

    ``timeout``: seconds to wait for the response (default ``DEFAULT_TIMEOUT``,
    60 s; None waits until the response or the stream's end).

    Raises:
      InvalidArgumentError: the server refused the settings.
      RequestTimeoutError: no response within ``timeout`` seconds.
    """
    connection = _async_connection(connection, "create_world_async")
    settings = pack_settings(create_world_settings, "create_world_settings")
    request = dm_env_rpc_pb2.CreateWorldRequest(settings=settings)
    return (await connection.send(request, timeout)).world_name  # type: ignore[no-any-return]


async def _open(
    connection: AsyncConnection | str, caller: str, timeout: float | None
) -> tuple[AsyncConnection, bool]:
    if isinstance(connection, str):
        wait = DEFAULT_CONNECT_TIMEOUT if timeout is None else timeout
        return await connect_async(connection, timeout=wait), True
    return _async_connection(connection, caller), False


async def _join(
    connection: AsyncConnection,
    world_name: str,
    join_world_settings: Mapping[str, Any] | None,
    adaptor_kwargs: Mapping[str, Any],
) -> AsyncDmEnvAdaptor:
    timeout = adaptor_kwargs.get("timeout")
    request = dm_env_rpc_pb2.JoinWorldRequest(
        world_name=_checks.check_world_name(world_name),
        settings=pack_settings(join_world_settings, "join_world_settings"),
    )
    response = await connection.send(request, timeout)
    try:
        return AsyncDmEnvAdaptor(
            connection, response.specs, world_name=world_name, **adaptor_kwargs
        )
    except BaseException:
        with contextlib.suppress(Exception):  # raise the adaptor's error, not the cleanup's
            await leave_world_async(connection, timeout=timeout)
        raise


async def join_world_async(
    connection: AsyncConnection | str,
    world_name: str,
    join_world_settings: Mapping[str, Any] | None = None,
    **adaptor_kwargs: Any,
) -> AsyncDmEnvAdaptor:
    """Joins a world (``join_world`` for asyncio; an address makes an owned connection).

    Raises:
      TypeError: an unknown keyword (checked before anything is sent), or not an
        AsyncConnection or address.
      UnknownNameError: a requested observation the world does not have (the
        world is left again).
      DmEnvRpcError: the server refused the join.
    """
    check_adaptor_kwargs("join_world_async", adaptor_kwargs, AsyncDmEnvAdaptor)
    conn, owned = await _open(connection, "join_world_async", adaptor_kwargs.get("timeout"))
    adaptor_kwargs.setdefault("timeout", DEFAULT_TIMEOUT)
    try:
        env = await _join(conn, world_name, join_world_settings, adaptor_kwargs)
    except BaseException:
        if owned:
            await conn.aclose()
        raise
    env._owns_connection = owned
    return env


async def create_and_join_world_async(
    connection: AsyncConnection | str,
    create_world_settings: Mapping[str, Any] | None = None,
    join_world_settings: Mapping[str, Any] | None = None,
    **adaptor_kwargs: Any,
) -> tuple[AsyncDmEnvAdaptor, str]:
    """Creates a world and joins it (``create_and_join_world`` for asyncio).

    ``await env.aclose()`` (or ``async with env``) later leaves and destroys
    it. A failed join leaves and destroys the new world, so the connection
    stays usable; a misspelled keyword raises before anything is created.

    Args:
      connection: an ``AsyncConnection``, or an address ``"host:port"``, which is
        connected to (within ``timeout``, default ``DEFAULT_CONNECT_TIMEOUT``)
        and closed by ``env.aclose()``.
      create_world_settings: the CreateWorldRequest settings (nested dicts).
      join_world_settings: the JoinWorldRequest settings (nested dicts).
      **adaptor_kwargs: keywords of ``AsyncDmEnvAdaptor``.

    Returns:
      ``(env, world_name)``.

    Raises:
      TypeError: an unknown keyword, or not an AsyncConnection or address.
      ConnectTimeoutError: an address that did not answer.
      UnknownNameError: a requested observation the world does not have.
      DmEnvRpcError: the server refused the create or the join.
    """
    check_adaptor_kwargs("create_and_join_world_async", adaptor_kwargs, AsyncDmEnvAdaptor)
    conn, owned = await _open(
        connection, "create_and_join_world_async", adaptor_kwargs.get("timeout")
    )
    timeout = adaptor_kwargs.setdefault("timeout", DEFAULT_TIMEOUT)
    try:
        world_name = await create_world_async(conn, create_world_settings, timeout=timeout)
        try:
            env = await _join(
                conn, world_name, join_world_settings, {**adaptor_kwargs, "destroy_on_close": True}
            )
        except BaseException:
            with contextlib.suppress(Exception):  # raise the join's error, not the cleanup's
                await leave_world_async(conn, timeout=timeout)  # a no-op unless joined
                await destroy_world_async(conn, world_name, timeout=timeout)
            raise
    except BaseException:
        if owned:
            await conn.aclose()
        raise
    env._owns_connection = owned
    return env, world_name


async def leave_world_async(
    connection: AsyncConnection, *, timeout: float | None = DEFAULT_TIMEOUT
) -> None:
    """Leaves the joined world (a no-op when not joined); ``timeout`` as for ``create_world_async``."""
    conn = _async_connection(connection, "leave_world_async")
    await conn.send(dm_env_rpc_pb2.LeaveWorldRequest(), timeout)


async def destroy_world_async(
    connection: AsyncConnection, world_name: str, *, timeout: float | None = DEFAULT_TIMEOUT
) -> None:
    """Destroys a world (it must not be joined); ``timeout`` as for ``create_world_async``."""
    conn = _async_connection(connection, "destroy_world_async")
    request = dm_env_rpc_pb2.DestroyWorldRequest(world_name=_checks.check_world_name(world_name))
    await conn.send(request, timeout)


async def reset_world_async(
    connection: AsyncConnection,
    world_name: str,
    settings: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> None:
    """Resets a world for every joined connection, optionally with new settings.

    ``timeout`` as for ``create_world_async``.
    """
    conn = _async_connection(connection, "reset_world_async")
    request = dm_env_rpc_pb2.ResetWorldRequest(
        world_name=_checks.check_world_name(world_name), settings=pack_settings(settings)
    )
    await conn.send(request, timeout)
