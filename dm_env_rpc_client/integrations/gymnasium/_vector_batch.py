"""What the vector bridges share: opening their batch, and a world's seeded reset.

``GymnasiumVectorEnv`` and SB3's ``BatchedVecEnv`` both take either a
``BatchedEnvironment`` the caller owns or server addresses to connect to, and
both show its worlds' observations and actions as gymnasium spaces
(``open_vector``: the batch, whether the bridge owns it, the two sides'
``SpaceAdapter``s, and the batch's autoreset switched to the bridge's), and both reset a world with a ResetRequest that carries its
seed under ``seed_setting``, falling back to an unseeded reset, with a
warning, when the server refuses that setting (``reset_world``). When a world
ends, both take the FIRST step that starts its next sequence on the same call
(``receive_firsts``): the batch's loop sent it as the LAST step landed.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ... import errors, specs
from ..._adaptor.stacked import BatchedTimeStep
from ..._base import checks as _checks
from ...batched import BatchedEnvironment
from ._spaces import SpaceAdapter

_ONE_SOURCE = "Give {owner} either a BatchedEnvironment or addresses=, not {what}."
_NOT_A_BATCH = (
    "{owner}'s first argument, batch, is a BatchedEnvironment, not {kind}. To connect to "
    "servers, pass their addresses as addresses=: {owner}(addresses={addresses!r}, "
    "num_envs=N) makes N worlds over them."
)
_NUM_ENVS = "num_envs={num_envs} but the BatchedEnvironment has {count} worlds."
_REQUESTED_WITH_BATCH = (
    "requested_observations= goes with addresses=; a BatchedEnvironment shows what its "
    "worlds were joined with: pass it to BatchedEnvironment.connect instead."
)
_SEED_REFUSED = (
    "World {index} refused the reset setting {name!r} ({error}); resets are not seeded on the "
    "server{also}. Pass seed_setting= with the name the server takes, or seed_setting=None to "
    "silence this."
)


def connect_arguments(
    create_world_settings: Mapping[str, Any] | None,
    join_world_settings: Mapping[str, Any] | None,
    timeout: float | None,
    connect_kwargs: Mapping[str, Any] | None,
    **defaults: Any,
) -> dict[str, Any]:
    """A bridge's arguments for ``BatchedEnvironment.connect``: its own, its ``defaults``
    (such as SB3's ``on_world_failure``), then the caller's ``connect_kwargs`` over both."""
    return {
        "create_world_settings": create_world_settings,
        "join_world_settings": join_world_settings,
        "timeout": timeout,
        **defaults,
        **dict(connect_kwargs or {}),
    }


@dataclasses.dataclass(frozen=True)
class VectorWorlds:
    """A vector bridge's opened batch (``open_vector``).

    Attributes:
      batch: the worlds.
      owned: this bridge connected them (it closes the batch; else it gives
        the batch its ``autoreset_before`` back).
      observations: the worlds' observations as a gymnasium space.
      actions: the worlds' actions as a gymnasium space.
      autoreset_before: the batch's autoreset setting before the bridge set its own.
    """

    batch: BatchedEnvironment
    owned: bool
    observations: SpaceAdapter
    actions: SpaceAdapter
    autoreset_before: bool


def open_vector(
    owner: str,
    batch: BatchedEnvironment | None,
    addresses: Sequence[str] | str | None,
    num_envs: int | None,
    requested_observations: Sequence[str] | None,
    connect: Mapping[str, Any],
    *,
    unwrap_single: bool,
    autoreset: bool,
) -> VectorWorlds:
    """A vector bridge's batch (``batch`` checked, or one connected to ``addresses``) with its
    spaces, and the batch's autoreset set.

    Args:
      owner: the bridge's class name, for the messages.
      batch: a batch the caller owns, or None.
      addresses: server addresses to connect to instead, or None.
      num_envs: how many worlds (checked against ``batch``).
      requested_observations: with ``addresses`` only.
      connect: the arguments for ``BatchedEnvironment.connect``.
      unwrap_single: a side of one tensor is that tensor's space, not a ``Dict``.
      autoreset: the batch's autoreset while the bridge has it (its loop sends a
        world whose step lands LAST its next step at once).

    Returns:
      The opened worlds. Nothing is left open, and the batch is unchanged, when
      this raises.

    Raises:
      ArgumentTypeError: ``batch`` is not a BatchedEnvironment (the message shows ``addresses=``).
      ArgumentValueError: neither or both of ``batch`` and ``addresses``, ``num_envs``
        other than the batch's size, ``requested_observations`` with ``batch``, or a bad
        ``connect`` argument.
      SpecError: a tensor has no gymnasium space (the message says how to leave it out).
      WorldError: a world could not be created or joined.
    """
    if batch is not None and not isinstance(batch, BatchedEnvironment):
        example = [batch] if isinstance(batch, str) else batch
        if not isinstance(batch, (str, list, tuple)):
            example = ["127.0.0.1:50051"]
        raise errors.ArgumentTypeError(
            _NOT_A_BATCH.format(owner=owner, kind=_checks.kind(batch), addresses=list(example))
        )
    if (batch is None) == (addresses is None):
        what = "both" if batch is not None else "neither"
        raise errors.ArgumentValueError(_ONE_SOURCE.format(owner=owner, what=what))
    if batch is not None:
        if num_envs is not None and num_envs != len(batch):
            raise errors.ArgumentValueError(_NUM_ENVS.format(num_envs=num_envs, count=len(batch)))
        if requested_observations is not None:
            raise errors.ArgumentValueError(_REQUESTED_WITH_BATCH)
        opened, owned = batch, False
    else:
        assert addresses is not None
        opened = BatchedEnvironment.connect(
            [addresses] if isinstance(addresses, str) else list(addresses),
            num_envs,
            requested_observations=requested_observations,
            **connect,
        )
        owned = True
    try:
        template = opened.envs[0]
        wire = template._wire_specs
        observations = SpaceAdapter(
            wire.observations,
            list(specs.flatten(template.observation_spec())),
            "observation",
            unwrap_single,
        )
        actions = SpaceAdapter(
            wire.actions, list(specs.flatten(template.action_spec())), "action", unwrap_single
        )
    except BaseException:
        if owned:
            opened.close()
        raise
    before, opened._autoreset = opened._autoreset, autoreset
    return VectorWorlds(opened, owned, observations, actions, before)


def refused_setting(exc: errors.InvalidArgumentError, name: str | None) -> bool:
    """Whether a server's INVALID_ARGUMENT names the reset setting ``name``."""
    return name is not None and repr(name) in str(exc)


