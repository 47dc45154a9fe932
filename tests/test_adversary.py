"""Every misbehaviour of the adversarial server through every client path (issue 37).

Each mode of tests/adversary.py meets lockstep ``DmEnvAdaptor.step``, ``step_iter``,
``step_async``, ``BatchedEnvironment`` and asyncio (``AsyncDmEnvAdaptor``), and must give what
``adversary_paths.EXPECTED`` says: a named error whose message has a key phrase, or the right
steps. Never a raw exception (a path lets anything but the SDK's errors through), a hang (every
wait is bounded), or a step matched to the wrong request (every answer echoes its action). The
table in docs/faults.md is rendered from ``EXPECTED``, and checked here.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from typing import Any

import dm_env
import numpy as np
import pytest
from adversary import TIMEOUT, adversary_server
from adversary_paths import ACTIONS, EXPECTED, FOLLOW_UP, PATHS, WORLDS, Expect, Outcome, table
from raw_stream import RawStream

import dm_env_rpc_client as dmr
from dm_env_rpc_client._proto import dm_env_rpc_pb2

FAULTS_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "faults.md"


@pytest.fixture(scope="module")
def adversary() -> Any:
    with adversary_server() as address:
        yield address


def _cases() -> list[Any]:
    cases = []
    for mode, row in EXPECTED.items():
        for path, expect in row.items():
            marks = [pytest.mark.xfail(strict=False, reason=expect.defect)] if expect.defect else []
            cases.append(pytest.param(mode, path, id=f"{mode}-{path}", marks=marks))
    return cases


def _is(error: BaseException | None, expect: Expect) -> bool:
    """``error`` is of ``expect.error`` (or a WorldError caused by one) with one of its phrases."""
    assert expect.error is not None
    of_kind = isinstance(error, expect.error) or (
        isinstance(error, dmr.WorldError) and isinstance(error.__cause__, expect.error)
    )
    return of_kind and any(phrase in str(error) for phrase in expect.phrase.split("|"))


def _check(outcome: Outcome, expect: Expect, path: str) -> None:
    worlds = WORLDS.get(path, 1)
    wrong = [(sent, echo) for sent, echo in outcome.pairs if sent != echo]
    assert outcome.pairs[:worlds] == [(ACTIONS[0], ACTIONS[0])] * worlds  # the step before
    if expect.shifted:
        # dm_env_rpc matches answers to requests by order alone: after one dropped or repeated
        # answer, the later ones are one request off, which no client can see.
        assert all(abs(sent - echo) == 1 for sent, echo in wrong), wrong
    else:
        assert wrong == [], f"steps matched to the wrong request: {wrong}"
    if expect.optional:
        seen = [e for e in (outcome.error, outcome.after, outcome.closing) if e is not None]
        assert all(_is(error, expect) for error in seen), seen
        return
    if expect.error is None:
        assert outcome.error is None and outcome.after is None and outcome.closing is None
        assert len(outcome.pairs) == len(ACTIONS) * worlds
        return
    assert _is(outcome.error, expect), repr(outcome.error)
    if expect.cause is not None:
        assert isinstance(outcome.error, expect.error)
        assert isinstance(outcome.error.__cause__, expect.cause), repr(outcome.error.__cause__)
    if expect.then is None:  # the follow-up step got its own, right answer
        assert outcome.after is None and outcome.pairs[-1] == (FOLLOW_UP, FOLLOW_UP), outcome
    else:
        assert isinstance(outcome.after, expect.then), repr(outcome.after)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("mode", "path"), _cases())
def test_mode_through_path(adversary: str, mode: str, path: str) -> None:
    expect = EXPECTED[mode][path]
    outcome = PATHS[path](adversary, mode)
    _check(outcome, expect, path)
    if mode == "nan":
        assert np.isnan(outcome.xs[WORLDS.get(path, 1)]).all()  # the bad step's x, as sent


def test_the_docs_table_is_the_tested_one() -> None:
    page = FAULTS_PAGE.read_text()
    rendered = table()
    assert rendered in page, (
        "docs/faults.md's table of modes and paths differs from tests/adversary_paths.py's "
        "EXPECTED; put this table in the page:\n" + rendered
    )


def test_async_step_iter_yields_the_steps_before_an_undefined_state(adversary: str) -> None:
    """asyncio ``step_iter`` decodes the answers of 102 (good) and 103 (state 0) in one run: 102
    is yielded before the ProtocolError, and the stream goes on right (as the sync one, above)."""
    got: list[int] = []
    follow_up: list[Any] = []

    async def main() -> None:
        env, _ = await dmr.create_and_join_world_async(
            adversary, {"mode": "undefined-state"}, {}, timeout=TIMEOUT
        )
        try:
            await env.reset()

            async def actions() -> Any:
                for sent in ACTIONS:
                    yield {"a": np.int32(sent)}
                # Every answer in before step_iter takes any: one run holds the good and the bad.
                deadline = time.monotonic() + TIMEOUT
                while len(env.connection._pending) and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)

            with pytest.raises(dmr.ProtocolError, match="invalid state 0"):
                async for timestep in env.step_iter(actions(), in_flight=8):
                    got.append(int(timestep.observation["echo"]))
            follow_up.append(await env.step({"a": np.int32(FOLLOW_UP)}))
        finally:
            await env.aclose()

    asyncio.run(asyncio.wait_for(main(), 20))
    assert got == [ACTIONS[0]]
    assert int(follow_up[0].observation["echo"]) == FOLLOW_UP
    assert follow_up[0].step_type == dm_env.StepType.MID


def test_an_odd_error_code_keeps_its_number(adversary: str) -> None:
    with dmr.connect(adversary, timeout=5) as conn:
        env, _ = dmr.create_and_join_world(conn, {"mode": "odd-error-code"}, {}, timeout=5)
        env.reset()
        env.step({"a": np.int32(1)})
        with pytest.raises(dmr.DmEnvRpcError) as info:
            env.step({"a": np.int32(2)})
        env.close()
    assert info.value.raw_code == 99 and info.value.code == 2  # UNKNOWN, as gRPC has it
    assert "the server's code 99" in str(info.value)


def test_the_adversary_echoes_then_misbehaves(adversary: str) -> None:
    """The server itself, without the SDK's client: echoes, then its misbehaving answer."""
    stream = RawStream(adversary)
    try:
        create = dm_env_rpc_pb2.CreateWorldRequest(settings={"mode": dmr.pack_tensor("wrong-kind")})
        assert stream.ok(create_world=create).world_name == "w"
        stream.join("w")
        action = {1: dmr.pack_tensor(np.int32(7))}
        assert stream.step(action, [1]).observations[1].int32s.array == [7]
        stream.step(action)
        bad = stream.send(step=dm_env_rpc_pb2.StepRequest(actions=action))
        assert bad.WhichOneof("payload") == "reset"
    finally:
        stream.close()
