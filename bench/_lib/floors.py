"""The raw gRPC floors the SDK's clients are measured against (no SDK code on the step path).

``raw_floor(address, window)`` is one bare gRPC stream (the sync API, as the
SDK's ``Connection`` uses): the world is created and joined, then every step
writes the same pre-serialized ``EnvironmentRequest`` and takes each response
as undecoded bytes, a reader thread counting them and keeping ``window`` steps
in flight. Whatever a client spends beyond it is the client's own cost.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from _lib.common import Variant
from dm_env_rpc_client import dm_env_rpc_pb2
from dm_env_rpc_client.messages import METHOD


def step_request(specs: Any) -> dm_env_rpc_pb2.StepRequest:
    """The StepRequest asking for every observation (as the adaptors do)."""
    return dm_env_rpc_pb2.StepRequest(requested_observations=sorted(specs.observations))


def raw_floor(address: str, window: int, each: Callable[[], Any] | None = None) -> Variant:
    """Pre-serialized requests and undecoded responses over a bare gRPC stream.

    ``each``, if given, is called on the sending thread after each request
    (``in_stream.py`` times its own Python there).
    """
    channel = grpc.insecure_channel(address)
    outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()
    call = channel.stream_stream(METHOD)(iter(outgoing.get, None))
    responses: Iterator[bytes] = iter(call)

    def send(message: Any) -> Any:
        outgoing.put(dm_env_rpc_pb2.EnvironmentRequest(**message).SerializeToString())
        return dm_env_rpc_pb2.EnvironmentResponse.FromString(next(responses))

    world = send({"create_world": dm_env_rpc_pb2.CreateWorldRequest()}).create_world.world_name
    specs = send({"join_world": dm_env_rpc_pb2.JoinWorldRequest(world_name=world)}).join_world.specs
    data = dm_env_rpc_pb2.EnvironmentRequest(step=step_request(specs)).SerializeToString()

    def run(steps: int) -> None:
        slots = threading.Semaphore(window)
        done = threading.Event()

        def reader() -> None:
            for _ in range(steps):
                next(responses)
                slots.release()
            done.set()

        thread = threading.Thread(target=reader)
        thread.start()
        for _ in range(steps):
            slots.acquire()
            outgoing.put(data)
            if each is not None:
                each()
        done.wait()
        thread.join()

    def close() -> None:
        outgoing.put(None)
        call.cancel()
        channel.close()

    return run, close
