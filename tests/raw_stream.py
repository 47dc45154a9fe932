"""A bare gRPC stream for driving servers with hand-built EnvironmentRequests (no SDK connection)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf import any_pb2

from dm_env_rpc_client import tensors
from dm_env_rpc_client._proto import dm_env_rpc_pb2, properties_pb2

_END = object()


class RawStream:
    """One Process stream: ``send`` writes a request and reads exactly one response."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self._requests: queue.Queue[Any] = queue.Queue()
        call = self.channel.stream_stream(
            "/dm_env_rpc.v1.Environment/Process",
            request_serializer=dm_env_rpc_pb2.EnvironmentRequest.SerializeToString,
            response_deserializer=dm_env_rpc_pb2.EnvironmentResponse.FromString,
        )
        self._responses: Iterator[dm_env_rpc_pb2.EnvironmentResponse] = call(
            iter(self._requests.get, _END), timeout=60
        )

    def send(self, **payload: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        self.write(**payload)
        return next(self._responses)

    def write(self, **payload: Any) -> None:
        """Writes a request without reading its response."""
        self._requests.put(dm_env_rpc_pb2.EnvironmentRequest(**payload))

    def ok(self, **payload: Any) -> Any:
        """Sends and returns the payload message, asserting there was no error."""
        (field,) = payload
        response = self.send(**payload)
        assert response.WhichOneof("payload") == field, response.error
        return getattr(response, field)

    def error(self, **payload: Any) -> Any:
        """Sends and returns the error Status, asserting there was one."""
        response = self.send(**payload)
        assert response.WhichOneof("payload") == "error", response
        return response.error

    def create(self, **settings: Any) -> str:
        request = dm_env_rpc_pb2.CreateWorldRequest(
            settings={key: tensors.pack_tensor(value) for key, value in settings.items()}
        )
        return self.ok(create_world=request).world_name

    def join(self, world_name: str) -> dm_env_rpc_pb2.ActionObservationSpecs:
        request = dm_env_rpc_pb2.JoinWorldRequest(world_name=world_name)
        return self.ok(join_world=request).specs

    def step(self, actions: Any = None, observations: Any = ()) -> dm_env_rpc_pb2.StepResponse:
        request = dm_env_rpc_pb2.StepRequest(
            actions=actions or {}, requested_observations=list(observations)
        )
        return self.ok(step=request)

    def properties(self, **payload: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        packed = any_pb2.Any()
        packed.Pack(properties_pb2.PropertyRequest(**payload))
        return self.send(extension=packed)

    def close(self) -> None:
        self._requests.put(_END)
        self.channel.close()


def uid_of(specs: Any, name: str) -> int:
    """The UID of the spec called ``name`` in a ``{uid: TensorSpec}`` map."""
    return next(uid for uid, spec in specs.items() if spec.name == name)
