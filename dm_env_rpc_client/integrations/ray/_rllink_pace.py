"""Pacing an RLlink run: one round shipped per update of the learner's weights.

A run with the learner's module (on-policy), or ``paced=True`` (off-policy), ships each
round with ``EPISODES_AND_GET_STATE`` and takes the answer before shipping the next. Ray's
``EnvRunnerServerForExternalInference`` answers on every ``set_state`` call on its
EnvRunner, and RLlib 2.60 makes two an iteration: the learner's weights
(``sync_weights``), then the connector states (``sync_env_runner_states``, which carry no
weights). A round shipped between the two (a pipelined client ships its next round the
moment the first answer comes) is answered by the second, untrained: a client that took
every answer for a trained round would ship two rounds an iteration, act with weights
that did not learn from the last one, and leave a learner told to run N iterations
waiting for rounds it had already sent.

So a ``Pacer`` keeps each link's ``weights_seq_no`` (the learner's count of updates),
and after an answer whose weights did not move it asks again (``GET_STATE``, every
``PACE_POLL`` seconds) until they do: one round per update. Until a link's weights
first move (an off-policy learner that has not started learning: DQN before
``num_steps_sampled_before_learning_starts``) every answer lets the next round go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ._rllink_wire import STOPPED, LearnerUnreachableError, Link, LinkStopped

PACE_POLL = 0.02  # seconds between GET_STATEs while a paced run waits for an update
NO_UPDATE = (
    "the RLlib learner at {address} answered but did not update its weights for "
    "{seconds:.0f} s (learner_timeout) after it was sent a round; raise learner_timeout "
    "if its training iterations take longer"
)


def seq_no(state: Mapping[str, Any]) -> int:
    """The version of the weights in a learner's state (0 if it gives none)."""
    return int(state.get("weights_seq_no", 0) or 0)


class Pacer:
    """Each link's last ``weights_seq_no``; waits for the next one after an answer."""

    def __init__(
        self,
        links: list[Link],
        timeout: float,
        learner_timeout: float,
        stop: threading.Event,
        say: Callable[[str], None],
    ) -> None:
        self.timeout, self.learner_timeout, self.stop, self.say = (
            timeout,
            learner_timeout,
            stop,
            say,
        )
        self.seq = {id(link): seq_no(link.state(timeout)) for link in links}
        self.learning: set[int] = set()  # links whose weights have moved at least once
        self.waits = 0  # answers after which the pacer asked again

    def next(self, link: Link, state: dict[str, Any]) -> dict[str, Any]:
        """The state that lets the next round go to ``link``, given its answer ``state``.

        Raises:
          LearnerUnreachableError: the weights did not move for ``learner_timeout``.
          LinkDroppedError: the link broke while asked again.
          LinkStopped: the run's stop was set.
        """
        key = id(link)
        if not self.moved(link, state):
            self.waits += 1
            if self.waits == 1:
                self.say(f"waiting for the learner at {link.address} to update its weights")
            deadline = time.monotonic() + self.learner_timeout
            while seq_no(state) <= self.seq[key]:
                if time.monotonic() >= deadline:
                    raise LearnerUnreachableError(
                        NO_UPDATE.format(address=link.address, seconds=self.learner_timeout)
                    )
                if self.stop.wait(PACE_POLL):
                    raise LinkStopped(STOPPED)
                state = link.state(self.timeout)
        if seq_no(state) > self.seq[key]:
            self.learning.add(key)
        self.seq[key] = seq_no(state)
        return state

    def moved(self, link: Link, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` lets the next round go to ``link`` without asking again."""
        key = id(link)
        return key not in self.learning or seq_no(state) > self.seq[key]

    def rebase(self, link: Link, state: Mapping[str, Any]) -> None:
        """After a reconnect: the state asked for is the new baseline."""
        self.seq[id(link)] = seq_no(state)
