"""The pipelined autoreset of SAME_STEP and SB3's BatchedVecEnv: sent once, early, and safely.

The batch's loop sends a world whose step lands LAST its autoreset step at once
(``BatchCore._autoreset``). A recording server checks, world by world, that the
reset is taken inside the vector step on which the world ended (not late) and
exactly once (not twice); a server that dies on the autoreset step checks the
error paths.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from faulty import stalling_reset_server
from gymnasium.vector import AutoresetMode
from vector_helpers import Recording, over_two_servers

from dm_env_rpc_client import errors
from dm_env_rpc_client.batched import BatchedEnvironment, RestartPolicy
from dm_env_rpc_client.integrations.gymnasium import GymnasiumVectorEnv
from dm_env_rpc_client.server import serve

SAME_STEP = AutoresetMode.SAME_STEP
DYING = "tests.vector_helpers:dying_at_autoreset"


def _check_each_world_reset_within_its_ending_step(step: Any, pending: Any, steps: int) -> None:
    """``step()`` returns each world's done flags; the server log must follow them exactly."""
    before = {world: len(calls) for world, calls in Recording.calls.items()}
    ends = np.zeros(4, int)
    for number in range(1, steps + 1):
        done = step()
        # Even worlds end every 2 steps (truncated), odd ones every 3: ends do not line up.
        assert done.tolist() == [number % (2 + world % 2) == 0 for world in range(4)], number
        ends += done
        for world in range(4):
            calls = Recording.calls[world]
            # One server step per world per step(), plus the reset of a world that ended.
            assert len(calls) == before[world] + number + ends[world], (world, calls)
            assert calls[-1] == ("reset" if done[world] else "step"), (world, number, calls)
        assert pending() == 0  # no autoreset step left over (nor a second one on its way)
    assert ends.tolist() == [steps // 2, steps // 3, steps // 2, steps // 3]


def test_same_step_resets_each_world_once_within_the_step_it_ended() -> None:
    Recording.calls = {}
    with serve(lambda settings: Recording(**settings)) as server:
        envs = GymnasiumVectorEnv(
            addresses=[server.address],
            num_envs=4,
            autoreset_mode=SAME_STEP,
            connect_kwargs={"seed": 100},
        )
        envs.reset()
        assert envs.batch._autoreset
        zeros = {"paddle": np.zeros(4, np.int8)}

        def step() -> np.ndarray:
            observations, _, terminations, truncations, infos = envs.step(zeros)
            done = terminations | truncations
            assert infos.get("_final_obs", np.zeros(4, bool)).tolist() == done.tolist()
            assert (observations["board"][done, 0].max(axis=1) == 1.0).all()  # ball on top
            return done

        _check_each_world_reset_within_its_ending_step(step, envs.batch.pending, 12)
        envs.close()


@pytest.mark.training
def test_sb3_vec_env_resets_each_world_once_within_the_step_it_ended() -> None:
    sb3 = pytest.importorskip("dm_env_rpc_client.integrations.sb3")
    Recording.calls = {}
    with serve(lambda settings: Recording(**settings)) as server:
        envs = sb3.BatchedVecEnv(
            addresses=[server.address], num_envs=4, connect_kwargs={"seed": 100}
        )
        envs.reset()

        def step() -> np.ndarray:
            observations, _, dones, infos = envs.step(np.ones(4, np.int64))  # paddle 0
            assert ["terminal_observation" in info for info in infos] == dones.tolist()
            assert (observations[dones, 0].max(axis=1) == 1.0).all()  # the next episode's first
            return dones

        _check_each_world_reset_within_its_ending_step(step, envs.batch.pending, 12)
        envs.close()


def test_the_batch_sends_no_autoreset_when_the_next_step_is_in_flight_already() -> None:
    """A world whose step after LAST was sent by the caller gets no second reset step."""
    Recording.calls = {}
    with serve(lambda settings: Recording(**settings)) as server:
        batch = BatchedEnvironment.connect([server.address], 1, seed=100)  # 2 steps an episode
        batch._autoreset = True
        batch.reset()
        Recording.calls[0].clear()
        paddle = [{"paddle": 0}]
        batch.send(paddle, [0])
        batch.recv(env_ids=[0])
        batch.send(paddle * 2, [0, 0])  # LAST, and the step that starts the next episode
        got = batch.recv(env_ids=[0, 0], timeout=10)
        assert got.step_type.tolist() == [2, 0] and batch.pending() == 0
        assert Recording.calls[0] == ["step", "step", "reset"]
        batch.send(paddle, [0])
        batch.send(paddle, [0])
        got = batch.recv(env_ids=[0, 0], timeout=10)
        assert got.step_type.tolist() == [1, 2]
        assert batch.in_flight(0) == batch.pending() == 1  # the loop sent the reset step
        with pytest.raises(ValueError, match="in flight"):
            batch.reset([0])  # as for any step in flight
        assert batch.recv(env_ids=[0], timeout=10).step_type.tolist() == [0]
        assert Recording.calls[0] == ["step", "step", "reset", "step", "step", "reset"]
        assert batch.pending() == 0
        batch.close()


def _dying_pair(server_process: Any, make: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
    """World 0 on a Catch server, world 1 on one that dies on its world's autoreset step."""
    settings = {"rows": 3}
    return over_two_servers(
        server_process, make, ("catch", DYING), create_world_settings=settings, **kwargs
    )


def test_same_step_restarts_a_world_whose_server_dies_on_the_pipelined_reset(
    server_process: Any,
) -> None:
    envs, servers = _dying_pair(
        server_process,
        GymnasiumVectorEnv,
        timeout=20,
        autoreset_mode=SAME_STEP,
        connect_kwargs={"on_world_failure": "restart"},
    )
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(2, np.int8)}
    envs.step(zeros)
    observations, rewards, terminations, truncations, infos = envs.step(zeros)
    assert terminations.all() and not truncations.any() and (np.abs(rewards) == 1).all()
    assert infos["_final_obs"].all()
    # World 1's next episode starts on the other server: its first board is the row.
    assert (observations["board"][:, 0].max(axis=1) == 1.0).all()
    (failure,) = envs.batch.failures
    assert failure.index == 1 and failure.outcome == "restarted" and failure.steps_lost == 1
    assert failure.new_address == servers[0].address
    observations, _, terminations, _, _ = envs.step(zeros)  # a real step for both
    assert (observations["board"][:, 1].max(axis=1) == 1.0).all() and not terminations.any()
    assert envs.batch.pending() == 0
    envs.close()


def test_same_step_under_raise_a_world_lost_with_its_reset_raises_and_keeps_the_rest(
    server_process: Any,
) -> None:
    envs, _ = _dying_pair(server_process, GymnasiumVectorEnv, timeout=20, autoreset_mode=SAME_STEP)
    envs.reset(seed=0)
    zeros = {"paddle": np.zeros(2, np.int8)}
    envs.step(zeros)
    with pytest.raises(errors.WorldError, match=r"step_wait\(\) returns them") as raised:
        envs.step(zeros)
    assert raised.value.index == 1
    observations, _, terminations, _, infos = envs.step_wait()
    assert terminations.all()  # both episodes ended; world 1 has no next one
    assert infos["_final_obs"].tolist() == [True, False]
    assert infos["_error"].tolist() == [False, True] and infos["error"][1].index == 1
    assert observations["board"][0, 0].max() == 1.0  # world 0 starts again
    # World 1 keeps its LAST board: the ball reached the bottom row, none is on top.
    assert observations["board"][1, :-1].sum() == 0.0
    with pytest.raises(errors.WorldError):  # the world failed: it takes no more steps
        envs.step(zeros)
    envs.close()


@pytest.mark.training
def test_sb3_vec_env_restarts_a_world_whose_server_dies_on_the_pipelined_reset(
    server_process: Any,
) -> None:
    sb3 = pytest.importorskip("dm_env_rpc_client.integrations.sb3")
    envs, servers = _dying_pair(server_process, sb3.BatchedVecEnv, timeout=20)
    envs.reset()
    envs.step(np.ones(2, np.int64))
    observations, rewards, dones, infos = envs.step(np.ones(2, np.int64))
    assert dones.all() and (np.abs(rewards) == 1).all()
    assert all(info["terminal_observation"][-1].max() == 1.0 for info in infos)
    assert (observations[:, 0].max(axis=1) == 1.0).all()  # both start again
    (failure,) = envs.batch.failures
    assert failure.index == 1 and failure.new_address == servers[0].address
    observations, _, dones, _ = envs.step(np.ones(2, np.int64))
    assert (observations[:, 1].max(axis=1) == 1.0).all() and not dones.any()
    envs.close()


STEP_TIMEOUT = 1.0


def _stalled_pair(stalled: list[float], address: str, policy: str) -> GymnasiumVectorEnv:
    """Worlds 0 and 1 (seeds 100 and 101) on ``stalling_reset_server(101, stalled)``."""
    envs = GymnasiumVectorEnv(
        addresses=[address],
        num_envs=2,
        timeout=20,
        autoreset_mode=SAME_STEP,
        connect_kwargs={
            "seed": 100,
            "on_world_failure": policy,
            "step_timeout": STEP_TIMEOUT,
            "restart": RestartPolicy(attempts=3, total=10.0, backoff=0.05, connect_timeout=2.0),
        },
    )
    observations, _ = envs.reset()
    assert observations["x"].tolist() == [[1.0, 100.0], [1.0, 101.0]]  # count, seed
    return envs


def _check_detected_within_the_documented_bound(failure: Any, stalled: list[float]) -> None:
    """docs/batched.md: a stall is found within step_timeout plus a quarter of it (the
    watchdog's period); 3 s more for a loaded 2-core CI machine's scheduling. Not before the timeout:
    the clock starts as the loop sends the step, before it reaches the server."""
    (arrived,) = stalled
    waited = failure.time - arrived
    assert STEP_TIMEOUT - 0.2 <= waited <= STEP_TIMEOUT * 1.25 + 3.0, waited
    assert isinstance(failure.cause, errors.RequestTimeoutError)
    assert f"step_timeout of {STEP_TIMEOUT} s" in str(failure.cause)


def test_same_step_restarts_a_world_whose_server_never_answers_the_pipelined_reset() -> None:
    stalled: list[float] = []
    with stalling_reset_server(101, stalled) as address:
        envs = _stalled_pair(stalled, address, "restart")
        one = {"a": np.ones(2, np.int8)}
        observations, _, terminations, truncations, infos = envs.step(one)
        # Both LASTs are kept; world 1's next episode is its restarted world's first step.
        assert terminations.tolist() == [True, True] and not truncations.any()
        assert [final["x"].tolist() for final in infos["final_obs"]] == [[2, 100], [2, 101]]
        assert observations["x"].tolist() == [[3.0, 100.0], [1.0, 101.0]]
        (failure,) = envs.batch.failures
        assert (failure.index, failure.outcome, failure.steps_lost) == (1, "restarted", 1)
        assert failure.new_address == address
        _check_detected_within_the_documented_bound(failure, stalled)
        # Both step on, exactly once each: no step lost, repeated or left in flight.
        steps = [([[4, 100], [2, 101]], [[5, 100], [3, 101]])]
        steps.append(([[6, 100], [4, 101]], [[7, 100], [5, 101]]))
        for finals, firsts in steps:  # (count, seed): LASTs, then the next episode's firsts
            observations, _, terminations, _, infos = envs.step(one)
            assert terminations.tolist() == [True, True]
            assert [final["x"].tolist() for final in infos["final_obs"]] == finals
            assert observations["x"].tolist() == firsts
        assert envs.batch.pending() == 0 and len(envs.batch.failures) == 1
        envs.close()


def test_same_step_under_raise_a_never_answered_reset_names_its_world() -> None:
    stalled: list[float] = []
    with stalling_reset_server(101, stalled) as address:
        envs = _stalled_pair(stalled, address, "raise")
        one = {"a": np.ones(2, np.int8)}
        with pytest.raises(errors.WorldTimeoutError) as raised:
            envs.step(one)
        assert raised.value.index == 1 and raised.value.address == address
        message = str(raised.value)
        assert f"World 1 at {address} failed" in message and "step_timeout" in message
        (failure,) = envs.batch.failures
        assert (failure.index, failure.outcome, failure.steps_lost) == (1, "raised", 1)
        _check_detected_within_the_documented_bound(failure, stalled)
        observations, _, terminations, _, infos = envs.step_wait()
        assert terminations.tolist() == [True, True]
        assert infos["_error"].tolist() == [False, True] and infos["error"][1].index == 1
        # World 0 starts its next episode; world 1 keeps its LAST and takes no more steps.
        assert observations["x"].tolist() == [[3.0, 100.0], [2.0, 101.0]]
        with pytest.raises(errors.WorldError, match="World 1"):
            envs.step(one)
        envs.close()


@pytest.mark.training
def test_sb3_vec_env_restarts_a_world_whose_server_never_answers_the_pipelined_reset() -> None:
    sb3 = pytest.importorskip("dm_env_rpc_client.integrations.sb3")
    stalled: list[float] = []
    with stalling_reset_server(101, stalled) as address:
        envs = sb3.BatchedVecEnv(
            addresses=[address],
            num_envs=2,
            timeout=20,
            connect_kwargs={"seed": 100, "on_world_failure": "restart", "step_timeout": 1.0},
        )
        assert envs.reset().tolist() == [[1, 100], [1, 101]]  # count, seed
        observations, _, dones, infos = envs.step(np.ones(2, np.int64))
        assert dones.tolist() == [True, True]
        assert [info["terminal_observation"].tolist() for info in infos] == [[2, 100], [2, 101]]
        assert observations.tolist() == [[3, 100], [1, 101]]  # world 1 made again
        (failure,) = envs.batch.failures
        assert (failure.index, failure.outcome, failure.steps_lost) == (1, "restarted", 1)
        _check_detected_within_the_documented_bound(failure, stalled)
        observations, _, dones, infos = envs.step(np.ones(2, np.int64))
        assert [info["terminal_observation"].tolist() for info in infos] == [[4, 100], [2, 101]]
        assert observations.tolist() == [[5, 100], [3, 101]] and envs.batch.pending() == 0
        envs.close()
