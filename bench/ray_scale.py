"""What Ray adds: 16 Catch worlds on a fleet of 2 servers, stepped locally or in 1 or 2 shards.

Run: ``python bench/ray_scale.py [--steps N] [--rounds R]``. It starts a local
Ray (``num_cpus=2``, no dashboard) and a ``ServerFleet`` of 2 embedded Catch
servers (Ray actors), then, interleaved in rounds in a seeded shuffled order
(and again over 2 foreign servers written on the reference package,
``_lib/foreign_server.py``, given to the shards as addresses: a fleet serves only
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

``--scale [--servers sdk foreign] [--steps N] [--rounds R]`` instead compares
many worlds (issue 28). Over 4 server processes of each kind (``--max-workers``
room for 1,024 streams each), with 1,024 worlds per batch or shard (world ``i``
on server ``i % 4``), 2 steps in flight per world, ``--steps`` (20,000) steps
per batch or shard, in rounds in a seeded shuffled order:

- **1 local batch**: the shards' stepping loop over 1,024 worlds in a plain
  child process (no Ray there);
- **1 Ray shard**: ``run_sharded`` with one shard of 1,024 worlds;
- **4 local batches at once**: 4 such child processes side by side;
- **4 Ray shards at once**: ``run_sharded`` with 4 shards of 1,024 worlds.

Client CPU per step is each batch's or shard's own process's CPU time (all its
threads, Ray's included) over its steps: the per-shard number the target is
about. The table gives the median over the batches or shards, the largest,
and the median against the one local batch and against the local variant at
the same concurrency. Pinned by default (``--pin``): the servers on CPU 0,
this process on CPU 1, and so everything it starts (the child processes, and
Ray's, which it starts after pinning itself). On 2 cores, 4 shards and their
servers share them, so the wall-clock steps/s is what 2 cores give, not what 4
machines would.
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
from typing import Any, NamedTuple

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    DEFAULT_ROUNDS,
    SERVERS,
    add_pin_argument,
    any_server_process_info,
    apply_pin,
    pin,
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

from dm_env_rpc_client.integrations.ray import ServerFleet, init_ray, run_sharded
from dm_env_rpc_client.integrations.ray._shards import _Shard
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


def local_child(
    steps: int, addresses: list[str], count: int, pipeline: int, raw: bool = False
) -> None:
    worlds = list(range(count))
    options = {"timeout": 120.0}
    shard = _Shard(0, worlds, [addresses[w % len(addresses)] for w in worlds], 0, options)
    try:
        stats = shard.run(steps, None, pipeline, False)
    finally:
        shard.close()
    if raw:  # steps, stepping seconds, CPU seconds
        print(json.dumps([stats.stats.steps, stats.stats.elapsed, stats.cpu]))
        return
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
ONE_LOCAL, ONE_SHARD = "1 local batch", "1 Ray shard"
ALL_LOCAL, ALL_SHARDS = (
    f"{SCALE_SHARDS} local batches at once",
    f"{SCALE_SHARDS} Ray shards at once",
)
# Each variant: the name it is compared with at the same concurrency.
SCALE_VARIANTS = {
    ONE_LOCAL: ONE_LOCAL,
    ONE_SHARD: ONE_LOCAL,
    ALL_LOCAL: ALL_LOCAL,
    ALL_SHARDS: ALL_LOCAL,
}


class Stepper(NamedTuple):
    """One batch's or shard's run: its steps, stepping seconds and CPU seconds (its process)."""

    steps: int
    elapsed: float
    cpu: float


class ScaleSample(NamedTuple):
    """One variant in one round: every batch's or shard's run, and the servers' CPU seconds."""

    steppers: list[Stepper]
    server_cpu: float

    @property
    def cpu_us(self) -> list[float]:
        return [s.cpu / s.steps * 1e6 for s in self.steppers]

    @property
    def steps_per_second(self) -> float:
        """All steps over the slowest stepper's seconds (they step side by side)."""
        return sum(s.steps for s in self.steppers) / max(s.elapsed for s in self.steppers)


def _local_children(addresses: list[str], steps: int, count: int) -> list[Stepper]:
    """``count`` local batches of ``SCALE_WORLDS`` at once, each in a child process."""
    command = [sys.executable, __file__, *_local_command(steps, SCALE_WORLDS, SCALE_PIPELINE)]
    command += ["--raw", *addresses]
    children = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=600)
        if child.returncode:
            raise SystemExit(f"a local batch failed ({child.returncode})")
        results.append(Stepper(*json.loads(out.strip().splitlines()[-1])))
    return results


def _ray_shards(addresses: list[str], steps: int, count: int) -> list[Stepper]:
    """``run_sharded`` with ``count`` shards of ``SCALE_WORLDS`` worlds each."""
    run = run_sharded(
        addresses,
        num_worlds=SCALE_WORLDS * count,
        num_shards=count,
        steps=steps * count,
        seed=0,
        pipeline=SCALE_PIPELINE,
        num_cpus=1 / SCALE_SHARDS,
        timeout=120,
    )
    return [Stepper(s.stats.steps, s.stats.elapsed, s.cpu) for s in run.shards]


