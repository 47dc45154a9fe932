"""``GymnasiumVectorEnv``: a ``BatchedEnvironment`` as a ``gymnasium.vector.VectorEnv``.

Every ``step`` sends all the worlds' actions in one pipelined batch and waits
for their answers (``step_async`` / ``step_wait`` split the two, so inference
can overlap the servers' work). Autoreset is gymnasium's NEXT_STEP by default,
which is what the protocol does already: the step after a world's LAST step is
the FIRST step of its next sequence, and that step's action is ignored. So a
world that ended is carried into its next episode by the next ``step``, with no
extra round trip, and that step reports reward 0 and neither terminated nor
truncated. ``autoreset_mode=AutoresetMode.SAME_STEP`` or ``DISABLED`` give
gymnasium's other two modes (``gymnasium._autoreset``), and
``reset(options={"reset_mask": mask})`` resets only the masked worlds.

Each world's ``terminated`` is its server state TERMINATED, ``truncated`` its
state INTERRUPTED. ``infos`` follow gymnasium's vector format: ``discount``
(1.0 on a FIRST step and after a reset, as ``GymnasiumEnv`` reports it; masked
by ``_discount``, False only for a world without a step) and ``env_id`` (the
world's index in the batch) with its ``_env_id`` mask.

No step a world answered is lost (``gymnasium._uneven``):

- when the batch restarted a failed world (``on_world_failure="restart"`` in
  ``connect_kwargs``), that world's step is ``truncated`` (its episode was cut
  short), with ``restarted`` (mask ``_restarted``) True and its
  ``WorldFailure`` in ``failure`` (mask ``_failure``); its observation is the
  new episode's first, and the next vector step is its autoreset step, as
  after any truncation (that step's action is not sent). In SAME_STEP that
  first observation is also the row's observation (and ``final_obs``: the cut
  episode has no last one), and the next step is a real step; in DISABLED the
  world is reset by ``reset_mask`` like any world that ended;
- when a world has no step for a vector step (it failed under the default
  ``on_world_failure="raise"``, was removed, missed the timeout, or the server
  refused its step), ``step_wait`` raises that ``WorldError``, and the next
  ``step_wait()`` returns the vector step of the other worlds, with a stand-in
  row for that world, marked by its ``WorldError`` in ``error`` (mask
  ``_error``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium import error as gym_error
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from ... import errors
from ..._adaptor.stacked import BatchedTimeStep, batch_of, split_actions
from ..._proto import dm_env_rpc_pb2
from ...batched import BatchedEnvironment
from . import _autoreset as autoreset
from ._spaces import AnyText, leaf
from ._uneven import Uneven
from ._vector_batch import connect_arguments, open_vector, receive_firsts, reset_world

State = dm_env_rpc_pb2.EnvironmentStateType
_FIRST = 0  # dm_env.StepType.FIRST
_RESET_INFO = "discount"  # GymnasiumEnv's reset info: {"discount": 1.0}, the keys of a step's

_SEEDS = "reset(seed=) takes an int or one seed per world ({count}), not {seed!r}."
_BAD_ACTION = (
    "Action {name!r} does not fit the batched action space {space} (one row per world, "
    "{count} worlds): got {value}. Pass values of that dtype (cast with .astype), shape and "
    "bounds; envs.action_space.sample() shows one."
)
_AGAIN = "step_async was called again before step_wait; call step_wait first."
_AFTER_ERROR = (
    "step_wait raised WorldError for world {index}; call step_wait() again to take the other "
    "worlds' steps of that vector step (infos['error'] marks the worlds without one), or reset()."
)
_TAKE_THE_REST = (
    "{error}. The other worlds' steps of this vector step are kept: step_wait() returns them "
    "(infos['error'] marks the worlds without one)."
)
VectorStep = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


class GymnasiumVectorEnv(VectorEnv[Any, Any, Any]):
    """Many dm_env_rpc worlds as one gymnasium ``VectorEnv``. See the module docs.

    Args:
      batch: the worlds (the caller keeps owning it), all with the same specs.
      addresses: server addresses to connect to instead (worlds round-robin over them).
      num_envs: how many worlds (with ``addresses``); default one per address.
      create_world_settings: settings of every CreateWorldRequest.
      join_world_settings: settings of every JoinWorldRequest.
      requested_observations: the observations to show (with ``addresses``; a
        batch you pass shows what its worlds were joined with): leave out those
        with no gymnasium space.
      timeout: seconds to wait for the servers, and for each step and reset.
      seed_setting: the reset setting that carries ``reset(seed=...)``; None never sends it.
      unwrap_single: a world with one action (observation) has that tensor's
        space, not a ``Dict``.
      connect_kwargs: more arguments for ``BatchedEnvironment.connect``
        (credentials, ``on_world_failure``, ``restart``, ...).
      autoreset_mode: gymnasium's ``AutoresetMode`` (or its value, ``"SameStep"``):
        NEXT_STEP (the protocol's own), SAME_STEP or DISABLED; also in
        ``metadata["autoreset_mode"]`` and the ``autoreset_mode`` attribute.

    Raises:
      ArgumentTypeError: ``batch`` is not a BatchedEnvironment (addresses name ``addresses=``).
      ArgumentValueError: neither or both of ``batch`` and ``addresses``, a bad address,
        ``num_envs`` or timeout (``BatchedEnvironment.connect`` checks them),
        ``requested_observations`` with ``batch``, or an unknown autoreset mode.
      UnknownNameError: a requested observation the worlds do not have.
      SpecError: a tensor has no gymnasium space (the message says how to leave it out).
      WorldError: a world could not be created or joined.
    """

    # gymnasium declares ``metadata`` as a class attribute dict.
    metadata: dict[str, Any] = {  # noqa: RUF012
        "autoreset_mode": AutoresetMode.NEXT_STEP,
        "render_modes": [],
    }
    _owned = False  # until __init__ has a batch: gymnasium's __del__ may close a half-made env

    def __init__(
        self,
        batch: BatchedEnvironment | None = None,
        *,
        addresses: Sequence[str] | str | None = None,
        num_envs: int | None = None,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | None = None,
        requested_observations: Sequence[str] | None = None,
        timeout: float | None = 30.0,
        seed_setting: str | None = "seed",
        unwrap_single: bool = False,
        connect_kwargs: Mapping[str, Any] | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
    ) -> None:
        self.autoreset_mode = autoreset.autoreset_mode(autoreset_mode)
        self.metadata = {**type(self).metadata, "autoreset_mode": self.autoreset_mode}
        connect = connect_arguments(
            create_world_settings, join_world_settings, timeout, connect_kwargs
        )
        opened = open_vector(
            "GymnasiumVectorEnv",
            batch,
            addresses,
            num_envs,
            requested_observations,
            connect,
            unwrap_single=unwrap_single,
            # SAME_STEP: the batch sends a world whose step lands LAST its autoreset step at
            # once, from its loop (``_batch.core``); a batch the caller passed gets its setting
            # back on close.
            autoreset=self.autoreset_mode == AutoresetMode.SAME_STEP,
        )
        batch = self._batch = opened.batch
        self._owned, self._autoreset_before = opened.owned, opened.autoreset_before
        self._observations, self._actions = opened.observations, opened.actions
        self._timeout = timeout
        self._seed_setting = seed_setting
        self._waiting = False
        self._partial: VectorStep | None = None  # the rest of a vector step that raised
        self._partial_index = -1  # the world it raised for
        self.num_envs = len(batch)
        self._ids = list(range(self.num_envs))
        self.single_observation_space = self._observations.space
        self.single_action_space = self._actions.space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        # The batched space of each action, by dotted name, for checks before sending.
        self._action_checks = [
            (name, batch_space(leaf(self._actions.dict_space, name), self.num_envs))
            for name in self._actions.names
        ]
        self._infos_env_id = np.arange(self.num_envs, dtype=np.int64)
        self._uneven = Uneven(batch, self.num_envs)
        self._ended = np.zeros(self.num_envs, bool)  # DISABLED: ended, not reset since
        self._at_last = np.zeros(self.num_envs, bool)  # the world's latest step was LAST
        self._latest: Any = None  # the observations last returned (for reset_mask)
        self._sent: Any = None  # the SDK actions last sent (SAME_STEP's autoreset steps)

    @property
    def batch(self) -> BatchedEnvironment:
        """The underlying ``BatchedEnvironment``."""
        return self._batch

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Starts a new sequence in every world.

        A step sent by ``step_async`` and not yet waited for, or the rest of a
        vector step whose ``step_wait`` raised, is received and dropped first.

        Args:
          seed: world ``i`` gets ``seed + i`` (as gymnasium's vector envs do), or
            one seed (or None) per world; each goes to its server as the reset
            setting ``seed_setting``.
          options: ``{"settings": {...}}`` adds reset settings for every world;
            ``{"reset_mask": mask}`` (a bool array, one per world) resets only
            the worlds where it is True (gymnasium 1.1 and newer): the others
            keep their episode and their last observation.

        Returns:
          ``(observations, infos)``, batched; ``infos`` holds ``discount`` (1.0)
          and ``env_id``, masked by the worlds reset.

        Raises:
          ValueError: a seed list of the wrong length, or a bad ``reset_mask``.
          WorldError: a world failed or refused the reset.
        """
        super().reset(seed=seed if isinstance(seed, int) else None)
        if isinstance(seed, int):
            seeds: list[int | None] = [seed + index for index in self._ids]
        elif seed is None:
            seeds = [None] * self.num_envs
        elif len(seed) == self.num_envs:
            seeds = list(seed)
        else:
            raise ValueError(_SEEDS.format(count=self.num_envs, seed=seed))
        mask = (options or {}).get("reset_mask")
        if mask is not None:
            mask = autoreset.reset_mask(mask, self.num_envs)
        targets = self._ids if mask is None else np.flatnonzero(mask).tolist()
        if self._waiting or self._batch.pending():
            self._drop_in_flight(self._timeout)
        self._waiting, self._partial = False, None
        if mask is None:
            self._uneven.clear()
        for index in targets:
            self._uneven.held.pop(index, None)
            self._uneven.cut.discard(index)
        extra = dict((options or {}).get("settings", {}))
        # A world whose last step was LAST starts its next sequence with its autoreset step
        # (all of them in one pipelined batch); the others, or seeded, take a ResetRequest.
        stepped = [i for i in targets if self._at_last[i] and seeds[i] is None and not extra]
        got, failed = self._autoreset_steps(stepped) if stepped else (None, {})
        if failed:
            raise failed[min(failed)]
        firsts = {} if got is None else {i: got.at(p) for p, i in enumerate(got.env_ids.tolist())}
        for index in targets:
            if index not in firsts:
                firsts[index] = self._reset_world(index, seeds[index], extra)
        self._ended[targets] = self._at_last[targets] = False
        timesteps = [firsts[index] for index in targets]
        observations = self._from_batch(batch_of(timesteps, targets).observation)
        reset = self._all() if mask is None else mask.copy()
        if mask is not None:
            rows = autoreset.rows(self.observation_space, self._latest_or_empty())
            for index, row in zip(
                targets, autoreset.rows(self.observation_space, observations), strict=True
            ):
                rows[index] = row
            observations = autoreset.stacked(self.single_observation_space, rows)
        self._latest = observations
        infos = {
            _RESET_INFO: np.where(reset, 1.0, 0.0),
            f"_{_RESET_INFO}": reset,
            "env_id": self._infos_env_id.copy(),
            "_env_id": reset.copy(),
        }
        return observations, infos

    def _reset_world(self, index: int, seed: int | None, extra: dict[str, Any]) -> Any:
        """A ResetRequest to world ``index`` with ``extra`` settings and its seed."""
        also = ", only gymnasium's np_random is"
        first, self._seed_setting = reset_world(
            self._batch, index, self._timeout, extra, seed, self._seed_setting, also
        )
        return first

    def _autoreset_steps(
        self, ids: list[int]
    ) -> tuple[BatchedTimeStep | None, dict[int, errors.WorldError]]:
        """The FIRST steps that start the next sequences of worlds at a LAST step, as a batch.

        A world whose next step is in flight already (in SAME_STEP the batch's
        loop sent it as the LAST step landed) is not sent another; the others
        are sent it now, in one pipelined batch, with the action each was last
        sent (the server ignores it). A world that fails on the way is left out,
        with its ``WorldError`` in the dict.
        """
        unsent = [i for i in ids if not self._batch.in_flight(i)]
        if unsent:
            rows = split_actions(self._sent, self.num_envs, self._actions.names)
            self._batch.send([rows[i] for i in unsent], unsent)
        return receive_firsts(self._batch, ids, self._timeout)

    def _latest_or_empty(self) -> Any:
        if self._latest is None:
            return autoreset.empty(self.single_observation_space, self.num_envs)
        return self._latest

    def _all(self) -> np.ndarray:
        return np.ones(self.num_envs, dtype=bool)

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Steps every world: ``step_async(actions)`` then ``step_wait()``."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Sends every world its row of ``actions`` (one pipelined batch); returns at once.

        The whole batch is checked against ``action_space`` first, so a bad
        action sends nothing. A world on its autoreset step after a restart is
        sent nothing (its answer is known), as is a world whose answer to an
        earlier step is still on its way (it answers this one).

        Raises:
          gymnasium.error.AlreadyPendingCallError: the previous step was not
            waited for, or ``step_wait`` raised and holds the other worlds' steps.
          SpecValidationError: an action does not fit ``action_space`` (named).
          WorldError: a world's connection is closed.
        """
        if self._waiting:
            raise gym_error.AlreadyPendingCallError(
                _AGAIN if self._partial is None else _AFTER_ERROR.format(index=self._partial_index),
                "step",
            )
        if self.autoreset_mode == AutoresetMode.DISABLED:
            autoreset.check_not_ended(self._ended)
        sdk_actions = self._actions.to_sdk(actions)
        for name, space in self._action_checks:
            try:
                value = leaf(sdk_actions, name)
            except (KeyError, TypeError, IndexError):
                raise errors.SpecValidationError(
                    _BAD_ACTION.format(name=name, space=space, count=self.num_envs, value="nothing")
                ) from None
            if isinstance(space, gymnasium.spaces.Tuple) and isinstance(value, (list, np.ndarray)):
                value = tuple(value)
            if not space.contains(value):
                shown = (
                    f"{value.dtype} {value.shape} {value!r}"
                    if isinstance(value, np.ndarray)
                    else repr(value)
                )
                raise errors.SpecValidationError(
                    _BAD_ACTION.format(name=name, space=space, count=self.num_envs, value=shown)
                )
        self._sent = sdk_actions
        if not self._uneven.held and not self._batch.pending():
            self._batch.send(sdk_actions, self._ids)
        else:
            ids = self._uneven.to_send()
            if ids:
                rows = split_actions(sdk_actions, self.num_envs, self._actions.names)
                self._batch.send([rows[index] for index in ids], ids)
        self._waiting = True

    def step_wait(self, timeout: float | None = None) -> VectorStep:
        """Waits for the steps ``step_async`` sent.

        Args:
          timeout: seconds to wait for every world (default: the env's ``timeout``).

        Returns:
          ``(observations, rewards, terminations, truncations, infos)``, batched.

        Raises:
          gymnasium.error.NoAsyncCallError: no step was sent.
          WorldError: a world failed, refused the step, did not answer within
            ``timeout`` (``WorldTimeoutError``), or was removed from the batch.
            The other worlds' steps of this vector step are kept: the next
            ``step_wait()`` returns them (see the module docs).
        """
        if not self._waiting:
            raise gym_error.NoAsyncCallError(
                "step_wait was called without step_async; call step_async first.", "step"
            )
        if self._partial is not None:
            result, self._partial, self._waiting = self._partial, None, False
            return result
        self._waiting = False
        wait = self._timeout if timeout is None else timeout
        deadline = None if wait is None else time.monotonic() + wait
        got, error = None, None
        if not self._uneven.held:
            try:
                got = self._batch.recv(env_ids=self._ids, timeout=wait)
            except errors.WorldError as exc:
                error = exc
            else:
                flagged = got.truncated is not None and got.truncated.any()
                if len(got.env_ids) == self.num_envs and not flagged:
                    return self._finish(self._vector_step(got), None)
        return self._uneven_step(*self._uneven.collect(got, error, deadline), error)

    def _vector_step(self, batch: BatchedTimeStep) -> VectorStep:
        """The gymnasium tuple of one step of every world."""
        states = np.asarray(batch.state)  # BatchedEnvironment always fills it
        not_first = batch.step_type != _FIRST
        infos = {
            "discount": np.where(not_first, batch.discount, 1.0),
            "_discount": self._all(),
            "env_id": batch.env_ids,
            "_env_id": self._all(),
        }
        return (
            self._from_batch(batch.observation),
            np.where(not_first, batch.reward, 0.0),
            states == State.TERMINATED,
            states == State.INTERRUPTED,
            infos,
        )

    def _uneven_step(
        self, rows: Any, failed: dict[int, errors.WorldError], first: errors.WorldError | None
    ) -> VectorStep:
        """A vector step world by world (``gymnasium._uneven``); raises if a world has none."""
        out = self._uneven.assemble(rows, failed)
        batch = batch_of(out.timesteps, self._ids)._replace(state=out.states)
        observations, rewards, terminations, truncations, infos = self._vector_step(batch)
        truncations |= out.cut
        if out.restarted.any():
            infos.update(restarted=out.restarted, _restarted=self._all())
            infos.update(failure=out.failures, _failure=out.restarted.copy())
        missing = np.array([e is not None for e in out.errors])
        infos["_discount"] = ~missing
        result = (observations, rewards, terminations, truncations, infos)
        return self._finish(result, missing | out.cut | out.restarted, out.errors, first)

    def _finish(
        self,
        result: VectorStep,
        not_last: np.ndarray | None,
        failed: np.ndarray | None = None,
        first: errors.WorldError | None = None,
    ) -> VectorStep:
        """The vector step in the env's autoreset mode.

        ``not_last``: the worlds truncated without a LAST step of their own (no
        step, restarted, being restarted). ``failed``: each world's
        ``WorldError`` (None where it has a step); with one, or a SAME_STEP
        autoreset that failed, the step is kept for the next ``step_wait()``
        and ``first`` (else the first world's error) is raised.
        """
        observations, rewards, terminations, truncations, infos = result
        ended = terminations | truncations
        self._at_last = ended if not_last is None else ended & ~not_last
        if self.autoreset_mode == AutoresetMode.DISABLED:
            self._ended = ended.copy()
            for index in np.flatnonzero(ended).tolist():  # a restarted world: reset_mask resets it
                self._uneven.held.pop(index, None)
        elif self.autoreset_mode == AutoresetMode.SAME_STEP:
            restarted = [i for i in np.flatnonzero(ended).tolist() if i in self._uneven.held]
            ready = np.flatnonzero(self._at_last).tolist() + restarted
            if ready:
                observations, lost = self._same_step(observations, infos, sorted(ready))
                if lost:
                    failed = np.full(self.num_envs, None, object) if failed is None else failed
                    failed[list(lost)] = list(lost.values())
            self._at_last = np.zeros(self.num_envs, bool)
        self._latest = observations
        result = observations, rewards, terminations, truncations, infos
        if failed is None or not any(error is not None for error in failed):
            return result
        infos.update(error=failed, _error=np.array([error is not None for error in failed]))
        first = first if first is not None else next(e for e in failed if e is not None)
        self._partial, self._partial_index, self._waiting = result, first.index, True
        message = _TAKE_THE_REST.format(error=str(first).rstrip("."))
        raise type(first)(message, first.index, first.address) from first

    def _same_step(
        self, observations: Any, infos: dict[str, Any], ended: list[int]
    ) -> tuple[Any, dict[int, errors.WorldError]]:
        """SAME_STEP: the ended worlds' next FIRST steps replace their rows (``gymnasium._autoreset``).

        A world whose autoreset step failed keeps its LAST row; it is returned with its error.
        """
        held = {i: self._uneven.held.pop(i)[0] for i in ended if i in self._uneven.held}
        others = [i for i in ended if i not in held]
        lost: dict[int, errors.WorldError] = {}
        if held:
            new = self._from_batch(batch_of(list(held.values()), list(held)).observation)
            observations = autoreset.same_step_rows(self, observations, infos, list(held), new)
        if others:
            got, lost = self._autoreset_steps(others)
            if got is not None:
                new, ids = self._from_batch(got.observation), got.env_ids.tolist()
                observations = autoreset.same_step_rows(self, observations, infos, ids, new)
        return observations, lost

    def _drop_in_flight(self, timeout: float | None) -> None:
        """Receives and drops every step still in flight (before a reset)."""
        autoreset.drop_in_flight(self._batch, self._ids, timeout)

    def _from_batch(self, observation: dict[str, Any]) -> Any:
        """Stacked SDK observations as a value of ``observation_space``."""
        for name in self._observations.names:
            if isinstance(leaf(self._observations.dict_space, name), AnyText):
                *path, last = name.split(".")
                parent = observation
                for key in path:
                    parent = parent[key]
                parent[last] = tuple(str(text) for text in parent[last])
        single = self._observations.single
        return observation if single is None else leaf(observation, single)

    def close_extras(self, **kwargs: Any) -> None:
        """Closes the batch if this env made it (``VectorEnv.close`` calls this once)."""
        batch = getattr(self, "_batch", None)  # None: connecting failed in __init__
        if self._owned and batch is not None:
            batch.close()
        elif batch is not None:
            batch._autoreset = self._autoreset_before

    def __repr__(self) -> str:
        return f"GymnasiumVectorEnv({self._batch!r})"
