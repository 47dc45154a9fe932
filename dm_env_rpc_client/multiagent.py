"""Multi-agent worlds: one world's N agents over N connections, or M such worlds as one batch.

The protocol makes a multi-agent world with one CreateWorldRequest and one
JoinWorldRequest per agent, each on its own connection; a lockstep server answers
an agent's step only once every agent has acted, a turns server once the agents
before it have. Stepping agents one after another from one thread therefore
deadlocks (the first step waits for the second, which is never sent). Here every
agent's step is written at once, on the batch's one event loop, and no call waits
for one agent before sending another's::

    import dm_env_rpc_client as dmr

    with dmr.MultiAgentWorld.connect(address, num_agents=2, create_world_settings={"seed": 1}) as world:
        steps = world.reset()                       # {"agent_0": TimeStep, "agent_1": TimeStep}
        steps = world.step({"agent_0": {"paddle": 1}, "agent_1": {"paddle": -1}})

``MultiAgentWorld.connect`` creates the world once (or joins ``world_name``, one
made elsewhere, e.g. by a matchmaker), joins every agent (``join_world_settings``:
one mapping for all, or one per agent; the setting ``agent`` picks an agent by
index or role name and names it), and on ``close`` leaves every agent and destroys
the world it made.

``MultiAgentBatch`` is M such worlds at the batch's speed: a ``BatchedEnvironment``
whose slots are agents (slot ``w * num_agents + a`` is agent ``a`` of world ``w``),
so ``send``/``recv``/``step`` and ``dmr.collect``-style loops drive it as they
drive any batch, and ``step_agents`` / ``reset_agents`` / ``reset_worlds`` take and
give per-agent dicts. Its failure handling is the batch's, by world: a slot that
fails fails its whole world, not the batch; under ``on_world_failure="restart"``
the world is made again and all its agents rejoin (``_batch.agents``).

A step of one agent that is refused (the server's error, or an answer that does not
decode) raises a ``WorldError`` naming the world and agent, and the same round's
steps of the world's other agents are dropped with it: a world that goes on has
its agents in step (each one's next answer is to its next step).

Bad input is refused before anything is sent: actions for an agent that does not
exist, or none for a joined agent (every joined agent must act in a step), raise
``ArgumentValueError`` naming the agents; an action that does not fit its spec
raises before any agent's step is written. Every call is bounded: ``timeout`` for
opening, resets and closing, ``step_timeout`` (a world with steps in flight and no
answer for that long has failed, ``WorldTimeoutError``) for steps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import dm_env

from . import errors
from ._adaptor.core import _RUNNING, pack_settings
from ._adaptor.stacked import BatchedTimeStep, split_actions
from ._base import checks as _checks
from ._batch.agent_actions import check_agents, cut_by_agent, interleave
from ._batch.agent_opening import open_agent_batch
from ._batch.agents import AgentBatch, SiblingFailure, close_agents
from ._batch.options import ConnectionOptions, FailurePolicy, regroup
from ._batch.outcomes import _LIVE
from ._batch.undo import ask
from ._proto import dm_env_rpc_pb2

_AGENT_FAILED = "World {world} (agent {agent}) at {address} failed: {error}"
_CONNECT_KEYWORDS = (
    "num_worlds",
    "num_agents",
    "create_world_settings",
    "join_world_settings",
    "world_names",
    "world_name",
    "requested_observations",
    "timeout",
    "seed",
    "seed_setting",
    "connection",
    "failure_policy",
)


class MultiAgentBatch(AgentBatch):
    """M multi-agent worlds of N agents each, stepped as one batch. See the module docs.

    Attributes:
      agents: the agents' names, in slot order within a world.
      num_agents: agents per world.
      world_names: each world's name on its server.
      envs, addresses, failures, latencies: as ``BatchedEnvironment``'s, per agent slot.
    """

    # (len(failures), live worlds, their slots) when last worked out: see _slots.
    _live_slots: tuple[int, list[int], list[int]] | None = None
    _differ: bool | None = None  # whether the agents' observation specs differ; None: not known

    @classmethod
    @_checks.keywords_checked
    def connect(  # type: ignore[override]
        cls,
        addresses: str | Sequence[str],
        num_worlds: int | None = None,
        num_agents: int = 2,
        *,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
        world_names: Sequence[str] | None = None,
        requested_observations: Sequence[str] | None = None,
        timeout: float | None = 30.0,
        seed: int | None = None,
        seed_setting: str | None = "seed",
        connection: ConnectionOptions | None = None,
        failure_policy: FailurePolicy | None = None,
        **single: Any,
    ) -> MultiAgentBatch:
        """Creates ``num_worlds`` worlds (round-robin over ``addresses``) and joins
        ``num_agents`` agents to each, every agent over its own stream, all at once.

        Args:
          addresses: server addresses (``host:port``, ``unix:path``).
          num_worlds: how many worlds; default one per address (or per ``world_names``).
          num_agents: agents per world.
          create_world_settings: settings for every CreateWorldRequest.
          join_world_settings: one mapping for every agent, or a list of one per agent
            (``{"agent": 1}`` or ``{"agent": "agent_1"}`` picks an agent and names it).
          world_names: join these existing worlds (made elsewhere) instead of creating
            worlds; they are left, not destroyed, on close.
          requested_observations: observation names every agent returns; None: all.
          timeout: seconds for each server's answer while opening, resetting, closing.
          seed: world ``w`` is created with ``seed + w`` under ``seed_setting``.
          seed_setting: the create setting that carries the seed.
          connection: how the streams connect, a ``dmr.ConnectionOptions`` (credentials,
            channel options, metadata, ``wait_for_ready``, streams per connection, the
            largest answer), as for ``BatchedEnvironment.connect``.
          failure_policy: what a world's failure does, a ``dmr.FailurePolicy``
            (``on_world_failure``: ``"raise"`` or ``"restart"``, the world made again and
            all its agents rejoined; ``step_timeout``: 30 s by default; ``restart``).
          **single: any field of those two groups given alone (``step_timeout=10.0``,
            ``metadata=[...]``), as ``BatchedEnvironment.connect`` takes them; one given
            both alone and in its group is refused.

        Raises:
          ArgumentError: a bad argument (it is named).
          WorldError: naming the world that could not be made; nothing is left behind.
        """
        grouped, policy = regroup(
            "MultiAgentBatch.connect", connection, failure_policy, single, _CONNECT_KEYWORDS
        )
        return open_agent_batch(
            cls,
            addresses,
            num_worlds,
            num_agents,
            create_world_settings=create_world_settings,
            join_world_settings=join_world_settings,
            world_names=world_names,
            requested_observations=requested_observations,
            timeout=timeout,
            seed=seed,
            seed_setting=seed_setting,
            connection=grouped,
            failure_policy=policy,
        )

    @property
    def num_worlds(self) -> int:
        """How many worlds the batch opened (removed ones counted)."""
        return len(self.envs) // self.num_agents

    @property
    def live_worlds(self) -> list[int]:
        """The worlds still in the batch (all but removed ones), in order."""
        live = set(self.live_ids)
        return [w for w in range(self.num_worlds) if self.slots_of(w)[0] in live]

    def action_specs(self) -> dict[str, Any]:
        """Each agent's action spec, by agent name (from the first world)."""
        return {name: self.envs[a].action_spec() for a, name in enumerate(self.agents)}

    def observation_specs(self) -> dict[str, Any]:
        """Each agent's observation spec, by agent name (from the first world)."""
        return {name: self.envs[a].observation_spec() for a, name in enumerate(self.agents)}

    def _slots(self, world_ids: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """The worlds of ``world_ids`` (default every live one) and their agent slots, world by
        world. Every live world's are kept until the next failure (a world leaves the live
        ones only on a failure): ``world_ids`` that is that list itself takes them too."""
        known = self._live_slots
        fresh = known is not None and known[0] == len(self.failures)
        if known is not None and fresh and (world_ids is None or world_ids is known[1]):
            return known[1], known[2]
        worlds = self.live_worlds if world_ids is None else [int(w) for w in world_ids]
        slots = self._checked_ids([s for w in worlds for s in self.slots_of(w)])
        if world_ids is None:
            self._live_slots = (len(self.failures), worlds, slots)
        return worlds, slots

    def _by_agent(
        self, batch: BatchedTimeStep, worlds: Sequence[int] | None = None
    ) -> dict[str, BatchedTimeStep]:
        """``batch`` (of agent slots) cut by agent (``_batch.agent_actions.cut_by_agent``)."""
        if self._differ is None:  # whether the agents' observation specs differ
            first = self.envs[0].observation_spec()
            agents = range(1, self.num_agents)
            self._differ = any(self.envs[a].observation_spec() != first for a in agents)
        return cut_by_agent(batch, self.agents, worlds, self._differ)

    def _agent_error(self, error: errors.WorldError) -> errors.WorldError:
        """``error`` of an agent slot, as the error of its world naming the agent (the agent
        whose failure failed the world, for the others' answers)."""
        world, agent = divmod(error.index, self.num_agents)
        text = str(error).split(" failed: ", 1)[-1]
        if isinstance(error.__cause__, SiblingFailure) and text == str(error.__cause__):
            agent, text = error.__cause__.agent, str(error.__cause__.cause)
        text = _AGENT_FAILED.format(
            world=world, agent=self.agents[agent], address=error.address, error=text
        )
        wrapped = type(error)(text, world, error.address)
        wrapped.reset_steps = error.reset_steps
        return wrapped

    def send_agents(
        self, actions_by_agent: Mapping[str, Any], world_ids: Sequence[int] | None = None
    ) -> None:
        """Sends one step to every agent of each world of ``world_ids`` (default all live ones);
        returns at once. ``actions_by_agent[name]`` is that agent's actions stacked over the
        worlds (batch axis first), or a list of one action dict per world.

        Raises:
          ArgumentValueError: an unknown agent, or one without actions (nothing was sent).
          SpecValidationError, WorldError: as for ``BatchedEnvironment.send`` (nothing sent).
        """
        check_agents(actions_by_agent, self.agents)
        worlds, slots = self._slots(world_ids)
        stacked = (
            None
            if self._encoder is None
            else interleave(actions_by_agent, self.agents, len(worlds))
        )
        if stacked is not None:  # the batch's encoder: one NumPy copy per action name
            try:
                self.send(stacked, slots)
            except errors.WorldError as exc:
                raise self._agent_error(exc) from exc.__cause__
            return
        per_agent = [
            split_actions(actions_by_agent[name], len(worlds), self.envs[a].action_manager.names())
            for a, name in enumerate(self.agents)
        ]
        flat = [per_agent[a][w] for w in range(len(worlds)) for a in range(self.num_agents)]
        try:
            self.send(flat, slots)
        except errors.WorldError as exc:
            raise self._agent_error(exc) from exc.__cause__

    def recv_agents(
        self, world_ids: Sequence[int] | None = None, timeout: float | None = None
    ) -> dict[str, BatchedTimeStep]:
        """The oldest step of every agent of each world of ``world_ids``, by agent name
        (each a ``BatchedTimeStep`` whose ``env_ids`` are world indices).

        Raises:
          WorldError: a world failed or a step was refused, naming the world and agent.
        """
        worlds, slots = self._slots(world_ids)
        try:
            return self._by_agent(self.recv(len(slots), timeout=timeout, env_ids=slots), worlds)
        except errors.WorldError as exc:
            self._drop_round(exc.index, slots, timeout)
            raise self._agent_error(exc) from exc.__cause__

    def _drop_round(self, failed: int, slots: Sequence[int], timeout: float | None) -> None:
        """Agent slot ``failed``'s step was refused (a server's error, or an answer that does not
        decode) and its world goes on: the same round's steps of the world's other agents (of
        ``slots``) are taken and dropped too, so that its agents stay in step (the next round's
        answers are that round's for every agent). The other worlds' steps stay for the next
        ``recv``, as in any batch."""
        if self._state[failed] != _LIVE:
            return  # the world failed: its agents answer with the failure (SiblingFailure)
        wanted = set(slots)
        for slot in self.slots_of(failed // self.num_agents):
            if slot != failed and slot in wanted and self.in_flight(slot):
                with contextlib.suppress(errors.WorldError):  # its own error: dropped too
                    self.recv(1, timeout=timeout, env_ids=[slot])

    def step_agents(
        self, actions_by_agent: Mapping[str, Any], timeout: float | None = None
    ) -> dict[str, BatchedTimeStep]:
        """Steps every agent of every live world at once; each agent's steps, by name.

        Raises:
          ArgumentValueError, SpecValidationError: bad actions (nothing was sent).
          WorldError: a world failed or did not answer, naming the world and agent.
        """
        worlds, _ = self._slots(None)
        self.send_agents(actions_by_agent, worlds)
        return self.recv_agents(worlds, timeout)

    def reset_agents(
        self, world_ids: Sequence[int] | None = None, timeout: float | None = None
    ) -> dict[str, BatchedTimeStep]:
        """Resets every agent of the worlds (default every live one), all at once; their
        FIRST steps by agent name.

        Raises:
          WorldError: naming the first world and agent that failed to reset.
        """
        worlds, slots = self._slots(world_ids)
        try:
            return self._by_agent(self.reset(slots, timeout), worlds)
        except errors.WorldError as exc:
            raise self._agent_error(exc) from exc.__cause__

    def reset_worlds(
        self,
        settings: Mapping[str, Any] | None = None,
        world_ids: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> dict[str, BatchedTimeStep]:
        """Sends ResetWorldRequest (with ``settings``, e.g. a new seed) for each world, then
        steps every agent on: the steps the reset interrupted end (LAST), and each agent's
        FIRST step of the new sequence is returned, by agent name. A world with no episode
        running (just joined, or its episode ended) has its agents reset first, so the
        ResetWorld always interrupts a running sequence, whichever way its server answers
        a ResetWorld between episodes.

        Raises:
          DmEnvRpcError: a server refused the reset.
          WorldError: a world failed, naming it and the agent.
        """
        _checks.check_settings(settings, "settings")
        worlds, _ = self._slots(world_ids)
        packed = pack_settings(settings)
        wait = self.envs[0]._timeout if timeout is None else timeout
        assert self._runner is not None
        # A ResetWorld interrupts a running sequence. With none running (just joined, or the
        # episode ended) a server may still answer the next step INTERRUPTED (the reference
        # package's servers do), which no step type describes: such worlds start one first,
        # so that every server sees, and every agent answers, the same thing.
        idle = [w for w in worlds if not all(self._in_sequence(s) for s in self.slots_of(w))]
        if idle:
            self.reset_agents(idle, timeout)
        # From a stream joined to no world: a server may restart its caller's own agent at
        # once instead of interrupting it, so every agent is treated alike this way.
        self._runner.run(self._reset_from_aside(worlds, packed, wait), timeout=None)
        empty: dict[str, list[dict[str, Any]]] = {name: [{}] * len(worlds) for name in self.agents}
        steps = self.step_agents_of(empty, worlds, timeout)
        if any(step.last().any() for step in steps.values()):
            steps = self.step_agents_of(empty, worlds, timeout)
        return steps

    def _in_sequence(self, slot: int) -> bool:
        """Whether agent slot ``slot`` is in a running sequence (a step since its FIRST)."""
        return bool(self.envs[slot]._last_state == _RUNNING)

    async def _reset_from_aside(self, worlds: list[int], packed: Any, wait: float | None) -> None:
        """Sends each world's ResetWorldRequest over a stream of its own, all at once; raises
        the first refusal. Every call is bounded by ``wait``."""
        open_stream: Any = self._open_stream

        async def reset(world: int) -> None:
            address = str(self.addresses[self.slots_of(world)[0]])
            conn = await open_stream(address, wait)
            try:
                request = dm_env_rpc_pb2.ResetWorldRequest(
                    world_name=self.world_names[world], settings=packed
                )
                await ask(conn.async_connection, request, wait)
            finally:
                await conn.async_connection.aclose()

        outcomes = await asyncio.gather(*(reset(w) for w in worlds), return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed

    def step_agents_of(
        self, actions_by_agent: Mapping[str, Any], world_ids: Sequence[int], timeout: float | None
    ) -> dict[str, BatchedTimeStep]:
        """``step_agents`` for the worlds of ``world_ids`` only."""
        self.send_agents(actions_by_agent, world_ids)
        return self.recv_agents(world_ids, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Leaves every agent, destroys the worlds the batch made, and closes every stream.
        Idempotent; bounded by ``timeout`` (and gRPC's own 10 s to tear streams down)."""
        if not self._closed:
            close_agents(self, timeout)

    def __enter__(self) -> MultiAgentBatch:
        return self

    def __repr__(self) -> str:
        where = sorted({str(address) for address in self.addresses})
        return f"MultiAgentBatch({self.num_worlds} worlds x {self.num_agents} agents on {where})"


class MultiAgentWorld:
    """One multi-agent world's agents, each over its own connection. See the module docs.

    Make it with ``MultiAgentWorld.connect``. ``batch`` is the one-world
    ``MultiAgentBatch`` underneath (its ``failures``, ``latencies``, ``envs``).
    """

    def __init__(self, batch: MultiAgentBatch) -> None:
        self.batch = batch

    @classmethod
    @_checks.keywords_checked
    def connect(
        cls,
        address: str,
        num_agents: int = 2,
        *,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
        world_name: str | None = None,
        requested_observations: Sequence[str] | None = None,
        timeout: float | None = 30.0,
        connection: ConnectionOptions | None = None,
        failure_policy: FailurePolicy | None = None,
        **single: Any,
    ) -> MultiAgentWorld:
        """Creates a world on ``address`` (or joins ``world_name``) and joins ``num_agents``
        agents to it, each over its own connection, all at once.

        Args:
          address: the server's address.
          num_agents: how many agents to join.
          create_world_settings: the CreateWorldRequest's settings.
          join_world_settings: one mapping for every agent, or one per agent.
          world_name: join this world (made elsewhere) instead of creating one; it is
            left, not destroyed, on close.
          requested_observations: observation names every agent returns; None: all.
          timeout: seconds for each answer while opening, resetting and closing.
          connection: a ``dmr.ConnectionOptions``, as for ``MultiAgentBatch.connect``.
          failure_policy: a ``dmr.FailurePolicy``, as for ``MultiAgentBatch.connect``
            (``step_timeout``: the world has failed when a step gets no answer for
            that long).
          **single: a field of those groups given alone, as for ``MultiAgentBatch.connect``.

        Raises:
          ArgumentError: a bad argument (it is named).
          WorldError: the world could not be made or joined; nothing is left behind.
        """
        grouped, policy = regroup(
            "MultiAgentWorld.connect", connection, failure_policy, single, _CONNECT_KEYWORDS
        )
        batch = MultiAgentBatch.connect(
            address,
            1,
            num_agents,
            create_world_settings=create_world_settings,
            join_world_settings=join_world_settings,
            world_names=None if world_name is None else [world_name],
            requested_observations=requested_observations,
            timeout=timeout,
            connection=grouped,
            failure_policy=policy,
        )
        return cls(batch)

    @property
    def agents(self) -> list[str]:
        """The agents' names."""
        return self.batch.agents

    @property
    def world_name(self) -> str:
        """The world's name on its server (made again under a restart: its new one)."""
        return self.batch.world_names[0]

    def action_spec(self) -> dict[str, Any]:
        """Each agent's action spec, by agent name."""
        return self.batch.action_specs()

    def observation_spec(self) -> dict[str, Any]:
        """Each agent's observation spec, by agent name."""
        return self.batch.observation_specs()

    def _one(self, steps: dict[str, BatchedTimeStep]) -> dict[str, dm_env.TimeStep]:
        return {name: batch.at(0) for name, batch in steps.items()}

    def step(
        self, actions_by_agent: Mapping[str, Any], timeout: float | None = None
    ) -> dict[str, dm_env.TimeStep]:
        """Sends every agent's step at once and returns each agent's TimeStep, by name.

        Args:
          actions_by_agent: ``{agent name: action dict}`` for every agent.
          timeout: seconds to wait for the answers; None: bounded by ``step_timeout``.

        Raises:
          ArgumentValueError: an unknown agent, or one without an action (nothing sent).
          SpecValidationError: an action that does not fit (nothing sent).
          WorldError: the world failed or a step was refused (a server's error, e.g. its
            barrier's DEADLINE_EXCEEDED naming the agents that did not act).
        """
        check_agents(actions_by_agent, self.agents)
        stacked = {name: [action] for name, action in actions_by_agent.items()}
        return self._one(self.batch.step_agents(stacked, timeout))

    def reset(self, timeout: float | None = None) -> dict[str, dm_env.TimeStep]:
        """Resets every agent at once; their FIRST TimeSteps, by name.

        Raises:
          WorldError: an agent failed to reset.
        """
        return self._one(self.batch.reset_agents(None, timeout))

    def reset_world(
        self, settings: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, dm_env.TimeStep]:
        """ResetWorldRequest with ``settings``; then every agent's FIRST step of the new
        sequence, by name (the steps the reset interrupted end first).

        Raises:
          DmEnvRpcError: the server refused the reset.
          WorldError: the world failed.
        """
        return self._one(self.batch.reset_worlds(settings, None, timeout))

    def close(self, timeout: float = 10.0) -> None:
        """Leaves every agent and destroys the world (if this made it). Idempotent; bounded."""
        self.batch.close(timeout)

    def __enter__(self) -> MultiAgentWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MultiAgentWorld({self.world_name!r}, agents={self.agents})"
