"""The client paths run against the adversary (tests/adversary.py), what each must get, and the
table of it in docs/faults.md.

Each of ``PATHS`` drives one world (two for the batch) through one client path: reset, then a
step for each of ``ACTIONS``; after the first error one more step (``FOLLOW_UP``), which shows
whether the stream goes on with right answers or fails with a named error; then it closes.
Every wait is bounded by ``adversary.TIMEOUT`` (asyncio also by ``asyncio.wait_for``). A path
catches only the SDK's own errors (``dmr.DmEnvRpcClientError``): anything else is raised, and
fails the test. It returns an ``Outcome``.

``EXPECTED[mode][path]`` is an ``Expect``; ``table()`` renders them as docs/faults.md's table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from adversary import MODES, TIMEOUT

import dm_env_rpc_client as dmr

ACTIONS = (102, 103, 104, 105)  # the steps after the reset's; 103 meets the misbehaviour
FOLLOW_UP = 999
WORLDS = {"batched": 2}  # worlds per path (default 1)


class Outcome(NamedTuple):
    """What a path got: its first error, the follow-up step's error, the close's error, the
    ``(sent, echoed)`` action of every TimeStep, and each TimeStep's ``x``."""

    error: BaseException | None
    after: BaseException | None
    closing: BaseException | None
    pairs: list[tuple[int, int]]
    xs: list[Any]


