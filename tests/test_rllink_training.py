"""Real RLlib learners fed by the RLlink client, which runs as a separate process (the CLI).

One local Ray on loopback for the module (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set by
conftest; no dashboard). Each learner has one remote ``EnvRunnerServerForExternalInference``
(``create_local_env_runner=False``: no listener left in this process after ``algo.stop()``),
listening on ``env_config["port"] + 1``. The worlds are Catch, served by the SDK's server
(``python -m dm_env_rpc_client.server``, as ``dm-env-rpc-client serve``) or by a server
written on the reference ``dm-env-rpc`` package (``check_servers.reference_server``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import process_gone, wait_for

from dm_env_rpc_client.server.catch import Catch

ray = pytest.importorskip("ray")
pytest.importorskip(
    "ray.rllib", exc_type=ImportError, reason="needs RLlib: pip install -e '.[rllib]'"
)
pytest.importorskip("torch", reason="the training tier needs torch")
gymnasium = pytest.importorskip("gymnasium")
rayi = pytest.importorskip("dm_env_rpc_client.integrations.ray")
from ray.rllib.env.external.env_runner_server_for_external_inference import (  # noqa: E402
    EnvRunnerServerForExternalInference,
)

pytestmark = [pytest.mark.training, pytest.mark.timeout(900)]

BOARD = gymnasium.spaces.Box(0.0, 1.0, (50,), np.float32)
MOVES = gymnasium.spaces.Discrete(3)
CLI = [sys.executable, "-m", "dm_env_rpc_client"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    environment = dict(os.environ)
    started = rayi.init_ray("local", num_cpus=2, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
        os.environ.clear()
        os.environ.update(environment)


def _runner_port() -> int:
    """A free port for EnvRunner 1 (which listens on env_config["port"] + 1)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _external(config: Any, port: int) -> Any:
    return (
        config.environment(
            observation_space=BOARD, action_space=MOVES, env_config={"port": port - 1}
        )
        .env_runners(
            env_runner_cls=EnvRunnerServerForExternalInference,
            num_env_runners=1,
            create_local_env_runner=False,
            num_cpus_per_env_runner=0,
        )
        .learners(num_learners=0)
        .debugging(seed=0)
    )


def random_return(episodes: int = 300, seed: int = 0) -> float:
    """Catch's mean return under uniform random paddle moves."""
    rng = np.random.default_rng(seed)
    env, total = Catch(seed=seed), 0.0
    for _ in range(episodes):
        step = env.reset()
        while not step.last():
            step = env.step({"paddle": np.int8(rng.integers(-1, 2))})
        total += float(step.reward)
    return total / episodes


@contextlib.contextmanager
def client(
    tmp_path: pathlib.Path, world_address: str, port: int, *extra: str, name: str = "client"
) -> Iterator[subprocess.Popen[str]]:
    """The RLlink client as its own process (the CLI); killed at the end if still running."""
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    command = [*CLI, "run", "--address", world_address, "--json", "--seed", "0"]
    command += ["--rllib-server", f"127.0.0.1:{port}", "--rllib-wait", "60", *extra]
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _summary(tmp_path: pathlib.Path, process: subprocess.Popen[str], name: str) -> Any:
    assert process.wait(timeout=120) == 0, (tmp_path / f"{name}.err").read_text()
    return json.loads((tmp_path / f"{name}.out").read_text())


@pytest.fixture(params=["sdk", "reference"])
def catch_address(request: pytest.FixtureRequest, server_process: Any) -> Iterator[str]:
    """The worlds' server; the reference-package one serves 8 streams (its thread pool)."""
    if request.param == "sdk":
        yield server_process("catch").address
        return
    pytest.importorskip("dm_env_rpc", reason="needs the reference dm-env-rpc package (test peer)")
    from check_servers import reference_server

    with reference_server() as address:
        yield address


