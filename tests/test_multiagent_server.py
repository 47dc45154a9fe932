"""The embedded server's multi-agent worlds, driven by real clients over loopback.

One ``dmr.connect`` per agent; steps that must meet in a lockstep round are sent with
``send_async`` so that they are in flight together (one thread stepping agents one after
another would wait on itself: that is the server's timeout, tested too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import dm_env
import grpc
import numpy as np
import pytest
from conftest import process_gone, wait_for
from dm_env import specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client import dm_env_rpc_pb2 as pb
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.multiagent import MultiAgentEnvironment
from dm_env_rpc_client.server.paddles import Paddles

RUNNING, TERMINATED, INTERRUPTED = pb.RUNNING, pb.TERMINATED, pb.INTERRUPTED
WAIT = 10.0  # seconds any answer may take (a hang guard, not a timing)
SHORT = 0.5  # the agent_timeout of servers whose timeouts are tested


@pytest.fixture
def server() -> Iterator[Server]:
    with serve(Paddles, agent_timeout=WAIT) as running:
        yield running


@pytest.fixture
def impatient() -> Iterator[Server]:
    with serve(Paddles, agent_timeout=SHORT) as running:
        yield running


class Agent:
    """One agent over its own connection, speaking raw protocol requests."""

    def __init__(self, address: str, world: str, **settings: Any) -> None:
        self.conn = dmr.connect(address, timeout=WAIT)
        join = pb.JoinWorldRequest(world_name=world, settings=_packed(settings))
        self.specs = self.conn.send(join).specs
        self.uids = {spec.name: uid for uid, spec in self.specs.observations.items()}
        self.action_uids = {spec.name: uid for uid, spec in self.specs.actions.items()}

    def step_async(self, move: int | None = None, **kwargs: Any) -> Any:
        actions = kwargs.pop("actions", None)
        if actions is None:
            actions = {} if move is None else {1: dmr.pack_tensor(np.int8(move))}
        request = pb.StepRequest(actions=actions, requested_observations=sorted(self.uids.values()))
        return self.conn.send_async(request)

    def observe(self, response: Any) -> dict[str, Any]:
        return {
            name: dmr.unpack_tensor(response.observations[uid]) for name, uid in self.uids.items()
        }

    def close(self) -> None:
        self.conn.close()


def _packed(settings: Mapping[str, Any]) -> dict[str, pb.Tensor]:
    return {key: dmr.pack_tensor(value) for key, value in settings.items()}


def _world(address: str, **settings: Any) -> tuple[dmr.Connection, str]:
    conn = dmr.connect(address, timeout=WAIT)
    return conn, conn.send(pb.CreateWorldRequest(settings=_packed(settings))).world_name


def step_all(agents: Sequence[Agent], moves: Sequence[int | None] | None = None) -> list[Any]:
    """Every agent's step in flight at once; their answers."""
    moves = moves or [None] * len(agents)
    futures = [agent.step_async(move) for agent, move in zip(agents, moves, strict=True)]
    return [future.result(timeout=WAIT) for future in futures]


def _ball(board: np.ndarray) -> tuple[int, int]:
    rows, columns = np.nonzero(board[:-1] == 1.0)
    return int(rows[0]), int(columns[0])


def _own_paddle(board: np.ndarray) -> int:
    return int(np.nonzero(board[-1] == 1.0)[0][-1])


def _error(future: Any) -> dmr.DmEnvRpcError:
    with pytest.raises(dmr.DmEnvRpcError) as caught:
        future.result(timeout=WAIT)
    return caught.value


# --- lockstep -------------------------------------------------------------------------------


def test_lockstep_each_agent_gets_its_own_observation_and_reward(server: Server) -> None:
    creator, name = _world(server.address, num_agents=3, seed=4)
    agents = [Agent(server.address, name) for _ in range(3)]
    first = step_all(agents)
    assert [r.state for r in first] == [RUNNING] * 3
    boards = [agent.observe(r)["board"] for agent, r in zip(agents, first, strict=True)]
    assert [_own_paddle(board) for board in boards] == [1, 2, 3]  # round((i+1)*4/4)
    assert all(agent.observe(r)["reward"] == 0 for agent, r in zip(agents, first, strict=True))
    column = _ball(boards[0])[1]
    # agent_0 chases the ball, the others stay: the ball lands after rows - 1 = 9 steps.
    states = []
    for _ in range(9):
        paddle = _own_paddle(agents[0].observe(first[0])["board"])
        chase = int(np.sign(column - paddle))
        first = step_all(agents, [chase, 0, 0])
        states.append(first[0].state)
    assert states == [RUNNING] * 8 + [TERMINATED]
    rewards = [float(agent.observe(r)["reward"]) for agent, r in zip(agents, first, strict=True)]
    catchers = [column == c for c in (column, 2, 3)]
    assert rewards[0] == pytest.approx(1.0 / sum(catchers))
    assert [r.state for r in first] == [TERMINATED] * 3
    # The step after the end starts the next episode, ignoring its actions (even a bad UID).
    bogus = {99: dmr.pack_tensor(np.int8(1))}
    futures = [agent.step_async(actions=bogus) for agent in agents]
    assert [f.result(timeout=WAIT).state for f in futures] == [RUNNING] * 3
    creator.close()


