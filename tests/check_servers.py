"""Servers for the conformance checker's tests: a raw-gRPC one that breaks one rule when told,
and a conforming one written on the reference ``dm-env-rpc`` package (test-only peer).

``raw_server(fault)`` serves worlds of a small game with a plain ``grpc.server`` and a
hand-written protocol state machine: one int8 action ``a`` in [0, 2]; observations ``x``
(float32[2], ``[count, 0]``) and ``count`` (int64); an episode TERMINATES at its 5th step.
With ``fault=None`` it keeps every rule; each fault in ``FAULTS`` breaks exactly the rule it
is named after. ``"one-world-at-a-time"`` refuses to create a world while another exists,
which the protocol allows. A world takes one agent: a second JoinWorld of a joined world
is refused (so the ``multi-agent.*`` rules are skipped; ``multiagent_check_servers`` has
the multi-agent servers).

``reference_server()`` serves Catch on the reference package's servicer, with its
``tensor_utils``, ``tensor_spec_utils`` and ``dm_env_utils`` (its specs written as
``bench/_lib/foreign_server.py`` writes them); nothing of this SDK's server.
It too takes one agent per world.
"""

from __future__ import annotations

import contextlib
import itertools
import pathlib
import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
from faulty import process_server, reference_servicer_server

from dm_env_rpc_client._proto import dm_env_rpc_pb2 as pb

EPISODE = 5
FAULTS = (
    "lifecycle.create",
    "lifecycle.join",
    "lifecycle.step",
    "lifecycle.reset",
    "lifecycle.reset-world",
    "lifecycle.leave",
    "lifecycle.destroy",
    "specs.unique-names",
    "specs.dtypes",
    "specs.shapes",
    "specs.bounds",
    "step.observations",
    "step.first-ignores-actions",
    "pipeline.order",
    "errors.step-before-join",
    "errors.reset-before-join",
    "errors.unknown-uid",
    "errors.wrong-dtype",
    "errors.unknown-world",
    "errors.stream-survives",
    "multi-client.concurrent",
    "episodes.first-after-last",
    "latency.step",
)
HANG_AFTER_STEPS = 20  # latency.step fault: a stream's later steps are never answered


def _specs(fault: str | None) -> pb.ActionObservationSpecs:
    action = pb.TensorSpec(name="a", dtype=pb.INT8)
    action.min.int8s.array = bytes([0])
    action.max.int8s.array = bytes([2])
    specs = pb.ActionObservationSpecs(
        actions={1: action},
        observations={
            2: pb.TensorSpec(name="x", shape=[2], dtype=pb.FLOAT),
            3: pb.TensorSpec(name="count", dtype=pb.INT64),
        },
    )
    if fault == "specs.unique-names":
        specs.observations[4].CopyFrom(pb.TensorSpec(name="x", shape=[2], dtype=pb.FLOAT))
    elif fault == "specs.dtypes":
        specs.actions[5].CopyFrom(pb.TensorSpec(name="broken", dtype=pb.INVALID_DATA_TYPE))
    elif fault == "specs.shapes":
        specs.observations[4].CopyFrom(pb.TensorSpec(name="grid", shape=[-1, -1], dtype=pb.FLOAT))
    elif fault == "specs.bounds":
        level = pb.TensorSpec(name="level", dtype=pb.INT32)
        level.min.int32s.array.append(5)
        level.max.int32s.array.append(1)
        specs.observations[4].CopyFrom(level)
    return specs


def _error(code: int, message: str) -> pb.EnvironmentResponse:
    response = pb.EnvironmentResponse()
    response.error.code, response.error.message = code, message
    return response


