"""Vector-env steps per second over 16 Catch worlds on 2 servers: four ways to drive them.

Run: ``python bench/gym_vector.py [--steps N] [--rounds R] [--worlds W] [--servers ...]``.
Two server processes hold the worlds (round-robin): first two of the SDK's
event-loop server, then two of a foreign one written on the reference package
(``_lib/foreign_server.py``), one table each, in one run. Every variant steps all the
worlds in lockstep with the same random actions, one vector step at a time:

- (a) gymnasium's ``SyncVectorEnv`` of ``GymnasiumEnv``s (one stream each, one
  world after another);
- (b) gymnasium's ``AsyncVectorEnv`` of ``GymnasiumEnv``s (one subprocess per
  world, forked from a clean forkserver);
- (c) ``GymnasiumVectorEnv`` over ``BatchedEnvironment``;
- (d) ``BatchedEnvironment.send`` then ``recv`` directly: the floor under (c).

Variants run interleaved in rounds (``bench/_lib/common.py``); steps/s count world
steps.

A second table (``--modes``, on by default) compares ``GymnasiumVectorEnv``'s
three autoreset modes over the SDK server: NEXT_STEP, SAME_STEP (the ended
worlds' autoreset steps sent in one pipelined batch within the vector step)
and DISABLED with ``reset(options={"reset_mask": ended})`` after each step that
ended worlds. Its "transitions/s" leaves out NEXT_STEP's autoreset steps (the
vector step after an end, whose action is ignored), counted during the runs. Catch's
episodes all last 9 steps, so after a reset every world ends on the same vector step (the
worst case for SAME_STEP, whose reset step then overlaps nothing); the ", staggered ends"
rows start world ``i`` ``i % 9`` steps into its episode, so a few worlds end on each step. Targets (issue 13): (c) >= 3x (a), >= 1.5x (b), >= 0.9x (d). Where the
installed gymnasium has ``gymnasium.utils.performance.benchmark_vector_step``,
it is run on (a), (b) and (c) too.
"""

from __future__ import annotations

import argparse
import multiprocessing
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    DEFAULT_ROUNDS,
    SERVERS,
    measure_interleaved,
    print_table,
    server_processes,
)

# isort: split
import gymnasium
import numpy as np
from gymnasium.utils import performance
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv, GymnasiumVectorEnv

SYNC = "(a) SyncVectorEnv of GymnasiumEnv"
ASYNC = "(b) AsyncVectorEnv of GymnasiumEnv"
OURS = "(c) GymnasiumVectorEnv"
FLOOR = "(d) BatchedEnvironment send/recv"
POOL = 64  # pre-drawn action batches, reused in turn: the RNG is no variant's cost


def _actions(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(-1, 2, count).astype(np.int8) for _ in range(POOL)]


def _env_fn(address: str) -> Any:
    return lambda: GymnasiumEnv(address=address)


