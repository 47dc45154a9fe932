"""How a batch's cost grows with its worlds: 64, 1,024, 4,096 and 16,384 Catch worlds.

Run: ``python bench/scale.py [--worlds 64 1024 4096 16384] [--servers sdk foreign]``.
For each server kind (the SDK's embedded server, and a foreign one written on
the reference package, ``_lib/foreign_server.py``), 4 server processes serve Catch
(8 from 16,384 worlds on, to spare the servers' CPU: ``_lib/scale_report.py``),
each started with room for the largest batch (``--max-workers``: a stream per
world). For each size, a fresh client process (so its RSS is its own) runs
``BatchedEnvironment.connect`` over the 4 servers with the ``step_timeout``
watchdog (600 s, ``STEP_TIMEOUT``) and restart policy ``"restart"``, resets, keeps two
steps in flight per world and takes ``recv(n // 2)`` at a time, sending each
world that came back its next step at once, for ``--steps-per-world`` steps per
world (at least ``--min-steps``) after a warm-up of 3 per world. Reported:

- connect and close: wall seconds of ``connect`` and of ``close``;
- client CPU per step: the client process's CPU (all threads) over the timed
  steps; ``--threads`` adds each thread's share (from /proc/self/task);
- RSS per world: the client's RSS after the run minus before connect, over n;
  server RSS per world: the same for the 4 servers' processes, summed;
- steps/s, p50 and p99 latency (send to response, ``envs.latencies``);
- spread: the most steps any world took over the fewest (1.00 is even); "per
  server": the same among the worlds of one server, the largest of the 4 (the
  servers share a CPU, so one may run faster than another; within one server's
  worlds an uneven count could only be the client's doing).

The "vs" column divides each size's client CPU per step by the first size's
(64 worlds by default). The client runs on its own CPU and the servers on the other (``--pin``, default).

A second table says where connect and close go: their wall time, the client's
CPU and the 4 servers' CPU (summed, from /proc) in each. ``--floor`` adds the raw
gRPC floor of the same opening and closing on bare ``grpc.aio`` (``_lib/open_floor.py``),
against each kind's servers (the client's floor), and against 4 bare ``grpc.aio``
servers that answer with pre-serialized bytes (``_lib/server_floor.py``: the row "raw
gRPC floor, client and server", whose servers' CPU is the servers' floor);
``--connect-only`` skips the steps, ``--profile PREFIX`` records the client (and the stepping floor's, PREFIX-<kind>-floor-<n>-client.txt) and
every server with py-spy, ``--baseline DIR`` adds rows for the SDK found in DIR
(another commit's tree: a before-and-after in one run, each size's "before" row
in the stepping table and in this one, with ``--threads`` its collector's line);
with ``--baseline-servers`` the SDK server's "before" rows also run on 4 servers of
DIR's SDK (started next to this checkout's, all pinned alike), so the servers' CPU
columns compare the two servers.

A third table puts each size's client CPU per step next to the raw gRPC stepping
floor's: the same steps on bare ``grpc.aio`` (``_lib/step_floor.py``), in a fresh
process of its own; the floor's growth from the first size is gRPC's, the
client/floor ratio is the SDK's (``--no-step-floor`` skips it); its spreads are the
floor's worlds' (nothing on the floor's client holds a world back, so an uneven
floor is the servers' doing). ``--cli`` adds a
fourth: the CLI's ``run`` loop (``dmr.collect``: random actions, ``IN_FLIGHT`` in
flight per world, the same number of steps) over a batch connected the same way.

``--rounds R`` measures each size R times (the SDK, its floor and ``--cli`` in turn, each
in a fresh process): the rows are each one's median round, and the client/floor ratios
their median with the range over the rounds. ``--streams-per-connection N`` connects with
``max_streams_per_connection=N`` and lays the stepping floor's streams out the same way (N
a connection; by default the floor has one connection a server, the batch 100 streams a
connection). ``--plot FILE.svg`` draws client CPU per step
against worlds for the SDK (``send``/``recv``, and with ``--cli`` the run loop) and the
floor, each server kind, with matplotlib. CPU per step is CPU time, so a ratio taken in one
run holds on a loaded machine; wall times (connect, close, steps/s) do not.

The last lines say which of the issue's targets each size meets (PASS) or misses
(FAIL): client CPU per step at most 1.15x the stepping floor's (``send``/``recv`` and
the run loop), with ``--floor`` connect and close within 1.15x of the opening floor's
(wall and client CPU) and RSS at most 40 KB a world (from 1,024 worlds); at 4,096 worlds
connect 2 s, close 1 s, client CPU per step 1.2x the first size's; at every size a
spread of at most 1.10. ``--threads``
also prints, for the client and the floor, CPU per step by thread, the part of it
spent in Python's garbage collector (the collecting thread's CPU time, with the
client's collections by generation) and, for the client, the part on the thread that
calls ``send``/``recv`` (the rest of "python" is the batch's loop thread).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    SERVERS,
    add_pin_argument,
    any_server_process_info,
    apply_pin,
    floor_server_process_info,
    pin,
    print_table,
    process_cpu_seconds,
    thread_cpu,
    tree_server_process_info,
)

# isort: split
import contextlib

from _lib.scale_report import (
    PlotPoint,
    cpu_range,
    median_round,
    phase_targets,
    ratio_target,
    ratio_text,
    server_count,
    servers_text,
    write_plot,
)

if len(sys.argv) > 1 and sys.argv[1] == "--child" and os.environ.get("SCALE_SDK_ROOT"):
    # --baseline: this child measures the SDK in that directory (another commit's tree), not
    # this checkout's (which _lib.common put first on the path and imported part of).
    for _name in [name for name in sys.modules if name.startswith("dm_env_rpc_client")]:
        del sys.modules[_name]
    sys.path.insert(0, os.environ["SCALE_SDK_ROOT"])

WORLDS = (64, 1024, 4096, 16384)
# py-spy (--profile): the one beside this Python (a venv's bin, often not on PATH), else PATH's.
_BESIDE = os.path.join(os.path.dirname(sys.executable), "py-spy")
PY_SPY = _BESIDE if os.access(_BESIDE, os.X_OK) else "py-spy"
IN_FLIGHT = 2
WARMUP_PER_WORLD = 3
# The batch's step watchdog, as by default but with more time: 8 reference-package servers
# sharing one core answer 16,384 worlds' 32,768 steps in flight at 1,000 to 1,800 steps/s, so a
# world's answer can wait 30 s (the default step_timeout) in their queues, and the watchdog
# restarted worlds that were only queued (each restart more work for the same servers: a
# warm-up of 105 steps in 60 s). The watchdog's cost per step is the same.
STEP_TIMEOUT = 600.0
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def server_pids() -> list[str]:
    """The server processes' pids ($SCALE_SERVER_PIDS)."""
    return os.environ.get("SCALE_SERVER_PIDS", "").split()


