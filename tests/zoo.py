"""A zoo ``dm_env.Environment`` for the gymnasium bridge: every dtype and spec shape at once.

Actions cover all 9 numeric and bool dtypes, a scalar string, scalar bounds
broadcast over a shape, per-element bounds, unbounded tensors, discrete
actions and dotted (nested) names. The observation ``act`` echoes the last
action (its spec is the action spec), so a test can see what the server got;
``camera`` is an image (for ``render``); ``strings`` (a string array),
``ragged`` (a variable dimension) and ``proto`` (a proto tensor) have no
gymnasium space. Episodes last ``length`` steps and end TERMINATED, or
INTERRUPTED with ``truncate=True``. Observations are drawn from a seeded RNG,
within their bounds.
"""

from __future__ import annotations

from typing import Any

import dm_env
import numpy as np
from dm_env import specs as dm_specs
from google.protobuf import any_pb2, struct_pb2

from dm_env_rpc_client import specs

U64_MAX = np.iinfo(np.uint64).max


def action_specs() -> dict[str, Any]:
    """The zoo's action specs, nested."""
    return {
        "f32": dm_specs.BoundedArray((2, 3), np.float32, -1.0, 1.0, name="f32"),
        "f64": dm_specs.Array((2,), np.float64, name="f64"),
        "i8": dm_specs.BoundedArray((), np.int8, -5, 5, name="i8"),
        "i32": dm_specs.DiscreteArray(4, dtype=np.int32, name="i32"),
        "i64": dm_specs.Array((3,), np.int64, name="i64"),
        "u8": dm_specs.BoundedArray((2,), np.uint8, [0, 10], [5, 255], name="u8"),
        "u32": dm_specs.Array((), np.uint32, name="u32"),
        "u64": dm_specs.Array((2,), np.uint64, name="u64"),
        "flag": dm_specs.Array((3,), np.bool_, name="flag"),
        "text": dm_specs.StringArray((), name="text"),
        "arm": {
            "joint": dm_specs.BoundedArray((2,), np.float32, -3.0, 3.0, name="joint"),
            "grip": dm_specs.DiscreteArray(2, dtype=np.uint8, name="grip"),
        },
    }


def _draw(spec: dm_specs.Array, rng: np.random.Generator) -> Any:
    """A random value inside ``spec``."""
    if isinstance(spec, dm_specs.StringArray):
        return "".join(rng.choice(list("héllo wörld ✓"), size=int(rng.integers(0, 8))))
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "b":
        return rng.random(spec.shape) < 0.5
    if isinstance(spec, dm_specs.BoundedArray):
        low = np.broadcast_to(spec.minimum, spec.shape).astype(np.float64)
        high = np.broadcast_to(spec.maximum, spec.shape).astype(np.float64)
        if dtype.kind == "f":
            return np.asarray(rng.uniform(low, high)).astype(dtype)
        return np.asarray(np.floor(rng.uniform(low, high + 1)).clip(low, high)).astype(dtype)
    if dtype.kind == "f":
        return rng.normal(0, 1e6, spec.shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, spec.shape, dtype=dtype, endpoint=True)


class Zoo(dm_env.Environment):
    """See the module docstring."""

    def __init__(self, seed: int = 0, length: int = 4, truncate: bool = False) -> None:
        self._rng = np.random.default_rng(int(seed))
        self._length = int(length)
        self._truncate = bool(truncate)
        self._steps = 0
        self._actions = action_specs()
        self._act = specs.unflatten(
            {
                name: spec.generate_value()
                for name, spec in specs.flatten_dm_env_specs(self._actions).items()
            }
        )

    def _observation(self) -> dict[str, Any]:
        proto = any_pb2.Any()
        proto.Pack(struct_pb2.Value(number_value=float(self._steps)))
        return {
            "act": self._act,
            "camera": self._rng.integers(0, 256, (4, 6, 3), dtype=np.uint8),
            "level": _draw(dm_specs.BoundedArray((), np.float64, 0.0, 1.0), self._rng),
            "strings": np.array(["a", "b"], dtype=object),
            "ragged": np.arange(self._steps, dtype=np.float32),
            "proto": proto,
        }

    def reset(self) -> dm_env.TimeStep:
        self._steps = 0
        return dm_env.restart(self._observation())

    def step(self, action: Any) -> dm_env.TimeStep:
        self._act = action
        self._steps += 1
        if self._steps >= self._length:
            if self._truncate:
                return dm_env.truncation(np.float32(1.0), self._observation(), np.float32(0.5))
            return dm_env.termination(np.float32(1.0), self._observation())
        return dm_env.transition(np.float32(0.5), self._observation(), np.float32(0.5))

    def dm_env_rpc_reset_settings(self, settings: dict[str, Any]) -> None:
        """Takes ``seed``."""
        self._rng = np.random.default_rng(int(settings["seed"]))

    def observation_spec(self) -> dict[str, Any]:
        return {
            "act": self._actions,
            "camera": dm_specs.BoundedArray((4, 6, 3), np.uint8, 0, 255, name="camera"),
            "level": dm_specs.BoundedArray((), np.float64, 0.0, 1.0, name="level"),
            "strings": dm_specs.StringArray((2,), name="strings"),
            "ragged": specs.VariableArray((-1,), np.float32, name="ragged"),
            "proto": dm_specs.Array((), np.object_, name="proto"),
        }

    def action_spec(self) -> dict[str, Any]:
        return self._actions

    def reward_spec(self) -> dm_specs.Array:
        return dm_specs.Array((), np.float32, name="reward")

    def discount_spec(self) -> dm_specs.BoundedArray:
        return dm_specs.BoundedArray((), np.float32, 0.0, 1.0, name="discount")


SPACELESS = ("strings", "ragged", "proto")
"""The zoo's observations that have no gymnasium space."""
