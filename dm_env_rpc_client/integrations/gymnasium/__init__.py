"""Gymnasium bridge: a dm_env_rpc world as a ``gymnasium.Env``, many as a ``VectorEnv``."""

from ._api import (
    DISCOUNT_KEY,
    ENV_ID,
    AnyText,
    GymnasiumEnv,
    GymnasiumVectorEnv,
    make_vector,
    register,
    space_from_spec,
    spaces_from_specs,
)

__all__ = [
    "DISCOUNT_KEY",
    "ENV_ID",
    "AnyText",
    "GymnasiumEnv",
    "GymnasiumVectorEnv",
    "make_vector",
    "register",
    "space_from_spec",
    "spaces_from_specs",
]