class _World:
    """The worlds of one server, shared by its streams."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.joined: dict[str, object] = {}  # world name -> the stream joined to it
        self.counter = itertools.count(1)
        self.lock = threading.Lock()


class _Stream:
    """One client's state: the world joined, whether the next step starts a sequence."""

    def __init__(self, worlds: _World, fault: str | None, context: grpc.ServicerContext) -> None:
        self.worlds, self.fault, self.specs = worlds, fault, _specs(fault)
        self.ended = threading.Event()  # set when the stream ends (cancelled, server stopped)
        context.add_callback(self.ended.set)
        context.add_callback(self.depart)
        self.joined: str | None = None
        self.first = True
        self.count = 0
        self.steps = 0  # on this stream, for the latency fault
        self.ended_twice = False

    def answer(self, request: pb.EnvironmentRequest) -> pb.EnvironmentResponse:
        kind = request.WhichOneof("payload")
        handler = getattr(self, f"_{kind}", None)
        if handler is None:
            return _error(12, f"{kind} is not supported")
        return handler(getattr(request, kind))

    def _create_world(self, request: Any) -> pb.EnvironmentResponse:
        if self.fault == "lifecycle.create":
            return _error(13, "cannot create worlds")
        with self.worlds.lock:
            if self.fault == "one-world-at-a-time" and self.worlds.names:
                return _error(8, "this server holds one world at a time")
            name = f"world-{next(self.worlds.counter)}"
            self.worlds.names.add(name)
        return pb.EnvironmentResponse(create_world=pb.CreateWorldResponse(world_name=name))

    def _join_world(self, request: Any) -> pb.EnvironmentResponse:
        if self.joined is not None:
            return _error(9, "already joined")
        if request.world_name not in self.worlds.names:
            if self.fault != "errors.unknown-world":
                return _error(5, f"no world {request.world_name!r}")
        elif self.fault == "lifecycle.join":
            return _error(13, "cannot join")
        refusal = self.enter(request.world_name)
        if refusal is not None:
            return refusal
        self.joined, self.first = request.world_name, True
        return pb.EnvironmentResponse(join_world=pb.JoinWorldResponse(specs=self.specs))

    def enter(self, world: str) -> pb.EnvironmentResponse | None:
        """Takes the world's one agent slot, or the refusal."""
        with self.worlds.lock:
            if self.worlds.joined.setdefault(world, self) is not self:
                return _error(9, f"world {world!r} is joined already: it takes one agent")
        return None

    def depart(self) -> None:
        """Frees the slot of the joined world (on LeaveWorld or the stream's end)."""
        with self.worlds.lock:
            if self.joined is not None and self.worlds.joined.get(self.joined) is self:
                del self.worlds.joined[self.joined]

    def _check_actions(self, actions: Any) -> str | None:
        for uid, tensor in actions.items():
            if uid not in self.specs.actions:
                if self.fault != "errors.unknown-uid":
                    return f"unknown action UID {uid}"
                continue
            field = tensor.WhichOneof("payload")
            if field != "int8s" and self.fault != "errors.wrong-dtype":
                return f"action UID {uid} must be int8, not {field}"
        return None

    def _step(self, request: Any) -> pb.EnvironmentResponse:
        if self.joined is None and self.fault != "errors.step-before-join":
            return _error(9, "join a world first")
        self.steps += 1
        if self.fault == "latency.step" and self.steps > HANG_AFTER_STEPS:
            self.ended.wait()  # never answers while the stream lasts
        state = pb.RUNNING
        if self.first:
            problem = self._check_actions(request.actions)
            if problem is not None and self.fault == "step.first-ignores-actions":
                return _error(3, problem)
            self.first, self.count = False, 0
        else:
            problem = self._check_actions(request.actions)
            if problem is not None:
                return _error(3, problem)
            self.first = False
            self.count += 1
            if self.count >= EPISODE:
                state, self.first = pb.TERMINATED, True
                if self.fault == "episodes.first-after-last" and not self.ended_twice:
                    self.first, self.count, self.ended_twice = False, EPISODE - 1, True
            elif self.fault == "lifecycle.step":
                state = pb.INVALID_ENVIRONMENT_STATE
        step = pb.StepResponse(state=state)
        for uid in request.requested_observations:
            if uid not in self.specs.observations:
                return _error(3, f"unknown observation UID {uid}")
            step.observations[uid].CopyFrom(self._observation(uid))
        return pb.EnvironmentResponse(step=step)

    def _observation(self, uid: int) -> pb.Tensor:
        spec = self.specs.observations[uid]
        if spec.name == "count":
            return pb.Tensor(int64s=pb.Tensor.Int64Array(array=[self.count]))
        if spec.name == "level":
            return pb.Tensor(int32s=pb.Tensor.Int32Array(array=[3]))
        if spec.name == "grid":
            return pb.Tensor(floats=pb.Tensor.FloatArray(array=[0.0]), shape=[1, 1])
        values = [float(self.count), 0.0]
        if self.fault == "step.observations":
            return pb.Tensor(doubles=pb.Tensor.DoubleArray(array=values), shape=[2])
        return pb.Tensor(floats=pb.Tensor.FloatArray(array=values), shape=[2])

    def _reset(self, request: Any) -> pb.EnvironmentResponse:
        if self.joined is None and self.fault != "errors.reset-before-join":
            return _error(9, "join a world first")
        self.first = True
        specs = pb.ActionObservationSpecs() if self.fault == "lifecycle.reset" else self.specs
        return pb.EnvironmentResponse(reset=pb.ResetResponse(specs=specs))

    def _reset_world(self, request: Any) -> pb.EnvironmentResponse:
        if request.world_name not in self.worlds.names:
            return _error(5, f"no world {request.world_name!r}")
        if self.fault == "lifecycle.reset-world":
            return _error(13, "cannot reset worlds")
        if self.joined == request.world_name:
            self.first = True
        return pb.EnvironmentResponse(reset_world=pb.ResetWorldResponse())

    def _leave_world(self, request: Any) -> pb.EnvironmentResponse:
        if self.joined is not None and self.fault == "lifecycle.leave":
            return _error(13, "cannot leave")
        self.depart()
        self.joined = None
        return pb.EnvironmentResponse(leave_world=pb.LeaveWorldResponse())

    def _destroy_world(self, request: Any) -> pb.EnvironmentResponse:
        if request.world_name not in self.worlds.names:
            return _error(5, f"no world {request.world_name!r}")
        if self.joined == request.world_name:
            return _error(9, "leave the world before destroying it")
        if self.fault == "lifecycle.destroy":
            return _error(13, "cannot destroy worlds")
        with self.worlds.lock:
            self.worlds.names.discard(request.world_name)
        return pb.EnvironmentResponse(destroy_world=pb.DestroyWorldResponse())


