"""A foreign dm_env_rpc server, written on the reference ``dm-env-rpc`` package (test-only peer).

Run: ``python bench/_lib/foreign_server.py --env catch|large [--size N] [--port P]``; it
prints ``Serving <env> on <address>`` once it listens, then serves until killed.

It is built the way most dm_env_rpc servers in the wild are: a sync gRPC server
(``grpc.server`` with a thread pool), and a ``Process`` handler that takes one
request from the stream, answers it and yields the answer, with the reference
package's own ``tensor_utils`` packing each observation per step and its
``dm_env_utils`` writing the specs. Nothing of this SDK's server is used; the
games are the same ``dm_env.Environment``s (``Catch``, and ``LargeObservation``
with one float32[size] observation), so both servers offer the same specs and
the benchmarks can compare them side by side. Reward and discount are
observations named ``reward`` and ``discount``, as the SDK's server offers them.

One liberty: an observation that is the very same array object as on the last
step is not packed again (``LargeObservation`` returns its one fixed array).
The reference ``pack_tensor`` turns float32 arrays into Python lists, about
15 ms for 100,000 floats, which would make the server the bottleneck and hide
every difference between clients; a server with a fixed or pre-packed payload
spends its time on the copy into the response, as this one does.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import dm_env
import grpc
from dm_env_rpc.v1 import dm_env_rpc_pb2 as pb
from dm_env_rpc.v1 import dm_env_rpc_pb2_grpc, dm_env_utils, tensor_utils
from google.rpc import code_pb2, status_pb2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# The games only (plain dm_env.Environments); the serving below is the reference package's.
from dm_env_rpc_client.server.catch import Catch
from dm_env_rpc_client.server.envs import LargeObservation

_STATE = {
    dm_env.StepType.FIRST: pb.EnvironmentStateType.RUNNING,
    dm_env.StepType.MID: pb.EnvironmentStateType.RUNNING,
}


def tensor_specs(env: dm_env.Environment) -> tuple[dict[int, Any], dict[int, Any]]:
    """``env``'s ``({uid: action TensorSpec}, {uid: observation TensorSpec})``, written by the
    reference package's ``dm_env_utils``: uids from 1, actions first, then the observations,
    ``reward`` and ``discount`` (also used by ``tests/check_servers.py``'s reference server)."""
    uids = itertools.count(1)
    actions = {
        next(uids): dm_env_utils.dm_env_spec_to_tensor_spec(spec)
        for spec in env.action_spec().values()
    }
    observations = {
        next(uids): dm_env_utils.dm_env_spec_to_tensor_spec(spec)
        for spec in [*env.observation_spec().values(), env.reward_spec(), env.discount_spec()]
    }
    return actions, observations


def copy_specs(into: Any, actions: dict[int, Any], observations: dict[int, Any]) -> None:
    """Writes the specs of ``tensor_specs`` into a JoinWorld's or Reset's ``specs`` message."""
    for uid, spec in actions.items():
        into.actions[uid].CopyFrom(spec)
    for uid, spec in observations.items():
        into.observations[uid].CopyFrom(spec)


class _Servicer(dm_env_rpc_pb2_grpc.EnvironmentServicer):
    """One world per stream; the world's name is its stream's number."""

    def __init__(self, make_env: Any) -> None:
        self._make_env = make_env
        self._worlds = itertools.count()

    def Process(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        env: dm_env.Environment | None = None
        action_specs: dict[int, Any] = {}
        observation_specs: dict[int, Any] = {}
        names: dict[int, str] = {}
        defaults: dict[str, Any] = {}
        packed: dict[int, tuple[Any, Any]] = {}  # uid -> (array, its Tensor), see the docstring
        needs_reset = True
        for request in request_iterator:
            response = pb.EnvironmentResponse()
            field = request.WhichOneof("payload")
            try:
                if field == "create_world":
                    env = self._make_env()
                    action_specs, observation_specs = tensor_specs(env)
                    names = {uid: spec.name for uid, spec in observation_specs.items()}
                    defaults = {
                        name: spec.generate_value() for name, spec in env.action_spec().items()
                    }
                    response.create_world.world_name = f"world-{next(self._worlds)}"
                elif field == "join_world":
                    assert env is not None, "create a world first"
                    copy_specs(response.join_world.specs, action_specs, observation_specs)
                    needs_reset = True
                elif field == "step":
                    assert env is not None, "join a world first"
                    if needs_reset:
                        timestep = env.reset()
                    else:
                        action = dict(defaults)  # actions left out: the spec's zero value
                        for uid, tensor in request.step.actions.items():
                            action[action_specs[uid].name] = tensor_utils.unpack_tensor(tensor)
                        timestep = env.step(action)
                    needs_reset = timestep.last()
                    values = dict(timestep.observation)
                    values["reward"] = 0.0 if timestep.reward is None else timestep.reward
                    values["discount"] = 0.0 if timestep.discount is None else timestep.discount
                    step = response.step
                    for uid in request.step.requested_observations:
                        value = values[names[uid]]
                        cached = packed.get(uid)
                        if cached is None or cached[0] is not value:
                            dtype = observation_specs[uid].dtype
                            cached = packed[uid] = (value, tensor_utils.pack_tensor(value, dtype))
                        step.observations[uid].CopyFrom(cached[1])
                    if timestep.last():
                        discount = timestep.discount
                        step.state = (
                            pb.EnvironmentStateType.TERMINATED
                            if discount is not None and float(discount) == 0.0
                            else pb.EnvironmentStateType.INTERRUPTED
                        )
                    else:
                        step.state = _STATE[timestep.step_type]
                elif field == "reset":
                    assert env is not None, "join a world first"
                    needs_reset = True
                    copy_specs(response.reset.specs, action_specs, observation_specs)
                elif field == "leave_world":
                    response.leave_world.SetInParent()
                elif field == "destroy_world":
                    env = None
                    response.destroy_world.SetInParent()
                else:
                    raise ValueError(f"unsupported request {field!r}")
            except Exception as exc:  # every error goes back as a Status
                response = pb.EnvironmentResponse(
                    error=status_pb2.Status(code=code_pb2.INTERNAL, message=repr(exc))
                )
            yield response


def _make_env(name: str, size: int) -> Any:
    if name == "catch":
        return Catch
    return lambda: LargeObservation(size=size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=("catch", "large"), default="catch")
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-workers", type=int, default=64)
    args = parser.parse_args()
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=args.max_workers),
        options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            ("grpc.so_reuseport", 0),
        ],
    )
    dm_env_rpc_pb2_grpc.add_EnvironmentServicer_to_server(
        _Servicer(_make_env(args.env, args.size)), server
    )
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"Serving {args.env} on {args.host}:{port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
