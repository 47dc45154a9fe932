"""The ``multi-agent.*`` conformance checks: two agents in one world, and the reference's rules.

``check_multiagent(probe)`` makes a world on a third stream (the "matchmaker",
unless ``probe.given_world`` names one), joins it on two more streams, and
checks, in this order:

- ``multi-agent.join``: both joins answer specs; both first steps, in flight
  together (a lockstep server answers neither until both are in), answer RUNNING;
- ``multi-agent.reset-world``: after a ResetWorld from the matchmaker, both
  agents' next steps answer INTERRUPTED and the steps after them RUNNING. The
  reference lets a server hold the ResetWorld answer until the agents have
  stepped: if it has not answered within a second, the steps are sent anyway;
- ``multi-agent.leave``: after the second agent leaves, the first one's steps
  are still answered (a lockstep server no longer waits for it);
- ``multi-agent.destroy-joined``: a DestroyWorld from the first agent's stream
  (still joined) is answered with an error status.

A server that refuses the second join with an error status serves one agent per
world: every rule of the group is skipped, with that refusal as the reason. So
is a server that could not serve two clients at once (``multi-client.concurrent``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from typing import Any

from .. import errors
from .._proto import dm_env_rpc_pb2 as pb
from ..connection import Connection
from .conformance_probe import RULES, STATE, Actions, Probe, state_name

GROUP = tuple(rule for rule in RULES if rule.startswith("multi-agent."))
_RESET_WORLD_GRACE = 1.0  # seconds a ResetWorld answer is awaited before the agents step
_LEAVE_STEPS = 3


def _skip_all(probe: Probe, reason: str, rules: tuple[str, ...] = GROUP) -> None:
    for rule in rules:
        probe.record(rule, "skip", reason)


def _together(probe: Probe, sends: list[tuple[Connection, Any]]) -> list[Any] | str:
    """Sends every request at once; their answers, or what went wrong (a sentence)."""
    futures = [conn.send_async(request) for conn, request in sends]
    deadline = time.monotonic() + probe.timeout
    answers = []
    for index, ((conn, request), future) in enumerate(zip(sends, futures, strict=True)):
        who = f"agent {index + 1}'s {type(request).__name__}"
        try:
            answers.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            probe.broken.add(id(conn))
            return f"{who}: no answer within {probe.timeout:g} s"
        except errors.DmEnvRpcClientError as exc:
            return f"{who}: {probe.describe(exc)}"
    return answers


def _states(answers: list[Any]) -> str:
    return ", ".join(state_name(answer.state) for answer in answers)


def _join(probe: Probe, conns: list[Connection], name: str) -> list[Actions] | None:
    """``multi-agent.join``; the agents' random actions, or None (the group is settled)."""
    join = pb.JoinWorldRequest(world_name=name, settings=probe.join_settings)
    try:
        first = probe.send(conns[0], join)
    except errors.DmEnvRpcClientError as exc:
        _skip_all(probe, f"could not join a world to check it on ({probe.describe(exc)})")
        return None
    try:
        second = probe.send(conns[1], join)
    except errors.DmEnvRpcError as exc:
        reason = f"one agent per world: a second JoinWorld of {name!r} was refused ({exc})"
        _skip_all(probe, reason)
        return None
    except errors.DmEnvRpcClientError as exc:
        probe.record("multi-agent.join", "fail", f"the second JoinWorld: {probe.describe(exc)}")
        _skip_all(probe, "needs two agents joined (multi-agent.join failed)", GROUP[1:])
        return None
    actions = [Actions(first.specs, probe.rng), Actions(second.specs, probe.rng)]
    answers = _together(probe, [(conn, pb.StepRequest()) for conn in conns])
    problem = answers if isinstance(answers, str) else None
    if isinstance(answers, list) and any(a.state != STATE.RUNNING for a in answers):
        problem = f"the first steps answered {_states(answers)}, not RUNNING, RUNNING"
    if problem is not None:
        probe.record("multi-agent.join", "fail", problem)
        _skip_all(probe, "needs two agents stepping (multi-agent.join failed)", GROUP[1:])
        return None
    probe.record("multi-agent.join", "pass", "two agents joined; first steps sent together")
    return actions


