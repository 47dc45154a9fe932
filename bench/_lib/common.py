"""Shared benchmark helpers: server subprocesses, timing, and table printing.

The machine the benchmarks run on may be shared and noisy, so throughput drifts
between consecutive measurements. :func:`measure_interleaved` copes with that:
it runs every variant once per round, in a seeded shuffled order (each set up,
timed and closed in its turn), and reports medians over the rounds; ratios between variants
are taken within each round (where they saw the same conditions) before the
median, so drift between rounds cancels.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

# Before grpc is imported anywhere (the scripts import this module before grpc), so
# gRPC's INFO log lines ("Got goaway", ...) stay out of the tables. The server
# subprocesses inherit it through their environment.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from dm_env_rpc_client.server import _subprocess  # noqa: E402
from dm_env_rpc_client.server._subprocess import server_subprocess  # noqa: E402

DEFAULT_ROUNDS = 5

# CPU pinning (``--pin``, set by ``apply_pin``): the servers' processes on the first half of the
# CPUs, the benchmark's client on the other half. None: nothing is pinned.
_PIN: tuple[set[int], set[int]] | None = None


class ServerInfo(NamedTuple):
    address: str
    pid: int


@contextlib.contextmanager
def server_process_info(env: str, *extra_args: str) -> Iterator[ServerInfo]:
    """The embedded server serving ``env`` in a child process; yields its address and pid."""
    with server_subprocess(env, extra_args=extra_args) as server:
        yield ServerInfo(server.address, server.process.pid)


FOREIGN_SERVER = pathlib.Path(__file__).resolve().parent / "foreign_server.py"

# The two servers every table compares (--servers key: name in the tables): the SDK's own
# event-loop server, and a foreign one written on the reference package (sync gRPC handler),
# each in a process of its own.
SERVERS = {"sdk": "SDK server", "foreign": "reference-package server"}


@contextlib.contextmanager
def command_server_process_info(
    command: Sequence[str], what: str, cwd: str | None = None
) -> Iterator[ServerInfo]:
    """A server started by ``command`` (in ``cwd``) that prints ``Serving <env> on <address>``."""
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd
    )
    try:
        line = _subprocess._first_line(process.stdout, 30.0)
        match = _subprocess._ADDRESS.match(line.strip()) if line else None
        if match is None:
            raise OSError(f"The {what} server did not start (it printed {line!r}).")
        yield ServerInfo(match.group(1), process.pid)
    finally:
        _subprocess._stop(process)
        if process.stdout is not None:
            process.stdout.close()


def foreign_server_process_info(env: str, *extra_args: str) -> Any:
    """The foreign server (``_lib/foreign_server.py``) serving ``env`` in a child process."""
    command = [sys.executable, str(FOREIGN_SERVER), "--env", env, *extra_args]
    return command_server_process_info(command, f"foreign {env}")


SERVER_FLOOR = pathlib.Path(__file__).resolve().parent / "server_floor.py"


def floor_server_process_info(*extra_args: str) -> Any:
    """The raw gRPC floor server (``_lib/server_floor.py``: bare ``grpc.aio``, pre-serialized
    answers, no environment) in a child process that ends with this one."""
    command = [sys.executable, str(SERVER_FLOOR), "--exit-with-parent", *extra_args]
    return command_server_process_info(command, "raw gRPC floor")


def tree_server_process_info(root: str, env: str, *extra_args: str) -> Any:
    """The embedded server of the SDK in ``root`` (another commit's tree) serving ``env``."""
    command = [sys.executable, "-m", "dm_env_rpc_client.server", "--env", env, "--port", "0"]
    command += ["--exit-with-parent", *extra_args]
    return command_server_process_info(command, f"{root}'s {env}", cwd=root)


def any_server_process_info(server: str, env: str, *extra_args: str) -> Any:
    """``server_process_info`` or ``foreign_server_process_info`` by ``SERVERS`` key."""
    if server == "sdk":
        return server_process_info(env, *extra_args)
    return foreign_server_process_info(env, *extra_args)


@contextlib.contextmanager
def server_processes(server: str, count: int = 2, env: str = "catch") -> Iterator[list[ServerInfo]]:
    """``count`` server processes of one kind (``SERVERS`` key) serving ``env``."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(any_server_process_info(server, env)) for _ in range(count)]


def add_pin_argument(parser: Any) -> None:
    """Adds ``--pin`` / ``--no-pin`` (default: pin, on a machine with at least 2 CPUs)."""
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the servers on the first half of the CPUs and the client on the other half "
        "(the client's cost measured apart from the server's; --no-pin: all share every CPU)",
    )


def apply_pin(pin: bool) -> str:
    """Turns pinning on or off for ``measure_interleaved``; returns a line saying which.

    Unpinned on 2 cores, client and server threads land on the cores by chance and a
    run settles either where responses come alone (one wake-up each, more CPU per step)
    or in bursts (fewer wake-ups, less CPU per step): back-to-back runs of one client
    differ by up to 2x. Pinned, the client's cost is measured apart from the server's,
    as when it runs on another machine, and runs agree within about 10%.
    """
    global _PIN
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        _PIN = None
        why = "" if not pin else " (fewer than 2 CPUs)"
        return f"Not pinned{why}: client and servers share every CPU."
    half = len(cpus) // 2
    _PIN = (set(cpus[:half]), set(cpus[half:]))
    return (
        f"Pinned: servers on CPU {_cpu_list(_PIN[0])}, the client (every thread) on CPU "
        f"{_cpu_list(_PIN[1])}."
    )


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def _pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it)."""
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cpus)


