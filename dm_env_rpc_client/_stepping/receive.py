"""A run's receives: waited for on the caller's thread, or on the batch's own event loop.

``_stepping.loop`` steps a batch in passes: each sends what it can, then receives
the steps that came back (``recv_until_stopped``: a share of those in flight, at
most one ``SLICE``, then whatever finished; ``None`` once ``stop`` is set; a stall of
``timeout`` seconds raises ``RequestTimeoutError`` naming every world waited on).

From the caller's thread, every pass hands its steps to the batch's loop thread
and waits to be woken by it: two thread switches per pass, and on a machine whose
cores are busy each costs about what a pass of a few steps costs itself (issue 36:
``collect`` at 1 world x 2 agents spent as much CPU on the hand-offs as on its
steps). ``on_loop(batch, ...)`` says when a run may instead run its passes on the
batch's loop thread itself (``recv_on_loop``, ``take_on_loop``): the batch's steps
are then written from there at once, and a pass waits for its steps as a coroutine
(``BatchCore._cond`` is a ``LoopWakingCondition``: the notify that would wake a
waiting ``recv`` resolves the pass's future). The passes, their order and what
they send and receive are the same either way; only the thread differs. It
applies to random actions with nothing of the caller's run per pass (no policy,
recording, progress or observers: those stay on the caller's thread). The caller
waits for the run (``wait_on_loop``) in ``SLICE`` s slices, so a signal handler
runs meanwhile and can set ``stop``; an exception there (Ctrl-C's
``KeyboardInterrupt``) cancels the run between its steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine, Generator, Sequence
from typing import Any, TypeVar

from .. import errors
from .._batch.core import _NO_WAITER
from .._transport.loop import LoopThread
from ..batched import BatchedEnvironment, BatchedTimeStep

T = TypeVar("T")

SLICE = 0.25  # seconds between checks for a stop signal while waiting for steps
STALLED = (
    "No step finished within {timeout} s. Waiting on: {waiting}. The server may be stopped, "
    "overloaded or unreachable; pass a longer --timeout if it is only slow."
)
_LOOP_GONE = "The batch's event loop was closed while a run was stepping it; open a new batch."


def stalled(
    batch: BatchedEnvironment, timeout: float, first_world: int
) -> errors.RequestTimeoutError:
    """The error of a run that waited ``timeout`` s for a step: names every world in flight.

    Args:
      batch: the worlds.
      timeout: the seconds waited.
      first_world: the index of world 0 in the whole run.

    Returns:
      The error, to raise.
    """
    waiting = [
        f"world {first_world + world} at {batch.addresses[world]} "
        f"({batch.in_flight(world)} in flight)"
        for world in range(len(batch.envs))  # removed worlds too: len(batch) leaves them out
        if batch.in_flight(world)
    ]
    return errors.RequestTimeoutError(
        STALLED.format(timeout=timeout, waiting="; ".join(waiting) or "nothing")
    )


def recv_until_stopped(
    batch: BatchedEnvironment,
    timeout: float,
    stop: threading.Event,
    first_world: int = 0,
    *,
    wanted: int = 1,
) -> BatchedTimeStep | None:
    """The next finished steps, or None once ``stop`` is set.

    Args:
      batch: the worlds.
      timeout: seconds to wait for a step.
      stop: ends the wait when set.
      first_world: the index of world 0 in the whole run, for the stall's message.
      wanted: waits up to one ``SLICE`` for this many steps (at most those in flight), then
        takes whatever finished (at least one).

    Returns:
      The steps, or None once ``stop`` is set.

    Raises:
      RequestTimeoutError: no step finished within ``timeout``; names the worlds waited on.
      WorldError: a world failed (or was removed, with nothing else in flight).
    """
    tries = _tries(batch, timeout, stop, first_world, wanted)
    try:
        count, wait = next(tries)
        while True:
            count, wait = _answer(tries, batch.recv, count, wait)
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]


def _answer(tries: Generator[tuple[int, float], Any, Any], recv: Any, *args: Any) -> Any:
    """``recv(*args)``'s steps sent to ``tries``, or its ``RequestTimeoutError`` or
    ``ValueError`` thrown in; returns what ``tries`` yields next."""
    try:
        got = recv(*args)
    except (errors.RequestTimeoutError, ValueError) as error:
        return tries.throw(error)
    return tries.send(got)


def _tries(
    batch: BatchedEnvironment, timeout: float, stop: threading.Event, first_world: int, wanted: int
) -> Generator[tuple[int, float], Any, BatchedTimeStep | None]:
    """``recv_until_stopped``'s receives, each left to its driver: it yields ``(count, wait)``
    for ``batch.recv(count)`` waited at most ``wait`` s, is sent its steps (which it returns)
    or thrown its ``RequestTimeoutError`` or ``ValueError``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        count = min(wanted, batch.pending())
        if count > 1:
            wanted = 1  # once: after this wait, any step will do
            try:
                return (yield count, max(0.0, min(SLICE, left)))
            except (errors.RequestTimeoutError, ValueError):  # (ValueError: fewer in flight now)
                continue
        try:
            return (yield 1, max(0.0, min(SLICE, left)))
        except errors.RequestTimeoutError:
            if stop.is_set():
                return None
            if left <= SLICE:
                raise stalled(batch, timeout, first_world) from None


