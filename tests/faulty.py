"""Faulty dm_env_rpc servers for error paths: a raw gRPC handler answers each request as told.

``faulty_server(answer)`` serves ``answer(request) -> EnvironmentResponse`` on a
loopback port (a plain ``grpc.server``, default options, like any foreign
server). ``Counter`` is a dm_env whose observation is the number of steps it
took, and which waits at a gate when told, so a test can tell which request a
response answers.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import dm_env
import grpc
import numpy as np
from dm_env import specs as dm_specs

from dm_env_rpc_client._proto import dm_env_rpc_pb2

METHOD = "/dm_env_rpc.v1.Environment/Process"
Answer = Callable[[dm_env_rpc_pb2.EnvironmentRequest], dm_env_rpc_pb2.EnvironmentResponse]


@contextlib.contextmanager
def faulty_server(answer: Answer, options: Any = None) -> Iterator[str]:
    """Serves ``answer`` for every request of every stream; yields the address."""

    def process(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for request in requests:
            yield answer(request)

    with process_server(process, options) as address:
        yield address


@contextlib.contextmanager
def process_server(process: Any, options: Any = None, max_workers: int = 8) -> Iterator[str]:
    """Serves ``process(requests, context)``, a generator of responses, as the Process method
    of each stream, with ``max_workers`` threads; yields the address."""
    handler = grpc.method_handlers_generic_handler(
        "dm_env_rpc.v1.Environment",
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                process,
                request_deserializer=dm_env_rpc_pb2.EnvironmentRequest.FromString,
                response_serializer=dm_env_rpc_pb2.EnvironmentResponse.SerializeToString,
            )
        },
    )
    with serving(
        lambda server: server.add_generic_rpc_handlers((handler,)), options, max_workers
    ) as address:
        yield address


@contextlib.contextmanager
def reference_servicer_server(servicer: Any, max_workers: int = 8) -> Iterator[str]:
    """Serves a reference-package ``EnvironmentServicer`` (default gRPC server options);
    yields the address."""
    from dm_env_rpc.v1 import dm_env_rpc_pb2_grpc

    def add(server: grpc.Server) -> None:
        dm_env_rpc_pb2_grpc.add_EnvironmentServicer_to_server(servicer, server)

    with serving(add, None, max_workers) as address:
        yield address


@contextlib.contextmanager
def serving(
    add: Callable[[grpc.Server], None], options: Any = None, max_workers: int = 8
) -> Iterator[str]:
    """A ``grpc.server`` on a loopback port with ``add(server)``'s handlers, stopped at the
    end; yields the address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(5)


def float_specs(shape: tuple[int, ...] = (2,)) -> dm_env_rpc_pb2.ActionObservationSpecs:
    """Specs with no action and one float32 observation ``x`` (UID 1) of ``shape``."""
    spec = dm_env_rpc_pb2.TensorSpec(name="x", shape=list(shape), dtype=dm_env_rpc_pb2.FLOAT)
    return dm_env_rpc_pb2.ActionObservationSpecs(observations={1: spec})


def lifecycle(
    request: dm_env_rpc_pb2.EnvironmentRequest, specs: dm_env_rpc_pb2.ActionObservationSpecs
) -> dm_env_rpc_pb2.EnvironmentResponse | None:
    """The ordinary answer to a lifecycle request; None for a step."""
    kind = request.WhichOneof("payload")
    if kind == "create_world":
        return dm_env_rpc_pb2.EnvironmentResponse(
            create_world=dm_env_rpc_pb2.CreateWorldResponse(world_name="w")
        )
    if kind == "join_world":
        return dm_env_rpc_pb2.EnvironmentResponse(
            join_world=dm_env_rpc_pb2.JoinWorldResponse(specs=specs)
        )
    if kind == "reset":
        return dm_env_rpc_pb2.EnvironmentResponse(reset=dm_env_rpc_pb2.ResetResponse(specs=specs))
    if kind == "step":
        return None
    response = dm_env_rpc_pb2.EnvironmentResponse()
    getattr(response, kind).SetInParent()
    return response


def refusing_leave(specs: dm_env_rpc_pb2.ActionObservationSpecs, seen: list[str]) -> Answer:
    """An ``answer`` that refuses every LeaveWorldRequest (INTERNAL, "cannot leave"),
    answers the rest as ``lifecycle`` does, and appends each request's kind to ``seen``."""

    def answer(request: dm_env_rpc_pb2.EnvironmentRequest) -> Any:
        kind = request.WhichOneof("payload")
        seen.append(kind)
        if kind == "leave_world":
            error = dm_env_rpc_pb2.EnvironmentResponse()
            error.error.code, error.error.message = 13, "cannot leave"
            return error
        return lifecycle(request, specs)

    return answer


