"""The learner's spaces against the worlds': what fits, and the values between them.

The RLlib learner declares its spaces (``.environment(observation_space=...,
action_space=...)``: ``EnvRunnerServerForExternalInference`` has no env to ask);
the worlds have theirs, read from their specs with the Gymnasium bridge's
table (``gymnasium._spaces``). ``SpaceBridge`` checks that one fits the other and
converts between them, for a whole batch at once:

============================== ============================== ======================
worlds (one tensor each side)  learner                        conversion
============================== ============================== ======================
any space                      the same space                 none (dtype cast)
``Box`` of shape S             ``Box`` of shape ``(prod(S),)`` flattened (RLlib's
                                                              default encoders take
                                                              1-D or 3-D Boxes)
integer scalar ``Box[lo, hi]`` ``Discrete(hi - lo + 1)``      ``lo + a`` (Catch's
                                                              paddle -1..1 as 0..2)
``Box`` actions                ``Box`` of the same shape      clipped to the world's
                                                              bounds when sent
============================== ============================== ======================

Anything else raises ``SpaceMismatchError`` saying which space (observation or
action), both sides, and what to declare. Worlds with several observations
(or actions) must be narrowed to one (``requested_observations=[...]``).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from ... import specs
from ...batched import BatchedEnvironment, BatchedTimeStep
from ..gymnasium._spaces import SpaceAdapter, leaf
from ._rllink_wire import SpaceMismatchError

_MISMATCH = (
    "The learner's {kind} space {learner} does not fit the worlds' {kind} {name!r}, {world}. "
    "Declare .environment({kind}_space={hint}) in the RLlib config{more}."
)
_SEVERAL = (
    "The worlds have {count} {kind}s ({names}); the RLlink client feeds RLlib one tensor. {fix}"
)
_FIX = {
    "observation": "Pick one with requested_observations=[NAME].",
    "action": "Serve worlds with a single action tensor.",
}


def _single(adapter: SpaceAdapter, kind: str) -> str:
    if adapter.single is None:
        names = ", ".join(adapter.names)
        raise SpaceMismatchError(
            _SEVERAL.format(count=len(adapter.names), kind=kind, names=names, fix=_FIX[kind])
        )
    return adapter.single


def _int_scalar(space: gymnasium.Space[Any]) -> bool:
    return (
        isinstance(space, spaces.Box) and space.shape == () and np.dtype(space.dtype).kind in "iu"
    )


def _same_discrete(learner: Any, world: Any) -> bool:
    both = isinstance(learner, spaces.Discrete) and isinstance(world, spaces.Discrete)
    return both and learner.n == world.n


def _same_box(learner: Any, world: Any) -> bool:
    both = isinstance(learner, spaces.Box) and isinstance(world, spaces.Box)
    return both and learner.shape == world.shape and np.dtype(world.dtype).kind == "f"


class SpaceBridge:
    """The worlds' spaces against the learner's (see the module docs).

    Args:
      batch: the worlds (their first world's specs stand for all).
      observation_space: the learner's (its config's ``observation_space``).
      action_space: the learner's (its config's ``action_space``).

    Attributes:
      world_observation_space, world_action_space: the worlds' spaces.
      observation_name, action_name: the worlds' tensors on each side.

    Raises:
      SpaceMismatchError: a side does not fit; the message says which.
      SpecError: a tensor with no gymnasium space.
    """

    def __init__(
        self,
        batch: BatchedEnvironment,
        observation_space: gymnasium.Space[Any] | None,
        action_space: gymnasium.Space[Any] | None,
    ) -> None:
        template = batch.envs[0]
        wire = template._wire_specs
        observations = SpaceAdapter(
            wire.observations, list(specs.flatten(template.observation_spec())), "observation", True
        )
        actions = SpaceAdapter(
            wire.actions, list(specs.flatten(template.action_spec())), "action", True
        )
        self.observation_name = _single(observations, "observation")
        self.action_name = _single(actions, "action")
        self.world_observation_space = observations.space
        self.world_action_space = actions.space
        self.observation_space, self.action_space = observation_space, action_space
        self._flatten = self._check_observations()
        self._offset = self._check_actions()

    def _mismatch(self, kind: str, learner: Any, world: Any, hint: str, more: str = "") -> None:
        name = self.observation_name if kind == "observation" else self.action_name
        raise SpaceMismatchError(
            _MISMATCH.format(
                kind=kind, learner=learner, name=name, world=world, hint=hint, more=more
            )
        )

    def _check_observations(self) -> bool:
        world, learner = self.world_observation_space, self.observation_space
        if learner == world:
            return False
        if isinstance(world, spaces.Box) and isinstance(learner, spaces.Box):
            size = int(np.prod(world.shape))
            if learner.shape == (size,):
                return True
            if learner.shape == world.shape:
                return False  # a dtype the values are cast to
            hint = f"gymnasium.spaces.Box(low, high, ({size},), np.{np.dtype(world.dtype).name})"
            self._mismatch("observation", learner, world, hint, more=" (flattened)")
        self._mismatch("observation", learner, world, repr(world))
        raise AssertionError  # not reached

    def _check_actions(self) -> int | None:
        world, learner = self.world_action_space, self.action_space
        if isinstance(learner, spaces.Discrete) and _int_scalar(world):
            low, high = int(world.low), int(world.high)  # type: ignore[attr-defined]
            if high - low + 1 == int(learner.n):
                return low - int(learner.start)
            self._mismatch("action", learner, world, f"gymnasium.spaces.Discrete({high - low + 1})")
        if _same_discrete(learner, world):
            return int(world.start) - int(learner.start)  # type: ignore[attr-defined,union-attr]
        if _same_box(learner, world):
            return None
        hint = repr(world)
        if _int_scalar(world):
            low, high = int(world.low), int(world.high)  # type: ignore[attr-defined]
            hint = f"gymnasium.spaces.Discrete({high - low + 1})"
        self._mismatch("action", learner, world, hint)
        raise AssertionError  # not reached

    def observations(self, timestep: BatchedTimeStep) -> np.ndarray:
        """The batch's observations as the learner sees them: ``[B, ...]``."""
        values = np.asarray(leaf(timestep.observation, self.observation_name))
        dtype = getattr(self.observation_space, "dtype", None)
        if self._flatten:
            values = values.reshape(len(values), -1)
        return values if dtype is None else values.astype(dtype, copy=False)

    def to_world(self, actions: np.ndarray) -> dict[str, Any]:
        """The learner's actions ``[B, ...]`` as the worlds' (a stacked SDK mapping)."""
        world = self.world_action_space
        values = np.asarray(actions)
        if self._offset is not None:
            values = values.astype(np.int64) + self._offset
        elif isinstance(world, spaces.Box):
            values = np.clip(values, world.low, world.high)
        return specs.unflatten({self.action_name: values.astype(world.dtype, copy=False)})

    def to_learner(self, actions: Any) -> np.ndarray:
        """The worlds' stacked actions (a policy's) as the learner's ``[B, ...]``."""
        values = np.asarray(leaf(actions, self.action_name))
        if self._offset is not None:
            return values.astype(np.int64) - self._offset
        return values.astype(getattr(self.action_space, "dtype", None) or values.dtype)
