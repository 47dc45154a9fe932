"""Scale out on Ray: server fleets, sharded stepping, an RLlib env creator.

Needs the ``ray`` extra (``pip install 'dm_env_rpc_client[ray]'``); the core
package never imports this module. Three pieces, each in a private module:

- ``ServerFleet`` (``ray._fleet``): N embedded servers as Ray actors, placed by
  a placement group (``SPREAD`` by default), each on its node's IP and a free
  port; ``addresses``, ``health()``, restarts by Ray, ``close()``.
- ``run_sharded`` (``ray._shards``): K shard actors each step a
  ``BatchedEnvironment`` over their share of the worlds, with random actions or
  a policy; the ``ShardedRun`` totals add the shards up (latency percentiles
  over every step).
- ``rllib_env_creator`` (``ray._rllib``): RLlib's env creator for the new
  API stack under ``VECTOR_ENTRY_POINT``: each EnvRunner gets a
  ``GymnasiumVectorEnv`` over worlds of its own (needs the ``gymnasium`` extra
  and RLlib).
- ``run_rllink`` (``ray._rllink``): the other direction, RLlib's RLlink: this
  machine steps the worlds and runs the learner's RLModule, and ships episodes
  to RLlib ``EnvRunnerServerForExternalInference`` ports (needs the ``rllib``
  extra; imported on first use). ``docs/rllink.md``.
- ``init_ray(target)``: starts or joins Ray the way the command line's
  ``run --ray`` does.

::

    import ray
    from dm_env_rpc_client.integrations.ray import ServerFleet, run_sharded

    ray.init(num_cpus=2, include_dashboard=False)
    with ServerFleet(lambda settings: Catch(**settings), 2, num_cpus=0.5) as fleet:
        run = run_sharded(fleet, num_worlds=8, num_shards=2, steps=2000, seed=0, num_cpus=0.5)
        print(run.steps_per_second, run.latency_p99_ms)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

try:
    import ray
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "dm_env_rpc_client.integrations.ray needs Ray: pip install 'dm_env_rpc_client[ray]'"
    ) from exc

from ._fleet import FleetError, ServerFleet, ServerHealth, ServerInfo
from ._launch import LaunchedFleet
from ._rllib import (
    ENV_NAME,
    free_rllib_env_config,
    register_rllib_env,
    rllib_env_config,
    rllib_env_creator,
    runner_slot,
)
from ._shards import ShardedRun, ShardError, ShardStats, run_sharded, split, summarize

if TYPE_CHECKING:  # imported on first use (__getattr__): they need the rllib extra
    from ._rllink import RLlinkStats, run_rllink
    from ._rllink_wire import (
        LearnerUnreachableError,
        LinkDroppedError,
        RLlinkError,
        SpaceMismatchError,
    )


def __getattr__(name: str) -> Any:
    """The RLlink client's names, imported on first use: they need RLlib (the rllib extra)."""
    if name in _RLLINK:
        try:
            from . import _rllink as _ray_rllink
            from . import _rllink_wire as _ray_rllink_wire
        except ImportError as exc:
            raise ImportError(
                f"dm_env_rpc_client.integrations.ray.{name} needs RLlib and msgpack-numpy: "
                "pip install 'dm_env_rpc_client[rllib]'"
            ) from exc
        for module in (_ray_rllink, _ray_rllink_wire):
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_RLLINK = (
    "LearnerUnreachableError",
    "LinkDroppedError",
    "RLlinkError",
    "RLlinkStats",
    "SpaceMismatchError",
    "run_rllink",
)

LOCAL = "local"
AUTO = "auto"


def init_ray(target: str = LOCAL, *, num_cpus: int | None = None, **kwargs: Any) -> bool:
    """Starts or joins Ray; does nothing if Ray is initialized already.

    Args:
      target: ``"local"`` starts a Ray of this machine alone, without the
        dashboard and without usage reports (it listens on the machine's IP
        address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` was set before
        Ray was imported: then on loopback); ``"auto"`` joins the cluster this
        machine belongs to (``ray start`` ran here); anything else is a cluster
        address (``host:port`` or ``ray://host:port``).
      num_cpus: with ``"local"``, the CPUs Ray may schedule (default all).
      **kwargs: more arguments for ``ray.init``.

    Returns:
      True when this call initialized Ray (so the caller should shut it down).
    """
    if ray.is_initialized():
        return False
    if target == LOCAL:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local run reports nothing
        kwargs.setdefault("include_dashboard", False)
        ray.init(num_cpus=num_cpus, **kwargs)
    else:
        ray.init(address=target, **kwargs)
    return True


__all__ = [
    "AUTO",
    "ENV_NAME",
    "FleetError",
    "LOCAL",
    "LaunchedFleet",
    "LearnerUnreachableError",
    "LinkDroppedError",
    "RLlinkError",
    "RLlinkStats",
    "ServerFleet",
    "ServerHealth",
    "ServerInfo",
    "ShardError",
    "ShardStats",
    "ShardedRun",
    "SpaceMismatchError",
    "free_rllib_env_config",
    "init_ray",
    "register_rllib_env",
    "rllib_env_config",
    "rllib_env_creator",
    "run_rllink",
    "run_sharded",
    "runner_slot",
    "split",
    "summarize",
]
