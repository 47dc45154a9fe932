"""Real RLlib PPO fed multi-agent Paddles by the RLlink client process, one policy for both agents.

Ray 2.60's ``EnvRunnerServerForExternalInference`` is single-agent: the client ships each
agent's episodes as ``SingleAgentEpisode``s and the learner trains one module on all of
them (parameter sharing). Each agent sees its own paddle at 1.0 and the other at 0.5, so
one policy can play either. The learner's ``episode_return_mean`` is per agent.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from dm_env_rpc_client.server.paddles import Paddles

pytest.importorskip(
    "ray.rllib", exc_type=ImportError, reason="needs RLlib: pip install -e '.[rllib]'"
)
pytest.importorskip("torch", reason="the training tier needs torch")
from test_rllink_training import _external, _runner_port, _summary, client, local_ray

pytestmark = [pytest.mark.training, pytest.mark.timeout(900)]
__all__ = ["local_ray"]  # the module's Ray, a fixture

AGENTS, WORLDS, ROUNDS, BATCH = 2, 16, 64, 512


def random_return(episodes: int = 300, seed: int = 0) -> float:
    """Paddles' mean return per agent (2 agents, 10 x 5) under uniform random moves."""
    rng = np.random.default_rng(seed)
    env, total = Paddles(num_agents=AGENTS, seed=seed), 0.0
    for _ in range(episodes):
        steps = env.reset()
        while not all(step.last() for step in steps.values()):
            moves = {name: {"paddle": np.int8(rng.integers(-1, 2))} for name in steps}
            steps = env.step(moves)
            total += sum(float(step.reward or 0.0) for step in steps.values())
    return total / (episodes * AGENTS)


def test_ppo_trains_one_shared_policy_on_remote_paddles(
    local_ray: None, server_process: Any, tmp_path: pathlib.Path
) -> None:
    from ray.rllib.algorithms.ppo import PPOConfig

    port, address = _runner_port(), server_process("paddles").address
    config = _external(PPOConfig(), port).training(
        train_batch_size_per_learner=BATCH, minibatch_size=128, num_epochs=4, lr=1e-3
    )
    algo = config.build_algo()
    flags = ["--num-envs", str(WORLDS), "--rllib-agents", str(AGENTS)]
    flags += ["--create-setting", f"num_agents={AGENTS}", "--rllib-rounds", str(ROUNDS)]
    try:
        with client(tmp_path, address, port, *flags) as process:
            returns = [
                algo.train()["env_runners"].get("episode_return_mean") for _ in range(ROUNDS)
            ]
            summary = _summary(tmp_path, process, "client")
    finally:
        algo.stop()
    baseline = random_return()
    print("random", baseline, "returns", returns)
    assert summary["agents"] == AGENTS and summary["worlds"] == WORLDS
    assert summary["rounds"] == ROUNDS and summary["weight_updates"] == ROUNDS
    assert summary["steps_shipped"] >= ROUNDS * BATCH and summary["unconfirmed_steps"] == 0
    # An iteration's episode_return_mean is over a few dozen episodes, and PPO on these
    # settings swings (in 64 iterations a run went 8-iteration means -0.42, -0.14, -0.03,
    # -0.15, -0.39, -0.03, 0.24, -0.06 against random's -0.445): judged over windows.
    values = np.array([np.nan if r is None else r for r in returns], float)
    windows = [np.nanmean(values[i : i + 8]) for i in range(0, ROUNDS, 8)]
    later = float(np.nanmean(values[ROUNDS // 2 :]))
    assert later > baseline + 0.2 and max(windows) > baseline + 0.4, (baseline, windows)
