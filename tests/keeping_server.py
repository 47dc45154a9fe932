"""A test server that keeps worlds until DestroyWorld, as the protocol allows, with a world limit.

The SDK's own server destroys a stream's worlds when the stream ends, which hides
a client that drops its streams without LeaveWorld and DestroyWorld. This one
(a plain ``grpc.aio`` server on a thread of its own, answering with the server
package's ``Session``) only leaves the joined world on disconnect: a world stays
until a DestroyWorldRequest names it. ``max_worlds`` refuses a CreateWorld beyond
it with RESOURCE_EXHAUSTED; ``options`` are the gRPC server's, e.g.
``("grpc.max_concurrent_streams", 100)`` for an HTTP/2 stream limit per connection.
A test can make it refuse every JoinWorld (``kept.refuse_joins``), every one after the
first K (``kept.joins_allowed = K``), or abort every stream that steps (``kept.abort_steps``).
It serves multi-agent environments too (``server/paddles.py``'s ``Paddles``): each agent
joins over its own stream, and a world is destroyed only once every agent has left it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import dm_env
import grpc

from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client._transport.loop import LoopThread
from dm_env_rpc_client.server._registry import AnyWorld, Registry
from dm_env_rpc_client.server._session import Session
from dm_env_rpc_client.server._worlds import ServerError

FULL = "This server keeps at most {limit} worlds and has {limit}; destroy one first."


class LimitedRegistry(Registry):
    """A ``Registry`` that refuses a world beyond ``limit``."""

    def __init__(self, make_env: Callable[[dict[str, Any]], dm_env.Environment], limit: int):
        super().__init__(make_env)
        self.limit = limit

    def create(
        self, settings: dict[str, Any], creator: object, name: str | None = None
    ) -> AnyWorld:
        if len(self) >= self.limit:
            raise ServerError(grpc.StatusCode.RESOURCE_EXHAUSTED, FULL.format(limit=self.limit))
        return super().create(settings, creator, name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._worlds)


class Kept:
    """A running keeping server: its address, its worlds, and switches for faults."""

    def __init__(self, address: str, registry: LimitedRegistry) -> None:
        self.address = address
        self.registry = registry
        self.refuse_joins = False
        self.joins_allowed: int | None = None  # refuse every JoinWorld after this many
        self.joins = 0  # JoinWorld requests seen
        self.abort_steps = False

    @property
    def worlds(self) -> int:
        """How many worlds the server holds."""
        return len(self.registry)


def _serialize(response: Any) -> bytes:
    return (
        bytes(response)
        if isinstance(response, (bytes, bytearray))
        else response.SerializeToString()
    )


@contextlib.contextmanager
def keeping_server(
    make_env: Callable[[dict[str, Any]], dm_env.Environment],
    max_worlds: int = 1 << 30,
    options: Sequence[tuple[str, Any]] = (),
) -> Iterator[Kept]:
    """Serves worlds that are kept until destroyed; yields the running ``Kept``."""
    registry = LimitedRegistry(make_env, max_worlds)
    kept: Kept | None = None

    async def process(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        session = Session(registry)
        try:
            async for request in requests:
                which = request.WhichOneof("payload")
                if kept is not None and which == "join_world":
                    kept.joins += 1
                    allowed = kept.joins_allowed
                    refused = kept.refuse_joins or (allowed is not None and kept.joins > allowed)
                else:
                    refused = False
                if refused:
                    yield dm_env_rpc_pb2.EnvironmentResponse(
                        error={"code": grpc.StatusCode.UNAVAILABLE.value[0], "message": "no joins"}
                    )
                    continue
                if kept is not None and kept.abort_steps and which == "step":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "stream aborted")
                answer = session.handle(request)
                if isinstance(answer, asyncio.Future):  # a multi-agent step: waits for its round
                    answer = await answer
                yield answer
        finally:
            session.leave()  # only: the worlds it created stay

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=list(options))
        handler = grpc.method_handlers_generic_handler(
            "dm_env_rpc.v1.Environment",
            {
                "Process": grpc.stream_stream_rpc_method_handler(
                    process,
                    request_deserializer=dm_env_rpc_pb2.EnvironmentRequest.FromString,
                    response_serializer=_serialize,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    runner = LoopThread(name="keeping-server")
    try:
        server, port = runner.run(start(), 30)
        kept = Kept(f"127.0.0.1:{port}", registry)
        try:
            yield kept
        finally:
            runner.run(server.stop(None), 30)
            registry.close()
    finally:
        runner.close()
