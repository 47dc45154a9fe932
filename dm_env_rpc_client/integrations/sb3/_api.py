"""Stable-Baselines3 bridge: many remote worlds as one SB3 ``VecEnv``, at the batch's speed.

Needs the ``sb3`` extra (``pip install torch==2.13.0`` first, then
``pip install 'dm_env_rpc_client[sb3]'``)::

    from stable_baselines3 import PPO
    from dm_env_rpc_client.integrations.sb3 import BatchedVecEnv

    envs = BatchedVecEnv(addresses=[address], num_envs=8)
    model = PPO("MlpPolicy", envs).learn(20_000)

``BatchedVecEnv`` drives a ``BatchedEnvironment``: ``step_async`` sends every
world its action in one pipelined batch (``BatchedEnvironment.send``) and
``step_wait`` collects the answers (``recv``), not a Python loop of single steps.

SB3's autoreset. When a world's step is LAST, ``step_wait`` returns the next
episode's first observation for it in the same call, with the LAST observation
in ``infos[i]["terminal_observation"]``, the LAST reward, ``dones[i]`` True and
``infos[i]["TimeLimit.truncated"]`` True when the server's state is INTERRUPTED
(a time limit) rather than TERMINATED. The reset is pipelined: the VecEnv
turns on its batch's autoreset, so the batch's loop thread,
the moment a world's answer lands LAST, sends that world the step that starts
its next sequence (the protocol's reset: the step after a LAST step is the
FIRST step of the next sequence, its action ignored), before ``step_wait``
even has the other worlds' answers. ``step_wait`` takes every world's answer in
one ``recv``, then the ended worlds' FIRST steps, already in or close behind
(see the autoreset section of ``docs/gymnasium.md``).

Failures. By default a world that fails (its server dies, its stream breaks,
it stalls past ``step_timeout``) is made again by the batch
(``on_world_failure="restart"``, see ``dm_env_rpc_client.batched``), and the
VecEnv reports that step as a truncation: ``dones[i]`` True,
``TimeLimit.truncated`` True, reward 0, the last observation the learner saw
as ``terminal_observation``, ``infos[i]["restarted"]`` True and the batch's
``WorldFailure`` in ``infos[i]["failure"]``. Any error ``step_wait`` raises
(``WorldError``: a world removed after its restarts failed, a step the server
refused, ``on_world_failure="raise"``) leaves the VecEnv to be ``reset()``
before it steps again.

Spaces follow the Gymnasium bridge's mapping (``integrations.gymnasium``), with
a lone action or observation unwrapped (SB3 takes one action space), and an
integer action ``Box`` with finite bounds shown as ``Discrete`` (scalar) or
``MultiDiscrete`` (1-D) counted from its lower bound, which is what SB3's
policies produce (Catch's paddle ``-1, 0, 1`` is ``Discrete(3)``); pass
``discrete_actions=False`` for the plain ``Box``.

``get_attr``, ``set_attr`` and ``env_method`` reach one ``RemoteWorld`` per
world (its ``DmEnvAdaptor`` as ``env``, its ``address``; attributes you set are
kept there); a name it lacks is looked up on the world's ``DmEnvAdaptor``.
``env_is_wrapped`` is False for every wrapper: no Gymnasium env is involved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

try:
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnv,
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
    )
except ImportError as exc:  # pragma: no cover - exercised in a venv without the extra
    raise ImportError(
        "dm_env_rpc_client.integrations.sb3 needs Stable-Baselines3 (and torch): "
        "pip install torch==2.13.0, then pip install 'dm_env_rpc_client[sb3]'"
    ) from exc

import numpy as np

from ... import errors, specs
from ..._proto import dm_env_rpc_pb2
from ...batched import BatchedEnvironment
from ...environment import DmEnvAdaptor
from ..gymnasium._discrete_actions import DISCRETE_LIMIT, ActionMap
from ..gymnasium._spaces import AnyText, leaf
from ..gymnasium._vector_batch import (
    VectorWorlds,
    connect_arguments,
    open_vector,
    receive_firsts,
    reset_world,
)

State = dm_env_rpc_pb2.EnvironmentStateType
_FIRST, _LAST = 0, 2  # dm_env.StepType
_ONE_ACTION = (
    "Stable-Baselines3 takes one action space, and these worlds have {count} actions ({names}). "
    "Serve a world with one action tensor, or use GymnasiumVectorEnv with a wrapper of your own."
)
_TEXT = (
    "The observation {name!r} is a string, which Stable-Baselines3 cannot take. Leave it out: "
    "pass requested_observations=[...] without it."
)
_NO_IMAGE = (
    "render_mode='rgb_array' needs an image observation (uint8 [height, width, 3]), and these "
    "worlds have none among {names}."
)
_RENDER_MODE = "render_mode must be None or 'rgb_array', not {mode!r}."
_PENDING = "step_async was called twice without step_wait; call step_wait first."
_NOT_SENT = "step_wait was called without step_async; call step_async first."
_BROKEN = (
    "An earlier step_wait raised ({error}); the worlds' steps are out of step with the VecEnv. "
    "Call reset() before stepping again."
)
_STEPPING = (
    "env_method({name!r}) would move world {index} behind the VecEnv's back; use the VecEnv's "
    "own step_async/step_wait and reset."
)
_STEPPING_NAMES = frozenset({"reset", "step", "step_async", "step_iter", "close", "_step"})
_GONE = "World {index} was removed from the batch ({reason}); a VecEnv keeps num_envs fixed."


class RemoteWorld:
    """One world as ``get_attr``/``set_attr``/``env_method`` see it.

    Attributes:
      index: the world's index in the batch.
      render_mode: the VecEnv's render mode (what SB3's ``VecEnv`` asks every env for).
    """

    def __init__(self, vec: BatchedVecEnv, index: int, render_mode: str | None) -> None:
        self._vec = vec
        self.index = index
        self.render_mode = render_mode

    @property
    def env(self) -> DmEnvAdaptor:
        """The world's ``DmEnvAdaptor`` (a new one after a restart)."""
        return self._vec.batch.envs[self.index]

    @property
    def address(self) -> str | None:
        """The server the world is on now."""
        return self._vec.batch.addresses[self.index]

    def render(self) -> np.ndarray | None:
        """The world's latest image observation (``render_mode="rgb_array"``); else None."""
        return self._vec._image(self.index)


