"""The asyncio environment: the sync adaptor's TimeSteps, awaited, pipelined, and cleaned up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import dm_env
import numpy as np
import pytest
from conftest import sigstop
from faulty import counting_server, faulty_server, float_specs, refusing_leave

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client._adaptor.core import AdaptorCore
from dm_env_rpc_client.server import Server
from dm_env_rpc_client.server.catch import Catch

SETTINGS = {"rows": 4, "columns": 3, "seed": 11}
PADDLES = [1, -1, 0, 1, 1, -1, 0, 0, 1, -1, 0, 1]


def _same(a: dm_env.TimeStep, b: dm_env.TimeStep) -> None:
    assert a.step_type == b.step_type
    assert a.reward == b.reward and a.discount == b.discount
    assert np.array_equal(a.observation["board"], b.observation["board"])


def _sync_run(address: str) -> list[dm_env.TimeStep]:
    env, _ = dmr.create_and_join_world(address, SETTINGS, {}, timeout=10)
    try:
        out = [env.reset()]
        out += [env.step({"paddle": p}) for p in PADDLES]
        return out
    finally:
        env.close()


def test_the_shared_logic_is_one_implementation_not_a_copy() -> None:
    for name in ("_advance", "_timestep_of", "_run_timesteps", "reward", "discount"):
        assert getattr(dmr.AsyncDmEnvAdaptor, name) is getattr(dmr.DmEnvAdaptor, name), name
        assert getattr(dmr.AsyncDmEnvAdaptor, name) is getattr(AdaptorCore, name), name
    for name in ("step_request", "step_response", "observation_spec", "action_spec"):
        assert name not in vars(dmr.AsyncDmEnvAdaptor) and name not in vars(dmr.DmEnvAdaptor)


def test_awaited_steps_equal_the_sync_adaptor(catch_server: Server) -> None:
    expected = _sync_run(catch_server.address)

    async def main() -> list[dm_env.TimeStep]:
        env, name = await dmr.create_and_join_world_async(
            catch_server.address, SETTINGS, {}, timeout=10
        )
        async with env:
            assert name == env.world_name
            assert repr(env).startswith(f"AsyncDmEnvAdaptor(world={name!r}")
            assert env.observation_spec()["board"].shape == (4, 3)
            out = [await env.reset()]
            out += [await env.step({"paddle": p}) for p in PADDLES]
        assert env.connection.closed  # made from an address: the env owned it
        return out

    got = asyncio.run(main())
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        _same(a, b)


async def _actions() -> AsyncIterator[dict[str, int]]:
    for paddle in PADDLES:
        await asyncio.sleep(0)
        yield {"paddle": paddle}


@pytest.mark.parametrize("source", ["list", "async-generator"])
@pytest.mark.parametrize("in_flight", [1, 4])
def test_pipelined_async_for_equals_the_sync_adaptor(
    catch_server: Server, source: str, in_flight: int
) -> None:
    expected = _sync_run(catch_server.address)

    async def main() -> list[dm_env.TimeStep]:
        async with await dmr.connect_async(catch_server.address, timeout=10) as conn:
            env, _ = await dmr.create_and_join_world_async(conn, SETTINGS, {}, timeout=10)
            async with env:
                out = [await env.reset()]
                actions: Any = [{"paddle": p} for p in PADDLES] if source == "list" else _actions()
                out += [t async for t in env.step_iter(actions, in_flight=in_flight)]
            assert not conn.closed  # a connection passed in stays the caller's
            return out

    got = asyncio.run(main())
    for a, b in zip(got, expected, strict=True):
        _same(a, b)


def test_stopping_an_async_for_early_keeps_the_state_machine_in_step(
    catch_server: Server,
) -> None:
    expected = _sync_run(catch_server.address)

    async def main() -> list[dm_env.TimeStep]:
        env, _ = await dmr.create_and_join_world_async(
            catch_server.address, SETTINGS, {}, timeout=10
        )
        async with env:
            out = [await env.reset()]
            steps = env.step_iter([{"paddle": p} for p in PADDLES[:6]], in_flight=6)
            async with contextlib.aclosing(steps):
                async for timestep in steps:
                    out.append(timestep)
                    break  # five more are on the wire: awaited and dropped on close
            out += [await env.step({"paddle": p}) for p in PADDLES[6:]]
            return out

    got = asyncio.run(main())
    assert len(got) == 1 + 1 + len(PADDLES[6:])
    _same(got[0], expected[0])
    _same(got[1], expected[1])
    for a, b in zip(got[2:], expected[7:], strict=True):
        _same(a, b)


def test_bad_actions_raise_before_anything_is_sent(catch_server: Server) -> None:
    async def main() -> None:
        env, _ = await dmr.create_and_join_world_async(catch_server.address, {}, {}, timeout=10)
        async with env:
            await env.reset()
            with pytest.raises(errors.SpecValidationError, match=r"env\.step\(\{'paddle': 1\}\)"):
                await env.step(1)  # type: ignore[arg-type]
            with pytest.raises(errors.SpecValidationError, match="paddle"):
                async for _ in env.step_iter([{"paddle": 0}, {"paddle": 7}]):
                    pass
            with pytest.raises(ValueError, match="in_flight"):
                async for _ in env.step_iter([], in_flight=0):
                    pass

    asyncio.run(main())


class _Gate:
    """A Catch whose steps wait until released (from the test's thread)."""

    release = threading.Event()


class SlowCatch(Catch):
    def step(self, action: Any) -> dm_env.TimeStep:
        _Gate.release.wait(5)
        return super().step(action)


@pytest.fixture
def slow_server() -> Iterator[Server]:
    _Gate.release.clear()
    with dmr.serve(SlowCatch) as server:
        try:
            yield server
        finally:
            _Gate.release.set()  # before the server stops: no step left waiting


def test_a_step_without_an_answer_times_out(slow_server: Server) -> None:
    async def main() -> None:
        env, _ = await dmr.create_and_join_world_async(slow_server.address, {}, {}, timeout=0.2)
        _Gate.release.set()  # let reset's first step through
        await env.reset(timeout=5)
        _Gate.release.clear()
        with pytest.raises(errors.RequestTimeoutError, match="StepRequest"):
            await env.step({"paddle": 0})
        with pytest.raises(errors.RequestTimeoutError, match="StepRequest"):
            async for _ in env.step_iter([{"paddle": 0}] * 2):
                pass
        _Gate.release.set()
        await env.aclose(timeout=5)

    asyncio.run(main())


def test_a_stopped_server_ends_waiting_steps_and_aclose_gives_up_quietly(server_process) -> None:
    """SIGSTOP: with no request timeout at all, keepalive (the fast options the SDK's server
    accepts) ends the wait within FAST_KEEPALIVE_DETECTION_S; with the default timeout, the
    same; ``aclose`` returns quietly."""
    child = server_process()

    async def main() -> None:
        fast = dmr.FAST_KEEPALIVE_OPTIONS
        unbounded, _ = await dmr.create_and_join_world_async(
            await dmr.connect_async(child.address, options=fast), {}, {}, timeout=None
        )
        default, _ = await dmr.create_and_join_world_async(
            await dmr.connect_async(child.address, options=fast), {}, {}
        )
        assert default._timeout == dmr.DEFAULT_TIMEOUT
        await unbounded.reset()
        await default.reset()
        sigstop(child.process)
        try:
            stopped = time.monotonic()
            for env in (unbounded, default):
                with pytest.raises(
                    errors.ConnectionClosedError, match="ping timeout|keepalive timeout"
                ):
                    async for _ in env.step_iter([{"paddle": 0}] * 4):
                        pass
            with pytest.raises(errors.ConnectionClosedError):
                await default.step({"paddle": 0})
            # The documented bound, with room for a loaded machine.
            assert time.monotonic() - stopped < dmr.FAST_KEEPALIVE_DETECTION_S + 15
            for env in (unbounded, default):
                await env.aclose()  # the server is gone: nothing to leave, no error
                assert env.connection.closed
        finally:
            os.kill(child.process.pid, signal.SIGCONT)

    asyncio.run(main())


def test_aclose_destroys_the_world_when_leave_is_refused() -> None:
    """As the sync close: a refused LeaveWorld still sends DestroyWorld, then raises."""
    seen: list[str] = []
    answer = refusing_leave(float_specs(), seen)

    async def main(address: str) -> None:
        env, _ = await dmr.create_and_join_world_async(address, {}, {}, timeout=5)
        with pytest.raises(errors.DmEnvRpcError, match="cannot leave"):
            await env.aclose()
        assert seen[-2:] == ["leave_world", "destroy_world"]
        assert env.connection.closed  # an adaptor made from an address closes its connection
        await env.aclose()  # idempotent

    with faulty_server(answer) as address:
        asyncio.run(main(address))


def test_async_world_helpers_and_failed_joins(catch_server: Server) -> None:
    async def main() -> None:
        async with await dmr.connect_async(catch_server.address, timeout=10) as conn:
            with pytest.raises(TypeError, match="requested_observations"):
                await dmr.create_and_join_world_async(conn, {}, {}, requested_observation=["x"])
            with pytest.raises(errors.UnknownNameError, match="bord"):
                await dmr.create_and_join_world_async(conn, {}, {}, requested_observations=["bord"])
            with pytest.raises(errors.InvalidArgumentError, match="bogus"):
                await dmr.create_and_join_world_async(conn, {}, {"bogus": 1})
            name = await dmr.create_world_async(conn, {"seed": 3}, timeout=10)
            env = await dmr.join_world_async(conn, name, {}, timeout=10)
            assert (await env.reset()).first()
            await dmr.reset_world_async(conn, name, timeout=10)
            await env.aclose()
            await env.aclose()  # idempotent
            await dmr.leave_world_async(conn, timeout=10)  # a no-op when not joined
            await dmr.destroy_world_async(conn, name, timeout=10)
            with pytest.raises(errors.NotFoundError):
                await dmr.destroy_world_async(conn, name, timeout=10)

    asyncio.run(main())


def test_what_is_not_an_async_connection_says_what_to_pass(catch_server: Server) -> None:
    async def main() -> None:
        with (
            dmr.connect(catch_server.address, timeout=10) as conn,
            pytest.raises(TypeError, match="dmr.create_and_join_world"),
        ):
            await dmr.create_and_join_world_async(conn, {}, {})
        coroutine = dmr.connect_async(catch_server.address, timeout=10)
        with pytest.raises(TypeError, match="await"):
            await dmr.create_and_join_world_async(coroutine, {}, {})  # type: ignore[arg-type]

    asyncio.run(main())


def test_the_sync_helpers_point_asyncio_users_to_the_async_ones(catch_server: Server) -> None:
    async def main() -> None:
        async with await dmr.connect_async(catch_server.address, timeout=10) as conn:
            with pytest.raises(TypeError, match="create_and_join_world_async"):
                dmr.create_and_join_world(conn, {}, {})  # type: ignore[arg-type]

    asyncio.run(main())


def test_a_refused_step_in_the_window_loses_none_before_it() -> None:
    """As the sync step_iter: the steps answered before a refused one are yielded first, and
    the later ones still move the state machine on (count 9 ends the episode)."""

    async def main(address: str) -> None:
        env, _ = await dmr.create_and_join_world_async(address, {}, {}, timeout=10)
        await env.reset()
        got = []
        with pytest.raises(errors.InvalidArgumentError, match="refused step"):
            async for timestep in env.step_iter([{}] * 8, in_flight=8):
                got.append(float(timestep.observation["x"][0]))
        assert got == [2.0, 3.0, 4.0]
        after = await env.step({})
        assert after.observation["x"][0] == 10.0 and after.first()
        await env.aclose()

    with counting_server(refuse=5, delay=0.0) as address:
        asyncio.run(main(address))
