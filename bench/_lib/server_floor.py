"""The raw gRPC floor of a server's per-stream cost (no SDK server code: bare gRPC).

Run: ``python bench/_lib/server_floor.py [--kind aio|sync] [--max-workers N]``; prints
``Serving floor on <address>`` as the SDK server does, then serves until killed
(or until its standard input ends, with ``--exit-with-parent``).

One stream_stream method (``Process``): each request is taken as bytes, its first
byte (the payload's field tag) picks a pre-serialized answer, and that answer is
sent as bytes. CreateWorld gets ``world-1`` (every world the same name: the floor
keeps no registry), JoinWorld gets Catch's specs (the bytes the SDK server sends),
Leave and Destroy their empty answers, anything else an empty StepResponse. No
environment, no messages parsed or built, no per-stream state: what gRPC itself
costs a server per stream and per message, on this machine, is what this costs.

- ``aio`` (default): a ``grpc.aio`` server, the handler an async generator
  (``async for request in requests: yield answer``), as the SDK server's event loop;
- ``sync``: a ``grpc.server`` with a thread pool of ``--max-workers`` threads (one
  per stream, as the reference-package server), the handler a plain generator.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dm_env_rpc_client import dm_env_rpc_pb2
from dm_env_rpc_client.server.__main__ import _watch_parent
from dm_env_rpc_client.server._worlds import World
from dm_env_rpc_client.server.catch import Catch

SERVICE, METHOD = "dm_env_rpc.v1.Environment", "Process"
OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 0),
]


def _answers() -> dict[int, bytes]:
    """Pre-serialized answers by the request's first byte (field number << 3 | 2)."""
    response = dm_env_rpc_pb2.EnvironmentResponse
    specs = World("world-1", Catch(), None).specs
    by_field = {
        1: response(create_world=dm_env_rpc_pb2.CreateWorldResponse(world_name="world-1")),
        2: response(join_world=dm_env_rpc_pb2.JoinWorldResponse(specs=specs)),
        6: response(leave_world=dm_env_rpc_pb2.LeaveWorldResponse()),
        7: response(destroy_world=dm_env_rpc_pb2.DestroyWorldResponse()),
    }
    answers = {field << 3 | 2: message.SerializeToString() for field, message in by_field.items()}
    answers[-1] = response(step=dm_env_rpc_pb2.StepResponse()).SerializeToString()
    return answers


ANSWERS = _answers()
OTHER = ANSWERS[-1]


def _identity(data: bytes) -> bytes:
    return data


async def _process_aio(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
    async for request in requests:
        yield ANSWERS.get(request[0], OTHER) if request else OTHER


def _process_sync(requests: Iterator[bytes], context: object) -> Iterator[bytes]:
    for request in requests:
        yield ANSWERS.get(request[0], OTHER) if request else OTHER


def _handlers(kind: str) -> list[grpc.GenericRpcHandler]:
    process = _process_aio if kind == "aio" else _process_sync
    handler = grpc.stream_stream_rpc_method_handler(
        process,  # type: ignore[arg-type]
        request_deserializer=_identity,
        response_serializer=_identity,
    )
    return [grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler})]


def serve_sync(host: str, max_workers: int, stop: threading.Event) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers)
    server = grpc.server(pool, handlers=_handlers("sync"), options=OPTIONS)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    print(f"Serving floor on {host}:{port}", flush=True)
    stop.wait()
    server.stop(None)


def serve_aio(host: str, stop: threading.Event) -> None:
    import asyncio

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers(_handlers("aio"))
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        print(f"Serving floor on {host}:{port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(None)

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("aio", "sync"), default="aio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-workers", type=int, default=64)
    parser.add_argument("--exit-with-parent", action="store_true")
    args, _ = parser.parse_known_args()
    stop = threading.Event()
    if args.exit_with_parent:
        _watch_parent(stop.set)  # the SDK server's own (it serves nothing)
    if args.kind == "sync":
        serve_sync(args.host, args.max_workers, stop)
    else:
        serve_aio(args.host, stop)


if __name__ == "__main__":
    main()
