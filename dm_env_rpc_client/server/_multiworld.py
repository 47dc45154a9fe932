"""A multi-agent world of the embedded server: agents' slots, lockstep rounds, turns, timeouts.

A ``MultiWorld`` owns one ``MultiAgentEnvironment`` and one ``Agent`` slot per
agent name, each with its ``WireSpecs``. Everything runs on the server's event
loop, so nothing here locks. ``submit(agent, request)`` takes an agent's
StepRequest and returns an ``asyncio.Future`` of its answer (wire bytes, or an
error response): the step waits, in lockstep, until every joined agent has
submitted one, or, in turns, until it is the agent's turn; a timer answers it
DEADLINE_EXCEEDED after ``timeout`` seconds, naming the agents it waited for,
without applying it.

Sequences (the protocol's states), per agent: ``playing`` is False until its
first step after joining, an episode's end, a ResetRequest or a ResetWorld; that
first step ignores its actions and answers RUNNING with the observation of a new
episode (``env.reset()`` when none runs) or of the running one (an agent that
joins late). ``interrupt`` marks an agent whose next step must answer INTERRUPTED
(ResetWorld from another connection); ``end`` holds, in turns, the LAST TimeStep
of an episode another agent's move ended, delivered on the agent's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import dm_env
import grpc
import numpy as np

from .._proto import dm_env_rpc_pb2
from ._worlds import ServerError, WireSpecs, error_response, step_response
from .multiagent import LOCKSTEP, TURNS, MultiAgentEnvironment

State = dm_env_rpc_pb2.EnvironmentStateType

_BAD_AGENTS = (
    "{env}.{method}() must give one entry per agent of agent_names() {names}; it gave {keys}."
)
_NOT_ALL_ENDED = (
    "{env}.step() ended the episode for {ended} but not for {going}: a multi-agent "
    "environment ends an episode for every agent at once."
)
_NO_SUCH_AGENT = "No agent {agent!r} in world {world!r}: its agents are {known}."
_AGENT_TAKEN = (
    "Agent {name!r} (index {index}) of world {world!r} is already joined by another "
    "connection. Join a free agent ({free}), or leave out the 'agent' setting to take the "
    "next free one."
)
_WORLD_FULL = (
    "World {world!r} is full: all {count} agents ({names}) are joined. Wait for one to "
    "leave (LeaveWorldRequest), or create another world."
)
_BAD_JOIN_SETTINGS = (
    "Unknown join settings {names}: a multi-agent world takes only 'agent' (an index or a "
    "name of {known})."
)
_TIMED_OUT = (
    "Agent {agent!r} of world {world!r} waited {timeout:g} s for {waited} to step "
    "({rule}); its step was not applied. Step every agent at once (one connection each, "
    "requests in flight together), or raise the server's agent_timeout "
    "(serve --agent-timeout)."
)
_RULES = {
    LOCKSTEP: "lockstep: a step completes when every joined agent has sent its StepRequest",
    TURNS: "turns: agents act one at a time in agent order",
}
_DESTROYED = "World {world!r} was destroyed while agent {agent!r} waited to step."


class Request:
    """One agent's StepRequest while it waits: decoded actions, observations asked, answer."""

    __slots__ = ("actions", "agent", "future", "timer", "uids")

    def __init__(
        self, agent: Agent, actions: Any, uids: list[int], future: asyncio.Future[Any]
    ) -> None:
        self.agent = agent
        self.actions = actions
        self.uids = uids
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class Agent:
    """One agent slot of a world: its specs, its connection, its sequence state."""

    def __init__(self, index: int, name: str, wire: WireSpecs) -> None:
        self.index = index
        self.name = name
        self.wire = wire
        self.session: object | None = None  # the joined connection's session
        self.playing = False  # in the running sequence (its next step's actions count)
        self.interrupt = False  # its next step answers INTERRUPTED (a ResetWorld)
        self.end: dm_env.TimeStep | None = None  # turns: a LAST to deliver on its next step
        self.pending: Request | None = None
        self.last: dm_env.TimeStep | None = None  # its newest TimeStep from the environment
        self.reward: Any = 0.0  # turns: reward earned by other agents' moves, not yet reported


def _names(agents: list[Agent]) -> str:
    return ", ".join(repr(agent.name) for agent in agents) or "(none)"


