"""A stand-in for a DeepMind Unity task's ``Linux64Player``, built on the reference package.

The Unity-task loaders (dm-memorytasks, dm_alchemy, dm_hard_eight, ...) start the
player as ``Linux64Player -logfile -batchmode -noaudio --logtostderr
--server_type=GRPC --uri_address=[::]:PORT`` and talk dm_env_rpc to it over local
credentials. This program takes those flags and serves one world with the Memory
Tasks' observations (``RGB_INTERLEAVED`` uint8[height, width, 3], ``AvatarPosition``
float[3], ``Score`` float, and ``reward``) and four double (float64) actions in [-1, 1], over
local credentials on loopback only (``[::]`` is served as ``localhost``). Written
with the reference ``dm-env-rpc`` package (a test-only peer), as a server in the
wild is. Everything it sends is a function of the world's settings and the actions,
so two clients driving it alike get the same answers.

An episode lasts ``EpisodeLengthSeconds * 30`` steps plus ``episode % 3``, then
TERMINATES; the next step starts a new episode. A step before a world is joined
gets FAILED_PRECONDITION, the answer the loaders' start-up probe waits for.

Environment variables:
  STAND_IN_UNAVAILABLE_STREAMS: refuse the first N streams with UNAVAILABLE, as a
    player that says ready before it serves does (the loaders retry).
  STAND_IN_LOG: a file to append one line per request type to.

The player exits when it is terminated, and when the process that started it is gone.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from dm_env_rpc.v1 import dm_env_rpc_pb2, dm_env_rpc_pb2_grpc, tensor_spec_utils, tensor_utils
from google.rpc import code_pb2, status_pb2

ACTIONS = ("MOVE_BACK_FORWARD", "STRAFE_LEFT_RIGHT", "LOOK_LEFT_RIGHT", "LOOK_DOWN_UP")
FPS = 30


def _specs(height: int, width: int) -> dm_env_rpc_pb2.ActionObservationSpecs:
    specs = dm_env_rpc_pb2.ActionObservationSpecs()
    for uid, name in enumerate(ACTIONS, start=1):
        spec = specs.actions[uid]
        spec.name, spec.dtype = name, dm_env_rpc_pb2.DataType.DOUBLE
        tensor_spec_utils.set_bounds(spec, -1.0, 1.0)
    observations = [
        ("RGB_INTERLEAVED", dm_env_rpc_pb2.DataType.UINT8, [height, width, 3]),
        ("AvatarPosition", dm_env_rpc_pb2.DataType.FLOAT, [3]),
        ("Score", dm_env_rpc_pb2.DataType.FLOAT, []),
        ("reward", dm_env_rpc_pb2.DataType.DOUBLE, []),
    ]
    for uid, (name, dtype, shape) in enumerate(observations, start=1):
        spec = specs.observations[uid]
        spec.name, spec.dtype = name, dtype
        spec.shape[:] = shape
    return specs


def _error(code: int, message: str) -> dm_env_rpc_pb2.EnvironmentResponse:
    return dm_env_rpc_pb2.EnvironmentResponse(error=status_pb2.Status(code=code, message=message))


class _World:
    """One world's episodes; the RNG of each step is seeded by (seed, episode, step)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.seed = int(settings.get("seed", 0))
        self.level = str(settings.get("levelName", ""))
        self.episode = int(settings.get("episodeId", 0)) - 1
        self.specs: dm_env_rpc_pb2.ActionObservationSpecs | None = None
        self.length = 0
        self.step_index = -1  # -1: the next step starts an episode

    def join(self, settings: dict[str, Any]) -> dm_env_rpc_pb2.ActionObservationSpecs:
        self.height, self.width = int(settings["height"]), int(settings["width"])
        self.seconds = float(settings["EpisodeLengthSeconds"])
        self.specs = _specs(self.height, self.width)
        return self.specs

    def step(self, actions: dict[str, float]) -> tuple[int, dict[str, Any]]:
        if self.step_index < 0:
            self.episode += 1
            self.length = max(2, int(self.seconds * FPS)) + self.episode % 3
            self.step_index, self.position, self.score = 0, np.zeros(3, np.float32), 0.0
            reward = 0.0
        else:
            self.step_index += 1
            move = [actions.get(name, 0.0) for name in ACTIONS[:3]]
            self.position = (self.position + np.float32(0.1) * np.float32(move)).astype(np.float32)
            reward = 1.0 if actions.get(ACTIONS[0], 0.0) > 0.5 and self.step_index % 3 == 0 else 0.0
            self.score += reward
        rng = np.random.default_rng([self.seed, self.episode, self.step_index])
        observations = {
            "RGB_INTERLEAVED": rng.integers(0, 256, (self.height, self.width, 3), np.uint8),
            "AvatarPosition": self.position,
            "Score": np.float32(self.score),
            "reward": np.float64(reward),
        }
        if self.step_index >= self.length:
            self.step_index = -1
            return dm_env_rpc_pb2.EnvironmentStateType.TERMINATED, observations
        return dm_env_rpc_pb2.EnvironmentStateType.RUNNING, observations


