"""A test environment with variable-length tensors, served with ``--env variable_env:make``.

``word``: an int32 action of ``[-1]`` elements (any length); observation ``echo``: the
last action as float32 ``[-1]``, and ``length``: its length. Episodes last 3 steps.
"""

from __future__ import annotations

from typing import Any

import dm_env
import numpy as np
from dm_env import specs


class VariableArray(specs.Array):
    """An Array spec whose -1 dimensions take any length."""

    def validate(self, value: Any) -> np.ndarray:
        value = np.asarray(value)
        fits = value.ndim == len(self.shape) and all(
            want < 0 or want == got for want, got in zip(self.shape, value.shape, strict=True)
        )
        if not fits or value.dtype != self.dtype:
            self._fail_validation(
                f"Expected shape {self.shape} and dtype {self.dtype}, got {value}"
            )
        return value


class Variable(dm_env.Environment):
    """Echoes a variable-length action back as a variable-length observation."""

    def __init__(self, seed: int = 0) -> None:
        self._steps = 0
        self._rng = np.random.default_rng(int(seed))

    def _observation(self, word: np.ndarray) -> dict[str, Any]:
        return {"echo": word.astype(np.float32), "length": np.int32(len(word))}

    def reset(self) -> dm_env.TimeStep:
        self._steps = 0
        start = self._rng.integers(0, 9, size=int(self._rng.integers(1, 4)), dtype=np.int32)
        return dm_env.restart(self._observation(start))

    def step(self, action: Any) -> dm_env.TimeStep:
        self._steps += 1
        observation = self._observation(np.asarray(action["word"]))
        if self._steps >= 3:
            return dm_env.termination(np.float32(len(action["word"])), observation)
        return dm_env.transition(np.float32(0.0), observation)

    def observation_spec(self) -> dict[str, specs.Array]:
        return {
            "echo": VariableArray((-1,), np.float32, name="echo"),
            "length": specs.Array((), np.int32, name="length"),
        }

    def action_spec(self) -> dict[str, specs.Array]:
        return {"word": VariableArray((-1,), np.int32, name="word")}

    def reward_spec(self) -> specs.Array:
        return specs.Array((), np.float32, name="reward")

    def discount_spec(self) -> specs.BoundedArray:
        return specs.BoundedArray((), np.float32, 0.0, 1.0, name="discount")


def make(settings: dict[str, Any]) -> dm_env.Environment:
    """The factory for ``serve --env variable_env:make``."""
    return Variable(**settings)


def needs_settings(settings: dict[str, Any]) -> dm_env.Environment:
    """A factory that refuses to make an environment without settings."""
    if not settings:
        raise ValueError("give the seed setting")
    return Variable(**settings)
