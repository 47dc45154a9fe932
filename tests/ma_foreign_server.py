"""A foreign multi-agent dm_env_rpc server on the reference ``dm-env-rpc`` package (test-only).

Built the way most multi-agent servers in the wild are: a sync gRPC servicer
(``grpc.server`` with a thread pool, one thread per stream), the reference
package's ``tensor_utils`` and ``dm_env_utils`` for tensors and specs, and a
lockstep step that blocks its stream's thread on a ``threading.Condition`` until
every joined agent of the world has acted. Nothing of the SDK is used.

The game is a multi-agent Paddles (CONTRACTS.md section 2): a ball falls one row
per round; each agent moves its own paddle along the bottom row (action
``paddle``, int8 in [-1, 1]); when the ball lands, the agents under it get +1,
the others 0, and the episode ends (discount 0: TERMINATED). Each agent sees
``board``, float32 [rows, columns]: 1.0 at the ball and its own paddle, 0.5 at
the other paddles; reward and discount are observations, as the SDK's servers
offer them.

- Create settings: ``num_agents`` (default 2, 1..8), ``mode`` (``"lockstep"``, or
  ``"turns"``: agent k's action counts only once agents 0..k-1 acted this round),
  ``seed``, ``rows`` (10), ``columns`` (8).
- Join setting ``agent``: an index or ``"agent_<k>"``; absent: the lowest free one.
  Taken: ALREADY_EXISTS; out of range: INVALID_ARGUMENT; full: RESOURCE_EXHAUSTED.
- A step waits at most ``barrier_timeout`` s (the server's option) for the other
  agents, then is answered DEADLINE_EXCEEDED naming the agents that did not act.
- ResetWorld makes every joined agent's next step INTERRUPTED (and re-seeds with
  ``seed``); Reset starts a new episode for the whole world; the first step after
  a join or an episode's end ignores the agent's action.
- DestroyWorld from a connection still joined is FAILED_PRECONDITION; a stream
  that ends leaves its agent.

For fault tests the servicer has these switches: ``abort_agent = k`` aborts the
stream of agent k at its next step (once; with ``abort_mid_episode``, its next
step that would answer MID after at least one MID step); ``abort_answered = k``
lets agent k's next step play its round (the other agents get their answers),
then holds agent k's answer until ``release`` is set and aborts its stream
instead; ``stall = True`` never answers a step (the barrier never completes).

Run ``python tests/ma_foreign_server.py [--port P] [--max-workers W]``: it prints
``Serving paddles on <address>`` and serves until killed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import numpy as np
from dm_env import specs as dm_specs
from dm_env_rpc.v1 import dm_env_rpc_pb2 as pb
from dm_env_rpc.v1 import dm_env_rpc_pb2_grpc, dm_env_utils, tensor_utils
from google.rpc import code_pb2, status_pb2

PADDLE, BOARD, REWARD, DISCOUNT = 1, 2, 3, 4
_RUNNING, _TERMINATED, _INTERRUPTED = (
    pb.EnvironmentStateType.RUNNING,
    pb.EnvironmentStateType.TERMINATED,
    pb.EnvironmentStateType.INTERRUPTED,
)
_WAITED = "{mode} step of {agent} waited {timeout} s; agents that did not act: {missing}"


class Refused(Exception):
    """A request answered with an error status (the stream goes on)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _name(agent: int) -> str:
    return f"agent_{agent}"


def _setting(settings: Any, name: str, default: Any) -> Any:
    if name not in settings:
        return default
    value = tensor_utils.unpack_tensor(settings[name])
    return value.item() if isinstance(value, (np.ndarray, np.generic)) else value