def servers_rss() -> int:
    """The RSS of the server processes, summed."""
    return sum(rss_bytes(pid) for pid in server_pids())


def servers_cpu() -> float:
    """The CPU seconds the server processes have used, summed."""
    return sum(process_cpu_seconds(int(pid)) for pid in server_pids())


class Spent:
    """Wall, client CPU and servers' CPU seconds of one phase (``with Spent() as spent:``)."""

    def __enter__(self) -> Spent:
        self._start = (time.perf_counter(), time.process_time(), servers_cpu())
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall, cpu, servers = self._start
        self.wall = time.perf_counter() - wall
        self.cpu = time.process_time() - cpu
        self.servers = servers_cpu() - servers

    def seconds(self) -> dict[str, float]:
        return {"wall": self.wall, "cpu": self.cpu, "servers": self.servers}


def streams_option() -> dict[str, int]:
    """``connect``'s ``max_streams_per_connection`` from ``--streams-per-connection`` (passed
    to the child as $SCALE_STREAMS_PER_CONNECTION), or nothing (the default)."""
    value = os.environ.get("SCALE_STREAMS_PER_CONNECTION")
    return {"max_streams_per_connection": int(value)} if value else {}


def connect_options() -> dict[str, Any]:
    """How every size connects: a restart policy, the watchdog (``STEP_TIMEOUT``), seeds."""
    return {
        "timeout": 60,
        "seed": 0,
        "on_world_failure": "restart",
        "step_timeout": STEP_TIMEOUT,
        **streams_option(),
    }


