"""What the vector bridges share: opening their batch, and a world's seeded reset.

``GymnasiumVectorEnv`` and SB3's ``BatchedVecEnv`` both take either a
``BatchedEnvironment`` the caller owns or server addresses to connect to
(``open_batch``), and both reset a world with a ResetRequest that carries its
seed under ``seed_setting``, falling back to an unseeded reset, with a
warning, when the server refuses that setting (``reset_world``). When a world
ends, both take the FIRST step that starts its next sequence on the same call
(``receive_firsts``): the batch's loop sent it as the LAST step landed.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ... import errors
from ..._adaptor.stacked import BatchedTimeStep
from ..._base import checks as _checks
from ...batched import BatchedEnvironment

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


def open_batch(
    owner: str,
    batch: BatchedEnvironment | None,
    addresses: Sequence[str] | str | None,
    num_envs: int | None,
    requested_observations: Sequence[str] | None,
    connect: Mapping[str, Any],
) -> tuple[BatchedEnvironment, bool]:
    """The bridge's batch: ``batch`` checked, or one connected to ``addresses``.

    Args:
      owner: the bridge's class name, for the messages.
      batch: a batch the caller owns, or None.
      addresses: server addresses to connect to instead, or None.
      num_envs: how many worlds (checked against ``batch``).
      requested_observations: with ``addresses`` only.
      connect: more arguments for ``BatchedEnvironment.connect``.

    Returns:
      ``(batch, owned)``: owned when this call connected it (the bridge closes it).

    Raises:
      ArgumentTypeError: ``batch`` is not a BatchedEnvironment (the message shows ``addresses=``).
      ArgumentValueError: neither or both of ``batch`` and ``addresses``, ``num_envs``
        other than the batch's size, or ``requested_observations`` with ``batch``.
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
        return batch, False
    assert addresses is not None
    opened = BatchedEnvironment.connect(
        [addresses] if isinstance(addresses, str) else list(addresses),
        num_envs,
        requested_observations=requested_observations,
        **connect,
    )
    return opened, True


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
