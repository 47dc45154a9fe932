"""The checks behind ``conformance.check_server``: each drives a server over streams of its own.

``run_checks(probe, latency_steps, episode_steps)`` returns ``{rule: (status,
detail)}`` for every rule of ``RULES`` and the step latency. A check records a
failure as soon as it sees one; a rule it could not reach is skipped with the
reason. Every request waits at most ``probe.timeout`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import errors, tensors
from .._codec.bounds import bounds
from .._codec.dtypes import DATA_TYPE_TO_NUMPY
from .._proto import dm_env_rpc_pb2 as pb
from ..connection import Connection
from .conformance_multiagent import check_multiagent
from .conformance_probe import (
    ENDED,
    RULES,
    STATE,
    UNKNOWN_WORLD,
    Actions,
    NoWorld,
    Probe,
    Verdict,
    check_specs,
    observations_ok,
    state_name,
    uid_not_in,
)

_PIPELINE_DEPTH = 16
_MULTI_CLIENT_STEPS = 4


def check_lifecycle(probe: Probe) -> None:
    """create, join, step, reset, reset world, leave, destroy; the specs; the observations."""
    with probe.stream() as conn:
        if probe.given_world is not None:
            name = probe.given_world
            for rule in ("lifecycle.create", "lifecycle.destroy"):
                probe.record(rule, "skip", f"the world {name!r} is given: not made here")
        else:
            created = probe.expect(
                "lifecycle.create", conn, pb.CreateWorldRequest(settings=probe.create_settings)
            )
            if created is None:
                return
            name = created.world_name
            probe.record("lifecycle.create", "pass", f"world {name!r}")
        join = pb.JoinWorldRequest(world_name=name, settings=probe.join_settings)
        joined = probe.expect("lifecycle.join", conn, join)
        if joined is None:
            probe.cleanup(conn, name)  # the world made for it goes: the next checks make theirs
            return
        specs = joined.specs
        probe.record(
            "lifecycle.join",
            "pass",
            f"{len(specs.actions)} actions, {len(specs.observations)} observations",
        )
        valid = check_specs(probe, specs)
        actions = Actions(specs, probe.rng)
        every = sorted(specs.observations)
        first = probe.expect("lifecycle.step", conn, pb.StepRequest(requested_observations=every))
        if first is None:
            probe.cleanup(conn, name)
            return
        if first.state != STATE.RUNNING:
            probe.record(
                "lifecycle.step",
                "fail",
                f"the first step answered {state_name(first.state)}, not RUNNING",
            )
        observed = observations_ok(probe, specs, valid, every, first)
        bare = probe.expect("step.observations", conn, actions.step())
        observed = observed and bare is not None and observations_ok(probe, specs, valid, (), bare)
        for _ in range(3):
            step = probe.expect("lifecycle.step", conn, actions.step(every))
            if step is None:
                probe.cleanup(conn, name)
                return
            if step.state not in (STATE.RUNNING, *ENDED):
                probe.record(
                    "lifecycle.step", "fail", f"a step answered state {state_name(step.state)}"
                )
            observed = observed and observations_ok(probe, specs, valid, every, step)
        probe.record("lifecycle.step", "pass", "5 steps")
        if observed:
            probe.record("step.observations", "pass", f"{len(every)} observations, 5 steps")
        reset = probe.expect("lifecycle.reset", conn, pb.ResetRequest())
        if reset is not None:
            if reset.specs != specs:
                probe.record("lifecycle.reset", "fail", "its specs differ from JoinWorld's")
            after = probe.expect("lifecycle.reset", conn, actions.step())
            if after is not None and after.state != STATE.RUNNING:
                probe.record(
                    "lifecycle.reset",
                    "fail",
                    f"the step after it answered {state_name(after.state)}, not RUNNING",
                )
            probe.record("lifecycle.reset", "pass")
        reset_world = pb.ResetWorldRequest(world_name=name)
        if (
            probe.expect("lifecycle.reset-world", conn, reset_world) is not None
            and probe.expect("lifecycle.reset-world", conn, actions.step()) is not None
        ):
            probe.record("lifecycle.reset-world", "pass")
        if probe.expect("lifecycle.leave", conn, pb.LeaveWorldRequest()) is None:
            probe.record("lifecycle.destroy", "skip", "needs a world left: LeaveWorld failed")
            return
        probe.record("lifecycle.leave", "pass")
        destroy = pb.DestroyWorldRequest(world_name=name)
        if probe.given_world is None and probe.expect("lifecycle.destroy", conn, destroy):
            probe.record("lifecycle.destroy", "pass")


def _joined(
    check: Callable[[Probe, Connection, pb.ActionObservationSpecs], None], *rules: str
) -> Callable[[Probe], None]:
    """A check run on a new stream joined to a new world; ``rules`` skip if there is none."""

    def run(probe: Probe) -> None:
        with probe.stream() as conn:
            try:
                name, specs = probe.world(conn)
            except NoWorld as exc:
                for rule in rules:
                    probe.record(rule, "skip", str(exc))
                return
            try:
                check(probe, conn, specs)
            finally:
                probe.cleanup(conn, name)

    return run


def _first_ignores_actions(probe: Probe, conn: Connection, specs: Any) -> None:
    bogus = pb.StepRequest(actions={uid_not_in(specs.actions): tensors.pack_tensor(0)})
    step = probe.expect("step.first-ignores-actions", conn, bogus)
    if step is not None:
        probe.record("step.first-ignores-actions", "pass")


def _pipeline(probe: Probe, conn: Connection, specs: Any) -> None:
    actions = Actions(specs, probe.rng)
    every = sorted(specs.observations)
    probe.send(conn, pb.StepRequest())
    plan: list[Any] = []
    for index in range(_PIPELINE_DEPTH):
        kind = index % 4
        plan.append(
            pb.ResetRequest() if kind == 3 else actions.step(every[: len(every) * kind // 2])
        )
    futures = [conn.send_async(request) for request in plan]
    deadline = time.monotonic() + probe.timeout
    for index, (request, future) in enumerate(zip(plan, futures, strict=True)):
        what = f"answer {index + 1} of {len(plan)} (to a {type(request).__name__})"
        try:
            response = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            probe.broken.add(id(conn))
            probe.record("pipeline.order", "fail", f"{what}: no answer within {probe.timeout:g} s")
            return
        except errors.DmEnvRpcClientError as exc:
            probe.record("pipeline.order", "fail", f"{what}: {probe.describe(exc)}")
            return
        if isinstance(request, pb.StepRequest):
            asked = sorted(request.requested_observations)
            if sorted(response.observations) != asked:
                probe.record(
                    "pipeline.order",
                    "fail",
                    f"{what} carried observations {sorted(response.observations)}, asked {asked}",
                )
                return
    probe.record("pipeline.order", "pass", f"{len(plan)} requests in flight, steps and resets")


def _bad_request(
    probe: Probe, rule: str, conn: Connection, request: Any, follow_up: Any, survivors: list[str]
) -> None:
    """``request`` must be answered with an error status; then ``follow_up`` must be answered."""
    try:
        probe.send(conn, request)
    except errors.DmEnvRpcError as exc:
        probe.record(rule, "pass", probe.describe(exc))
    except errors.DmEnvRpcClientError as exc:
        probe.record(rule, "fail", f"instead of an error status: {probe.describe(exc)}")
        return
    else:
        probe.record(rule, "fail", f"the server accepted it (a {type(request).__name__} answer)")
        return
    try:
        probe.send(conn, follow_up)
    except errors.DmEnvRpcError:
        pass  # an answer, and a refusal is the server's right
    except errors.DmEnvRpcClientError as exc:
        probe.record(
            "errors.stream-survives",
            "fail",
            f"after the error answer of {rule}, a {type(follow_up).__name__}: "
            f"{probe.describe(exc)}",
        )
        return
    survivors.append(rule)


def check_errors(probe: Probe) -> None:
    """The ``errors.*`` rules, each on a new stream."""
    survivors: list[str] = []
    unjoined = (
        ("errors.step-before-join", pb.StepRequest()),
        ("errors.reset-before-join", pb.ResetRequest()),
        ("errors.unknown-world", pb.JoinWorldRequest(world_name=UNKNOWN_WORLD)),
    )
    for rule, request in unjoined:
        with probe.stream() as conn:
            _bad_request(probe, rule, conn, request, pb.LeaveWorldRequest(), survivors)

    def unknown_uid(probe: Probe, conn: Connection, specs: Any) -> None:
        actions = Actions(specs, probe.rng)
        probe.send(conn, pb.StepRequest())
        bogus = pb.StepRequest(actions={uid_not_in(specs.actions): tensors.pack_tensor(0)})
        _bad_request(probe, "errors.unknown-uid", conn, bogus, actions.step(), survivors)

    def wrong_dtype(probe: Probe, conn: Connection, specs: Any) -> None:
        actions = Actions(specs, probe.rng)
        numeric = [
            (uid, spec)
            for uid, spec in sorted(actions.specs.items())
            if DATA_TYPE_TO_NUMPY[spec.dtype].kind in "iuf"
        ]
        if not numeric:
            probe.record("errors.wrong-dtype", "skip", "the world has no numeric action")
            return
        uid, spec = numeric[0]
        low = bounds(spec).min
        shape = [1 if dim < 0 else dim for dim in spec.shape]
        wrong = np.float32 if spec.dtype == pb.DataType.DOUBLE else np.float64
        value = np.full(shape, np.max(low) if np.isfinite(np.max(low)) else 0, dtype=wrong)
        probe.send(conn, pb.StepRequest())
        request = pb.StepRequest(actions={uid: tensors.pack_tensor(value)})
        _bad_request(probe, "errors.wrong-dtype", conn, request, actions.step(), survivors)

    for check, rule in ((unknown_uid, "errors.unknown-uid"), (wrong_dtype, "errors.wrong-dtype")):
        try:
            _joined(check, rule)(probe)
        except errors.DmEnvRpcClientError as exc:  # the first step failed: not this rule's
            probe.record(rule, "skip", f"the first step failed ({probe.describe(exc)})")
    if survivors:
        probe.record("errors.stream-survives", "pass", f"after {', '.join(survivors)}")


def check_two_clients(probe: Probe) -> None:
    """Two streams at once, each with a world of its own, stepped in turn."""
    rule = "multi-client.concurrent"
    with probe.stream() as first:
        try:
            name_a, specs_a = probe.world(first)
        except NoWorld as exc:
            probe.record(rule, "skip", str(exc))
            return
        try:
            with probe.stream() as second:
                try:
                    name_b, specs_b = probe.world(second)
                except NoWorld as exc:
                    cause = exc.__cause__
                    if isinstance(cause, errors.DmEnvRpcError):
                        probe.record(rule, "skip", f"the server refused a second client: {cause}")
                    else:
                        probe.record(rule, "fail", f"the second client: {exc}")
                    return
                try:
                    pairs = [
                        (first, Actions(specs_a, probe.rng)),
                        (second, Actions(specs_b, probe.rng)),
                    ]
                    for turn in range(_MULTI_CLIENT_STEPS + 1):
                        for index, (conn, actions) in enumerate(pairs):
                            request = actions.step() if turn else pb.StepRequest()
                            if probe.expect(rule, conn, request) is None:
                                who = ("first", "second")[index]
                                probe.record(
                                    rule, "fail", f"the {who} client's step {turn + 1} failed"
                                )
                                return
                    probe.record(rule, "pass", f"{_MULTI_CLIENT_STEPS + 1} steps each, in turn")
                finally:
                    probe.cleanup(second, name_b)
        finally:
            probe.cleanup(first, name_a)


def _episodes(probe: Probe, conn: Connection, specs: Any, episode_steps: int) -> None:
    rule = "episodes.first-after-last"
    actions = Actions(specs, probe.rng)
    probe.send(conn, pb.StepRequest())
    deadline = time.monotonic() + 4 * probe.timeout
    for count in range(1, episode_steps + 1):
        step = probe.send(conn, actions.step())
        if step.state in ENDED:
            after = probe.send(conn, actions.step())
            if after.state != STATE.RUNNING:
                probe.record(
                    rule,
                    "fail",
                    f"after {state_name(step.state)} (step {count}) the next step answered "
                    f"{state_name(after.state)}, not RUNNING",
                )
            else:
                probe.record(rule, "pass", f"an episode ended at step {count}")
            return
        if time.monotonic() > deadline:
            break
    probe.record(rule, "skip", f"no episode ended within {count} steps")


def _latency(probe: Probe, conn: Connection, specs: Any, latency_steps: int) -> dict[str, float]:
    actions = Actions(specs, probe.rng)
    every = sorted(specs.observations)
    requests = [actions.step(every) for _ in range(latency_steps)]
    probe.send(conn, pb.StepRequest())
    times = []
    for index, request in enumerate(requests):
        started = time.perf_counter()
        if probe.expect("latency.step", conn, request) is None:
            probe.record("latency.step", "fail", f"step {index + 1} of {latency_steps} failed")
            return {}
        times.append(time.perf_counter() - started)
    p50, p99 = (float(np.percentile(times, q)) * 1e3 for q in (50, 99))
    probe.record(
        "latency.step",
        "pass",
        f"p50 {p50:.3f} ms, p99 {p99:.3f} ms over {latency_steps} steps, one at a time",
    )
    return {"p50_ms": p50, "p99_ms": p99, "steps": latency_steps}


def run_checks(
    probe: Probe, latency_steps: int, episode_steps: int
) -> tuple[dict[str, Verdict], dict[str, float]]:
    """Runs every check; returns the verdicts of all ``RULES`` and the step latency."""
    try:
        with probe.stream():
            probe.record("connect", "pass")
    except errors.DmEnvRpcClientError as exc:
        probe.record("connect", "fail", str(exc))
        reason = "no stream to the server"
        return {rule: probe.verdicts.get(rule, ("skip", reason)) for rule in RULES}, {}
    latency: dict[str, float] = {}

    def episodes(probe: Probe, conn: Connection, specs: Any) -> None:
        _episodes(probe, conn, specs, episode_steps)

    def timed(probe: Probe, conn: Connection, specs: Any) -> None:
        latency.update(_latency(probe, conn, specs, latency_steps))

    def rules(*prefixes: str) -> tuple[str, ...]:
        return tuple(rule for rule in RULES if rule.startswith(prefixes))

    checks: list[tuple[Callable[[Probe], None], tuple[str, ...]]] = [
        (check_lifecycle, rules("lifecycle.", "specs.", "step.observations")),
        (_joined(_first_ignores_actions, "step.first-ignores-actions"), rules("step.first")),
        (_joined(_pipeline, "pipeline.order"), rules("pipeline.")),
        (check_errors, rules("errors.")),
        (check_two_clients, rules("multi-client.")),
        (check_multiagent, rules("multi-agent.")),
        (_joined(episodes, "episodes.first-after-last"), rules("episodes.")),
        (_joined(timed, "latency.step"), rules("latency.")),
    ]
    for check, covered in checks:
        try:
            check(probe)
        except errors.DmEnvRpcClientError as exc:  # e.g. no new stream, or a first step failed
            for rule in covered:
                if rule not in probe.verdicts:
                    probe.record(rule, "fail", probe.describe(exc))
    reason = "not reached: an earlier request of its check failed (see above)"
    return {rule: probe.verdicts.get(rule, ("skip", reason)) for rule in RULES}, latency
