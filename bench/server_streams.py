"""What a server needs per world: threads, memory and file descriptors of one server holding N streams.

Run: ``python bench/server_streams.py [--worlds 1024 4096] [--servers sdk foreign]``.
For each server kind (the SDK's embedded server, and a foreign one written on
the reference package, ``_lib/foreign_server.py``, a sync gRPC server with a thread
pool) and each N, one server process serves Catch with room for N streams
(``--max-workers N + 16``); this process connects a ``BatchedEnvironment`` of N
worlds to it alone (one connection, N streams), resets every world and steps
each twice, then reads the server's threads, RSS and open file descriptors
from /proc, and again after ``close``. Reported per world: what the server
holds with the batch open, less what it held before ``connect``.

Then the defaults: a server started without ``--max-workers`` (the SDK's 64;
the peer's thread pool of 64) and a batch of 1,024 worlds on it, with the
error ``connect`` raises and how long it took.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import SERVERS, any_server_process_info, print_table

# isort: split
import numpy as np

import dm_env_rpc_client as dmr

PAGE = os.sysconf("SC_PAGE_SIZE")
DEFAULT_LIMIT_WORLDS = 1024
DEFAULT_TIMEOUT = 10.0  # seconds connect waits for a world the default server does not answer


def usage(pid: int) -> tuple[int, int, int]:
    """Threads, RSS bytes and open file descriptors of process ``pid``."""
    threads = len(list(pathlib.Path(f"/proc/{pid}/task").iterdir()))
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * PAGE
    fds = len(list(pathlib.Path(f"/proc/{pid}/fd").iterdir()))
    return threads, rss, fds


def hold(kind: str, worlds: int) -> list[Any]:
    """One server of ``kind`` holding ``worlds`` streams: a table row."""
    with any_server_process_info(kind, "catch", "--max-workers", str(worlds + 16)) as server:
        idle = usage(server.pid)
        started = time.perf_counter()
        batch = dmr.BatchedEnvironment.connect([server.address], worlds, timeout=120, seed=0)
        try:
            connect_s = time.perf_counter() - started
            batch.reset()
            for _ in range(2):
                batch.step({"paddle": np.zeros(worlds, np.int8)})
            held = usage(server.pid)
        finally:
            started = time.perf_counter()
            batch.close()
            close_s = time.perf_counter() - started
        deadline = time.monotonic() + 30  # the server ends its streams after the client's close
        while (after := usage(server.pid))[2] > idle[2] + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    threads, rss, fds = (h - i for h, i in zip(held, idle, strict=True))
    return [
        SERVERS[kind],
        f"{worlds:,}",
        f"{idle[0]} / {held[0]} / {after[0]}",
        f"{threads / worlds:.2f}",
        f"{idle[1] / 2**20:.0f} / {held[1] / 2**20:.0f} / {after[1] / 2**20:.0f} MB",
        f"{rss / worlds / 1024:.1f} KB",
        f"{idle[2]} / {held[2]} / {after[2]}",
        f"{fds / worlds:.3f}",
        f"{connect_s:.2f} s / {close_s:.2f} s",
    ]


def default_limit(kind: str) -> list[Any]:
    """A batch of ``DEFAULT_LIMIT_WORLDS`` on a server with its default stream room."""
    with any_server_process_info(kind, "catch") as server:
        started = time.perf_counter()
        try:
            with dmr.BatchedEnvironment.connect(
                [server.address], DEFAULT_LIMIT_WORLDS, timeout=DEFAULT_TIMEOUT
            ):
                outcome = "connected"
        except dmr.DmEnvRpcClientError as error:
            outcome = f"{type(error).__name__}: {error}"
        took = time.perf_counter() - started
        threads = usage(server.pid)[0]
    return [SERVERS[kind], f"{took:.1f} s", str(threads), outcome.replace("|", "\\|")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--no-defaults", action="store_true", help="skip the default-limit runs")
    args = parser.parse_args()
    rows = [hold(kind, worlds) for kind in args.servers for worlds in args.worlds]
    print_table(
        "One server process holding N Catch streams (one client connection)",
        [
            "server",
            "worlds",
            "threads: idle / open / closed",
            "threads per world",
            "RSS: idle / open / closed",
            "RSS per world",
            "fds: idle / open / closed",
            "fds per world",
            "connect / close",
        ],
        rows,
    )
    if not args.no_defaults:
        limits = [default_limit(kind) for kind in args.servers]
        print_table(
            f"{DEFAULT_LIMIT_WORLDS:,} worlds on one server started with its defaults "
            f"(connect timeout {DEFAULT_TIMEOUT:.0f} s)",
            ["server", "connect failed after", "server threads", "what connect raised"],
            limits,
        )


if __name__ == "__main__":
    main()