def test_a_step_waits_for_every_joined_agent_and_times_out_naming_the_missing(
    impatient: Server,
) -> None:
    creator, name = _world(impatient.address, num_agents=3)
    agents = [Agent(impatient.address, name) for _ in range(3)]
    step_all(agents)
    before = agents[0].observe(step_all(agents)[0])["board"]
    # agent_0 moves alone: agent_1 and agent_2 never step, so it is refused, not applied.
    error = _error(agents[0].step_async(-1))
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "'agent_1', 'agent_2'" in error.message and f"waited {SHORT:g} s" in error.message
    assert "lockstep" in error.message and "--agent-timeout" in error.message
    after = agents[0].observe(step_all(agents)[0])["board"]
    assert _own_paddle(after) == _own_paddle(before)  # the refused move did not happen
    assert _ball(after)[0] == _ball(before)[0] + 1  # one step, not two
    creator.close()


def test_a_waiting_step_holds_up_no_other_world(server: Server) -> None:
    creator, name = _world(server.address)
    waiting = Agent(server.address, name)
    Agent(server.address, name)  # joined, never steps
    pending = waiting.step_async()
    other_conn, other = _world(server.address)
    alone = Agent(server.address, other)  # a lockstep round of one
    for _ in range(20):
        assert alone.step_async(0).result(timeout=WAIT).state in (RUNNING, TERMINATED)
    assert not pending.done()
    creator.close()  # destroys the world: the waiting step is answered at once
    assert _error(pending).code == grpc.StatusCode.NOT_FOUND
    other_conn.close()


def test_a_bad_action_is_refused_at_once_without_waiting(server: Server) -> None:
    creator, name = _world(server.address)
    agents = [Agent(server.address, name) for _ in range(2)]
    step_all(agents)
    error = _error(agents[0].step_async(actions={1: dmr.pack_tensor(np.float32(1))}))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "'paddle'" in error.message
    error = _error(agents[0].step_async(actions={7: dmr.pack_tensor(np.int8(1))}))
    assert "Unknown action UID 7" in error.message
    assert [r.state for r in step_all(agents)] == [RUNNING, RUNNING]  # nothing was left waiting
    creator.close()


# --- turns ----------------------------------------------------------------------------------


def test_turns_go_in_agent_order_whatever_the_order_sent(server: Server) -> None:
    creator, name = _world(server.address, mode="turns", seed=1)
    first, second = Agent(server.address, name), Agent(server.address, name)
    late = second.step_async()  # sent first, but agent_1 acts after agent_0
    early = first.step_async()
    rows = [_ball(first.observe(early.result(timeout=WAIT))["board"])[0]]
    rows.append(_ball(second.observe(late.result(timeout=WAIT))["board"])[0])
    assert rows == [0, 0]  # first steps: no move, the ball has not fallen
    for _ in range(2):
        late, early = second.step_async(0), first.step_async(0)
        rows.append(_ball(first.observe(early.result(timeout=WAIT))["board"])[0])
        rows.append(_ball(second.observe(late.result(timeout=WAIT))["board"])[0])
    assert rows == [0, 0, 1, 2, 3, 4]  # the ball falls after each move, agent_0's first
    creator.close()


def test_turns_a_step_out_of_turn_times_out_naming_whose_turn_it_is(impatient: Server) -> None:
    creator, name = _world(impatient.address, mode="turns", num_agents=3)
    agents = [Agent(impatient.address, name) for _ in range(3)]
    step_all(agents)
    error = _error(agents[2].step_async(0))
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "'agent_0', 'agent_1'" in error.message and "turns" in error.message
    assert [r.state for r in step_all(agents, [0, 0, 0])] == [RUNNING] * 3
    creator.close()


