"""Multi-agent worlds as one batch of agent streams: making, failing, restarting, closing a world.

A multi-agent world is one CreateWorldRequest and N JoinWorldRequests, one per
connection (the protocol joins one world per connection). ``AgentBatch`` is a
``BatchedEnvironment`` whose slots are agents: slot ``w * num_agents + a`` is agent
``a`` of world ``w``, each over its own stream on the batch's one event loop, so
every agent's step is written at once and none waits for another (stepping agents
one after another from one thread deadlocks a lockstep server: its step returns
only once every agent has acted). What it adds to the batch is the world:

- ``make_world`` creates a world once (or takes a named one) and joins every agent
  at once; if any part fails it leaves the agents it joined and destroys the world
  it made before raising (``unmake_world``), so nothing is left on the server.
- A slot that fails fails its whole world (``_fail``): under ``"raise"`` every
  agent of the world answers with the failure; under ``"restart"`` the world is
  made again (``remake_world``: attempts, backoff and bounds of ``RestartPolicy``),
  all its agents rejoin, and if steps were lost every agent takes its FIRST step
  at once (flagged ``truncated``). Steps of the world already landed but not yet
  received are dropped with it, so a world's agents always answer alike.
- ``close_agents`` leaves every agent of every world at once, then destroys the
  worlds it made (a joined connection may not destroy its world).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .. import errors
from .._base import collector
from .._proto import dm_env_rpc_pb2
from .._transport.loop import LoopConnection
from ..aio import AsyncConnection
from ..batched import BatchedEnvironment
from ..environment import DmEnvAdaptor, pack_settings
from .closing import shut_down
from .outcomes import _FAILED, _LIVE, _RESTARTING, _Failure
from .restart import RAISE, GaveUp, RestartPolicy, back_off
from .undo import ask as _ask

_SIBLING = "agent {agent} of the same world failed: {cause}"


class SiblingFailure(errors.DmEnvRpcClientError):
    """What the other agents of a world whose agent ``agent`` failed answer with (``cause``)."""

    def __init__(self, agent: int, cause: BaseException) -> None:
        super().__init__(_SIBLING.format(agent=agent, cause=cause))
        self.agent, self.cause = agent, cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.agent, self.cause))


AGENT_SETTING = "agent"  # the join setting that picks an agent (CONTRACTS.md section 2)
CLOSE_CALL_S = 5.0  # at most this long for each leave or destroy of a world being undone


class WorldPlan(NamedTuple):
    """How one multi-agent world is made, so that it can be made again."""

    create_settings: Mapping[str, Any] | None
    join_settings: tuple[Mapping[str, Any] | None, ...]  # one per agent
    world_name: str | None  # join this existing world instead of creating one
    timeout: float | None  # the adaptors' timeout
    requested_observations: tuple[str, ...] | None = None


class Made(NamedTuple):
    """A world made (or joined) by ``make_world``: its name, each agent's specs."""

    name: str
    specs: list[dm_env_rpc_pb2.ActionObservationSpecs]


async def make_world(
    streams: Sequence[AsyncConnection], plan: WorldPlan, timeout: float | None
) -> Made:
    """Creates the world on the first stream (unless ``plan`` names one) and joins agent ``a``
    on stream ``a``, all agents at once; each call bounded by ``timeout``.

    Raises:
      DmEnvRpcClientError: a call failed; the agents joined were left and the world
        created was destroyed first.
    """
    name = plan.world_name
    created = name is None
    if name is None:
        request = dm_env_rpc_pb2.CreateWorldRequest(settings=pack_settings(plan.create_settings))
        name = (await _ask(streams[0], request, timeout)).world_name
    # Agents that pick theirs join first, all at once; then the others one after another, so
    # a server that gives the lowest free agent gives them in the order of their labels.
    picks = [AGENT_SETTING in (settings or {}) for settings in plan.join_settings]
    phases = [[a for a, pick in enumerate(picks) if pick]]
    phases += [[a] for a, pick in enumerate(picks) if not pick]
    answers: list[Any] = [None] * len(streams)
    for phase in phases:
        joins = [
            _ask(
                streams[a],
                dm_env_rpc_pb2.JoinWorldRequest(
                    world_name=name, settings=pack_settings(plan.join_settings[a])
                ),
                timeout,
            )
            for a in phase
        ]
        for agent, answer in zip(
            phase, await asyncio.gather(*joins, return_exceptions=True), strict=True
        ):
            answers[agent] = answer
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is not None:
            joined = [
                stream
                for stream, answer in zip(streams, answers, strict=True)
                if answer is not None and not isinstance(answer, BaseException)
            ]
            await unmake_world(joined, streams[0], name if created else None, timeout)
            raise failed
    return Made(name, [answer.specs for answer in answers])