def _stepping(envs: Any, count: int) -> Any:
    """The (run, close) pair of a vector env: lockstep steps with pre-drawn actions."""
    envs.reset(seed=0)
    pool = _actions(count)

    def run(steps: int) -> None:
        for index in range(steps // count):
            envs.step({"paddle": pool[index % POOL]})

    return run, envs.close


def sync_vector(addresses: list[str], count: int) -> Any:
    fns = [_env_fn(addresses[i % len(addresses)]) for i in range(count)]
    return SyncVectorEnv(fns, autoreset_mode=AutoresetMode.NEXT_STEP)


def async_vector(addresses: list[str], count: int) -> Any:
    fns = [_env_fn(addresses[i % len(addresses)]) for i in range(count)]
    return AsyncVectorEnv(fns, context="forkserver", autoreset_mode=AutoresetMode.NEXT_STEP)


def ours(addresses: list[str], count: int) -> Any:
    return GymnasiumVectorEnv(addresses=addresses, num_envs=count)


def floor(addresses: list[str], count: int) -> Any:
    batch = BatchedEnvironment.connect(addresses, count)
    batch.reset()
    pool = _actions(count)
    ids = list(range(count))

    def run(steps: int) -> None:
        for index in range(steps // count):
            batch.send({"paddle": pool[index % POOL]}, ids)
            batch.recv(env_ids=ids, timeout=30)

    return run, batch.close


def _gymnasium_benchmark(addresses: list[str], count: int) -> list[list[Any]]:
    """gymnasium's own vector benchmark (world steps/s), where the installed version has it."""
    bench = getattr(performance, "benchmark_vector_step", None)
    if bench is None:
        print(
            f"\ngymnasium {gymnasium.__version__} has no "
            "gymnasium.utils.performance.benchmark_vector_step; only the table above."
        )
        return []
    rows = []
    for name, make in ((SYNC, sync_vector), (ASYNC, async_vector), (OURS, ours)):
        envs = make(addresses, count)
        try:
            rows.append([name, float(bench(envs, target_duration=3, seed=0))])
        finally:
            envs.close()
    return rows


MODES = {
    "NEXT_STEP": AutoresetMode.NEXT_STEP,
    "SAME_STEP": AutoresetMode.SAME_STEP,
    "DISABLED + reset_mask": AutoresetMode.DISABLED,
}


STAGGERED = ", staggered ends"


def _staggered_batch(addresses: list[str], count: int) -> BatchedEnvironment:
    """A batch whose world ``i`` is ``i % 9`` steps into its episode: ends spread over 9 steps."""
    batch = BatchedEnvironment.connect(addresses, count)
    batch.reset()
    for index in range(count):
        for _ in range(index % 9):
            batch.send([{"paddle": 0}], [index])
            batch.recv(env_ids=[index], timeout=30)
    return batch


def _mode_stepping(
    addresses: list[str], count: int, mode: Any, tally: list[int], stagger: bool = False
) -> Any:
    """(run, close) of a ``GymnasiumVectorEnv`` in ``mode``; ``tally`` counts [transitions, steps].

    ``stagger``: over a ``_staggered_batch`` (not reset again), so that a few worlds end on
    each vector step instead of all of them on every ninth.
    """
    batch = _staggered_batch(addresses, count) if stagger else None
    if batch is not None:
        envs = GymnasiumVectorEnv(batch, autoreset_mode=mode)
    else:
        envs = GymnasiumVectorEnv(addresses=addresses, num_envs=count, autoreset_mode=mode)
        envs.reset(seed=0)
    pool = _actions(count)
    wasted = np.zeros(count, bool)  # NEXT_STEP: the next step of these worlds is an autoreset

    def run(steps: int) -> None:
        nonlocal wasted
        for index in range(steps // count):
            _, _, terminations, truncations, _ = envs.step({"paddle": pool[index % POOL]})
            ended = terminations | truncations
            tally[0] += count - int(wasted.sum())
            tally[1] += count
            if mode == AutoresetMode.NEXT_STEP:
                wasted = ended
            elif mode == AutoresetMode.DISABLED and ended.any():
                envs.reset(options={"reset_mask": ended})

    def close() -> None:
        envs.close()
        if batch is not None:
            batch.close()

    return run, close


def _measure_modes(count: int, args: argparse.Namespace) -> None:
    with server_processes("sdk") as servers:
        addresses = [server.address for server in servers]
        names = [*MODES, *(name + STAGGERED for name in MODES)]
        tallies = {name: [0, 0] for name in names}

        def variant(name: str) -> Any:
            mode = MODES[name.removesuffix(STAGGERED)]
            return lambda: _mode_stepping(
                addresses, count, mode, tallies[name], stagger=name.endswith(STAGGERED)
            )

        variants = {name: variant(name) for name in names}
        variants[FLOOR] = lambda: floor(addresses, count)
        results = measure_interleaved(
            variants, args.steps, rounds=args.rounds, server_pid=[s.pid for s in servers]
        )
        rows = []
        for name in variants:
            useful = tallies[name][0] / tallies[name][1] if name in tallies else 1.0
            base = "NEXT_STEP" + (STAGGERED if name.endswith(STAGGERED) else "")
            rows.append(
                [
                    name,
                    results.median(name),
                    results.median(name) * useful,
                    results.median(name, "cpu_us_per_step"),
                    f"{results.ratio(name, base):.2f}x",
                ]
            )
        print_table(
            f"GymnasiumVectorEnv autoreset modes, {count} Catch worlds (10 rows) on 2 SDK servers",
            ["variant", "world steps/s", "transitions/s", "client CPU µs/step", "vs NEXT_STEP"],
            rows,
        )
        print(
            f"\nMedians over {args.rounds} interleaved rounds of {args.steps:,} world steps; "
            "transitions/s leaves out NEXT_STEP's autoreset steps (action ignored); "
            "staggered rows are compared with NEXT_STEP staggered."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3200, help="world steps per timed run")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--worlds", type=int, default=16)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument(
        "--modes", action=argparse.BooleanOptionalAction, default=True, help="the modes table"
    )
    parser.add_argument("--only-modes", action="store_true", help="only the autoreset modes table")
    args = parser.parse_args()
    count = args.worlds
    # AsyncVectorEnv's workers fork from a server that imported the SDK but opened nothing.
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["dm_env_rpc_client.integrations.gymnasium"]
    )
    if args.modes or args.only_modes:
        _measure_modes(count, args)
    if args.only_modes:
        return
    for server_key in args.servers:
        _measure(server_key, count, args)


def _measure(server_key: str, count: int, args: argparse.Namespace) -> None:
    """Every variant over 2 server processes of one kind (``SERVERS``), then gymnasium's own."""
    label = SERVERS[server_key]
    with server_processes(server_key) as servers:
        addresses = [server.address for server in servers]
        variants = {
            SYNC: lambda: _stepping(sync_vector(addresses, count), count),
            ASYNC: lambda: _stepping(async_vector(addresses, count), count),
            OURS: lambda: _stepping(ours(addresses, count), count),
            FLOOR: lambda: floor(addresses, count),
        }
        results = measure_interleaved(
            variants,
            args.steps,
            rounds=args.rounds,
            server_pid=[server.pid for server in servers],
        )
        rows = [
            [
                name,
                results.median(name),
                results.median(name, "cpu_us_per_step"),
                results.median(name, "server_cpu_us_per_step"),
                f"{results.ratio(OURS, name):.2f}x",
            ]
            for name in variants
        ]
        print_table(
            f"World steps/s, {count} Catch worlds on 2 {label} processes, lockstep vector steps",
            ["variant", "steps/s", "client CPU µs/step", "server CPU µs/step", "(c) vs this"],
            rows,
        )
        print(
            f"\nMedians over {args.rounds} interleaved rounds of {args.steps:,} world steps per "
            "variant; client CPU is the benchmark process only (not (b)'s worker processes)."
        )
        print(
            f"Targets ({label}): (c)/(a) >= 3x: {results.ratio(OURS, SYNC):.2f}x; "
            f"(c)/(b) >= 1.5x: {results.ratio(OURS, ASYNC):.2f}x; "
            f"(c)/(d) >= 0.9x: {results.ratio(OURS, FLOOR):.2f}x."
        )
        extra = _gymnasium_benchmark(addresses, count)
        if extra:
            print_table(
                f"gymnasium benchmark_vector_step (world steps/s), {label}",
                ["variant", "steps/s"],
                extra,
            )


if __name__ == "__main__":
    main()
