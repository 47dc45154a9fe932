"""Worlds whose server stops reading do not hold up the other worlds' writes.

A batch's streams are written by one pool of writer tasks (``_transport.writers``).
A stream whose server stops reading holds its task while the ``grpc.aio`` write
waits for HTTP/2 flow control (its unread requests past the stream's window: large
actions). Here more worlds stall than the pool has tasks: they are on a raw-gRPC
server that answers create and join, then reads nothing more from the stream;
the healthy worlds are on the SDK's server.

The stalling server turns gRPC's BDP probing off, so a stream's window stays
HTTP/2's 64 KB and one 256 KB step fills it. With probing on, gRPC grows the
window of a stream that is not read to about 4 MB on loopback (measured: a stream
took 16 such steps before a write waited), the same stall after more bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import dm_env
import grpc
import numpy as np
import pytest
from conftest import wait_for
from dm_env import specs as dm_specs
from faulty import lifecycle, process_server
from raw_stream import RawStream

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client._transport import writers
from dm_env_rpc_client._transport.writers import WritePool
from dm_env_rpc_client.server import Server, serve

ACTION = 256 * 1024  # bytes a step: four times HTTP/2's default window of 64 KB
HEALTHY = 4
# The batch's pool for these tests (writers.POOL_SIZE is 256: as many stalled worlds with
# 256 KB actions would be 64 MB in flight): what matters is stalling them all.
POOL_SIZE = 64
STALLED = POOL_SIZE + 6  # more than the pool's tasks
ROUNDS = 5


class Echo(dm_env.Environment):
    """Action ``a``: uint8[ACTION]. Observes ``seen = [steps, sum, first, last]`` of the last
    action, so that a test can tell a step's action arrived whole and in order."""

    def __init__(self, **_: Any) -> None:
        self.count = 0

    def _observe(self, action: Any) -> dict[str, Any]:
        a = np.asarray(action, np.uint8)
        seen = [self.count, int(a.sum(dtype=np.int64)), int(a[0]), int(a[-1])]
        return {"seen": np.array(seen, np.int64)}

    def reset(self) -> dm_env.TimeStep:
        self.count = 0
        return dm_env.restart(self._observe(np.zeros(ACTION, np.uint8)))

    def step(self, action: Any) -> dm_env.TimeStep:
        self.count += 1
        return dm_env.transition(0.0, self._observe(action["a"]))

    def observation_spec(self) -> Any:
        return {"seen": dm_specs.Array((4,), np.int64, name="seen")}

    def action_spec(self) -> Any:
        return {"a": dm_specs.Array((ACTION,), np.uint8, name="a")}


def _specs_of(address: str) -> Any:
    """The specs a world of the SDK server at ``address`` joins with (the stalling server
    answers with the same, so that all the batch's worlds are alike)."""
    raw = RawStream(address)
    try:
        return raw.join(raw.create())
    finally:
        raw.close()


