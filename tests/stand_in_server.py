#!/usr/bin/env python3
"""A stand-in server binary for ``dmr.launch`` tests: built on the reference ``dm-env-rpc`` package.

Run: ``stand_in_server.py --port P [--misbehave MODE] [--ignore-sigterm]``. It serves
Catch with the reference package's servicer of ``bench/_lib/foreign_server.py`` on
``127.0.0.1:P`` until stopped. ``--misbehave`` makes it one of the bad servers a
launcher must cope with:

- ``exit``: prints a complaint and exits with code 3 at once;
- ``never-listen``: prints a line and waits, listening on nothing;
- ``garbage``: listens on P and answers every connection with bytes that are not HTTP/2;
- ``slow-start``: accepts connections on P for 1.5 s without answering (a player
  still loading), then serves.

``--die-after K --die-once FILE``: once the process has read K step requests, it kills
itself with SIGKILL (with steps in flight), unless FILE exists; it creates FILE first, so
of every process of a launch (relaunches too) sharing FILE, exactly one dies.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import contextlib


def _raw_listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    return sock


def _garbage(port: int) -> None:
    sock = _raw_listener(port)
    while True:
        conn, _ = sock.accept()
        conn.sendall(b"\x00garbage, not a dm_env_rpc server\r\n" * 8)
        conn.close()


def _hold_connections(port: int, seconds: float) -> None:
    sock = _raw_listener(port)
    sock.settimeout(0.05)
    held = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            held.append(sock.accept()[0])
    for conn in held:
        conn.close()
    sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--misbehave", choices=("exit", "never-listen", "garbage", "slow-start"))
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--tag", help="ignored: lets a test find its processes")
    parser.add_argument("--die-after", type=int, help="SIGKILL itself after this many steps")
    parser.add_argument("--die-once", help="a file: only the process that creates it dies")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.misbehave == "exit":
        print("stand-in: refusing to start (misbehave=exit)", flush=True)
        sys.exit(3)
    if args.misbehave == "never-listen":
        print("stand-in: loading forever", flush=True)
        threading.Event().wait()
    if args.misbehave == "garbage":
        _garbage(args.port)
    if args.misbehave == "slow-start":
        _hold_connections(args.port, 1.5)
    # Imported only to serve: the misbehaving modes above answer at once, even on a busy machine.
    import grpc
    from _lib.foreign_server import _make_env, _Servicer
    from dm_env_rpc.v1 import dm_env_rpc_pb2_grpc

    all_steps = itertools.count(1)  # every stream's step requests, for --die-after

    def die_once() -> None:
        try:
            os.close(os.open(args.die_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        print("stand-in: dying (--die-after)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    class _LoggingServicer(_Servicer):
        """Prints a line per world created, so that a test can tell when worlds are up."""

        def Process(self, request_iterator: Any, context: Any) -> Any:
            def logged() -> Any:
                steps = 0
                for request in request_iterator:
                    if request.WhichOneof("payload") == "create_world":
                        print("stand-in: world created", flush=True)
                    if request.WhichOneof("payload") == "step":
                        steps += 1
                        if steps == 20:
                            print("stand-in: world stepping", flush=True)
                        if next(all_steps) == args.die_after and args.die_once:
                            die_once()
                    yield request

            return super().Process(logged(), context)

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=32))
    dm_env_rpc_pb2_grpc.add_EnvironmentServicer_to_server(
        _LoggingServicer(_make_env("catch", 0)), server
    )
    if server.add_insecure_port(f"127.0.0.1:{args.port}") != args.port:
        print(f"stand-in: cannot listen on port {args.port}", flush=True)
        sys.exit(4)
    server.start()
    print(f"stand-in: serving on 127.0.0.1:{args.port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