def reset_world(
    batch: BatchedEnvironment,
    index: int,
    timeout: float | None,
    settings: Mapping[str, Any],
    seed: int | None,
    seed_setting: str | None,
    also: str = "",
) -> tuple[Any, str | None]:
    """A ResetRequest to world ``index`` with ``settings`` and its ``seed`` under ``seed_setting``.

    Returns:
      ``(FIRST TimeStep, seed_setting)``: the setting to use from now on, None
      once the server refused it (the reset is then sent again without it, with a
      warning; ``also`` adds to the warning what is still seeded).

    Raises:
      WorldError: the world failed or refused the reset (naming it).
    """
    env = batch.envs[index]
    seeded = dict(settings)
    if seed is not None and seed_setting is not None:
        seeded[seed_setting] = seed
    try:
        try:
            return env.reset(timeout, settings=seeded), seed_setting
        except errors.InvalidArgumentError as exc:
            if seed is None or not refused_setting(exc, seed_setting):
                raise
            message = _SEED_REFUSED.format(index=index, name=seed_setting, error=exc, also=also)
            warnings.warn(message, stacklevel=4)
            return env.reset(timeout, settings=dict(settings)), None
    except errors.DmEnvRpcClientError as exc:
        raise batch._wrap(index, exc) from exc


def receive_firsts(
    batch: BatchedEnvironment, ids: list[int], timeout: float | None
) -> tuple[BatchedTimeStep | None, dict[int, errors.WorldError]]:
    """The next answer of each world of ``ids`` (their autoreset FIRST steps), as one batch.

    Every world of ``ids`` has that step in flight. A world that fails, or was
    removed, on the way is left out of the batch (None if none is left) and
    named in the dict with its ``WorldError``; the others are still received,
    all within ``timeout`` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    firsts: BatchedTimeStep | None = None
    failed: dict[int, errors.WorldError] = {}
    waiting = list(ids)
    while waiting:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            got = batch.recv(env_ids=waiting, timeout=remaining)
        except errors.WorldError as exc:  # the other worlds' steps stay filed for the next recv
            if exc.index not in waiting:
                raise
            failed[exc.index] = exc
            waiting = [index for index in waiting if index != exc.index]
            continue
        firsts = got
        break
    received = set() if firsts is None else set(firsts.env_ids.tolist())
    for index in waiting:
        if index not in received:  # removed from the batch meanwhile
            failed[index] = batch._refusal(index)
    return firsts, failed