def test_turns_an_episode_ended_by_another_agents_move_reaches_every_agent(server: Server) -> None:
    creator, name = _world(server.address, mode="turns", rows=3)
    agents = [Agent(server.address, name) for _ in range(2)]
    step_all(agents)
    # rows 3: the ball lands after two moves (agent_0's, then agent_1's).
    answers = step_all(agents, [0, 0])
    assert [a.state for a in answers] == [RUNNING, TERMINATED]
    answers = step_all(agents, [0, 0])  # agent_0 learns of the end; agent_1 starts the next
    assert [a.state for a in answers] == [TERMINATED, RUNNING]
    reward = float(agents[0].observe(answers[0])["reward"])
    assert reward in (-1.0, 0.0, 0.5, 1.0)
    creator.close()


def test_turns_a_leave_of_the_agent_whose_turn_it_is_passes_the_turn_on(server: Server) -> None:
    creator, name = _world(server.address, mode="turns", num_agents=3)
    agents = [Agent(server.address, name) for _ in range(3)]
    step_all(agents)
    waiting = agents[2].step_async(0)  # waits for agent_0, then agent_1
    agents[0].conn.send(pb.LeaveWorldRequest())
    assert agents[1].step_async(0).result(timeout=WAIT).state == RUNNING
    assert waiting.result(timeout=WAIT).state == RUNNING
    creator.close()


# --- joining ----------------------------------------------------------------------------------


def test_join_settings_pick_an_agent_and_refuse_a_taken_or_unknown_one(server: Server) -> None:
    creator, name = _world(server.address, num_agents=3)
    by_name = Agent(server.address, name, agent="agent_2")
    by_index = Agent(server.address, name, agent=0)
    taken = dmr.connect(server.address, timeout=WAIT)

    def join(**settings: Any) -> dmr.DmEnvRpcError:
        with pytest.raises(dmr.DmEnvRpcError) as caught:
            taken.send(pb.JoinWorldRequest(world_name=name, settings=_packed(settings)))
        return caught.value

    error = join(agent="agent_2")
    assert error.code == grpc.StatusCode.ALREADY_EXISTS
    assert "'agent_2'" in error.message and "'agent_1'" in error.message  # the free one
    error = join(agent=3)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "No agent 3" in error.message and "2 (agent_2)" in error.message
    assert join(agent="nobody").code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'team'" in join(team=1).message
    third = Agent(server.address, name)  # the next free one: agent_1
    answers = step_all([by_index, third, by_name])
    paddles = [
        _own_paddle(a.observe(r)["board"])
        for a, r in zip([by_index, third, by_name], answers, strict=True)
    ]
    assert paddles == [1, 2, 3]
    error = join()
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "is full" in error.message
    creator.close()


def test_agents_join_the_default_world_together(server: Server) -> None:
    agents = [Agent(server.address, "") for _ in range(2)]  # no CreateWorld: made on the spot
    assert [r.state for r in step_all(agents)] == [RUNNING, RUNNING]
    answers = step_all(agents, [0, 0])
    boards = [a.observe(r)["board"] for a, r in zip(agents, answers, strict=True)]
    assert [_own_paddle(board) for board in boards] == [1, 3]
    for agent in agents:
        agent.close()


def test_agents_may_have_specs_of_their_own() -> None:
    with serve(lambda settings: Mixed()) as server:
        creator, name = _world(server.address)
        pilot, gunner = Agent(server.address, name), Agent(server.address, name)
        assert [s.name for s in pilot.specs.actions.values()] == ["throttle"]
        assert sorted(s.name for s in gunner.specs.actions.values()) == ["aim.x", "aim.y"]
        step_all([pilot, gunner])
        futures = [
            pilot.step_async(actions={1: dmr.pack_tensor(np.float32(0.5))}),
            gunner.step_async(actions={1: dmr.pack_tensor(np.int32(2))}),
        ]
        answers = [f.result(timeout=WAIT) for f in futures]
        assert float(pilot.observe(answers[0])["speed"]) == 0.5
        assert int(gunner.observe(answers[1])["hits"]) == 2
        creator.close()


