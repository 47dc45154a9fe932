"""Server fleets: N embedded dm_env_rpc servers, each in a Ray actor.

``ServerFleet(make_env, num_servers)`` reserves one placement-group bundle per
server (``SPREAD`` by default: one server per node while nodes last), starts an
actor in each bundle, and the actor serves ``make_env`` (pickled by Ray) on its
node's IP address on a free port::

    with ServerFleet(lambda settings: Catch(**settings), 2) as fleet:
        fleet.addresses            # ['10.0.0.5:40211', '10.0.0.6:38101']
        fleet.health()             # one ServerHealth per server, from a real round trip

A server whose actor dies is restarted by Ray (up to ``max_restarts`` times).
It binds its old port again when it restarts on the same node and the port is
free; otherwise it takes a new port, and ``addresses`` reports it (the fleet
asks its actors each time, so it never hands out a stale address for long).
``restarts`` counts the restarts the fleet has seen.

``close()`` stops every server, kills the actors and frees the placement group;
it is idempotent and bounded.

Strangers kept out: ``token=`` makes every server require that token (it travels
to the actors as an argument, never on a command line), and ``fleet.metadata``
carries it to clients (``run_sharded`` and ``health`` send it themselves);
``credentials=`` serve TLS, mutual TLS with ``require_client_auth=True``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ... import errors
from ..._base import checks as _checks
from ..._base import tokens as _tokens
from ..._proto import dm_env_rpc_pb2
from ...connection import connect
from ...server import MakeEnv, Server, check_factory, serve

_MEMO = "dm_env_rpc_fleet"  # /tmp/dm_env_rpc_fleet-<fleet>-<server>: a server's port, for restarts
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_NOT_INITIALIZED = (
    "Ray is not initialized: call ray.init() first (on one machine: "
    "ray.init(num_cpus=2, include_dashboard=False); on a cluster: ray.init(address='auto'))."
)
_BAD_STRATEGY = "Unknown placement strategy {strategy!r}; use one of {choices}."
_NO_ROOM = (
    "Ray could not place {count} servers of {cpus} CPU each with strategy {strategy} within "
    "{timeout} s (the cluster has {available}). Ask for fewer servers or CPUs per server "
    "(num_cpus=...), or add nodes."
)
_NOT_STARTED = (
    "Server {index} of the fleet did not answer within {timeout} s: {error}. make_env must "
    "unpickle on every node (a lambda, or a function of a module installed there)."
)
_CLOSED = "The fleet is closed; make a new ServerFleet."


class FleetError(errors.DmEnvRpcClientError):
    """A server fleet could not be placed, started or reached."""


class ServerInfo(NamedTuple):
    """Where one server of a fleet runs (from its actor).

    Attributes:
      server: the server's index in the fleet.
      address: ``host:port`` its clients connect to.
      node_id: the Ray node it runs on.
      pid: its process id (a new one after each restart).
    """

    server: int
    address: str
    node_id: str
    pid: int


class ServerHealth(NamedTuple):
    """The result of one health probe.

    Attributes:
      server: the server's index in the fleet.
      address: the address probed (None when the actor did not answer).
      ok: the server answered a request within the timeout.
      error: why not, when ``ok`` is False.
    """

    server: int
    address: str | None
    ok: bool
    error: str | None


class _ServerHost:
    """The actor body: one embedded server on its node's IP (made a Ray actor by the fleet)."""

    def __init__(
        self,
        make_env: MakeEnv,
        index: int,
        fleet_id: str,
        host: str | None,
        credentials: Callable[[], grpc.ServerCredentials] | None,
        max_workers: int,
        token: str | None = None,
    ) -> None:
        self._index = index
        self._token = token
        self._host = host or ray.util.get_node_ip_address()
        # A restart on the same node binds the old port again when it is free.
        self._memo = pathlib.Path(tempfile.gettempdir()) / f"{_MEMO}-{fleet_id}-{index}"
        with contextlib.suppress(OSError, ValueError):
            port = int(self._memo.read_text())
            self._server: Server = self._serve(make_env, port, credentials, max_workers)
            return
        self._server = self._serve(make_env, 0, credentials, max_workers)

    def _serve(
        self,
        make_env: MakeEnv,
        port: int,
        credentials: Callable[[], grpc.ServerCredentials] | None,
        max_workers: int,
    ) -> Server:
        server = serve(
            make_env,
            f"{self._host}:{port}",
            credentials=None if credentials is None else credentials(),
            max_workers=max_workers,
            token=self._token,
        )
        self._memo.write_text(server.address.rsplit(":", 1)[1])
        return server

    def info(self) -> ServerInfo:
        return ServerInfo(
            self._index, self._server.address, ray.get_runtime_context().get_node_id(), os.getpid()
        )

    def stop(self) -> None:
        self._server.stop(grace=0.5)
        with contextlib.suppress(OSError):
            self._memo.unlink()


