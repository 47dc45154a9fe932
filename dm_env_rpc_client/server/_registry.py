"""All worlds of one embedded server, by name: single-agent ``World``s and ``MultiWorld``s."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import dm_env
import grpc

from .. import specs
from ._multiworld import MultiWorld
from ._worlds import ServerError, World
from .multiagent import MultiAgentEnvironment

AnyWorld = World | MultiWorld
DEFAULT_AGENT_TIMEOUT = 30.0  # seconds a multi-agent step waits for the other agents


class Registry:
    """All worlds of one server, by name."""

    def __init__(
        self,
        make_env: Callable[[dict[str, Any]], dm_env.Environment | MultiAgentEnvironment],
        agent_timeout: float = DEFAULT_AGENT_TIMEOUT,
    ) -> None:
        self._make_env = make_env
        self.agent_timeout = agent_timeout
        self._worlds: dict[str, AnyWorld] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._last: AnyWorld | None = None  # the newest world, whose wire specs a like one shares

    def create(
        self, settings: dict[str, Any], creator: object, name: str | None = None
    ) -> AnyWorld:
        """Creates a world with ``make_env(settings)``.

        Raises:
          ServerError: INVALID_ARGUMENT naming the settings when make_env raises
            TypeError or ValueError; INTERNAL for other exceptions.
        """
        try:
            env = self._make_env(settings)
        except (TypeError, ValueError) as exc:
            names = ", ".join(repr(key) for key in sorted(specs.flatten(settings))) or "(none)"
            raise ServerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Bad world settings {names}: {type(exc).__name__}: {exc}",
            ) from exc
        with self._lock:
            if name is None:
                self._counter += 1
                name = f"world-{self._counter}"
            last = self._last
            world: AnyWorld
            if isinstance(env, MultiAgentEnvironment):
                like = last if isinstance(last, MultiWorld) else None
                world = MultiWorld(name, env, creator, self.agent_timeout, like=like)
            else:
                world = World(name, env, creator, like=last if isinstance(last, World) else None)
            self._last = world
            self._worlds[name] = world
        return world

    def get(self, name: str) -> AnyWorld | None:
        with self._lock:
            return self._worlds.get(name)

    def require(self, name: str) -> AnyWorld:
        world = self.get(name)
        if world is None:
            with self._lock:
                known = ", ".join(repr(n) for n in sorted(self._worlds)) or "(none)"
            raise ServerError(
                grpc.StatusCode.NOT_FOUND, f"Unknown world {name!r}. Known worlds: {known}."
            )
        return world

    def remove(self, world: AnyWorld) -> None:
        with self._lock:
            if self._worlds.get(world.name) is world:
                del self._worlds[world.name]
        world.destroy()

    def close(self) -> None:
        with self._lock:
            worlds = list(self._worlds.values())
        for world in worlds:
            self.remove(world)
