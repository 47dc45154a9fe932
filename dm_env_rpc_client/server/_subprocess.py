"""The embedded server in a child process, so that it has a CPU core (and a GIL) of its own.

``server_subprocess()`` starts ``python -m dm_env_rpc_client.server`` on a free
loopback port, waits for its ``Serving <env> on <address>`` line, yields the
address (and the process, for tests that stop or kill it) and kills the
process on exit::

    with server_subprocess("catch") as server:
        conn = dmr.connect(server.address, timeout=10)

The CLI's ``run``, the tests and the benchmarks all start their servers with it.

The child dies with its parent, whatever ends the parent (SIGTERM, SIGKILL, a
crash): it watches its standard input, a pipe whose other end only this
process holds, and stops when the pipe closes (``--exit-with-parent``). That
works on every platform, unlike a parent-death signal. The child ignores
Ctrl-C (the parent handles it and then kills the child), and its gRPC log
lines are off unless ``GRPC_VERBOSITY`` is set.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

_ADDRESS = re.compile(r"^Serving \S+ on (\S+)")
_NO_START = (
    "The embedded {env} server process did not start{detail}. Its error output: {stderr!r}. "
    "Start a server yourself (python -m dm_env_rpc_client.server) and pass --address."
)


class ChildServer(NamedTuple):
    """A running server child process."""

    address: str
    process: subprocess.Popen[str]

    def kill(self) -> None:
        """Kills the process (SIGKILL) and waits for it."""
        _stop(self.process)


def _first_line(stream: object, timeout: float) -> str | None:
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: lines.put(stream.readline()),  # type: ignore[attr-defined]
        name="dm_env_rpc_client-server-line",
        daemon=True,
    )
    reader.start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return None


def _stop(process: subprocess.Popen[str], grace: float = 5.0) -> None:
    # Killed outright: the child serves only us and holds nothing to save. A graceful stop
    # would send GOAWAY to our connections if they are still closing, which gRPC logs.
    if process.poll() is None:
        process.kill()
        process.wait(timeout=grace)
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()


@contextlib.contextmanager
def server_subprocess(
    env: str = "catch",
    *,
    host: str = "127.0.0.1",
    timeout: float = 30.0,
    extra_args: Sequence[str] = (),
    max_workers: int | None = None,
) -> Iterator[ChildServer]:
    """Runs the embedded server in a child process; yields its address and process.

    Args:
      env: the environment to serve (``catch``, or ``large``).
      host: the interface to listen on.
      timeout: seconds to wait for the server to report its address.
      extra_args: more arguments for ``python -m dm_env_rpc_client.server``.
      max_workers: the most streams (worlds) the server serves at once; None
        keeps its default (64).

    Raises:
      OSError: the process did not report an address within ``timeout`` (the
        message includes its error output).
    """
    command = [sys.executable, "-m", "dm_env_rpc_client.server", "--env", env]
    command += ["--host", host, "--port", "0", "--exit-with-parent", *extra_args]
    if max_workers is not None:
        command += ["--max-workers", str(max_workers)]
    environment = {"GRPC_VERBOSITY": "NONE", **os.environ}
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=environment,
        )
        try:
            line = _first_line(process.stdout, timeout)
            match = _ADDRESS.match(line.strip()) if line else None
            if match is None:
                _stop(process)
                stderr.seek(0)
                detail = f" within {timeout} s" if line is None else f" (it printed {line!r})"
                raise OSError(
                    _NO_START.format(env=env, detail=detail, stderr=stderr.read()[-2000:])
                )
            yield ChildServer(match.group(1), process)
        finally:
            _stop(process)
            if process.stdout is not None:
                process.stdout.close()
