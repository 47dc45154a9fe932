"""A raw gRPC dm_env_rpc server that misbehaves on purpose, for error-path tests.

``faulty_server(specs, step)`` serves one world per stream on a loopback port
with a sync gRPC handler (no SDK server code): CreateWorld, JoinWorld (answering
``specs``), Reset, LeaveWorld and DestroyWorld answer as a correct server
would; each StepRequest is answered with ``step(request, count)``, the
``StepResponse`` a test builds (``count`` is the stream's step number, from 0),
so a test decides exactly what is wrong in which step::

    def step(request, count):
        return good_response() if count < 3 else missing_observation()

    with faulty_server(SPECS, step) as address:
        conn = dmr.connect(address, timeout=10)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from dm_env_rpc_client._proto import dm_env_rpc_pb2

StepFunction = Callable[[dm_env_rpc_pb2.StepRequest, int], dm_env_rpc_pb2.StepResponse]


def _handler(specs: dm_env_rpc_pb2.ActionObservationSpecs, step: StepFunction) -> Any:
    worlds = itertools.count()

    def process(requests: Iterator[Any], context: Any) -> Iterator[Any]:
        steps = itertools.count()
        for request in requests:
            field = request.WhichOneof("payload")
            response = dm_env_rpc_pb2.EnvironmentResponse()
            if field == "create_world":
                response.create_world.world_name = f"faulty-{next(worlds)}"
            elif field == "join_world":
                response.join_world.specs.CopyFrom(specs)
            elif field == "reset":
                response.reset.specs.CopyFrom(specs)
            elif field == "step":
                response.step.CopyFrom(step(request.step, next(steps)))
            else:
                getattr(response, field).SetInParent()
            yield response

    return grpc.method_handlers_generic_handler(
        "dm_env_rpc.v1.Environment",
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                process,
                request_deserializer=dm_env_rpc_pb2.EnvironmentRequest.FromString,
                response_serializer=dm_env_rpc_pb2.EnvironmentResponse.SerializeToString,
            )
        },
    )


@contextlib.contextmanager
def faulty_server(
    specs: dm_env_rpc_pb2.ActionObservationSpecs, step: StepFunction
) -> Iterator[str]:
    """Serves ``specs`` and ``step`` on a free loopback port; yields the address."""
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)]
    )
    server.add_generic_rpc_handlers((_handler(specs, step),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(5)
