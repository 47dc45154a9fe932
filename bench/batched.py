"""Aggregate random-action steps per second over 1, 4 and 16 Catch worlds.

Run: ``python bench/batched.py [--steps N] [--rounds R]``. Two server processes
hold the worlds (round-robin). This SDK's ``BatchedEnvironment`` (pipelined
send/recv, 8 steps in flight per world) against a loop over the reference
``DmEnvAdaptor`` (one step per world in turn), interleaved in rounds: in each
round, in a seeded shuffled order, each client is set up, warmed up, timed and
closed. Steps/s, client CPU and server CPU (both server processes) are
medians over the rounds; the ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

# _common first: it sets GRPC_VERBOSITY before grpc is imported.
from _common import DEFAULT_ROUNDS, measure_interleaved, print_table, server_process_info

# isort: split
import grpc
import numpy as np
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

from dm_env_rpc_client.batched import BatchedEnvironment

WORLDS = (1, 4, 16)
WINDOW = 8
REFERENCE = "reference loop"
OURS = f"SDK batched, {WINDOW} in flight/world"


def reference_loop(addresses: list[str], count: int) -> Any:
    channels, conns, envs = [], [], []
    for index in range(count):
        channel = grpc.insecure_channel(addresses[index % len(addresses)])
        conn = reference_connection.Connection(channel)
        env, _ = reference_adaptor.create_and_join_world(conn, {}, {})
        env.reset()
        channels.append(channel)
        conns.append(conn)
        envs.append(env)
    rng = np.random.default_rng(0)

    def run(steps: int) -> None:
        for _ in range(steps // count):
            for env in envs:
                env.step({"paddle": np.int8(rng.integers(-1, 2))})

    def close() -> None:
        for env, conn, channel in zip(envs, conns, channels, strict=True):
            env.close()
            conn.close()
            channel.close()

    return run, close


def ours(addresses: list[str], count: int) -> Any:
    batch = BatchedEnvironment.connect(addresses, count)
    batch.reset()
    dtype = batch.action_spec()["paddle"].dtype
    rng = np.random.default_rng(0)

    def run(steps: int) -> None:
        sent = received = 0
        while received < steps:
            while sent < steps:  # top every world up to WINDOW steps in flight
                ids = [w for w in range(count) if batch.in_flight(w) < WINDOW][: steps - sent]
                if not ids:
                    break
                batch.send({"paddle": rng.integers(-1, 2, len(ids)).astype(dtype)}, ids)
                sent += len(ids)
            wanted = min(max(1, count // 2), sent - received)
            received += len(batch.recv(wanted, timeout=30).env_ids)

    return run, batch.close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3200)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    args = parser.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(server_process_info("catch")) for _ in range(2)]
        addresses = [server.address for server in servers]
        for count in args.worlds:
            results = measure_interleaved(
                {
                    REFERENCE: lambda count=count: reference_loop(addresses, count),
                    OURS: lambda count=count: ours(addresses, count),
                },
                args.steps,
                rounds=args.rounds,
                server_pid=[server.pid for server in servers],
            )
            for name in (REFERENCE, OURS):
                rows.append(
                    [
                        count,
                        name,
                        results.median(name),
                        results.median(name, "cpu_us_per_step"),
                        results.median(name, "server_cpu_us_per_step"),
                        f"{results.ratio(name, REFERENCE):.2f}x",
                    ]
                )
    print_table(
        "Aggregate steps/s, Catch, 2 server processes",
        [
            "worlds",
            "client",
            "steps/s",
            "client CPU µs/step",
            "server CPU µs/step",
            "vs reference loop",
        ],
        rows,
    )
    print(f"\nMedians over {args.rounds} interleaved rounds of {args.steps:,} steps per client.")


if __name__ == "__main__":
    main()
