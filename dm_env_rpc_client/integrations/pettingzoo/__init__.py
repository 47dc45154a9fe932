"""PettingZoo bridge: a multi-agent world as a ``pettingzoo.ParallelEnv``; RLlib's route on it."""

from ._parallel import ParallelEnv, aec_env
from ._rllib import rllib_env

__all__ = ["ParallelEnv", "aec_env", "rllib_env"]
