"""How a run on lockstep multi-agent worlds ends, and ResetWorld between episodes, on every server.

``dmr.collect`` on a ``MultiAgentBatch`` steps whole worlds (every agent of a world is sent its
step together), rounds ``steps`` up to whole world steps, and a stopped run receives the world
steps still in flight: at its end nothing is in flight, every agent of a world has taken the
same steps, and the next step of every agent completes its world's barrier (a half-stepped
world would leave it waiting until the server's barrier timeout). ``reset_world`` on a world
with no episode running (just joined, or ended) starts one first, so every server answers the
same. Each test runs against the foreign reference-package server (a Condition barrier), the
SDK's own ``Paddles`` and the Node.js @grpc/grpc-js server's lockstep worlds (skipped without
Node).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
from ma_foreign_server import foreign_server
from node_peer import NODE_SKIP_REASON, node_server

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.paddles import Paddles

BARRIER_S = 3.0  # the foreign server's bound on a waiting agent's step
AGENTS = 2


class Target(NamedTuple):
    address: str
    settings: dict[str, Any]  # a lockstep world of AGENTS agents there


_NODE = pytest.mark.skipif(NODE_SKIP_REASON is not None, reason=str(NODE_SKIP_REASON))


@pytest.fixture(params=["foreign", "sdk", pytest.param("node", marks=_NODE)])
def address(request: pytest.FixtureRequest) -> Iterator[Target]:
    lockstep = {"num_agents": AGENTS, "mode": "lockstep"}
    if request.param == "foreign":
        with foreign_server(barrier_timeout=BARRIER_S) as server:
            yield Target(server.address, lockstep)
    elif request.param == "sdk":
        with dmr.serve(Paddles, agent_timeout=BARRIER_S) as served:
            yield Target(served.address, lockstep)
    else:
        with node_server(agent_timeout=BARRIER_S) as node:
            yield Target(node.address, {"num_agents": AGENTS})


def _batch(target: Target, worlds: int = 2) -> dmr.MultiAgentBatch:
    return dmr.MultiAgentBatch.connect(
        target.address,
        worlds,
        AGENTS,
        create_world_settings=target.settings,
        seed=3,
        step_timeout=10.0,
    )


def _counting_policy(
    counts: Counter[int], then: Callable[[int], None] = lambda calls: None
) -> Callable[[dmr.BatchedTimeStep], dict[str, Any]]:
    calls = [0]

    def policy(timestep: dmr.BatchedTimeStep) -> dict[str, Any]:
        counts.update(timestep.env_ids.tolist())
        calls[0] += 1
        then(calls[0])
        return {"paddle": np.ones(len(timestep.env_ids), np.int8)}

    return policy


def _every_agent_steps_on(batch: dmr.MultiAgentBatch) -> None:
    """The next step of every agent of every world completes (no agent waits at a barrier)."""
    steps = batch.step_agents({name: [{}] * batch.num_worlds for name in batch.agents}, 10.0)
    assert sorted(steps) == batch.agents
    assert all(len(step.env_ids) == batch.num_worlds for step in steps.values())


@pytest.mark.parametrize("steps", [7, 8, 1])
def test_a_policy_run_ends_on_whole_world_steps(address, steps):
    counts: Counter[int] = Counter()
    with _batch(address) as batch:
        stats = dmr.collect(batch, steps=steps, policy=_counting_policy(counts), timeout=10.0)
        assert stats.steps == -(-steps // AGENTS) * AGENTS  # rounded up to whole world steps
        assert batch.pending() == 0
        for world in range(batch.num_worlds):  # the opening FIRST steps and every step sent
            assert len({counts[slot] for slot in batch.slots_of(world)}) == 1
        _every_agent_steps_on(batch)


@pytest.mark.parametrize("steps", [7, 40])
def test_a_random_run_gives_each_worlds_agents_the_same_share(address, steps):
    with _batch(address, worlds=3) as batch:
        stats = dmr.collect(batch, steps=steps, seed=2, timeout=10.0)
        assert stats.steps == -(-steps // AGENTS) * AGENTS
        assert batch.pending() == 0
        _every_agent_steps_on(batch)


def test_a_policy_run_in_rounds_counts_per_world_and_resumes_without_a_reset(address):
    """Per-world counts (equal for a world's agents) and ``resume=``: the RLlink client's rounds."""
    counts: Counter[int] = Counter()
    firsts: Counter[int] = Counter()

    class Firsts(dmr.RunObserver):
        def on_steps(self, timestep: dmr.BatchedTimeStep) -> None:
            firsts.update(timestep.env_ids[timestep.step_type == 0].tolist())

    with _batch(address, worlds=3) as batch:
        policy = _counting_policy(counts)
        kwargs: dict[str, Any] = {"policy": policy, "timeout": 10.0, "observers": [Firsts()]}
        first = dmr.collect(batch, [3, 3, 1, 1, 0, 0], **kwargs)
        assert first.steps == 8 and batch.pending() == 0
        assert [counts[slot] for slot in range(6)] == [3, 3, 1, 1, 0, 0]
        second = dmr.collect(batch, [2, 2, 4, 4, 1, 1], resume=first, **kwargs)
        assert second.steps == 14 and batch.pending() == 0
        assert [counts[slot] for slot in range(6)] == [5, 5, 5, 5, 1, 1]
        assert firsts == dict.fromkeys(range(6), 1)  # the opening reset's only: no second
        _every_agent_steps_on(batch)


def test_unequal_counts_for_a_worlds_agents_are_refused_by_name(address):
    with _batch(address) as batch:
        with pytest.raises(dmr.ArgumentValueError, match=r"steps\[3\] = 1 differs .*world 1"):
            dmr.collect(batch, [2, 2, 2, 1], timeout=10.0)
        assert batch.pending() == 0


def test_a_stopped_policy_run_takes_its_steps_in_flight_and_leaves_no_agent_waiting(address):
    stop = threading.Event()
    counts: Counter[int] = Counter()

    def stop_at(calls: int) -> None:
        if calls == 5:
            stop.set()

    with _batch(address, worlds=3) as batch:
        policy = _counting_policy(counts, stop_at)
        stats = dmr.collect(batch, steps=10_000, policy=policy, stop=stop, timeout=10.0)
        assert stats.interrupted and 0 < stats.steps < 10_000
        assert batch.pending() == 0
        assert stats.steps % AGENTS == 0
        _every_agent_steps_on(batch)


def test_a_stopped_random_run_leaves_no_agent_waiting(address):
    stop = threading.Event()
    seen = []

    class StopAfterTwo(dmr.RunObserver):
        def on_steps(self, timestep: dmr.BatchedTimeStep) -> None:
            seen.append(len(timestep.env_ids))
            if len(seen) == 2:
                stop.set()

    with _batch(address) as batch:
        stats = dmr.collect(batch, steps=10_000, stop=stop, observers=[StopAfterTwo()])
        assert stats.interrupted and stats.steps % AGENTS == 0
        assert batch.pending() == 0
        _every_agent_steps_on(batch)


def test_a_random_run_on_the_loop_stopped_from_another_thread_leaves_no_agent_waiting(address):
    """With no observer the run steps from the batch's loop thread (issue 36); ``stop`` set
    from another thread (as a signal handler would) still ends it on whole world steps."""
    stop = threading.Event()
    with _batch(address) as batch:

        def stop_once_stepping() -> None:
            deadline = time.monotonic() + 30
            while len(batch.latencies) < 4 * AGENTS and time.monotonic() < deadline:
                time.sleep(0.01)  # polling the run's progress, with a deadline
            stop.set()

        stopper = threading.Thread(target=stop_once_stepping)
        stopper.start()
        stats = dmr.collect(batch, steps=10**9, stop=stop, pipeline=8, timeout=10.0)
        stopper.join(30)
        assert stats.interrupted and 0 < stats.steps < 10**9 and stats.steps % AGENTS == 0
        assert batch.pending() == 0
        _every_agent_steps_on(batch)


def test_reset_world_right_after_joining_and_after_an_episode_ended(address):
    settings = {**address.settings, "seed": 1}
    with dmr.MultiAgentWorld.connect(
        address.address, AGENTS, create_world_settings=settings
    ) as world:
        first = world.reset_world({"seed": 7})  # no episode running yet
        assert all(step.first() for step in first.values())
        ball = np.argwhere(first["agent_0"].observation["board"][0])[0, 0]
        steps = first
        while not all(step.last() for step in steps.values()):
            steps = world.step({name: {"paddle": 0} for name in world.agents})
        again = world.reset_world({"seed": 7})  # the episode ended: none running
        assert all(step.first() for step in again.values())
        assert np.argwhere(again["agent_0"].observation["board"][0])[0, 0] == ball
        assert all(step.mid() for step in world.step({n: {} for n in world.agents}).values())
