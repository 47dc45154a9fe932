"""``run --watch``: the flags, and the watcher a run is stepped under.

``add_flags(parser)`` adds ``--watch``, ``--watch-host`` and ``--watch-port``.
``watching(args, stop)`` is a context manager that yields the run's observers:
none without ``--watch``; else a started ``dm_env_rpc_client.watch.Watcher``
(imported only then), whose URL it prints to stderr (with a warning when it is
bound beyond loopback, where the URL's token is what guards it), closed after.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .._base.cli_args import port

_SHOWN = "watch the run at {url}"
_EXPOSED = (
    "note: the watch page is bound to {host}, not loopback: anyone who can reach this "
    "machine and has the token in that URL can see the worlds and pause the run; keep it private."
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds ``--watch``, ``--watch-host`` and ``--watch-port`` to ``run``."""
    parser.add_argument(
        "--watch",
        action="store_true",
        help="serve a live page of the run (frames, returns, steps/s, events, pause) and "
        "print its URL (see docs/watch.md)",
    )
    parser.add_argument(
        "--watch-host",
        default="127.0.0.1",
        metavar="HOST",
        help="with --watch: the interface to serve on (default: 127.0.0.1; any other needs "
        "the token in the printed URL)",
    )
    parser.add_argument(
        "--watch-port",
        type=port,
        metavar="PORT",
        help="with --watch: the port (default: the first free one from 8765)",
    )


@contextlib.contextmanager
def watching(args: argparse.Namespace, stop: threading.Event) -> Iterator[list[Any]]:
    """The run's observers: a started watcher with ``--watch``, else none.

    Raises:
      WatchPortError: ``--watch-port`` is taken.
    """
    if not args.watch:
        yield []
        return
    from ..watch import Watcher

    with Watcher(host=args.watch_host, port=args.watch_port, stop=stop) as watcher:
        print(_SHOWN.format(url=watcher.url), file=sys.stderr, flush=True)
        if not watcher.loopback:
            print(_EXPOSED.format(host=args.watch_host), file=sys.stderr, flush=True)
        yield [watcher]