class Mixed(MultiAgentEnvironment):
    """Two agents with different specs: a pilot (float throttle) and a gunner (int aim)."""

    def agent_names(self) -> tuple[str, str]:
        return ("pilot", "gunner")

    def action_spec(self) -> dict[str, Any]:
        return {
            "pilot": {"throttle": specs.BoundedArray((), np.float32, 0, 1, name="throttle")},
            "gunner": {
                "aim": {
                    "x": specs.Array((), np.int32, name="aim.x"),
                    "y": specs.Array((), np.int32, name="aim.y"),
                }
            },
        }

    def observation_spec(self) -> dict[str, Any]:
        return {
            "pilot": {"speed": specs.Array((), np.float32, name="speed")},
            "gunner": {"hits": specs.Array((), np.int64, name="hits")},
        }

    def _timesteps(self, kind: Any, speed: float, hits: int) -> dict[str, dm_env.TimeStep]:
        return {
            "pilot": kind({"speed": np.float32(speed)}),
            "gunner": kind({"hits": np.int64(hits)}),
        }

    def reset(self) -> dict[str, dm_env.TimeStep]:
        return self._timesteps(dm_env.restart, 0.0, 0)

    def step(self, actions: Mapping[str, Any]) -> dict[str, dm_env.TimeStep]:
        speed = float(actions["pilot"]["throttle"])
        hits = int(actions["gunner"]["aim"]["x"])
        return self._timesteps(lambda obs: dm_env.transition(0.0, obs), speed, hits)


class Unfair(Mixed):
    """Ends the episode for the pilot alone: against the rules."""

    def step(self, actions: Mapping[str, Any]) -> dict[str, dm_env.TimeStep]:
        return {
            "pilot": dm_env.termination(1.0, {"speed": np.float32(0)}),
            "gunner": dm_env.transition(0.0, {"hits": np.int64(0)}),
        }


class Nameless(Mixed):
    """Specs for an agent it does not have: against the rules."""

    def observation_spec(self) -> dict[str, Any]:
        return {"pilot": {}, "stranger": {}}


def test_an_environment_that_breaks_the_rules_is_named_in_the_error() -> None:
    with serve(lambda settings: Unfair()) as server:
        creator, name = _world(server.address)
        agents = [Agent(server.address, name) for _ in range(2)]
        step_all(agents)
        futures = [agent.step_async(actions={}) for agent in agents]
        for future in futures:
            error = _error(future)
            assert error.code == grpc.StatusCode.INTERNAL
            assert "ended the episode for ['pilot'] but not for ['gunner']" in error.message
        creator.close()
    refused = pytest.raises(dmr.DmEnvRpcError, match=r"Nameless.observation_spec\(\) must give")
    with serve(lambda settings: Nameless()) as server, dmr.connect(server.address) as conn, refused:
        conn.send(pb.CreateWorldRequest())


# --- the reference's rules ------------------------------------------------------------------


def test_reset_world_from_any_connection_interrupts_every_joined_agent(server: Server) -> None:
    creator, name = _world(server.address, seed=2)
    agents = [Agent(server.address, name) for _ in range(2)]
    step_all(agents)
    step_all(agents, [1, -1])
    seeded = pb.ResetWorldRequest(world_name=name, settings=_packed({"seed": 9}))
    creator.send(seeded)  # the matchmaker: not joined
    assert [r.state for r in step_all(agents, [1, 1])] == [INTERRUPTED, INTERRUPTED]
    restarted = step_all(agents, [1, 1])
    assert [r.state for r in restarted] == [RUNNING, RUNNING]
    column = _ball(agents[0].observe(restarted[0])["board"])[1]
    assert column == Paddles(seed=9).reset()["agent_0"].observation["board"][0].argmax()
    # From a joined agent: the others are interrupted; its own next step starts a sequence.
    agents[0].conn.send(pb.ResetWorldRequest(world_name=name))
    assert [r.state for r in step_all(agents)] == [RUNNING, INTERRUPTED]
    assert [r.state for r in step_all(agents)] == [RUNNING, RUNNING]
    creator.close()


def test_destroy_world_from_a_joined_connection_is_refused(server: Server) -> None:
    creator, name = _world(server.address)
    agents = [Agent(server.address, name) for _ in range(2)]
    with pytest.raises(dmr.DmEnvRpcError, match="joined by this connection") as caught:
        agents[0].conn.send(pb.DestroyWorldRequest(world_name=name))
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(dmr.DmEnvRpcError, match="joined by another connection"):
        creator.send(pb.DestroyWorldRequest(world_name=name))
    assert [r.state for r in step_all(agents)] == [RUNNING, RUNNING]  # it goes on
    for agent in agents:
        agent.conn.send(pb.LeaveWorldRequest())
    creator.send(pb.DestroyWorldRequest(world_name=name))
    creator.close()


