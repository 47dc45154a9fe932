"""``BatchedEnvironment.reset``: resetting some or all of a batch's worlds at once.

``reset_each`` resets the worlds of ``env_ids`` and returns their FIRST steps;
on a batch's loop every world's ResetRequest goes out before any answer is
awaited (``_reset_pipelined``), so resetting costs two round trips, not two
per world. A world that fails does not stop the others.
"""

from __future__ import annotations

import time
from typing import Any

from .. import errors
from .._adaptor.stacked import BatchedTimeStep, batch_of
from .._proto import dm_env_rpc_pb2
from ..connection import wait_response
from .core import BatchCore
from .outcomes import _flagged


def reset_each(core: BatchCore, ids: list[int], timeout: float | None) -> BatchedTimeStep:
    """Resets every world of ``ids`` in turn; their FIRST steps in that order.

    A world that fails does not stop the others: the first failure is raised
    once all were tried, as a ``WorldError`` whose ``reset_steps`` holds the
    FIRST steps of the worlds that did reset (None if none did).
    """
    timesteps, done = [], []
    failed: tuple[int, errors.DmEnvRpcClientError] | None = None
    if core._runner is not None:  # every world's requests in flight at once
        answers = _reset_pipelined(core, ids, timeout)
    else:
        answers = {}
        for index in ids:
            try:
                answers[index] = core.envs[index].reset(timeout=timeout)
            except errors.DmEnvRpcClientError as exc:
                answers[index] = exc
    for index in ids:
        answer = answers[index]
        if isinstance(answer, errors.DmEnvRpcClientError):
            failed = failed or (index, answer)
        else:
            timesteps.append(answer)
            done.append(index)
    states = [core.envs[i]._last_state or 0 for i in done]  # RUNNING after a reset
    reset = _flagged(batch_of(timesteps, done), None, states) if done else None
    if failed is not None:
        error = core._wrap(*failed)
        error.reset_steps = reset
        raise error from failed[1]
    assert reset is not None  # ids is never empty
    return reset


def _reset_pipelined(core: BatchCore, ids: list[int], timeout: float | None) -> dict[int, Any]:
    """``DmEnvAdaptor.reset`` for every world of ``ids`` at once: their TimeSteps or errors.

    Every world's ResetRequest is sent before any answer is awaited, then
    every world's first step, so resetting takes two round trips, not two per
    world (the first steps wait for the resets: a reset may change the specs
    the step is made from). Each response is awaited ``timeout`` seconds
    (default: the adaptor's) from when it was sent.
    """
    outcome: dict[int, Any] = {}
    resets = {}
    request = dm_env_rpc_pb2.ResetRequest()
    for index in ids:
        env = core.envs[index]
        try:
            env._check_open()
            resets[index] = env.connection.send_async(request)
        except errors.DmEnvRpcClientError as exc:
            outcome[index] = exc
    started = time.monotonic()
    for index, future in resets.items():
        env = core.envs[index]
        wait = _remaining(started, env._timeout if timeout is None else timeout)
        try:
            env._reset_done(wait_response(future, wait, request))
        except errors.DmEnvRpcClientError as exc:
            outcome[index] = exc
    steps = {index: core.envs[index]._send_step({}) for index in resets if index not in outcome}
    started = time.monotonic()
    for index in list(steps):
        step, future = steps.pop(index)  # its answer's bytes go once decoded, not at the end
        env = core.envs[index]
        wait = _remaining(started, env._timeout if timeout is None else timeout)
        try:
            outcome[index] = env.step_response(wait_response(future, wait, step))
        except errors.RequestTimeoutError as exc:
            # As DmEnvAdaptor.step: its late answer still moves the state machine on.
            future.add_done_callback(env._advance_late)
            outcome[index] = exc
        except errors.DmEnvRpcClientError as exc:
            outcome[index] = exc
    return outcome


def _remaining(started: float, timeout: float | None) -> float | None:
    """What is left of ``timeout`` seconds from ``started`` (monotonic); None waits for ever."""
    return None if timeout is None else max(0.0, started + timeout - time.monotonic())
