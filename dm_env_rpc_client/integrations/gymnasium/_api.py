"""Gymnasium bridge: a dm_env_rpc world as a ``gymnasium.Env``, many as a ``VectorEnv``.

Needs the ``gymnasium`` extra (``pip install 'dm_env_rpc_client[gymnasium]'``;
gymnasium 1.2.2 or newer)::

    from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv, GymnasiumVectorEnv

    env = GymnasiumEnv(address=address, create_world_settings={"rows": 5})
    observation, info = env.reset(seed=1)
    observation, reward, terminated, truncated, info = env.step(env.action_space.sample())
    env.close()

    envs = GymnasiumVectorEnv(addresses=[address], num_envs=8)   # over BatchedEnvironment
    observations, infos = envs.reset(seed=1)                    # world i gets seed 1 + i

- Spaces: ``spaces_from_specs`` (the table is in its docstring and in
  ``docs/gymnasium.md``); dotted names nest as ``Dict`` spaces, and with
  ``unwrap_single=True`` a world with one action (observation) has that
  tensor's space instead of a ``Dict``.
- ``step``: ``terminated`` when the server's state is TERMINATED, ``truncated``
  when it is INTERRUPTED; dm_env's discount is ``info["discount"]`` (1.0 after a
  reset and on a step that starts an episode: every info has the same keys, as
  Minari's ``DataCollector(record_infos=True)`` needs).
- ``metadata["render_modes"]`` of an instance is ``["rgb_array"]`` only when the
  world has an image observation (gymnasium's ``check_env`` renders each mode).
- ``reset(seed=s)``: the seed goes to the server as the reset setting
  ``seed_setting`` (default ``"seed"``; the embedded Catch takes it); a server
  that refuses it gets a warning, once, and unseeded resets.
- Errors are the SDK's own (``dm_env_rpc_client.errors``).
- Registration: ``gymnasium.make("DmEnvRpc-v0", address=..., ...)`` and
  ``gymnasium.make_vec("DmEnvRpc-v0", num_envs, vectorization_mode="vector_entry_point",
  addresses=[...], ...)``, after importing this module or with the id
  ``"dm_env_rpc_client.integrations.gymnasium:DmEnvRpc-v0"``. The id is
  registered ``nondeterministic=True``: a remote server promises nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, SupportsFloat

try:
    import gymnasium
    from gymnasium import spaces
except ImportError as exc:  # pragma: no cover - exercised in a venv without gymnasium
    raise ImportError(
        "dm_env_rpc_client.integrations.gymnasium needs gymnasium: "
        "pip install 'dm_env_rpc_client[gymnasium]'"
    ) from exc

import numpy as np

from ... import errors, specs
from ..._base import checks as _checks
from ..._proto import dm_env_rpc_pb2
from ...connection import Connection, connect
from ...environment import DmEnvAdaptor, create_and_join_world
from ._spaces import AnyText, SpaceAdapter, leaf, space_from_spec, spaces_from_specs
from ._vector import GymnasiumVectorEnv
from ._vector_batch import refused_setting

State = dm_env_rpc_pb2.EnvironmentStateType
ENV_ID = "DmEnvRpc-v0"
"""The registered gymnasium id (``gymnasium.make(ENV_ID, address=...)``)."""
DISCOUNT_KEY = "discount"
"""The ``info`` key of dm_env's discount after a step."""

_ONE_SOURCE = "Give GymnasiumEnv either a DmEnvAdaptor or address=, not {what}."
_NOT_AN_ADAPTOR = (
    "GymnasiumEnv's first argument, env, is a joined world (a DmEnvAdaptor, as "
    "dmr.create_and_join_world returns), not {kind}.{hint}"
)
_ADDRESS_HINT = (
    " To connect to a server, pass its address as address=: GymnasiumEnv(address={env!r})."
)
_NO_IMAGE = (
    "render_mode='rgb_array' needs an image observation (uint8 [height, width, 3]), and "
    "this world has none among {names}. Name one with render_observation=."
)
_UNKNOWN_RENDER = "render_observation {name!r} is not an observation; the observations are {names}."
_RENDER_MODE = "render_mode must be None or one of {modes}, not {mode!r}."
_SEED_REFUSED = (
    "The server refused the reset setting {name!r} ({error}); resets are not seeded on the "
    "server, only gymnasium's np_random is. Pass seed_setting= with the name the server "
    "takes, or seed_setting=None to silence this."
)


def _is_image(space: gymnasium.Space[Any]) -> bool:
    return (
        isinstance(space, spaces.Box)
        and space.dtype == np.uint8
        and len(space.shape) == 3
        and space.shape[-1] == 3
    )


