"""Faults of multi-agent worlds: a dying agent stream, a barrier that never completes, a barrier
that gives up, and the parent SIGKILLed, against the foreign server (``ma_foreign_server``)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import process_gone, wait_for
from ma_foreign_server import ForeignServer, foreign_server

import dm_env_rpc_client as dmr

SETTINGS = {"num_agents": 2, "seed": 3}
ACTIONS = {"agent_0": {"paddle": 1}, "agent_1": {"paddle": 0}}


@pytest.fixture
def server() -> Iterator[ForeignServer]:
    with foreign_server(barrier_timeout=30.0) as running:
        yield running


def _nothing_left(server: ForeignServer) -> bool:
    return server.servicer.active_streams == 0 and not server.servicer.worlds


# --- one agent's stream dies mid-episode -------------------------------------------------------


def test_an_agent_stream_that_dies_fails_its_world_with_a_named_error(server):
    with dmr.MultiAgentWorld.connect(server.address, 2, create_world_settings=SETTINGS) as world:
        world.reset()
        world.step(ACTIONS)
        server.servicer.abort_agent = 1
        with pytest.raises(
            dmr.WorldError, match=r"World 0 \(agent agent_1\).*UNAVAILABLE"
        ) as caught:
            world.step(ACTIONS)
        assert caught.value.index == 0
        with pytest.raises(dmr.WorldError, match="failed before"):
            world.step(ACTIONS)
        assert [f.outcome for f in world.batch.failures] == ["raised", "raised"]
    assert wait_for(lambda: _nothing_left(server))  # the failed world destroyed on close


def test_a_failed_world_does_not_fail_the_batch(server):
    with dmr.MultiAgentBatch.connect(server.address, 2, 2, create_world_settings=SETTINGS) as batch:
        batch.reset_agents()
        server.servicer.abort_agent = 1  # the first agent 1 to step: world 0's or world 1's
        actions = {agent: {"paddle": np.zeros(2, np.int8)} for agent in batch.agents}
        with pytest.raises(dmr.WorldError) as caught:
            batch.step_agents(actions)
        healthy = 1 - caught.value.index
        for _ in range(3):
            steps = batch.step_agents_of(
                {agent: [{"paddle": 1}] for agent in batch.agents}, [healthy], None
            )
            assert steps["agent_1"].env_ids.tolist() == [healthy]
    assert wait_for(lambda: _nothing_left(server))


def test_under_restart_the_world_is_made_again_and_every_agent_rejoins(server):
    policy = dmr.RestartPolicy(attempts=3, backoff=0.05)
    with dmr.MultiAgentWorld.connect(
        server.address,
        2,
        create_world_settings=SETTINGS,
        on_world_failure="restart",
        restart=policy,
    ) as world:
        world.reset()
        world.step(ACTIONS)
        old_name = world.world_name
        server.servicer.abort_agent = 0
        steps = world.step(ACTIONS)  # answered by the new world's FIRST step of every agent
        assert all(step.first() for step in steps.values())
        assert world.world_name != old_name
        (failure,) = world.batch.failures
        assert failure.outcome == "restarted" and failure.steps_lost == 2
        assert wait_for(lambda: list(server.servicer.worlds) == [world.world_name])
        assert server.servicer.worlds[world.world_name].joined == {0, 1}
        for _ in range(3):
            assert all(step.mid() for step in world.step(ACTIONS).values())
    assert wait_for(lambda: _nothing_left(server))


def _restarting(server: ForeignServer, worlds: int) -> dmr.MultiAgentBatch:
    """``worlds`` two-agent worlds on ``server``, each made again when it fails."""
    return dmr.MultiAgentBatch.connect(
        server.address,
        worlds,
        2,
        create_world_settings=SETTINGS,
        on_world_failure="restart",
        restart=dmr.RestartPolicy(attempts=3, backoff=0.05),
        step_timeout=10.0,
    )


def test_a_policy_run_through_a_restart_counts_each_agents_own_lost_step(server):
    """``failures`` records the world's lost steps summed over its agents; each agent's FIRST
    step answers its own one (if any), so the run neither drops an action nor takes one twice."""
    sent: list[list[int]] = []

    def move(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
        sent.append(timestep.env_ids.tolist())
        if len(sent) == 6:
            server.servicer.abort_agent = 1  # mid-episode (Paddles' episodes are 9 steps)
        return {"paddle": np.ones(len(timestep.env_ids), np.int8)}

    with _restarting(server, 2) as batch:
        stats = dmr.collect(batch, [20, 20, 20, 20], policy=move, timeout=10.0)
        assert stats.steps == 80 and batch.pending() == 0
        (failure,) = batch.failures
        # 2: agent 0's answer (the server gives it as agent 1 leaves) was dropped with the
        # world; 1: it was received first (its FIRST then answers no step: the test below).
        assert failure.outcome == "restarted" and failure.steps_lost in (1, 2)
        counts = collections.Counter(slot for slots in sent for slot in slots)
        assert counts == {0: 20, 1: 20, 2: 20, 3: 20}
        steps = batch.step_agents(
            {agent: {"paddle": np.zeros(2, np.int8)} for agent in batch.agents}
        )
        assert all(len(step.env_ids) == 2 for step in steps.values())  # no agent left waiting
    assert wait_for(lambda: _nothing_left(server))


def test_an_agent_answered_before_its_world_failed_takes_the_new_worlds_first_step_too(server):
    """Agent 0's step came back and was received; agent 1's was lost with its stream. After
    the restart every agent's next step received is the new world's FIRST, flagged
    truncated (agent 0's answers no step sent), and the agents step on together: agent 0's
    next action is not the new world's second step with its FIRST unseen."""
    with _restarting(server, 1) as batch:
        batch.reset_agents()
        one = {agent: [{"paddle": 1}] for agent in batch.agents}
        batch.step_agents(one)
        server.servicer.abort_answered = 1  # agent 0 is answered; agent 1's answer is lost
        batch.send_agents(one)
        answered = batch.recv(1, timeout=10.0)
        assert answered.env_ids.tolist() == [0] and answered.step_type.tolist() == [1]
        server.servicer.release.set()
        firsts = batch.recv(1, timeout=10.0)
        assert sorted(firsts.env_ids.tolist()) == [0, 1]
        assert firsts.step_type.tolist() == [0, 0] and firsts.truncated.tolist() == [True, True]
        assert batch.pending() == 0
        (failure,) = batch.failures
        assert failure.outcome == "restarted" and failure.steps_lost == 1
        for _ in range(3):
            steps = batch.step_agents(one)
            for agent in batch.agents:
                assert steps[agent].step_type.tolist() == [1]
                assert not steps[agent].truncated.any()
    assert wait_for(lambda: _nothing_left(server))


def test_a_policy_run_through_a_restart_after_one_agents_answer_acts_on_both_firsts(server):
    """The same failure under ``dmr.collect`` with a policy: the agent whose answer came back
    is not acted for on that answer; both agents' FIRST steps go to the policy together."""
    seen: list[tuple[list[int], list[int]]] = []

    def move(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
        seen.append((timestep.env_ids.tolist(), timestep.step_type.tolist()))
        if len(seen) == 3:
            server.servicer.abort_answered = 1
        return {"paddle": np.ones(len(timestep.env_ids), np.int8)}

    class Release:
        def on_steps(self, timestep: dmr.BatchedTimeStep) -> None:
            if len(seen) >= 3 and timestep.env_ids.tolist() == [0]:  # agent 0's answer alone
                server.servicer.release.set()

        def on_event(self, event: object) -> None:
            pass

    with _restarting(server, 1) as batch:
        stats = dmr.collect(batch, [8, 8], policy=move, timeout=10.0, observers=[Release()])
        assert stats.steps == 16 and batch.pending() == 0
        (failure,) = batch.failures
        assert failure.outcome == "restarted"
        assert all(sorted(ids) == [0, 1] for ids, _ in seen)  # always both agents, together
        kinds = [step_types for _, step_types in seen]
        assert kinds[:4] == [[0, 0], [1, 1], [1, 1], [0, 0]]  # the reset, 2 steps, the restart
        assert all(step_types == [1, 1] for step_types in kinds[4:])
    assert wait_for(lambda: _nothing_left(server))


# --- a barrier that never completes; a barrier that gives up -----------------------------------


def test_a_server_that_never_completes_the_barrier_gets_a_bounded_named_timeout(server):
    with dmr.MultiAgentWorld.connect(
        server.address, 2, create_world_settings=SETTINGS, step_timeout=0.5
    ) as world:
        world.reset()
        server.servicer.stall = True
        with pytest.raises(dmr.WorldTimeoutError, match=r"World 0 \(agent agent_\d\).*0.5 s"):
            world.step(ACTIONS)
    server.servicer.stall = False
    assert wait_for(lambda: server.servicer.active_streams == 0)


def test_the_servers_barrier_timeout_names_the_agent_that_did_not_act():
    with foreign_server(barrier_timeout=1.0) as server, dmr.connect(server.address) as third:
        world = dmr.MultiAgentWorld.connect(
            server.address, 2, create_world_settings={"num_agents": 3}
        )
        with world:
            dmr.join_world(third, world.world_name, {"agent": 2})  # joined, never steps
            with pytest.raises(dmr.WorldError, match="did not act: agent_2"):
                world.reset()
            third.send(dmr.dm_env_rpc_pb2.LeaveWorldRequest())
            assert all(step.first() for step in world.reset().values())  # the world goes on


# --- the parent SIGKILLed ----------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    import dm_env_rpc_client as dmr
    world = dmr.MultiAgentWorld.connect(sys.argv[1], 2, world_name=sys.argv[2])
    print("joined", flush=True)
    world.reset()  # waits in the barrier for the third agent, which never acts
    """
)


def test_a_sigkilled_parent_leaves_nothing_running(server):
    with dmr.connect(server.address) as matchmaker:
        name = dmr.create_world(matchmaker, {"num_agents": 3})
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, server.address, name],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "joined"
            world = server.servicer.worlds[name]
            assert wait_for(lambda: server.servicer.steps_received >= 2, timeout=30)
            assert world.joined == {0, 1}
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            assert process_gone(child.pid)
            # Its agents' streams ended on the server, the barrier waiters woke and left.
            assert wait_for(lambda: server.servicer.active_streams == 1, timeout=15)
            assert world.joined == set()
        finally:
            child.kill()
            if child.stdout is not None:
                child.stdout.close()
        dmr.destroy_world(matchmaker, name)
    assert wait_for(lambda: _nothing_left(server))
