"""What a batch files for a world besides a step, its worlds' states, and the batch's messages.

``BatchCore`` (``_batch.core``) files, per world, either a landed step
(``(step_type, TimeStep-or-RawStep, state)``), the exception of a failed step, or a
``_Failure`` standing for steps a failed or removed world lost; ``_ends`` and
``_is_bad`` tell them apart. ``_LIVE`` .. ``_REMOVED_STATE`` are a world's states in
the batch. The message templates are shared by the batch's opening, taking and
failure paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dm_env
import numpy as np

from .._adaptor.stacked import BatchedTimeStep

_WORLD_FAILED = "World {index} at {address} failed: {error}"
_STALLED = "no response within its step_timeout of {timeout} s (the server may be stopped or hung)"
_FAILED_BEFORE = (
    "it failed before ({cause}) and takes no more steps; leave it out of env_ids, close "
    "the batch, or connect with on_world_failure='restart'"
)
_REMOVED = (
    "it was removed from the batch after {attempts} restart attempts failed "
    "(first failure: {cause}; last attempt: {last}); see envs.failures and envs.live_ids"
)
_LIVE, _FAILED, _RESTARTING, _REMOVED_STATE = 0, 1, 2, 3
_SEED_TWICE = (
    "create_world_settings already holds {name!r}, and seed= sets it per world: "
    "pass one of the two, or a different seed_setting."
)
_NOT_ENVS = (
    "BatchedEnvironment(envs) takes joined worlds (DmEnvAdaptors), not {envs}; to connect to "
    "server addresses, use BatchedEnvironment.connect(addresses, num_envs)."
)
_NAMES_COUNT = "Give one world name per world: {names} names for {count} worlds."


class _Failure:
    """A filed outcome that stands for ``lost`` steps of a failed or removed world."""

    __slots__ = ("cause", "lost", "removed")

    def __init__(self, cause: BaseException, lost: int, removed: bool = False) -> None:
        self.cause, self.lost, self.removed = cause, lost, removed


def _ends(outcome: Any) -> bool:
    """Whether a landed outcome is a LAST step (dm_env.StepType.LAST)."""
    return isinstance(outcome, tuple) and outcome[0] == dm_env.StepType.LAST


def _is_bad(outcome: Any) -> bool:
    return isinstance(outcome, (BaseException, _Failure))


def _flagged(
    batch: BatchedTimeStep, truncated: Sequence[bool] | None, states: Sequence[int]
) -> BatchedTimeStep:
    """The batch with its ``truncated`` flags (all False unless given) and server states."""
    flags = np.zeros(len(batch.env_ids), bool) if truncated is None else np.array(truncated, bool)
    return batch._replace(truncated=flags, state=np.array(states, np.uint8))
