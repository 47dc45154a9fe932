"""Stepped worlds as RLlib ``SingleAgentEpisode`` chunks, each step in exactly one chunk.

``EpisodeBook`` keeps one open episode per world and the finished chunks not
yet shipped. The client tells it what it sent (``acted``: the learner-space
action, and the extra model outputs PPO needs, ``action_logp`` and
``action_dist_inputs``) and what came back (``take``: a ``BatchedTimeStep``):

- a MID or LAST step is added to the world's episode with the action sent for
  it; a LAST step closes it, ``terminated`` when the server says the episode
  ended by itself (``TERMINATED``), ``truncated`` when it was cut (``INTERRUPTED``);
- a FIRST step opens a new episode (the action that was sent for it is ignored
  by the world, as the protocol says, and is not recorded);
- a FIRST step with ``truncated`` set (the batch restarted a failed world)
  closes the world's open episode as truncated: the steps it had are kept, the
  step lost with the failure is not recorded, nothing is recorded twice. (If
  the failure came right after a shipment, the open chunk has no step, and
  RLlib has no zero-step chunk: the chunk shipped last stays not done, which a
  learner bootstraps from its last observation just as for a truncation;
  ``cut_after_ship`` counts these.);
- ``let_go(world)`` closes the open episode of a world removed from the batch,
  truncated.

``ship()`` hands over every finished chunk plus each open episode's steps so
far (the open episode goes on as ``episode.cut()``, RLlib's successor chunk
with the same id), grouped by the RLlib link each world feeds, and forgets
them: what was shipped is never shipped again. Chunks without steps are left
out. Every episode's ``custom_data["behavior"]`` says who acted: ``"rl_module"``
(the learner's module, on-policy) or ``"external"`` (the user's policy: off-policy
data, as the old stack's ``log_action``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from ..._adaptor.stacked import BatchedTimeStep
from ._rllink_agents import link_of

BEHAVIOR = "behavior"
ON_POLICY, OFF_POLICY = "rl_module", "external"
_TERMINATED = 2  # EnvironmentStateType.TERMINATED (dmr.dm_env_rpc_pb2)


def wire_state(episode: SingleAgentEpisode) -> dict[str, Any]:
    """``episode``'s state as shipped (a chunk no step is added to any more): numpy'd (one
    array per column, where the learner would read one array header per step) and without
    the rewards' space (RLlib's default ``Box(-inf, inf)``, which the learner rebuilds from
    its dict for every episode: about a third of its EnvRunner's time at 256 worlds; a
    rewards buffer without a space reads the same). The learner's ``to_numpy`` then finds
    it done."""
    state = episode.to_numpy().get_state()
    state["rewards"]["space"] = None
    return state


class EpisodeBook:
    """The episodes of every world (see the module docs).

    Args:
      worlds: how many worlds (agent slots of a multi-agent batch: each its own episodes).
      links: how many RLlib links; world ``w`` feeds link ``w % links``.
      behavior: ``ON_POLICY`` or ``OFF_POLICY``, written into every episode.
      agents: agent slots per world (a multi-agent batch's ``num_agents``): slot ``s`` is
        agent ``s % agents`` of world ``s // agents``, and feeds that world's link.
      labels: each slot's extra ``custom_data`` (a multi-agent slot's agent and world).

    Attributes:
      recorded: env steps recorded per link since the last ``ship``.
      returns: the return of every episode that reached its LAST step.
      last_obs: each world's latest observation (learner space), None before its first.
      truncated_by_failure: episodes cut by a failure and shipped truncated.
      cut_after_ship: episodes cut by a failure with no step since their last chunk was
        shipped (RLlib has no zero-step chunk): that chunk went out not done, which
        RLlib's learners bootstrap from its last observation, as for a truncation.
    """

    def __init__(
        self,
        worlds: int,
        links: int,
        behavior: str,
        agents: int = 1,
        labels: list[dict[str, Any]] | None = None,
    ) -> None:
        self.links, self.behavior = links, behavior
        self.link = [link_of(slot, agents, links) for slot in range(worlds)]
        self.labels = labels or [{} for _ in range(worlds)]
        self.open: list[SingleAgentEpisode | None] = [None] * worlds
        self.pending: list[tuple[Any, dict[str, Any]] | None] = [None] * worlds
        self.done: list[list[SingleAgentEpisode]] = [[] for _ in range(links)]
        self.recorded = [0] * links
        self.returns: list[float] = []
        self.last_obs: list[Any] = [None] * worlds
        self.truncated_by_failure = 0
        self.cut_after_ship = 0

    def _start(self, world: int, obs: Any) -> None:
        episode = SingleAgentEpisode(observations=[obs], len_lookback_buffer=0)
        episode.custom_data[BEHAVIOR] = self.behavior
        episode.custom_data.update(self.labels[world])
        self.open[world] = episode

    def _close(self, world: int, *, truncated: bool) -> None:
        episode = self.open[world]
        self.open[world] = None
        if episode is None:
            return
        if truncated and not episode.is_done:
            episode.is_truncated = True
        if len(episode):
            self.done[self.link[world]].append(episode)

    def _count_cut(self, world: int) -> None:
        episode = self.open[world]
        if episode is None:
            return
        if len(episode):
            self.truncated_by_failure += 1
        elif episode.t_started > 0:
            self.cut_after_ship += 1

    def acted(self, world: int, action: Any, extras: dict[str, Any]) -> None:
        """Notes the action sent to ``world`` (learner space) and its model outputs."""
        self.pending[world] = (action, extras)

    def take(self, timestep: BatchedTimeStep, observations: np.ndarray) -> list[int]:
        """Records the steps of ``timestep``; ``observations`` are its learner-space values.

        Returns:
          The links each recorded env step went to (one entry per MID or LAST step).
        """
        counted = []
        truncated = timestep.truncated
        state = timestep.state
        for position, world_id in enumerate(timestep.env_ids):
            world = int(world_id)
            obs = observations[position]
            self.last_obs[world] = obs
            sent, self.pending[world] = self.pending[world], None
            step_type = int(timestep.step_type[position])
            if step_type == 0:
                if truncated is not None and truncated[position]:
                    self._count_cut(world)
                self._close(world, truncated=True)
                self._start(world, obs)
                continue
            episode = self.open[world]
            if episode is None or sent is None:  # cannot happen: a MID step follows a FIRST
                raise AssertionError(f"world {world}: a step with no episode or no action")
            action, extras = sent
            last = step_type == 2
            ended = last and (state is None or int(state[position]) == _TERMINATED)
            episode.add_env_step(
                obs,
                action,
                float(timestep.reward[position]),
                terminated=ended,
                truncated=last and not ended,
                extra_model_outputs=extras,
            )
            link = self.link[world]
            self.recorded[link] += 1
            counted.append(link)
            if last:
                self.returns.append(float(episode.get_return()))
                self._close(world, truncated=False)
        return counted

    def let_go(self, world: int) -> None:
        """Closes the open episode of a world removed from the batch, truncated."""
        self._count_cut(world)
        self._close(world, truncated=True)
        self.pending[world] = None

    def ship(self) -> list[list[SingleAgentEpisode]]:
        """Every chunk not shipped yet, by link (see the module docs); forgets them."""
        chunks = self.done
        for world, episode in enumerate(self.open):
            if episode is not None and len(episode):
                chunks[self.link[world]].append(episode)
                self.open[world] = episode.cut()
        self.done = [[] for _ in range(self.links)]
        self.recorded = [0] * self.links
        return chunks

    def unshipped_steps(self) -> int:
        """Env steps recorded and not shipped (open episodes and finished chunks)."""
        done = sum(len(e) for chunks in self.done for e in chunks)
        return done + sum(len(e) for e in self.open if e is not None)
