"""Serve any ``dm_env.Environment`` over dm_env_rpc, on a real gRPC port.

``serve(make_env)`` starts a server; each CreateWorldRequest calls
``make_env(settings)`` with the unpacked create settings (a nested dict) and
puts the environment it returns behind the protocol::

    import dm_env_rpc_client as dmr
    from dm_env_rpc_client.server.catch import Catch

    with dmr.serve(lambda settings: Catch(**settings)) as server:
        print(server.address)  # e.g. 127.0.0.1:38541

A class works as well as a factory: ``serve(Catch)`` makes each world with
``Catch(**settings)``, the create settings as keyword arguments.

Behaviour, in the protocol's terms:

- World names are ``world-1``, ``world-2``, ... A JoinWorldRequest for the empty
  name ``""`` when no CreateWorldRequest made it joins a *default world*, created
  on the spot with ``make_env({})`` and owned by that connection.
- Specs: the environment's ``action_spec()`` and ``observation_spec()``,
  flattened to dotted names, numbered from UID 1 in sorted-name order; the
  ``reward_spec()`` and ``discount_spec()`` are offered as the observations
  ``reward`` and ``discount``; on the first step of a sequence, where dm_env
  gives None, they are sent as 0 and 1.
- A step that LASTs with discount 0 reports TERMINATED; with discount > 0
  (truncation) INTERRUPTED. Actions a StepRequest leaves out take their spec's
  ``generate_value()``.
- One connection joins a world at a time. When a connection ends, it leaves its
  world and every world it created is destroyed.
- Multi-agent worlds: when ``make_env`` returns a ``MultiAgentEnvironment``
  (``server.multiagent``), each JoinWorldRequest is one of its agents (join
  setting ``agent``: an index or a name; else the first free one), steps go in
  lockstep or in turns, and a step that waits for other agents is answered
  DEADLINE_EXCEEDED after ``agent_timeout`` seconds, naming them (docs/multiagent.md).
- Reset settings: the settings of a ResetRequest or ResetWorldRequest go to the
  environment's ``dm_env_rpc_reset_settings(settings)`` method (a nested dict),
  before the next sequence starts; an environment without it refuses them
  (INVALID_ARGUMENT). Catch takes ``seed``.
- Properties: an environment with a ``dm_env_rpc_properties()`` method returning
  ``{key: Property}`` serves the properties extension (``server.properties``).
- An exception inside the environment becomes an error Status (INVALID_ARGUMENT
  for bad settings, INTERNAL otherwise) carrying its type and message; the stream
  goes on.
- Every stream is served on one ``grpc.aio`` event loop in a background thread;
  environments are stepped there, one request at a time. A multi-agent step that
  waits holds up only its own stream.
- Strangers kept out: with ``token=``, a stream whose metadata lacks
  ``authorization: Bearer <token>`` (``dmr.token_metadata(token)``) is ended with
  UNAUTHENTICATED and a message saying what is missing, or that the token is wrong
  (never repeating it); tokens are compared in constant time. With ``credentials=
  grpc.ssl_server_credentials(..., root_certificates=CA, require_client_auth=True)``,
  only clients with a certificate signed by CA get through the TLS handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import dm_env
import grpc

from .. import errors
from .._base import checks as _checks
from .._base import tokens as _tokens
from .._proto import dm_env_rpc_pb2
from .._transport.loop import LoopThread
from ._registry import DEFAULT_AGENT_TIMEOUT, Registry
from ._session import Session
from .multiagent import MultiAgentEnvironment
from .properties import Property

METHOD = "/dm_env_rpc.v1.Environment/Process"
_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # Without this, a second server on a port in use binds it too and takes half the clients.
    ("grpc.so_reuseport", 0),
    # Clients may watch this server with keepalive pings every 10 s while it is idle
    # (dmr.FAST_KEEPALIVE_OPTIONS); gRPC's default policy allows one per 5 minutes only.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
_START_TIMEOUT = 30.0
_STOP_SLACK = 2.0  # seconds stop() waits for the loop beyond the grace period
_REFUSE_READ = 1.0  # seconds a refused stream waits for the client's first request
_END = object()
_Future = asyncio.Future
_TOO_MANY_STREAMS = (
    "This server serves at most {limit} streams at once (one per world) and all are in use. "
    "Start it with more (serve --max-workers N, or serve(..., max_workers=N)), "
    "or spread the worlds over more servers."
)

MakeEnv = Callable[[dict[str, Any]], dm_env.Environment | MultiAgentEnvironment]
EnvClass = type[dm_env.Environment] | type[MultiAgentEnvironment]
_NOT_A_FACTORY = (
    "make_env is a factory, called with each world's settings, not {kind}. Pass "
    "{hint}lambda settings: MyEnv(**settings), or the environment class itself."
)


def check_factory(make_env: Any) -> None:
    """Refuses a ``make_env`` that is not a factory or a class (an environment instance).

    Raises:
      ArgumentTypeError: naming ``make_env`` and what to pass (for an instance, its class).
    """
    instance = isinstance(make_env, (dm_env.Environment, MultiAgentEnvironment))
    if instance or not callable(make_env):
        hint = f"{type(make_env).__name__} (the class), " if instance else ""
        raise errors.ArgumentTypeError(
            _NOT_A_FACTORY.format(kind=_checks.kind(make_env), hint=hint)
        )


def _factory(make_env: MakeEnv | EnvClass) -> MakeEnv:
    """``make_env`` itself, or for a class one that passes the settings as keyword arguments."""
    if not isinstance(make_env, type):
        return make_env
    env_class = make_env

    def make(settings: dict[str, Any]) -> dm_env.Environment | MultiAgentEnvironment:
        return env_class(**settings)

    return make


def _serialize(response: Any) -> bytes:
    """Responses are messages, or wire bytes already (steps)."""
    if isinstance(response, (bytes, bytearray)):
        return bytes(response)
    return response.SerializeToString()


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Ends the stream with ``code``: raises, as ``context.abort`` does."""
    # Take the client's first request before refusing: a client whose write fails
    # on the aborted stream sees "Internal error from Core" instead of this status.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(context.read(), _REFUSE_READ)
    await context.abort(code, message)


