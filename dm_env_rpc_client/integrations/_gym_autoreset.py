"""Gymnasium's autoreset modes for ``GymnasiumVectorEnv``, and ``reset_mask``.

The protocol itself autoresets the NEXT_STEP way: the step after a world's
LAST step is the FIRST step of its next sequence (its action is ignored). The
other two modes are built on that:

- SAME_STEP: the vector step on which worlds end also returns their next
  episode's first observation. Once every world has answered, each world that
  ended is sent its next step at once (the protocol's autoreset step, with the
  action it was just sent, which the server ignores), all of them in one
  pipelined batch, and that FIRST step's observation replaces the ended
  world's row; the LAST observation goes to ``infos["final_obs"]`` and its
  info to ``infos["final_info"]``, with gymnasium's own ``_add_info``, so the
  layout is exactly that of gymnasium's ``SyncVectorEnv`` of the version in
  use. The next ``step()`` then sends every world a real step. A world counts
  the same server steps per episode as in NEXT_STEP (its autoreset step is
  taken one vector step earlier); a vector step on which a world ended waits
  for one more round trip of the ended worlds (measured in
  ``bench/gym_vector.py``).
- DISABLED: nothing is reset; a world that ended must be reset with
  ``reset(options={"reset_mask": mask})`` before it is stepped again.

``reset_mask`` (gymnasium 1.1 and newer) resets only the masked worlds; the
others keep their episode and their last observation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import Space
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array, iterate

from dm_env_rpc_client import errors

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
    raise ValueError(_MODE.format(modes=modes, value=value))


def reset_mask(mask: Any, count: int) -> np.ndarray:
    """Checks ``options["reset_mask"]`` as gymnasium's ``SyncVectorEnv`` does; a clear ValueError."""
    if not isinstance(mask, np.ndarray):
        what = type(mask).__name__
    elif mask.dtype != np.bool_ or mask.shape != (count,):
        what = f"{mask.dtype} {mask.shape}"
    elif not mask.any():
        what = "no True value"
    else:
        return mask
    raise ValueError(_MASK.format(count=count, what=what))


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
