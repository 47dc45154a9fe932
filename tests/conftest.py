"""Shared fixtures: a real embedded server on a loopback port, in-process or in a subprocess."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest

from dm_env_rpc_client import errors
from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server._subprocess import ChildServer, server_subprocess
from dm_env_rpc_client.server.catch import Catch

# A Ray started by the tests listens on loopback only and reports no usage; Ray reads the
# first when it is imported, so it is set here, before any test module imports it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

_NO_TORCH = (
    "needs torch (the training tier): pip install torch==2.13.0 && pip install -e '.[training]', "
    "then pytest -m training; .ci/run does this"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``training`` are skipped, with the reason, where torch is not installed."""
    if importlib.util.find_spec("torch") is not None:
        return
    skip = pytest.mark.skip(reason=_NO_TORCH)
    for item in items:
        if "training" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _sb3_logs_in_tmp_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training-tier test's SB3 learner logs under its tmp_path: with no folder given, SB3
    makes one per learner in the system's temp folder (``SB3-<date>``) unless SB3_LOGDIR names
    one, and leaves it there."""
    if "training" in request.keywords:
        monkeypatch.setenv("SB3_LOGDIR", str(request.getfixturevalue("tmp_path")))


@pytest.fixture
def catch_server() -> Iterator[Server]:
    """An in-process embedded Catch server; ``make_env(settings) = Catch(**settings)``."""
    with serve(lambda settings: Catch(**settings)) as server:
        yield server


@pytest.fixture
def server_process() -> Iterator[Callable[..., ChildServer]]:
    """A factory of server subprocesses (``server_subprocess``); every one is killed at teardown."""
    with contextlib.ExitStack() as stack:

        def start(env: str = "catch", *extra_args: str) -> ChildServer:
            return stack.enter_context(server_subprocess(env, extra_args=extra_args))

        yield start


def run_child(
    command: Sequence[str], timeout: float = 60, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` with text output captured; a child still running after ``timeout``
    is killed and fails the test with what it printed. Keep ``timeout`` inside the test's own
    pytest timeout (120 s unless marked), or pytest stops the test first and the output is lost.
    """
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{list(command)} ran over {timeout} s; it printed {exc.stdout!r} {exc.stderr!r}"
        )


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Polls ``condition`` until it holds or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (Linux ``/proc``); a zombie has (only its parent's
    ``wait()`` is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return bool(states) and all(state in "tT" for state in states)


def sigstop(process: Any) -> None:
    """SIGSTOPs a child process and waits until every thread of it has stopped.

    The signal takes effect asynchronously: on a loaded machine a server thread may still
    answer a request sent just after ``os.kill`` returns.
    """
    pid = process.pid
    os.kill(pid, signal.SIGSTOP)
    if os.path.isdir(f"/proc/{pid}"):  # Linux: confirm it
        assert wait_for(lambda: _all_threads_stopped(pid), timeout=10), "did not stop"


def assert_killing_fails_pending(
    server: ChildServer, conn: Any, futures: Sequence[concurrent.futures.Future[Any]]
) -> None:
    """Kills ``server``; every pending future must fail promptly, and so must later sends."""
    started = time.monotonic()
    server.kill()
    concurrent.futures.wait(futures, timeout=5)
    assert time.monotonic() - started < 5
    for future in futures:
        error = future.exception(timeout=0)
        assert isinstance(error, errors.ConnectionClosedError)
        assert error.code == grpc.StatusCode.UNAVAILABLE
    assert wait_for(lambda: conn.closed, timeout=5)
    with pytest.raises(errors.ConnectionClosedError):
        conn.send(dm_env_rpc_pb2.StepRequest(), timeout=5)
