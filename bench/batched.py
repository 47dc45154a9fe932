"""Aggregate random-action steps per second over 1, 4 and 16 Catch worlds.

Run: ``python bench/batched.py [--steps N]``. Two server processes hold the
worlds (round-robin). This SDK's ``BatchedEnvironment`` (pipelined send/recv)
against a loop over the reference ``DmEnvAdaptor`` (one step per world in turn),
in one table with ratios.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import grpc
import numpy as np
from _common import measure, print_table, server_process
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

from dm_env_rpc_client.batched import BatchedEnvironment

WORLDS = (1, 4, 16)


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


def ours(addresses: list[str], count: int, window: int) -> Any:
    batch = BatchedEnvironment.connect(addresses, count)
    batch.reset()
    spec = batch.action_spec()
    rng = np.random.default_rng(0)

    def run(steps: int) -> None:
        sent = received = 0
        while received < steps:
            ids = [w for w in range(count) if len(batch._inflight[w]) < window][: steps - sent]
            if ids:
                actions = {"paddle": rng.integers(-1, 2, len(ids)).astype(spec["paddle"].dtype)}
                batch.send(actions, ids)
                sent += len(ids)
            wanted = min(max(1, count // 2), sent - received)
            received += len(batch.recv(wanted, timeout=30).env_ids)

    return run, batch.close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3200)
    args = parser.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        addresses = [stack.enter_context(server_process("--env", "catch")) for _ in range(2)]
        for count in WORLDS:
            results = {}
            for name, factory in (
                ("reference loop", lambda count=count: reference_loop(addresses, count)),
                ("SDK batched, 8 in flight/world", lambda count=count: ours(addresses, count, 8)),
            ):
                run, close = factory()
                run(min(args.steps, 160))
                results[name] = measure(run, args.steps, repeats=2)
                close()
            base = results["reference loop"].steps_per_second
            for name, m in results.items():
                rows.append(
                    [
                        count,
                        name,
                        m.steps_per_second,
                        m.cpu_us_per_step,
                        f"{m.steps_per_second / base:.2f}x",
                    ]
                )
    print_table(
        "Aggregate steps/s, Catch, 2 server processes",
        ["worlds", "client", "steps/s", "CPU µs/step", "vs reference loop"],
        rows,
    )


if __name__ == "__main__":
    main()
