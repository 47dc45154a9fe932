"""DmEnvAdaptor.step, lockstep and pipelined, against the reference DmEnvAdaptor.

Run: ``python bench/environment.py [--steps N]``. The server runs in a separate
process: Catch, and an environment with a float32[100,000] observation. One
table per environment, with ratios against the reference adaptor.
"""

from __future__ import annotations

import argparse
from typing import Any

import grpc
import numpy as np
from _common import Measurement, measure, print_table, server_process
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

import dm_env_rpc_client as dmr


def reference(address: str, action: dict[str, Any]) -> Any:
    channel = grpc.insecure_channel(address)
    conn = reference_connection.Connection(channel)
    env, _ = reference_adaptor.create_and_join_world(conn, {}, {})
    env.reset()

    def run(steps: int) -> None:
        for _ in range(steps):
            env.step(action)

    return run, lambda: (env.close(), conn.close(), channel.close())


def ours(address: str, action: dict[str, Any], in_flight: int | None) -> Any:
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

    return run, lambda: (env.close(), conn.close())


def bench(address: str, action: dict[str, Any], steps: int) -> list[list[Any]]:
    results: dict[str, Measurement] = {}
    variants = {
        "reference DmEnvAdaptor.step": lambda: reference(address, action),
        "SDK DmEnvAdaptor.step (lockstep)": lambda: ours(address, action, None),
        "SDK step_iter, 8 in flight": lambda: ours(address, action, 8),
        "SDK step_iter, 32 in flight": lambda: ours(address, action, 32),
    }
    for name, factory in variants.items():
        run, close = factory()
        run(min(steps, 100))
        results[name] = measure(run, steps)
        close()
    base = results["reference DmEnvAdaptor.step"]
    return [
        [
            name,
            m.steps_per_second,
            m.cpu_us_per_step,
            f"{m.steps_per_second / base.steps_per_second:.2f}x",
        ]
        for name, m in results.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    header = ["adaptor", "steps/s", "CPU µs/step", "vs reference"]
    with server_process("--env", "catch") as address:
        rows = bench(address, {"paddle": np.int8(1)}, args.steps)
        print_table("Catch", header, rows)
    with server_process("--env", "large", "--size", "100000") as address:
        rows = bench(address, {"delta": np.float32(0.5)}, max(100, args.steps // 10))
        print_table("float32[100,000] observation", header, rows)


if __name__ == "__main__":
    main()
