"""Every misbehaviour of the adversarial server (tests/adversary.py) met by one agent of a
``dmr.MultiAgentWorld``.

The adversary's mode belongs to the stream that created the world: agent 0's stream (it
creates the world) misbehaves at its ``BAD_STEP``-th step, agent 1's answers as it should
(its answers echo its own actions, 1000 above agent 0's, so a step matched to another round
cannot pass unseen). Each mode must give, within ``TIMEOUT`` and with nothing hanging:

- ``GOES_ON``: a ``WorldError`` naming the world and agent 0, and the world goes on *in
  step*: the follow-up round's answers are that round's for both agents (the refused round's
  answer of agent 1 is dropped with it);
- ``FAILS``: a ``WorldError`` naming agent 0 (the stream is gone), then "failed before";
- ``TIMES_OUT``: a ``WorldTimeoutError`` naming agent 0 after ``step_timeout``, then "failed
  before";
- ``RIGHT``: every round right;
- ``duplicated``: the protocol has no request ids, so agent 0's answers shift by one until the
  extra one is seen ("no request pending", when it is seen in time), as for one agent
  (docs/faults.md); agent 1's stay right.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from adversary import MODES, TIMEOUT, adversary_server

import dm_env_rpc_client as dmr

ROUNDS = (102, 103, 104, 105)  # 103 meets the misbehaviour
FOLLOW_UP = 999
OTHER = 1000  # agent 1 sends agent 0's action plus this
GOES_ON = {
    "wrong-kind",
    "empty",
    "long-payload",
    "empty-tensor",
    "wrong-dtype",
    "wrong-shape",
    "absurd-shape",
    "unknown-uid",
    "missing-observation",
    "undefined-state",
    "odd-error-code",
    "ok-error-code",
}
FAILS = {"closed", "aborted"}
TIMES_OUT = {"missing", "stalled", "late"}
RIGHT = {"slow", "nan"}


@pytest.fixture(scope="module")
def adversary() -> Any:
    with adversary_server() as address:
        yield address


def test_every_mode_has_an_expectation() -> None:
    assert GOES_ON | FAILS | TIMES_OUT | RIGHT | {"duplicated"} == set(MODES)


def _round(world: dmr.MultiAgentWorld, sent: int) -> tuple[int, int, int]:
    actions = {"agent_0": {"a": np.int32(sent)}, "agent_1": {"a": np.int32(sent + OTHER)}}
    steps = world.step(actions, timeout=TIMEOUT)
    return (
        sent,
        int(steps["agent_0"].observation["echo"]),
        int(steps["agent_1"].observation["echo"]),
    )


@pytest.mark.timeout(20)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_one_agent_meets_the_mode(adversary: str, mode: str) -> None:
    started = time.monotonic()
    rounds: list[tuple[int, int, int]] = []
    error: dmr.DmEnvRpcClientError | None = None
    after: dmr.DmEnvRpcClientError | None = None
    world = dmr.MultiAgentWorld.connect(
        adversary, 2, create_world_settings={"mode": mode}, timeout=TIMEOUT, step_timeout=TIMEOUT
    )
    try:
        world.reset()
        for sent in ROUNDS:
            try:
                rounds.append(_round(world, sent))
            except dmr.DmEnvRpcClientError as exc:
                error = exc
                break
        if error is not None:
            try:
                rounds.append(_round(world, FOLLOW_UP))
            except dmr.DmEnvRpcClientError as exc:
                after = exc
    finally:
        world.close(timeout=TIMEOUT)
    assert time.monotonic() - started < 10 * TIMEOUT  # bounded: nothing waited without end
    assert rounds[0] == (102, 102, 102 + OTHER)
    if mode in RIGHT:
        assert error is None and rounds == [(a, a, a + OTHER) for a in ROUNDS]
        return
    if mode == "duplicated":  # shifted by one for agent 0 until the extra answer is seen
        assert all(echo - sent in (0, -1) for sent, echo, _ in rounds), rounds
        assert all(other == sent + OTHER for sent, _, other in rounds), rounds
        if error is not None:  # seen in time (else only on a later read, or on close)
            assert "World 0 (agent agent_0)" in str(error) and "no request pending" in str(error)
        return
    assert isinstance(error, dmr.WorldError), repr(error)
    assert str(error).startswith("World 0 (agent agent_0) at "), str(error)
    if mode in GOES_ON:
        assert after is None
        assert rounds == [(102, 102, 102 + OTHER), (FOLLOW_UP, FOLLOW_UP, FOLLOW_UP + OTHER)]
        return
    assert isinstance(error, dmr.WorldTimeoutError) == (mode in TIMES_OUT), repr(error)
    assert isinstance(after, dmr.WorldError) and "failed before" in str(after), repr(after)
    assert [f.outcome for f in world.batch.failures][:1] == ["raised"]