def on_loop(
    batch: BatchedEnvironment, policy: Any, recording: Any, progress: Any, observers: Sequence[Any]
) -> bool:
    """Whether a run of ``batch`` with these may run its passes on the batch's loop (see the
    module): random actions, nothing of the caller's per pass, and a loop that is not this
    thread's own.

    Args:
      batch: the worlds.
      policy: the run's policy (None: random actions).
      recording: the run's recording, or None.
      progress: the run's progress callback, or None.
      observers: the run's observers.

    Returns:
      Whether ``wait_on_loop`` may run it.
    """
    runner = batch._runner
    return (
        runner is not None
        and not runner.closed
        and policy is None
        and recording is None
        and progress is None
        and not observers
        and threading.current_thread() is not runner._thread
    )


def wait_on_loop(runner: LoopThread, coroutine: Coroutine[Any, Any, T]) -> T:
    """Runs ``coroutine`` (a run's passes) on ``runner``'s loop and waits for its end.

    Args:
      runner: the batch's loop thread.
      coroutine: the run.

    Returns:
      What the run returned.

    Raises:
      ConnectionClosedError: the loop was closed before the run ended.
      Exception: what the run raised; an exception raised while waiting (a signal's)
        cancels the run first.
    """
    future = asyncio.run_coroutine_threadsafe(coroutine, runner.loop)
    try:
        while not concurrent.futures.wait([future], SLICE).done:
            if runner.closed:
                raise errors.ConnectionClosedError(_LOOP_GONE)
    except BaseException:
        future.cancel()
        raise
    return future.result()


async def _landed(batch: BatchedEnvironment, count: int, wait: float) -> None:
    """Returns once ``count`` steps are filed for ``recv``, or after ``wait`` seconds."""
    if batch._ready >= count or wait <= 0:
        return
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    cond = batch._cond
    with batch._lock:
        if batch._ready >= count:
            return
        batch._want, cond.waiter = count, waiter  # type: ignore[attr-defined]
    timer = loop.call_later(wait, _expire, waiter)
    try:
        await waiter
    finally:
        timer.cancel()
        with batch._lock:
            batch._want, cond.waiter = _NO_WAITER, None  # type: ignore[attr-defined]


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def recv_on_loop(
    batch: BatchedEnvironment, timeout: float, stop: threading.Event, first: int, wanted: int
) -> BatchedTimeStep | None:
    """``recv_until_stopped``, waited for on the batch's loop (see there and the module)."""
    tries = _tries(batch, timeout, stop, first, wanted)
    try:
        count, wait = next(tries)
        while True:
            await _landed(batch, count, wait)
            count, wait = _answer(tries, batch.recv, count, 0.0)  # (it waited above)
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]


async def take_on_loop(
    batch: BatchedEnvironment, count: int, timeout: float, first_world: int
) -> BatchedTimeStep:
    """``count`` steps, at most ``timeout`` s waited for on the batch's loop.

    Raises:
      RequestTimeoutError: they did not finish in time (``stalled``'s, naming the worlds).
      WorldError: a world failed.
    """
    await _landed(batch, count, timeout)
    try:
        return batch.recv(count, timeout=0.0)
    except errors.RequestTimeoutError:
        raise stalled(batch, timeout, first_world) from None