def _reset_world(
    probe: Probe, host: Connection, conns: list[Connection], actions: list[Actions], name: str
) -> None:
    rule = "multi-agent.reset-world"
    reset = host.send_async(pb.ResetWorldRequest(world_name=name))
    answered = True
    try:
        reset.result(timeout=min(probe.timeout, _RESET_WORLD_GRACE))
    except concurrent.futures.TimeoutError:
        answered = False  # the server may hold it until the agents have stepped
    except errors.DmEnvRpcClientError as exc:
        probe.record(rule, "skip", f"ResetWorld failed ({probe.describe(exc)}): see lifecycle.*")
        return
    steps = [(conn, agent.step()) for conn, agent in zip(conns, actions, strict=True)]
    interrupted = _together(probe, steps)
    if not answered:
        try:
            reset.result(timeout=probe.timeout)
        except concurrent.futures.TimeoutError:
            probe.broken.add(id(host))
            probe.record(rule, "fail", f"ResetWorld: no answer within {probe.timeout:g} s")
            return
        except errors.DmEnvRpcClientError as exc:
            probe.record(rule, "fail", f"ResetWorld: {probe.describe(exc)}")
            return
    if isinstance(interrupted, str):
        probe.record(rule, "fail", f"after ResetWorld, {interrupted}")
        return
    if any(answer.state != STATE.INTERRUPTED for answer in interrupted):
        seen = _states(interrupted)
        probe.record(rule, "fail", f"after ResetWorld the steps answered {seen}, not INTERRUPTED")
        return
    steps = [(conn, agent.step()) for conn, agent in zip(conns, actions, strict=True)]
    restarted = _together(probe, steps)
    if isinstance(restarted, str):
        probe.record(rule, "fail", f"after INTERRUPTED, {restarted}")
    elif any(answer.state != STATE.RUNNING for answer in restarted):
        seen = _states(restarted)
        probe.record(rule, "fail", f"after INTERRUPTED the steps answered {seen}, not RUNNING")
    else:
        probe.record(rule, "pass", "both agents INTERRUPTED, then RUNNING")


def _leave(probe: Probe, conns: list[Connection], actions: list[Actions]) -> None:
    """``multi-agent.leave``."""
    rule = "multi-agent.leave"
    try:
        probe.send(conns[1], pb.LeaveWorldRequest())
    except errors.DmEnvRpcClientError as exc:
        probe.record(rule, "skip", f"LeaveWorld failed ({probe.describe(exc)}): see lifecycle.*")
        return
    for count in range(1, _LEAVE_STEPS + 1):
        answers = _together(probe, [(conns[0], actions[0].step())])
        if isinstance(answers, str):
            probe.record(rule, "fail", f"after agent 2 left, step {count} of {answers}")
            return
    probe.record(rule, "pass", f"{_LEAVE_STEPS} steps of the agent that stayed")


def _destroy_joined(probe: Probe, conn: Connection, name: str) -> None:
    rule = "multi-agent.destroy-joined"
    if id(conn) in probe.broken:
        probe.record(rule, "skip", "needs the first agent's stream, given up after a timeout")
        return
    try:
        probe.send(conn, pb.DestroyWorldRequest(world_name=name))
    except errors.DmEnvRpcError as exc:
        probe.record(rule, "pass", probe.describe(exc))
    except errors.DmEnvRpcClientError as exc:
        probe.record(rule, "fail", f"instead of an error status: {probe.describe(exc)}")
    else:
        probe.record(rule, "fail", f"the server destroyed {name!r} for a connection joined to it")


def check_multiagent(probe: Probe) -> None:
    """The ``multi-agent.*`` rules (see the module docstring)."""
    concurrent_clients = probe.verdicts.get("multi-client.concurrent", ("skip", ""))
    if concurrent_clients[0] == "fail":
        _skip_all(probe, "needs two clients served at once (multi-client.concurrent failed)")
        return
    with probe.stream() as host, probe.stream() as first, probe.stream() as second:
        name = probe.given_world
        if name is None:
            create = pb.CreateWorldRequest(settings=probe.create_settings)
            try:
                name = probe.send(host, create).world_name
            except errors.DmEnvRpcClientError as exc:
                _skip_all(probe, f"could not create a world ({probe.describe(exc)})")
                return
        conns = [first, second]
        try:
            actions = _join(probe, conns, name)
            if actions is None:
                return
            _reset_world(probe, host, conns, actions, name)
            _leave(probe, conns, actions)
            _destroy_joined(probe, first, name)
        finally:
            for conn in (first, second):
                with contextlib.suppress(errors.DmEnvRpcClientError):
                    probe.send(conn, pb.LeaveWorldRequest())
            if probe.given_world is None:
                with contextlib.suppress(errors.DmEnvRpcClientError):
                    probe.send(host, pb.DestroyWorldRequest(world_name=name))
