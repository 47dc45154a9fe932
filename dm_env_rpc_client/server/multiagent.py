"""The interface of a world with several agents, served by ``dmr.serve`` like a ``dm_env.Environment``.

A ``MultiAgentEnvironment`` is ``dm_env.Environment`` with every answer keyed by
agent: ``reset()`` and ``step(actions)`` return ``{agent_name: dm_env.TimeStep}``,
and each spec method returns ``{agent_name: spec}``, so agents may have specs of
their own. ``serve(make_env)`` serves one when ``make_env(settings)`` returns it::

    import dm_env_rpc_client as dmr
    from dm_env_rpc_client.server.paddles import Paddles

    with dmr.serve(Paddles) as server:   # CreateWorld settings: num_agents, mode, seed
        ...                              # one connection per agent joins the world

What the server does with it, in the protocol's terms:

- Each JoinWorldRequest is one agent, one connection. The join setting ``agent``
  picks it: an index into ``agent_names()`` or a name of it; without it the
  first free agent is taken. The JoinWorldResponse carries that agent's specs.
- ``mode = "lockstep"``: a step completes when every joined agent has sent its
  StepRequest; then ``step`` is called once with the actions of all of them,
  and each agent is answered with its own TimeStep.
- ``mode = "turns"``: agents act one at a time, in the order of
  ``agent_names()`` (skipping agents not joined); an agent's StepRequest waits
  for its turn, then ``step`` is called with that agent's action alone. The
  rewards another agent's moves earn an agent are added up and reported on its
  own next step.
- A step that waits for other agents waits at most the server's
  ``agent_timeout`` (``serve(..., agent_timeout=30.0)``); then it is answered
  DEADLINE_EXCEEDED, naming the agents that did not act, and is not applied.
- The first step after joining, after an episode's end or after a reset ignores
  its actions; an agent that joins while an episode runs starts in it, with
  the world's current observation.

The rules for an environment:

- ``reset()`` and ``step()`` return a TimeStep for every agent of
  ``agent_names()``, joined or not (the server keeps the latest observation of
  each, for agents that join later).
- An episode ends for every agent at once: a step returns LAST for all agents
  or for none.
- ``step`` gets the actions of the agents that act (structured as each agent's
  ``action_spec()``); an agent left out did not act (not joined, or not its turn).
- ``dm_env_rpc_reset_settings(settings)`` and ``dm_env_rpc_properties()`` hooks
  work as for a single-agent environment (docs/server.md).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import dm_env
import numpy as np
from dm_env import specs

__all__ = ["LOCKSTEP", "TURNS", "Mode", "MultiAgentEnvironment"]

Mode = Literal["lockstep", "turns"]
LOCKSTEP: Mode = "lockstep"
TURNS: Mode = "turns"


class MultiAgentEnvironment(abc.ABC):
    """A world of several agents, as close to ``dm_env.Environment`` as that allows.

    Attributes:
      mode: ``"lockstep"`` (every joined agent acts in each step, the default)
        or ``"turns"`` (one agent acts per step, in ``agent_names()`` order).
    """

    mode: Mode = LOCKSTEP

    @abc.abstractmethod
    def agent_names(self) -> Sequence[str]:
        """The agents' names (their roles), unique; an agent's index is its position."""

    @abc.abstractmethod
    def reset(self) -> Mapping[str, dm_env.TimeStep]:
        """Starts a new episode.

        Returns:
          ``{agent_name: TimeStep}`` of step type FIRST for every agent, reward and
          discount None.
        """

    @abc.abstractmethod
    def step(self, actions: Mapping[str, Any]) -> Mapping[str, dm_env.TimeStep]:
        """Steps the world with the actions of the agents that act.

        Args:
          actions: ``{agent_name: action}``, each action structured as that
            agent's ``action_spec()``. Lockstep: every joined agent; turns: one.

        Returns:
          ``{agent_name: TimeStep}`` for every agent: what this step did to it (its
          observation, the reward this step earned it). LAST for all agents or none.
        """

    @abc.abstractmethod
    def action_spec(self) -> Mapping[str, Any]:
        """``{agent_name: spec}``: each agent's (possibly nested) action spec."""

    @abc.abstractmethod
    def observation_spec(self) -> Mapping[str, Any]:
        """``{agent_name: spec}``: each agent's (possibly nested) observation spec."""

    def reward_spec(self) -> Mapping[str, specs.Array]:
        """``{agent_name: spec}``; by default a float64 scalar for every agent, as dm_env's."""
        spec = specs.Array(shape=(), dtype=np.float64, name="reward")
        return dict.fromkeys(self.agent_names(), spec)

    def discount_spec(self) -> Mapping[str, specs.BoundedArray]:
        """``{agent_name: spec}``; by default a float64 scalar in [0, 1] for every agent."""
        spec = specs.BoundedArray((), np.float64, minimum=0.0, maximum=1.0, name="discount")
        return dict.fromkeys(self.agent_names(), spec)

    def close(self) -> None:  # noqa: B027 (optional, as dm_env.Environment.close)
        """Frees the world's resources; called once when the server destroys the world."""

    def __enter__(self) -> MultiAgentEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