def test_ppo_learns_remote_catch_through_a_client_process(
    local_ray: None, catch_address: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    from ray.rllib.algorithms.ppo import PPOConfig

    rounds, port = 16, _runner_port()
    worlds = "16" if "sdk" in request.node.callspec.id else "8"  # the reference server: 8
    config = _external(PPOConfig(), port).training(
        train_batch_size_per_learner=512, minibatch_size=128, num_epochs=4, lr=1e-3
    )
    algo = config.build_algo()
    try:
        with client(
            tmp_path,
            catch_address,
            port,
            *("--num-envs", worlds, "--rllib-rounds", str(rounds), "--rllib-lockstep"),
        ) as process:
            returns = [
                algo.train()["env_runners"].get("episode_return_mean") for _ in range(rounds)
            ]
            summary = _summary(tmp_path, process, "client")
    finally:
        algo.stop()
    baseline = random_return()
    assert summary["rounds"] == rounds and summary["weight_updates"] == rounds
    assert summary["steps_shipped"] >= rounds * 512 and summary["unconfirmed_steps"] == 0
    late = [r for r in returns[-3:] if r is not None]
    assert late and min(late) > baseline + 0.5, (baseline, returns)


def test_a_killed_client_leaves_the_learner_for_the_next_one(
    local_ray: None, server_process: Any, tmp_path: pathlib.Path
) -> None:
    from ray.rllib.algorithms.ppo import PPOConfig

    port, worlds = _runner_port(), server_process("catch").address
    config = _external(PPOConfig(), port).training(
        train_batch_size_per_learner=256, minibatch_size=128, num_epochs=1
    )
    algo = config.build_algo()
    try:
        with client(tmp_path, worlds, port, "--num-envs", "64", name="first") as first:
            before = [algo.train() for _ in range(2)]
            # The learner has sent new weights: the client is stepping its next round.
            os.kill(first.pid, signal.SIGKILL)
            assert wait_for(lambda: process_gone(first.pid) or first.poll() is not None, 30)
        with client(
            tmp_path, worlds, port, "--num-envs", "8", "--rllib-rounds", "1", name="second"
        ) as second:
            # If the first client shipped its next round just before the kill, the learner's
            # first train() takes those episodes and the second client waits for one more.
            after = [algo.train()]
            while len(after) < 3 and not wait_for(lambda: second.poll() is not None, 30):
                after.append(algo.train())
            summary = _summary(tmp_path, second, "second")
    finally:
        algo.stop()
    for result in before + after:
        assert result["env_runners"]["num_env_steps_sampled"] >= 256
    assert summary["rounds"] == 1 and summary["weight_updates"] == 1


def _greedy_return(module: Any, address: str, worlds: int = 64) -> float:
    """The mean return of ``module``'s greedy actions over one episode of each of ``worlds``."""
    import torch

    import dm_env_rpc_client as dmr

    with dmr.BatchedEnvironment.connect([address], worlds, seed=1000) as batch:
        step, total = batch.reset(), np.zeros(worlds)
        done = np.zeros(worlds, bool)
        while not done.all():
            boards = step.observation["board"].reshape(worlds, -1).astype(np.float32)
            with torch.no_grad():
                actions = module.forward_inference({"obs": torch.from_numpy(boards)})["actions"]
            step = batch.step({"paddle": (actions.numpy() - 1).astype(np.int8)})
            total += np.where(done, 0.0, np.nan_to_num(step.reward))
            done |= step.step_type == 2
    return float(total.mean())


def test_dqn_learns_catch_from_paced_random_policy_episodes(
    local_ray: None, server_process: Any, tmp_path: pathlib.Path
) -> None:
    """Off-policy data, as ``log_action`` gave it: the client acts at random (``--rllib-policy
    random``) and ships episodes marked ``external``; DQN replays them, and its greedy policy,
    played on fresh worlds, beats the random return by far.

    ``--rllib-paced`` ships a round (256 env steps) per training iteration (each iteration
    sampled exactly one round: RLlib answers the client twice an iteration, and the client
    waits for the weights to move), and ``training_intensity`` is set so that Ray's
    ``calculate_rr_weights`` gives DQN_UPDATES updates of 64 per iteration. The Q-network is
    RLlib's encoder alone (no dueling or extra head layers) with ``n_step=1``: see
    docs/rllink.md for what did not learn in this budget."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.algorithms.dqn.dqn import calculate_rr_weights

    port, worlds = _runner_port(), server_process("catch").address
    config = (
        _external(DQNConfig(), port)
        .training(
            lr=2e-3,
            train_batch_size_per_learner=64,
            num_steps_sampled_before_learning_starts=256,  # the first round: answered at once
            target_network_update_freq=256,  # env steps sampled: once an iteration
            n_step=1,
            dueling=False,
            hiddens=[],
            double_q=True,
            replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 50_000},
        )
        .rl_module(model_config={"fcnet_hiddens": [64, 64]})
        .reporting(min_sample_timesteps_per_iteration=0, min_time_s_per_iteration=0)
        .env_runners(sample_timeout_s=120)
    )
    native = config.total_train_batch_size / (
        config.get_rollout_fragment_length() * config.num_envs_per_env_runner * 2
    )  # calculate_rr_weights' native ratio (one remote runner, plus one)
    config.training(training_intensity=DQN_UPDATES * native)
    assert calculate_rr_weights(config) == [1, DQN_UPDATES]
    algo = config.build_algo()
    try:
        with client(
            tmp_path,
            worlds,
            port,
            *("--num-envs", "16", "--rllib-policy", "random", "--rllib-paced"),
            *("--rllib-steps-per-send", "256", "--rllib-rounds", str(DQN_ITERATIONS)),
        ) as process:
            results = [algo.train() for _ in range(DQN_ITERATIONS)]
            summary = _summary(tmp_path, process, "client")
        # The learner's own module (algo.get_module() would ask the remote EnvRunner's copy).
        module = config.get_rl_module_spec().build()
        module.set_state(algo.learner_group.get_weights()["default_policy"])
        learned = _greedy_return(module, worlds, 48)
    finally:
        algo.stop()
    assert summary["behavior"] == "external" and summary["weight_updates"] == 0
    assert summary["rounds"] == DQN_ITERATIONS and summary["unconfirmed_steps"] == 0
    per_iteration = [r["env_runners"]["num_env_steps_sampled"] for r in results]
    assert all(256 <= steps < 2 * 256 for steps in per_iteration), per_iteration  # one round
    sampled = results[-1]["env_runners"]["num_env_steps_sampled_lifetime"]
    assert summary["steps_shipped"] == sampled  # all of it came from us, none of it twice
    losses = results[-1]["learners"]["default_policy"]
    assert losses["num_module_steps_trained_lifetime"] == DQN_ITERATIONS * DQN_UPDATES * 64
    baseline = random_return()
    assert learned > baseline + 0.5, (baseline, learned)


DQN_ITERATIONS, DQN_UPDATES = 20, 256