def client(addresses: list[str], worlds: int, steps: int, threads: bool) -> dict[str, Any]:
    """One size, in this (child) process; returns the measurements."""
    import numpy as np
    from _lib.step_floor import GcTime, spreads

    import dm_env_rpc_client as dmr

    rss0, server_rss0 = rss_bytes(), servers_rss()
    if steps < 0:  # --floor: the same opening and closing on bare grpc.aio
        from _lib.open_floor import open_close_floor

        return {**open_close_floor(addresses, worlds, servers_cpu), "rss_kb": float("nan")}
    with Spent() as connecting:
        batch = dmr.BatchedEnvironment.connect(addresses, worlds, **connect_options())
    if steps == 0:  # --connect-only: connect and close, nothing else
        rss = rss_bytes() - rss0
        with Spent() as closing:
            batch.close()
        return {
            "connect": connecting.seconds(),
            "close": closing.seconds(),
            "rss_kb": rss / worlds / 1024,
        }
    rng = np.random.default_rng(0)
    paddles = rng.integers(-1, 2, worlds * 4).astype(np.int8)
    cursor = 0

    def send(ids: Any) -> None:
        nonlocal cursor
        if cursor + len(ids) > len(paddles):
            cursor = 0
        batch.send({"paddle": paddles[cursor : cursor + len(ids)]}, ids)
        cursor += len(ids)

    def run(total: int) -> np.ndarray:
        counts = np.zeros(worlds, np.int64)
        received = 0
        while received < total:
            got = batch.recv(worlds // 2, timeout=60)
            ids = got.env_ids
            np.add.at(counts, ids, 1)
            received += len(ids)
            send(list(ids))
        return counts

    batch.reset()
    everyone = list(range(worlds))
    for _ in range(IN_FLIGHT):
        send(everyone)
    run(WARMUP_PER_WORLD * worlds)
    batch.latencies.clear()
    before = thread_cpu() if threads else {}
    collections = [generation["collections"] for generation in gc.get_stats()]
    wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
    with GcTime() as collecting:
        counts = run(steps)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    main = time.thread_time() - main  # this (the calling) thread's part of "python"
    after = thread_cpu() if threads else {}
    taken = int(counts.sum())
    rss = rss_bytes() - rss0
    server_rss = servers_rss() - server_rss0
    latencies = np.array(batch.latencies) * 1e3
    while batch.pending():  # the steps still in flight, so close does not count them
        batch.recv(1, timeout=60)  # (all that finished; slow servers: 60 s for each one)
    with Spent() as closing:
        batch.close()
    per_thread = {
        name: (after[name] - before.get(name, 0.0)) / taken * 1e6
        for name in after
        if after[name] - before.get(name, 0.0) > 0
    }
    return {
        "connect": connecting.seconds(),
        "close": closing.seconds(),
        "cpu_us": cpu / taken * 1e6,
        "rss_kb": rss / worlds / 1024,
        "server_rss_kb": server_rss / worlds / 1024,
        "steps_s": taken / wall,
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        **spreads(counts, len(addresses)),
        "threads_us": {
            **per_thread,
            "(of which gc)": collecting.seconds / taken * 1e6,
            "(of which the caller's thread)": main / taken * 1e6,
        },
        "gc": {
            "collections": [
                generation["collections"] - before_gc
                for generation, before_gc in zip(gc.get_stats(), collections, strict=True)
            ],
            "seconds": [round(seconds, 3) for seconds in collecting.by_generation],
            "tracked": len(gc.get_objects()),
        },
        "failures": len(batch.failures),
    }


def cli_client(addresses: list[str], worlds: int, steps: int) -> dict[str, float]:
    """The CLI's ``run`` loop (``dmr.collect``, random actions, ``IN_FLIGHT`` in flight per
    world) over a batch connected as above: its CPU per step, after a warm-up run."""
    import dm_env_rpc_client as dmr

    batch = dmr.BatchedEnvironment.connect(addresses, worlds, **connect_options())
    with batch:
        options = {"pipeline": IN_FLIGHT, "timeout": 60.0, "seed": 0}
        dmr.collect(batch, steps=WARMUP_PER_WORLD * worlds, **options)
        wall, cpu = time.perf_counter(), time.process_time()
        stats = dmr.collect(batch, steps=steps, **options)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"cpu_us": cpu / stats.steps * 1e6, "steps_s": stats.steps / wall}


class ChildFailed(RuntimeError):
    """A size's client process failed (its own error is on stderr, above)."""


