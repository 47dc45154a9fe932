"""RLlib multi-agent over ``ParallelEnv``: RLlib's own ``ParallelPettingZooEnv`` around it.

``rllib_env`` is the env creator to register (``ray.tune.registry.register_env(name,
rllib_env)``): RLlib calls it in every env runner, in that runner's process, with the
``env_config`` (``ParallelEnv``'s keyword arguments: ``address``, ``num_agents``,
``create_world_settings``, ...), so each runner makes a world of its own. It is a
function of this package (not of the caller's script) so that runners in other
processes can import it. Needs RLlib (``pip install 'dm_env_rpc_client[rllib,pettingzoo]'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._parallel import ParallelEnv

_NO_RLLIB = (
    "rllib_env needs RLlib: pip install 'dm_env_rpc_client[rllib,pettingzoo]' "
    "(ray[rllib] and torch)."
)


def rllib_env(env_config: Mapping[str, Any]) -> Any:
    """A ``ParallelPettingZooEnv`` (an RLlib ``MultiAgentEnv``) over ``ParallelEnv(**env_config)``.

    Args:
      env_config: ``ParallelEnv``'s keyword arguments (RLlib's ``EnvContext`` is a dict).

    Returns:
      RLlib's ``ParallelPettingZooEnv`` around a new ``ParallelEnv`` (its own world).

    Raises:
      ImportError: RLlib is not installed (naming the extra).
      WorldError: the world could not be made or joined.
    """
    try:
        from ray.rllib.env.wrappers.pettingzoo_env import ParallelPettingZooEnv
    except ImportError as exc:  # pragma: no cover - exercised in a venv without RLlib
        raise ImportError(_NO_RLLIB) from exc
    return ParallelPettingZooEnv(ParallelEnv(**dict(env_config)))