async def unmake_world(
    joined: Sequence[AsyncConnection],
    destroyer: AsyncConnection | None,
    world_name: str | None,
    timeout: float | None,
) -> None:
    """Leaves every ``joined`` stream's world at once, then destroys ``world_name`` (if given)
    from ``destroyer``; refusals and dead servers end each call quietly, within ``timeout``."""
    bound = CLOSE_CALL_S if timeout is None else min(timeout, CLOSE_CALL_S)

    async def quietly(stream: AsyncConnection, request: Any) -> None:
        with contextlib.suppress(Exception):
            await _ask(stream, request, bound)

    leave = dm_env_rpc_pb2.LeaveWorldRequest()
    await asyncio.gather(*(quietly(stream, leave) for stream in joined))
    if world_name is not None and destroyer is not None:
        await quietly(destroyer, dm_env_rpc_pb2.DestroyWorldRequest(world_name=world_name))


class Remade(NamedTuple):
    """What a successful ``remake_world`` gives."""

    connections: list[LoopConnection]
    made: Made
    envs: list[DmEnvAdaptor]
    firsts: list[Any] | None  # each agent's first step's response, if asked
    attempts: int


async def remake_world(
    open_stream: Callable[..., Any],
    address: str,
    plan: WorldPlan,
    policy: RestartPolicy,
    *,
    first_step: bool,
    rng: random.Random,
) -> Remade:
    """Makes a failed world again on ``address`` and rejoins all its agents (and with
    ``first_step`` takes every agent's first step at once), within ``policy``'s bounds.

    Raises:
      GaveUp: no attempt succeeded within the bounds.
    """
    deadline = time.monotonic() + policy.total
    last_error: BaseException | None = None
    attempt = 0
    while attempt < policy.attempts and deadline > time.monotonic():
        attempt += 1
        remaining = deadline - time.monotonic()
        opening = [
            open_stream(address, min(policy.connect_timeout, remaining)) for _ in plan.join_settings
        ]
        opened = await asyncio.gather(*opening, return_exceptions=True)
        connections = [conn for conn in opened if isinstance(conn, LoopConnection)]
        try:
            failed = next((c for c in opened if isinstance(c, BaseException)), None)
            if failed is not None:
                raise failed
            streams = [conn.async_connection for conn in connections]
            call_timeout = min(policy.call_timeout, max(0.01, deadline - time.monotonic()))
            made = await make_world(streams, plan, call_timeout)
            envs = [
                DmEnvAdaptor(
                    conn,
                    specs,
                    world_name=made.name,
                    timeout=plan.timeout,
                    requested_observations=plan.requested_observations,
                )
                for conn, specs in zip(connections, made.specs, strict=True)
            ]
            firsts = None
            if first_step:
                steps = [
                    stream.send(env.step_request(None), call_timeout)
                    for stream, env in zip(streams, envs, strict=True)
                ]
                firsts = list(await asyncio.gather(*steps))
            return Remade(connections, made, envs, firsts, attempt)
        except (errors.DmEnvRpcClientError, OSError) as exc:
            last_error = exc
            for conn in connections:
                with contextlib.suppress(Exception):
                    await conn.async_connection.aclose()
        await back_off(policy, attempt, deadline, rng)
    raise GaveUp(attempt, last_error)


