"""Launched fleets: a server command per Ray actor, started with ``dmr.launch`` on its node.

``LaunchedFleet(command, num_servers)`` is the sibling of ``ServerFleet`` for
servers that are not Python environments (players, simulators, containers):
each actor runs ``dmr.launch(command, 1)`` on its node, on the node's IP, so
every server gets the launcher's readiness wait, log file, relaunch and
cleanup. The fleet's face is ``ServerFleet``'s (``addresses``, ``servers()``,
``health()``, ``close()``, context manager), plus ``relaunches()``::

    with LaunchedFleet("my_player --port {port}", 4) as fleet:
        run_sharded(fleet, num_worlds=16, num_shards=4, steps=10_000)

A dead actor leaves no process behind: the server dies with the actor's
process (the launcher's parent-death signal and watchdog), and Ray restarts
the actor (``max_restarts``), which launches the command again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from ...launch import LaunchedServers, Relaunch, RelaunchPolicy, launch
from ._fleet import ServerFleet, ServerInfo


def _launched_env(settings: Any) -> Any:
    """The ``make_env`` a ``LaunchedFleet`` hands ``ServerFleet``: its servers are commands."""
    raise NotImplementedError("a LaunchedFleet's servers are launched commands")


class _LaunchHost:
    """The actor body: one launched server on the actor's node."""

    def __init__(
        self, command: str | Sequence[str], index: int, host: str | None, options: dict[str, Any]
    ) -> None:
        self._index = index
        host = host or ray.util.get_node_ip_address()
        self._servers: LaunchedServers = launch(command, 1, host=host, **options)

    def info(self) -> ServerInfo:
        server = self._servers.servers[0]
        node = ray.get_runtime_context().get_node_id()
        return ServerInfo(self._index, server.address, node, server.pid)

    def relaunches(self) -> list[Relaunch]:
        return list(self._servers.relaunches)

    def stop(self) -> None:
        self._servers.close()


class LaunchedFleet(ServerFleet):
    """A server command per Ray actor (see the module docs). Ray must be initialized.

    Args:
      command: the command template, with ``{port}`` (and optionally ``{host}``),
        as for ``dmr.launch``; the program must exist on every node.
      num_servers: how many servers (one actor each).
      strategy, num_cpus, host, max_restarts, timeout: as for ``ServerFleet``.
      ready_timeout, grace, env, cwd, relaunch: as for ``dmr.launch``, per server.
      token: a shared token for the servers, as for ``dmr.launch`` (each server
        gets it in ``DMR_TOKEN``); clients send ``fleet.metadata``.

    Raises:
      FleetError: Ray is not initialized, the actors could not be placed, or a
        server did not start (the launcher's error, with its log, is included).
      ValueError: a bad ``num_servers``, ``strategy`` or command template.
    """

    _HOST = _LaunchHost

    def __init__(
        self,
        command: str | Sequence[str],
        num_servers: int = 2,
        *,
        strategy: str = "SPREAD",
        num_cpus: float = 1.0,
        host: str | None = None,
        max_restarts: int = 3,
        timeout: float = 60.0,
        ready_timeout: float = 60.0,
        grace: float = 5.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        relaunch: RelaunchPolicy | None = RelaunchPolicy(),  # noqa: B008 (an immutable tuple)
        token: str | None = None,
    ) -> None:
        from ..._launch.process import command_line

        command_line(command, "127.0.0.1", 0)  # a bad template fails here, not in every actor
        self._command = command
        self._launch_options = {
            "ready_timeout": ready_timeout,
            "grace": grace,
            "env": env,
            "cwd": cwd,
            "relaunch": relaunch,
            "token": token,
        }
        super().__init__(
            _launched_env,  # never called: the actors launch the command
            num_servers,
            strategy=strategy,
            num_cpus=num_cpus,
            host=host,
            max_restarts=max_restarts,
            timeout=max(timeout, ready_timeout),
            token=token,
        )

    def _host_args(self, index: int, given: tuple[Any, ...]) -> tuple[Any, ...]:
        host = given[1]
        return (self._command, index, host, self._launch_options)

    def relaunches(self, timeout: float = 10.0) -> list[Relaunch]:
        """Every server's relaunches, as their actors report them."""
        reports = ray.get([actor.relaunches.remote() for actor in self._actors], timeout=timeout)
        return [relaunch for report in reports for relaunch in report]
