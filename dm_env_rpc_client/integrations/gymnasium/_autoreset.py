"""Gymnasium's autoreset modes for ``GymnasiumVectorEnv``, and ``reset_mask``.

The protocol itself autoresets the NEXT_STEP way: the step after a world's
LAST step is the FIRST step of its next sequence (its action is ignored). The
other two modes are built on that:

- SAME_STEP: the vector step on which worlds end also returns their next
  episode's first observation, and costs no round trip of its own. The env
  turns the batch's ``_autoreset`` on, so the batch's loop thread
  (``_batch.core``), the moment a world's answer lands LAST with nothing else
  in flight for it, writes that world's next step (the protocol's autoreset
  step: the bytes of the step just answered, whose action the server ignores)
  before it even files the LAST answer for ``recv``. By the time ``step_wait``
  has every world's answer, the ended worlds' FIRST steps are in or on their
  way, behind the LAST on the same stream; ``step_wait`` then takes them
  (``_vector_batch.receive_firsts``). That FIRST step's observation replaces the
  ended world's row; the LAST observation goes to ``infos["final_obs"]`` and its
  info to ``infos["final_info"]``, with gymnasium's own ``_add_info``, so the
  layout is exactly that of gymnasium's ``SyncVectorEnv`` of the version in
  use. The next ``step()`` then sends every world a real step. A world counts
  the same server steps per episode as in NEXT_STEP (its autoreset step is
  taken one vector step earlier). Failures follow the batch's policy: a world
  whose server dies with its autoreset step in flight is restarted (its new
  first observation is the row) or, under ``"raise"``, keeps its LAST row and
  ``step_wait`` raises its ``WorldError`` with the other worlds' step kept.
- DISABLED: nothing is reset; a world that ended must be reset with
  ``reset(options={"reset_mask": mask})`` before it is stepped again.

``reset_mask`` (gymnasium 1.1 and newer) resets only the masked worlds; the
others keep their episode and their last observation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import dm_env
import numpy as np
from gymnasium import Space
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array, iterate

from ... import errors
from ...batched import BatchedEnvironment

_LAST = 2  # dm_env.StepType.LAST
Row = tuple[dm_env.TimeStep, int, bool]  # a world's step, its server state, restart flag

_MODE = (
    "autoreset_mode must be one of gymnasium's AutoresetMode values {modes} (or their names), "
    "not {value!r}."
)
_MASK = (
    "options['reset_mask'] must be a NumPy bool array of shape ({count},) with at least one "
    "True (the worlds to reset); got {what}."
)
_NOT_RESET = (
    "World(s) {indices} ended on an earlier step and autoreset_mode is DISABLED: reset them "
    "first with envs.reset(options={{'reset_mask': mask}}) (mask True for those worlds)."
)


def autoreset_mode(value: AutoresetMode | str) -> AutoresetMode:
    """``value`` as an ``AutoresetMode``: the enum, its value (``"SameStep"``) or name."""
    if isinstance(value, AutoresetMode):
        return value
    for mode in AutoresetMode:
        if value in (mode.value, mode.name):
            return mode
    modes = [mode.value for mode in AutoresetMode]
    raise errors.ArgumentValueError(_MODE.format(modes=modes, value=value))


def reset_mask(mask: Any, count: int) -> np.ndarray:
    """Checks ``options["reset_mask"]`` as gymnasium's ``SyncVectorEnv`` does (ArgumentValueError)."""
    if not isinstance(mask, np.ndarray):
        what = type(mask).__name__
    elif mask.dtype != np.bool_ or mask.shape != (count,):
        what = f"{mask.dtype} {mask.shape}"
    elif not mask.any():
        what = "no True value"
    else:
        return mask
    raise errors.ArgumentValueError(_MASK.format(count=count, what=what))


def check_not_ended(ended: np.ndarray) -> None:
    """Raises for DISABLED worlds that ended and were not reset."""
    if ended.any():
        indices = np.flatnonzero(ended).tolist()
        raise errors.DmEnvRpcClientError(_NOT_RESET.format(indices=indices))


def rows(space: Space[Any], batched: Any) -> list[Any]:
    """The per-world values of a batched value of ``space`` (its single space)."""
    return list(iterate(space, batched))


def stacked(single: Space[Any], values: Sequence[Any]) -> Any:
    """Per-world values of ``single`` stacked as its batched space holds them."""
    out: Any = create_empty_array(single, len(values))
    return concatenate(single, values, out)


def empty(single: Space[Any], count: int) -> Any:
    """A zero-filled batched value (the observations of worlds never reset yet)."""
    return create_empty_array(single, count, fn=np.zeros)


def same_step_rows(
    env: Any, observations: Any, infos: dict[str, Any], ended: list[int], firsts: Any
) -> Any:
    """SAME_STEP: each ended world's row becomes its first observation ``firsts`` (stacked).

    Its last observation and info go to ``infos["final_obs"]`` and
    ``infos["final_info"]`` through gymnasium's own ``_add_info``, and its
    ``discount`` becomes the reset's 1.0, as ``SyncVectorEnv`` merges it.
    """
    if _plain(observations) and _plain(firsts):  # arrays: rows by indexing, not per world
        for index in ended:
            final_info = {"discount": infos["discount"][index]}
            env._add_info(
                infos, {"final_obs": _row(observations, index), "final_info": final_info}, index
            )
            infos["discount"][index] = 1.0
        if isinstance(observations, np.ndarray):
            out = observations.copy()
            out[ended] = firsts
            return out
        out = {key: value.copy() for key, value in observations.items()}
        for key, value in out.items():
            value[ended] = firsts[key]
        return out
    items = rows(env.observation_space, observations)
    for index, first in zip(ended, rows(env.observation_space, firsts), strict=True):
        final_info = {"discount": infos["discount"][index]}
        env._add_info(infos, {"final_obs": items[index], "final_info": final_info}, index)
        items[index] = first
        infos["discount"][index] = 1.0
    return stacked(env.single_observation_space, items)


def _plain(value: Any) -> bool:
    """An array, or a flat dict of arrays (a Box, or a Dict of Boxes, batched)."""
    if isinstance(value, dict):
        return all(isinstance(item, np.ndarray) for item in value.values())
    return isinstance(value, np.ndarray)


def _row(value: Any, index: int) -> Any:
    """World ``index``'s row of a ``_plain`` value (copied: the batch's arrays live on)."""
    if isinstance(value, dict):
        return {key: item[index].copy() for key, item in value.items()}
    return value[index].copy()


def drop_in_flight(batch: BatchedEnvironment, ids: list[int], timeout: float | None) -> None:
    """Receives and drops every step still in flight (before a reset)."""
    for _ in ids:
        pending = [index for index in ids if batch.in_flight(index) > 0]
        if not pending:
            return
        with contextlib.suppress(errors.DmEnvRpcClientError, ValueError):
            batch.recv(env_ids=pending, timeout=timeout)
