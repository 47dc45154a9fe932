"""An adversarial dm_env_rpc server: one misbehaviour per mode, and the client paths that meet it.

``adversary_server()`` serves, on a loopback port, a raw gRPC handler (``faulty.process_server``)
whose worlds echo each step's action: action ``a`` (UID 1, int32 ``[]``), observations ``echo``
(UID 1, int32 ``[]``: the ``a`` of the request answered, -1 without one) and ``x`` (UID 2, float32
``[2]``). A world's mode is its CreateWorld setting ``mode`` (a string, one of ``MODES``): the
stream's ``BAD_STEP``-th step (the reset's step is the first) gets that mode's misbehaviour,
every other request its ordinary answer. The echo shows which request an answer was for, so a
step matched to the wrong request cannot pass unseen. ``adversary_paths`` drives the client
paths against it; tests/test_adversary.py runs every mode through every path.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
from faulty import lifecycle, process_server

from dm_env_rpc_client._proto import dm_env_rpc_pb2 as pb

TIMEOUT = 0.6  # seconds: every request's timeout on every client path
SLOW = 0.1  # a slow answer: well within TIMEOUT
LATE = 0.9  # a late answer: past TIMEOUT, and within TIMEOUT of a request sent at TIMEOUT
BAD_STEP = 3  # the stream's step that misbehaves (the reset's step is 1)


def specs() -> pb.ActionObservationSpecs:
    """Action ``a`` int32 []; observations ``echo`` int32 [] and ``x`` float32 [2]."""
    return pb.ActionObservationSpecs(
        actions={1: pb.TensorSpec(name="a", shape=[], dtype=pb.INT32)},
        observations={
            1: pb.TensorSpec(name="echo", shape=[], dtype=pb.INT32),
            2: pb.TensorSpec(name="x", shape=[2], dtype=pb.FLOAT),
        },
    )


def _x(values: list[float], shape: list[int]) -> pb.Tensor:
    tensor = pb.Tensor(shape=shape)
    tensor.floats.array.extend(values)
    return tensor


def answer(echo: int, count: int) -> pb.EnvironmentResponse:
    """The ordinary answer to a stream's ``count``-th step, whose action was ``echo``."""
    observations = {1: pb.Tensor(shape=[], int32s=pb.Tensor.Int32Array(array=[echo]))}
    observations[2] = _x([float(count), 0.0], [2])
    return pb.EnvironmentResponse(step=pb.StepResponse(state=pb.RUNNING, observations=observations))


class Stream(NamedTuple):
    context: grpc.ServicerContext
    cancelled: threading.Event


def _with_x(good: pb.EnvironmentResponse, tensor: pb.Tensor) -> list[pb.EnvironmentResponse]:
    good.step.observations[2].CopyFrom(tensor)
    return [good]


def _doubles(good: pb.EnvironmentResponse) -> list[pb.EnvironmentResponse]:
    return _with_x(good, pb.Tensor(shape=[2], doubles=pb.Tensor.DoubleArray(array=[1.0, 2.0])))


def _unknown_uid(good: pb.EnvironmentResponse) -> list[pb.EnvironmentResponse]:
    good.step.observations[99].CopyFrom(good.step.observations[2])
    return [good]


def _missing_observation(good: pb.EnvironmentResponse) -> list[pb.EnvironmentResponse]:
    del good.step.observations[2]
    return [good]


def _undefined_state(good: pb.EnvironmentResponse) -> list[pb.EnvironmentResponse]:
    good.step.state = pb.INVALID_ENVIRONMENT_STATE
    return [good]


def _refused(code: int, message: str) -> list[pb.EnvironmentResponse]:
    refused = pb.EnvironmentResponse()
    refused.error.code, refused.error.message = code, message
    return [refused]


def _slow(good: pb.EnvironmentResponse, delay: float) -> list[pb.EnvironmentResponse]:
    time.sleep(delay)  # the server's own pace: the point of the mode
    return [good]


def _abort(stream: Stream) -> list[pb.EnvironmentResponse]:
    stream.context.abort(grpc.StatusCode.ABORTED, "adversary aborts the stream")
    return []  # not reached: abort raises


