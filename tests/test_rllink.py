"""The RLlink client (integrations.ray.run_rllink) against stand-in and real RLlib learners.

The stand-in learner (``rllink_peer.FakeLearner``) speaks RLlink on a loopback
port and misbehaves on purpose; it needs torch to build the module whose
weights it sends, so these tests are in the training tier. The worlds are real:
the SDK's embedded Catch server, in process or in child processes. The real
RLlib learners (PPO, DQN) are in ``test_rllink_training.py``.
"""

from __future__ import annotations

import collections
import json
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.catch import Catch

pytest.importorskip(
    "ray.rllib", exc_type=ImportError, reason="needs RLlib: pip install -e '.[rllib]'"
)
gymnasium = pytest.importorskip("gymnasium")
rayi = pytest.importorskip("dm_env_rpc_client.integrations.ray")
from conftest import run_child, wait_for  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from rllink_peer import FakeLearner  # noqa: E402

from dm_env_rpc_client.integrations.ray._rllink_spaces import SpaceBridge  # noqa: E402

BOARD = gymnasium.spaces.Box(0.0, 1.0, (50,), np.float32)  # Catch's 10 x 5 board, flattened
MOVES = gymnasium.spaces.Discrete(3)  # Catch's paddle move -1, 0, 1 as 0, 1, 2
CLI = [sys.executable, "-m", "dm_env_rpc_client"]
# Seconds a SIGTERMed client may take to print its summary and exit. Not a speed target: a
# client that does not look at its stop event waits 30 to 600 s here (or for ever).
SIGTERM_BOUND = 20.0


