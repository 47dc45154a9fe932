"""An RLlib env creator: each EnvRunner gets a ``GymnasiumVectorEnv`` over worlds of its own.

For RLlib's new API stack with ``gym_env_vectorize_mode=VECTOR_ENTRY_POINT``::

    config = (
        PPOConfig()
        .environment(env=register_rllib_env(), env_config=rllib_env_config(fleet, seed=0))
        .env_runners(num_envs_per_env_runner=4,
                     gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT)
    )

RLlib calls the creator once per EnvRunner with its ``env_config`` and
``num_envs``; the creator connects a ``GymnasiumVectorEnv`` of ``num_envs``
new worlds. Worlds differ between runners and between vector indices: runner
slot ``r`` creates its world ``j`` with setting ``seed = seed + r * num_envs + j``,
and starts its worlds at server ``r % len(addresses)``, so runners spread over
the servers.

The slot is the runner's ``worker_index`` when RLlib passes an ``EnvContext``.
Under ``VECTOR_ENTRY_POINT`` it does not: RLlib (checked on Ray 2.60) calls the
creator with ``env_context | {"num_envs": n}``, a plain dict without
``worker_index``. Then the slot comes from a counter actor that
``rllib_env_config`` starts in the driver (named, no CPU), so every runner
still gets a slot of its own; slots are handed out in the order runners ask.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from ._fleet import ServerFleet, fleet_addresses

ENV_NAME = "dm_env_rpc"
_SLOTS = "slots"
_WRAP = "wrap"
_NAMESPACE = "dm_env_rpc_client"
_LIVE_SLOTS: dict[str, Any] = {}  # slot counters this driver started, by name
_NO_ADDRESSES = (
    "The env_config has no 'addresses'; build it with rllib_env_config(fleet_or_addresses, ...)."
)
_NOT_VECTOR = (
    "RLlib called the env creator without num_envs, so it is not using the vector entry "
    "point and would treat the vector env as one env (an IndexError in the driver). Set "
    ".env_runners(gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT, "
    "num_envs_per_env_runner=N) in the algorithm config."
)
_BAD_NUM_ENVS = "num_envs must be a positive int (num_envs_per_env_runner), not {value!r}."
_NOT_FLAT = (
    "The observation space {space} is {ndim}-D; RLlib's default encoders take 1-D or 3-D "
    "Boxes and fail on it with an IndexError in the driver. Flatten it: add "
    "env_to_module_connector=lambda env, spaces=None, device=None: FlattenObservations() "
    "(ray.rllib.connectors.env_to_module) to .env_runners(...) and pass "
    "rllib_env_config(..., connector_flattens=True), or wrap= the env in "
    "gymnasium.wrappers.vector.FlattenObservation."
)
_FLATTENS = "connector_flattens"
_NO_SLOT = (
    "RLlib gave the env creator no worker_index and the env_config names no slot counter; "
    "build the env_config with rllib_env_config(...) in the driver."
)


class _Slots:
    """The actor body: hands out 0, 1, 2, ... (made a Ray actor by ``rllib_env_config``)."""

    def __init__(self) -> None:
        self._next = 0

    def take(self) -> int:
        slot = self._next
        self._next += 1
        return slot


def rllib_env_config(
    source: ServerFleet | Sequence[str],
    *,
    seed: int | None = 0,
    create_world_settings: Mapping[str, Any] | None = None,
    join_world_settings: Mapping[str, Any] | None = None,
    timeout: float = 30.0,
    insecure: bool = True,
    unwrap_single: bool = True,
    wrap: Callable[[Any], Any] | None = None,
    connector_flattens: bool = False,
    **vector_kwargs: Any,
) -> dict[str, Any]:
    """The ``env_config`` for ``rllib_env_creator``; call it in the driver.

    Args:
      source: a ``ServerFleet`` (its addresses now) or server addresses.
      seed: world ``j`` of runner slot ``r`` is created with ``seed + r * num_envs + j``;
        None leaves the worlds unseeded.
      create_world_settings: settings of every CreateWorldRequest.
      join_world_settings: settings of every JoinWorldRequest.
      timeout: seconds for each server answer, step and reset.
      insecure: allow plaintext to non-loopback addresses (a fleet's servers
        listen on their node's IP); TLS needs credentials, which do not travel
        in an env_config: pass ``connect_kwargs`` only for plaintext options.
      unwrap_single: a world with one action (observation) gets that tensor's
        space, not a ``Dict`` (default True: RLlib's default models take a Box
        or Discrete space, not a Dict).
      wrap: ``wrap(vector_env) -> vector_env``, applied in each runner, for
        gymnasium vector wrappers RLlib needs (Ray pickles it): Catch's int8
        paddle move, say, as a ``Discrete(3)`` action (RLlib takes no integer
        ``Box`` action).
      connector_flattens: the algorithm's ``env_to_module_connector`` flattens
        observations (``FlattenObservations``). Without it the creator refuses
        an observation Box that is neither 1-D nor 3-D, naming the fix, since
        RLlib's default encoders fail on it with an ``IndexError``.
      **vector_kwargs: more ``GymnasiumVectorEnv`` arguments (``seed_setting``,
        ``connect_kwargs``). A ``ServerFleet`` with a token adds its
        ``metadata`` to ``connect_kwargs`` unless they have their own.

    Returns:
      A plain, picklable dict; it names a slot counter actor this call starts
      (it lives as long as this driver).
    """
    name = f"rllib-slots-{uuid.uuid4().hex}"
    slots: Any = ray.remote(_Slots).options(name=name, namespace=_NAMESPACE, num_cpus=0).remote()
    ray.get(slots.__ray_ready__.remote(), timeout=60)
    _LIVE_SLOTS[name] = slots  # an actor without a handle left is ended by Ray
    if isinstance(source, ServerFleet) and source.metadata is not None:
        connect_kwargs = dict(vector_kwargs.get("connect_kwargs") or {})
        connect_kwargs.setdefault("metadata", source.metadata)  # the fleet's token
        vector_kwargs["connect_kwargs"] = connect_kwargs
    return {
        "addresses": fleet_addresses(source),
        "seed": seed,
        "create_world_settings": dict(create_world_settings or {}),
        "join_world_settings": dict(join_world_settings or {}),
        "timeout": timeout,
        "insecure": insecure,
        "unwrap_single": unwrap_single,
        _WRAP: wrap,
        _FLATTENS: connector_flattens,
        _SLOTS: name,
        **vector_kwargs,
    }


def free_rllib_env_config(env_config: Mapping[str, Any]) -> None:
    """Ends the slot counter actor of an ``rllib_env_config`` (after training). Idempotent."""
    name = env_config.get(_SLOTS)
    if name is None:
        return
    _LIVE_SLOTS.pop(name, None)
    with contextlib.suppress(ValueError):  # gone already
        ray.kill(ray.get_actor(name, namespace=_NAMESPACE), no_restart=True)


def runner_slot(env_config: Mapping[str, Any]) -> int:
    """The runner's ``worker_index`` if RLlib passed it, else a fresh slot from the counter.

    Raises:
      ValueError: neither is available.
    """
    index = getattr(env_config, "worker_index", None)
    if index is None:
        index = env_config.get("worker_index")
    if index is not None:
        return int(index)
    name = env_config.get(_SLOTS)
    if name is None:
        raise ValueError(_NO_SLOT)
    return int(ray.get(ray.get_actor(name, namespace=_NAMESPACE).take.remote(), timeout=60))


def rllib_env_creator(env_config: Mapping[str, Any]) -> Any:
    """RLlib's env creator: a ``GymnasiumVectorEnv`` over ``num_envs`` new worlds.

    Args:
      env_config: from ``rllib_env_config``, with ``num_envs`` added by RLlib
        (default 1); an ``EnvContext`` or a plain dict.

    Returns:
      The ``GymnasiumVectorEnv`` (wrapped by the config's ``wrap``); RLlib closes it.

    Raises:
      ValueError: the env_config was not made by ``rllib_env_config``, RLlib was
        not configured for the vector entry point (no ``num_envs``), or the
        observation is 2-D with no flattening (each message names the setting).
      WorldError: a world could not be created.
    """
    from ..gymnasium import GymnasiumVectorEnv

    config = dict(env_config)
    addresses = list(config.pop("addresses", None) or ())
    if not addresses:
        raise ValueError(_NO_ADDRESSES)
    if "num_envs" not in config:
        raise ValueError(_NOT_VECTOR)
    num_envs = config.pop("num_envs")
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(_BAD_NUM_ENVS.format(value=num_envs))
    flattens = bool(config.pop(_FLATTENS, False))
    slot = runner_slot(env_config)
    seed = config.pop("seed", None)
    config.pop(_SLOTS, None)
    wrap = config.pop(_WRAP, None)
    config.pop("worker_index", None)
    start = slot % len(addresses)
    connect_kwargs = dict(config.pop("connect_kwargs", None) or {})
    connect_kwargs.setdefault("insecure", config.pop("insecure", True))
    if seed is not None:
        connect_kwargs["seed"] = seed + slot * num_envs
    envs = GymnasiumVectorEnv(
        addresses=addresses[start:] + addresses[:start],
        num_envs=num_envs,
        connect_kwargs=connect_kwargs,
        **config,
    )
    wrapped = envs if wrap is None else wrap(envs)
    space = wrapped.single_observation_space
    shape: tuple[int, ...] = getattr(space, "shape", None) or ()
    if not flattens and type(space).__name__ == "Box" and len(shape) not in (1, 3):
        wrapped.close()
        raise ValueError(_NOT_FLAT.format(space=space, ndim=len(shape)))
    return wrapped


def register_rllib_env(name: str = ENV_NAME) -> str:
    """Registers ``rllib_env_creator`` with Ray Tune's registry under ``name``; returns it.

    RLlib takes an env as a registered name (or a class), not a function.
    """
    from ray.tune.registry import register_env

    register_env(name, rllib_env_creator)
    return name
