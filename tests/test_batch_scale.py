"""BatchedEnvironment at scale: connecting and closing all at once, shared spec machinery, limits.

The limits are tested on real servers (the SDK's server refusing streams past
its ``max_workers`` is in test_batched_seeds): the reference-package peer (``bench/_lib/foreign_server.py``)
whose thread pool leaves a stream past its size unanswered, and a client
process whose file-descriptor limit (RLIMIT_NOFILE) is lowered.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import run_child, sigstop, wait_for
from faulty import faulty_server, float_specs, refusing_leave

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client._base import collector
from dm_env_rpc_client._batch.closing import _leave_all
from dm_env_rpc_client._transport import writers
from dm_env_rpc_client._transport.writers import WritePool
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server._subprocess import _ADDRESS, _first_line, _stop
from dm_env_rpc_client.server.catch import Catch

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOREIGN = ROOT / "bench" / "_lib" / "foreign_server.py"


@contextlib.contextmanager
def foreign_server(max_workers: int) -> Iterator[str]:
    """The reference-package peer serving Catch with a thread pool of ``max_workers``."""
    command = [sys.executable, str(FOREIGN), "--env", "catch", "--max-workers", str(max_workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = _first_line(process.stdout, 30.0)
        match = _ADDRESS.match(line.strip()) if line else None
        assert match is not None, f"the peer server printed {line!r}"
        yield match.group(1)
    finally:
        _stop(process)
        if process.stdout is not None:
            process.stdout.close()


def test_many_worlds_open_step_and_close_all_at_once() -> None:
    with (
        serve(lambda settings: Catch(**settings), max_workers=100) as one,
        serve(lambda settings: Catch(**settings), max_workers=100) as two,
    ):
        addresses = [one.address, two.address]
        batch = dmr.BatchedEnvironment.connect(addresses, 150, seed=3)
        with batch:
            assert batch.addresses == [addresses[i % 2] for i in range(150)]
            worlds = set(zip(batch.addresses, (env.world_name for env in batch.envs), strict=True))
            assert len(worlds) == 150
            assert batch.world_seeds == [3 + i for i in range(150)]
            first = batch.reset()
            assert first.observation["board"].shape[0] == 150
            step = batch.step({"paddle": np.ones(150, np.int8)})
            assert list(step.env_ids) == list(range(150))
        assert all(env._closed for env in batch.envs)
        # every world was left and destroyed: its stream ended, and the servers have room again
        for server in (one, two):
            assert wait_for(lambda server=server: server._streams == 0)
            assert not server._registry._worlds


def test_worlds_alike_share_spec_machinery_but_not_state(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect([catch_server.address], 3) as batch:
        first, second, third = batch.envs
        assert second._observations is first._observations
        assert second._plan is first._plan
        assert len({id(env.connection) for env in batch.envs}) == 3
        assert len({id(env._lock) for env in batch.envs}) == 3
        first.reset()  # one world alone: the others' state machines do not move
        assert first._last_state is not None
        assert second._last_state is None and third._last_state is None
        timestep = second.reset()
        assert timestep.first()


def test_a_thread_pool_servers_stream_limit_is_named_after_the_timeout() -> None:
    with foreign_server(max_workers=2) as address:
        with pytest.raises(errors.WorldError) as raised:
            dmr.BatchedEnvironment.connect([address], 3, timeout=2)
        message = str(raised.value)
        assert "2 other streams" in message and "max_workers" in message, message
        # the pool's threads were given back: two worlds connect and step
        with dmr.BatchedEnvironment.connect([address], 2, timeout=10) as batch:
            assert len(batch.step({"paddle": np.zeros(2, np.int8)}).env_ids) == 2


def test_the_sdk_servers_max_workers_is_named_and_nothing_is_left_half_open(
    server_process,
) -> None:
    server = server_process("catch", "--max-workers", "2")  # the command line's limit
    with pytest.raises(errors.WorldError) as raised:
        dmr.BatchedEnvironment.connect([server.address], 3, timeout=10)
    message = str(raised.value)
    assert "RESOURCE_EXHAUSTED" in message and "--max-workers" in message, message

    # all or nothing: the failed connect let go of every stream it had opened, so the server
    # has room for two worlds again (once it has seen the streams end)
    def two_connect() -> bool:
        try:
            with dmr.BatchedEnvironment.connect([server.address], 2, timeout=10) as batch:
                return len(batch.step({"paddle": np.zeros(2, np.int8)}).env_ids) == 2
        except errors.WorldError:
            return False

    assert wait_for(two_connect, timeout=20, interval=0.2)


_LOW_LIMIT = textwrap.dedent(
    """
    import os, resource, sys
    import dm_env_rpc_client as dmr
    from dm_env_rpc_client import errors
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
    try:
        dmr.BatchedEnvironment.connect(sys.argv[1:], 4, timeout=10)
    except errors.DmEnvRpcConnectionError as exc:
        print("REFUSED", exc)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # as the message says
    with dmr.BatchedEnvironment.connect(sys.argv[1:], 4, timeout=10) as batch:
        print("STEPPED", len(batch.reset().env_ids))
    """
)


@pytest.mark.skipif(not pathlib.Path("/proc/self/fd").exists(), reason="needs /proc")
def test_too_few_file_descriptors_fail_before_anything_is_opened(catch_server: Server) -> None:
    address = catch_server.address
    port = address.rsplit(":", 1)[1]
    addresses = [address, f"localhost:{port}"]
    done = run_child([sys.executable, "-c", _LOW_LIMIT, *addresses], timeout=60)
    assert done.returncode == 0, done.stderr
    refused = next(line for line in done.stdout.splitlines() if line.startswith("REFUSED"))
    assert "RLIMIT_NOFILE" in refused and "ulimit -n" in refused and "2 servers" in refused
    assert "STEPPED 4" in done.stdout
    # nothing was opened by the refused connect: the server saw only the second batch's streams
    assert wait_for(lambda: catch_server._streams == 0)


def test_close_leaves_and_destroys_every_world_even_when_leave_is_refused() -> None:
    seen: list[str] = []
    with faulty_server(refusing_leave(float_specs(), seen)) as address:
        batch = dmr.BatchedEnvironment.connect([address], 4, timeout=10)
        batch.close(timeout=5)
        # Each world's Leave (refused) and Destroy reached the server before its stream ended.
        assert seen.count("leave_world") == 4
        assert seen.count("destroy_world") == 4
        assert all(env._closed for env in batch.envs)
        batch.close()  # idempotent


_SEEN: list[tuple[str, bool]] = []


class _Watched(Catch):
    """Catch that records (in ``_SEEN``) whether the garbage collector was on as it is made and
    destroyed (the in-process server runs it on its own thread, while the client opens or
    closes)."""

    def __init__(self, **settings: object) -> None:
        super().__init__(**settings)  # type: ignore[arg-type]
        _SEEN.append(("made", gc.isenabled()))

    def close(self) -> None:
        _SEEN.append(("destroyed", gc.isenabled()))
        super().close()


def test_the_garbage_collector_is_held_off_while_opening_and_closing_and_only_then() -> None:
    _SEEN.clear()
    assert gc.isenabled()
    with serve(lambda settings: _Watched(**settings), max_workers=4) as server:
        batch = dmr.BatchedEnvironment.connect([server.address], 3)
        assert gc.isenabled()  # on again once connected
        batch.reset()
        batch.close()
        assert gc.isenabled()
        assert wait_for(lambda: len(_SEEN) == 6)
        # the worlds were made while connect held the collector off, destroyed while close did
        assert sorted(_SEEN) == [("destroyed", False)] * 3 + [("made", False)] * 3
        # a connect that fails turns it back on too
        with pytest.raises(errors.WorldError):
            dmr.BatchedEnvironment.connect([server.address], 5, timeout=10)
        assert gc.isenabled()
        assert wait_for(lambda: server._streams == 0)
        # a collector the caller turned off stays off
        gc.disable()
        try:
            with dmr.BatchedEnvironment.connect([server.address], 2) as batch:
                assert not gc.isenabled()
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_collector_pauses_nest_and_restore_what_they_found() -> None:
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():  # another batch closing meanwhile
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    try:
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(KeyError), collector.paused():  # an error inside still ends the pause
        raise KeyError("x")
    assert gc.isenabled()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_close_leaves_and_destroys_the_live_servers_worlds_bounded_beside_a_dead_one(
    server_process, how: str
) -> None:
    dead = server_process()
    seen: list[str] = []
    with faulty_server(refusing_leave(float_specs(), seen)) as live:
        batch = dmr.BatchedEnvironment.connect([live, dead.address], 8, timeout=20)
        if how == "killed":
            dead.process.kill()
            dead.process.wait(timeout=10)
        else:
            sigstop(dead.process)
        try:
            started = time.monotonic()
            batch.close(timeout=2)
            took = time.monotonic() - started
            # bounded: the leaves wait at most the timeout; the teardown does not wait for servers
            assert took < 2 + 5, took
            assert all(env._closed for env in batch.envs)
            # each of the live server's 4 worlds got its Leave (refused) and its Destroy
            assert seen.count("leave_world") == 4 and seen.count("destroy_world") == 4, seen
            assert gc.isenabled()
        finally:
            if how == "stopped":
                os.kill(dead.process.pid, signal.SIGCONT)


def _step_rounds(batch: dmr.BatchedEnvironment, worlds: int, rounds: int) -> None:
    """Keeps 2 steps in flight per world and takes half the worlds at a time, ``rounds`` times."""
    paddles = np.zeros(4 * worlds, np.int8)
    for _ in range(rounds):
        ids = list(batch.recv(worlds // 2, timeout=30).env_ids)
        batch.send({"paddle": paddles[: len(ids)]}, ids)


def test_stepping_a_batch_makes_no_cyclic_garbage(server_process: Any) -> None:
    # Garbage in cycles is what makes Python's collector run while nothing else grows; a batch
    # stepping (steps, responses, gRPC's writes and reads, the watchdog) must free all it makes
    # by reference counting. Counted with the collector off, so nothing is collected unseen.
    servers = [server_process("catch", "--max-workers", "64") for _ in range(2)]
    batch = dmr.BatchedEnvironment.connect(
        [server.address for server in servers], 32, seed=0, on_world_failure="restart"
    )
    with batch:
        batch.reset()
        for _ in range(2):
            batch.send({"paddle": np.zeros(32, np.int8)}, list(range(32)))
        _step_rounds(batch, 32, 20)  # warm: the decoders' layouts, gRPC's caches
        gc.collect()
        gc.disable()
        try:
            _step_rounds(batch, 32, 100)
            found = gc.collect()
        finally:
            gc.enable()
        assert found == 0
        while batch.pending():
            batch.recv(batch.pending(), timeout=30)


def test_a_send_to_many_worlds_starts_a_bounded_pool_of_writers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One writer task per stream, started in one loop turn for every world sent a step, was
    # a burst of tracked objects (the task's and its gRPC write's) that ran dozens of young
    # collections per send at 4,096 worlds. The writer tasks on the loop right after the send
    # is queued (``_running``: they start together on the next turn): at most the pool's size
    # (main had one per world: 138). The pool is made
    # with writers.POOL_SIZE (256), here 64, so that twice as many worlds stay few.
    pool_size = 64
    monkeypatch.setattr(writers, "POOL_SIZE", pool_size)
    worlds = pool_size * 2 + 10
    with serve(lambda settings: Catch(**settings), max_workers=worlds + 8) as server:
        batch = dmr.BatchedEnvironment.connect([server.address], worlds, seed=0)
        assert batch._writers._size == pool_size
        with batch:
            batch.reset()
            assert batch._runner is not None
            counted: list[int] = []
            batch.send({"paddle": np.zeros(worlds, np.int8)}, list(range(worlds)))
            batch._runner.call(
                lambda: counted.append(batch._writers._running + _writers(asyncio.all_tasks()))
            )
            assert wait_for(lambda: bool(counted))
            assert 0 < counted[0] <= pool_size
            assert len(batch.recv(worlds, timeout=30).env_ids) == worlds


def _writers(tasks: set[asyncio.Task[Any]]) -> int:
    """How many of ``tasks`` write requests: a stream's own (a pool's writers are no tasks:
    ``WritePool._tasks``)."""
    names = [getattr(task.get_coro(), "__qualname__", "") for task in tasks]
    return sum(name == "AsyncConnection._write_loop" for name in names)


def test_a_stream_queued_as_the_pools_last_task_ends_is_still_written() -> None:
    # The pool's scheduling alone (no gRPC: what a stream's write does is not the point): a
    # stream queued after the last task found nothing to write, but before that task's done
    # callback ran, used to find the pool full and wait forever.
    pool = WritePool(size=1)
    written: list[str] = []

    class Stream:
        _close_called = False

        def __init__(self, name: str, then: Stream | None = None) -> None:
            self.name, self.then, self._writer = name, then, None

        async def _write_queued(self) -> None:
            written.append(self.name)
            if self.then is not None:  # queued on the loop once this task ends, not before
                asyncio.get_running_loop().call_soon(pool.ready, self.then)

    async def run() -> None:
        pool.ready(Stream("a", then=Stream("b")))
        for _ in range(100):
            if written == ["a", "b"]:
                return
            await asyncio.sleep(0)

    asyncio.run(run())
    assert written == ["a", "b"]


def test_a_burst_of_ready_streams_starts_its_writers_in_one_callback() -> None:
    # The pool's scheduling alone (no gRPC): a send to 512 worlds used to schedule one loop
    # callback per writer it started; now one starts them all, in the order queued, and
    # streams past the pool's size wait for a writer to finish one.
    pool = WritePool(size=3)
    written: list[str] = []

    class Stream:
        _close_called = False

        def __init__(self, name: str) -> None:
            self.name, self._writer = name, None

        async def _write_queued(self) -> None:
            await asyncio.sleep(0)  # a write waits for gRPC's completion: a loop turn
            written.append(self.name)

    async def run() -> list[Any]:
        loop = asyncio.get_running_loop()
        scheduled: list[Any] = []
        original = loop.call_soon

        def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
            scheduled.append(callback)
            return original(callback, *args, **kwargs)

        loop.call_soon = counting  # type: ignore[method-assign]
        try:
            for name in "abcde":
                pool.ready(Stream(name))
        finally:
            loop.call_soon = original  # type: ignore[method-assign]
        assert pool._running == 3
        for _ in range(100):
            if len(written) == 5:
                break
            await asyncio.sleep(0)
        return scheduled

    scheduled = asyncio.run(run())
    assert scheduled == [pool._start_writers]
    assert written == list("abcde")
    assert pool._running == 0 and not pool._tasks


def test_leaving_ends_each_streams_reader_with_its_last_answer() -> None:
    # close's leave and destroy are a stream's last requests: its reader ends as it reads
    # their answers, with no read left waiting for the stream's cancellation to fail (and
    # its task to be cancelled): a tenth of closing 4,096 worlds (issue 38).
    with serve(lambda settings: Catch(**settings), max_workers=8) as server:
        batch = dmr.BatchedEnvironment.connect([server.address], 6, seed=0)
        batch.reset()
        streams = list(batch._streams)
        _leave_all(batch, timeout=10)
        assert wait_for(lambda: all(stream._reader.done() for stream in streams))
        assert all(stream.closed and not stream._close_called for stream in streams)
        assert not server._registry._worlds  # every world left and destroyed
        batch.close()
        assert wait_for(lambda: server._streams == 0)
