"""``DmEnvAdaptor``: a remote dm_env_rpc world as a ``dm_env.Environment``, and world helpers.

::

    import dm_env_rpc_client as dmr

    with dmr.connect(address, timeout=10) as conn:
        env, world_name = dmr.create_and_join_world(conn, {"seed": 1}, {})
        timestep = env.reset()
        timestep = env.step({"paddle": 1})
        for timestep in env.step_iter([{"paddle": 0}] * 100, in_flight=8):
            ...
        env.close()

The adaptor adds the I/O (sync, over a ``Connection``) to ``AdaptorCore``
(``_adaptor.core``), which holds the step-type state machine and the
reward/discount rules: see that module for them.

``reset()`` sends a ResetRequest and takes the first step. If the server's
specs change on reset, the adaptor refreshes them (the reference package raises
instead); requested observation names that no longer exist raise
``UnknownNameError``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import dm_env
from google.protobuf import message

from . import connection as dm_env_rpc_connection  # noqa: F401 (reference name)
from . import errors, specs
from ._adaptor.core import (
    CLOSE_TIMEOUT,
    DISCOUNT,
    REWARD,
    AdaptorCore,
    State,
    StepFuture,
    pack_settings,
)
from ._adaptor.keywords import check_adaptor_kwargs
from ._adaptor.stacked import StackedDecoder
from ._adaptor.world_requests import create_world, destroy_world, leave_world, reset_world
from ._base import checks as _checks
from ._base.futures import TimedFuture
from ._fastpath.wire_step import read_step
from ._proto import dm_env_rpc_pb2
from ._transport.foreign import ForeignConnection, as_connection, compatible, note_destroyed
from ._transport.loop import LoopConnection
from .connection import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    Connection,
    ConnectionLike,
    connect,
    request_timeout,
    wait_response,
)
from .properties import PropertiesExtension

specs_table = specs.specs_table  # importable from here as before
# step_iter's steps in flight: the request (or its type's name, for a timeout), its Future.
_Window = collections.deque[tuple[message.Message | str, concurrent.futures.Future[Any]]]


_NO_ACTION: Any = object()  # step_iter's actions ran out


class DmEnvAdaptor(AdaptorCore, dm_env.Environment):
    """A joined dm_env_rpc world as a ``dm_env.Environment``.

    Args:
      connection: a ``Connection``; or anything with the reference's ``send(request)``
        (a reference connection, a mock), which then gets every request through it.
      specs: the ``ActionObservationSpecs`` from the JoinWorldResponse.
      requested_observations: observation names to return; None returns all
        (without ``reward`` and ``discount``, which go into the TimeStep).
      nested_tensors: give and take nested dicts for dotted names.
      extensions: ``{attribute name: extension}``, set on the adaptor as the
        reference's are (``properties`` replaces ``env.properties``).
      validate: check actions against their specs before sending.
      world_name: the joined world's name, for display and for ``close``.
      destroy_on_close: also destroy the world on ``close()`` (set by
        ``create_and_join_world``).
      timeout: seconds to wait for each response in ``step``, ``reset`` and
        ``close`` (default ``DEFAULT_TIMEOUT``, 60 s); None waits until the
        response or the stream's end. A step that times out raises
        ``RequestTimeoutError``; its late response, when it comes, still moves
        the step-type state machine on, so later steps keep their right types.
      copy_observations: True (the default) gives writable arrays of their own.
        False gives each large float, double, int8 or uint8 observation as a
        read-only view of the response's bytes, no copy (writing raises
        ``ValueError``: ``.copy()`` it first), where it is aligned for its dtype
        over a ``Connection``; else the usual copy ("Zero-copy observations" in
        the environment guide).
    """

    def __init__(
        self,
        connection: ConnectionLike,
        specs: dm_env_rpc_pb2.ActionObservationSpecs,
        requested_observations: Iterable[str] | None = None,
        nested_tensors: bool = True,
        extensions: Mapping[str, Any] | None = None,
        *,
        validate: bool = True,
        world_name: str | None = None,
        destroy_on_close: bool = False,
        timeout: float | None = DEFAULT_TIMEOUT,
        copy_observations: bool = True,
    ) -> None:
        self._connection = as_connection(connection, "DmEnvAdaptor")
        _checks.check_adaptor_arguments(specs, requested_observations, extensions, timeout)
        self._timeout = timeout
        self._destroy_on_close = destroy_on_close
        self._owns_connection = False  # set by the helpers that connected to an address
        self._properties: PropertiesExtension | None = None
        super().__init__(
            specs,
            requested_observations,
            nested_tensors,
            validate=validate,
            world_name=world_name,
            copy_observations=copy_observations,
        )
        self._attach_extensions(extensions)

    # --- dm_env.Environment ---------------------------------------------------------------

    def reset(
        self, timeout: float | None = None, *, settings: Mapping[str, Any] | None = None
    ) -> dm_env.TimeStep:
        """Starts a new sequence: a ResetRequest, then the first step.

        Args:
          timeout: seconds to wait for each of the two responses (default: the
            adaptor's ``timeout``).
          settings: ResetRequest settings (nested dicts of Python or NumPy
            values), e.g. ``{"seed": 3}`` for a server that takes a seed there.

        Raises:
          InvalidArgumentError: the server refused the settings.
        """
        self._check_open()
        timeout = self._timeout if timeout is None else _checks.check_seconds(timeout)
        request = dm_env_rpc_pb2.ResetRequest(settings=pack_settings(settings))
        self._reset_done(compatible(self._connection).send(request, timeout))
        return self._step({}, timeout)

    def step(self, action: Mapping[str, Any]) -> dm_env.TimeStep:
        """Takes one step with an action keyed by name (nested dicts for dotted names).

        Raises:
          UnknownNameError: for an action name not in the specs (lists the known ones).
          SpecValidationError: for a wrong dtype, shape or bound.
          DmEnvRpcError: the server refused the step.
          ProtocolError: an impossible state transition.
          RequestTimeoutError: no response within the adaptor's ``timeout``.
        """
        return self._step(action, self._timeout)

    def _step(self, action: Mapping[str, Any], timeout: float | None) -> dm_env.TimeStep:
        request, future = self._send_step(action)
        try:
            response = wait_response(future, timeout, request)
        except errors.RequestTimeoutError:
            # The step stays in flight: when its response comes, it still moves the state
            # machine on (in request order), so the next step's type is right.
            future.add_done_callback(self._advance_late)
            raise
        return self.step_response(response)

    def _advance_late(self, future: concurrent.futures.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            with contextlib.suppress(errors.ProtocolError):
                self._advance(future.result().state)

    def _send_step(
        self,
        action: Mapping[str, Any],
        decode: Callable[[bytes], Any] = read_step,
        future: concurrent.futures.Future[Any] | None = None,
    ) -> tuple[message.Message | str, concurrent.futures.Future[Any]]:
        """Sends a step (as bytes over a ``Connection``: ``_step_data``); returns the request or its
        type's name (for a timeout's message) and its Future: ``future`` if given, resolved with
        ``decode(response bytes)`` over a ``Connection``, else with the StepResponse. A
        replaced ``send`` gets the request (``_transport.foreign.compatible``)."""
        connection = compatible(self._connection)
        if isinstance(connection, (Connection, LoopConnection)):  # a batch's world: the latter
            data, expected, name = self._step_data(action)
            return name, connection._submit_bytes(data, expected, decode, future)
        request = self.step_request(action)
        return request, connection.send_async(request)

    def _filed_step(self, data: bytes) -> tuple[dm_env.StepType, Any]:
        # On the reader thread, in response order: the state machine only (see StepFuture).
        response = read_step(data)
        return self._advance(response.state), response

    def step_async(self, action: Mapping[str, Any]) -> concurrent.futures.Future[dm_env.TimeStep]:
        """Sends a step at once and returns a Future of its TimeStep.

        Steps may be pipelined; step types follow request order, across sequence
        boundaries. Use one thread per environment. Over a ``Connection``, each
        TimeStep is made on its Future's first ``result()`` (``StepFuture``).

        Raises:
          UnknownNameError: for an action name not in the specs.
          SpecValidationError: for a wrong dtype, shape or bound.

        The Future fails with ``DmEnvRpcError`` (the server refused the step),
        ``ObservationError`` (the response contradicts the specs),
        ``ProtocolError`` (an impossible state transition) or
        ``ConnectionClosedError``; its ``result(timeout)`` raises
        ``RequestTimeoutError`` (also a ``concurrent.futures.TimeoutError``)
        with a message when no response came within ``timeout``.
        """
        connection = compatible(self._connection)
        if isinstance(connection, Connection):
            return self._send_step(action, self._filed_step, StepFuture(self._timestep))[1]
        request = self.step_request(action)
        result: concurrent.futures.Future[dm_env.TimeStep] = TimedFuture()
        sent = connection.send_async(request)

        def convert(done: concurrent.futures.Future[Any]) -> None:
            try:
                result.set_result(self.step_response(done.result()))
            except BaseException as exc:
                result.set_exception(exc)

        sent.add_done_callback(convert)
        return result

    def step_iter(
        self, actions: Iterable[Mapping[str, Any]], in_flight: int = 8
    ) -> Iterator[dm_env.TimeStep]:
        """Steps through ``actions`` with up to ``in_flight`` requests pending; yields in order.

        When the window is full it waits for its oldest half (``in_flight // 2``
        steps) to finish, takes every finished step, decodes their observations
        together (one NumPy call per observation, see ``_fastpath.decode``) and refills
        the window: one wake-up and one decode per half window instead of per
        step, while the server always has the other half to work on. The
        TimeSteps are the same as ``step`` gives.

        It takes an action from ``actions`` only when there is room to send it
        at once, so when it raises, every action it took was sent, except one
        it could not send: that one is on the error as ``unsent_action``, and
        the caller may send it again (an iterator passed in resumes with the
        action after it).

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
        window: _Window = collections.deque()
        run = max(1, in_flight // 2)
        source = iter(actions)
        try:
            while True:
                while len(window) >= in_flight:  # an error here takes no action
                    yield from self._finished_steps(window, decoder, run)
                action = next(source, _NO_ACTION)
                if action is _NO_ACTION:
                    break
                try:
                    window.append(self._send_step(action))
                except BaseException as exc:
                    exc.unsent_action = action  # type: ignore[attr-defined]
                    raise
            while window:
                yield from self._finished_steps(window, decoder, run)
        finally:
            # Stopped early or by an error: the answers of the steps still in the window
            # move the state machine on as they come (in request order), so the next step
            # gets its right type.
            for _, late in window:
                late.add_done_callback(self._advance_late)

    def _finished_steps(
        self,
        window: _Window,
        decoder: StackedDecoder,
        run: int,
    ) -> Iterator[dm_env.TimeStep]:
        """The oldest ``run`` steps of ``window`` (waiting for them) and every finished one after.

        Responses come in request order, so waiting for the ``run``-th oldest
        waits for all of them: the caller's thread wakes once per ``run`` steps,
        not once per step, while the server still has the rest of the window to
        work on. Only the oldest step's error is raised here; a later one's is
        raised once the steps before it have been yielded (none is dropped).
        """
        request, future = window[0]
        last = window[min(run, len(window)) - 1][1]
        concurrent.futures.wait([last], self._timeout)  # one wake-up: answers come in order
        if not future.done():  # not even the oldest answered in time
            raise request_timeout(request, self._timeout)
        responses = [future.result()]  # raises the oldest step's own error (none before it)
        window.popleft()
        while window and window[0][1].done() and window[0][1].exception() is None:
            responses.append(window.popleft()[1].result())
        yield from self._run_timesteps(responses, decoder)

    @property
    def connection(self) -> ConnectionLike:
        """The connection this environment talks over."""
        return self._connection

    @property
    def properties(self) -> PropertiesExtension:
        """The properties extension over this environment's connection."""
        if self._properties is None:
            self._properties = PropertiesExtension(self._connection)
        return self._properties

    def close(self, timeout: float | None = None) -> None:
        """Leaves the world (once; idempotent), and destroys it if ``destroy_on_close``.

        An adaptor made from an address (``create_and_join_world("host:port")``)
        also closes the connection it opened. Gives up quietly on a dead or hung
        server: a closed stream or a response that does not come within
        ``timeout`` ends the call without an error. A server that refuses the
        LeaveWorldRequest still gets the DestroyWorldRequest, then its error is raised.

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
        self._release_extensions()
        refused: errors.DmEnvRpcError | None = None
        connection = compatible(self._connection)
        try:
            try:
                connection.send(dm_env_rpc_pb2.LeaveWorldRequest(), timeout)
            except errors.DmEnvRpcError as exc:
                refused = exc  # still destroy the world below
            if self._destroy_on_close and self.world_name is not None:
                connection.send(
                    dm_env_rpc_pb2.DestroyWorldRequest(world_name=self.world_name), timeout
                )
                note_destroyed(self._connection, self.world_name)
        except (errors.ConnectionClosedError, errors.RequestTimeoutError):
            pass  # the server is gone or hung: nothing more to do
        finally:
            if self._owns_connection:
                self._connection.close()
        if refused is not None:
            raise refused

    def _repr_html_(self) -> str:
        from . import display  # presentation: only when rendered

        return display.environment_html(
            "DmEnvAdaptor",
            {"world": self.world_name, "address": getattr(self._connection, "address", None)},
            *self._spec_rows(),
        )


# --- world helpers -----------------------------------------------------------------------------


def _open(
    connection: ConnectionLike | str, caller: str, timeout: float | None
) -> tuple[ConnectionLike, bool]:
    """The connection to use, and whether the caller opened it (from an address string)."""
    if isinstance(connection, str):
        return connect(
            connection, timeout=DEFAULT_CONNECT_TIMEOUT if timeout is None else timeout
        ), True
    return as_connection(connection, caller, takes_address=True), False


class CreateAndJoinResult(NamedTuple):
    """What ``create_and_join_world`` returns."""

    env: DmEnvAdaptor
    world_name: str


def join_world(
    connection: ConnectionLike | str,
    world_name: str,
    join_world_settings: Mapping[str, Any] | None = None,
    **adaptor_kwargs: Any,
) -> DmEnvAdaptor:
    """Joins a world and returns it as a DmEnvAdaptor (``adaptor_kwargs`` go to it).

    If the adaptor cannot be made after the server let us join (an unknown
    ``requested_observations`` name), the world is left again, so the
    connection stays usable. An adaptor ``timeout=`` also bounds the wait for
    the join.

    Args:
      connection: a ``Connection``; an object with the reference package's
        ``send(request)``; or an address ``"host:port"``, which is connected to
        (within ``timeout``, default ``DEFAULT_CONNECT_TIMEOUT``) and closed by
        ``env.close()``.
      world_name: the world to join.
      join_world_settings: the JoinWorldRequest settings.
      **adaptor_kwargs: keywords of ``DmEnvAdaptor``.

    Raises:
      TypeError: an unknown keyword (checked before anything is sent), or not a connection.
      UnknownNameError: a requested observation the world does not have.
      DmEnvRpcError: the server refused the join.
    """
    check_adaptor_kwargs("join_world", adaptor_kwargs, DmEnvAdaptor)
    conn, owned = _open(connection, "join_world", adaptor_kwargs.get("timeout"))
    adaptor_kwargs.setdefault("timeout", DEFAULT_TIMEOUT)
    try:
        env = _join(conn, world_name, join_world_settings, adaptor_kwargs)
    except BaseException:
        if owned:
            conn.close()
        raise
    env._owns_connection = owned
    return env


def _join(
    connection: ConnectionLike,
    world_name: str,
    join_world_settings: Mapping[str, Any] | None,
    adaptor_kwargs: Mapping[str, Any],
) -> DmEnvAdaptor:
    timeout = adaptor_kwargs.get("timeout")
    request = dm_env_rpc_pb2.JoinWorldRequest(
        world_name=_checks.check_world_name(world_name),
        settings=pack_settings(join_world_settings, "join_world_settings"),
    )
    response = compatible(connection).send(request, timeout)
    try:
        return DmEnvAdaptor(connection, response.specs, world_name=world_name, **adaptor_kwargs)
    except BaseException:
        with contextlib.suppress(Exception):  # raise the adaptor's error, not the cleanup's
            leave_world(connection, timeout=timeout)
        raise


def create_and_join_world(
    connection: ConnectionLike | str,
    create_world_settings: Mapping[str, Any] | None = None,
    join_world_settings: Mapping[str, Any] | None = None,
    **adaptor_kwargs: Any,
) -> CreateAndJoinResult:
    """Creates a world and joins it; ``env.close()`` later leaves and destroys it.

    Over an object with the reference's ``send(request)`` (a reference
    connection), ``env.close()`` only leaves, as the reference's adaptor does.
    Code written for the reference that destroys the world after ``env.close()``
    works over an SDK ``Connection`` too: that request is answered as done.

    If the join fails, the world is left (if it was joined) and destroyed, so
    the connection stays usable, and the join's error is raised (never an
    error of that cleanup). A misspelled keyword raises before anything is
    created. An adaptor ``timeout=`` bounds every call, these included.

    Args:
      connection: a ``Connection``; an object with the reference package's
        ``send(request)``; or an address ``"host:port"``, which is connected to
        (within ``timeout``, default ``DEFAULT_CONNECT_TIMEOUT``) and closed by
        ``env.close()``.
      create_world_settings: the CreateWorldRequest settings (nested dicts).
      join_world_settings: the JoinWorldRequest settings (nested dicts).
      **adaptor_kwargs: keywords of ``DmEnvAdaptor`` (``requested_observations``,
        ``timeout``, ``copy_observations``, ...).

    Returns:
      ``(env, world_name)``.

    Raises:
      TypeError: an unknown keyword, or not a connection (the message says what to pass).
      ConnectTimeoutError: an address that did not answer.
      UnknownNameError: a requested observation the world does not have.
      DmEnvRpcError: the server refused the create or the join.
    """
    check_adaptor_kwargs("create_and_join_world", adaptor_kwargs, DmEnvAdaptor)
    conn, owned = _open(connection, "create_and_join_world", adaptor_kwargs.get("timeout"))
    timeout = adaptor_kwargs.setdefault("timeout", DEFAULT_TIMEOUT)
    try:
        world_name = create_world(conn, create_world_settings, timeout=timeout)
        try:
            # Over a reference connection the reference's code around it destroys the world.
            destroy = not isinstance(conn, ForeignConnection)
            env = _join(
                conn,
                world_name,
                join_world_settings,
                {**adaptor_kwargs, "destroy_on_close": destroy},
            )
        except BaseException:
            with contextlib.suppress(Exception):  # raise the join's error, not the cleanup's
                leave_world(conn, timeout=timeout)  # a no-op unless the join went through
                destroy_world(conn, world_name, timeout=timeout)
            raise
    except BaseException:
        if owned:
            conn.close()
        raise
    env._owns_connection = owned
    return CreateAndJoinResult(env, world_name)


__all__ = [
    "CLOSE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DISCOUNT",
    "REWARD",
    "CreateAndJoinResult",
    "DmEnvAdaptor",
    "State",
    "create_and_join_world",
    "create_world",
    "destroy_world",
    "join_world",
    "leave_world",
    "pack_settings",
    "reset_world",
    "specs_table",
]