class AgentBatch(BatchedEnvironment):
    """Agent slots grouped into worlds (see the module docs); ``dmr.MultiAgentBatch`` is its face.

    Attributes:
      num_agents: agents per world.
      world_names: each world's name on its server (a restarted world's is its new one).
    """

    num_agents: int = 1
    agents: list[str]
    world_names: list[str]
    _plans: list[WorldPlan]
    _created: list[bool]
    _first_answers: dict[int, int]  # per slot: the steps its latest restart's FIRST answered

    def _answered_by_first(self, slot: int) -> int:
        """How many of slot ``slot``'s steps its world's latest restart's FIRST step answered:
        the slot's own (``failures`` records the world's, every agent's lost steps summed)."""
        return self._first_answers.get(slot, 1)

    def slots_of(self, world: int) -> range:
        """The slots (indices in ``envs``) of world ``world``'s agents, in agent order."""
        first = world * self.num_agents
        return range(first, first + self.num_agents)

    def _fail(self, index: int, cause: BaseException, reported: bool = False) -> int:
        """Slot ``index`` failed: its whole world fails (see the module docs)."""
        if self._state[index] != _LIVE:
            return 0
        world = index // self.num_agents
        slots = self.slots_of(world)
        if self._policy == RAISE:
            lost = BatchedEnvironment._fail(self, index, cause, reported)
            sibling = SiblingFailure(index - slots[0], cause)
            sibling.__cause__ = cause
            for slot in slots:
                if slot != index:
                    BatchedEnvironment._fail(self, slot, sibling, False)
            return lost
        lost_by_slot: dict[int, int] = {}
        with self._cond:
            for slot in slots:
                queue = self._done[slot]
                dropped = sum(_answers(outcome) for outcome, _ in queue)
                self._ready -= len(queue)
                queue.clear()
                lost_by_slot[slot] = self._busy[slot] + dropped if self._state[slot] == _LIVE else 0
                self._busy[slot] = 0
                self._gen[slot] += 1
                self._state[slot] = _RESTARTING
        olds = [self._streams[slot] for slot in slots]
        self._spawn(self._restore_world(world, index, cause, lost_by_slot, olds))
        return lost_by_slot[index]

    async def _restore_world(
        self,
        world: int,
        index: int,
        cause: BaseException,
        lost: dict[int, int],
        olds: list[AsyncConnection],
    ) -> None:
        detected, started = time.time(), time.monotonic()
        for old in olds:
            with contextlib.suppress(Exception):
                await old.aclose()
        slots = self.slots_of(world)
        address = self.addresses[slots[0]]
        assert self._open_stream is not None and address is not None
        try:
            remade = await remake_world(
                self._open_stream,
                address,
                self._plans[world],
                self._restart_policy,
                first_step=any(lost.values()),
                rng=self._rng,
            )
        except GaveUp as gave_up:
            lost_by_slot = [lost[slot] for slot in slots]
            self._removed(index, address, slots, lost_by_slot, cause, detected, started, gave_up)
            return
        old_name, self.world_names[world] = self.world_names[world], remade.made.name
        if self._created[world]:  # the failed world's agents are gone: it goes too
            self._spawn(self._destroy_apart(address, old_name, self._restart_policy.call_timeout))
        lost_in_all = sum(lost.values())
        self._restarted(
            index, address, cause, detected, started, remade.attempts, address, lost_in_all
        )
        firsts: list[tuple[int, tuple[Any, Any, int]]] = []
        for agent, slot in enumerate(slots):
            env, conn = remade.envs[agent], remade.connections[agent]
            self.envs[slot] = env
            self._connections[slot] = conn
            self._streams[slot] = conn.async_connection
            self._streams[slot]._pool = self._writers
            if env._wire_specs == self._joined_specs[slot]:
                self._joined_specs[slot] = env._wire_specs
            if remade.firsts is None:  # no agent lost a step: each one's next is its FIRST
                self._first_answers[slot] = 1
                self._truncate_next[slot] = True
            else:  # answers the agent's lost steps (or none: see _file_firsts)
                first = remade.firsts[agent]
                self._first_answers[slot] = lost[slot]
                firsts.append((slot, (env._advance(first.state), first, lost[slot])))
        _file_firsts(self, firsts)
        with self._cond:
            for slot in slots:
                self._state[slot] = _LIVE
        for slot in slots:
            held_steps, self._held[slot] = self._held[slot], []
            for data, sent in held_steps:
                self._write(slot, data, sent)

    async def _destroy_apart(self, address: str, name: str, timeout: float) -> None:
        """Destroys a failed world (its agents' streams are closed) over a stream of its own;
        a dead server or a refusal ends it quietly, within ``timeout``."""
        assert self._open_stream is not None
        bound = min(timeout, CLOSE_CALL_S)
        with contextlib.suppress(Exception):
            conn = await self._open_stream(address, bound)
            self._connections.append(conn)
            request = dm_env_rpc_pb2.DestroyWorldRequest(world_name=name)
            with contextlib.suppress(Exception):
                await _ask(conn.async_connection, request, bound)
            await conn.async_connection.aclose()


