"""Keeping a batch's worlds spread evenly over its servers, through failures and recoveries.

Under ``on_world_failure="restart"`` a world whose server dies fails over to
another one. ``Balancer`` brings such worlds home once their server answers
again, so that after recovery the worlds per live server differ by at most one
(launched servers or given addresses alike):

- a restart tries the world's own address first, then the others from the
  least loaded up (``order``); an address a world just failed on is *down*
  until a probe (a stream opens and a request is answered, every
  ``PROBE_EVERY`` seconds) says it serves again;
- when an address comes back, or a restart lands, ``plan`` picks worlds on
  the most loaded servers to move to the least loaded ones, until the counts
  differ by at most one;
- a picked world moves at its next episode boundary: when its LAST step
  lands, its stream is closed and the world is made again on the target
  (``_batch.restart.reopen``). The steps it had in flight after the LAST (their
  request bytes are kept from the moment it is picked) are written to the new
  world, whose first answer is the FIRST step the protocol promises after a
  LAST: no step is lost, repeated or truncated. A world picked while steps it
  sent before were still in flight waits for a boundary past them.

Every move is recorded in ``BatchedEnvironment.moves``. Healthy worlds keep
stepping meanwhile: everything here runs on the batch's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from typing import Any

import dm_env

from .. import errors
from .._proto import dm_env_rpc_pb2
from . import restart as _restart
from .core import BatchCore
from .outcomes import _LIVE, _REMOVED_STATE, _RESTARTING

PROBE_EVERY = 0.25  # seconds between probes of a down address
_DEATH_SEEN = 5.0  # a relaunch counts for a failure if the death was seen at most this earlier
_MOVED = "moved for balance from {source} (the move to {target} failed)"


@dataclasses.dataclass(frozen=True)
class WorldMove:
    """One world moved to even out the load (``BatchedEnvironment.moves``).

    Attributes:
      index: the world.
      source: the address it left.
      target: the address it is on now.
      time: when it moved (``time.time()``).
      seconds: how long the move took (its steps were held meanwhile).
    """

    index: int
    source: str
    target: str
    time: float
    seconds: float


class _Pending:
    """A world picked to move: its target, and the request bytes of its steps in flight."""

    __slots__ = ("recorded", "target", "unrecorded")

    def __init__(self, target: str, unrecorded: int) -> None:
        self.target = target
        self.unrecorded = unrecorded  # in flight when picked: their bytes were not kept
        self.recorded: collections.deque[tuple[bytes, float]] = collections.deque()


class Balancer:
    """The balance of one batch (see the module docs); its methods run on the batch's loop."""

    def __init__(self, core: BatchCore) -> None:
        self.core = core
        self.known = list(dict.fromkeys(str(a) for a in core.addresses))
        self.down: set[str] = set()
        self.moves: list[WorldMove] = []

    def loads(self) -> collections.Counter[str]:
        """Worlds per known address (removed worlds not counted; moving ones at their target)."""
        counts = collections.Counter({address: 0 for address in self.known})
        for index, address in enumerate(self.core.addresses):
            if self.core._state[index] != _REMOVED_STATE:
                pending = self.core._moving.get(index)
                counts[pending.target if pending is not None else str(address)] += 1
        return counts

    def order(self, index: int) -> list[str]:
        """Where a restart of world ``index`` tries: its address, then the least loaded up ones."""
        home = str(self.core.addresses[index])
        loads = self.loads()
        others = sorted(
            (a for a in self.known if a != home), key=lambda a: (a in self.down, loads[a])
        )
        return [home, *others]

    def failed_at(self, address: str) -> None:
        """A world failed at ``address``: it is down until a probe says otherwise."""
        if address in self.down or address not in self.known:
            return
        self.down.add(address)
        self.core._spawn(self._probe(address))

    async def _probe(self, address: str) -> None:
        open_stream = self.core._open_stream
        assert open_stream is not None
        while address in self.down and not self.core._closed:
            await asyncio.sleep(PROBE_EVERY)
            connection = None
            try:
                connection = await open_stream(address, 1.0)
                with contextlib.suppress(errors.DmEnvRpcError):  # an error is an answer
                    await connection.async_connection.send(dm_env_rpc_pb2.LeaveWorldRequest(), 1.0)
            except (errors.DmEnvRpcClientError, OSError):
                continue
            finally:
                if connection is not None:
                    with contextlib.suppress(Exception):
                        await connection.async_connection.aclose()
            self.down.discard(address)
            self.plan()

    def adopt(self, index: int, restored: _restart.Restored) -> None:
        """World ``index`` is ``restored`` now (made again elsewhere, or moved); it is live."""
        core, env = self.core, restored.env
        core.envs[index] = env
        core._connections[index] = restored.connection
        core._streams[index] = restored.connection.async_connection
        core._streams[index]._pool = core._writers
        core.addresses[index] = restored.address
        if env._wire_specs == core._joined_specs[index]:
            core._joined_specs[index] = env._wire_specs
        with core._cond:
            core._state[index] = _LIVE

    def flush_held(self, index: int) -> None:
        """Writes the steps held while world ``index`` was being made again, in order."""
        core = self.core
        held, core._held[index] = core._held[index], []
        for data, sent in held:
            core._write(index, data, sent)

    def restored(self, index: int) -> None:
        """World ``index``'s restart ended: its failure gets its server's relaunch, if any,
        and the load is planned again."""
        core = self.core
        failure = core._latest_failure(index)
        servers = core.servers
        if failure is not None and servers is not None:
            relaunch = next(
                (
                    r
                    for r in reversed(servers.relaunches)
                    if r.address == failure.address and r.died >= failure.time - _DEATH_SEEN
                ),
                None,
            )
            if relaunch is not None:
                position = len(core.failures) - 1 - core.failures[::-1].index(failure)
                core.failures[position] = dataclasses.replace(failure, relaunch=relaunch)
        self.plan()

    def plan(self) -> None:
        """Picks worlds to move until the worlds per up address differ by at most one."""
        core = self.core
        up = [a for a in self.known if a not in self.down]
        if len(up) < 2 or core._closed:
            return
        loads = self.loads()
        while True:
            busiest = max(up, key=lambda a: loads[a])
            idlest = min(up, key=lambda a: loads[a])
            if loads[busiest] - loads[idlest] < 2:
                return
            candidates = [
                index
                for index, address in enumerate(core.addresses)
                if str(address) == busiest
                and core._state[index] == _LIVE
                and index not in core._moving
            ]
            if not candidates:
                return
            index = candidates[-1]
            core._moving[index] = _Pending(idlest, core._busy[index])
            loads[busiest] -= 1
            loads[idlest] += 1

    def landed(self, index: int, outcome: Any) -> None:
        """A step of a picked world landed (and was filed); at a boundary past the unkept
        steps, the move starts."""
        core = self.core
        pending = core._moving[index]
        if pending.unrecorded:
            pending.unrecorded -= 1
        elif pending.recorded:
            pending.recorded.popleft()
        last = isinstance(outcome, tuple) and outcome[0] == dm_env.StepType.LAST
        if not last or pending.unrecorded or core._state[index] != _LIVE:
            return
        del core._moving[index]
        source = str(core.addresses[index])
        if pending.target in self.down:
            return  # the target went down meanwhile: stay
        with core._cond:
            core._gen[index] += 1  # the old world's answers to the steps moved are dropped
            core._state[index] = _RESTARTING
        core._busy[index] = 0
        core._held[index][:0] = list(pending.recorded)
        core._spawn(self._move(index, source, pending.target))

    async def _move(self, index: int, source: str, target: str) -> None:
        core = self.core
        started, when = time.monotonic(), time.time()
        old = core._streams[index]
        with contextlib.suppress(Exception):
            await old.aclose()
        assert core._open_stream is not None
        try:
            restored = await _restart.reopen(
                core._open_stream,
                [target],
                core._recipes[index],
                core._restart_policy._replace(attempts=1),
                first_step=False,
                rng=core._rng,
            )
        except _restart.GaveUp as gave_up:  # as if the world had failed where it was
            cause = errors.DmEnvRpcClientError(_MOVED.format(source=source, target=target))
            cause.__cause__ = gave_up.last_error
            await core._restore(index, cause, 0, old)
            return
        self.adopt(index, restored)
        self.moves.append(WorldMove(index, source, target, when, time.monotonic() - started))
        self.flush_held(index)
