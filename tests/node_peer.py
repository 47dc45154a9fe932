"""The Node.js @grpc/grpc-js dm_env_rpc test server (tests/node_server/server.js), started and
stopped from Python.

``node_server(max_concurrent_streams=..., max_worlds=..., agent_timeout=...)`` starts it on a free loopback port
(the server binds port 0 and prints ``{"port": N}``), waits with a deadline until that port
takes connections, yields ``NodeServer(address, process)``, and stops it at the end. The server
exits by itself when its stdin closes or its parent changes, so it never outlives the process
that started it, even one that is SIGKILLed. ``NODE_SKIP_REASON`` says why it cannot run here
(no ``node``, or ``npm ci`` not run in tests/node_server), or is None.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import selectors
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "tests" / "node_server"
SERVER_JS = NODE_DIR / "server.js"


def _skip_reason() -> str | None:
    if shutil.which("node") is None:
        return "needs Node.js: `node` is not on PATH (the @grpc/grpc-js test server runs on it)"
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return "needs the Node test server's packages: run `cd tests/node_server && npm ci`"
    return None


NODE_SKIP_REASON = _skip_reason()


class NodeServer(NamedTuple):
    address: str
    process: subprocess.Popen[bytes]


def _status_include() -> str:
    """The folder holding google/rpc/status.proto (googleapis-common-protos ships it)."""
    from google.rpc import status_pb2

    return str(pathlib.Path(status_pb2.__file__).resolve().parents[2])


def _read_port(process: subprocess.Popen[bytes], log: Any, deadline: float) -> int:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.05):
                line = process.stdout.readline()
                if line:
                    return int(json.loads(line)["port"])
            if process.poll() is not None:
                break
    log.seek(0)
    raise RuntimeError(f"the Node test server did not start: {log.read().decode()[-2000:]}")


def _wait_listening(port: int, deadline: float) -> None:
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the Node test server does not take connections on port {port}")
        time.sleep(0.02)


@contextlib.contextmanager
def node_server(
    max_concurrent_streams: int = 0,
    max_worlds: int = 0,
    start_timeout: float = 30.0,
    agent_timeout: float = 30.0,
) -> Iterator[NodeServer]:
    """Runs the Node test server (0 = no limit; ``agent_timeout``: its multi-agent worlds'
    lockstep barrier's bound, in seconds); yields its address and process."""
    if NODE_SKIP_REASON is not None:
        raise RuntimeError(NODE_SKIP_REASON)
    command = [
        shutil.which("node") or "node",
        str(SERVER_JS),
        "--proto-root",
        str(ROOT / "protos"),
        "--include",
        _status_include(),
        "--max-concurrent-streams",
        str(max_concurrent_streams),
        "--max-worlds",
        str(max_worlds),
        "--agent-timeout",
        str(agent_timeout),
    ]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=NODE_DIR
        )
        try:
            deadline = time.monotonic() + start_timeout
            port = _read_port(process, log, deadline)
            _wait_listening(port, deadline)
            yield NodeServer(f"127.0.0.1:{port}", process)
        finally:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.close()  # the server exits when its stdin closes
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
            process.stdout.close()
