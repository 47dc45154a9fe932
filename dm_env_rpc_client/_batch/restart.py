"""Restarting one failed world of a batch: the policy, the failure record, and the attempts.

``BatchedEnvironment.connect(on_world_failure="restart")`` restores a world
whose stream broke, whose step failed at the transport, or that passed its
deadline. ``reopen`` makes the attempts, on the batch's event loop:

- attempt 1 goes to the world's own address; each later attempt to the next
  address of the order ``_batch.balance.Balancer.order`` gives (the least loaded up
  servers first), so a world whose server stays down moves to another server;
  once its server answers again, the balancer brings it back at an episode
  boundary;
- each attempt opens a stream (waiting at most ``connect_timeout`` for the
  server), creates a world with the same settings (or joins the same named
  world) and joins it, each call bounded by ``call_timeout``;
- between attempts it sleeps an exponential backoff with jitter
  (``backoff * 2**k``, at most ``max_backoff``, times a random factor in
  [0.5, 1]); it gives up after ``attempts`` attempts or ``total`` seconds from
  the failure, whichever comes first.

Every failure ends up as one ``WorldFailure`` in ``BatchedEnvironment.failures``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .. import errors
from .._proto import dm_env_rpc_pb2
from .._transport.loop import LoopConnection
from ..environment import DmEnvAdaptor, pack_settings

RAISE = "raise"
RESTART = "restart"
POLICIES = (RAISE, RESTART)
_BAD_POLICY = "on_world_failure must be 'raise' or 'restart', not {value!r}."


class RestartPolicy(NamedTuple):
    """The bounds of restarting one world (``on_world_failure="restart"``).

    Attributes:
      attempts: at most this many attempts per failure.
      total: give up this many seconds after the failure was detected.
      backoff: the sleep after the first failed attempt, in seconds; it doubles
        after each further one, times a random factor in [0.5, 1].
      max_backoff: the longest sleep between two attempts.
      connect_timeout: seconds one attempt waits for a server to answer.
      call_timeout: seconds one attempt waits for each of its calls
        (CreateWorld, JoinWorld, the first step).
    """

    attempts: int = 5
    total: float = 60.0
    backoff: float = 0.2
    max_backoff: float = 5.0
    connect_timeout: float = 2.0
    call_timeout: float = 10.0


@dataclasses.dataclass(frozen=True)
class WorldFailure:
    """One failure of one world of a batch, as recorded in ``BatchedEnvironment.failures``.

    Attributes:
      index: the world's index in the batch.
      address: the server address the world was on when it failed.
      cause: the exception that showed the failure (a ``ConnectionClosedError``
        for a broken stream, a ``RequestTimeoutError`` for a passed deadline).
      time: when the failure was detected (``time.time()``).
      attempts: restart attempts made (0 under ``on_world_failure="raise"``).
      outcome: ``"raised"`` (reported to the caller), ``"restarted"`` or ``"removed"``
        (could not be restored within the bounds; the world left the batch).
      new_address: where the world was restored (None unless restarted).
      steps_lost: steps the world had in flight that no server answered; their
        actions were dropped (the FIRST step after a restart answers them).
      downtime: seconds from detection to restored or removed (0.0 when raised).
      last_error: the error of the last failed attempt, if any.
      relaunch: the ``Relaunch`` of the world's server, when it was launched
        (``dmr.launch``) and died then (updated in place as the relaunch goes on).
    """

    index: int
    address: str | None
    cause: BaseException
    time: float
    attempts: int
    outcome: str
    new_address: str | None
    steps_lost: int
    downtime: float
    last_error: BaseException | None = None
    relaunch: Any = None


def check_policy(value: str) -> str:
    """Returns ``value`` if it names a policy.

    Raises:
      ValueError: it does not.
    """
    if value not in POLICIES:
        raise errors.ArgumentValueError(_BAD_POLICY.format(value=value))
    return value


class Restored(NamedTuple):
    """What a successful ``reopen`` gives."""

    connection: LoopConnection
    env: DmEnvAdaptor
    first: dm_env_rpc_pb2.StepResponse | None  # the first step's response, if one was asked
    address: str
    attempts: int


class GaveUp(Exception):
    """``reopen`` ran out of attempts or time (not raised to users)."""

    def __init__(self, attempts: int, last_error: BaseException | None) -> None:
        super().__init__(attempts, last_error)
        self.attempts = attempts
        self.last_error = last_error


class WorldRecipe(NamedTuple):
    """How a world was made, so that it can be made again."""

    create_settings: Mapping[str, Any] | None
    join_settings: Mapping[str, Any] | None
    world_name: str | None  # join this existing world instead of creating one
    timeout: float | None  # the adaptor's timeout
    requested_observations: tuple[str, ...] | None = None  # the adaptor's


async def reopen(
    open_stream: Callable[[str, float], Awaitable[LoopConnection]],
    addresses: Sequence[str],
    recipe: WorldRecipe,
    policy: RestartPolicy,
    *,
    first_step: bool,
    rng: random.Random,
) -> Restored:
    """Makes the world again (see the module docs); on the batch's loop.

    Args:
      open_stream: ``open_stream(address, connect_timeout)`` opens a stream.
      addresses: the addresses to try, in order (``Balancer.order``).
      recipe: how the world was made.
      policy: the bounds.
      first_step: also take the new world's first step (empty action).
      rng: for the jitter.

    Raises:
      GaveUp: no attempt succeeded within the bounds.
    """
    deadline = time.monotonic() + policy.total
    last_error: BaseException | None = None
    attempt = 0
    while attempt < policy.attempts:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        address = addresses[attempt % len(addresses)]
        attempt += 1
        connection: LoopConnection | None = None
        try:
            connection = await open_stream(address, min(policy.connect_timeout, remaining))
            call_timeout = min(policy.call_timeout, max(0.01, deadline - time.monotonic()))
            env, first = await _make_world(connection, recipe, call_timeout, first_step)
            return Restored(connection, env, first, address, attempt)
        except (errors.DmEnvRpcClientError, OSError) as exc:
            last_error = exc
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.async_connection.aclose()
        await back_off(policy, attempt, deadline, rng)
    raise GaveUp(attempt, last_error)


async def back_off(
    policy: RestartPolicy, attempt: int, deadline: float, rng: random.Random
) -> None:
    """Sleeps the backoff after failed attempt number ``attempt`` (none after the last one),
    at most until ``deadline`` (``time.monotonic()``); see the module docs."""
    if attempt < policy.attempts:
        delay = min(policy.max_backoff, policy.backoff * 2 ** (attempt - 1))
        delay *= rng.uniform(0.5, 1.0)
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))


async def _make_world(
    connection: LoopConnection, recipe: WorldRecipe, timeout: float, first_step: bool
) -> tuple[DmEnvAdaptor, dm_env_rpc_pb2.StepResponse | None]:
    """Creates (or takes the named world) and joins it, and takes the first step if asked; if
    any of it fails, leaves and destroys (a named world: only leaves) what it made, then raises
    the failure (never an error of that cleanup)."""
    stream = connection.async_connection
    world_name = recipe.world_name
    destroy = world_name is None
    if world_name is None:
        request = dm_env_rpc_pb2.CreateWorldRequest(settings=pack_settings(recipe.create_settings))
        world_name = (await stream.send(request, timeout)).world_name
    try:
        join = dm_env_rpc_pb2.JoinWorldRequest(
            world_name=world_name, settings=pack_settings(recipe.join_settings)
        )
        response = await stream.send(join, timeout)
        env = DmEnvAdaptor(
            connection,
            response.specs,
            world_name=world_name,
            destroy_on_close=destroy,
            timeout=recipe.timeout,
            requested_observations=recipe.requested_observations,
        )
        first = None
        if first_step:
            first = await stream.send(env.step_request(None), timeout)
    except BaseException:
        with contextlib.suppress(Exception):  # a no-op refusal unless the join went through
            await stream.send(dm_env_rpc_pb2.LeaveWorldRequest(), timeout)
        if destroy:
            with contextlib.suppress(Exception):
                await stream.send(
                    dm_env_rpc_pb2.DestroyWorldRequest(world_name=world_name), timeout
                )
        raise
    return env, first
