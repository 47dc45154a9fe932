"""Multi-agent worlds for a single-agent RLlib learner: one policy shared by every agent.

Ray 2.60's ``EnvRunnerServerForExternalInference`` builds one RLModule and takes
``SingleAgentEpisode``s; there is no multi-agent RLlink server. What works today is
parameter sharing: ``run_rllink(..., num_agents=N)`` opens a ``dmr.MultiAgentBatch``
(M worlds of N agents, slot ``w * N + a`` is agent ``a`` of world ``w``), and the
client treats every agent slot as one stream of experience:

- each agent of each world has its own ``SingleAgentEpisode`` (its
  ``custom_data`` says ``agent`` and ``world``), shipped like a world's;
- one forward pass gives the actions of every agent of every world whose step
  came back; ``dmr.collect`` sends them whole world by whole world (a lockstep
  server answers no agent until all acted);
- a world's agents all feed the same RLlib port (``link_of``), and a round gives
  each agent of a world the same count of steps (``world_counts``).

A shared policy needs the agents alike: ``check_shared`` compares every agent's
observation and action specs with the first agent's and raises
``SpaceMismatchError`` naming the agent, the side and the tensor otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ... import specs
from ...batched import BatchedEnvironment
from ._rllink_wire import SpaceMismatchError

_UNEQUAL = (
    "A shared policy needs every agent's {kind}s alike: {kind} {name!r} is {theirs} for agent "
    "{agent!r} and {ours} for agent {first!r}. Serve agents with equal {kind} specs (or "
    "narrow every agent to the same observation with requested_observations=[NAME]); a policy "
    "per agent needs Ray's multi-agent RLlink server, which Ray 2.60 does not have "
    "(docs/rllink.md#multi-agent)."
)
_ABSENT = "absent"


def agents_of(batch: BatchedEnvironment) -> int:
    """Agent slots per world: ``num_agents`` of a ``dmr.MultiAgentBatch``, else 1."""
    return int(getattr(batch, "num_agents", 1))


def link_of(slot: int, agents: int, links: int) -> int:
    """The RLlib port that agent slot ``slot`` feeds: its world's, ``world % links``."""
    return (slot // agents) % links


def agent_labels(batch: BatchedEnvironment) -> list[dict[str, Any]] | None:
    """Each agent slot's ``custom_data`` labels (``agent``, ``world``); None for one agent."""
    agents = agents_of(batch)
    if agents == 1:
        return None
    names = list(getattr(batch, "agents", [f"agent_{a}" for a in range(agents)]))
    return [{"agent": names[s % agents], "world": s // agents} for s in range(len(batch.envs))]


def _describe(spec: Any) -> str:
    if spec is None:
        return _ABSENT
    text = f"{getattr(spec, 'dtype', '?')} {tuple(getattr(spec, 'shape', ()))}"
    if hasattr(spec, "minimum"):
        text += f" in [{spec.minimum}, {spec.maximum}]"
    return text


def _compare(kind: str, names: Sequence[str], specs: Sequence[Mapping[str, Any]]) -> None:
    ours = specs[0]
    for agent, theirs in zip(names[1:], specs[1:], strict=True):
        for name in sorted(set(ours) | set(theirs)):
            mine, other = ours.get(name), theirs.get(name)
            if mine is None or other is None or mine != other:
                raise SpaceMismatchError(
                    _UNEQUAL.format(
                        kind=kind,
                        agent=agent,
                        name=name,
                        theirs=_describe(other),
                        first=names[0],
                        ours=_describe(mine),
                    )
                )


def check_shared(batch: BatchedEnvironment) -> None:
    """Checks that one policy can act for every agent of ``batch``'s worlds.

    Args:
      batch: the worlds (a single-agent batch passes at once).

    Raises:
      SpaceMismatchError: an agent's observation or action specs differ from the first
        agent's; the message names the agent, the side and the tensor.
    """
    agents = agents_of(batch)
    if agents == 1:
        return
    envs = batch.envs[:agents]  # the first world's agents (every world is made alike)
    names = list(getattr(batch, "agents", [f"agent_{a}" for a in range(agents)]))
    _compare("observation", names, [dict(specs.flatten(e.observation_spec())) for e in envs])
    _compare("action", names, [dict(specs.flatten(e.action_spec())) for e in envs])


def world_counts(
    live: Sequence[int], agents: int, links: int, short: Sequence[int], ratio: float, slots: int
) -> list[int] | None:
    """Each agent slot's steps for the rest of a round, whole worlds; None if it is done.

    Args:
      live: the live agent slots.
      agents: agent slots per world (1 for single-agent worlds).
      links: how many RLlib ports; world ``w`` feeds port ``w % links``.
      short: env steps (agent steps) each port still needs this round.
      ratio: steps received per env step recorded so far (a FIRST step records none).
      slots: every slot of the batch (removed ones too).

    Returns:
      A count per slot, the same for every agent of a world, or None if no port is short.
    """
    worlds = sorted({slot // agents for slot in live})
    counts = [0] * slots
    for link in range(links):
        mine = [w for w in worlds if w % links == link]
        if not mine or short[link] <= 0:
            continue
        steps = math.ceil(short[link] * ratio / agents)  # world steps: each is `agents` steps
        for position, world in enumerate(mine):
            count = steps // len(mine) + (position < steps % len(mine))
            for slot in range(world * agents, (world + 1) * agents):
                counts[slot] = count
    return counts if any(counts) else None