class Player(dm_env_rpc_pb2_grpc.EnvironmentServicer):
    """The dm_env_rpc service: one world per player, as a Unity task has."""

    def __init__(self, unavailable_streams: int, log: str | None) -> None:
        self._unavailable = unavailable_streams
        self._log = log
        self._lock = threading.Lock()
        self._world: _World | None = None
        self._joined = False

    def Process(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        with self._lock:
            refuse = self._unavailable > 0
            self._unavailable -= 1
        if refuse:
            self._note("refused")
            context.abort(grpc.StatusCode.UNAVAILABLE, "the player is still starting")
        for request in request_iterator:
            kind = request.WhichOneof("payload")
            self._note(kind)
            with self._lock:
                yield self._answer(kind, getattr(request, kind))

    def _note(self, kind: str) -> None:
        if self._log:
            with open(self._log, "a") as log:
                log.write(f"{kind}\n")

    def _answer(self, kind: str, request: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        world = self._world
        if kind == "create_world":
            settings = {k: tensor_utils.unpack_tensor(v) for k, v in request.settings.items()}
            self._world = _World(settings)
            return dm_env_rpc_pb2.EnvironmentResponse(
                create_world=dm_env_rpc_pb2.CreateWorldResponse(world_name="unity_world")
            )
        if kind == "join_world":
            if world is None or request.world_name != "unity_world":
                return _error(code_pb2.NOT_FOUND, f"no world {request.world_name!r}")
            settings = {k: tensor_utils.unpack_tensor(v) for k, v in request.settings.items()}
            self._joined = True
            return dm_env_rpc_pb2.EnvironmentResponse(
                join_world=dm_env_rpc_pb2.JoinWorldResponse(specs=world.join(settings))
            )
        if kind == "step":
            if world is None or not self._joined:
                return _error(code_pb2.FAILED_PRECONDITION, "no world is joined")
            return self._step(world, request)
        if kind == "reset":
            if world is None or not self._joined:
                return _error(code_pb2.FAILED_PRECONDITION, "no world is joined")
            world.step_index = -1
            return dm_env_rpc_pb2.EnvironmentResponse(
                reset=dm_env_rpc_pb2.ResetResponse(specs=world.specs)
            )
        if kind == "leave_world":
            self._joined = False
            return dm_env_rpc_pb2.EnvironmentResponse(
                leave_world=dm_env_rpc_pb2.LeaveWorldResponse()
            )
        if kind == "destroy_world":
            if world is None or self._joined or request.world_name != "unity_world":
                return _error(code_pb2.NOT_FOUND, f"no world {request.world_name!r} to destroy")
            self._world = None
            return dm_env_rpc_pb2.EnvironmentResponse(
                destroy_world=dm_env_rpc_pb2.DestroyWorldResponse()
            )
        return _error(code_pb2.UNIMPLEMENTED, f"{kind} is not supported")

    def _step(self, world: _World, request: Any) -> dm_env_rpc_pb2.EnvironmentResponse:
        assert world.specs is not None
        names = {uid: spec.name for uid, spec in world.specs.actions.items()}
        actions = {
            names[uid]: float(tensor_utils.unpack_tensor(t)) for uid, t in request.actions.items()
        }
        state, observations = world.step(actions)
        uids = {spec.name: uid for uid, spec in world.specs.observations.items()}
        wanted = set(request.requested_observations)
        response = dm_env_rpc_pb2.StepResponse(state=state)
        for name, value in observations.items():
            if uids[name] in wanted:
                response.observations[uids[name]].CopyFrom(tensor_utils.pack_tensor(value))
        return dm_env_rpc_pb2.EnvironmentResponse(step=response)


def serve_player(address: str = "127.0.0.1:0", unavailable_streams: int = 0) -> tuple[Any, int]:
    """Starts a player's server in this process; returns ``(grpc server, port)``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    dm_env_rpc_pb2_grpc.add_EnvironmentServicer_to_server(
        Player(unavailable_streams, os.environ.get("STAND_IN_LOG")), server
    )
    credentials = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    port = server.add_secure_port(address, credentials)  # loopback only
    server.start()
    return server, port


def _exit_with_parent() -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri_address", required=True, help="[::]:PORT, as the loaders pass it")
    parser.add_argument("--server_type", default="GRPC", choices=["GRPC"])
    args, _unity_flags = parser.parse_known_args()  # -logfile -batchmode -noaudio --logtostderr
    port = int(args.uri_address.rsplit(":", 1)[1])
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    unavailable = int(os.environ.get("STAND_IN_UNAVAILABLE_STREAMS", "0"))
    server, _ = serve_player(f"localhost:{port}", unavailable)  # loopback only, never [::]
    server.wait_for_termination()


if __name__ == "__main__":
    main()
