"""What Ray adds: 16 Catch worlds on a fleet of 2 servers, stepped locally or in 1 or 2 shards.

Run: ``python bench/ray_scale.py [--steps N] [--rounds R]``. It starts a local
Ray (``num_cpus=2``, no dashboard) and a ``ServerFleet`` of 2 embedded Catch
servers (Ray actors), then, interleaved in rounds in a seeded shuffled order
(and again over 2 foreign servers written on the reference package,
``_foreign_server.py``, given to the shards as addresses: a fleet serves only
the SDK's server):

- **local process**: one ``BatchedEnvironment`` over the 16 worlds in a plain
  child process (no Ray started there), stepped by the same loop the shards
  run (random actions, 8 in flight per world);
- **1 shard** and **2 shards**: ``run_sharded`` over the same 16 worlds.

Steps/s is aggregate (all steps over the slowest stepper's time); client CPU
per step is the stepping processes' CPU time (each measures its own, all
threads) per step; server CPU per step sums both server processes (from
/proc), over the whole run including connecting. Medians over the rounds; the
ratio is the median of per-round ratios against the local process.

On one 2-core machine this can only show what Ray costs, not what it gains:
2 servers and 2 shards share 2 cores. docs/ray.md projects to N nodes from
one shard's client CPU per step.

``--scale`` instead compares many worlds (issue 28): over 4 SDK server
processes (``--max-workers`` room for 1,024 worlds each), one local batch of
1,024 worlds in a plain child process, then 4 such batches at once (4
processes), then ``run_sharded`` with 4 shards of 1,024 worlds; 2 steps in
flight per world. Each row gives the aggregate steps/s and each batch's or
shard's client CPU per step (median over them, and the largest), against the
one local batch's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
from typing import Any

# _common first: it sets GRPC_VERBOSITY before grpc is imported.
from _common import (
    DEFAULT_ROUNDS,
    any_server_process_info,
    print_table,
    process_cpu_seconds,
    server_processes,
)

# isort: split
# A local Ray on loopback only, reporting nothing (read when Ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray starts its workers at nice 15; at 0 they compete with the local process on equal terms.
os.environ.setdefault("RAY_worker_niceness", "0")

import ray

from dm_env_rpc_client.integrations._ray_shards import _Shard
from dm_env_rpc_client.integrations.ray import ServerFleet, init_ray, run_sharded
from dm_env_rpc_client.server.catch import Catch

WORLDS = 16
PIPELINE = 8
LOCAL = "local process"
SHARDS = {"1 shard": 1, "2 shards": 2}
FRACTION = 0.5  # CPUs reserved per server and per shard: 2 servers + 2 shards fit 2 CPUs


def make_catch(settings: dict[str, Any]) -> Catch:
    return Catch(**settings)


def local(
    addresses: list[str], steps: int, worlds: int = WORLDS, pipeline: int = PIPELINE
) -> tuple[float, float]:
    """The shards' stepping loop over all worlds, in a child process without Ray started.

    Not in this process: Ray's driver threads here would be counted in its CPU time.
    """
    out = subprocess.run(
        [sys.executable, __file__, *_local_command(steps, worlds, pipeline), *addresses],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rate, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return rate, cpu


def _local_command(steps: int, worlds: int, pipeline: int) -> list[str]:
    return ["--local-child", str(steps), "--worlds", str(worlds), "--pipeline", str(pipeline)]


def local_child(steps: int, addresses: list[str], count: int, pipeline: int) -> None:
    worlds = list(range(count))
    options = {"timeout": 120.0}
    shard = _Shard(0, worlds, [addresses[w % len(addresses)] for w in worlds], 0, options)
    try:
        stats = shard.run(steps, None, pipeline, False)
    finally:
        shard.close()
    print(
        json.dumps([stats.stats.steps / stats.stats.elapsed, stats.cpu / stats.stats.steps * 1e6])
    )


def sharded(source: ServerFleet | list[str], shards: int, steps: int) -> tuple[float, float]:
    run = run_sharded(
        source,
        num_worlds=WORLDS,
        num_shards=shards,
        steps=steps,
        seed=0,
        pipeline=PIPELINE,
        num_cpus=FRACTION,
    )
    return run.steps_per_second, run.cpu_us_per_step


Samples = dict[str, list[tuple[float, float, float]]]


def measure(source: ServerFleet | list[str], pids: list[int], args: argparse.Namespace) -> Samples:
    """Every client once per round, in a seeded shuffled order, over the servers of ``source``."""
    addresses = source.addresses if isinstance(source, ServerFleet) else source
    names = [LOCAL, *SHARDS]
    samples: Samples = {name: [] for name in names}
    order = list(names)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            before = sum(process_cpu_seconds(pid) for pid in pids)
            if name == LOCAL:
                rate, cpu = local(addresses, args.steps)
            else:
                rate, cpu = sharded(source, SHARDS[name], args.steps)
            server = (sum(process_cpu_seconds(pid) for pid in pids) - before) / args.steps
            samples[name].append((rate, cpu, server * 1e6))
    return samples


def report(title: str, samples: Samples) -> None:
    def median(name: str, field: int) -> float:
        return statistics.median(sample[field] for sample in samples[name])

    def ratio(name: str) -> str:
        ratios = [a[0] / b[0] for a, b in zip(samples[name], samples[LOCAL], strict=True)]
        return f"{statistics.median(ratios):.2f}x"

    print_table(
        title,
        ["client", "steps/s", "client CPU µs/step", "server CPU µs/step", "vs local process"],
        [
            [name, median(name, 0), median(name, 1), median(name, 2), ratio(name)]
            for name in samples
        ],
    )


SCALE_WORLDS, SCALE_SHARDS, SCALE_PIPELINE = 1024, 4, 2


def scale_out(steps: int) -> None:
    """``--scale``: 4 Ray shards of 1,024 worlds against local batches of 1,024 (see above)."""
    room = str(SCALE_WORLDS + 16)
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(any_server_process_info("sdk", "catch", "--max-workers", room))
            for _ in range(SCALE_SHARDS)
        ]
        addresses = [server.address for server in servers]
        one = [local(addresses, steps, SCALE_WORLDS, SCALE_PIPELINE)]
        command = [sys.executable, __file__, *_local_command(steps, SCALE_WORLDS, SCALE_PIPELINE)]
        children = [
            subprocess.Popen([*command, *addresses], stdout=subprocess.PIPE, text=True)
            for _ in range(SCALE_SHARDS)
        ]
        together = []
        for child in children:
            out, _ = child.communicate(timeout=600)
            together.append(tuple(json.loads(out.strip().splitlines()[-1])))
        started = init_ray("local", num_cpus=2, log_to_driver=False)
        try:
            run = run_sharded(
                addresses,
                num_worlds=SCALE_WORLDS * SCALE_SHARDS,
                num_shards=SCALE_SHARDS,
                steps=steps * SCALE_SHARDS,
                seed=0,
                pipeline=SCALE_PIPELINE,
                num_cpus=1 / SCALE_SHARDS,
                timeout=120,
            )
        finally:
            if started:
                ray.shutdown()
    shards = [
        (shard.stats.steps / shard.stats.elapsed, shard.cpu / shard.stats.steps * 1e6)
        for shard in run.shards
    ]
    base = one[0][1]
    rows = []
    for name, samples, aggregate in (
        ("1 local batch of 1,024", one, one[0][0]),
        (f"{SCALE_SHARDS} local batches of 1,024 at once", together, sum(s[0] for s in together)),
        (f"{SCALE_SHARDS} Ray shards of 1,024", shards, run.steps_per_second),
    ):
        cpus = [cpu for _, cpu in samples]
        middle = statistics.median(cpus)
        rows.append(
            [
                name,
                aggregate,
                middle,
                max(cpus),
                f"{middle / base:.2f}x",
                f"{max(cpus) / base:.2f}x",
            ]
        )
    print_table(
        f"{SCALE_WORLDS:,} Catch worlds per batch or shard over {SCALE_SHARDS} SDK servers, "
        f"{SCALE_PIPELINE} steps in flight per world",
        [
            "client",
            "steps/s (all)",
            "CPU µs/step (median)",
            "CPU µs/step (largest)",
            "median vs 1 local",
            "largest vs 1 local",
        ],
        rows,
    )
    print(f"\n{steps:,} steps per batch or shard; Ray {ray.__version__}, {os.cpu_count()} cores.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--local-child", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", type=int, default=WORLDS, help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", type=int, default=PIPELINE, help=argparse.SUPPRESS)
    parser.add_argument("--scale", action="store_true", help="4 shards of 1,024 worlds (see above)")
    args, addresses = parser.parse_known_args()
    if args.local_child is not None:
        local_child(args.local_child, addresses, args.worlds, args.pipeline)
        return
    if args.scale:
        scale_out(args.steps)
        return
    started = init_ray("local", num_cpus=2, log_to_driver=False)
    try:
        with ServerFleet(make_catch, 2, num_cpus=FRACTION) as fleet:
            pids = [server.pid for server in fleet.servers()]
            ours = measure(fleet, pids, args)
        with server_processes("foreign") as foreign:
            theirs = measure(
                [server.address for server in foreign], [server.pid for server in foreign], args
            )
    finally:
        if started:
            ray.shutdown()
    report(
        f"{WORLDS} Catch worlds on a fleet of 2 SDK servers, {PIPELINE} steps in flight per world",
        ours,
    )
    report(
        f"{WORLDS} Catch worlds on 2 reference-package server processes (their addresses, "
        f"no fleet), {PIPELINE} steps in flight per world",
        theirs,
    )
    print(
        f"\nMedians over {args.rounds} interleaved rounds of {args.steps:,} steps per client; "
        f"Ray {ray.__version__}, {os.cpu_count()} cores."
    )


if __name__ == "__main__":
    main()