def pin(server_pids: Sequence[int]) -> None:
    """Applies ``apply_pin``'s choice to the servers' processes and this one (if on)."""
    if _PIN is None:
        return
    servers, client = _PIN
    for pid in server_pids:
        _pin_process(pid, servers)
    _pin_process(os.getpid(), client)


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # Fields after the parenthesised command name start at field 3 (state); utime and
    # stime are fields 14 and 15.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds of each live thread of process ``pid`` (this one by default), by thread name
    (threads of one name summed), from /proc/<pid>/task/*/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            stat = (task / "stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return seconds


class Sample(NamedTuple):
    """One timed run of one variant."""

    steps_per_second: float
    cpu_us_per_step: float  # client, all threads (time.process_time)
    server_cpu_us_per_step: float  # NaN when the server's pid is unknown


# (run, close): run(steps) does ``steps`` steps; close() releases what the variant holds.
Variant = tuple[Callable[[int], Any], Callable[[], Any]]
VariantFactory = Callable[[], Variant]


class Rounds:
    """The samples of :func:`measure_interleaved`: one per variant per round."""

    def __init__(self, samples: Mapping[str, Sequence[Sample]]) -> None:
        self.samples = {name: list(runs) for name, runs in samples.items()}

    @property
    def names(self) -> list[str]:
        return list(self.samples)

    @property
    def rounds(self) -> int:
        return min(len(runs) for runs in self.samples.values())

    def median(self, name: str, field: str = "steps_per_second") -> float:
        """The median over rounds of one field of variant ``name``."""
        return statistics.median(getattr(sample, field) for sample in self.samples[name])

    def ratio(self, name: str, base: str, field: str = "steps_per_second") -> float:
        """The median over rounds of ``name``'s field divided by ``base``'s in the same round."""
        return statistics.median(
            getattr(sample, field) / getattr(base_sample, field)
            for sample, base_sample in zip(self.samples[name], self.samples[base], strict=True)
        )


def measure_interleaved(
    variants: Mapping[str, VariantFactory],
    steps: int,
    *,
    rounds: int = DEFAULT_ROUNDS,
    warmup: int | None = None,
    server_pid: int | Sequence[int] | None = None,
    seed: int = 0,
) -> Rounds:
    """Times every variant once per round, interleaved, so they all see the same drift.

    For each of ``rounds`` rounds, in an order shuffled by ``random.Random(seed)``,
    each variant is set up (its factory connects and joins a world), warmed up with
    ``warmup`` steps (default ``min(steps, 200)``), timed for ``steps`` steps and
    closed, so only the variant being timed has connections open (idle streams of
    the others would cost CPU in gRPC's pollers). Each run records wall-clock
    steps/s, client CPU µs/step (all threads) and, if ``server_pid`` is given, the
    server process's CPU µs/step (from /proc, with the resolution of a clock tick;
    several pids are summed).
    """
    rng = random.Random(seed)
    pids = [] if server_pid is None else [server_pid] if isinstance(server_pid, int) else server_pid
    pin(pids)

    def server_seconds() -> float:
        return sum(process_cpu_seconds(pid) for pid in pids)

    warmup = min(steps, 200) if warmup is None else warmup
    samples: dict[str, list[Sample]] = {name: [] for name in variants}
    order = list(variants)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            run, close = variants[name]()
            try:
                run(warmup)
                gc.collect()  # garbage left by the previous variant is not this one's cost
                server = server_seconds()
                wall, cpu = time.perf_counter(), time.process_time()
                run(steps)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                server_us = (server_seconds() - server) / steps * 1e6 if pids else math.nan
            finally:
                close()
            samples[name].append(Sample(steps / wall, cpu / steps * 1e6, server_us))
    return Rounds(samples)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints a Markdown table."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        cells = [f"{cell:,.1f}" if isinstance(cell, float) else str(cell) for cell in row]
        print("| " + " | ".join(cells) + " |")