def run_child(
    servers: list[Any],
    worlds: int,
    steps: int,
    threads: bool,
    profile: str | None = None,
    step_floor: bool = False,
    cli: bool = False,
    sdk_root: str | None = None,
) -> dict[str, Any]:
    addresses = [server.address for server in servers]
    environment = {**os.environ, "SCALE_SERVER_PIDS": " ".join(str(s.pid) for s in servers)}
    if sdk_root:
        environment["SCALE_SDK_ROOT"] = sdk_root
    command = [sys.executable, __file__, "--child", str(worlds), str(steps), *addresses]
    if threads:
        command.append("--threads")
    if step_floor:
        command.append("--step-floor")
    if cli:
        command.append("--cli")
    # The child inherits this process's CPUs (``pin`` put it on the client's).
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)
    spies = []
    if profile:  # py-spy samples the client and each server, every thread, for the client's life
        targets = [("client", process.pid)]
        targets += [(f"server{number}", server.pid) for number, server in enumerate(servers)]
        for name, pid in targets:
            spy_command = [PY_SPY, "record", "-p", str(pid), "-f", "raw", "-r", "250"]
            spy_command += ["--threads", "--nonblocking", "-o", f"{profile}-{worlds}-{name}.txt"]
            spies.append(
                subprocess.Popen(spy_command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
    try:
        out, _ = process.communicate(timeout=600)
        for spy in spies[1:]:  # the servers live on: stop their samplers (they write on SIGINT)
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for spy in spies:
            if spy.poll() is None:
                spy.kill()
                spy.wait()
    if process.returncode:
        raise ChildFailed(f"the {worlds}-world client failed (exit status {process.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def measure_rounds(
    args: argparse.Namespace, servers: list[Any], worlds: int, steps: int, profile: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One size's rounds: the SDK's client, its stepping floor and the run loop (as ``args``
    ask), each in a fresh process; py-spy (``profile``) on the first round only."""
    results, stepped_rounds, ran_rounds = [], [], []
    for number in range(1 if args.connect_only else args.rounds):
        spy = profile if number == 0 else None
        results.append(run_child(servers, worlds, steps, args.threads, spy))
        if args.connect_only:
            continue
        if args.step_floor:
            floor_spy = spy and f"{spy}-floor"
            stepped_rounds.append(
                run_child(servers, worlds, steps, args.threads, floor_spy, step_floor=True)
            )
        if args.cli:
            ran_rounds.append(run_child(servers, worlds, steps, False, cli=True))
    return results, stepped_rounds, ran_rounds


def child_main(argv: list[str]) -> None:
    threads, floor, cli = "--threads" in argv, "--step-floor" in argv, "--cli" in argv
    argv = [arg for arg in argv if arg not in ("--threads", "--step-floor", "--cli")]
    worlds, steps, addresses = int(argv[0]), int(argv[1]), argv[2:]
    if cli:
        result = cli_client(addresses, worlds, steps)
    elif floor:  # the stepping floor: the same steps on bare grpc.aio
        from _lib.step_floor import step_floor

        result = step_floor(
            addresses,
            worlds,
            steps,
            WARMUP_PER_WORLD,
            thread_cpu if threads else None,
            streams_option().get("max_streams_per_connection"),
        )
    else:
        result = client(addresses, worlds, steps, threads)
    print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--steps-per-world", type=int, default=40)
    parser.add_argument("--min-steps", type=int, default=20_000)
    parser.add_argument("--threads", action="store_true", help="print CPU per step per thread")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each size this many times (the SDK, its floor and --cli in turn): the "
        "rows are the median rounds, the ratios medians with their range",
    )
    parser.add_argument(
        "--plot",
        metavar="SVG",
        help="write CPU per step against worlds (the SDK, the floor and --cli's run loop, "
        "each server kind) to this SVG file (matplotlib)",
    )
    parser.add_argument(
        "--connect-only", action="store_true", help="only connect and close (no steps)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also connect and close each size on bare grpc.aio (the raw gRPC floor)",
    )
    parser.add_argument(
        "--step-floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also step each size on bare grpc.aio (the raw gRPC stepping floor, _lib/step_floor.py)",
    )
    parser.add_argument(
        "--cli",
        action="store_true",
        help="also time the CLI's run loop (dmr.collect) at each size: a fourth table",
    )
    parser.add_argument(
        "--profile",
        metavar="PREFIX",
        help="py-spy record each client and each server to PREFIX-<kind>-<n>-<process>.txt",
    )
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also measure the SDK in DIR (another commit's tree, e.g. from `git archive main "
        "dm_env_rpc_client | tar -x -C DIR`), each size right after this checkout's",
    )
    parser.add_argument(
        "--baseline-servers",
        action="store_true",
        help="with --baseline, the 'before' rows of the SDK server run against 4 servers of "
        "DIR's SDK too (started beside this checkout's): the server's own before-and-after",
    )
    parser.add_argument(
        "--streams-per-connection",
        type=int,
        metavar="N",
        help="connect with max_streams_per_connection=N, and lay the stepping floor's streams "
        "out the same way (default: the batch's default, and the floor on one connection a "
        "server)",
    )
    add_pin_argument(parser)
    args = parser.parse_args()
    if args.streams_per_connection:  # the children read it (streams_option)
        os.environ["SCALE_STREAMS_PER_CONNECTION"] = str(args.streams_per_connection)
    pinned = apply_pin(args.pin)
    counts = {worlds: server_count(worlds) for worlds in args.worlds}
    started = max(counts.values())  # each size uses the first counts[worlds] of them
    per_server = max(-(-worlds // counts[worlds]) for worlds in args.worlds) + 16  # and some
    room = ("--max-workers", str(per_server))
    rows, phases, verdicts, floors, cli_rows = [], [], [], [], []
    points: list[PlotPoint] = []  # for --plot
    floor_phases: dict[tuple[str, int], dict[str, Any]] = {}  # (kind, worlds): open_close_floor
    if args.floor:  # both ends bare grpc.aio: the floor of the servers' CPU too
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(floor_server_process_info()) for _ in range(started)]
            pin([server.pid for server in servers])
            for worlds in args.worlds:
                floor = run_child(servers[: counts[worlds]], worlds, -1, False)
                phases.append(phase_row(SERVER_FLOOR_ROW, worlds, floor))
    for kind in args.servers:
        with contextlib.ExitStack() as stack:
            all_servers = [
                stack.enter_context(any_server_process_info(kind, "catch", *room))
                for _ in range(started)
            ]
            all_old = all_servers
            if args.baseline and args.baseline_servers and kind == "sdk":
                all_old = [
                    stack.enter_context(tree_server_process_info(args.baseline, "catch", *room))
                    for _ in range(started)
                ]
            pin([server.pid for server in {*all_servers, *all_old}])
            base = floor_base = cli_base = before_base = None
            for worlds in args.worlds:
                servers, old_servers = all_servers[: counts[worlds]], all_old[: counts[worlds]]
                steps = (
                    0 if args.connect_only else max(args.min_steps, args.steps_per_world * worlds)
                )
                profile = args.profile and f"{args.profile}-{kind}"
                if args.floor:
                    floor = floor_phases[kind, worlds] = run_child(servers, worlds, -1, False)
                    phases.append(phase_row(f"{SERVERS[kind]}, raw gRPC floor", worlds, floor))
                before = None
                if args.baseline:
                    before = run_child(
                        old_servers, worlds, steps, args.threads, sdk_root=args.baseline
                    )
                    phases.append(phase_row(f"{SERVERS[kind]}, before", worlds, before))
                # Rounds: the SDK, its floor and the run loop in turn, each in a fresh process;
                # the rows show each one's median round, the ratios their median and range.
                try:
                    results, stepped_rounds, ran_rounds = measure_rounds(
                        args, servers, worlds, steps, profile
                    )
                except ChildFailed as failed:  # the other sizes' tables still print
                    print(f"{SERVERS[kind]}, {worlds:,} worlds: {failed}; its rows are left out")
                    verdicts.append(f"FAIL {SERVERS[kind]}, {worlds:,} worlds: {failed}")
                    continue
                result = median_round(results)
                phases.append(phase_row(SERVERS[kind], worlds, result))
                if args.floor:
                    verdicts += phase_targets(SERVERS[kind], worlds, result, floor)
                if args.connect_only:
                    continue
                base = base or result["cpu_us"]
                point = PlotPoint(SERVERS[kind], worlds, result["cpu_us"], cpu_range(results))
                if args.step_floor:
                    stepped = median_round(stepped_rounds)
                    floor_base = floor_base or stepped["cpu_us"]
                    ratios = [
                        mine["cpu_us"] / theirs["cpu_us"]
                        for mine, theirs in zip(results, stepped_rounds, strict=True)
                    ]
                    if args.threads:
                        print_threads(f"{SERVERS[kind]}, {worlds} worlds, floor", stepped)
                    floors.append(
                        [
                            *floor_row(SERVERS[kind], worlds, result, stepped, base, floor_base),
                            ratio_text(ratios),
                        ]
                    )
                    verdicts.append(ratio_target(SERVERS[kind], worlds, "send/recv", ratios))
                    point = point._replace(
                        floor_us=stepped["cpu_us"], floor_range=cpu_range(stepped_rounds)
                    )
                if args.cli:
                    ran = median_round(ran_rounds)
                    cli_base = cli_base or ran["cpu_us"]
                    row = [
                        SERVERS[kind],
                        f"{worlds:,}",
                        f"{ran['cpu_us']:.1f} µs",
                        f"{ran['cpu_us'] / cli_base:.2f}x",
                        f"{ran['steps_s']:,.0f}",
                    ]
                    if args.step_floor:
                        ratios = [
                            mine["cpu_us"] / theirs["cpu_us"]
                            for mine, theirs in zip(ran_rounds, stepped_rounds, strict=True)
                        ]
                        row += [f"{stepped['cpu_us']:.1f} µs", ratio_text(ratios)]
                        verdicts.append(ratio_target(SERVERS[kind], worlds, "run loop", ratios))
                    cli_rows.append(row)
                    point = point._replace(run_us=ran["cpu_us"])
                points.append(point)
                verdicts += targets(SERVERS[kind], worlds, result, result["cpu_us"] / base)
                if before is not None:
                    before_base = before_base or before["cpu_us"]
                    rows.append(step_row(f"{SERVERS[kind]}, before", worlds, before, before_base))
                    if args.threads:
                        print_threads(f"{SERVERS[kind]}, {worlds} worlds, before", before)
                        print(GC_LINE.format(**before["gc"]))
                rows.append(step_row(SERVERS[kind], worlds, result, base))
                if args.threads:
                    print_threads(f"{SERVERS[kind]}, {worlds} worlds, client", result)
                    print(GC_LINE.format(**result["gc"]))
                if result["failures"]:
                    print(f"  ({result['failures']} world failures during the run)")
    if rows:
        print_table(
            f"BatchedEnvironment over {servers_text(args.worlds)} servers, Catch, {IN_FLIGHT} steps in flight "
            "per world, recv(n // 2)",
            [
                "server",
                "worlds",
                "connect",
                "close",
                "client CPU/step",
                f"vs {args.worlds[0]:,}",
                "RSS/world",
                "server RSS/world",
                "steps/s",
                "p50",
                "p99",
                "spread",
                "per server",
            ],
            rows,
        )
        print(
            f"\n{args.steps_per_world} steps per world (at least {args.min_steps:,}) after a "
            f"warm-up of {WARMUP_PER_WORLD}; each size in a fresh client process."
        )
    if floors:
        print_table(
            "Client CPU per step vs the raw gRPC stepping floor (bare grpc.aio, the same steps: "
            "_lib/step_floor.py)",
            [
                "server",
                "worlds",
                "client CPU/step",
                "floor CPU/step",
                "client/floor",
                f"client vs {args.worlds[0]:,}",
                f"floor vs {args.worlds[0]:,}",
                "floor steps/s",
                "floor spread",
                "floor per server",
                "client/floor by round: median (range)",
            ],
            floors,
        )
    if cli_rows:
        print_table(
            f"The CLI's run loop (dmr.collect, random actions, {IN_FLIGHT} in flight per world)",
            ["server", "worlds", "client CPU/step", f"vs {args.worlds[0]:,}", "steps/s"]
            + (["floor CPU/step", "run/floor by round: median (range)"] if args.step_floor else []),
            cli_rows,
        )
    print_table(
        "Where connect and close go: wall seconds, the client's CPU seconds (all threads), and "
        f"the {servers_text(args.worlds)} servers' CPU seconds (summed)",
        [
            "server",
            "worlds",
            "connect",
            "client CPU",
            "servers CPU",
            "close",
            "client CPU",
            "servers CPU",
            "RSS/world",
        ],
        phases,
    )
    if args.baseline and args.baseline_servers and "sdk" in args.servers:
        print(f"\nThe SDK server's 'before' rows ran on servers of {args.baseline}'s SDK.")
    for verdict in verdicts:
        print(verdict)
    if args.plot and points:
        write_plot(args.plot, points)
        print(f"Wrote {args.plot}.")
    print(pinned)


SERVER_FLOOR_ROW = "raw gRPC floor, client and server"

GC_LINE = (
    "  garbage collections by generation {collections}, seconds in them {seconds}, objects the "
    "GC tracks after the run {tracked:,}"
)


def step_row(label: str, worlds: int, result: dict[str, Any], base: float) -> list[str]:
    """A row of the stepping table (``base``: the first size's client CPU per step)."""
    return [
        label,
        f"{worlds:,}",
        f"{result['connect']['wall']:.2f} s",
        f"{result['close']['wall']:.2f} s",
        f"{result['cpu_us']:.1f} µs",
        f"{result['cpu_us'] / base:.2f}x",
        f"{result['rss_kb']:.0f} KB",
        f"{result['server_rss_kb']:.0f} KB",
        f"{result['steps_s']:,.0f}",
        f"{result['p50_ms']:.1f} ms",
        f"{result['p99_ms']:.1f} ms",
        f"{result['spread']:.2f}",
        f"{result['server_spread']:.2f}",
    ]


# The targets at 4,096 worlds over 4 servers, and fairness at every size (the floor
# ratios' targets are in _lib/scale_report.py).
TARGET_WORLDS = 4096
TARGETS = {"connect": 2.0, "close": 1.0, "rss_kb": 40.0, "cpu_vs_first": 1.2, "spread": 1.10}


def targets(server: str, worlds: int, result: dict[str, Any], cpu_ratio: float) -> list[str]:
    """Lines saying which targets this size meets (PASS) or misses (FAIL)."""
    checks = [
        ("spread", result["spread"], "step counts' spread (fairness)"),
        ("spread", result["server_spread"], "step counts' spread within a server's worlds"),
    ]
    if worlds == TARGET_WORLDS:
        checks += [
            ("connect", result["connect"]["wall"], "connect, s"),
            ("close", result["close"]["wall"], "close, s"),
            ("rss_kb", result["rss_kb"], "RSS per world, KB"),
            ("cpu_vs_first", cpu_ratio, "client CPU per step vs the first size"),
        ]
    return [
        f"{'PASS' if value <= TARGETS[key] else 'FAIL'} {server}, {worlds:,} worlds: {what} "
        f"{value:.2f} (at most {TARGETS[key]})"
        for key, value, what in checks
    ]


def print_threads(what: str, result: dict[str, Any]) -> None:
    """Prints a run's CPU µs per step by thread, most first."""
    shares = sorted(result["threads_us"].items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{name} {us:.1f}" for name, us in shares)
    print(f"{what} CPU µs/step by thread: {text}", flush=True)


def floor_row(
    server: str,
    worlds: int,
    result: dict[str, Any],
    floor: dict[str, float],
    base: float,
    floor_base: float,
) -> list[str]:
    """One row of the client-vs-stepping-floor table."""
    return [
        server,
        f"{worlds:,}",
        f"{result['cpu_us']:.1f} µs",
        f"{floor['cpu_us']:.1f} µs",
        f"{result['cpu_us'] / floor['cpu_us']:.2f}x",
        f"{result['cpu_us'] / base:.2f}x",
        f"{floor['cpu_us'] / floor_base:.2f}x",
        f"{floor['steps_s']:,.0f}",
        f"{floor['spread']:.2f}",
        f"{floor['server_spread']:.2f}",
    ]


def phase_row(server: str, worlds: int, result: dict[str, Any]) -> list[str]:
    """One row of the connect-and-close table."""
    row = [server, f"{worlds:,}"]
    for phase in ("connect", "close"):
        spent = result[phase]
        row += [f"{spent['wall']:.2f} s", f"{spent['cpu']:.2f} s", f"{spent['servers']:.2f} s"]
    rss = result["rss_kb"]
    return [*row, "-" if rss != rss else f"{rss:.0f} KB"]  # NaN: not measured


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
    else:
        main()