class Server:
    """A running dm_env_rpc server; a context manager that stops it on exit.

    The server runs on one ``grpc.aio`` event loop in a daemon thread: every
    stream's requests are answered there, one at a time, so the environments
    need no locks, and a step that blocks holds up the other streams too.

    Attributes:
      address: ``host:port`` to connect to (the real port when 0 was asked for).
    """

    def __init__(
        self,
        make_env: MakeEnv | EnvClass,
        address: str = "127.0.0.1:0",
        *,
        credentials: grpc.ServerCredentials | None = None,
        max_workers: int = 64,
        agent_timeout: float = DEFAULT_AGENT_TIMEOUT,
        token: str | None = None,
    ) -> None:
        check_factory(make_env)
        _checks.check_address(address, listen=True)
        _checks.check_count(max_workers, "max_workers")
        _checks.check_seconds(agent_timeout, "agent_timeout", allow_none=False)
        self._token = None if token is None else _tokens.check_token(token)
        self._registry = Registry(_factory(make_env), agent_timeout)
        self._stopped = False
        self._max_streams = max_workers
        self._streams = 0  # open streams; only the event loop touches it
        self._runner = LoopThread(name="dm_env_rpc_server-loop")
        try:
            self._server, port = self._runner.run(self._start(address, credentials), _START_TIMEOUT)
        except BaseException:
            self._runner.close()
            raise
        host = address.rsplit(":", 1)[0]
        self.address = f"{host}:{port}"

    async def _start(
        self, address: str, credentials: grpc.ServerCredentials | None
    ) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=_OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(
            self._process,
            request_deserializer=dm_env_rpc_pb2.EnvironmentRequest.FromString,
            response_serializer=_serialize,
        )
        service, method = METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service, {method: handler})]
        )
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"Cannot bind the dm_env_rpc server to {address!r}; pick another port.")
        await server.start()
        return server, port

    async def _process(
        self,
        requests: AsyncIterator[dm_env_rpc_pb2.EnvironmentRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """One stream: a reader task answers requests in order; this task sends the answers.

        Each send is awaited until it completes; meanwhile the reader takes and
        answers the requests a pipelining client has already sent, so their
        answers are ready when the send is done.
        """
        if self._token is not None:
            refusal = _tokens.refusal(context.invocation_metadata(), self._token)
            if refusal is not None:
                await _refuse(context, grpc.StatusCode.UNAUTHENTICATED, refusal)
        if self._streams >= self._max_streams:
            await _refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                _TOO_MANY_STREAMS.format(limit=self._max_streams),
            )
        self._streams += 1
        session = Session(self._registry)
        answers: asyncio.Queue[Any] = asyncio.Queue()

        async def answer() -> None:
            # context.read() rather than iterating ``requests``: the same messages in the same
            # order, without the async generator gRPC wraps around it (a cost per request).
            read, handle, put = context.read, session.handle, answers.put_nowait
            try:
                while (request := await read()) is not grpc.aio.EOF:
                    put(answer := handle(request))
                    if type(answer) is _Future:  # a multi-agent step: the next request waits
                        await asyncio.wait((answer,))
            finally:
                put(_END)

        reader = asyncio.ensure_future(answer())
        try:
            while (response := await answers.get()) is not _END:
                if type(response) is _Future:
                    response = await response
                await context.write(response)
            await reader  # raises what ended the reading, if anything but the stream's end
        finally:
            self._streams -= 1
            reader.cancel()
            session.close()

    def stop(self, grace: float | None = None) -> None:
        """Stops serving (idempotent); open streams end after ``grace`` seconds.

        Bounded even when an environment's step never returns (it holds the
        event loop): after ``grace`` plus a few seconds, ``stop`` gives up
        waiting for the loop and returns; its daemon thread ends with the step.
        """
        if self._stopped:
            return
        self._stopped = True
        try:
            with contextlib.suppress(errors.RequestTimeoutError):
                self._runner.run(self._server.stop(grace), (grace or 0.0) + _STOP_SLACK)
        finally:
            self._registry.close()
            self._runner.close(timeout=1.0)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops; returns False on timeout."""
        if self._stopped:
            return True
        try:
            return self._runner.run(self._server.wait_for_termination(timeout))
        except Exception:
            if self._stopped:  # stopped from another thread while waiting
                return True
            raise

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Server(address={self.address!r}, stopped={self._stopped})"


@_checks.keywords_checked
def serve(
    make_env: MakeEnv | EnvClass,
    address: str = "127.0.0.1:0",
    *,
    credentials: grpc.ServerCredentials | None = None,
    max_workers: int = 64,
    agent_timeout: float = DEFAULT_AGENT_TIMEOUT,
    token: str | None = None,
) -> Server:
    """Starts a dm_env_rpc server for environments made by ``make_env``.

    Args:
      make_env: called as ``make_env(settings)`` for every CreateWorldRequest
        with the unpacked settings (a nested dict); returns a dm_env.Environment,
        or a ``MultiAgentEnvironment`` for a world of several agents.
        Raise TypeError or ValueError for bad settings. Or an environment
        class, called as ``make_env(**settings)``.
      address: ``host:port`` to listen on; port 0 picks a free port.
      credentials: server credentials for TLS; None serves plaintext. For mutual
        TLS, ``grpc.ssl_server_credentials([(key, cert)], root_certificates=CA,
        require_client_auth=True)``: only clients whose certificate CA signed get in.
      max_workers: the most streams (worlds) served at once; a stream beyond
        them fails with RESOURCE_EXHAUSTED, whose message says what to do.
      agent_timeout: seconds a multi-agent step waits for the other agents (or its
        turn) before it is answered DEADLINE_EXCEEDED, naming them, unapplied.
      token: require this shared token of every stream (see the module docs);
        printable ASCII without spaces. None lets in anyone who reaches the port.

    Returns:
      The running Server (use it as a context manager, or call ``stop()``).

    Raises:
      ArgumentTypeError: ``make_env`` is not callable (an environment instance,
        where its class or a factory goes), or ``max_workers`` is not a whole number.
      ArgumentValueError: ``address`` is not ``host:port``, ``max_workers`` < 1, or
        ``agent_timeout`` is not above 0, or a ``token`` that cannot travel as gRPC
        metadata (empty, spaces, non-ASCII).
      OSError: the address cannot be bound.
    """
    return Server(
        make_env,
        address,
        credentials=credentials,
        max_workers=max_workers,
        agent_timeout=agent_timeout,
        token=token,
    )


__all__ = ["MultiAgentEnvironment", "Property", "Server", "serve"]