class BatchedVecEnv(VecEnv):  # type: ignore[misc]
    """Many dm_env_rpc worlds as one Stable-Baselines3 ``VecEnv``. See the module docs.

    Args:
      batch: the worlds (the caller keeps owning it), all with the same specs.
      addresses: server addresses to connect to instead (worlds round-robin over them).
      num_envs: how many worlds (with ``addresses``); default one per address.
      create_world_settings: settings of every CreateWorldRequest.
      join_world_settings: settings of every JoinWorldRequest.
      requested_observations: the observations to show (with ``addresses``).
      timeout: seconds to wait for the servers, each reset and each ``step_wait``.
      on_world_failure: the batch's failure policy (with ``addresses``):
        ``"restart"`` (reported as a truncation) or ``"raise"``.
      seed_setting: the reset setting that carries ``seed()``'s seeds; None never sends it.
      discrete_actions: show a bounded integer action as ``Discrete``/``MultiDiscrete``.
      render_mode: None or ``"rgb_array"`` (the first uint8 ``[h, w, 3]`` observation).
      connect_kwargs: more arguments for ``BatchedEnvironment.connect``.

    Raises:
      ValueError: neither or both of ``batch`` and ``addresses``, a bad ``num_envs``
        or ``render_mode``.
      SpecError: more than one action, a string observation, or a tensor with no space.
      WorldError: a world could not be created or joined.
    """

    def __init__(
        self,
        batch: BatchedEnvironment | None = None,
        *,
        addresses: Sequence[str] | str | None = None,
        num_envs: int | None = None,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | None = None,
        requested_observations: Sequence[str] | None = None,
        timeout: float | None = 60.0,
        on_world_failure: str = "restart",
        seed_setting: str | None = "seed",
        discrete_actions: bool = True,
        render_mode: str | None = None,
        connect_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(_RENDER_MODE.format(mode=render_mode))
        connect = connect_arguments(
            create_world_settings,
            join_world_settings,
            timeout,
            connect_kwargs,
            on_world_failure=on_world_failure,
        )
        self._closed = True  # until there is a batch
        # SB3's autoreset: the batch's loop sends an ended world its next step at once.
        opened = open_vector(
            "BatchedVecEnv",
            batch,
            addresses,
            num_envs,
            requested_observations,
            connect,
            unwrap_single=True,
            autoreset=True,
        )
        self._batch, self._owned = opened.batch, opened.owned
        self._autoreset_before = opened.autoreset_before
        self._closed = False
        try:
            self._setup(opened, discrete_actions, render_mode)
        except BaseException:
            self.close()
            raise
        self._timeout = timeout
        self._seed_setting = seed_setting
        self._waiting = False
        self._broken: BaseException | None = None
        self._sent: Any = None
        self._worlds = [RemoteWorld(self, index, render_mode) for index in self._ids]
        super().__init__(len(self._ids), self._obs_adapter.space, self._action_map.space)

    def _setup(self, opened: VectorWorlds, discrete: bool, render_mode: str | None) -> None:
        self._obs_adapter, actions = opened.observations, opened.actions
        if actions.single is None:
            raise errors.SpecError(
                _ONE_ACTION.format(count=len(actions.names), names=", ".join(actions.names))
            )
        for name in self._obs_adapter.names:
            if isinstance(leaf(self._obs_adapter.dict_space, name), AnyText):
                raise errors.SpecError(_TEXT.format(name=name))
        self._ids = list(range(len(opened.batch)))
        self._action_name = actions.single
        count = len(self._ids)
        self._action_map = ActionMap(actions.space, count, discrete)
        self._buffers = {
            name: np.zeros((count, *space.shape), space.dtype)
            for name in self._obs_adapter.names
            for space in [leaf(self._obs_adapter.dict_space, name)]
        }
        self._render_name = None
        if render_mode is not None:
            images = [
                name
                for name, buffer in self._buffers.items()
                if buffer.dtype == np.uint8 and buffer.ndim == 4 and buffer.shape[-1] == 3
            ]
            if not images:
                raise ValueError(_NO_IMAGE.format(names=self._obs_adapter.names))
            self._render_name = images[0]

    @property
    def batch(self) -> BatchedEnvironment:
        """The underlying ``BatchedEnvironment``."""
        return self._batch

    # --- stepping --------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Starts a new sequence in every world, with the seeds of ``seed()`` and the options
        of ``set_options()`` (``{"settings": {...}}`` adds reset settings), once.

        Steps still in flight (a ``step_async`` not waited for, or a ``step_wait``
        that raised) are received and dropped first.

        Raises:
          WorldError: a world failed, was removed, or refused the reset.
        """
        self._drop_in_flight()
        self._waiting, self._broken = False, None
        for index in self._ids:
            settings = dict(self._options[index].get("settings", {}))
            timestep = self._reset_world(index, settings, self._seeds[index])
            self._write_row(index, timestep.observation)
            self.reset_infos[index] = {}
        self._reset_seeds()
        self._reset_options()
        return self._observation()

    def _reset_world(self, index: int, settings: dict[str, Any], seed: int | None) -> Any:
        if index not in self._batch.live_ids:
            reason = self._batch.failures[-1].cause if self._batch.failures else "failed"
            raise errors.WorldError(
                _GONE.format(index=index, reason=reason), index, self._batch.addresses[index]
            )
        first, self._seed_setting = reset_world(
            self._batch, index, self._timeout, settings, seed, self._seed_setting
        )
        return first

    def step_async(self, actions: np.ndarray) -> None:
        """Sends every world its row of ``actions`` in one pipelined batch; returns at once.

        Raises:
          SpecValidationError: the actions do not fit (nothing is sent then).
          DmEnvRpcClientError: a step is already pending, or an earlier ``step_wait``
            raised and ``reset()`` was not called since.
        """
        if self._broken is not None:
            raise errors.DmEnvRpcClientError(_BROKEN.format(error=self._broken))
        if self._waiting:
            raise errors.DmEnvRpcClientError(_PENDING)
        sdk = {self._action_name: self._action_map.to_sdk(actions)}
        self._batch.send(specs.unflatten(sdk), self._ids)
        self._sent, self._waiting = sdk, True

    def step_wait(self) -> VecEnvStepReturn:
        """Collects the steps ``step_async`` sent; an ended world is reset in the same call.

        Returns:
          ``(observations, rewards, dones, infos)`` (see the module docs for SB3's
          autoreset and truncation keys).

        Raises:
          WorldError: a world failed under ``on_world_failure="raise"``, was removed,
            or its step was refused; ``WorldTimeoutError`` when the worlds did not
            all answer within ``timeout``. ``reset()`` before stepping again.
        """
        if not self._waiting:
            raise errors.DmEnvRpcClientError(_NOT_SENT)
        self._waiting = False
        try:
            rewards, dones, infos = self._collect()
        except BaseException as exc:
            self._broken = exc
            raise
        return self._observation(), rewards, dones, infos

    def _collect(self) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
        count = len(self._ids)
        rewards = np.zeros(count, np.float32)
        dones = np.zeros(count, bool)
        infos: list[dict[str, Any]] = [{"TimeLimit.truncated": False} for _ in self._ids]
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        batch = self._batch
        # Every world's answer at once (a late world fails as the batch's, and raises).
        got = batch.recv(env_ids=self._ids, timeout=self._timeout)
        if len(got.env_ids) < count:  # a world removed after its restarts failed
            raise batch._refusal(next(i for i in self._ids if i not in batch.live_ids))
        step_types, states = got.step_type, got.state
        assert states is not None  # BatchedEnvironment always fills it
        observations = {name: leaf(got.observation, name) for name in self._buffers}
        ended = np.flatnonzero(step_types == _LAST).tolist()
        for index in ended:
            rewards[index], dones[index] = got.reward[index], True
            infos[index]["terminal_observation"] = self._row(observations, index)
            infos[index]["TimeLimit.truncated"] = bool(states[index] == State.INTERRUPTED)
        for index in np.flatnonzero(step_types == _FIRST).tolist():
            # A FIRST step not asked for: the world was restarted and its episode cut short.
            dones[index] = True
            info = infos[index]
            info["terminal_observation"] = self._row(self._buffers, index)
            info["TimeLimit.truncated"] = info["restarted"] = True
            info["failure"] = batch._latest_failure(index)
        mid = step_types == 1
        rewards[mid] = got.reward[mid]
        for name, buffer in self._buffers.items():
            buffer[:] = observations[name]
        if ended:  # their next episodes' first steps: the batch's loop sent them as LAST landed
            unsent = [i for i in ended if not batch.in_flight(i)]
            if unsent:
                rows = self._sent[self._action_name]
                batch.send(specs.unflatten({self._action_name: rows[unsent]}), unsent)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            firsts, failed = receive_firsts(batch, ended, remaining)
            if failed:
                raise failed[min(failed)]
            assert firsts is not None
            for name, buffer in self._buffers.items():
                buffer[firsts.env_ids] = leaf(firsts.observation, name)
        return rewards, dones, infos

    def _drop_in_flight(self) -> None:
        """Receives and drops every step still in flight (before a reset)."""
        for _ in range(2):
            pending = [index for index in self._batch.live_ids if self._batch.in_flight(index)]
            if not pending:
                return
            with contextlib.suppress(errors.DmEnvRpcClientError, ValueError):
                self._batch.recv(env_ids=pending, timeout=self._timeout)

    # --- observations ----------------------------------------------------------------------

    def _write_row(self, index: int, observation: Mapping[str, Any]) -> None:
        for name, buffer in self._buffers.items():
            buffer[index] = leaf(observation, name)

    def _row(self, source: Mapping[str, np.ndarray], position: int) -> Any:
        single = self._obs_adapter.single
        if single is not None:
            return np.array(source[single][position])
        return specs.unflatten({name: np.array(source[name][position]) for name in self._buffers})

    def _observation(self) -> VecEnvObs:
        single = self._obs_adapter.single
        if single is not None:
            return self._buffers[single].copy()
        return specs.unflatten({name: buffer.copy() for name, buffer in self._buffers.items()})

    def _image(self, index: int) -> np.ndarray | None:
        if self._render_name is None:
            return None
        return self._buffers[self._render_name][index].copy()

    # --- SB3's VecEnv API ----------------------------------------------------------------

    def get_images(self) -> Sequence[np.ndarray | None]:
        """Each world's latest image observation (``render_mode="rgb_array"``)."""
        return [self._image(index) for index in self._ids]

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """``attr_name`` of each world's ``RemoteWorld``, else of its ``DmEnvAdaptor``.

        Raises:
          AttributeError: neither has it (SB3's ``has_attr`` relies on this).
        """
        values = []
        for world in self._targets(indices):
            if hasattr(world, attr_name):
                values.append(getattr(world, attr_name))
            else:
                values.append(getattr(world.env, attr_name))
        return values

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Sets ``attr_name`` on each world's ``RemoteWorld`` (``get_attr`` reads it back)."""
        for world in self._targets(indices):
            setattr(world, attr_name, value)

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """Calls ``method_name`` of each world's ``RemoteWorld``, else of its ``DmEnvAdaptor``.

        Raises:
          ValueError: a method that would step, reset or close a world
            (``reset``, ``step``, ...): use the VecEnv's own.
          AttributeError: neither has it.
        """
        results = []
        for world in self._targets(indices):
            if method_name in _STEPPING_NAMES:
                raise ValueError(_STEPPING.format(name=method_name, index=world.index))
            owner: Any = world if hasattr(world, method_name) else world.env
            results.append(getattr(owner, method_name)(*method_args, **method_kwargs))
        return results

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        """False for each world: no Gymnasium env, so no Gymnasium wrapper, is involved."""
        return [False for _ in self._targets(indices)]

    def _targets(self, indices: VecEnvIndices) -> list[RemoteWorld]:
        return [self._worlds[index] for index in self._get_indices(indices)]

    def close(self) -> None:
        """Closes the batch if this VecEnv made it. Idempotent; bounded."""
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self._batch.close()
        else:
            self._batch._autoreset = self._autoreset_before

    def __repr__(self) -> str:
        return f"BatchedVecEnv({self._batch!r})"


__all__ = ["DISCRETE_LIMIT", "BatchedVecEnv", "RemoteWorld"]
