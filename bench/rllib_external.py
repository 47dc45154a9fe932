"""RLlib fed from outside (the RLlink client) against RLlib's EnvRunners over the Gymnasium bridge.

Run: ``python bench/rllib_external.py [--worlds 8 64 256] [--iters 3] [--batch 2048]
[--servers sdk foreign]``. It starts a local Ray (``num_cpus=2``, no dashboard, loopback)
and, for each ``--servers`` kind, one Catch server in a child process (room for every world:
the SDK's, or ``foreign``, one written on the reference package, ``_lib/foreign_server.py``), then, for each world count, trains the same PPO
(one EnvRunner, ``train_batch_size_per_learner=--batch``, one epoch of one minibatch, so
that sampling dominates) two ways:

- **(a) RLlink client**: the EnvRunner is an ``EnvRunnerServerForExternalInference``; the
  client (``dm-env-rpc-client run --rllib-server``) is a separate process stepping the N
  worlds, one forward pass per ``recv``, shipping episodes each round and taking the weights
  trained on them while it steps the next (``lockstep=False``, the default);
- **(b) bridge**: the EnvRunner steps a ``GymnasiumVectorEnv`` of N worlds
  (``rllib_env_creator``, ``VECTOR_ENTRY_POINT``, ``FlattenObservations``).

After one warm-up iteration it times ``--iters`` iterations: **env steps/s** is the env steps
the learner got over their wall time, **learner steps/s** the env steps it trained on over the
same time (on-policy PPO trains on what it samples, so the two are close; they differ when an
iteration samples more than it trains). The ratio is (a) over (b) at the same world count.
**CPU µs per env step** is the CPU time of this process and all its descendants (the learner,
Ray's processes and EnvRunner, the Catch server, the client) over the timed iterations, per
env step the learner got: on 2 cores, what a route costs in all decides its speed as much as
its waits. The client's own CPU per step is its summary's (``cpu_us_per_step``).

Numbers on a shared 2-core machine are noisy (the client, the server, the EnvRunner and the
learner share the cores, and other work runs beside them): read the ratios, taken in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback

import gymnasium
import numpy as np
import ray
from _lib.common import foreign_server_process_info, print_table, server_process_info

from dm_env_rpc_client.integrations import ray as rayi

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the wrap travels by value
BOARD = gymnasium.spaces.Box(0.0, 1.0, (50,), np.float32)
MOVES = gymnasium.spaces.Discrete(3)


def paddle_moves(envs: Any) -> Any:
    """Catch's int8 paddle move (-1, 0, 1) as a Discrete(3) action."""
    from gymnasium.wrappers.vector import TransformAction

    return TransformAction(
        envs, lambda moves: (np.asarray(moves) - 1).astype(np.int8), single_action_space=MOVES
    )


def _ppo(batch: int) -> Any:
    from ray.rllib.algorithms.ppo import PPOConfig

    return (
        PPOConfig()
        .training(train_batch_size_per_learner=batch, minibatch_size=batch, num_epochs=1)
        .learners(num_learners=0)
        .debugging(seed=0)
    )


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and every live descendant, with what each
    has collected from its children that ended (``/proc/<pid>/stat``)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(v) for v in fields[11:15]) / tick
    tree, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return sum(times.get(pid, 0.0) for pid in tree)


