"""One connection's protocol state machine: answers EnvironmentRequests in order."""

from __future__ import annotations

from typing import Any

import dm_env
import grpc
from google.protobuf import any_pb2
from google.rpc import status_pb2

from .. import specs, tensors
from .._codec.payload import _varint
from .._proto import dm_env_rpc_pb2, properties_pb2
from . import properties
from ._worlds import Registry, ServerError, World

State = dm_env_rpc_pb2.EnvironmentStateType
DEFAULT_WORLD = ""

_NOT_JOINED = "{what} needs a joined world: send JoinWorldRequest first."


def _settings(tensor_map: Any) -> dict[str, Any]:
    return specs.unflatten({key: tensors.unpack_tensor(t) for key, t in tensor_map.items()})


class Session:
    """The state of one stream: the joined world and the sequence state."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._world: World | None = None
        self._state = State.INTERRUPTED  # the next step starts a sequence
        self._epoch = 0
        self._created: list[World] = []

    def handle(
        self, request: dm_env_rpc_pb2.EnvironmentRequest
    ) -> dm_env_rpc_pb2.EnvironmentResponse | bytes:
        """Answers one request (a message, or its wire bytes); errors become
        ``EnvironmentResponse.error``."""
        which = request.WhichOneof("payload")
        try:
            if which is None:
                raise ServerError(grpc.StatusCode.INVALID_ARGUMENT, "Empty EnvironmentRequest.")
            handler = getattr(self, f"_{which}")
            return handler(getattr(request, which))
        except ServerError as exc:
            return _error(exc.code, str(exc))
        except properties.PropertyError as exc:
            return _error(exc.code, str(exc))
        except Exception as exc:
            return _error(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    # --- requests ---------------------------------------------------------------------

    def _create_world(self, request: Any) -> bytes:
        world = self._registry.create(_settings(request.settings), creator=self)
        self._created.append(world)
        # EnvironmentResponse{create_world: CreateWorldResponse{world_name}} as wire bytes.
        name = world.name.encode()
        answer = b"\x0a" + _varint(len(name)) + name
        return b"\x0a" + _varint(len(answer)) + answer

    def _join_world(self, request: Any) -> bytes:
        if self._world is not None:
            raise ServerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"This connection already joined world {self._world.name!r}; "
                "send LeaveWorldRequest first.",
            )
        name = request.world_name
        world = self._registry.get(name)
        if world is None and name == DEFAULT_WORLD:
            world = self._registry.create({}, creator=self, name=DEFAULT_WORLD)
            self._created.append(world)
        if world is None:
            world = self._registry.require(name)
        if request.settings:
            names = ", ".join(repr(key) for key in sorted(request.settings))
            raise ServerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Unknown join settings {names}: this server takes no join settings.",
            )
        with world.lock:
            if world.joined_by is not None:
                raise ServerError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"World {world.name!r} is already joined by another connection; "
                    "a world takes one connection at a time.",
                )
            world.joined_by = self
        self._world = world
        self._state = State.INTERRUPTED
        self._epoch = world.epoch
        return world.join_response

    def _joined(self, what: str) -> World:
        world = self._world
        if world is None:
            raise ServerError(grpc.StatusCode.FAILED_PRECONDITION, _NOT_JOINED.format(what=what))
        if world.destroyed:
            raise ServerError(
                grpc.StatusCode.NOT_FOUND,
                f"World {world.name!r} was destroyed (its creator disconnected); "
                "leave it and join another.",
            )
        return world

    def _step(self, request: Any) -> bytes:
        world = self._joined("StepRequest")
        env = world.env
        if self._epoch != world.epoch and self._state == State.RUNNING:
            # Another connection reset the world: this sequence ends as INTERRUPTED.
            self._epoch = world.epoch
            self._state = State.INTERRUPTED
            return _step_response(State.INTERRUPTED, [])
        self._epoch = world.epoch
        # A request that fails must not move the world: check everything before stepping.
        world.check_observation_uids(request.requested_observations)
        if self._state != State.RUNNING:
            timestep = env.reset()  # the first step ignores its actions
        else:
            timestep = env.step(world.decode_actions(request.actions))
        observations = world.encode_observations(timestep, request.requested_observations)
        if timestep.step_type == dm_env.StepType.LAST:
            discount = timestep.discount
            truncated = discount is not None and float(discount) > 0
            self._state = State.INTERRUPTED if truncated else State.TERMINATED
        else:
            self._state = State.RUNNING
        return _step_response(self._state, observations)

    def _reset(self, request: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        world = self._joined("ResetRequest")
        _apply_reset_settings(world, request.settings, "reset")
        self._state = State.INTERRUPTED
        return dm_env_rpc_pb2.EnvironmentResponse(
            reset=dm_env_rpc_pb2.ResetResponse(specs=world.specs)
        )

    def _reset_world(self, request: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        world = self._registry.require(request.world_name)
        _apply_reset_settings(world, request.settings, "reset world")
        world.epoch += 1
        if world.joined_by is self:
            self._state = State.INTERRUPTED
            self._epoch = world.epoch
        return dm_env_rpc_pb2.EnvironmentResponse(reset_world=dm_env_rpc_pb2.ResetWorldResponse())

    def _leave_world(self, request: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        del request
        self.leave()
        return dm_env_rpc_pb2.EnvironmentResponse(leave_world=dm_env_rpc_pb2.LeaveWorldResponse())

    def _destroy_world(self, request: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        world = self._registry.require(request.world_name)
        if world.joined_by is not None:
            who = "this connection" if world.joined_by is self else "another connection"
            raise ServerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"World {world.name!r} is joined by {who}; leave it before destroying it.",
            )
        self._registry.remove(world)
        if world in self._created:
            self._created.remove(world)
        return dm_env_rpc_pb2.EnvironmentResponse(
            destroy_world=dm_env_rpc_pb2.DestroyWorldResponse()
        )

    def _extension(self, request: any_pb2.Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        if not request.Is(properties_pb2.PropertyRequest.DESCRIPTOR):
            raise ServerError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"Extension {request.type_url!r} is not supported; this server supports "
                "only the properties extension.",
            )
        world = self._joined("A properties request")
        hook = getattr(world.env, "dm_env_rpc_properties", None)
        if hook is None:
            raise ServerError(
                grpc.StatusCode.UNIMPLEMENTED,
                "Extensions are not supported: this environment offers no properties "
                "(it has no dm_env_rpc_properties() hook).",
            )
        property_request = properties_pb2.PropertyRequest()
        request.Unpack(property_request)
        response = dm_env_rpc_pb2.EnvironmentResponse()
        response.extension.Pack(properties.handle(hook(), property_request))
        return response

    # --- lifecycle --------------------------------------------------------------------

    def leave(self) -> None:
        """Leaves the joined world, if any."""
        world, self._world = self._world, None
        if world is not None:
            with world.lock:
                if world.joined_by is self:
                    world.joined_by = None

    def close(self) -> None:
        """On disconnect: leave the joined world and destroy the worlds this session created."""
        self.leave()
        for world in self._created:
            self._registry.remove(world)
        self._created.clear()


def _apply_reset_settings(world: World, settings: Any, what: str) -> None:
    """Hands reset settings to the environment's ``dm_env_rpc_reset_settings`` hook.

    Without the hook any setting is refused; a TypeError or ValueError of the
    hook is the client's fault (INVALID_ARGUMENT naming the settings).
    """
    if not settings:
        return
    names = ", ".join(repr(key) for key in sorted(settings))
    hook = getattr(world.env, "dm_env_rpc_reset_settings", None)
    if hook is None:
        raise ServerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Unknown {what} settings {names}: this environment takes none "
            "(it has no dm_env_rpc_reset_settings() hook).",
        )
    try:
        hook(_settings(settings))
    except (TypeError, ValueError) as exc:
        raise ServerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Bad {what} settings {names}: {type(exc).__name__}: {exc}",
        ) from exc


def _step_response(state: int, observations: list[tuple[int, Any]]) -> bytes:
    """``EnvironmentResponse{step: StepResponse{state, observations}}`` as wire bytes.

    The observation tensors are spliced in as they are (one copy, no messages).
    """
    parts = [b"\x08", _varint(state)]
    for uid, tensor in observations:
        head = b"\x08" + _varint(uid) + b"\x12" + _varint(len(tensor))
        parts += [b"\x12", _varint(len(head) + len(tensor)), head, tensor]
    step = b"".join(parts)
    return b"\x1a" + _varint(len(step)) + step


def _error(code: grpc.StatusCode, message: str) -> dm_env_rpc_pb2.EnvironmentResponse:
    return dm_env_rpc_pb2.EnvironmentResponse(
        error=status_pb2.Status(code=code.value[0], message=message)
    )
