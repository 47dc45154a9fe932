"""Uneven vector steps of ``GymnasiumVectorEnv``: restarted worlds, failed worlds, autoreset.

Most vector steps are one ``BatchedTimeStep`` of every world, turned into
gymnasium's tuple in one go. A vector step is *uneven* when:

- the batch restarted a world (``on_world_failure="restart"``): its answer is
  the FIRST step of a new episode, flagged ``truncated``. Gymnasium's NEXT_STEP
  autoreset wants the cut episode to end on this step (truncated) and the new
  one to start on the next (reward 0, the action ignored). So that FIRST step
  is reported twice: here as the truncated end of the old episode, and on the
  next vector step as the autoreset step, for which the world is sent nothing;
- a world has no step for this vector step: it failed, was removed, did not
  answer in time, or the server refused its step. Its row is a stand-in (each
  observation's ``spec.generate_value()``, reward 0), marked by
  ``infos["error"]``. It is truncated when its episode is over for this env
  (it failed under "raise", was removed, or is being restarted), not when only
  its step was refused (then the world goes on where it was).

``Uneven`` keeps what carries over from one vector step to the next: the
autoreset steps already known (``held``), and the restarting worlds whose
truncation was reported already (``cut``), whose late FIRST step is then their
autoreset step and not a second truncation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import dm_env
import numpy as np

from ... import errors
from ..._adaptor.stacked import BatchedTimeStep
from ..._proto import dm_env_rpc_pb2
from ...batched import BatchedEnvironment

State = dm_env_rpc_pb2.EnvironmentStateType
_REMOVED = (
    "the batch removed it after it failed beyond its restart bounds (see batch.failures); "
    "a VectorEnv keeps its num_envs: close this one and make a new one"
)
_NO_STEP = "it has no step in flight to answer this vector step"

Row = tuple[dm_env.TimeStep, int, bool]  # a world's step, its server state, restart flag


class Assembled(NamedTuple):
    """An uneven vector step, world by world (index = world)."""

    timesteps: list[dm_env.TimeStep]
    states: np.ndarray  # uint8 server states (RUNNING for a stand-in)
    cut: np.ndarray  # bool: truncated by a failure, on top of the server's INTERRUPTED
    restarted: np.ndarray  # bool: the first step after a restart
    failures: np.ndarray  # object: the WorldFailure of a restarted world
    errors: np.ndarray  # object: the WorldError of a world with no step


class Uneven:
    """What carries over between uneven vector steps (see the module docs).

    Args:
      batch: the VectorEnv's batch.
      count: how many worlds (``num_envs``).
    """

    def __init__(self, batch: BatchedEnvironment, count: int) -> None:
        self._batch = batch
        self._ids = list(range(count))
        self.held: dict[int, tuple[dm_env.TimeStep, int]] = {}
        self.cut: set[int] = set()
        self._stand_in: Any = None

    def clear(self) -> None:
        """Forgets everything carried over (after a reset)."""
        self.held.clear()
        self.cut.clear()

    def to_send(self) -> list[int]:
        """The worlds that take this vector step's actions: not those whose answer is known or on its way."""
        return [i for i in self._ids if i not in self.held and not self._batch.in_flight(i)]

    def collect(
        self,
        got: BatchedTimeStep | None,
        error: errors.WorldError | None,
        deadline: float | None,
    ) -> tuple[dict[int, Row], dict[int, errors.WorldError]]:
        """Every world's answer to this vector step, or the error that stands for it.

        Args:
          got: steps already received, if any.
          error: an error already raised for a world, if any.
          deadline: ``time.monotonic()`` by which every world must have answered.
        """
        rows: dict[int, Row] = {i: (step, state, False) for i, (step, state) in self.held.items()}
        self.held = {}
        failed: dict[int, errors.WorldError] = {}
        if got is not None:
            _take(got, rows)
        if error is not None:
            failed[error.index] = error
        for _ in range(len(self._ids) + 1):  # each round takes the steps or fails one more world
            waiting = []
            for index in self._ids:
                if index in rows or index in failed:
                    continue
                if self._batch.in_flight(index):
                    waiting.append(index)
                else:
                    removed = index not in self._batch.live_ids
                    reason = errors.DmEnvRpcClientError(_REMOVED if removed else _NO_STEP)
                    failed[index] = self._batch._wrap(index, reason)
            if not waiting:
                break
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                _take(self._batch.recv(env_ids=waiting, timeout=remaining), rows)
            except errors.WorldError as exc:
                failed[exc.index] = exc
        return rows, failed

    def assemble(self, rows: dict[int, Row], failed: dict[int, errors.WorldError]) -> Assembled:
        """The vector step of ``collect``'s answers; notes what carries over to the next."""
        count = len(self._ids)
        out = Assembled(
            [],
            np.full(count, State.RUNNING, np.uint8),
            np.zeros(count, bool),
            np.zeros(count, bool),
            np.full(count, None, object),
            np.full(count, None, object),
        )
        for index in self._ids:
            if index in rows:
                timestep, state, flagged = rows[index]
                out.states[index] = state
                if flagged:
                    out.restarted[index] = True
                    out.failures[index] = self._batch._latest_failure(index)
                    if index in self.cut:  # its truncation was reported: this is its autoreset step
                        self.cut.discard(index)
                    else:
                        out.cut[index] = True
                        self.held[index] = (timestep, state)
            else:
                timestep = self._stand_in_step()
                error = out.errors[index] = failed[index]
                removed = index not in self._batch.live_ids
                raised = any(
                    f.index == index and f.outcome == "raised" for f in self._batch.failures
                )
                restarting = not (removed or raised) and isinstance(error, errors.WorldTimeoutError)
                out.cut[index] = (removed or raised or restarting) and index not in self.cut
                if restarting:
                    self.cut.add(index)
                else:
                    self.cut.discard(index)
            out.timesteps.append(timestep)
        return out

    def _stand_in_step(self) -> dm_env.TimeStep:
        """A FIRST step (reward 0, no discount) with every observation's ``generate_value()``."""
        if self._stand_in is None:
            self._stand_in = _generate(self._batch.observation_spec())
        return dm_env.TimeStep(dm_env.StepType.FIRST, None, None, self._stand_in)


def _generate(spec: Any) -> Any:
    if isinstance(spec, Mapping):
        return {key: _generate(value) for key, value in spec.items()}
    return spec.generate_value()


def _take(batch: BatchedTimeStep, rows: dict[int, Row]) -> None:
    """Files each world's step of ``batch`` in ``rows``."""
    count = len(batch.env_ids)
    states = batch.state if batch.state is not None else np.full(count, State.RUNNING)
    flags = batch.truncated if batch.truncated is not None else np.zeros(count, bool)
    for position, index in enumerate(batch.env_ids.tolist()):
        rows[index] = (batch.at(position), int(states[position]), bool(flags[position]))
