"""PettingZoo bridge: one multi-agent dm_env_rpc world as a ``pettingzoo.ParallelEnv``."""

from ._parallel import ParallelEnv, aec_env

__all__ = ["ParallelEnv", "aec_env"]
