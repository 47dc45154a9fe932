"""The loop side of ``BatchedEnvironment``: writing steps, filing answers, failures, restarts.

``BatchCore`` holds a batch's state and everything that runs on the batch's
event loop: ``_write_steps`` queues requests, ``_landed`` moves a world's
step-type state machine on and files the answer for ``recv`` (with ``_autoreset``
on, a world whose step lands LAST is sent its next, resetting step right there,
a round trip before anyone asks for it: ``GymnasiumVectorEnv``'s SAME_STEP and
SB3's ``BatchedVecEnv`` want the reset observation with the LAST one), ``_watch`` fails
a world that passes its ``step_timeout``, and ``_fail`` applies the failure
policy (``_restore`` makes a world again with ``_batch.restart.reopen``). Answers
are filed under a per-world *generation*: a failure bumps it, so an answer to a
step dropped by the failure is never filed. ``_batch.opening`` creates the worlds
for ``BatchedEnvironment.connect``. The public face is ``batched``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from .. import errors
from .._adaptor.stacked import StackedDecoder
from .._base import checks as _checks
from .._fastpath.raw_step import RawStep, read_answer
from .._fastpath.step_encoder import StepEncoder
from .._transport.loop import LoopThread, LoopWakingCondition
from .._transport.receivers import _Callback, _callback_failed
from .._transport.writers import WritePool
from ..aio import AsyncConnection
from ..connection import ConnectionLike
from ..environment import DmEnvAdaptor
from . import restart as _restart
from .outcomes import (
    _FAILED,
    _FAILED_BEFORE,
    _LIVE,
    _NOT_ENVS,
    _REMOVED,
    _REMOVED_STATE,
    _RESTARTING,
    _STALLED,
    _WORLD_FAILED,
    _ends,
    _Failure,
)
from .restart import RestartPolicy, WorldFailure

_NO_WAITER = 1 << 62
LATENCY_SAMPLES = 100_000  # latencies kept for percentiles; older ones are dropped


class _Landing(_Callback):
    """A step in flight on the batch's loop: its response goes to ``BatchCore._landed``.

    One object per step in flight (with 2 in flight per world of 4,096, what the
    GC scans at each full collection), in place of a bound method, a
    ``functools.partial``, the ``_Callback`` around them and the stream's
    ``Pending`` (the receiver is its own pending item).
    """

    __slots__ = ("_core", "_gen", "_index", "_sent")

    def __init__(self, core: BatchCore, index: int, gen: int, sent: float) -> None:
        self._core, self._index, self._gen, self._sent = core, index, gen, sent
        self.decode = None  # it reads the answer's bytes itself (answer)

    def _run(self, result: Any, error: BaseException | None) -> None:
        self._core._landed(self._index, self._gen, self._sent, result, error)

    def answer(self, data: bytes) -> None:
        # The reader's call with the answer's bytes: one call to where it is filed.
        try:
            self._core._landed_data(self._index, self._gen, self._sent, data)
        except Exception as exc:
            _callback_failed(exc)


class BatchCore:
    """The state of a batch and its loop side (see the module docs); ``BatchedEnvironment`` is the face."""

    def __init__(
        self,
        envs: Sequence[DmEnvAdaptor],
        addresses: Sequence[str | None] | None = None,
        *,
        connections: Sequence[ConnectionLike] = (),
    ) -> None:
        if not envs:
            raise ValueError("A BatchedEnvironment needs at least one world.")
        if isinstance(envs, str) or not all(isinstance(env, DmEnvAdaptor) for env in envs):
            raise errors.ArgumentTypeError(_NOT_ENVS.format(envs=_checks.kind(envs)))
        self.envs = list(envs)
        self.addresses = (
            list(addresses)
            if addresses is not None
            else [getattr(env.connection, "address", None) for env in self.envs]
        )
        self._connections = list(connections)
        self.world_seeds: list[int | None] = [None] * len(self.envs)
        self.failures: list[WorldFailure] = []
        self._runner: LoopThread | None = None
        self._streams: list[AsyncConnection] = []  # with a runner: each world's stream
        self._writers = WritePool()  # and the tasks that write them all (_transport.writers)
        # With a runner and the same specs everywhere: the batch-at-once decoder, and the
        # specs it was made for (a world whose specs change on reset is decoded alone).
        self._decoder: StackedDecoder | None = None
        # Its plan, whose learned layout lets the loop read an answer's state from its bytes
        # (_fastpath.raw_step); None: every answer is parsed there.
        self._plan: Any = None
        self._joined_specs: list[Any] = []
        # With a runner and the same specs everywhere: the step requests' encoder (send's
        # fast path, for the worlds whose specs are still those they joined with).
        self._encoder: StepEncoder | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closed = False
        self._raised_threshold = False  # connect raised the GC's threshold (_base.collector)
        # Finished steps, per world in request order: (outcome, latency). The outcome is the
        # exception of a failed step, a _Failure, else (TimeStep, state) (adaptors over their
        # own connections) or (step type, StepResponse[, steps it answers]) (on the batch's loop;
        # recv decodes these; a third item marks the truncating FIRST step after a restart).
        # _lock is _cond's: taken directly where nothing waits or is notified (its C-level
        # enter and exit, not Condition's Python-level ones: the loop takes it once a step).
        self._lock = threading.Lock()
        self._cond = LoopWakingCondition(self._lock)
        count = len(self.envs)
        self._done: list[collections.deque[tuple[Any, float]]] = [
            collections.deque() for _ in range(count)
        ]
        self._ready = 0  # finished and not yet received, over all worlds
        # The worlds whose queue was empty when a step was filed for it since the last recv
        # (each world with a filed step is here; some twice, some emptied since): recv takes
        # from these alone, so its cost follows the steps it takes, not the batch's size.
        self._filed: list[int] = []
        self._want = _NO_WAITER  # recv wakes when _ready reaches this
        # Per world: steps sent by send() and not yet received (it goes below 0 when recv takes
        # an autoreset step), and (written on the loop only) the autoreset steps the loop sent
        # itself: with ``_autoreset`` on, a world whose step lands LAST with no other step in
        # flight is sent its next step (the protocol's reset: a step after LAST starts the
        # next sequence) at once, with the bytes of its latest step (``_latest_wire``), whose
        # action the server ignores. What is in flight is the sum of the two.
        self._in_flight = [0] * count
        self._auto_sent = [0] * count
        # Their sums (pending() in O(1)): the first written by the caller's thread only
        # (_count), the second by the loop only.
        self._in_flight_total = 0
        self._auto_total = 0
        self._autoreset = False
        self._latest_wire: list[bytes] = [b""] * count
        # Round trips in seconds, send to response, of the latest LATENCY_SAMPLES steps.
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)
        # World states (written under _cond; on the loop when there is one) and generations:
        # a failure bumps the generation, and responses of an older one are dropped.
        self._state = [_LIVE] * count
        self._gen = [0] * count
        self._policy = _restart.RAISE
        self._restart_policy = RestartPolicy()
        self._step_timeout: float | None = None
        # On the loop only: steps written and unanswered, the time of the world's last
        # progress (perf_counter), steps held while it restarts, and whether its next step
        # is the first after a restart that answered nothing.
        self._busy = [0] * count
        self._progress = [0.0] * count
        self._held: list[list[tuple[bytes, float]]] = [[] for _ in range(count)]
        self._truncate_next = [False] * count
        self._recipes: list[_restart.WorldRecipe] = []
        self._open_stream: Callable[[str, float], Any] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._rng = random.Random()
        self._balancer: Any = None  # under "restart": the balance of worlds over servers
        self.servers: Any = None  # public: the LaunchedServers it was connected to, if any,
        self.relaunches: list[Any] = []  # their Relaunch records (the same list),
        self.moves: list[Any] = []  # and each WorldMove made for balance (_balance)
        self._moving: dict[int, Any] = {}
        self._actions_rng = np.random.default_rng()  # random_actions(); connect(seed=) seeds it

    def _wrap(self, index: int, exc: BaseException) -> errors.WorldError:
        address = self.addresses[index]
        kind = errors.WorldTimeoutError if isinstance(exc, TimeoutError) else errors.WorldError
        return kind(_WORLD_FAILED.format(index=index, address=address, error=exc), index, address)

    def _latest_failure(self, index: int) -> WorldFailure | None:
        """World ``index``'s latest entry in ``failures``, if it has one."""
        return next((f for f in reversed(self.failures) if f.index == index), None)

    def _refusal(self, index: int) -> errors.WorldError:
        failure = self._latest_failure(index)
        cause: Any = failure.cause if failure is not None else "unknown"
        if self._state[index] == _REMOVED_STATE and failure is not None:
            reason = _REMOVED.format(
                attempts=failure.attempts, cause=cause, last=failure.last_error
            )
        else:
            reason = _FAILED_BEFORE.format(cause=cause)
        error = self._wrap(index, errors.DmEnvRpcClientError(reason))
        error.__cause__ = cause if isinstance(cause, BaseException) else None
        return error

    def _write_steps(self, ids: list[int], wire: list[bytes], sent: float) -> None:
        # Queue each world's step request (EnvironmentRequest bytes); _landed files its response.
        # A live world's is _write's, inlined (the loop runs this once per step sent).
        states, busy, progress, gens, streams = (
            self._state,
            self._busy,
            self._progress,
            self._gen,
            self._streams,
        )
        plain = not self._autoreset and not self._moving
        for index, data in zip(ids, wire, strict=True):
            state = states[index]
            if state == _LIVE and plain:
                if not busy[index]:
                    progress[index] = sent
                busy[index] += 1
                streams[index]._submit_receiver(data, _Landing(self, index, gens[index], sent))
            elif state == _LIVE:
                self._write(index, data, sent)
            elif state == _RESTARTING:
                self._held[index].append((data, sent))
            else:  # failed or removed while this was on its way: it answers as a failure
                self._count_lost(index)
                self._file(index, self._gen[index], sent, _Failure(self._refusal(index), 1))

    def _count_lost(self, index: int) -> None:
        """One more unanswered step in world ``index``'s latest failure's ``steps_lost``: a
        step sent before its failure was known, that never reached a stream."""
        for position in range(len(self.failures) - 1, -1, -1):
            failure = self.failures[position]
            if failure.index == index:
                self.failures[position] = dataclasses.replace(
                    failure, steps_lost=failure.steps_lost + 1
                )
                return

    def _write(self, index: int, data: bytes, sent: float) -> None:
        if not self._busy[index]:
            self._progress[index] = sent
        self._busy[index] += 1
        if self._autoreset:
            self._latest_wire[index] = data
        # Steps are read from their wire bytes: a large payload is copied once (_wire_step).
        if self._moving and index in self._moving:  # picked to move: keep the bytes
            self._moving[index].recorded.append((data, sent))
        landing = _Landing(self, index, self._gen[index], sent)
        self._streams[index]._submit_receiver(data, landing)

    def _landed_data(self, index: int, gen: int, sent: float, data: bytes) -> None:
        """``_landed`` for an answer's bytes (the reader's call, in answer order): read (its
        state alone, where the plan's layout fits: ``_fastpath.raw_step``), then filed.

        The usual answer (it fits the layout's ``Frame``, and nothing is special about
        its world: no restart to mark, no autoreset, no move) is read, advanced and filed
        right here, in one call: what ``read_answer``, ``_settle`` and ``_file`` do, without
        their calls (the loop runs this once per step of every world)."""
        if gen != self._gen[index]:
            return  # an answer to a step dropped by a failure
        plan = self._plan
        frame = None if plan is None or plan._layout is None else plan._layout.frame
        if (
            frame is not None
            and len(data) == frame.length
            and data[frame.state_at] < 0x80
            and not self._autoreset
            and not self._moving
            and not self._truncate_next[index]
        ):
            for start, stop, expected in frame.runs:
                if data[start:stop] != expected:
                    break
            else:
                response = RawStep(data[frame.body_at :], data[frame.state_at])
                try:
                    outcome: Any = (self.envs[index]._advance(response.state), response)
                except Exception as exc:
                    outcome = exc
                self._busy[index] -= 1
                now = self._progress[index] = time.perf_counter()
                with self._lock:  # _file's
                    if gen != self._gen[index]:
                        return
                    queue = self._done[index]
                    if not queue:
                        self._filed.append(index)
                    queue.append((outcome, now - sent))
                    self._ready += 1
                    if self._ready >= self._want:
                        self._want = _NO_WAITER
                        self._cond.notify()
                return
        try:
            response = read_answer(data, None if plan is None else plan._layout)
        except Exception as exc:  # the server's error for this step, or an unreadable answer
            self._landed(index, gen, sent, None, exc)
            return
        try:
            outcome = (self.envs[index]._advance(response.state), response)
        except Exception as exc:
            outcome = exc
        self._settle(index, gen, sent, outcome)

    def _landed(
        self, index: int, gen: int, sent: float, response: Any, error: BaseException | None
    ) -> None:
        # Only the state machine moves here (in request order); recv decodes the observations.
        if gen != self._gen[index]:
            return  # an answer to a step dropped by a failure
        if isinstance(error, errors.DmEnvRpcConnectionError):
            self._fail(index, error)  # this step is one of those it drops
            return
        outcome: Any = error
        if error is None:
            try:
                outcome = (self.envs[index]._advance(response.state), response)
            except Exception as exc:
                outcome = exc
        self._settle(index, gen, sent, outcome)

    def _settle(self, index: int, gen: int, sent: float, outcome: Any) -> None:
        """World ``index``'s step landed with ``outcome``: it makes progress, and is filed."""
        self._busy[index] -= 1
        now = self._progress[index] = time.perf_counter()
        if self._truncate_next[index]:
            self._truncate_next[index] = False
            if isinstance(outcome, tuple):
                outcome = (*outcome, 1)
        elif (
            self._autoreset
            and not self._busy[index]
            and _ends(outcome)
            and self._latest_wire[index]
        ):
            self._auto_sent[index] += 1  # counted before the LAST is filed: recv sees both
            self._auto_total += 1
            self._write(index, self._latest_wire[index], time.perf_counter())
        self._file(index, gen, sent, outcome, now)
        if self._moving and index in self._moving:
            self._balancer.landed(index, outcome)

    def _watch(self) -> None:
        # Every world with steps in flight and no progress for step_timeout has failed.
        timeout = self._step_timeout
        if self._closed or timeout is None or self._runner is None:
            return
        now = time.perf_counter()
        for index, busy in enumerate(self._busy):
            if busy and now - self._progress[index] > timeout and self._state[index] == _LIVE:
                self._fail(index, errors.RequestTimeoutError(_STALLED.format(timeout=timeout)))
        interval = min(1.0, max(0.02, timeout / 4))
        self._watchdog = self._runner.loop.call_later(interval, self._watch)

    def _fail(self, index: int, cause: BaseException, reported: bool = False) -> int:
        """World ``index`` failed: drop its unanswered steps and apply the policy.

        Returns how many steps were dropped. ``reported``: the caller raises the
        failure itself, so under "raise" nothing is filed for it.
        """
        if self._state[index] != _LIVE:
            return 0
        lost, self._busy[index] = self._busy[index], 0
        with self._cond:
            self._gen[index] += 1
            self._state[index] = _RESTARTING if self._policy == _restart.RESTART else _FAILED
        stream = self._streams[index]
        self._moving.pop(index, None)
        if self._policy == _restart.RESTART:
            self._spawn(self._restore(index, cause, lost, stream))
            return lost
        self._spawn(stream.aclose())
        self.failures.append(
            WorldFailure(
                index, self.addresses[index], cause, time.time(), 0, "raised", None, lost, 0.0
            )
        )
        if lost and not reported:
            self._file(index, self._gen[index], time.perf_counter(), _Failure(cause, lost))
        return lost

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restore(
        self, index: int, cause: BaseException, lost: int, old: AsyncConnection
    ) -> None:
        detected, started = time.time(), time.monotonic()
        with contextlib.suppress(Exception):
            await old.aclose()
        address = self.addresses[index]
        assert self._open_stream is not None
        self._balancer.failed_at(str(address))  # restarts have a balancer (_balance)
        try:
            restored = await _restart.reopen(
                self._open_stream,
                self._balancer.order(index),
                self._recipes[index],
                self._restart_policy,
                first_step=lost > 0,
                rng=self._rng,
            )
        except _restart.GaveUp as gave_up:
            self._removed(index, address, [index], [lost], cause, detected, started, gave_up)
            self._balancer.restored(index)
            return
        env = restored.env
        self._balancer.adopt(index, restored)
        self._restarted(
            index, address, cause, detected, started, restored.attempts, restored.address, lost
        )
        if restored.first is not None:
            step_type = env._advance(restored.first.state)
            self._file(
                index, self._gen[index], time.perf_counter(), (step_type, restored.first, lost)
            )
        else:
            self._truncate_next[index] = True
        self._balancer.flush_held(index)
        self._balancer.restored(index)

    def _restarted(
        self,
        index: int,
        address: str | None,
        cause: BaseException,
        detected: float,
        started: float,
        attempts: int,
        to: str | None,
        lost: int,
    ) -> None:
        """Records world ``index``'s failure (at ``address``), made good by a restart (on
        ``to``)."""
        downtime = time.monotonic() - started
        record = WorldFailure(
            index, address, cause, detected, attempts, "restarted", to, lost, downtime
        )
        self.failures.append(record)

    def _removed(
        self,
        index: int,
        address: str | None,
        slots: Sequence[int],
        lost: Sequence[int],
        cause: BaseException,
        detected: float,
        started: float,
        gave_up: _restart.GaveUp,
    ) -> None:
        """World ``index`` (at ``address``) could not be made again: its ``slots`` (the world itself, or a
        multi-agent world's agents, ``_batch.agents``) leave the batch, its failure is recorded,
        and each slot's lost steps (``lost``, one count per slot) and held ones are filed as
        one removed failure."""
        held = [len(self._held[slot]) for slot in slots]
        with self._cond:
            for slot in slots:
                self._state[slot] = _REMOVED_STATE
                self._held[slot] = []
        self.failures.append(
            WorldFailure(
                index,
                address,
                cause,
                detected,
                gave_up.attempts,
                "removed",
                None,
                sum(lost) + sum(held),
                time.monotonic() - started,
                gave_up.last_error,
            )
        )
        for slot, lost_here, held_here in zip(slots, lost, held, strict=True):
            if lost_here or held_here:
                failure = _Failure(cause, lost_here + held_here, removed=True)
                self._file(slot, self._gen[slot], time.perf_counter(), failure)

    def _finished(
        self, index: int, gen: int, sent: float, future: concurrent.futures.Future[Any]
    ) -> None:
        try:
            response = future.result()
            outcome: Any = (self.envs[index].step_response(response), response.state)
        except BaseException as exc:
            outcome = exc
        self._file(index, gen, sent, outcome)

    def _file(
        self, index: int, gen: int, sent: float, outcome: Any, now: float | None = None
    ) -> None:
        # On the loop (or a connection's reader thread): file the step and wake recv if due.
        # ``now``: perf_counter() as the caller just read it.
        latency = (time.perf_counter() if now is None else now) - sent
        with self._lock:  # _cond's
            if gen != self._gen[index]:
                return  # an answer to a step dropped by a failure
            self._enqueue(index, outcome, latency)

    def _enqueue(self, index: int, outcome: Any, latency: float) -> None:
        # With _lock held: world ``index``'s step joins its queue, for recv to take, and wakes
        # recv if due (it runs once the lock is let go, so steps filed in one hold go together).
        queue = self._done[index]
        if not queue:
            self._filed.append(index)
        queue.append((outcome, latency))
        self._ready += 1
        if self._ready >= self._want:
            self._want = _NO_WAITER  # notified once; recv sets it again if it waits on
            self._cond.notify()

    def _wait(self, ready: Callable[[], bool], wanted: int, timeout: float | None) -> bool:
        # The loop notifies once as _ready reaches _want, and clears _want (not once per step
        # filed while this thread waits for the GIL); each wait here sets it again.
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not ready():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._want = wanted
                try:
                    self._cond.wait(left)
                finally:
                    self._want = _NO_WAITER
            return True

    def _count(self, index: int, steps: int) -> None:
        """World ``index`` has ``steps`` more steps sent and not received (fewer if negative)."""
        self._in_flight[index] += steps
        self._in_flight_total += steps

    async def _stop_tasks(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
