"""One connection's protocol state machine: answers EnvironmentRequests in order.

``handle(request)`` answers at once (a message or its wire bytes), except a step of
a multi-agent world, which waits for the other agents: then it returns an
``asyncio.Future`` of the answer, which the server awaits before it reads this
connection's next request.
"""

from __future__ import annotations

from typing import Any

import dm_env
import grpc
from google.protobuf import any_pb2

from .. import specs, tensors
from .._codec.payload import _varint
from .._proto import dm_env_rpc_pb2, properties_pb2
from . import properties
from ._multiworld import Agent, MultiWorld
from ._registry import AnyWorld, Registry
from ._worlds import ServerError, World
from ._worlds import error_response as _error
from ._worlds import step_response as _step_response

State = dm_env_rpc_pb2.EnvironmentStateType
DEFAULT_WORLD = ""

_NOT_JOINED = "{what} needs a joined world: send JoinWorldRequest first."


def _settings(tensor_map: Any) -> dict[str, Any]:
    return specs.unflatten({key: tensors.unpack_tensor(t) for key, t in tensor_map.items()})


class Session:
    """The state of one stream: the joined world and the sequence state."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._world: AnyWorld | None = None
        self._agent: Agent | None = None  # the agent this connection is, in a multi-agent world
        self._state = State.INTERRUPTED  # the next step starts a sequence
        self._epoch = 0
        self._created: list[AnyWorld] = []

    def handle(self, request: dm_env_rpc_pb2.EnvironmentRequest) -> Any:
        """Answers one request (a message, its wire bytes, or a multi-agent step's future of
        them); errors become ``EnvironmentResponse.error``."""
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
        if isinstance(world, MultiWorld):
            agent = world.join(self, _settings(request.settings))
            self._world, self._agent = world, agent
            return agent.wire.join_response
        assert isinstance(world, World)
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

    def _joined(self, what: str) -> AnyWorld:
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

    def _step(self, request: Any) -> Any:
        world = self._joined("StepRequest")
        if self._agent is not None:
            return world.submit(self._agent, request)  # type: ignore[union-attr]
        assert isinstance(world, World)
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
        if self._agent is not None:
            if request.settings:
                raise ServerError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "A multi-agent world takes no ResetRequest settings: its settings are the "
                    "whole world's, so send them with ResetWorldRequest.",
                )
            assert isinstance(world, MultiWorld)
            world.reset_agent(self._agent)
            specs = self._agent.wire.specs
        else:
            assert isinstance(world, World)
            _apply_reset_settings(world, request.settings, "reset")
            self._state = State.INTERRUPTED
            specs = world.specs
        return dm_env_rpc_pb2.EnvironmentResponse(reset=dm_env_rpc_pb2.ResetResponse(specs=specs))

    def _reset_world(self, request: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        world = self._registry.require(request.world_name)
        _apply_reset_settings(world, request.settings, "reset world")
        if isinstance(world, MultiWorld):
            world.reset_world(self)
            return dm_env_rpc_pb2.EnvironmentResponse(
                reset_world=dm_env_rpc_pb2.ResetWorldResponse()
            )
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
        if isinstance(world, MultiWorld):
            sessions = [agent.session for agent in world.joined()]
            joined_by = None if not sessions else self if self in sessions else sessions[0]
        else:
            joined_by = world.joined_by
        if joined_by is not None:
            who = "this connection" if joined_by is self else "another connection"
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
        agent, self._agent = self._agent, None
        if isinstance(world, MultiWorld):
            if agent is not None and agent.session is self and not world.destroyed:
                world.leave(agent)
        elif world is not None:
            with world.lock:
                if world.joined_by is self:
                    world.joined_by = None

    def close(self) -> None:
        """On disconnect: leave the joined world and destroy the worlds this session created."""
        self.leave()
        for world in self._created:
            self._registry.remove(world)
        self._created.clear()


def _apply_reset_settings(world: AnyWorld, settings: Any, what: str) -> None:
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
