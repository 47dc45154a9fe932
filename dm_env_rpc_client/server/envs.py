"""Small environments for benchmarks and tests of the embedded server.

``LargeObservation(size)``: one float32 observation ``values`` of ``[size]``
elements and one float32 action ``delta``; episodes last ``length`` steps. It is
what ``python -m dm_env_rpc_client.server --env large --size 100000`` serves.
"""

from __future__ import annotations

from typing import Any

import dm_env
import numpy as np
from dm_env import specs


class LargeObservation(dm_env.Environment):
    """An environment with one large float32 observation."""

    def __init__(self, size: int = 100_000, length: int = 100, seed: int = 0) -> None:
        self._size = int(size)
        self._length = int(length)
        if self._size < 0 or self._length < 1:
            raise ValueError(f"size must be >= 0 and length >= 1, got {size} and {length}.")
        self._values = np.random.default_rng(int(seed)).random(self._size, dtype=np.float32)
        self._steps = 0

    def reset(self) -> dm_env.TimeStep:
        self._steps = 0
        return dm_env.restart({"values": self._values})

    def step(self, action: Any) -> dm_env.TimeStep:
        self._steps += 1
        if self._steps >= self._length:
            return dm_env.truncation(np.float32(1.0), {"values": self._values}, np.float32(1.0))
        return dm_env.transition(np.float32(1.0), {"values": self._values}, np.float32(1.0))

    def observation_spec(self) -> dict[str, specs.Array]:
        return {"values": specs.Array((self._size,), np.float32, name="values")}

    def action_spec(self) -> dict[str, specs.Array]:
        return {"delta": specs.Array((), np.float32, name="delta")}

    def reward_spec(self) -> specs.Array:
        return specs.Array((), np.float32, name="reward")

    def discount_spec(self) -> specs.BoundedArray:
        return specs.BoundedArray((), np.float32, 0.0, 1.0, name="discount")
