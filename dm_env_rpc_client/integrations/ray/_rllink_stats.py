"""``RLlinkStats``: what a ``run_rllink`` run did (``ray._rllink``), as one flat summary."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ._rllink_episodes import ON_POLICY


@dataclasses.dataclass
class RLlinkStats:
    """What a ``run_rllink`` run did.

    Attributes:
      worlds: worlds stepped.
      agents: agents per world (each its own episodes, one shared policy).
      steps: env steps recorded (FIRST steps not counted; one per agent of a world).
      episodes: episodes that reached their LAST step.
      returns: the return of each of them.
      rounds: batches of episodes shipped (to every link).
      steps_shipped: env steps shipped and taken by the learner.
      unconfirmed_steps: env steps sent whole whose answer never came (the
        learner may or may not have them; never sent twice).
      unshipped_steps: env steps recorded and not shipped when the run ended.
      weight_updates: new weights loaded.
      lagged_steps: actions the module chose while the weights trained on the round
        shipped last had not come yet (with weights one round old; 0 with ``lockstep``).
      truncated_by_failure: episodes cut by a world's failure (shipped truncated).
      cut_after_ship: episodes cut by a failure right after their chunk was shipped
        (no step left to mark truncated; see ``ray._rllink_episodes``).
      reconnects: one line per RLlib connection made again.
      restarts: one line per world restarted by the batch.
      worlds_lost: worlds removed from the batch.
      elapsed: seconds of the run.
      cpu_seconds: CPU time this process spent in the run (every thread: stepping,
        forward passes, episodes, shipping), for the CPU per step in ``summary()``.
      stepping_seconds: wall time spent stepping the worlds (``collect``).
      shipping_seconds: wall time spent encoding and sending episodes.
      learner_seconds: wall time spent waiting for the learner's weights after shipping
        (its training step, and the trip of the episodes and weights through Ray).
      learner_gone: the run ended because the learner did not come back.
      stop_reason: why the run ended.
      behavior: ``"rl_module"`` (on-policy) or ``"external"`` (the user's policy).
    """

    worlds: int = 0
    agents: int = 1
    steps: int = 0
    episodes: int = 0
    returns: list[float] = dataclasses.field(default_factory=list)
    rounds: int = 0
    steps_shipped: int = 0
    unconfirmed_steps: int = 0
    unshipped_steps: int = 0
    weight_updates: int = 0
    lagged_steps: int = 0
    truncated_by_failure: int = 0
    cut_after_ship: int = 0
    reconnects: list[str] = dataclasses.field(default_factory=list)
    restarts: list[str] = dataclasses.field(default_factory=list)
    worlds_lost: int = 0
    elapsed: float = 0.0
    cpu_seconds: float = 0.0
    stepping_seconds: float = 0.0
    shipping_seconds: float = 0.0
    learner_seconds: float = 0.0
    learner_gone: bool = False
    stop_reason: str = ""
    behavior: str = ON_POLICY

    def summary(self) -> dict[str, Any]:
        """The stats as one flat, JSON-ready dict."""
        data = dataclasses.asdict(self)
        returns = data.pop("returns")
        data["return_mean"] = round(float(np.mean(returns)), 3) if returns else None
        data["steps_per_second"] = round(self.steps / self.elapsed, 1) if self.elapsed else None
        data["cpu_us_per_step"] = (
            round(1e6 * self.cpu_seconds / self.steps, 1) if self.steps else None
        )
        return data
