"""DmEnvAdaptor.step, lockstep and pipelined, against the reference DmEnvAdaptor.

Run: ``python bench/environment.py [--steps N] [--rounds R]``. The server runs in
a separate process: Catch, and an environment with a float32[100,000]
observation. In each of R rounds, in a seeded shuffled order, every adaptor is set up,
warmed up, timed and closed (only the one being timed is connected). One table per
environment: steps per second, client CPU µs per step (all client threads) and
server CPU µs per step (the server process, from /proc), each the median over
the rounds, and the ratio against the reference adaptor, the median of the
per-round ratios, so drift between rounds cancels.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

# _common first: it sets GRPC_VERBOSITY before grpc is imported.
from _common import (
    DEFAULT_ROUNDS,
    ServerInfo,
    Variant,
    VariantFactory,
    measure_interleaved,
    print_table,
    server_process_info,
)

# isort: split
import grpc
import numpy as np
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

import dm_env_rpc_client as dmr

REFERENCE = "reference DmEnvAdaptor.step"


def reference(address: str, action: dict[str, Any]) -> Variant:
    channel = grpc.insecure_channel(address)
    conn = reference_connection.Connection(channel)
    env, _ = reference_adaptor.create_and_join_world(conn, {}, {})
    env.reset()

    def run(steps: int) -> None:
        for _ in range(steps):
            env.step(action)

    def close() -> None:
        env.close()
        conn.close()
        channel.close()

    return run, close


def ours(address: str, action: dict[str, Any], in_flight: int | None) -> Variant:
    conn = dmr.connect(address, timeout=30)
    env, _ = dmr.create_and_join_world(conn, {}, {})
    env.reset()

    def run(steps: int) -> None:
        if in_flight is None:
            for _ in range(steps):
                env.step(action)
        else:
            for _ in env.step_iter([action] * steps, in_flight=in_flight):
                pass

    def close() -> None:
        env.close()
        conn.close()

    return run, close


def bench(server: ServerInfo, action: dict[str, Any], steps: int, rounds: int) -> list[list[Any]]:
    address = server.address
    variants: dict[str, VariantFactory] = {
        REFERENCE: functools.partial(reference, address, action),
        "SDK DmEnvAdaptor.step (lockstep)": functools.partial(ours, address, action, None),
        "SDK step_iter, 8 in flight": functools.partial(ours, address, action, 8),
        "SDK step_iter, 32 in flight": functools.partial(ours, address, action, 32),
    }
    results = measure_interleaved(
        variants, steps, rounds=rounds, warmup=min(steps, 100), server_pid=server.pid
    )
    return [
        [
            name,
            results.median(name, "steps_per_second"),
            results.median(name, "cpu_us_per_step"),
            results.median(name, "server_cpu_us_per_step"),
            f"{results.ratio(name, REFERENCE):.2f}x",
        ]
        for name in results.names
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    args = parser.parse_args()
    header = ["adaptor", "steps/s", "client CPU µs/step", "server CPU µs/step", "vs reference"]
    large_steps = max(100, args.steps // 10)
    with server_process_info("catch") as server:
        rows = bench(server, {"paddle": np.int8(1)}, args.steps, args.rounds)
        print_table("Catch", header, rows)
    with server_process_info("large", "--size", "100000") as server:
        rows = bench(server, {"delta": np.float32(0.5)}, large_steps, args.rounds)
        print_table("float32[100,000] observation", header, rows)
    print(
        f"\nMedians over {args.rounds} interleaved rounds; steps per variant per round: "
        f"{args.steps:,} (Catch), {large_steps:,} (float32[100,000])."
    )


if __name__ == "__main__":
    main()
