"""Helpers of the vector-env tests (GymnasiumVectorEnv, SB3's BatchedVecEnv).

``over_two_servers`` is the setup of every test that kills one of two servers
under a vector env; ``Recording`` is a Catch that logs, per world, each call
the server makes to it; ``dying_at_autoreset`` (a ``serve --env`` factory)
is a Catch whose server process dies on the step that starts a world's
second episode: the autoreset step the batch sends as the LAST step lands.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import dm_env

from dm_env_rpc_client.server.catch import Catch


def over_two_servers(
    server_process: Callable[..., Any],
    make: Callable[..., Any],
    env: str | tuple[str, str] = "catch",
    **kwargs: Any,
) -> tuple[Any, list[Any]]:
    """Two server subprocesses of ``env`` (or one of each of two) and
    ``make(addresses=both, num_envs=2, **kwargs)``: world ``i`` is on server ``i``."""
    envs = (env, env) if isinstance(env, str) else env
    servers = [server_process(name) for name in envs]
    return make(addresses=[server.address for server in servers], num_envs=2, **kwargs), servers


class Recording(Catch):
    """Catch logging ``"reset"`` or ``"step"`` per call, under world ``seed - 100`` (``calls``).

    World ``i`` (created with seed ``100 + i``) has 4 rows: odd worlds end
    every 3 steps (terminated), even ones every 2 (truncated by ``max_steps``),
    so their ends do not line up.
    """

    calls: dict[int, list[str]] = {}  # noqa: RUF012 - one log per test, cleared by it

    def __init__(self, seed: int = 0, **settings: Any) -> None:
        self.world = seed - 100
        max_steps = 2 if self.world % 2 == 0 else None
        super().__init__(rows=4, seed=seed, max_steps=max_steps, **settings)

    def reset(self) -> dm_env.TimeStep:
        Recording.calls.setdefault(self.world, []).append("reset")
        return super().reset()

    def step(self, action: Any) -> dm_env.TimeStep:
        Recording.calls.setdefault(self.world, []).append("step")
        return super().step(action)


class _Dying(Catch):
    ended = False

    def reset(self) -> dm_env.TimeStep:
        if self.ended:  # the step after LAST: the autoreset step
            os._exit(1)
        return super().reset()

    def step(self, action: Any) -> dm_env.TimeStep:
        timestep = super().step(action)
        self.ended = timestep.last()
        return timestep


def dying_at_autoreset(settings: dict[str, Any]) -> dm_env.Environment:
    """Catch whose server process exits at a world's first step after a LAST step."""
    return _Dying(**settings)