def test_a_leave_frees_the_slot_and_the_others_go_on(server: Server) -> None:
    creator, name = _world(server.address, num_agents=3)
    agents = [Agent(server.address, name) for _ in range(3)]
    step_all(agents)
    waiting = [agents[0].step_async(0), agents[1].step_async(0)]
    agents[2].conn.send(pb.LeaveWorldRequest())  # the round no longer waits for agent_2
    assert [f.result(timeout=WAIT).state for f in waiting] == [RUNNING, RUNNING]
    assert [r.state for r in step_all(agents[:2], [0, 0])] == [RUNNING, RUNNING]
    # Rejoining takes the free slot; its first step joins the running episode.
    agents[2].conn.send(pb.JoinWorldRequest(world_name=name))
    answers = step_all(agents, [0, 0, 1])
    assert [r.state for r in answers] == [RUNNING] * 3
    row = _ball(agents[0].observe(answers[0])["board"])[0]
    assert _ball(agents[2].observe(answers[2])["board"])[0] == row == 3
    assert _own_paddle(agents[2].observe(answers[2])["board"]) == 3  # its move was ignored
    # A connection that ends leaves too.
    agents[1].close()
    assert [r.state for r in step_all([agents[0], agents[2]], [0, 0])] == [RUNNING, RUNNING]
    creator.close()


def test_a_reset_request_restarts_only_its_agent(server: Server) -> None:
    creator, name = _world(server.address)
    agents = [Agent(server.address, name) for _ in range(2)]
    step_all(agents)
    step_all(agents, [0, 0])
    reset = agents[1].conn.send(pb.ResetRequest())
    assert reset.specs == agents[1].specs
    answers = step_all(agents, [0, 1])
    assert [r.state for r in answers] == [RUNNING, RUNNING]
    assert _own_paddle(agents[1].observe(answers[1])["board"]) == 3  # its action ignored
    with pytest.raises(dmr.DmEnvRpcError, match="ResetWorldRequest"):
        agents[1].conn.send(pb.ResetRequest(settings=_packed({"seed": 1})))
    creator.close()


# --- settings, serving ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "words"),
    [({"num_agents": 5}, "2 to 4"), ({"mode": "chaos"}, "'lockstep' or 'turns'")],
)
def test_bad_paddles_settings_are_named(server: Server, settings: dict, words: str) -> None:
    with (
        dmr.connect(server.address, timeout=WAIT) as conn,
        pytest.raises(dmr.DmEnvRpcError) as caught,
    ):
        conn.send(pb.CreateWorldRequest(settings=_packed(settings)))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in caught.value.message and "Paddles" in caught.value.message


def test_paddles_is_seeded() -> None:
    def columns(seed: int) -> list[int]:
        game = Paddles(seed=seed)
        return [int(game.reset()["agent_0"].observation["board"][0].argmax()) for _ in range(8)]

    assert columns(3) == columns(3) != columns(4)


def test_serve_refuses_a_bad_agent_timeout_and_an_environment_instance() -> None:
    with pytest.raises(dmr.ArgumentValueError, match="agent_timeout"):
        serve(Paddles, agent_timeout=0)
    with pytest.raises(dmr.ArgumentTypeError, match="Paddles"):
        serve(Paddles())  # type: ignore[arg-type]


def test_serve_game_paddles_from_the_command_line() -> None:
    command = [sys.executable, "-m", "dm_env_rpc_client", "serve", "--game", "paddles"]
    process = subprocess.Popen(
        [*command, "--agent-timeout", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("Serving paddles on 127.0.0.1:"), line
        address = line.split()[3]
        creator, name = _world(address)
        agents = [Agent(address, name) for _ in range(2)]
        assert [r.state for r in step_all(agents)] == [RUNNING, RUNNING]
        assert "waited 0.5 s" in _error(agents[0].step_async(0)).message
        creator.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.wait()


PARENT = """
import sys, time
from dm_env_rpc_client.server._subprocess import server_subprocess
with server_subprocess("paddles") as server:
    print(server.process.pid, server.address, flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux)")
def test_a_sigkilled_parent_leaves_no_paddles_server_running() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid, address = parent.stdout.readline().split()
        creator, name = _world(address)
        agent, _idle = Agent(address, name), Agent(address, name)
        pending = agent.step_async()  # the idle agent never steps: it waits in the server
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=60)
        assert wait_for(lambda: process_gone(int(pid)), timeout=30), f"server {pid} outlived it"
        with pytest.raises(dmr.DmEnvRpcClientError):
            pending.result(timeout=WAIT)
        creator.close()
    finally:
        parent.kill()
        parent.wait()