class ServerFleet:
    """N embedded dm_env_rpc servers, one per Ray actor. See the module docs.

    Ray must be initialized first (``ray.init``).

    Args:
      make_env: ``make_env(settings) -> dm_env.Environment``, as for ``dmr.serve``;
        Ray pickles it (a lambda or a module-level function).
      num_servers: how many servers.
      strategy: the placement-group strategy: ``SPREAD`` (default, best effort
        one per node), ``STRICT_SPREAD``, ``PACK`` or ``STRICT_PACK``.
      num_cpus: CPUs reserved per server (fractions allowed).
      host: the address to bind; default the node's IP as Ray knows it. Off a
        single node that is not loopback: see the security notes in docs/ray.md.
      max_restarts: how many times Ray restarts a server whose actor died
        (-1: without limit).
      credentials: a function returning ``grpc.ServerCredentials`` for TLS, called
        in each actor (credential objects do not pickle; a
        ``functools.partial(grpc.ssl_server_credentials, [(key, cert)])`` does).
      max_workers: streams each server serves at once (as for ``dmr.serve``).
      timeout: seconds to wait for the placement and for every server to start.
      token: a shared token every server requires (as for ``dmr.serve``); clients
        send ``fleet.metadata``.

    Attributes:
      metadata: the gRPC metadata that carries ``token`` (None without one): pass
        it as ``metadata=`` to ``dmr.connect`` or ``BatchedEnvironment.connect``.

    Raises:
      FleetError: Ray is not initialized, the servers could not be placed, or a
        server did not start within ``timeout``.
      ValueError: a bad ``num_servers`` or ``strategy``.
    """

    def __init__(
        self,
        make_env: MakeEnv,
        num_servers: int = 2,
        *,
        strategy: str = "SPREAD",
        num_cpus: float = 1.0,
        host: str | None = None,
        max_restarts: int = 3,
        credentials: Callable[[], grpc.ServerCredentials] | None = None,
        max_workers: int = 64,
        timeout: float = 60.0,
        token: str | None = None,
    ) -> None:
        check_factory(make_env)
        self.metadata = None if token is None else _tokens.token_metadata(token)
        self._token = token
        _checks.check_count(num_servers, "num_servers")
        if strategy not in STRATEGIES:
            raise errors.ArgumentValueError(
                _BAD_STRATEGY.format(strategy=strategy, choices=", ".join(STRATEGIES))
            )
        if not ray.is_initialized():
            raise FleetError(_NOT_INITIALIZED)
        self.timeout = timeout
        self._closed = False
        self._actors: list[Any] = []
        self._infos: list[ServerInfo | None] = [None] * num_servers
        self.restarts = 0
        self._fleet_id = uuid.uuid4().hex
        self._group: PlacementGroup | None = placement_group(
            [{"CPU": num_cpus}] * num_servers, strategy=strategy
        )
        try:
            if not _ready(self._group, timeout):
                raise FleetError(
                    _NO_ROOM.format(
                        count=num_servers,
                        cpus=num_cpus,
                        strategy=strategy,
                        timeout=timeout,
                        available=ray.cluster_resources(),
                    )
                )
            actor_class: Any = ray.remote(self._HOST)
            for index in range(num_servers):
                self._actors.append(
                    actor_class.options(
                        num_cpus=num_cpus,
                        max_restarts=max_restarts,
                        max_task_retries=-1 if max_restarts else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            self._group, placement_group_bundle_index=index
                        ),
                    ).remote(*self._host_args(index, (make_env, host, credentials, max_workers)))
                )
            self.servers()
        except BaseException:
            self.close()
            raise

    _HOST: type = _ServerHost  # the actor body (``LaunchedFleet`` launches a command instead)

    def _host_args(self, index: int, given: tuple[Any, ...]) -> tuple[Any, ...]:
        """The actor's arguments for server ``index``; ``given``: make_env, host, credentials,
        max_workers."""
        make_env, host, credentials, max_workers = given
        return (make_env, index, self._fleet_id, host, credentials, max_workers, self._token)

    def servers(self, timeout: float | None = None) -> list[ServerInfo]:
        """Asks every actor where its server runs now; waits for restarting ones.

        Args:
          timeout: seconds to wait for all of them (default the fleet's timeout).

        Returns:
          One ``ServerInfo`` per server, in fleet order.

        Raises:
          FleetError: the fleet is closed, or a server did not answer in time
            (dead beyond ``max_restarts``, or still starting).
        """
        if self._closed:
            raise FleetError(_CLOSED)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        infos = []
        for index, actor in enumerate(self._actors):
            try:
                info = ray.get(actor.info.remote(), timeout=max(0.01, deadline - time.monotonic()))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                raise FleetError(
                    _NOT_STARTED.format(index=index, timeout=limit, error=_first_line(exc))
                ) from exc
            infos.append(info)
        for index, info in enumerate(infos):
            seen = self._infos[index]
            if seen is not None and seen.pid != info.pid:
                self.restarts += 1
            self._infos[index] = info
        return infos

    @property
    def addresses(self) -> list[str]:
        """Every server's current ``host:port`` (asks the actors; see ``servers``)."""
        return [info.address for info in self.servers()]

    def __len__(self) -> int:
        return len(self._actors)

    def health(
        self,
        timeout: float = 5.0,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        insecure: bool = True,
    ) -> list[ServerHealth]:
        """Probes every server with a real round trip from this process.

        Each probe connects, sends a LeaveWorldRequest (harmless: it joins
        nothing) and waits for the answer; any answer, even an error status,
        means the server's event loop serves.

        Args:
          timeout: seconds for each server (its actor's answer, then the probe).
          credentials: channel credentials for a fleet serving TLS.
          insecure: allow plaintext to a non-loopback address (the fleet's own
            servers; default True).

        Returns:
          One ``ServerHealth`` per server, in fleet order; never raises for a
          dead server.
        """
        if self._closed:
            raise FleetError(_CLOSED)
        results = []
        for index, actor in enumerate(self._actors):
            try:
                address = ray.get(actor.info.remote(), timeout=timeout).address
            except (ray.exceptions.RayError, TimeoutError) as exc:
                results.append(ServerHealth(index, None, False, _first_line(exc)))
                continue
            probed = _probe(address, timeout, credentials, insecure, self.metadata)
            results.append(ServerHealth(index, address, *probed))
        return results

    def close(self, timeout: float = 10.0) -> None:
        """Stops every server, kills the actors and frees the placement group.

        Idempotent, and bounded by about ``timeout`` seconds: a server that does
        not stop in time is killed with its actor.
        """
        if self._closed:
            return
        self._closed = True
        stops = [actor.stop.remote() for actor in self._actors]
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.wait(stops, num_returns=len(stops), timeout=timeout)
        for actor in self._actors:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(actor, no_restart=True)
        self._actors = []
        # The servers' port notes on this node (a killed server never removes its own).
        for memo in pathlib.Path(tempfile.gettempdir()).glob(f"{_MEMO}-{self._fleet_id}-*"):
            with contextlib.suppress(OSError):
                memo.unlink()
        if self._group is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                remove_placement_group(self._group)
            self._group = None

    def __enter__(self) -> ServerFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._actors)} servers"
        return f"ServerFleet({state})"


