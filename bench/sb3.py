"""Stable-Baselines3 over remote Catch worlds: BatchedVecEnv against SB3's own VecEnvs.

Run: ``python bench/sb3.py [--worlds W] [--steps N] [--ppo-steps N] [--rounds R] [--servers ...]``
(needs torch and stable-baselines3: ``pip install torch==2.13.0``, then ``.[training]``).

Two server processes hold the worlds (round-robin): first two of the SDK's own
server, then two foreign ones written on the reference package
(``_lib/foreign_server.py``). Three VecEnvs over the same worlds:

- (a) SB3's ``DummyVecEnv`` of ``GymnasiumEnv``s (one stream each, stepped one
  after another), with a ``Discrete(3)`` action wrapper as docs/gymnasium.md shows;
- (b) SB3's ``SubprocVecEnv`` of the same (one forkserver process per world);
- (c) ``BatchedVecEnv`` over ``BatchedEnvironment`` (integrations.sb3).

Two measurements, each interleaved in rounds (``bench/_lib/common.py``): env steps/s
(world steps, random actions drawn beforehand, SB3's ``step``), and PPO's wall
time for ``model.learn`` of the same number of steps with the same settings
(``n_steps=128``, one torch thread). Ratios are taken within each round.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
from typing import Any

import gymnasium
import numpy as np
import torch

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    SERVERS,
    add_pin_argument,
    apply_pin,
    measure_interleaved,
    print_table,
    server_processes,
)
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv
from dm_env_rpc_client.integrations.sb3 import BatchedVecEnv

DUMMY = "(a) DummyVecEnv of GymnasiumEnv"
SUBPROC = "(b) SubprocVecEnv of GymnasiumEnv"
OURS = "(c) BatchedVecEnv"
POOL = 64  # pre-drawn action batches, reused in turn: the RNG is no variant's cost
N_STEPS = 128  # PPO rollout length per world


def paddle_moves(address: str) -> gymnasium.Env[Any, Any]:
    """One remote Catch world with SB3's Discrete(3) action (docs/gymnasium.md's wrapper)."""
    return gymnasium.wrappers.TransformAction(
        GymnasiumEnv(address=address, unwrap_single=True),
        lambda move: np.int8(move - 1),
        gymnasium.spaces.Discrete(3),
    )


def _fns(addresses: list[str], count: int) -> list[Any]:
    return [functools.partial(paddle_moves, addresses[i % len(addresses)]) for i in range(count)]


def make(name: str, addresses: list[str], count: int) -> Any:
    if name == DUMMY:
        return DummyVecEnv(_fns(addresses, count))
    if name == SUBPROC:
        return SubprocVecEnv(_fns(addresses, count), start_method="forkserver")
    return BatchedVecEnv(addresses=addresses, num_envs=count)


def stepping(name: str, addresses: list[str], count: int) -> Any:
    """(run, close) for env steps/s: lockstep steps with pre-drawn Discrete actions."""
    envs = make(name, addresses, count)
    envs.seed(0)
    envs.reset()
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 3, count) for _ in range(POOL)]

    def run(steps: int) -> None:
        for index in range(steps // count):
            envs.step(pool[index % POOL])

    return run, envs.close


def training(name: str, addresses: list[str], count: int) -> Any:
    """(run, close) for PPO: ``run(steps)`` is ``model.learn(steps)`` on a fresh model."""
    envs = make(name, addresses, count)
    model = PPO("MlpPolicy", envs, n_steps=N_STEPS, batch_size=256, n_epochs=4, seed=0)

    def run(steps: int) -> None:
        model.learn(total_timesteps=steps)

    return run, envs.close


def _print(rows: list[list[Any]], count: int, ppo_steps: int) -> None:
    print_table(
        f"SB3 VecEnvs over {count} Catch worlds on 2 server processes",
        [
            "servers",
            "variant",
            "env steps/s",
            "(c) steps/s vs this",
            f"PPO wall s ({ppo_steps:,} steps)",
            "(c) PPO speed vs this",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2400, help="world steps per timed run")
    parser.add_argument("--ppo-steps", type=int, default=4096, help="PPO steps per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    add_pin_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(apply_pin(args.pin))
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["dm_env_rpc_client.integrations.gymnasium"]
    )
    count, rows = args.worlds, []
    names = [DUMMY, SUBPROC, OURS]
    for server_key in args.servers:
        with server_processes(server_key) as servers:
            addresses = [server.address for server in servers]
            pids = [server.pid for server in servers]
            steps = measure_interleaved(
                {n: functools.partial(stepping, n, addresses, count) for n in names},
                args.steps,
                rounds=args.rounds,
                server_pid=pids,
            )
            ppo = measure_interleaved(
                {n: functools.partial(training, n, addresses, count) for n in names},
                args.ppo_steps,
                rounds=args.rounds,
                warmup=N_STEPS * count,
                server_pid=pids,
            )
        for name in names:
            rows.append(
                [
                    SERVERS[server_key],
                    name,
                    steps.median(name),
                    f"{steps.ratio(OURS, name):.2f}x",
                    args.ppo_steps / ppo.median(name),
                    f"{ppo.ratio(OURS, name):.2f}x",
                ]
            )
        _print(rows, count, args.ppo_steps)  # so far (the last one holds every server)
    print(
        f"\nMedians over {args.rounds} interleaved rounds; env steps/s over {args.steps:,} world "
        f"steps; PPO: model.learn({args.ppo_steps:,}) after a {N_STEPS * count:,}-step warm-up "
        "on a fresh model, n_steps=128, batch_size=256, n_epochs=4, one torch thread. "
        "'vs this' ratios are (c)'s speed over the row's, per round."
    )


if __name__ == "__main__":
    main()