def ppo_config(observation_space: Any = BOARD, action_space: Any = MOVES, batch: int = 64) -> Any:
    return (
        PPOConfig()
        .environment(observation_space=observation_space, action_space=action_space)
        .training(train_batch_size_per_learner=batch)
        .debugging(seed=0)
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _chunks_once(learner: FakeLearner) -> None:
    """Every step the learner got is in one chunk only: (episode id, start) never repeats."""
    keys = [(episode.id_, episode.t_started) for episode in learner.episodes]
    repeated = [key for key, count in collections.Counter(keys).items() if count > 1]
    assert not repeated
    for episode in learner.episodes:
        episode.validate()


@pytest.fixture
def catch() -> Any:
    with dmr.serve(lambda settings: Catch(**settings)) as server:
        yield server


def test_spaces_that_fit_convert_and_others_name_the_space(catch: Any) -> None:
    with dmr.BatchedEnvironment.connect([catch.address], 2, seed=0) as batch:
        bridge = SpaceBridge(batch, BOARD, MOVES)
        first = batch.reset()
        assert bridge.observations(first).shape == (2, 50)
        assert bridge.to_world(np.array([0, 2]))["paddle"].tolist() == [-1, 1]
        assert bridge.to_learner({"paddle": np.array([1, -1], np.int8)}).tolist() == [2, 0]
        wrong_board = gymnasium.spaces.Box(0.0, 1.0, (40,), np.float32)
        with pytest.raises(rayi.SpaceMismatchError, match=r"observation space .*'board'.*\(50,\)"):
            SpaceBridge(batch, wrong_board, MOVES)
        with pytest.raises(
            rayi.SpaceMismatchError, match=r"action space .*'paddle'.*Discrete\(3\)"
        ):
            SpaceBridge(batch, BOARD, gymnasium.spaces.Discrete(4))


def test_an_unreachable_learner_is_waited_for_then_named(catch: Any) -> None:
    said: list[str] = []
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(rayi.LearnerUnreachableError, match=f"No RLlib .* at {address}"):
        rayi.run_rllink([catch.address], address, wait=1.5, say=said.append)
    assert said and all(f"waiting for the RLlib learner at {address}" in line for line in said)
    assert "retrying in 0.5 s" in said[0]  # backoff: the delays grow
    assert any("retrying in 1.0 s" in line for line in said[1:])


@pytest.mark.training
def test_episodes_carry_what_ppo_needs_and_each_step_ships_once(catch: Any) -> None:
    learner = FakeLearner(ppo_config())
    try:
        stats = rayi.run_rllink([catch.address], learner.address, num_envs=4, rounds=3, say=print)
    finally:
        learner.close()
    assert stats.rounds == 3 and stats.weight_updates == 3 and not stats.learner_gone
    assert stats.steps_shipped == sum(len(e) for e in learner.episodes) >= 3 * 64
    assert stats.steps == stats.steps_shipped + stats.unshipped_steps
    _chunks_once(learner)
    for episode in learner.episodes:
        assert episode.custom_data["behavior"] == "rl_module"
        logp = episode.get_extra_model_outputs("action_logp")
        inputs = episode.get_extra_model_outputs("action_dist_inputs")
        assert len(logp) == len(episode) and np.all(np.asarray(logp) <= 0)
        assert np.asarray(inputs).shape == (len(episode), 3)
        assert np.asarray(episode.get_observations()).shape[1:] == (50,)
        assert set(np.asarray(episode.get_actions()).tolist()) <= {0, 1, 2}
    finished = [e for e in learner.episodes if e.is_terminated]
    assert finished and all(e.get_return() in (-1.0, 1.0) for e in finished if e.t_started == 0)


@pytest.mark.training
@pytest.mark.parametrize("lockstep", [False, True])
def test_the_next_round_steps_while_the_learner_trains_unless_lockstep(
    catch: Any, lockstep: bool
) -> None:
    """Pipelined (the default), the round after a shipment starts acting with the weights
    one round old (lagged steps); the weights are loaded before the round after it ships."""
    learner = FakeLearner(ppo_config())
    try:
        stats = rayi.run_rllink(
            [catch.address], learner.address, num_envs=4, rounds=3, lockstep=lockstep, say=print
        )
    finally:
        learner.close()
    assert stats.rounds == 3 and stats.weight_updates == 3 and stats.unconfirmed_steps == 0
    assert learner.kinds.count("EPISODES_AND_GET_STATE") == 3
    assert stats.steps_shipped == sum(len(e) for e in learner.episodes) >= 3 * 64
    if lockstep:
        assert stats.lagged_steps == 0
    else:  # at least the first actions of rounds 2 and 3, at most those two rounds' actions
        assert 2 * 4 <= stats.lagged_steps <= stats.steps - 64


def _paced_run(catch: Any, learner: FakeLearner, rounds: int, steps: int, **kwargs: Any) -> Any:
    """A paced random-policy run of 3 worlds for ``learner``, which is closed after it."""
    try:
        return rayi.run_rllink(
            [catch.address],
            learner.address,
            num_envs=3,
            policy="random",
            rounds=rounds,
            steps_per_send=steps,
            paced=True,
            **kwargs,
        )
    finally:
        learner.close()


@pytest.mark.training
def test_a_paced_off_policy_client_ships_a_round_per_answer(catch: Any) -> None:
    learner = FakeLearner(ppo_config(), weights={})
    stats = _paced_run(catch, learner, 3, 32, say=print)
    assert learner.kinds.count("EPISODES_AND_GET_STATE") == 3 and "EPISODES" not in learner.kinds
    assert stats.rounds == 3 and stats.weight_updates == 0 and stats.unconfirmed_steps == 0
    assert stats.steps_shipped == sum(len(e) for e in learner.episodes) >= 3 * 32
    assert all(e.custom_data["behavior"] == "external" for e in learner.episodes)


@pytest.mark.training
def test_a_paced_client_ships_one_round_per_update_of_the_weights(catch: Any) -> None:
    """RLlib answers twice an iteration (``stale_every_other``): after an answer whose
    weights did not move, the client asks again until they do, then ships."""
    learner = FakeLearner(ppo_config(), weights={}, stale_every_other=True)
    stats = _paced_run(catch, learner, 4, 16)
    shipped = [k for k in learner.kinds if k in ("EPISODES_AND_GET_STATE", "GET_STATE")]
    # the pacer's baseline, then a round per update: the answers to rounds 2 and 4 are stale
    e, g = "EPISODES_AND_GET_STATE", "GET_STATE"
    assert shipped == [g, e, e, g, e, e, g] and learner.seq == 4
    assert stats.rounds == 4 and stats.unconfirmed_steps == 0


@pytest.mark.training
def test_a_paced_client_whose_learner_stops_updating_ends_with_a_summary(catch: Any) -> None:
    learner = FakeLearner(ppo_config(), weights={}, stale_every_other=True, frozen_after=1)
    said: list[str] = []
    stats = _paced_run(catch, learner, 4, 16, learner_timeout=1.0, say=said.append)
    assert stats.learner_gone and stats.rounds == 1
    assert "did not update its weights" in stats.stop_reason
    assert "learner_timeout" in stats.stop_reason
    assert any("to update its weights" in line for line in said), said


@pytest.mark.training
def test_off_policy_episodes_say_so_and_hold_the_policys_actions(catch: Any) -> None:
    learner = FakeLearner(ppo_config())
    calls: list[int] = []

    def right(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
        calls.append(len(timestep.env_ids))
        return {"paddle": np.ones(len(timestep.env_ids), np.int8)}  # always move right

    try:
        stats = rayi.run_rllink(
            [catch.address], learner.address, num_envs=3, policy=right, rounds=2, say=print
        )
        assert wait_for(lambda: learner.batches == 2)  # EPISODES are not answered: poll
    finally:
        learner.close()
    assert stats.behavior == "external" and stats.weight_updates == 0 and calls
    assert stats.steps_shipped == sum(len(e) for e in learner.episodes) > 0
    _chunks_once(learner)
    for episode in learner.episodes:
        assert episode.custom_data["behavior"] == "external"
        assert set(np.asarray(episode.get_actions()).tolist()) == {2}  # +1 as Discrete(3)
        assert "action_logp" not in episode.extra_model_outputs


@pytest.mark.training
def test_a_learner_that_hangs_up_is_reconnected_and_nothing_is_sent_twice(catch: Any) -> None:
    learner = FakeLearner(ppo_config(), drop_after=2)
    said: list[str] = []
    try:
        stats = rayi.run_rllink(
            [catch.address], learner.address, num_envs=4, rounds=4, say=said.append
        )
    finally:
        learner.close()
    assert stats.rounds == 4 and learner.connections == 2
    assert len(stats.reconnects) == 1 and "hung up" in stats.reconnects[0]
    assert any("reconnecting" in line for line in said)
    # The second batch reached the learner but its answer never came: unconfirmed, not resent.
    got = sum(len(e) for e in learner.episodes)
    assert stats.unconfirmed_steps > 0
    assert got == stats.steps_shipped + stats.unconfirmed_steps
    _chunks_once(learner)


@pytest.mark.training
def test_a_learner_gone_for_good_ends_the_run_with_a_summary(catch: Any) -> None:
    learner = FakeLearner(ppo_config(), gone_after=2)
    stats = rayi.run_rllink([catch.address], learner.address, num_envs=4, wait=2.0, say=print)
    assert stats.learner_gone and stats.rounds == 2
    assert f"No RLlib EnvRunnerServerForExternalInference answered at {learner.address}" in (
        stats.stop_reason
    )
    assert stats.steps_shipped == sum(len(e) for e in learner.episodes)
    assert stats.unshipped_steps > 0  # the third round's steps had nowhere to go
    assert stats.summary()["learner_gone"] is True


@pytest.mark.training
def test_weights_that_do_not_fit_name_the_spaces(catch: Any) -> None:
    small = ppo_config(observation_space=gymnasium.spaces.Box(0.0, 1.0, (40,), np.float32))
    weights = small.get_rl_module_spec(inference_only=True).build().get_state()
    learner = FakeLearner(ppo_config(), weights=weights)
    try:
        with pytest.raises(rayi.SpaceMismatchError, match=r"weights do not fit.*\(50,\)"):
            rayi.run_rllink([catch.address], learner.address, num_envs=2, rounds=1)
    finally:
        learner.close()


@pytest.mark.training
def test_a_restarted_worlds_cut_episode_is_shipped_truncated(server_process: Any) -> None:
    """Server 0 dies mid-round (killed from the policy, at a known step): its worlds are made
    again on server 1, and their cut episodes go to the learner truncated, each step once."""
    servers = [server_process("catch"), server_process("catch")]
    learner = FakeLearner(ppo_config(batch=256))
    calls = 0

    def policy(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
        nonlocal calls
        calls += 1
        mid_episode = [
            int(t) for w, t in zip(timestep.env_ids, timestep.step_type, strict=True) if w == 0
        ]
        if calls >= 40 and mid_episode == [1] and servers[0].process.poll() is None:
            servers[0].kill()  # world 0 has steps in its open episode: they go out truncated
        return {"paddle": np.zeros(len(timestep.env_ids), np.int8)}

    try:
        stats = rayi.run_rllink(
            [server.address for server in servers],
            learner.address,
            num_envs=4,
            policy=policy,
            rounds=3,
            timeout=10.0,
        )
        assert wait_for(lambda: learner.batches == 3)  # EPISODES are not answered: poll
    finally:
        learner.close()
    assert len(stats.restarts) == 2 and stats.worlds_lost == 0  # worlds 0 and 2
    # World 0's episode is cut with steps in it; world 2 may be between episodes.
    assert 1 <= stats.truncated_by_failure <= stats.truncated_by_failure + stats.cut_after_ship <= 2
    cut = [e for e in learner.episodes if e.is_truncated]
    assert len(cut) == stats.truncated_by_failure and all(len(e) for e in cut)
    assert stats.steps_shipped == sum(len(e) for e in learner.episodes)
    _chunks_once(learner)


@pytest.mark.training
def test_the_cli_runs_for_a_learner_and_prints_the_summary(catch: Any) -> None:
    learner = FakeLearner(ppo_config())
    try:
        done = run_child(
            [
                *CLI,
                "run",
                "--address",
                catch.address,
                "--num-envs",
                "4",
                "--json",
                "--rllib-server",
                learner.address,
                "--rllib-rounds",
                "2",
            ],
            timeout=100,
        )
    finally:
        learner.close()
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["rounds"] == 2 and summary["weight_updates"] == 2 and summary["worlds"] == 4
    assert summary["steps_shipped"] == sum(len(e) for e in learner.episodes) >= 128
    assert summary["stop_reason"] == "2 rounds done"


def test_the_cli_refuses_a_bad_policy_flag(catch: Any) -> None:
    done = run_child(
        [
            *CLI,
            "run",
            "--address",
            catch.address,
            "--rllib-server",
            "127.0.0.1:1",
            "--rllib-policy",
            "no_colon_here",
        ],
        timeout=60,
    )
    assert done.returncode == 2 and "MODULE:FUNCTION" in done.stderr


def _sigterm(
    tmp_path: pathlib.Path, arguments: list[str], phase: Callable[[str], bool]
) -> dict[str, Any]:
    """Starts the CLI client, SIGTERMs it once ``phase(its stderr)`` holds; its summary.

    The client prints its progress notes (so no ``--json``): the summary is its table, read
    back into ``RLlinkStats.summary()``'s keys. Fails if the client does not exit with 143
    within ``SIGTERM_BOUND`` seconds, or printed no summary.
    """
    out, err = tmp_path / "client.out", tmp_path / "client.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen([*CLI, "run", *arguments], stdout=stdout, stderr=stderr)
    try:
        assert wait_for(lambda: phase(err.read_text()) or process.poll() is not None, 90)
        assert process.poll() is None, err.read_text()
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=SIGTERM_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit {SIGTERM_BOUND} s after SIGTERM; it said: {err.read_text()}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert code == 143, err.read_text()
    table = {line[:16].strip(): line[16:].strip() for line in out.read_text().splitlines()}
    summary: dict[str, Any] = {key: table.get(label) for label, key in _TABLE.items()}
    assert summary["stop_reason"] == "stopped", (table, err.read_text())
    for key in ("steps", "rounds", "steps_shipped", "unshipped_steps", "unconfirmed_steps"):
        summary[key] = int(summary[key])
    return summary


# The summary table's labels (_rllink_cli.print_rllink_summary) and RLlinkStats' names.
_TABLE = {
    "acted by": "behavior",
    "steps": "steps",
    "rounds shipped": "rounds",
    "steps shipped": "steps_shipped",
    "unshipped": "unshipped_steps",
    "unconfirmed": "unconfirmed_steps",
    "weight updates": "weight_updates",
    "ended": "stop_reason",
}


def _client_flags(catch: Any, learner: str, *extra: str, worlds: int = 4) -> list[str]:
    return [
        *("--address", catch.address, "--num-envs", str(worlds), "--seed", "0"),
        *("--rllib-server", learner, "--rllib-wait", "600", "--rllib-learner-timeout", "600"),
        *extra,
    ]


def test_sigterm_while_connecting_ends_the_client_with_its_summary(
    catch: Any, tmp_path: pathlib.Path
) -> None:
    nobody = f"127.0.0.1:{_free_port()}"
    summary = _sigterm(
        tmp_path,
        _client_flags(catch, nobody, "--rllib-policy", "random"),
        lambda said: "waiting for the RLlib learner" in said,
    )
    assert summary["steps"] == 0 and summary["rounds"] == 0


def test_sigterm_while_stepping_ends_the_client_with_its_summary(
    catch: Any, tmp_path: pathlib.Path
) -> None:
    """The off-policy client whose learner keeps taking episodes (the DQN test's hang: it
    looked at its stop event only when no step came back for a quarter of a second)."""
    learner = FakeLearner(ppo_config(), weights={})
    try:
        summary = _sigterm(
            tmp_path,
            _client_flags(catch, learner.address, "--rllib-policy", "random", worlds=16),
            lambda _: learner.batches >= 3,
        )
        got = lambda: sum(len(e) for e in learner.episodes)  # noqa: E731
        assert wait_for(lambda: got() == summary["steps_shipped"])
    finally:
        learner.close()
    assert summary["rounds"] >= 3 and summary["behavior"] == "external"
    assert summary["steps"] == summary["steps_shipped"] + summary["unshipped_steps"]


def test_sigterm_while_shipping_to_a_learner_that_stopped_reading(
    catch: Any, tmp_path: pathlib.Path
) -> None:
    """The learner takes the config, then reads nothing: the first batch of episodes (about
    10 MB of 100 x 100 boards) fills the socket and the client's send waits."""
    board = gymnasium.spaces.Box(0.0, 1.0, (100 * 100,), np.float32)
    learner = FakeLearner(ppo_config(observation_space=board, batch=256), weights={}, stall_after=0)
    flags = ["--rllib-policy", "random", "--create-setting", "rows=100"]
    try:
        summary = _sigterm(
            tmp_path,
            _client_flags(catch, learner.address, *flags, "--create-setting", "columns=100"),
            lambda _: learner.unread_bytes() > 0,
        )
    finally:
        learner.close()
    assert summary["steps_shipped"] == 0 and summary["rounds"] == 0
    assert summary["unshipped_steps"] == summary["steps"] >= 256


def test_sigterm_while_waiting_for_a_learner_gone_ends_the_client(
    catch: Any, tmp_path: pathlib.Path
) -> None:
    learner = FakeLearner(ppo_config(), weights={}, gone_after=1)
    summary = _sigterm(
        tmp_path,
        _client_flags(catch, learner.address, "--rllib-policy", "random"),
        lambda said: "reconnecting" in said and said.count("waiting for the RLlib learner") >= 1,
    )
    assert summary["rounds"] == 1  # and not learner_gone: it was stopped while waiting
    assert summary["steps_shipped"] == sum(len(e) for e in learner.episodes) > 0


@pytest.mark.training
def test_sigterm_while_waiting_for_weights_ends_the_client_with_its_summary(
    catch: Any, tmp_path: pathlib.Path
) -> None:
    """On-policy: the learner took the first batch and never sends the weights."""
    learner = FakeLearner(ppo_config(), stall_after=1)
    try:
        summary = _sigterm(
            tmp_path, _client_flags(catch, learner.address), lambda _: learner.batches == 1
        )
    finally:
        learner.close()
    assert summary["rounds"] == 0 and summary["weight_updates"] == "0"
    assert summary["unconfirmed_steps"] == sum(len(e) for e in learner.episodes) >= 64