def _ready(group: PlacementGroup, timeout: float) -> bool:
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    return bool(ready)


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` of the innermost cause Ray wrapped (a task's or actor's exception)."""
    for _ in range(8):
        if not isinstance(exc, ray.exceptions.RayError):
            break
        inner = [
            e for e in (getattr(exc, "cause", None), *exc.args) if isinstance(e, BaseException)
        ]
        if not inner or inner[0] is exc:
            break
        exc = inner[0]
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}"


def _probe(
    address: str,
    timeout: float,
    credentials: grpc.ChannelCredentials | None,
    insecure: bool,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> tuple[bool, str | None]:
    try:
        with connect(
            address,
            timeout=timeout,
            credentials=credentials,
            insecure=insecure and not credentials,
            metadata=metadata,
        ) as conn:
            conn.send(dm_env_rpc_pb2.LeaveWorldRequest(), timeout=timeout)
    except errors.DmEnvRpcError:
        return True, None  # the server answered, with an error status
    except errors.DmEnvRpcClientError as exc:
        return False, _first_line(exc)
    return True, None


def fleet_addresses(source: ServerFleet | Sequence[str]) -> list[str]:
    """The server addresses of a fleet, or a list of addresses as given.

    Raises:
      ValueError: the list is empty.
    """
    addresses = source.addresses if isinstance(source, ServerFleet) else list(source)
    if not addresses:
        raise errors.ArgumentValueError("Give a ServerFleet or at least one server address.")
    return addresses
