"""A world's one bounded-integer action as ``Discrete``, and rows back (SB3's, PettingZoo's).

Used by ``sb3.BatchedVecEnv`` and ``pettingzoo.ParallelEnv`` (here, beside the spaces, so
that neither needs the other's library). Stable-Baselines3's policies give a ``Discrete`` action as ``0 .. n-1`` (and a
``MultiDiscrete`` one per entry likewise), so a bounded integer ``Box`` action
(Catch's paddle: int8 in ``[-1, 1]``) is shown as ``Discrete(high - low + 1)``
(scalar) or ``MultiDiscrete`` (1-D), and ``low`` is added back before sending.
Anything else keeps the Gymnasium bridge's space (``gymnasium._spaces``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from ... import errors

DISCRETE_LIMIT = 1 << 16
"""The most values an integer action may have to be shown as ``Discrete``/``MultiDiscrete``."""

_BAD_ACTIONS = (
    "Actions must be one row per world: shape {expected} for {count} worlds of {space}; got {got}."
)


class ActionMap:
    """SB3's action space for one action tensor, and batches of its values as the SDK's.

    Args:
      space: the Gymnasium bridge's space of the action.
      count: how many worlds (rows) a batch has.
      discrete: show a bounded integer ``Box`` as ``Discrete``/``MultiDiscrete``.
    """

    def __init__(self, space: Any, count: int, discrete: bool) -> None:
        self.count = count
        self.dtype = np.dtype(space.dtype)
        self.space: Any = space
        self.offset: Any = None  # added to SB3's values before sending; None: sent as given
        if not (discrete and isinstance(space, spaces.Box) and self.dtype.kind in "iu"):
            return
        low, high = space.low.astype(np.int64), space.high.astype(np.int64)
        counts = high - low + 1
        if space.shape == () and 0 < int(counts) <= DISCRETE_LIMIT:
            self.space, self.offset = spaces.Discrete(int(counts)), int(low)
        elif len(space.shape) == 1 and (counts > 0).all() and (counts <= DISCRETE_LIMIT).all():
            self.space, self.offset = spaces.MultiDiscrete(counts), low

    def to_sdk(self, actions: Any) -> np.ndarray:
        """SB3's batch of actions (one row per world) as the action tensor's values.

        Raises:
          SpecValidationError: the wrong shape, or a value outside a discrete space.
        """
        array = np.asarray(actions)
        expected = (self.count, *self.space.shape)
        if array.shape != expected and array.size == self.count * int(np.prod(expected[1:])):
            array = array.reshape(expected)  # e.g. [n, 1] for a Discrete action
        if array.shape != expected:
            raise self._refused(f"{array.dtype} {array.shape}")
        if self.offset is None:
            return array
        high = self.space.n if isinstance(self.space, spaces.Discrete) else self.space.nvec
        if array.dtype.kind not in "iu" and not np.array_equal(array, np.round(array)):
            raise self._refused(f"non-integer values {array.ravel()[:5]}")
        bad = array[(array < 0) | (array >= high)]
        if bad.size:
            raise self._refused(f"values {np.unique(bad)[:5]}")
        return (array.astype(np.int64) + self.offset).astype(self.dtype)

    def _refused(self, got: str) -> errors.SpecValidationError:
        expected = (self.count, *self.space.shape)
        return errors.SpecValidationError(
            _BAD_ACTIONS.format(expected=expected, count=self.count, space=self.space, got=got)
        )
