"""A raw-gRPC lockstep multi-agent server for the checker's ``multi-agent.*`` rules.

``multiagent_server(fault)`` serves ``check_servers``' small game, but any number of
streams may join one world, and a step waits (a condition variable, on a sync gRPC
server's worker thread, as most multi-agent servers in the wild do) until every joined
agent has sent one. ResetWorld makes every other joined agent's next step INTERRUPTED;
a leave (or a stream's end) frees the agent's place in the round. With ``fault=None`` it
keeps every rule; each fault of ``MULTIAGENT_FAULTS`` breaks exactly the rule it is named
after:

- ``multi-agent.join``: with two agents joined a round never completes (a barrier that
  counts one agent too many);
- ``multi-agent.reset-world``: ResetWorld interrupts no one;
- ``multi-agent.leave``: a leave does not take the agent out of the round;
- ``multi-agent.destroy-joined``: DestroyWorld from a joined stream destroys the world.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from check_servers import _Stream, _World
from faulty import process_server

from dm_env_rpc_client._proto import dm_env_rpc_pb2 as pb

MULTIAGENT_FAULTS = (
    "multi-agent.join",
    "multi-agent.reset-world",
    "multi-agent.leave",
    "multi-agent.destroy-joined",
)


class _Round:
    """One world's agents and the lockstep round they are in."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.agents: set[_Agent] = set()
        self.waiting: set[_Agent] = set()
        self.rounds = 0


class _Worlds(_World):
    def __init__(self) -> None:
        super().__init__()
        self.rounds: dict[str, _Round] = {}


class _Agent(_Stream):
    """A stream that joins worlds as one of their agents."""

    worlds: _Worlds

    def __init__(self, worlds: _Worlds, fault: str | None, context: grpc.ServicerContext) -> None:
        super().__init__(worlds, fault, context)
        self.interrupt = False

    def _round(self) -> _Round | None:
        with self.worlds.lock:
            return None if self.joined is None else self.worlds.rounds.get(self.joined)

    def enter(self, world: str) -> pb.EnvironmentResponse | None:
        with self.worlds.lock:
            found = self.worlds.rounds.setdefault(world, _Round())
        with found.condition:
            found.agents.add(self)
        return None

    def depart(self) -> None:
        found = self._round()
        if found is None or self.fault == "multi-agent.leave":
            return
        with found.condition:
            found.agents.discard(self)
            found.waiting.discard(self)
            self._complete(found)

    def _complete(self, found: _Round) -> None:
        """Ends the round if every joined agent is in it (the condition is held)."""
        needed = len(found.agents) + (self.fault == "multi-agent.join" and len(found.agents) > 1)
        if found.waiting and len(found.waiting) >= needed:
            found.rounds += 1
            found.waiting.clear()
            found.condition.notify_all()

    def _step(self, request: Any) -> pb.EnvironmentResponse:
        found = self._round()
        if found is not None:
            with found.condition:
                found.waiting.add(self)
                started = found.rounds
                self._complete(found)
                while found.rounds == started and not self.ended.is_set():
                    found.condition.wait(0.05)
            if self.interrupt:
                self.interrupt, self.first = False, True
                return pb.EnvironmentResponse(step=pb.StepResponse(state=pb.INTERRUPTED))
        return super()._step(request)

    def _reset_world(self, request: Any) -> pb.EnvironmentResponse:
        answer = super()._reset_world(request)
        if answer.HasField("error") or self.fault == "multi-agent.reset-world":
            return answer
        with self.worlds.lock:
            found = self.worlds.rounds.get(request.world_name)
        if found is not None:
            with found.condition:
                for agent in found.agents:
                    if agent is not self and not agent.first:
                        agent.interrupt = True
        return answer

    def _destroy_world(self, request: Any) -> pb.EnvironmentResponse:
        if self.fault == "multi-agent.destroy-joined" and self.joined == request.world_name:
            with self.worlds.lock:
                self.worlds.names.discard(request.world_name)
            return pb.EnvironmentResponse(destroy_world=pb.DestroyWorldResponse())
        return super()._destroy_world(request)


@contextlib.contextmanager
def multiagent_server(fault: str | None = None) -> Iterator[str]:
    """Serves the game with lockstep multi-agent worlds, breaking ``fault``; yields the address."""
    worlds = _Worlds()

    def process(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        stream = _Agent(worlds, fault, context)
        for request in requests:
            yield stream.answer(request)

    with process_server(process, max_workers=16) as address:
        yield address
