"""``ParallelEnv``: one multi-agent dm_env_rpc world as a PettingZoo ``ParallelEnv``.

Needs the ``pettingzoo`` extra (``pip install 'dm_env_rpc_client[pettingzoo]'``)::

    from dm_env_rpc_client.integrations.pettingzoo import ParallelEnv

    env = ParallelEnv(address="127.0.0.1:50051", num_agents=2,
                      create_world_settings={"seed": 1})
    observations, infos = env.reset(seed=1)
    while env.agents:
        actions = {agent: env.action_space(agent).sample() for agent in env.agents}
        observations, rewards, terminations, truncations, infos = env.step(actions)
    env.close()

The world is made by ``dmr.MultiAgentWorld`` (one connection per agent, every
agent's step written at once, so a lockstep or turns server never deadlocks).

- Agents: the world's agents' names (``possible_agents``); ``agents`` holds the
  ones still in the episode. An agent whose step was LAST leaves ``agents``
  (terminated when its discount is 0, truncated otherwise, dm_env's convention).
  The server still waits for every joined agent, so a finished agent goes on
  acting with its spec's default action until the episode ends for all, and
  what it gets back is dropped.
- Spaces: the Gymnasium bridge's (``integrations.gymnasium``), one object per
  agent (``observation_space(agent) is observation_space(agent)``); a world with
  one observation (one action) has that tensor's space. A bounded integer action
  (Paddles' and Catch's ``paddle``, int8 in ``[-1, 1]``) is ``Discrete(high -
  low + 1)``, ``low`` added back before sending, as learners expect
  (``discrete_actions=False`` keeps the ``Box``).
- ``reset(seed=s)`` sends ResetWorldRequest with ``{seed_setting: s}``: the world
  replays the same episodes for the same seed (PettingZoo's ``parallel_seed_test``);
  ``reset()`` resets every agent and goes on with the world's own stream.
- Pickling (SuperSuit's ``concat_vec_envs_v1`` copies envs with cloudpickle):
  a copy holds the settings and spaces, not the connections, and makes a world
  of its own at its first ``reset``. Credentials do not pickle: pass a token
  through ``metadata``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

try:
    import pettingzoo
    from pettingzoo.utils.conversions import parallel_to_aec
except ImportError as exc:  # pragma: no cover - exercised in a venv without pettingzoo
    raise ImportError(
        "dm_env_rpc_client.integrations.pettingzoo needs pettingzoo: "
        "pip install 'dm_env_rpc_client[pettingzoo]'"
    ) from exc

import dm_env
import grpc
import numpy as np

from ... import errors, specs
from ...multiagent import MultiAgentWorld
from ..gymnasium._discrete_actions import ActionMap
from ..gymnasium._spaces import SpaceAdapter

_CLOSED = "This ParallelEnv is closed; make a new one."
_NO_RESET = "Call reset() before step(): the episode has not started."
_MISSING = (
    "step() got no action for {missing}: every agent in env.agents acts each step "
    "(a lockstep server waits for it)."
)
_UNKNOWN = "step() got actions for {unknown}, which are not in env.agents {agents}."
_OUTSIDE = "step() got {action!r} for {agent}, outside its action space {space}."
_CREDENTIALS = (
    "A ParallelEnv with credentials cannot be pickled (gRPC credentials do not pickle): "
    "pass a token through metadata, or make the env inside each process."
)


class _Agent:
    """One agent's spaces and the conversions of its values."""

    def __init__(self, env: Any, discrete_actions: bool) -> None:
        wire = env._wire_specs
        self.observations = SpaceAdapter(
            wire.observations, list(specs.flatten(env.observation_spec())), "observation", True
        )
        self.actions = SpaceAdapter(
            wire.actions, list(specs.flatten(env.action_spec())), "action", True
        )
        self.map: ActionMap | None = None
        if self.actions.single is not None:
            self.map = ActionMap(self.actions.space, 1, discrete_actions)
        self.observation_space = self.observations.space
        self.action_space = self.actions.space if self.map is None else self.map.space

    def to_sdk(self, action: Any) -> Any:
        if self.map is not None and self.map.offset is not None:
            action = self.map.to_sdk(np.asarray(action)[None])[0]
        return self.actions.to_sdk(action)