class World:
    """One Paddles world: its agents, its lockstep barrier, its game."""

    def __init__(self, name: str, settings: Any, barrier_timeout: float) -> None:
        self.name = name
        self.num_agents = int(_setting(settings, "num_agents", 2))
        self.mode = str(_setting(settings, "mode", "lockstep"))
        self.rows = int(_setting(settings, "rows", 10))
        self.columns = int(_setting(settings, "columns", 8))
        known = {"num_agents", "mode", "seed", "rows", "columns"}
        unknown = sorted(set(settings) - known)
        if unknown or not 1 <= self.num_agents <= 8 or self.mode not in ("lockstep", "turns"):
            raise Refused(code_pb2.INVALID_ARGUMENT, f"bad create settings {dict(settings)!r}")
        self.rng = np.random.default_rng(int(_setting(settings, "seed", 0)))
        self.barrier_timeout = barrier_timeout
        self.cond = threading.Condition()
        self.joined: set[int] = set()
        self.submitted: dict[int, int] = {}
        self.acted: set[int] = set()  # this round's, kept by an agent that gave up waiting
        self.round = 0
        self.results: dict[int, tuple[int, np.ndarray, float, float]] = {}
        self.fresh = True  # the next round starts an episode (every action ignored)
        self.needs_first: set[int] = set()  # joined since the last round: action ignored
        self.interrupted: set[int] = set()
        self.destroyed = False
        self.ball = (0, 0)
        self.paddles = [0] * self.num_agents

    def join(self, wanted: Any) -> int:
        with self.cond:
            if wanted is None:
                free = [k for k in range(self.num_agents) if k not in self.joined]
                if not free:
                    raise Refused(code_pb2.RESOURCE_EXHAUSTED, f"world {self.name} is full")
                agent = free[0]
            else:
                agent = int(str(wanted).removeprefix("agent_"))
                if not 0 <= agent < self.num_agents:
                    raise Refused(
                        code_pb2.INVALID_ARGUMENT,
                        f"agent {wanted!r} is out of range: {self.name} has {self.num_agents}",
                    )
                if agent in self.joined:
                    raise Refused(code_pb2.ALREADY_EXISTS, f"agent {_name(agent)} is taken")
            self.joined.add(agent)
            self.needs_first.add(agent)
            return agent

    def leave(self, agent: int) -> None:
        with self.cond:
            self.joined.discard(agent)
            self.submitted.pop(agent, None)
            self.interrupted.discard(agent)
            self._complete_if_all_acted()
            self.cond.notify_all()

    def reset(self, seed: Any = None) -> None:
        with self.cond:
            if seed is not None:
                self.rng = np.random.default_rng(int(seed))
            self.fresh = True

    def reset_world(self, seed: Any) -> None:
        with self.cond:
            if seed is not None:
                self.rng = np.random.default_rng(int(seed))
            self.fresh = True
            self.interrupted = set(self.joined)

    def step(self, agent: int, action: int) -> tuple[int, np.ndarray, float, float]:
        with self.cond:
            if agent in self.interrupted:
                self.interrupted.discard(agent)
                self.needs_first.add(agent)
                return _INTERRUPTED, self._board(agent), 0.0, 1.0
            if self.mode == "turns":
                ahead = [k for k in sorted(self.joined) if k < agent]
                if not self.cond.wait_for(
                    lambda: self.destroyed or all(k in self.submitted for k in ahead),
                    self.barrier_timeout,
                ):
                    missing = [k for k in ahead if k not in self.submitted]
                    raise self._timed_out(agent, missing)
            self._check_alive()
            started = self.round
            self.submitted[agent] = action
            self.acted.add(agent)
            self._complete_if_all_acted()
            self.cond.notify_all()  # in turns, the next agent's turn
            if not self.cond.wait_for(
                lambda: self.destroyed or self.round != started or agent not in self.joined,
                self.barrier_timeout,
            ):
                self.submitted.pop(agent, None)
                missing = [k for k in sorted(self.joined) if k not in self.acted]
                raise self._timed_out(agent, missing)
            self._check_alive(agent)
            return self.results[agent]

    def _timed_out(self, agent: int, missing: list[int]) -> Refused:
        names = ", ".join(_name(k) for k in missing) or "none (they left)"
        message = _WAITED.format(
            mode=self.mode, agent=_name(agent), timeout=self.barrier_timeout, missing=names
        )
        return Refused(code_pb2.DEADLINE_EXCEEDED, message)

    def _check_alive(self, agent: int | None = None) -> None:
        if agent is not None and agent not in self.joined:
            raise Refused(code_pb2.CANCELLED, f"{_name(agent)} left while it waited")
        if self.destroyed:
            raise Refused(code_pb2.FAILED_PRECONDITION, f"world {self.name} was destroyed")

    def _complete_if_all_acted(self) -> None:
        # Under the condition's lock: the last agent to act plays the round for all.
        if not self.submitted or any(k not in self.submitted for k in self.joined):
            return
        acting = dict(self.submitted)
        self.submitted.clear()
        self.acted.clear()
        rewards = dict.fromkeys(acting, 0.0)
        state = _RUNNING
        if self.fresh:
            self.fresh = False
            self.ball = (0, int(self.rng.integers(self.columns)))
            self.paddles = [k * self.columns // self.num_agents for k in range(self.num_agents)]
        else:
            for agent in sorted(acting):  # in turn order
                if agent not in self.needs_first:
                    move = int(np.clip(acting[agent], -1, 1))
                    self.paddles[agent] = int(
                        np.clip(self.paddles[agent] + move, 0, self.columns - 1)
                    )
            self.ball = (self.ball[0] + 1, self.ball[1])
            if self.ball[0] == self.rows - 1:
                state = _TERMINATED
                for agent in acting:
                    rewards[agent] = 1.0 if self.paddles[agent] == self.ball[1] else 0.0
                self.fresh = True
        self.needs_first -= set(acting)
        discount = 0.0 if state == _TERMINATED else 1.0
        self.results = {
            agent: (state, self._board(agent), rewards[agent], discount) for agent in acting
        }
        self.round += 1
        self.cond.notify_all()

    def mid_episode(self) -> bool:
        """Whether the next round answers MID and follows a MID round (the test hooks')."""
        with self.cond:
            return not self.fresh and 1 <= self.ball[0] < self.rows - 2

    def _board(self, agent: int) -> np.ndarray:
        board = np.zeros((self.rows, self.columns), np.float32)
        for column in self.paddles:
            board[self.rows - 1, column] = max(board[self.rows - 1, column], 0.5)
        board[self.rows - 1, self.paddles[agent]] = 1.0
        board[self.ball] = 1.0
        return board

    def specs(self, into: Any) -> None:
        paddle = dm_specs.BoundedArray((), np.int8, -1, 1, name="paddle")
        board = dm_specs.BoundedArray((self.rows, self.columns), np.float32, 0.0, 1.0, "board")
        reward = dm_specs.Array((), np.float32, name="reward")
        discount = dm_specs.BoundedArray((), np.float32, 0.0, 1.0, name="discount")
        into.actions[PADDLE].CopyFrom(dm_env_utils.dm_env_spec_to_tensor_spec(paddle))
        for uid, spec in ((BOARD, board), (REWARD, reward), (DISCOUNT, discount)):
            into.observations[uid].CopyFrom(dm_env_utils.dm_env_spec_to_tensor_spec(spec))


class Servicer(dm_env_rpc_pb2_grpc.EnvironmentServicer):
    """Worlds by name, shared by every stream; one agent per stream."""

    def __init__(self, barrier_timeout: float = 30.0) -> None:
        self.barrier_timeout = barrier_timeout
        self.worlds: dict[str, World] = {}
        self.lock = threading.Lock()
        self.active_streams = 0
        self.abort_agent: int | None = None
        self.abort_mid_episode = False
        self.abort_answered: int | None = None
        self.release = threading.Event()
        self.stall = False
        self.steps_received = 0  # every StepRequest read, by any stream
        self._names = itertools.count()

    def Process(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        with self.lock:
            self.active_streams += 1
        world: World | None = None
        agent: int | None = None
        # The (world, agent) this stream holds: a stream that ends (its client gone) leaves at
        # once, waking its step if it waits in the barrier.
        membership: list[tuple[World, int]] = []

        def leave() -> None:
            while membership:
                held_world, held_agent = membership.pop()
                held_world.leave(held_agent)

        context.add_callback(leave)
        try:
            for request in request_iterator:
                response = pb.EnvironmentResponse()
                field = request.WhichOneof("payload")
                try:
                    if field == "create_world":
                        name = f"paddles-{next(self._names)}"
                        made = World(name, request.create_world.settings, self.barrier_timeout)
                        with self.lock:
                            self.worlds[name] = made
                        response.create_world.world_name = name
                    elif field == "join_world":
                        if world is not None:
                            raise Refused(code_pb2.FAILED_PRECONDITION, "already joined a world")
                        found = self.worlds.get(request.join_world.world_name)
                        if found is None or found.destroyed:
                            raise Refused(code_pb2.NOT_FOUND, "no such world")
                        wanted = _setting(request.join_world.settings, "agent", None)
                        agent, world = found.join(wanted), found
                        membership.append((world, agent))
                        world.specs(response.join_world.specs)
                    elif field == "step":
                        with self.lock:
                            self.steps_received += 1
                        if world is None or agent is None:
                            raise Refused(code_pb2.FAILED_PRECONDITION, "join a world first")
                        if self.abort_agent == agent and (
                            not self.abort_mid_episode or world.mid_episode()
                        ):
                            self.abort_agent = None
                            context.abort(grpc.StatusCode.UNAVAILABLE, "agent stream aborted")
                        while self.stall and context.is_active():
                            threading.Event().wait(0.05)
                        tensor = request.step.actions.get(PADDLE)
                        action = 0 if tensor is None else int(tensor_utils.unpack_tensor(tensor))
                        state, board, reward, discount = world.step(agent, action)
                        if self.abort_answered == agent:
                            self.abort_answered = None
                            self.release.wait(30.0)
                            context.abort(grpc.StatusCode.UNAVAILABLE, "agent stream aborted")
                        step = response.step
                        step.state = state
                        values = {BOARD: board, REWARD: reward, DISCOUNT: discount}
                        wanted_uids = request.step.requested_observations or list(values)
                        for uid in wanted_uids:
                            step.observations[uid].CopyFrom(
                                tensor_utils.pack_tensor(values[uid], np.float32)
                            )
                    elif field == "reset":
                        if world is None:
                            raise Refused(code_pb2.FAILED_PRECONDITION, "join a world first")
                        world.reset(_setting(request.reset.settings, "seed", None))
                        world.specs(response.reset.specs)
                    elif field == "reset_world":
                        found = self.worlds.get(request.reset_world.world_name)
                        if found is None:
                            raise Refused(code_pb2.NOT_FOUND, "no such world")
                        found.reset_world(_setting(request.reset_world.settings, "seed", None))
                        response.reset_world.SetInParent()
                    elif field == "leave_world":
                        leave()
                        world = agent = None
                        response.leave_world.SetInParent()
                    elif field == "destroy_world":
                        if world is not None:
                            raise Refused(
                                code_pb2.FAILED_PRECONDITION,
                                "this connection is still joined to a world: leave it first",
                            )
                        with self.lock:
                            found = self.worlds.pop(request.destroy_world.world_name, None)
                        if found is None:
                            raise Refused(code_pb2.NOT_FOUND, "no such world")
                        with found.cond:
                            found.destroyed = True
                            found.cond.notify_all()
                        response.destroy_world.SetInParent()
                    else:
                        raise Refused(code_pb2.UNIMPLEMENTED, f"unsupported request {field!r}")
                except Refused as exc:
                    response = pb.EnvironmentResponse(
                        error=status_pb2.Status(code=exc.code, message=str(exc))
                    )
                yield response
        finally:
            leave()
            with self.lock:
                self.active_streams -= 1


class ForeignServer:
    """A running server: ``address``, its ``servicer``, and ``stop()``."""

    def __init__(self, barrier_timeout: float = 30.0, max_workers: int = 64, port: int = 0):
        self.servicer = Servicer(barrier_timeout)
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=max_workers),
            options=[("grpc.so_reuseport", 0)],
        )
        dm_env_rpc_pb2_grpc.add_EnvironmentServicer_to_server(self.servicer, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)


@contextlib.contextmanager
def foreign_server(barrier_timeout: float = 30.0, max_workers: int = 64) -> Iterator[ForeignServer]:
    """A foreign multi-agent server in this process, stopped on exit."""
    server = ForeignServer(barrier_timeout, max_workers)
    try:
        yield server
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-workers", type=int, default=256)
    parser.add_argument("--barrier-timeout", type=float, default=30.0)
    args = parser.parse_args()
    server = ForeignServer(args.barrier_timeout, args.max_workers, args.port)
    print(f"Serving paddles on {server.address}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server._server.wait_for_termination()


if __name__ == "__main__":
    main()
