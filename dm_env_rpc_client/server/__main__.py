"""``python -m dm_env_rpc_client.server``: serve the Catch game (or a test env) until stopped.

Prints one line, ``Serving <env> on <host:port>``, then serves until Ctrl-C or
SIGTERM, and stops cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import dm_env

from dm_env_rpc_client.server import serve
from dm_env_rpc_client.server.catch import Catch
from dm_env_rpc_client.server.envs import LargeObservation

ENVS = {"catch": Catch, "large": LargeObservation}


def make_factory(name: str, defaults: dict[str, Any]) -> Any:
    """Returns make_env for a named environment, with command-line defaults."""
    env_class = ENVS[name]

    def make_env(settings: dict[str, Any]) -> dm_env.Environment:
        return env_class(**{**defaults, **settings})

    return make_env


def run(env: str, host: str, port: int, size: int | None = None) -> int:
    """Serves until SIGINT or SIGTERM; returns the exit code."""
    defaults = {} if size is None else {"size": size}
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with serve(make_factory(env, defaults), f"{host}:{port}") as server:
        print(f"Serving {env} on {server.address}", flush=True)
        while not stop.wait(0.5):
            pass
    print("Stopped.", flush=True)
    return 0


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The arguments of the serve command (shared with the main CLI)."""
    parser = parser or argparse.ArgumentParser(
        prog="python -m dm_env_rpc_client.server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--env", choices=sorted(ENVS), default="catch")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--size", type=int, default=None, help="observation size (--env large)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args.env, args.host, args.port, args.size)


if __name__ == "__main__":
    sys.exit(main())