class ParallelEnv(pettingzoo.ParallelEnv):  # type: ignore[misc]
    """One multi-agent dm_env_rpc world as a PettingZoo ``ParallelEnv``. See the module docs.

    Args:
      address: the server's address.
      num_agents: how many agents join the world (one connection each).
      create_world_settings: the CreateWorldRequest's settings.
      join_world_settings: one mapping for every agent, or one per agent (e.g.
        ``[{"agent": "red"}, {"agent": "blue"}]``).
      seed_setting: the ResetWorldRequest setting that ``reset(seed=s)`` sets.
      discrete_actions: show a bounded integer action as ``Discrete``.
      timeout: seconds to open, reset and close the world.
      step_timeout: seconds a step may wait for its answers.
      credentials, metadata, options: the connections' (as ``dmr.connect``'s).
      render_mode: only None (nothing is rendered).

    Raises:
      WorldError: the world could not be made or joined (nothing is left behind).
      ArgumentError: a bad argument.
    """

    metadata: ClassVar[dict[str, Any]] = {
        "name": "dm_env_rpc_parallel_v0",
        "render_modes": [],
        "is_parallelizable": True,
    }

    def __init__(
        self,
        address: str,
        num_agents: int = 2,
        create_world_settings: Mapping[str, Any] | None = None,
        *,
        join_world_settings: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
        seed_setting: str = "seed",
        discrete_actions: bool = True,
        timeout: float | None = 30.0,
        step_timeout: float | None = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        render_mode: str | None = None,
    ) -> None:
        if render_mode is not None:
            raise errors.ArgumentValueError(
                f"render_mode must be None (this env renders nothing), got {render_mode!r}."
            )
        self.render_mode = None
        self._settings: dict[str, Any] = dict(
            address=address,
            num_agents=num_agents,
            create_world_settings=dict(create_world_settings or {}),
            join_world_settings=join_world_settings,
            timeout=timeout,
            step_timeout=step_timeout,
            credentials=credentials,
            metadata=None if metadata is None else list(metadata),
            options=None if options is None else list(options),
        )
        self._seed_setting = seed_setting
        self._discrete = discrete_actions
        self._world: MultiAgentWorld | None = None
        self._closed = False
        world = self._open()
        self._by_agent = {
            name: _Agent(world.batch.envs[index], discrete_actions)
            for index, name in enumerate(world.agents)
        }
        self.possible_agents: list[str] = list(world.agents)
        self.agents: list[str] = []

    def _open(self) -> MultiAgentWorld:
        if self._closed:
            raise errors.ArgumentValueError(_CLOSED)
        if self._world is None:
            self._world = MultiAgentWorld.connect(**self._settings)
        return self._world

    @property
    def world_name(self) -> str | None:
        """The name of the world on its server; None until this env (or copy) opened one."""
        return None if self._world is None else self._world.world_name

    def observation_space(self, agent: str) -> Any:
        """``agent``'s observation space (the same object every call)."""
        return self._by_agent[agent].observation_space

    def action_space(self, agent: str) -> Any:
        """``agent``'s action space (the same object every call)."""
        return self._by_agent[agent].action_space

    def _observations(self, steps: Mapping[str, dm_env.TimeStep]) -> dict[str, Any]:
        return {
            name: self._by_agent[name].observations.from_sdk(dict(step.observation))
            for name, step in steps.items()
        }

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Starts an episode for every agent.

        Args:
          seed: re-seeds the world (ResetWorldRequest ``{seed_setting: seed}``).
          options: ``{"reset_world_settings": {...}}`` sends those settings instead.

        Returns:
          ``(observations, infos)`` by agent.
        """
        world = self._open()
        settings = dict((options or {}).get("reset_world_settings", {}))
        if seed is not None:
            settings[self._seed_setting] = int(seed)
        steps = world.reset_world(settings) if settings else world.reset()
        self.agents = list(self.possible_agents)
        return self._observations(steps), {name: {} for name in self.agents}

    def step(self, actions: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
        """Steps every agent at once.

        Args:
          actions: ``{agent: action}`` for every agent in ``agents``.

        Returns:
          ``(observations, rewards, terminations, truncations, infos)``, each by the
          agents that were in ``agents`` before the step.

        Raises:
          ArgumentValueError: an action missing for an agent in ``agents``, given for
            one not in it, or outside its agent's action space (nothing is sent); a
            step before ``reset``, or on a closed env.
        """
        world = self._open()
        if not self.agents:
            raise errors.ArgumentValueError(_NO_RESET)
        unknown = sorted(set(actions) - set(self.agents))
        if unknown:
            raise errors.ArgumentValueError(_UNKNOWN.format(unknown=unknown, agents=self.agents))
        missing = [name for name in self.agents if name not in actions]
        if missing:
            raise errors.ArgumentValueError(_MISSING.format(missing=missing))
        for name in self.agents:
            if not self._by_agent[name].action_space.contains(actions[name]):
                raise errors.ArgumentValueError(
                    _OUTSIDE.format(
                        action=actions[name], agent=name, space=self._by_agent[name].action_space
                    )
                )
        wire = {
            name: self._by_agent[name].to_sdk(actions[name]) if name in actions else {}
            for name in self.possible_agents
        }
        steps = world.step(wire)
        live = list(self.agents)
        observations = self._observations({name: steps[name] for name in live})
        rewards = {name: float(steps[name].reward or 0.0) for name in live}
        ended = {name: steps[name].last() for name in live}
        terminations = {name: ended[name] and steps[name].discount == 0 for name in live}
        truncations = {name: ended[name] and not terminations[name] for name in live}
        infos: dict[str, dict[str, Any]] = {name: {} for name in live}
        self.agents = [name for name in live if not ended[name]]
        return observations, rewards, terminations, truncations, infos

    def render(self) -> None:
        """Renders nothing (``render_mode`` is None)."""
        return None

    def close(self) -> None:
        """Leaves every agent and destroys the world. Idempotent."""
        self._closed = True
        world, self._world = self._world, None
        if world is not None:
            world.close()

    def __getstate__(self) -> dict[str, Any]:
        if self._settings.get("credentials") is not None:
            raise errors.ArgumentValueError(_CREDENTIALS)
        state = dict(self.__dict__)
        state["_world"] = None
        state["_closed"] = False
        state["agents"] = []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def aec_env(*args: Any, **kwargs: Any) -> Any:
    """The world as a PettingZoo AEC env (``parallel_to_aec`` over ``ParallelEnv(...)``)."""
    return parallel_to_aec(ParallelEnv(*args, **kwargs))