def scale_out(args: argparse.Namespace) -> None:
    """``--scale``: Ray shards of 1,024 worlds against local batches of 1,024 (see above)."""
    pinned = apply_pin(args.pin)
    pin([])  # this process on the clients' CPUs: the local batches and Ray's processes inherit it
    started = init_ray("local", num_cpus=2, log_to_driver=False)
    node = ray.util.get_node_ip_address()
    rows = []
    try:
        for kind in args.servers:
            samples = _scale_rounds(kind, args)
            rows += _scale_rows(kind, samples)
    finally:
        if started:
            ray.shutdown()
    print_table(
        f"{SCALE_WORLDS:,} Catch worlds per batch or shard, worlds i on server i % "
        f"{SCALE_SHARDS}, {SCALE_PIPELINE} steps in flight per world",
        [
            "servers",
            "client",
            "steps/s (all)",
            "client CPU µs/step (median)",
            "(largest)",
            "median vs 1 local batch",
            "median vs local, same concurrency",
            "server CPU µs/step",
        ],
        rows,
    )
    print(
        f"\n{args.steps:,} steps per batch or shard, medians over {args.rounds} interleaved "
        f"round(s); client CPU: each batch's or shard's process over its steps (all threads). "
        f"Server CPU: the {SCALE_SHARDS} servers' processes per step, over the whole variant "
        f"(connect and close included). Ray {ray.__version__} on {node}, {os.cpu_count()} cores."
    )
    print(pinned)


def _scale_rounds(kind: str, args: argparse.Namespace) -> dict[str, list[ScaleSample]]:
    """Every variant once per round, in a seeded shuffled order, on 4 servers of ``kind``."""
    room = str(SCALE_WORLDS + 16)  # the 4,096 worlds of 4 shards put 1,024 on each server
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(any_server_process_info(kind, "catch", "--max-workers", room))
            for _ in range(SCALE_SHARDS)
        ]
        pids = [server.pid for server in servers]
        pin(pids)
        addresses = [server.address for server in servers]
        samples: dict[str, list[ScaleSample]] = {name: [] for name in args.variants}
        order = [name for name in SCALE_VARIANTS if name in args.variants]
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                count = SCALE_SHARDS if name in (ALL_LOCAL, ALL_SHARDS) else 1
                step = _ray_shards if name in (ONE_SHARD, ALL_SHARDS) else _local_children
                before = sum(process_cpu_seconds(pid) for pid in pids)
                steppers = step(addresses, args.steps, count)
                server = sum(process_cpu_seconds(pid) for pid in pids) - before
                samples[name].append(ScaleSample(steppers, server))
                print(f"{SERVERS[kind]}, {name}: {samples[name][-1].cpu_us}", flush=True)
    return samples


def _scale_rows(kind: str, samples: dict[str, list[ScaleSample]]) -> list[list[Any]]:
    def median_cpu(sample: ScaleSample) -> float:
        return statistics.median(sample.cpu_us)

    def ratio(name: str, base: str) -> str:
        if base not in samples:
            return "-"
        ratios = [
            median_cpu(a) / median_cpu(b) for a, b in zip(samples[name], samples[base], strict=True)
        ]
        return f"{statistics.median(ratios):.2f}x"

    rows = []
    for name in samples:
        runs, same = samples[name], SCALE_VARIANTS[name]
        steps = [sum(s.steps for s in sample.steppers) for sample in runs]
        rows.append(
            [
                SERVERS[kind],
                name,
                statistics.median(sample.steps_per_second for sample in runs),
                statistics.median(median_cpu(sample) for sample in runs),
                statistics.median(max(sample.cpu_us) for sample in runs),
                ratio(name, ONE_LOCAL),
                ratio(name, same),
                statistics.median(
                    sample.server_cpu / total * 1e6
                    for sample, total in zip(runs, steps, strict=True)
                ),
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, help="steps per client (default 8,000; 20,000 with --scale)"
    )
    parser.add_argument(
        "--rounds", type=int, help=f"rounds (default {DEFAULT_ROUNDS}; 1 with --scale)"
    )
    parser.add_argument("--local-child", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", type=int, default=WORLDS, help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", type=int, default=PIPELINE, help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scale", action="store_true", help="4 shards of 1,024 worlds (see above)")
    parser.add_argument(
        "--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS), help="with --scale"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(SCALE_VARIANTS),
        default=list(SCALE_VARIANTS),
        help="with --scale: which to run (1 local batch always runs: the others' base)",
    )
    add_pin_argument(parser)
    args, addresses = parser.parse_known_args()
    if args.local_child is not None:
        local_child(args.local_child, addresses, args.worlds, args.pipeline, args.raw)
        return
    if args.scale:
        args.steps, args.rounds = args.steps or 20_000, args.rounds or 1
        args.variants = [n for n in SCALE_VARIANTS if n == ONE_LOCAL or n in args.variants]
        scale_out(args)
        return
    args.steps, args.rounds = args.steps or 8000, args.rounds or DEFAULT_ROUNDS
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
