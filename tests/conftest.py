"""Shared fixtures: a real embedded server on a loopback port, in-process or in a subprocess."""

from __future__ import annotations

import dataclasses
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch

_ADDRESS = re.compile(r"^Serving \w+ on (\S+)$")


@pytest.fixture
def catch_server() -> Iterator[Server]:
    """An in-process embedded Catch server; ``make_env(settings) = Catch(**settings)``."""
    with serve(lambda settings: Catch(**settings)) as server:
        yield server


@dataclasses.dataclass
class ServerProcess:
    """A ``python -m dm_env_rpc_client.server`` subprocess."""

    process: subprocess.Popen[str]
    address: str

    def kill(self) -> None:
        """Kills the process (SIGKILL) and waits for it."""
        self.process.kill()
        self.process.wait(timeout=10)


def start_server_process(*args: str, timeout: float = 30.0) -> ServerProcess:
    """Starts the embedded server in a subprocess and reads its address line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dm_env_rpc_client.server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            break
        except queue.Empty:
            process.kill()
            raise TimeoutError("the server subprocess printed no address") from None
    match = _ADDRESS.match(line.strip())
    if match is None:
        process.kill()
        raise RuntimeError(f"unexpected server output {line!r}: {process.stderr.read()}")
    return ServerProcess(process, match.group(1))


@pytest.fixture
def server_process() -> Iterator[Callable[..., ServerProcess]]:
    """A factory of server subprocesses; every one is killed at teardown."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = start_server_process(*args)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            server.kill()
        for stream in (server.process.stdout, server.process.stderr):
            if stream is not None:
                stream.close()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Polls ``condition`` until it holds or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