def _file_firsts(batch: AgentBatch, firsts: list[tuple[int, tuple[Any, Any, int]]]) -> None:
    """Files a restarted world's FIRST steps, every agent's at once (one ``recv`` takes all or
    none of them). An agent whose last step was received before its world failed (its step
    landed, another agent's was lost) had none in flight: its FIRST answers no step (``0``
    in the outcome), so that every agent's next step received is its FIRST of the new world
    (its next action would otherwise be the new world's second step, the FIRST unseen)."""
    if not firsts:
        return
    with batch._lock:
        for slot, outcome in firsts:
            batch._enqueue(slot, outcome, 0.0)


def _answers(outcome: Any) -> int:
    """How many sent steps a filed outcome answers."""
    if isinstance(outcome, _Failure):
        return outcome.lost
    if isinstance(outcome, tuple) and len(outcome) > 2:
        return int(outcome[2])
    return 1


def close_agents(batch: AgentBatch, timeout: float) -> None:
    """``MultiAgentBatch.close`` (once): every agent of every live world leaves at once, then
    the worlds the batch made are destroyed (failed worlds too, over a fresh stream); then
    the streams, channels and loop are shut down. Bounded by ``timeout`` (and gRPC's own
    10 s to tear the streams down)."""
    batch._closed = True
    runner = batch._runner
    assert runner is not None
    with collector.paused():
        if not runner.closed:
            with contextlib.suppress(errors.DmEnvRpcClientError):
                runner.run(batch._stop_tasks(), timeout=max(0.1, timeout / 4))
            with contextlib.suppress(errors.DmEnvRpcClientError):
                runner.run(_unmake_all(batch, timeout), timeout=timeout + 1.0)
        for env in batch.envs:
            env._closed = True
        shut_down(runner, batch._connections, batch._channels)
        batch._connections = []


async def _unmake_all(batch: AgentBatch, timeout: float) -> None:
    worlds = len(batch.envs) // batch.num_agents
    jobs = []
    for world in range(worlds):
        slots = batch.slots_of(world)
        name = batch.world_names[world] if batch._created[world] else None
        states = {batch._state[slot] for slot in slots}
        if states == {_LIVE}:
            streams = [batch._streams[slot] for slot in slots]
            jobs.append(unmake_world(streams, streams[0], name, timeout))
        elif name is not None and states & {_FAILED} and batch._open_stream is not None:
            jobs.append(batch._destroy_apart(str(batch.addresses[slots[0]]), name, timeout))
    if jobs:
        await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout)