class _Run:
    """Collects one path's TimeSteps and errors."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.after: BaseException | None = None
        self.closing: BaseException | None = None
        self.pairs: list[tuple[int, int]] = []
        self.xs: list[Any] = []

    def got(self, timestep: Any, sent: int) -> None:
        self.pairs.append((sent, int(timestep.observation["echo"])))
        self.xs.append(timestep.observation["x"])

    def failed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def each(self, step: Callable[[int], None]) -> None:
        """``step(sent)`` for each of ``ACTIONS`` until one fails."""
        for sent in ACTIONS:
            try:
                step(sent)
            except dmr.DmEnvRpcClientError as exc:
                self.failed(exc)
                break

    def follow_up(self, step: Callable[[int], None]) -> None:
        """After an error, ``step(FOLLOW_UP)``; its error goes into ``after``."""
        if self.error is not None:
            try:
                step(FOLLOW_UP)
            except dmr.DmEnvRpcClientError as exc:
                self.after = exc

    def close(self, close: Callable[[], None]) -> None:
        try:
            close()
        except dmr.DmEnvRpcClientError as exc:
            self.closing = exc

    def outcome(self) -> Outcome:
        return Outcome(self.error, self.after, self.closing, self.pairs, self.xs)


def _adaptor_path(
    address: str,
    mode: str,
    steps: Callable[[dmr.DmEnvAdaptor, _Run], None],
    one_step: Callable[[dmr.DmEnvAdaptor, int], Any],
) -> Outcome:
    """A sync adaptor's path: ``steps(env, run)`` after the reset, then ``one_step`` as the
    follow-up step."""
    run = _Run()
    with dmr.connect(address, timeout=5) as conn:
        env, _ = dmr.create_and_join_world(conn, {"mode": mode}, {}, timeout=TIMEOUT)
        env.reset()
        steps(env, run)
        run.follow_up(lambda sent: run.got(one_step(env, sent), sent))
        run.close(env.close)
    return run.outcome()


def _step(env: dmr.DmEnvAdaptor, sent: int) -> Any:
    return env.step({"a": np.int32(sent)})


def lockstep(address: str, mode: str) -> Outcome:
    def steps(env: dmr.DmEnvAdaptor, run: _Run) -> None:
        run.each(lambda sent: run.got(_step(env, sent), sent))

    return _adaptor_path(address, mode, steps, _step)


def step_iter(address: str, mode: str) -> Outcome:
    def steps(env: dmr.DmEnvAdaptor, run: _Run) -> None:
        sent = iter(ACTIONS)
        try:
            for timestep in env.step_iter(({"a": np.int32(a)} for a in ACTIONS), in_flight=4):
                run.got(timestep, next(sent))
        except dmr.DmEnvRpcClientError as exc:
            run.failed(exc)

    return _adaptor_path(address, mode, steps, _step)


def step_async(address: str, mode: str) -> Outcome:
    def steps(env: dmr.DmEnvAdaptor, run: _Run) -> None:
        futures = [(a, env.step_async({"a": np.int32(a)})) for a in ACTIONS]
        for sent, future in futures:  # every Future: the good ones after an error too
            try:
                run.got(future.result(timeout=TIMEOUT), sent)
            except dmr.DmEnvRpcClientError as exc:
                run.failed(exc)

    def one_step(env: dmr.DmEnvAdaptor, sent: int) -> Any:
        return env.step_async({"a": np.int32(sent)}).result(timeout=TIMEOUT)

    return _adaptor_path(address, mode, steps, one_step)


def batched(address: str, mode: str) -> Outcome:
    run = _Run()
    with dmr.BatchedEnvironment.connect(
        [address],
        WORLDS["batched"],
        create_world_settings={"mode": mode},
        timeout=TIMEOUT,
        step_timeout=TIMEOUT,
    ) as envs:
        envs.reset()

        def step(sent: int) -> None:
            actions = {"a": np.full(len(envs.live_ids), sent, np.int32)}
            batch = envs.step(actions, timeout=TIMEOUT)
            for index in range(len(batch.env_ids)):
                run.pairs.append((sent, int(batch.observation["echo"][index])))
                run.xs.append(batch.observation["x"][index])

        run.each(step)
        run.follow_up(step)
        run.close(lambda: envs.close(timeout=TIMEOUT))
    return run.outcome()


def aio(address: str, mode: str) -> Outcome:
    run = _Run()

    async def main() -> None:
        env, _ = await dmr.create_and_join_world_async(address, {"mode": mode}, {}, timeout=TIMEOUT)
        try:
            await env.reset()
            for sent in ACTIONS:
                try:
                    run.got(await env.step({"a": np.int32(sent)}), sent)
                except dmr.DmEnvRpcClientError as exc:
                    run.failed(exc)
                    break
            if run.error is not None:
                try:
                    run.got(await env.step({"a": np.int32(FOLLOW_UP)}), FOLLOW_UP)
                except dmr.DmEnvRpcClientError as exc:
                    run.after = exc
        finally:
            try:
                await env.aclose()
            except dmr.DmEnvRpcClientError as exc:
                run.closing = exc

    asyncio.run(asyncio.wait_for(main(), 20))
    return run.outcome()


PATHS: dict[str, Callable[[str, str], Outcome]] = {
    "lockstep": lockstep,
    "step_iter": step_iter,
    "step_async": step_async,
    "batched": batched,
    "asyncio": aio,
}


# --- what each path must get ----------------------------------------------------------------

MARKS: dict[str, str] = {}  # a known defect's reason -> its note in docs/faults.md ("N1")


class Expect(NamedTuple):
    """What a path must get from a mode.

    ``error``: the error's class (None: the steps are accepted, all right); ``phrase``: a part of
    its message; ``cause``: for the batch, the class of the WorldError's ``__cause__``;
    ``shifted``: answers may come one request off (a server that drops or repeats an answer:
    dm_env_rpc matches answers to requests by order alone, so no client can tell);
    ``optional``: the error may not come at all (when it does, it is of ``error`` and has one
    of the ``|``-separated phrases); ``then``: the class of the follow-up step's error (None: it
    gets its own, right answer); ``defect``: a known defect of issue 37 makes it fail today.
    """

    error: type[BaseException] | None
    phrase: str = ""
    cause: type[BaseException] | None = None
    shifted: bool = False
    optional: bool = False
    then: type[BaseException] | None = None
    defect: str | None = None


_TIMED_OUT = Expect(dmr.RequestTimeoutError, "No response to the StepRequest request within")
_ASYNC_TIMED_OUT = Expect(dmr.RequestTimeoutError, "within")
_WORLD_TIMED_OUT = Expect(dmr.WorldTimeoutError, "no response within", dmr.RequestTimeoutError)
_DECODE = {
    "long-payload": "with shape [2] (2 elements) but a payload of 3 elements",
    "empty-tensor": "observation 'x' (UID 2) as no payload",
    "wrong-dtype": "observation 'x' (UID 2) as doubles (DOUBLE (float64)) but its spec says FLOAT",
    "wrong-shape": "observation 'x' (UID 2) with shape [3] but its spec says [2]",
    "absurd-shape": "with shape [2147483647, 2147483647] but its spec says [2]",
    "unknown-uid": "observation UID 99, which is not in the server's specs",
    "missing-observation": "lacks the requested observation 'x' (UID 2)",
}
_ONE_ANSWER = {  # the same on every path; the batch wraps it in a WorldError
    "wrong-kind": Expect(dmr.ProtocolError, "answered a step request with a reset response"),
    "empty": Expect(dmr.ProtocolError, "EnvironmentResponse with no payload for a step request"),
    **{mode: Expect(dmr.ObservationError, phrase) for mode, phrase in _DECODE.items()},
    "undefined-state": Expect(dmr.ProtocolError, "invalid state 0"),
    "odd-error-code": Expect(dmr.DmEnvRpcError, "adversary refuses this step"),
    "ok-error-code": Expect(dmr.DmEnvRpcError, "OK: adversary errs with OK"),
    "closed": Expect(dmr.ConnectionClosedError, "The server ended the stream (OK"),
    "aborted": Expect(dmr.ConnectionClosedError, "(ABORTED: adversary aborts the stream)"),
    "slow": Expect(None),
    "nan": Expect(None),
}
# The SDK's two findings of a stream out of step: an answer with no request pending, or of
# another kind than its request.
_OUT_OF_STEP = "no request pending|must come in request order"
_SHIFTED = Expect(dmr.DmEnvRpcClientError, _OUT_OF_STEP, shifted=True, optional=True)


def _expected() -> dict[str, dict[str, Expect]]:
    table: dict[str, dict[str, Expect]] = {}
    for mode in MODES:
        if mode in _ONE_ANSWER:
            one = _ONE_ANSWER[mode]
            world = one if one.error is None else Expect(dmr.WorldError, one.phrase, one.error)
            table[mode] = {path: one for path in PATHS} | {"batched": world}
    table["duplicated"] = dict.fromkeys(PATHS, _SHIFTED)
    table["missing"] = {
        "lockstep": _TIMED_OUT,
        "step_iter": Expect(dmr.RequestTimeoutError, "within", shifted=True),
        "step_async": _ASYNC_TIMED_OUT._replace(shifted=True),
        "batched": _WORLD_TIMED_OUT,
        "asyncio": _TIMED_OUT,
    }
    timed_out = {"step_async": _ASYNC_TIMED_OUT, "batched": _WORLD_TIMED_OUT}
    table["stalled"] = dict.fromkeys(PATHS, _TIMED_OUT) | timed_out
    # step_iter bounds each wait for its oldest step by the timeout, and a late answer comes
    # within the second wait: accepted, and right.
    table["late"] = dict.fromkeys(PATHS, _TIMED_OUT) | timed_out | {"step_iter": Expect(None)}
    return {mode: {path: _then(mode, path, table[mode][path]) for path in PATHS} for mode in MODES}


def _then(mode: str, path: str, expect: Expect) -> Expect:
    """``expect`` with what the step after its error gets: a failed world in a batch takes no
    more steps; a closed stream and a stalled or one-behind one fail every later request; after
    any other error the stream goes on, right."""
    if expect.error is None or expect.optional:
        return expect
    if path == "batched":
        return expect._replace(then=dmr.WorldError)
    if mode in ("closed", "aborted"):
        return expect._replace(then=dmr.ConnectionClosedError)
    if mode in ("stalled", "missing"):
        return expect._replace(then=dmr.RequestTimeoutError)
    return expect


EXPECTED = _expected()


def _cell(expect: Expect) -> str:
    if expect.error is None:
        text = "accepted, right"
    elif expect.optional:
        text = "shifted [S]"
    elif expect.shifted:
        text = f"shifted [S], then `{expect.error.__name__}`"
    elif expect.cause is not None:
        text = f"`{expect.error.__name__}` (`{expect.cause.__name__}`)"
    else:
        text = f"`{expect.error.__name__}`"
    return text + (f" [{MARKS[expect.defect]}]" if expect.defect else "")


def table() -> str:
    """The modes x paths table of docs/faults.md, from ``EXPECTED``, then its messages."""
    lines = [
        "| mode | the server | " + " | ".join(f"`{path}`" for path in PATHS) + " |",
        "|---|---|" + "---|" * len(PATHS),
    ]
    for mode, row in EXPECTED.items():
        cells = " | ".join(_cell(row[path]) for path in PATHS)
        lines.append(f"| `{mode}` | {MODES[mode].what} | {cells} |")
    lines += ["", "| mode | the error's message has |", "|---|---|"]
    for mode, row in EXPECTED.items():
        found = {e.phrase for e in row.values() if e.phrase and not e.optional}
        phrases = sorted(p for p in found if not any(p != q and p in q for q in found))
        if phrases:
            lines.append(f"| `{mode}` | " + "; ".join(f"`{p}`" for p in phrases) + " |")
    return "\n".join(lines) + "\n"
