"""A bare ``grpc.aio`` lockstep server: a real barrier per world, pre-serialized answers.

Run: ``python bench/_lib/lockstep_server.py [--exit-with-parent]``; prints
``Serving lockstep on <address>``, then serves until killed (or until its standard
input ends, with ``--exit-with-parent``).

What a fast multi-agent server costs, and no more, so that the clients of
``multiagent.py`` are what is measured: CreateWorld makes a world (a name; its
settings are not read), JoinWorld joins one more agent and answers Catch's specs
(the bytes the SDK server sends), and a step waits, on an asyncio future per world
and round, until every joined agent of its world has sent its step; then every agent gets the same pre-serialized StepResponse (a zero board,
reward 0, discount 1, RUNNING). Steps are not parsed (their first byte says what
they are); no game runs. Reset, Leave and Destroy get their answers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import threading
from collections.abc import AsyncIterator

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dm_env_rpc_client import dm_env_rpc_pb2, pack_tensor
from dm_env_rpc_client.server.__main__ import _watch_parent
from dm_env_rpc_client.server._worlds import World as SdkWorld
from dm_env_rpc_client.server.catch import Catch

SERVICE, METHOD = "dm_env_rpc.v1.Environment", "Process"
OPTIONS = [("grpc.so_reuseport", 0)]
_RESPONSE = dm_env_rpc_pb2.EnvironmentResponse
_SPECS = SdkWorld("world-1", Catch(), None).specs
_TAG = {field: field << 3 | 2 for field in range(1, 8)}  # EnvironmentRequest payload tags


def _step_answer() -> bytes:
    step = dm_env_rpc_pb2.StepResponse(state=dm_env_rpc_pb2.EnvironmentStateType.RUNNING)
    for uid, spec in _SPECS.observations.items():
        shape = [max(1, d) for d in spec.shape]
        dtype = {1: np.float32, 2: np.float64, 3: np.int8}.get(spec.dtype, np.float32)
        value = np.ones(shape, dtype) if spec.name == "discount" else np.zeros(shape, dtype)
        step.observations[uid].CopyFrom(pack_tensor(value))
    return _RESPONSE(step=step).SerializeToString()


STEP = _step_answer()
JOINED = _RESPONSE(join_world=dm_env_rpc_pb2.JoinWorldResponse(specs=_SPECS)).SerializeToString()
RESET = _RESPONSE(reset=dm_env_rpc_pb2.ResetResponse(specs=_SPECS)).SerializeToString()
LEFT = _RESPONSE(leave_world=dm_env_rpc_pb2.LeaveWorldResponse()).SerializeToString()
DESTROYED = _RESPONSE(destroy_world=dm_env_rpc_pb2.DestroyWorldResponse()).SerializeToString()
RESET_WORLD = _RESPONSE(reset_world=dm_env_rpc_pb2.ResetWorldResponse()).SerializeToString()


class _World:
    __slots__ = ("arrived", "joined", "round")

    def __init__(self) -> None:
        self.joined = 0
        self.arrived = 0
        self.round: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def step(self) -> None:
        self.arrived += 1
        if self.arrived >= self.joined:
            done, self.round = self.round, asyncio.get_running_loop().create_future()
            self.arrived = 0
            if not done.done():
                done.set_result(None)
            return
        await asyncio.shield(self.round)  # a cancelled stream must not cancel its world's round

    def leave(self) -> None:
        self.joined -= 1
        if self.joined and self.arrived >= self.joined:
            done, self.round = self.round, asyncio.get_running_loop().create_future()
            self.arrived = 0
            if not done.done():
                done.set_result(None)


_WORLDS: dict[str, _World] = {}
_NAMES = itertools.count()


async def _process(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
    world: _World | None = None
    try:
        async for request in requests:
            tag = request[0] if request else 0
            if tag == _TAG[3] and world is not None:
                await world.step()
                yield STEP
            elif tag == _TAG[1]:
                name = f"lockstep-{next(_NAMES)}"
                _WORLDS[name] = _World()
                created = dm_env_rpc_pb2.CreateWorldResponse(world_name=name)
                yield _RESPONSE(create_world=created).SerializeToString()
            elif tag == _TAG[2]:
                parsed = dm_env_rpc_pb2.EnvironmentRequest.FromString(request)
                world = _WORLDS[parsed.join_world.world_name]
                world.joined += 1
                yield JOINED
            elif tag == _TAG[4]:
                yield RESET
            elif tag == _TAG[5]:
                yield RESET_WORLD
            elif tag == _TAG[6]:
                if world is not None:
                    world.leave()
                world = None
                yield LEFT
            elif tag == _TAG[7]:
                parsed = dm_env_rpc_pb2.EnvironmentRequest.FromString(request)
                _WORLDS.pop(parsed.destroy_world.world_name, None)
                yield DESTROYED
            else:
                yield STEP
    finally:
        if world is not None:
            world.leave()


def _identity(data: bytes) -> bytes:
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--exit-with-parent", action="store_true")
    args, _ = parser.parse_known_args()
    stop = threading.Event()
    if args.exit_with_parent:
        _watch_parent(stop.set)

    async def serve() -> None:
        server = grpc.aio.server(options=OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(
            _process,  # type: ignore[arg-type]
            request_deserializer=_identity,
            response_serializer=_identity,
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler})]
        )
        port = server.add_insecure_port(f"{args.host}:0")
        await server.start()
        print(f"Serving lockstep on {args.host}:{port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(None)

    asyncio.run(serve())


if __name__ == "__main__":
    main()
