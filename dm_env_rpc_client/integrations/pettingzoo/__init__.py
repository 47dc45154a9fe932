"""PettingZoo bridge: one multi-agent dm_env_rpc world as a ``pettingzoo.ParallelEnv``, and
RLlib's multi-agent route over it (``rllib_env``)."""

from ._parallel import ParallelEnv, aec_env
from ._rllib import rllib_env

__all__ = ["ParallelEnv", "aec_env", "rllib_env"]