class Mode(NamedTuple):
    """A misbehaviour: ``respond(good answer, stream)`` gives the answers to send (None: end
    the stream there); ``what`` says what the server does, for the docs."""

    what: str
    respond: Callable[[pb.EnvironmentResponse, Stream], list[pb.EnvironmentResponse] | None]


def _stall(stream: Stream) -> None:
    stream.cancelled.wait(30)  # holds the stream open without an answer until the client goes


MODES: dict[str, Mode] = {
    "wrong-kind": Mode(
        "answers a step with a ResetResponse",
        lambda good, s: [pb.EnvironmentResponse(reset=pb.ResetResponse(specs=specs()))],
    ),
    "empty": Mode(
        "answers with an EnvironmentResponse of no payload",
        lambda good, s: [pb.EnvironmentResponse()],
    ),
    "duplicated": Mode("answers one step twice", lambda good, s: [good, good]),
    "missing": Mode("never answers one step, answers the later ones", lambda good, s: []),
    "long-payload": Mode(
        "`x` of shape [2] carries 3 floats", lambda good, s: _with_x(good, _x([1.0, 2.0, 3.0], [2]))
    ),
    "empty-tensor": Mode(
        "`x` has its shape [2] and no payload", lambda good, s: _with_x(good, pb.Tensor(shape=[2]))
    ),
    "wrong-dtype": Mode("`x` (float32) comes as doubles", lambda good, s: _doubles(good)),
    "wrong-shape": Mode(
        "`x` ([2]) comes as shape [3] with 3 floats",
        lambda good, s: _with_x(good, _x([1.0, 2.0, 3.0], [3])),
    ),
    "absurd-shape": Mode(
        "`x` declares shape [2**31 - 1, 2**31 - 1] over 2 floats",
        lambda good, s: _with_x(good, _x([1.0, 2.0], [2**31 - 1, 2**31 - 1])),
    ),
    "unknown-uid": Mode(
        "adds an observation of UID 99, not in the specs", lambda good, s: _unknown_uid(good)
    ),
    "missing-observation": Mode(
        "leaves out the requested `x`", lambda good, s: _missing_observation(good)
    ),
    "undefined-state": Mode(
        "answers state INVALID_ENVIRONMENT_STATE (0)", lambda good, s: _undefined_state(good)
    ),
    "odd-error-code": Mode(
        "refuses the step with a Status of code 99, outside gRPC's 0 to 16",
        lambda good, s: _refused(99, "adversary refuses this step"),
    ),
    "ok-error-code": Mode(
        "sends an error Status of code 0 (OK)",
        lambda good, s: _refused(0, "adversary errs with OK"),
    ),
    "closed": Mode("ends the stream (status OK) instead of answering", lambda good, s: None),
    "aborted": Mode("aborts the stream: ABORTED", lambda good, s: _abort(s)),
    "stalled": Mode("holds the stream open and never answers again", lambda good, s: _stall(s)),
    "slow": Mode(
        f"answers after {SLOW} s, within the {TIMEOUT} s timeout", lambda good, s: _slow(good, SLOW)
    ),
    "late": Mode(
        f"answers after {LATE} s, past the {TIMEOUT} s timeout", lambda good, s: _slow(good, LATE)
    ),
    "nan": Mode("`x` is [NaN, NaN]", lambda good, s: _with_x(good, _x([math.nan, math.nan], [2]))),
}


def _process(
    requests: Iterator[pb.EnvironmentRequest], context: grpc.ServicerContext
) -> Iterator[Any]:
    stream = Stream(context, threading.Event())
    context.add_callback(stream.cancelled.set)
    mode, count, world_specs = None, 0, specs()
    for request in requests:
        if request.WhichOneof("payload") == "create_world":
            mode = request.create_world.settings["mode"].strings.array[0]
        done = lifecycle(request, world_specs)
        if done is not None:
            yield done
            continue
        count += 1
        actions = request.step.actions
        good = answer(actions[1].int32s.array[0] if 1 in actions else -1, count)
        if count != BAD_STEP or mode is None:
            yield good
            continue
        answers = MODES[mode].respond(good, stream)
        if answers is None:
            return
        yield from answers


@contextlib.contextmanager
def adversary_server() -> Iterator[str]:
    """Serves the adversary on a loopback port; yields its address."""
    with process_server(_process, max_workers=32) as address:
        yield address
