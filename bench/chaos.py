"""16 Catch worlds on 2 server processes, one of them killed and restarted every 10 s.

Run: ``python bench/chaos.py [--seconds S] [--every E] [--servers ...]`` (bounded:
two phases of ``S`` seconds each, default 25, plus start-up; about 60 s per kind
of server). It runs on the SDK's own server processes, then on foreign ones
written on the reference package (``_lib/foreign_server.py``), one table each.

The batch connects with ``on_world_failure="restart"`` and keeps 8 steps in
flight per world (send/recv, EnvPool-style). Phase 1 runs undisturbed. Phase 2
runs the same loop while a background thread SIGKILLs server 1 every ``E``
seconds (default 10) and starts a new one on the same port. The worlds of
server 0 are the *healthy* ones: their steps/s in phase 2 over phase 1 is the
ratio that matters (target: at least 0.8). Every step sent is accounted for:
answered, or dropped by a failure (``WorldFailure.steps_lost``), so the lost
count must be 0. Restart latency is each restart's ``downtime``: from detection
to the world's new FIRST step being filed.

``--servers launched`` (also run by default) starts the 2 foreign servers with
``dmr.launch`` instead, and the chaos thread only SIGKILLs server 1: the
launcher relaunches it on its port. Its table adds relaunch latency (death seen
to serving again, ``Relaunch.downtime``) and the worlds per server once the
chaos stops and the batch has recovered (``_batch.balance``: at most one apart).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    FOREIGN_SERVER,
    SERVERS,
    any_server_process_info,
    print_table,
    server_processes,
)

# isort: split
import numpy as np

from dm_env_rpc_client._batch.restart import RestartPolicy
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.launch import RelaunchPolicy, launch

WORLDS = 16
WINDOW = 8


def step_for(envs: BatchedEnvironment, seconds: float, counts: list[int]) -> tuple[int, int]:
    """Keeps WINDOW steps in flight per live world for ``seconds``; returns (sent, received)."""
    sent = received = 0
    for _ in range(WINDOW):
        ids = envs.live_ids
        envs.send({"paddle": np.zeros(len(ids), np.int8)}, ids)
        sent += len(ids)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = envs.recv(1, timeout=60)
        ids = batch.env_ids.tolist()
        received += len(ids)
        for index in ids:
            counts[index] += 1
        envs.send({"paddle": np.zeros(len(ids), np.int8)}, ids)
        sent += len(ids)
    while envs.pending():  # drain: every step sent is answered or counted as lost
        received += len(envs.recv(1, timeout=60).env_ids)
    return sent, received


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="length of each phase")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between kills")
    kinds = [*SERVERS, "launched"]
    parser.add_argument("--servers", nargs="+", choices=kinds, default=kinds)
    args = parser.parse_args()
    for server_key in args.servers:
        if server_key == "launched":
            _run_launched(args)
        else:
            _run(server_key, args)


def _run(server_key: str, args: argparse.Namespace) -> None:
    """Both phases on 2 server processes of one kind (``SERVERS``)."""
    label = SERVERS[server_key]
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(server_processes(server_key))
        addresses = [server.address for server in servers]
        port = addresses[1].rsplit(":", 1)[1]
        policy = RestartPolicy(attempts=10, total=30.0, backoff=0.2, max_backoff=1.0)
        envs = stack.enter_context(
            BatchedEnvironment.connect(
                addresses, WORLDS, on_world_failure="restart", step_timeout=5.0, restart=policy
            )
        )
        envs.reset()
        healthy = [index for index in range(WORLDS) if index % 2 == 0]  # on server 0
        calm = [0] * WORLDS
        started = time.perf_counter()
        calm_sent, calm_received = step_for(envs, args.seconds, calm)
        calm_seconds = time.perf_counter() - started

        stop = threading.Event()
        kills: list[float] = []

        def chaos() -> None:
            while not stop.wait(args.every):
                os.kill(servers[1].pid, signal.SIGKILL)
                kills.append(time.monotonic())
                servers[1] = stack.enter_context(
                    any_server_process_info(server_key, "catch", "--port", port)
                )

        killer = threading.Thread(target=chaos, name="chaos", daemon=True)
        stormy = [0] * WORLDS
        started = time.perf_counter()
        killer.start()
        stormy_sent, stormy_received = step_for(envs, args.seconds, stormy)
        stormy_seconds = time.perf_counter() - started
        stop.set()
        killer.join(timeout=60)

        failures = list(envs.failures)
        lost_in_failures = sum(f.steps_lost for f in failures)
        downtimes = [f.downtime for f in failures if f.outcome == "restarted"]
        # A restarted world's FIRST step was received and answers one of its steps_lost.
        answered_by_first = sum(1 for f in failures if f.outcome == "restarted" and f.steps_lost)
        unaccounted = (calm_sent + stormy_sent) - (calm_received + stormy_received)
        unaccounted -= lost_in_failures - answered_by_first
        calm_rate = sum(calm[i] for i in healthy) / calm_seconds
        stormy_rate = sum(stormy[i] for i in healthy) / stormy_seconds
        rows: list[list[Any]] = [
            ["undisturbed", f"{calm_seconds:.1f}", f"{calm_rate:,.0f}",
             f"{sum(calm) / calm_seconds:,.0f}", "1.00x"],
            [f"server 1 killed every {args.every:.0f} s", f"{stormy_seconds:.1f}",
             f"{stormy_rate:,.0f}", f"{sum(stormy) / stormy_seconds:,.0f}",
             f"{stormy_rate / calm_rate:.2f}x"],
        ]  # fmt: skip
        print_table(
            f"{WORLDS} Catch worlds on 2 {label} processes, {WINDOW} in flight/world, "
            "restart policy",
            ["phase", "seconds", "healthy steps/s", "all steps/s", "healthy vs undisturbed"],
            rows,
        )
        outcomes = {o: sum(f.outcome == o for f in failures) for o in ("restarted", "removed")}
        print(
            f"\nkills: {len(kills)}; world failures: {len(failures)} ({outcomes}); "
            f"steps in flight at the failures (answered by the FIRST step after the restart, "
            f"or dropped and counted in steps_lost): {lost_in_failures}; "
            f"steps lost (sent, neither answered nor counted): {unaccounted}"
        )
        if downtimes:
            print(
                f"restart latency (detection to FIRST step filed): p50 "
                f"{statistics.median(downtimes) * 1e3:,.0f} ms, p99 "
                f"{percentile(downtimes, 0.99) * 1e3:,.0f} ms, max {max(downtimes) * 1e3:,.0f} ms "
                f"over {len(downtimes)} restarts; new addresses: "
                f"{sorted({str(f.new_address) for f in failures})} (server 1 is {addresses[1]})"
            )
        print(f"live worlds at the end: {len(envs.live_ids)} of {WORLDS}")


def _run_launched(args: argparse.Namespace) -> None:
    """The launched-servers row: server 1 SIGKILLed every ``every`` s, relaunched by ``launch``."""
    command = [sys.executable, str(FOREIGN_SERVER), "--env", "catch", "--port", "{port}"]
    relaunch = RelaunchPolicy(attempts=5, backoff=0.2)
    policy = RestartPolicy(attempts=10, total=30.0, backoff=0.2, max_backoff=1.0)
    with (
        launch(command, 2, relaunch=relaunch) as servers,
        BatchedEnvironment.connect(
            servers, WORLDS, on_world_failure="restart", step_timeout=5.0, restart=policy
        ) as envs,
    ):
        envs.reset()
        stop = threading.Event()
        kills: list[float] = []

        def chaos() -> None:
            while not stop.wait(args.every):
                with contextlib.suppress(OSError):
                    os.kill(servers.servers[1].pid, signal.SIGKILL)
                    kills.append(time.monotonic())

        counts = [0] * WORLDS
        killer = threading.Thread(target=chaos, name="chaos", daemon=True)
        started = time.perf_counter()
        killer.start()
        sent, received = step_for(envs, args.seconds, counts)
        stop.set()
        killer.join(timeout=60)
        stormy_seconds = time.perf_counter() - started
        # Recovery: step on (bounded) until server 1 is back and the worlds are even.
        deadline = time.monotonic() + 60
        recovered = float("nan")
        settle = time.perf_counter()
        while time.monotonic() < deadline:
            per_server = collections.Counter(envs.addresses)
            loads = [per_server[a] for a in servers.addresses]
            if servers.alive(1) and max(loads) - min(loads) <= 1 and len(envs.live_ids) == WORLDS:
                recovered = time.perf_counter() - settle
                break
            more_sent, more_received = step_for(envs, 0.5, counts)
            sent, received = sent + more_sent, received + more_received
        failures = list(envs.failures)
        answered_by_first = sum(1 for f in failures if f.outcome == "restarted" and f.steps_lost)
        lost = sent - received - (sum(f.steps_lost for f in failures) - answered_by_first)
        relaunched = [r.downtime for r in envs.relaunches if r.outcome == "relaunched"]
        restarts = [f.downtime for f in failures if f.outcome == "restarted"]

        def ms(values: list[float], q: float) -> str:
            return f"{percentile(values, q) * 1e3:,.0f}" if values else "n/a"

        per_server = collections.Counter(envs.addresses)
        print_table(
            f"{WORLDS} Catch worlds on 2 launched reference-package servers (dmr.launch), "
            f"{WINDOW} in flight/world, server 1 SIGKILLed every {args.every:.0f} s for "
            f"{stormy_seconds:.0f} s",
            [
                "kills", "relaunches", "relaunch p50 ms", "relaunch p99 ms",
                "world restarts", "restart p50 ms", "restart p99 ms", "moves home",
                "steps lost", "worlds per server after recovery", "recovery s",
            ],
            [[
                len(kills), len(relaunched), ms(relaunched, 0.5), ms(relaunched, 0.99),
                len(restarts), ms(restarts, 0.5), ms(restarts, 0.99), len(envs.moves),
                lost, " / ".join(str(per_server[a]) for a in servers.addresses),
                f"{recovered:.1f}",
            ]],
        )  # fmt: skip


if __name__ == "__main__":
    main()
