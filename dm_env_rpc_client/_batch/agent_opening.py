"""Opening M multi-agent worlds of N agents each, for ``MultiAgentBatch.connect``.

Every agent gets its own stream on one background event loop (``_batch.streams``:
streams to one address share channels, as a ``BatchedEnvironment``'s do). Each world is made by
``_batch.agents.make_world``: created once on its first agent's stream (or a
named world taken), then every agent joined at once; up to
``OPENING_PER_SERVER`` streams are being opened at a time per server. All or
nothing: if a world cannot be made, the worlds made are left and destroyed
(``unmake_world``) and everything opened is shut down before the error is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .. import errors
from .._base import checks as _checks
from .._base import collector
from .._transport.loop import LoopConnection
from ..environment import DmEnvAdaptor
from . import restart as _restart
from .agents import AGENT_SETTING, AgentBatch, Made, WorldPlan, make_world, unmake_world
from .closing import shut_down
from .opening import _adaptor_like, equip
from .options import ConnectionOptions, FailurePolicy
from .outcomes import _NAMES_COUNT, _SEED_TWICE, _WORLD_FAILED
from .restart import RestartPolicy
from .streams import OPENING_PER_SERVER, start_streams

Batch = TypeVar("Batch", bound=AgentBatch)
_NO_ADDRESS = "addresses is empty: give at least one server address, e.g. ['127.0.0.1:50051']."
_JOIN_COUNT = (
    "join_world_settings holds {given} settings for {agents} agents: give one mapping per "
    "agent, or one mapping for all of them."
)
_SAME_NAME = (
    "Two agents are both named {name!r} (from their join settings' 'agent'); give each agent "
    "its own 'agent' setting, or leave it out to take the next free agent."
)


def agent_names(join_settings: Sequence[Mapping[str, Any] | None]) -> list[str]:
    """Each agent's name: its join setting ``agent`` (``"agent_<k>"`` for an index ``k``, a role
    name as it is); an agent without one (the server gives it the next free agent) is
    labelled with the lowest ``"agent_<k>"`` no other agent is named.

    Raises:
      ValueError: two agents pick the same agent.
    """
    picked: list[str | None] = []
    for settings in join_settings:
        value = (settings or {}).get(AGENT_SETTING)
        picked.append(
            None if value is None else value if isinstance(value, str) else f"agent_{int(value)}"
        )
    named = [name for name in picked if name is not None]
    for position, name in enumerate(named):
        if name in named[:position]:
            raise errors.ArgumentValueError(_SAME_NAME.format(name=name))
    free = (f"agent_{k}" for k in range(len(picked) * 2) if f"agent_{k}" not in named)
    return [name if name is not None else next(free) for name in picked]


def per_agent_settings(
    join_world_settings: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None,
    num_agents: int,
) -> tuple[Mapping[str, Any] | None, ...]:
    """``join_world_settings`` as one mapping (or None) per agent.

    Raises:
      ValueError: a list of the wrong length. ArgumentTypeError: not mappings.
    """
    if join_world_settings is None or isinstance(join_world_settings, Mapping):
        return (join_world_settings,) * num_agents
    if isinstance(join_world_settings, str) or not isinstance(join_world_settings, Sequence):
        _checks.check_settings(join_world_settings, "join_world_settings")
    settings = tuple(join_world_settings)
    if len(settings) != num_agents:
        raise errors.ArgumentValueError(_JOIN_COUNT.format(given=len(settings), agents=num_agents))
    for one in settings:
        _checks.check_settings(one, "join_world_settings[...]")
    return settings


def open_agent_batch(
    cls: type[Batch],
    addresses: str | Sequence[str],
    num_worlds: int | None,
    num_agents: int,
    *,
    create_world_settings: Mapping[str, Any] | None,
    join_world_settings: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None,
    world_names: Sequence[str] | None,
    requested_observations: Sequence[str] | None,
    timeout: float | None,
    seed: int | None,
    seed_setting: str | None,
    connection: ConnectionOptions,
    failure_policy: FailurePolicy,
) -> Batch:
    """``MultiAgentBatch.connect`` (its arguments and errors are documented there), with both
    groups of keywords whole (``_batch.options.regroup``)."""
    on_world_failure, step_timeout, restart = failure_policy
    _restart.check_policy(on_world_failure)
    if isinstance(addresses, str):
        addresses = [addresses]
    for address in addresses:
        _checks.check_address(address, "addresses")
    _checks.check_count(num_agents, "num_agents")
    if num_worlds is not None:
        _checks.check_count(num_worlds, "num_worlds")
    _checks.check_seconds(timeout)
    _checks.check_seconds(step_timeout, "step_timeout")
    _checks.check_settings(create_world_settings, "create_world_settings")
    if restart is not None:
        _checks.check_count(restart.attempts, "RestartPolicy.attempts")
    joins = per_agent_settings(join_world_settings, num_agents)
    names = agent_names(joins)
    count = (
        (len(world_names) if world_names is not None else 1) if num_worlds is None else num_worlds
    )
    if world_names is not None and len(world_names) != count:
        raise errors.ArgumentValueError(_NAMES_COUNT.format(names=len(world_names), count=count))
    if not addresses:
        raise errors.ArgumentValueError(_NO_ADDRESS)
    seeded = seed is not None and world_names is None and seed_setting is not None
    if seeded and seed_setting in (create_world_settings or {}):
        raise errors.ArgumentValueError(_SEED_TWICE.format(name=seed_setting))
    requested = None if requested_observations is None else tuple(requested_observations)
    plans, seeds = [], []
    for world in range(count):
        settings = dict(create_world_settings or {})
        if seeded:
            settings[str(seed_setting)] = seed + world  # type: ignore[operator]
        seeds.append(seed + world if seeded else None)  # type: ignore[operator]
        name = None if world_names is None else world_names[world]
        plans.append(WorldPlan(settings, joins, name, timeout, requested))
    where = [addresses[world % len(addresses)] for world in range(count)]
    runner, channels, open_stream = start_streams(
        "dm_env_rpc_client-multiagent", addresses, count * num_agents, timeout, connection
    )
    opened: list[list[LoopConnection]] = [[] for _ in range(count)]
    made: list[Made | None] = [None] * count

    async def open_one(world: int, gate: asyncio.Semaphore) -> Made:
        async with gate:
            for _ in range(num_agents):
                opened[world].append(await open_stream(where[world], first=True))
            streams = [conn.async_connection for conn in opened[world]]
            made[world] = await make_world(streams, plans[world], timeout)
            return made[world]  # type: ignore[return-value]

    async def undo_made() -> None:
        jobs = []
        for world, result in enumerate(made):
            if result is not None:
                streams = [conn.async_connection for conn in opened[world]]
                name = result.name if world_names is None else None
                jobs.append(unmake_world(streams, streams[0], name, timeout))
        await asyncio.gather(*jobs, return_exceptions=True)

    async def open_all() -> list[Any]:
        worlds_at_once = max(1, OPENING_PER_SERVER // num_agents)
        gates = {address: asyncio.Semaphore(worlds_at_once) for address in set(where)}
        tasks = [open_one(world, gates[where[world]]) for world in range(count)]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)  # each one bounded
        if any(isinstance(outcome, BaseException) for outcome in outcomes):
            await undo_made()
        return outcomes

    connections = lambda: [conn for world in opened for conn in world]  # noqa: E731
    try:
        with collector.paused(keep=True):  # its worlds live on (_base.collector)
            outcomes = runner.run(open_all())
            failed = next((w for w, o in enumerate(outcomes) if isinstance(o, BaseException)), None)
            if failed is not None:
                error = outcomes[failed]
                if not isinstance(error, errors.DmEnvRpcClientError):
                    raise error
                text = _WORLD_FAILED.format(index=failed, address=where[failed], error=error)
                raise errors.WorldError(text, failed, where[failed]) from error
            envs = _adaptors(opened, outcomes, timeout, requested)
    except BaseException:
        if not runner.closed and any(result is not None for result in made):
            runner.run(undo_made(), timeout=None if timeout is None else timeout + 1.0)
        shut_down(runner, connections(), channels)
        raise
    slot_addresses = [where[slot // num_agents] for slot in range(len(envs))]
    batch = cls(envs, slot_addresses, connections=connections())
    batch.num_agents = num_agents
    batch.agents = names
    batch.world_names = [outcome.name for outcome in outcomes]
    batch.world_seeds = [seeds[slot // num_agents] for slot in range(len(envs))]
    batch._plans = plans
    batch._created = [world_names is None] * count
    batch._first_answers = {}
    if seed is not None:
        batch._actions_rng = np.random.default_rng(seed)
    equip(batch, runner, channels, connections(), open_stream)
    batch._policy = on_world_failure
    batch._restart_policy = restart or RestartPolicy()
    batch._step_timeout = step_timeout
    if step_timeout is not None:
        runner.call(batch._watch)
    return batch


def _adaptors(
    opened: list[list[LoopConnection]],
    made: list[Any],
    timeout: float | None,
    requested: tuple[str, ...] | None,
) -> list[DmEnvAdaptor]:
    """One adaptor per agent, world-major; agents with alike specs share the spec machinery.

    Raises:
      UnknownNameError: a requested observation an agent does not have.
    """
    envs: list[DmEnvAdaptor] = []
    template: DmEnvAdaptor | None = None
    for connections, world in zip(opened, made, strict=True):
        for conn, specs in zip(connections, world.specs, strict=True):
            if template is not None and specs == template._wire_specs:
                envs.append(_adaptor_like(template, conn, world.name))
                continue
            env = DmEnvAdaptor(
                conn,
                specs,
                world_name=world.name,
                timeout=timeout,
                requested_observations=requested,
            )
            template = template or env
            envs.append(env)
    return envs