def pid_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` alone (its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:13]) / os.sysconf("SC_CLK_TCK")


def _timed(algo: Any, iters: int, server_pid: int) -> tuple[float, float, float, float]:
    """Env steps/s, learner steps/s, CPU µs per env step of the whole process tree, and of
    the server process alone."""
    algo.train()  # warm-up: connections, first weights
    sampled = trained = 0.0
    cpu, server_cpu = tree_cpu_seconds(), pid_cpu_seconds(server_pid)
    started = time.perf_counter()
    for _ in range(iters):
        result = algo.train()
        sampled += result["env_runners"]["num_env_steps_sampled"]
        modules = result["learners"].get("__all_modules__", {})
        trained += modules.get(
            "num_env_steps_trained", result["env_runners"]["num_env_steps_sampled"]
        )
    elapsed = time.perf_counter() - started
    cpu, server_cpu = tree_cpu_seconds() - cpu, pid_cpu_seconds(server_pid) - server_cpu
    steps = max(sampled, 1.0)
    return sampled / elapsed, trained / elapsed, 1e6 * cpu / steps, 1e6 * server_cpu / steps


def rllink(address: str, pid: int, worlds: int, batch: int, iters: int) -> tuple[Any, ...]:
    """(a): env steps/s, learner steps/s, CPU µs/env step (all, the server's), client steps/s and
    CPU µs/step, and the client's seconds stepping / shipping / waiting for weights.

    The client runs until SIGTERMed after the timed iterations (so it is measured while alive).
    """
    from ray.rllib.env.external.env_runner_server_for_external_inference import (
        EnvRunnerServerForExternalInference,
    )

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = (
        _ppo(batch)
        .environment(observation_space=BOARD, action_space=MOVES, env_config={"port": port - 1})
        .env_runners(
            env_runner_cls=EnvRunnerServerForExternalInference,
            num_env_runners=1,
            create_local_env_runner=False,
            num_cpus_per_env_runner=0,
        )
    )
    algo = config.build_algo()
    command = [sys.executable, "-m", "dm_env_rpc_client", "run", "--address", address]
    command += ["--num-envs", str(worlds), "--rllib-server", f"127.0.0.1:{port}", "--json"]
    with tempfile.TemporaryFile("w+") as out:
        client = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL, text=True)
        try:
            sampled, trained, cpu, server_cpu = _timed(algo, iters, pid)
            client.terminate()  # SIGTERM: the summary, then exit 143
            client.wait(timeout=60)
        finally:
            if client.poll() is None:
                client.kill()
            algo.stop()
        out.seek(0)
        summary = json.loads(out.read() or "{}")
    own = float(summary.get("steps_per_second") or 0.0)
    split = " / ".join(
        f"{summary.get(key) or 0.0:.1f}"
        for key in ("stepping_seconds", "shipping_seconds", "learner_seconds")
    )
    client_cpu = float(summary.get("cpu_us_per_step") or 0.0)
    return sampled, trained, cpu, server_cpu, own, client_cpu, split


def bridge(address: str, pid: int, worlds: int, batch: int, iters: int) -> tuple[float, ...]:
    """(b): env steps/s, learner steps/s and CPU µs/env step (all, the server's) over the
    Gymnasium bridge."""
    from ray.rllib.connectors.env_to_module import FlattenObservations

    env_config = rayi.rllib_env_config(
        [address], seed=0, wrap=paddle_moves, connector_flattens=True
    )
    config = (
        _ppo(batch)
        .environment(env=rayi.register_rllib_env(), env_config=env_config)
        .env_runners(
            num_env_runners=1,
            num_envs_per_env_runner=worlds,
            num_cpus_per_env_runner=0,
            gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT,
            env_to_module_connector=lambda env, spaces=None, device=None: FlattenObservations(),
        )
    )
    algo = config.build_algo()
    try:
        return _timed(algo, iters, pid)
    finally:
        algo.stop()
        rayi.free_rllib_env_config(env_config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--servers", nargs="+", choices=["sdk", "foreign"], default=["sdk"])
    args = parser.parse_args()
    rayi.init_ray("local", num_cpus=2, log_to_driver=False)
    rows = []
    room = str(2 * max(args.worlds) + 16)
    starts = {
        "sdk": lambda: server_process_info("catch", "--max-workers", room),
        "foreign": lambda: foreign_server_process_info("catch", "--max-workers", room),
    }
    for kind in args.servers:  # the SDK's server, or one written on the reference package
        with starts[kind]() as server:
            for worlds in args.worlds:
                a_env, a_learn, a_cpu, a_server, client, client_cpu, split = rllink(
                    server.address, server.pid, worlds, args.batch, args.iters
                )
                b_env, b_learn, b_cpu, b_server = bridge(
                    server.address, server.pid, worlds, args.batch, args.iters
                )
                rows.append(
                    [
                        *(kind, worlds, a_env, a_learn, client, b_env, b_learn),
                        *(f"{a_env / b_env:.2f}x", a_cpu, client_cpu, b_cpu),
                        *(f"{a_cpu / b_cpu:.2f}x", a_server, b_server, split),
                    ]
                )
                print(rows[-1], file=sys.stderr, flush=True)
    print_table(
        f"PPO on Catch, one EnvRunner, train batch {args.batch}, {args.iters} iterations timed",
        [
            "server",
            "worlds",
            "(a) RLlink env steps/s",
            "(a) learner steps/s",
            "(a) client's own steps/s",
            "(b) bridge env steps/s",
            "(b) learner steps/s",
            "(a)/(b) env steps/s",
            "(a) CPU µs/env step, all",
            "(a) client CPU µs/step",
            "(b) CPU µs/env step, all",
            "(a)/(b) CPU",
            "(a) server CPU µs/env step",
            "(b) server CPU µs/env step",
            "(a) client s: stepping / shipping / waiting for weights",
        ],
        rows,
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