class GymnasiumEnv(gymnasium.Env[Any, Any]):
    """A dm_env_rpc world as a ``gymnasium.Env``.

    Built from a ``DmEnvAdaptor`` (the caller keeps owning it and its
    connection), or from ``address=`` plus settings: then it connects, creates
    and joins a world, and ``close()`` leaves and destroys the world and closes
    the connection.

    Args:
      env: a joined world (with ``nested_tensors=True``, the default).
      address: a server address to connect to instead.
      create_world_settings: settings of the CreateWorldRequest (with ``address``).
      join_world_settings: settings of the JoinWorldRequest (with ``address``).
      requested_observations: the observations to show (with ``address``; with
        ``env``, the adaptor's own choice holds). Leave out what has no space.
      actions: the action names in ``action_space``; default all of them.
      timeout: seconds to wait for the server, and for each response.
      seed_setting: the reset setting that carries ``reset(seed=...)``; None never sends it.
      render_mode: None or ``"rgb_array"``.
      render_observation: the observation ``render()`` returns; default the
        first uint8 ``[height, width, 3]`` one.
      unwrap_single: a world with one action (observation) has that tensor's
        space, not a ``Dict`` (what Stable-Baselines3 needs).
      connect_kwargs: more arguments for ``dmr.connect`` (credentials, options, ...).

    Raises:
      ArgumentTypeError: ``env`` is not a DmEnvAdaptor (an address string names ``address=``).
      ArgumentValueError: neither or both of ``env`` and ``address``, a bad address or
        timeout (``dmr.connect`` checks them), or a bad render mode.
      ValueError: a bad render observation.
      SpecError: a shown tensor has no gymnasium space (the message says how to leave it out).
      DmEnvRpcClientError: connecting, creating or joining failed.
    """

    # gymnasium declares ``metadata`` as a class attribute dict: the modes any world may have.
    # Each instance has its own: ``rgb_array`` only for a world with an image to render.
    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 30}  # noqa: RUF012

    def __init__(
        self,
        env: DmEnvAdaptor | None = None,
        *,
        address: str | None = None,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | None = None,
        requested_observations: Iterable[str] | None = None,
        actions: Iterable[str] | None = None,
        timeout: float | None = 30.0,
        seed_setting: str | None = "seed",
        render_mode: str | None = None,
        render_observation: str | None = None,
        unwrap_single: bool = False,
        connect_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if env is not None and not isinstance(env, DmEnvAdaptor):
            hint = _ADDRESS_HINT.format(env=env) if isinstance(env, str) else ""
            raise errors.ArgumentTypeError(
                _NOT_AN_ADAPTOR.format(kind=_checks.kind(env), hint=hint)
            )
        if (env is None) == (address is None):
            raise errors.ArgumentValueError(_ONE_SOURCE.format(what="both" if env else "neither"))
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise errors.ArgumentValueError(
                _RENDER_MODE.format(modes=self.metadata["render_modes"], mode=render_mode)
            )
        self._timeout = timeout
        self._seed_setting = seed_setting
        self._closed = False
        self._connection: Connection | None = None  # set when this env owns the world
        if env is None:
            assert address is not None
            connection = connect(address, timeout=timeout, **dict(connect_kwargs or {}))
            try:
                env, _ = create_and_join_world(
                    connection,
                    create_world_settings,
                    join_world_settings,
                    timeout=timeout,
                    requested_observations=requested_observations,
                )
            except BaseException:
                connection.close()
                raise
            self._connection = connection
        self._env = env
        try:
            wire = env._wire_specs
            observation_names = list(specs.flatten(env.observation_spec()))
            action_names = (
                list(specs.flatten(env.action_spec())) if actions is None else list(actions)
            )
            self._observations = SpaceAdapter(
                wire.observations, observation_names, "observation", unwrap_single
            )
            self._actions = SpaceAdapter(wire.actions, action_names, "action", unwrap_single)
            self.render_mode = render_mode
            self._render_name = self._render_choice(render_mode, render_observation)
            renders = self._render_name is not None or self._image() is not None
            self.metadata = {**self.metadata, "render_modes": ["rgb_array"] if renders else []}
        except BaseException:
            self.close()
            raise
        self.observation_space = self._observations.space
        self.action_space = self._actions.space
        self._last_observation: dict[str, Any] | None = None

    def _render_choice(self, render_mode: str | None, name: str | None) -> str | None:
        names = self._observations.names
        if name is not None and name not in names:
            raise errors.ArgumentValueError(_UNKNOWN_RENDER.format(name=name, names=names))
        if render_mode is None or name is not None:
            return name
        image = self._image()
        if image is None:
            raise errors.ArgumentValueError(_NO_IMAGE.format(names=names))
        return image

    def _image(self) -> str | None:
        """The first uint8 ``[height, width, 3]`` observation, if any."""
        for candidate in self._observations.names:
            if _is_image(leaf(self._observations.dict_space, candidate)):
                return candidate
        return None

    @property
    def dm_env(self) -> DmEnvAdaptor:
        """The underlying ``DmEnvAdaptor``."""
        return self._env

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Starts a new sequence on the server.

        Args:
          seed: seeds gymnasium's ``np_random`` and goes to the server as the reset
            setting ``seed_setting``.
          options: ``{"settings": {...}}`` adds reset settings of your own.

        Returns:
          ``(observation, info)``; ``info`` is ``{"discount": 1.0}`` (the keys of a step's).

        Raises:
          DmEnvRpcClientError: the server failed or refused the reset.
        """
        super().reset(seed=seed)
        settings = dict((options or {}).get("settings", {}))
        if seed is not None and self._seed_setting is not None:
            settings[self._seed_setting] = seed
        try:
            timestep = self._env.reset(self._timeout, settings=settings)
        except errors.InvalidArgumentError as exc:
            if seed is None or not refused_setting(exc, self._seed_setting):
                raise
            warnings.warn(_SEED_REFUSED.format(name=self._seed_setting, error=exc), stacklevel=2)
            settings.pop(str(self._seed_setting))
            self._seed_setting = None
            timestep = self._env.reset(self._timeout, settings=settings)
        self._last_observation = timestep.observation
        return self._observations.from_sdk(timestep.observation), {DISCOUNT_KEY: 1.0}

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Takes one step.

        Returns:
          ``(observation, reward, terminated, truncated, info)``: terminated when
          the server's state is TERMINATED, truncated when it is INTERRUPTED, and
          ``info["discount"]`` is dm_env's discount. A step after the end of an
          episode starts the next one, as the protocol does (its action is
          ignored; reward 0, discount 1.0 as after a reset).

        An action may also come as TorchRL's ``GymWrapper`` sends it: the bare
        value of a one-action ``Dict``, and a scalar as shape ``[1]``.

        Raises:
          UnknownNameError, SpecValidationError: the action does not fit the specs.
          DmEnvRpcError: the server refused the step.
          RequestTimeoutError: no response within ``timeout``.
        """
        # The adaptor's own step: its request written as bytes, a large observation read
        # from the response's bytes and copied once (not parsed into a message first).
        timestep = self._env._step(self._actions.to_sdk(action, lenient=True), self._timeout)
        state = self._env._last_state  # this step's: the env is stepped in lockstep
        self._last_observation = timestep.observation
        observation = self._observations.from_sdk(timestep.observation)
        if timestep.first():
            return observation, 0.0, False, False, {DISCOUNT_KEY: 1.0}
        reward = timestep.reward
        reward = float(reward) if np.ndim(reward) == 0 else reward
        terminated = state == State.TERMINATED
        truncated = state == State.INTERRUPTED
        return observation, reward, terminated, truncated, {DISCOUNT_KEY: timestep.discount}

    def render(self) -> Any:
        """The ``render_observation`` of the latest step (``render_mode="rgb_array"``); else None."""
        if self._render_name is None or self._last_observation is None:
            return None
        return np.asarray(leaf(self._last_observation, self._render_name))

    def close(self) -> None:
        """Leaves and destroys an owned world and closes its connection; idempotent, bounded."""
        if self._closed:
            return
        self._closed = True
        if self._connection is not None:  # owned: leave and destroy the world, then disconnect
            try:
                self._env.close(timeout=self._timeout)
            finally:
                self._connection.close()

    def __repr__(self) -> str:
        return f"GymnasiumEnv({self._env!r})"


def make_vector(num_envs: int = 1, **kwargs: Any) -> GymnasiumVectorEnv:
    """The ``vector_entry_point`` of ``DmEnvRpc-v0``: ``GymnasiumVectorEnv(num_envs=..., **kwargs)``.

    ``kwargs`` take ``address=`` (one server) or ``addresses=`` (several).
    """
    address = kwargs.pop("address", None)
    if address is not None and "addresses" not in kwargs:
        kwargs["addresses"] = [address]
    return GymnasiumVectorEnv(num_envs=num_envs, **kwargs)


def register(env_id: str = ENV_ID) -> None:
    """Registers ``env_id`` with gymnasium (done on import for ``DmEnvRpc-v0``).

    ``gymnasium.make(env_id, address=..., **GymnasiumEnv kwargs)`` and
    ``gymnasium.make_vec(env_id, num_envs, vectorization_mode="vector_entry_point",
    addresses=[...], **GymnasiumVectorEnv kwargs)`` then build the environments.
    """
    if env_id in gymnasium.registry:
        return
    gymnasium.register(
        id=env_id,
        entry_point=f"{__name__}:GymnasiumEnv",
        vector_entry_point=f"{__name__}:make_vector",
        nondeterministic=True,
        disable_env_checker=False,
    )


register()

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
