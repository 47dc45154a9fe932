"""Stable-Baselines3 bridge: many remote worlds as one SB3 ``VecEnv``, at the batch's speed."""

from ._api import (
    DISCRETE_LIMIT,
    BatchedVecEnv,
    RemoteWorld,
)

__all__ = [
    "DISCRETE_LIMIT",
    "BatchedVecEnv",
    "RemoteWorld",
]