def _swapped(requests: Iterator[Any], stream: _Stream) -> Iterator[Any]:
    """pipeline.order fault: two requests that arrive together are answered in reverse order."""
    waiting: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        try:
            for request in requests:
                waiting.put(request)
        except Exception:  # the stream was cancelled: it ends here too
            pass
        finally:
            waiting.put(None)

    threading.Thread(target=read, daemon=True).start()
    while (request := waiting.get()) is not None:
        try:
            second = waiting.get(timeout=0.005)  # sequential requests wait this long
        except queue.Empty:
            yield stream.answer(request)
            continue
        if second is None:
            yield stream.answer(request)
            return
        first_answer = stream.answer(request)
        yield stream.answer(second)
        yield first_answer


@contextlib.contextmanager
def raw_server(fault: str | None = None) -> Iterator[str]:
    """Serves the game, breaking the rule ``fault``; yields the address."""
    worlds = _World()

    def process(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        stream = _Stream(worlds, fault, context)
        if fault == "pipeline.order":
            yield from _swapped(requests, stream)
            return
        for request in requests:
            response = stream.answer(request)
            yield response
            if fault == "errors.stream-survives" and response.HasField("error"):
                return  # ends the stream after any error answer

    # multi-client.concurrent fault: one worker thread serves one stream at a time, and a
    # second client waits, unanswered, until the first leaves. Otherwise room for the
    # multi-agent group's three streams while a loaded machine still closes earlier ones.
    workers = 1 if fault == "multi-client.concurrent" else 16
    with process_server(process, max_workers=workers) as address:
        yield address


def _bench_on_path() -> None:
    """Puts ``bench/`` on ``sys.path``, so its ``_lib`` imports (as in ``stand_in_server``)."""
    bench = str(pathlib.Path(__file__).resolve().parent.parent / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)


@contextlib.contextmanager
def reference_server() -> Iterator[str]:
    """A conforming multi-world Catch server on the reference package; yields the address."""
    from dm_env_rpc.v1 import dm_env_rpc_pb2 as ref
    from dm_env_rpc.v1 import dm_env_rpc_pb2_grpc, tensor_spec_utils, tensor_utils
    from google.rpc import code_pb2, status_pb2

    # The specs as the benchmarks' reference-package server writes them (bench/_lib).
    _bench_on_path()
    from _lib.foreign_server import copy_specs, tensor_specs

    from dm_env_rpc_client.server.catch import Catch

    worlds: dict[str, Any] = {}
    taken: dict[str, int] = {}  # world name -> id of the joined stream's state
    names = itertools.count(1)
    lock = threading.Lock()

    def leave(state: dict[str, Any]) -> None:
        with lock:
            if taken.get(state["joined"]) == id(state):
                del taken[state["joined"]]
        state["joined"] = None

    class Refused(Exception):
        def __init__(self, code: int, message: str) -> None:
            super().__init__(message)
            self.code = code

    class Servicer(dm_env_rpc_pb2_grpc.EnvironmentServicer):
        def Process(self, request_iterator: Any, context: Any) -> Any:
            state: dict[str, Any] = {"joined": None, "first": True, "values": {}}
            try:
                for request in request_iterator:
                    try:
                        yield self._answer(request, state)
                    except Refused as exc:
                        status = status_pb2.Status(code=exc.code, message=str(exc))
                        yield ref.EnvironmentResponse(error=status)
            finally:
                leave(state)

        def _world(self, name: str) -> Any:
            with lock:
                if name not in worlds:
                    raise Refused(code_pb2.NOT_FOUND, f"no world {name!r}")
                return worlds[name]

        def _answer(self, request: Any, state: dict[str, Any]) -> Any:
            kind = request.WhichOneof("payload")
            response = ref.EnvironmentResponse()
            if kind == "create_world":
                settings = {
                    k: tensor_utils.unpack_tensor(v)
                    for k, v in request.create_world.settings.items()
                }
                try:
                    env = Catch(**settings)
                except (TypeError, ValueError) as exc:
                    raise Refused(code_pb2.INVALID_ARGUMENT, str(exc)) from exc
                with lock:
                    name = f"catch-{next(names)}"
                    worlds[name] = (env, *tensor_specs(env))
                response.create_world.world_name = name
            elif kind == "join_world":
                if state["joined"] is not None:
                    raise Refused(code_pb2.FAILED_PRECONDITION, "already joined")
                _, actions, observations = self._world(request.join_world.world_name)
                with lock:
                    if taken.setdefault(request.join_world.world_name, id(state)) != id(state):
                        raise Refused(code_pb2.FAILED_PRECONDITION, "one agent per world")
                state.update(joined=request.join_world.world_name, first=True)
                copy_specs(response.join_world.specs, actions, observations)
            elif kind in ("step", "reset") and state["joined"] is None:
                raise Refused(code_pb2.FAILED_PRECONDITION, "join a world first")
            elif kind == "step":
                response.step.CopyFrom(self._step(request.step, state))
            elif kind == "reset":
                state["first"] = True
                _, actions, observations = self._world(state["joined"])
                copy_specs(response.reset.specs, actions, observations)
            elif kind == "reset_world":
                self._world(request.reset_world.world_name)
                if state["joined"] == request.reset_world.world_name:
                    state["first"] = True
                response.reset_world.SetInParent()
            elif kind == "leave_world":
                leave(state)
                response.leave_world.SetInParent()
            elif kind == "destroy_world":
                name = request.destroy_world.world_name
                self._world(name)
                if state["joined"] == name:
                    raise Refused(code_pb2.FAILED_PRECONDITION, "leave the world first")
                with lock:
                    del worlds[name]
                response.destroy_world.SetInParent()
            else:
                raise Refused(code_pb2.UNIMPLEMENTED, f"{kind} is not supported")
            return response

        def _step(self, request: Any, state: dict[str, Any]) -> Any:
            env, actions, observations = self._world(state["joined"])
            if state["first"]:
                timestep = env.reset()
            else:
                action = {}
                for uid, tensor in request.actions.items():
                    if uid not in actions:
                        raise Refused(code_pb2.INVALID_ARGUMENT, f"unknown action UID {uid}")
                    spec = actions[uid]
                    wanted = tensor_utils.data_type_to_np_type(spec.dtype)
                    if tensor_utils.get_tensor_type(tensor) != wanted:
                        raise Refused(code_pb2.INVALID_ARGUMENT, f"{spec.name} must be {wanted}")
                    value = tensor_utils.unpack_tensor(tensor)
                    limits = tensor_spec_utils.bounds(spec)
                    if np.any(value < limits.min) or np.any(value > limits.max):
                        raise Refused(code_pb2.INVALID_ARGUMENT, f"{spec.name} is out of bounds")
                    action[spec.name] = value
                timestep = env.step(action)
            state["first"] = timestep.last()
            values = dict(timestep.observation)
            values["reward"] = timestep.reward or 0.0
            values["discount"] = 1.0 if timestep.discount is None else timestep.discount
            step = ref.StepResponse()
            for uid in request.requested_observations:
                if uid not in observations:
                    raise Refused(code_pb2.INVALID_ARGUMENT, f"unknown observation UID {uid}")
                spec = observations[uid]
                packed = tensor_utils.pack_tensor(np.asarray(values[spec.name]), dtype=spec.dtype)
                step.observations[uid].CopyFrom(packed)
            if timestep.last():
                step.state = ref.TERMINATED if timestep.discount == 0 else ref.INTERRUPTED
            else:
                step.state = ref.RUNNING
            return step

    with reference_servicer_server(Servicer()) as address:
        yield address
