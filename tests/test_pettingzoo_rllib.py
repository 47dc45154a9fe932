"""Multi-agent learners on Paddles through ``integrations.pettingzoo.ParallelEnv``.

- RLlib: the documented route, RLlib's own ``ParallelPettingZooEnv`` around a
  ``ParallelEnv`` made from an ``env_config`` (address, num_agents, settings) in each env
  runner, passes RLlib's ``check_multiagent_environments``; in the training tier, PPO with
  ``.multi_agent(...)`` (one shared policy, and one policy per agent) beats random play.
- SuperSuit + Stable-Baselines3 (training tier): every agent of every copy is one slot of an
  SB3 ``VecEnv``; a short PPO run beats random play.

Ray listens on loopback only (tests/conftest.py sets it before Ray is imported).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import wait_for
from ma_foreign_server import foreign_server

from dm_env_rpc_client.server import serve
from dm_env_rpc_client.server.paddles import Paddles

pytest.importorskip("pettingzoo")
from dm_env_rpc_client.integrations.pettingzoo import ParallelEnv, rllib_env

SETTINGS = {"seed": 0, "num_agents": 2}


@pytest.fixture
def paddles() -> Iterator[str]:
    with serve(lambda s: Paddles(**s), agent_timeout=30.0) as server:
        yield server.address


def random_return(address: str, episodes: int = 100, seed: int = 0) -> float:
    """The mean per-agent episode return of uniformly random actions, over seeded episodes."""
    env = ParallelEnv(address=address, num_agents=2, create_world_settings=SETTINGS)
    rng = np.random.default_rng(seed)
    total = 0.0
    try:
        for episode in range(episodes):
            env.reset(seed=seed + episode)
            while env.agents:
                actions = {agent: int(rng.integers(3)) for agent in env.agents}
                _, rewards, *_ = env.step(actions)
                total += sum(rewards.values())
    finally:
        env.close()
    return total / (2 * episodes)


@pytest.mark.parametrize("server", ["sdk", "foreign"])
def test_rllib_check_multiagent_environments(server):
    pytest.importorskip(
        "ray.rllib", exc_type=ImportError, reason="needs RLlib: pip install -e '.[rllib]'"
    )
    from ray.rllib.env.multi_agent_env import MultiAgentEnv
    from ray.rllib.utils.pre_checks.env import check_multiagent_environments

    if server == "sdk":
        context = serve(lambda s: Paddles(**s), agent_timeout=30.0)
    else:
        context = foreign_server(barrier_timeout=30.0)
    with context as running:
        env = rllib_env(
            {"address": running.address, "num_agents": 2, "create_world_settings": SETTINGS}
        )
        try:
            assert isinstance(env, MultiAgentEnv)
            check_multiagent_environments(env)  # raises on anything RLlib cannot use
            observations, _ = env.reset(seed=3)
            assert set(observations) == {"agent_0", "agent_1"}
            _, rewards, terminations, truncations, _ = env.step({"agent_0": 0, "agent_1": 2})
            assert set(rewards) == {"agent_0", "agent_1"}
            assert terminations["__all__"] is False and truncations["__all__"] is False
        finally:
            env.close()


@pytest.fixture
def local_ray() -> Iterator[None]:
    """A local Ray (loopback) for one test; none of its processes are left after it."""
    ray = pytest.importorskip("ray")
    from dm_env_rpc_client.integrations import ray as rayi

    environment = dict(os.environ)
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # set by conftest: loopback
    assert rayi.init_ray("local", num_cpus=2, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environment)
        assert wait_for(lambda: not ray.is_initialized(), timeout=30)


@pytest.mark.training
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("policies", ["shared", "per-agent"])
def test_rllib_multi_agent_ppo_beats_random_play(local_ray, paddles, policies):
    # local_ray first: ray.init starts its processes with a preexec_fn (Python run in the
    # forked child), which can hang on a lock held by the Paddles server's gRPC threads at
    # fork time (CI once timed out waiting for Ray's gcs_server_port file that way).
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module import FlattenObservations
    from ray.tune.registry import register_env

    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)  # one learner thread: the machine's cores go to the servers too
    register_env("dm_env_rpc_paddles", rllib_env)
    if policies == "shared":
        ids, mapping = {"shared"}, (lambda agent_id, episode, **kwargs: "shared")
    else:
        ids, mapping = {"agent_0", "agent_1"}, (lambda agent_id, episode, **kwargs: agent_id)
    config = (
        PPOConfig()
        .environment(
            "dm_env_rpc_paddles",
            env_config={"address": paddles, "num_agents": 2, "create_world_settings": SETTINGS},
        )
        .multi_agent(policies=ids, policy_mapping_fn=mapping)
        .env_runners(
            num_env_runners=1,  # in a process of its own: the env is rebuilt from env_config
            num_cpus_per_env_runner=0.5,
            rollout_fragment_length=100,
            # Paddles' board is a 2-D Box; RLlib's default encoders take 1-D or 3-D.
            env_to_module_connector=lambda env, spaces=None, device=None: FlattenObservations(
                multi_agent=True
            ),
        )
        .training(train_batch_size_per_learner=400, minibatch_size=200, num_epochs=4, lr=2e-3)
        .learners(num_learners=0)
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(10)]
    finally:
        algo.stop()
    baseline = random_return(paddles)
    last = results[-1]["env_runners"]["agent_episode_returns_mean"]
    assert set(last) == {"agent_0", "agent_1"}
    learned = float(np.mean(list(last.values())))
    print(f"RLlib PPO ({policies}): per-agent return {learned:.3f}, random {baseline:.3f}")
    assert baseline < -0.2  # random play mostly misses the ball
    assert learned > baseline + 0.3, (learned, baseline)


@pytest.mark.training
@pytest.mark.timeout(900)
def test_supersuit_sb3_ppo_beats_random_play(paddles):
    ss = pytest.importorskip("supersuit")
    from stable_baselines3 import PPO
    from stable_baselines3.common.utils import set_random_seed

    parallel = ParallelEnv(address=paddles, num_agents=2, create_world_settings=SETTINGS)
    vec = ss.pettingzoo_env_to_vec_env_v1(parallel)
    vec = ss.concat_vec_envs_v1(vec, 4, num_cpus=0, base_class="stable_baselines3")
    # SB3 2.9.2's VecEnvWrapper.seed calls venv.seed, which SuperSuit 3.11's ConcatVecEnv lacks
    # (AttributeError) when PPO gets seed=...: seed SB3's RNGs here, and give PPO no seed.
    set_random_seed(0)
    try:
        model = PPO("MlpPolicy", vec, n_steps=64, batch_size=128, learning_rate=1e-3, verbose=0)
        model.learn(6000)
    finally:
        vec.close()
    env = ParallelEnv(address=paddles, num_agents=2, create_world_settings=SETTINGS)
    total = 0.0
    try:
        for episode in range(100):
            observations, _ = env.reset(seed=1000 + episode)
            while env.agents:
                actions = {
                    agent: int(model.predict(observations[agent], deterministic=True)[0])
                    for agent in env.agents
                }
                observations, rewards, *_ = env.step(actions)
                total += sum(rewards.values())
    finally:
        env.close()
        parallel.close()
    learned = total / 200
    baseline = random_return(paddles)
    print(f"SuperSuit+SB3 PPO: per-agent return {learned:.3f}, random {baseline:.3f}")
    assert learned > baseline + 0.3, (learned, baseline)