@contextlib.contextmanager
def stalling_server(specs: Any, stalled: list[int], ended: list[int]) -> Iterator[str]:
    """A raw-gRPC server that answers create and join, then reads nothing more from the
    stream: its handler waits, at most 60 s, for the client to cancel the call. Appends 1 to
    ``stalled`` for each stream that stopped reading, and to ``ended`` for each the client
    then cancelled. Yields the address."""

    def process(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        for request in requests:
            yield lifecycle(request, specs)
            if request.WhichOneof("payload") == "join_world":
                stalled.append(1)
                if cancelled.wait(60):
                    ended.append(1)
                return

    options = [("grpc.http2.bdp_probe", 0)]  # the stream's window stays 64 KB (see the module)
    with process_server(process, options, max_workers=STALLED + 8) as address:
        yield address


@contextlib.contextmanager
def stalled_batch(step_timeout: float) -> Iterator[tuple[dmr.BatchedEnvironment, Server]]:
    """Worlds 0..STALLED-1 on the stalling server, then HEALTHY on the SDK's (Echo), with a
    pool of POOL_SIZE writers. Every world has been sent one step: the stalled worlds' writes
    wait for flow control. Once the batch is closed, every stalled world's stream must have
    been cancelled."""
    stalled: list[int] = []
    ended: list[int] = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(serve(Echo, max_workers=HEALTHY + 8))
        address = stack.enter_context(stalling_server(_specs_of(server.address), stalled, ended))
        addresses = [address] * STALLED + [server.address] * HEALTHY
        with pytest.MonkeyPatch.context() as patch:  # read as the batch makes its pool
            patch.setattr(writers, "POOL_SIZE", POOL_SIZE)
            batch = dmr.BatchedEnvironment.connect(
                addresses, len(addresses), step_timeout=step_timeout
            )
        assert batch._writers._size == POOL_SIZE
        try:
            assert wait_for(lambda: len(stalled) == STALLED)  # every handler stopped reading
            everyone = list(range(len(addresses)))
            # the stalled worlds first: their writes take the pool's tasks before any other
            batch.send({"a": np.zeros((len(everyone), ACTION), np.uint8)}, everyone)
            yield batch, server
        finally:
            batch.close(timeout=1)  # the stalled worlds never answer their leave
        assert wait_for(lambda: len(ended) == STALLED)  # nothing of theirs is left hanging


HEALTHY_IDS = list(range(STALLED, STALLED + HEALTHY))


def _step_healthy(batch: dmr.BatchedEnvironment, rng: np.random.Generator, count: int) -> None:
    """Steps the healthy worlds once; each must answer its step ``count`` with its action whole."""
    actions = rng.integers(0, 256, (HEALTHY, ACTION), dtype=np.uint8)
    batch.send({"a": actions}, HEALTHY_IDS)
    seen = batch.recv(env_ids=HEALTHY_IDS, timeout=10).observation["seen"]
    assert list(seen[:, 0]) == [count] * HEALTHY
    assert list(seen[:, 1]) == list(actions.sum(axis=1, dtype=np.int64))
    assert list(seen[:, 2]) == list(actions[:, 0]) and list(seen[:, 3]) == list(actions[:, -1])


def _writer_tasks(batch: dmr.BatchedEnvironment) -> int:
    """How many tasks on the batch's loop write requests (a pool's, or a stream's own)."""
    counted: list[int] = []

    def count() -> None:  # the pool's writers (no tasks) and any stream's own writer task
        names = [getattr(t.get_coro(), "__qualname__", "") for t in asyncio.all_tasks()]
        own = sum(n == "AsyncConnection._write_loop" for n in names)
        counted.append(len(batch._writers._tasks) + own)

    assert batch._runner is not None
    batch._runner.call(count)
    assert wait_for(lambda: bool(counted))
    return counted[0]


def test_worlds_whose_server_stops_reading_do_not_stop_the_others() -> None:
    # The watchdog is far off: with every pool task held by a stalled world, the healthy
    # worlds' steps used to wait for it (recv timed out after 10 s here).
    rng = np.random.default_rng(0)
    with stalled_batch(step_timeout=60) as (batch, server):
        first = batch.recv(env_ids=HEALTHY_IDS, timeout=10)
        assert list(first.observation["seen"][:, 0]) == [0] * HEALTHY  # the reset
        for count in range(1, 1 + ROUNDS):
            _step_healthy(batch, rng, count)
        # the stall was real: each stalled world's write still holds a task; none failed
        assert _writer_tasks(batch) >= STALLED
        assert not batch.failures
    assert wait_for(lambda: server._streams == 0)  # the healthy worlds were left all the same


def test_the_watchdog_still_fails_worlds_whose_server_stops_reading() -> None:
    # Only the stalled worlds: the healthy ones' steps used to wait behind them in the pool
    # for the watchdog too, which failed them with the stalled ones.
    rng = np.random.default_rng(1)
    with stalled_batch(step_timeout=3.0) as (batch, server):
        assert batch.recv(env_ids=HEALTHY_IDS, timeout=10).first().all()
        count = 1
        deadline = time.monotonic() + 30
        while len(batch.failures) < STALLED and time.monotonic() < deadline:
            _step_healthy(batch, rng, count)  # every step meanwhile whole and answered
            count += 1
        assert sorted(failure.index for failure in batch.failures) == list(range(STALLED))
        assert all(isinstance(f.cause, errors.RequestTimeoutError) for f in batch.failures)
        # their writes ended with their streams: the pool is back to its size
        assert wait_for(lambda: _writer_tasks(batch) <= POOL_SIZE)
        for _ in range(ROUNDS):
            _step_healthy(batch, rng, count)
            count += 1
        with pytest.raises(errors.WorldError):
            batch.send({"a": np.zeros((1, ACTION), np.uint8)}, [0])
    assert wait_for(lambda: server._streams == 0)


def test_a_pool_whose_tasks_are_all_held_starts_one_more() -> None:
    # The pool's scheduling alone (no gRPC): two streams whose writes never end hold a pool
    # of two; a third queued behind them is written by a third task, and once the held
    # writes end the pool is back to two.
    pool = WritePool(size=2)
    written: list[str] = []

    class Stream:
        _close_called = False

        def __init__(self, name: str, held: asyncio.Future[None] | None = None) -> None:
            self.name, self.held, self._writer = name, held, None

        async def _write_queued(self) -> None:
            if self.held is not None:
                await self.held
            written.append(self.name)

    async def until(condition: Any) -> bool:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return bool(condition())

    async def run() -> None:
        loop = asyncio.get_running_loop()
        held = [loop.create_future(), loop.create_future()]
        pool.ready(Stream("held 1", held[0]))
        pool.ready(Stream("held 2", held[1]))
        pool.ready(Stream("c"))
        assert await until(lambda: written == ["c"])
        assert pool._running == 2  # the third task ended with the queue
        pool.ready(Stream("d"))  # held tasks still run: one more starts at once
        assert pool._running == 3
        for future in held:
            future.set_result(None)
        assert await until(lambda: pool._running == 0)
        assert sorted(written) == ["c", "d", "held 1", "held 2"]
        assert pool._limit == 2

    asyncio.run(run())