def refusing_catch(settings: dict[str, Any]) -> dm_env.Environment:
    """Catch, until the file named by ``$DMR_TEST_REFUSE_FLAG`` exists (``serve --env``)."""
    from dm_env_rpc_client.server.catch import Catch

    flag = os.environ.get("DMR_TEST_REFUSE_FLAG")
    if flag and os.path.exists(flag):
        raise RuntimeError("this server makes no more worlds")
    return Catch(**settings)


def refusing_servers(
    server_process: Any, tmp_path: Any, monkeypatch: Any, count: int = 2
) -> tuple[Any, list[Any]]:
    """``count`` server processes of ``refusing_catch``, and the flag file that makes them refuse."""
    flag = tmp_path / "refuse"
    monkeypatch.setenv("DMR_TEST_REFUSE_FLAG", str(flag))  # refusing_catch reads it
    return flag, [server_process("tests.faulty:refusing_catch") for _ in range(count)]


class Counter(dm_env.Environment):
    """Observation ``count``: the steps taken so far. Step ``gate_at`` waits at ``gate``."""

    gate = threading.Event()
    gate_at = -1

    def __init__(self, **_: Any) -> None:
        self.count = 0

    def reset(self) -> dm_env.TimeStep:
        return dm_env.restart({"count": np.int64(self.count)})

    def step(self, action: Any) -> dm_env.TimeStep:
        self.count += 1
        if self.count == Counter.gate_at and not Counter.gate.wait(timeout=30):
            raise RuntimeError("the test never opened the gate")
        return dm_env.transition(0.0, {"count": np.int64(self.count)})

    def observation_spec(self) -> Any:
        return {"count": dm_specs.Array((), np.int64, name="count")}

    def action_spec(self) -> Any:
        return {"a": dm_specs.BoundedArray((), np.int8, 0, 1, name="a")}


def counting_server(refuse: int | None, delay: float) -> Any:
    """A faulty server whose step ``count`` observes ``x = [count, 0]`` (the reset's first step
    is count 1): count 9 ends an episode (TERMINATED), count ``refuse`` is refused
    (INVALID_ARGUMENT), and each step is answered after ``delay`` seconds."""
    specs = float_specs()
    count = [0]

    def answer(request: Any) -> Any:
        done = lifecycle(request, specs)
        if done is not None:
            return done
        count[0] += 1
        time.sleep(delay)  # the server's own pace, so that steps stay in flight
        if count[0] == refuse:
            refused = dm_env_rpc_pb2.EnvironmentResponse()
            refused.error.code, refused.error.message = 3, "refused step"
            return refused
        tensor = dm_env_rpc_pb2.Tensor(shape=[2])
        tensor.floats.array.extend([float(count[0]), 0.0])
        state = dm_env_rpc_pb2.TERMINATED if count[0] == 9 else dm_env_rpc_pb2.RUNNING
        step = dm_env_rpc_pb2.StepResponse(state=state, observations={1: tensor})
        return dm_env_rpc_pb2.EnvironmentResponse(step=step)

    return faulty_server(answer)


def two_step_specs() -> dm_env_rpc_pb2.ActionObservationSpecs:
    """``float_specs()`` and one action ``a``, an int8 in [0, 1] (UID 1)."""
    specs = float_specs()
    action = specs.actions[1]
    action.name, action.dtype = "a", dm_env_rpc_pb2.INT8
    action.min.int8s.array, action.max.int8s.array = b"\x00", b"\x01"
    return specs


@contextlib.contextmanager
def stalling_reset_server(stall_seed: int, stalled: list[float]) -> Iterator[str]:
    """A server of two-step episodes that never answers one autoreset step; yields its address.

    Each stream's world counts its steps from 1 and observes ``x = [count, seed]``
    (``seed``: its CreateWorldRequest's); an odd count starts an episode (RUNNING),
    an even one ends it (TERMINATED). The first step after the first LAST of the world
    created with ``seed == stall_seed`` (its reset step) gets no answer: its arrival
    time (``time.time()``) goes into ``stalled`` and the stream waits, at most 60 s,
    for the client to cancel it. Once per server: a world made again there steps on.
    """
    specs = two_step_specs()

    def process(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        seed, count = None, 0
        for request in requests:
            if request.WhichOneof("payload") == "create_world":
                seed = int(request.create_world.settings["seed"].int64s.array[0])
            done = lifecycle(request, specs)
            if done is not None:
                yield done
                continue
            count += 1
            if count == 3 and seed == stall_seed and not stalled:
                stalled.append(time.time())
                cancelled.wait(60)
                return
            tensor = dm_env_rpc_pb2.Tensor(shape=[2])
            tensor.floats.array.extend([float(count), float(seed or 0)])
            state = dm_env_rpc_pb2.RUNNING if count % 2 else dm_env_rpc_pb2.TERMINATED
            step = dm_env_rpc_pb2.StepResponse(state=state, observations={1: tensor})
            yield dm_env_rpc_pb2.EnvironmentResponse(step=step)

    with process_server(process) as address:
        yield address