class MultiWorld:
    """One ``MultiAgentEnvironment`` behind the protocol (see the module docstring)."""

    def __init__(
        self,
        name: str,
        env: MultiAgentEnvironment,
        creator: object,
        timeout: float,
        like: MultiWorld | None = None,
    ) -> None:
        self.name = name
        self.env = env
        self.creator = creator
        self.timeout = timeout
        self.destroyed = False
        self.mode = env.mode
        if self.mode not in (LOCKSTEP, TURNS):
            raise ValueError(
                f"{type(env).__name__}.mode must be {LOCKSTEP!r} or {TURNS!r}, not {self.mode!r}."
            )
        names = tuple(env.agent_names())
        if not names or len(set(names)) != len(names):
            raise ValueError(
                f"{type(env).__name__}.agent_names() must give unique names, got {names!r}."
            )
        self.names = names
        spec_sets = [
            self._per_agent(method)
            for method in ("action_spec", "observation_spec", "reward_spec", "discount_spec")
        ]
        self.agents: list[Agent] = []
        for index, agent_name in enumerate(names):
            similar = like.agents[index].wire if like and index < len(like.agents) else None
            action, observation, reward, discount = (found[agent_name] for found in spec_sets)
            wire = WireSpecs(action, observation, reward, discount, like=similar)
            self.agents.append(Agent(index, agent_name, wire))
        self.by_name = {agent.name: agent for agent in self.agents}
        self.running = False  # an episode runs (reset() was called and it has not ended)
        self.turn = 0  # turns: the index from which the next turn is sought

    def _per_agent(self, method: str) -> Mapping[str, Any]:
        found = getattr(self.env, method)()
        self._check_keys(found, method)
        return found

    def _check_keys(self, found: Any, method: str) -> None:
        if not isinstance(found, Mapping) or set(found) != set(self.names):
            keys = sorted(found) if isinstance(found, Mapping) else type(found).__name__
            raise ServerError(
                grpc.StatusCode.INTERNAL,
                _BAD_AGENTS.format(
                    env=type(self.env).__name__, method=method, names=list(self.names), keys=keys
                ),
            )

    # --- joining and leaving ----------------------------------------------------------

    def joined(self) -> list[Agent]:
        """The agents joined now, in agent order."""
        return [agent for agent in self.agents if agent.session is not None]

    def join(self, session: object, settings: Mapping[str, Any]) -> Agent:
        """Joins ``session`` as the agent ``settings["agent"]`` names, or the first free one.

        Raises:
          ServerError: INVALID_ARGUMENT for an unknown setting or agent; ALREADY_EXISTS
            for a taken agent; RESOURCE_EXHAUSTED when every agent is joined.
        """
        known = ", ".join(f"{agent.index} ({agent.name})" for agent in self.agents)
        unknown = sorted(set(settings) - {"agent"})
        if unknown:
            names = ", ".join(repr(key) for key in unknown)
            raise ServerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                _BAD_JOIN_SETTINGS.format(names=names, known=known),
            )
        free = [agent for agent in self.agents if agent.session is None]
        if "agent" in settings:
            agent = self._find(settings["agent"], known)
            if agent.session is not None:
                raise ServerError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    _AGENT_TAKEN.format(
                        name=agent.name,
                        index=agent.index,
                        world=self.name,
                        free=_names(free) if free else "none is free",
                    ),
                )
        elif free:
            agent = free[0]
        else:
            raise ServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                _WORLD_FULL.format(
                    world=self.name, count=len(self.agents), names=_names(self.agents)
                ),
            )
        agent.session = session
        self._restart(agent)
        return agent

    def _find(self, wanted: Any, known: str) -> Agent:
        agent: Agent | None = None
        if isinstance(wanted, str):
            agent = self.by_name.get(str(wanted))
        elif (
            isinstance(wanted, (int, np.integer))
            and not isinstance(wanted, (bool, np.bool_))
            and 0 <= int(wanted) < len(self.agents)
        ):
            agent = self.agents[int(wanted)]
        if agent is None:
            shown = wanted.item() if isinstance(wanted, np.generic) else wanted
            raise ServerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                _NO_SUCH_AGENT.format(agent=shown, world=self.name, known=known),
            )
        return agent

    @staticmethod
    def _restart(agent: Agent) -> None:
        """The agent's next step starts a sequence."""
        agent.playing = agent.interrupt = False
        agent.end = None
        agent.reward = 0.0

    def leave(self, agent: Agent) -> None:
        """Frees the agent's slot; a step it had waiting is dropped; the others go on."""
        if agent.pending is not None:
            self._drop(agent.pending)
        agent.session = None
        self._restart(agent)
        if not self.joined():
            self.running = False  # the last agent left: the next one starts a new episode
        self._advance()

    def reset_agent(self, agent: Agent) -> None:
        """A ResetRequest: this agent's next step starts a sequence."""
        self._restart(agent)

    def reset_world(self, caller: object) -> None:
        """A ResetWorldRequest: every other joined agent's next step answers INTERRUPTED; the
        caller's own next step (if it is joined) starts the next sequence at once."""
        for agent in self.joined():
            if agent.session is caller:
                self._restart(agent)
            elif agent.playing:
                agent.interrupt, agent.end = True, None
        self.running = False
        self.turn = 0

    def destroy(self) -> None:
        """Destroys the world: every waiting step is answered NOT_FOUND; the env is closed."""
        self.destroyed = True
        for agent in self.agents:
            if agent.pending is not None:
                message = _DESTROYED.format(world=self.name, agent=agent.name)
                self._answer(agent.pending, error_response(grpc.StatusCode.NOT_FOUND, message))
        with contextlib.suppress(Exception):
            self.env.close()

    # --- stepping -----------------------------------------------------------------------

    def submit(self, agent: Agent, request: Any) -> asyncio.Future[Any]:
        """Takes the agent's StepRequest; returns the future of its answer.

        Raises:
          ServerError: INVALID_ARGUMENT for a bad action or observation UID (checked at
            once: a bad step never waits and never moves the world).
        """
        if agent.pending is not None:  # the session awaits each answer before the next request
            raise ServerError(
                grpc.StatusCode.FAILED_PRECONDITION, f"Agent {agent.name!r} has a step waiting."
            )
        wire = agent.wire
        wire.check_observation_uids(request.requested_observations)
        actions = None
        if agent.playing and not agent.interrupt and agent.end is None:
            actions = wire.decode_actions(request.actions)
        loop = asyncio.get_running_loop()
        waiting = Request(
            agent, actions, list(request.requested_observations), loop.create_future()
        )
        agent.pending = waiting
        waiting.timer = loop.call_later(self.timeout, self._expire, waiting)
        self._advance()
        return waiting.future

    def _advance(self) -> None:
        """Steps the world as far as the waiting requests allow."""
        if self.mode == LOCKSTEP:
            joined = self.joined()
            if joined and all(agent.pending is not None for agent in joined):
                self._round(joined)
            return
        while (holder := self._holder()) is not None and holder.pending is not None:
            self.turn = (holder.index + 1) % len(self.agents)
            self._turn(holder)

    def _holder(self) -> Agent | None:
        """Turns: the joined agent whose turn it is."""
        count = len(self.agents)
        for offset in range(count):
            agent = self.agents[(self.turn + offset) % count]
            if agent.session is not None:
                return agent
        return None

    def _waited_for(self, agent: Agent) -> list[Agent]:
        """The agents ``agent``'s step waits for now."""
        joined = self.joined()
        if self.mode == LOCKSTEP:
            return [other for other in joined if other.pending is None]
        before = []
        count = len(self.agents)
        for offset in range(count):
            other = self.agents[(self.turn + offset) % count]
            if other is agent:
                break
            if other.session is not None and other.pending is None:
                before.append(other)
        return before

    def _expire(self, waiting: Request) -> None:
        agent = waiting.agent
        if agent.pending is not waiting:
            return
        message = _TIMED_OUT.format(
            agent=agent.name,
            world=self.name,
            timeout=self.timeout,
            waited=_names(self._waited_for(agent)),
            rule=_RULES[self.mode],
        )
        self._answer(waiting, error_response(grpc.StatusCode.DEADLINE_EXCEEDED, message))

    def _drop(self, waiting: Request) -> None:
        if waiting.timer is not None:
            waiting.timer.cancel()
        if waiting.agent.pending is waiting:
            waiting.agent.pending = None
        if not waiting.future.done():
            waiting.future.cancel()

    def _answer(self, waiting: Request, answer: Any) -> None:
        if waiting.timer is not None:
            waiting.timer.cancel()
        if waiting.agent.pending is waiting:
            waiting.agent.pending = None
        if not waiting.future.done():
            waiting.future.set_result(answer)

    def _reply(self, agent: Agent, state: int, timestep: dm_env.TimeStep | None) -> None:
        """Answers the agent's waiting step with ``state`` and its observations."""
        waiting = agent.pending
        assert waiting is not None
        try:
            observations = (
                agent.wire.encode_observations(timestep, waiting.uids)
                if timestep is not None and waiting.uids
                else []
            )
        except ServerError as exc:
            self._answer(waiting, error_response(exc.code, str(exc)))
            return
        self._answer(waiting, step_response(state, observations))

    def _call(self, method: str, *args: Any) -> Mapping[str, dm_env.TimeStep]:
        """``env.reset()`` or ``env.step(actions)``, checked; every agent's newest TimeStep kept."""
        found = getattr(self.env, method)(*args)
        self._check_keys(found, method)
        for agent in self.agents:
            agent.last = found[agent.name]
        return found

    def _ended(self, timesteps: Mapping[str, dm_env.TimeStep]) -> bool:
        ended = [name for name in self.names if timesteps[name].step_type == dm_env.StepType.LAST]
        if ended and len(ended) != len(self.names):
            going = [name for name in self.names if name not in ended]
            raise ServerError(
                grpc.StatusCode.INTERNAL,
                _NOT_ALL_ENDED.format(env=type(self.env).__name__, ended=ended, going=going),
            )
        return bool(ended)

    def _first(self, agent: Agent) -> None:
        """Answers a first step: RUNNING with the agent's newest observation."""
        last = agent.last
        timestep = None if last is None else dm_env.restart(last.observation)
        agent.playing, agent.reward = True, 0.0
        self._reply(agent, State.RUNNING, timestep)

    def _finish(self, agent: Agent, timestep: dm_env.TimeStep) -> None:
        """Answers a step with ``timestep`` (its state from the step type)."""
        state: int = State.RUNNING
        if timestep.step_type == dm_env.StepType.LAST:
            discount = timestep.discount
            truncated = discount is not None and float(discount) > 0
            state = State.INTERRUPTED if truncated else State.TERMINATED
            agent.playing = False
        self._reply(agent, state, timestep)

    def _settled(self, agent: Agent) -> bool:
        """Answers the steps that need no environment call (INTERRUPTED, a held LAST)."""
        if agent.interrupt:
            self._restart(agent)
            last = agent.last
            timestep = None if last is None else dm_env.truncation(0.0, last.observation)
            self._reply(agent, State.INTERRUPTED, timestep)
            return True
        if agent.end is not None:
            end, agent.end = agent.end, None
            self._finish(agent, end)
            agent.reward = 0.0
            return True
        return False

    def _fail(self, agents: list[Agent], exc: Exception) -> None:
        if isinstance(exc, ServerError):
            code, message = exc.code, str(exc)
        else:
            code, message = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        for agent in agents:
            if agent.pending is not None:
                self._answer(agent.pending, error_response(code, message))

    def _round(self, joined: list[Agent]) -> None:
        """Lockstep: every joined agent has a step waiting; answers them (see the module)."""
        starting = [agent for agent in joined if not self._settled(agent) and not agent.playing]
        acting = [agent for agent in joined if agent.playing and agent.pending is not None]
        try:
            if not self.running and (starting or acting):
                self._call("reset")
                self.running = True
                starting += acting
                acting = []
            elif acting:
                timesteps = self._call("step", {a.name: a.pending.actions for a in acting})  # type: ignore[union-attr]
                ended = self._ended(timesteps)
                for agent in acting:
                    self._finish(agent, timesteps[agent.name])
                if ended:
                    self.running = False
                    return  # agents starting wait for the next episode: their steps stay
        except Exception as exc:
            self._fail(starting + acting, exc)
            return
        for agent in starting:
            self._first(agent)

    def _turn(self, agent: Agent) -> None:
        """Turns: the agent's step, on its turn (see the module)."""
        if self._settled(agent):
            return
        try:
            if not agent.playing:
                if not self.running:
                    self._call("reset")
                    self.running = True
                    for other in self.agents:
                        if other.end is None:
                            other.reward = 0.0
                self._first(agent)
                return
            waiting = agent.pending
            assert waiting is not None
            timesteps = self._call("step", {agent.name: waiting.actions})
            ended = self._ended(timesteps)
        except Exception as exc:
            self._fail([agent], exc)
            return
        for other in self.agents:
            found = timesteps[other.name]
            reward = other.reward if found.reward is None else other.reward + found.reward
            other.reward = reward
            if other is agent:
                continue
            if ended and other.session is not None and other.playing:
                other.end, other.reward = found._replace(reward=reward), 0.0
        own = timesteps[agent.name]
        agent.reward, reward = 0.0, agent.reward
        self._finish(agent, own._replace(reward=reward))
        if ended:
            self.running = False
