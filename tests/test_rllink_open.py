"""Stopping the RLlink client while it connects to worlds that never answer.

The worlds' server is a raw gRPC server (``faulty.process_server``) that accepts every
stream, reads its CreateWorldRequest and never answers it, until the client ends the
stream. The client's ``--timeout`` is long (600 s): only its stop event can end the
wait. Stopped, it ends promptly with ``stop_reason == "stopped"`` (the command line:
exit 143 and its summary), and the attempt leaves nothing behind: every stream it
opened ends, and no thread of it is left.
"""

from __future__ import annotations

import collections
import contextlib
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from faulty import float_specs, lifecycle, process_server

pytest.importorskip(
    "ray.rllib", exc_type=ImportError, reason="needs RLlib: pip install -e '.[rllib]'"
)
rayi = pytest.importorskip("dm_env_rpc_client.integrations.ray")
from conftest import wait_for  # noqa: E402
from rllink_peer import FakeLearner  # noqa: E402
from test_rllink import _sigterm, ppo_config  # noqa: E402

WORLDS = 3


class Stalling:
    """Counts the streams it accepted, the CreateWorldRequests it holds, the streams ended.

    ``release`` set: the held CreateWorldRequests are answered after all, and the rest of
    each stream's lifecycle too (``faulty.lifecycle``); ``kinds`` lists every request's kind.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened = self.creates = self.ended = 0
        self.kinds: list[str] = []
        self.release = threading.Event()
        self.closing = threading.Event()  # set at teardown: let every handler thread go

    def process(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        with self.lock:
            self.opened += 1
        try:
            for request in requests:
                kind = request.WhichOneof("payload")
                with self.lock:
                    self.kinds.append(kind)
                if kind == "create_world":
                    with self.lock:
                        self.creates += 1
                    while not (cancelled.is_set() or self.closing.is_set()):
                        if self.release.wait(0.05):
                            break
                    if not self.release.is_set():
                        return
                yield lifecycle(request, float_specs())
        finally:
            with self.lock:
                self.ended += 1

    def all_ended(self) -> bool:
        with self.lock:
            return self.opened == self.ended == WORLDS


@pytest.fixture
def stalling() -> Iterator[tuple[str, Stalling]]:
    server = Stalling()
    with process_server(server.process) as address:
        try:
            yield address, server
        finally:
            server.closing.set()


@pytest.fixture
def learner() -> Iterator[FakeLearner]:
    peer = FakeLearner(ppo_config(), weights={})
    try:
        yield peer
    finally:
        peer.close()


def _holding_every_create(server: Stalling) -> bool:
    with server.lock:
        return server.creates == WORLDS


def test_sigterm_while_connecting_to_worlds_that_never_answer(
    stalling: tuple[str, Stalling], learner: FakeLearner, tmp_path: pathlib.Path
) -> None:
    address, server = stalling
    flags = [
        *("--address", address, "--num-envs", str(WORLDS), "--timeout", "600"),
        *("--rllib-server", learner.address, "--rllib-policy", "random"),
    ]
    summary = _sigterm(tmp_path, flags, lambda _: _holding_every_create(server))
    assert summary["steps"] == 0 and summary["rounds"] == 0
    assert wait_for(server.all_ended)  # the process is gone: every stream it opened ended


def _stopped_while_held(server: Stalling, **kwargs: Any) -> Any:
    """``run_rllink(**kwargs)`` on a thread, stopped once the server holds every create;
    its stats (the thread must end: it no longer waits for the worlds)."""
    stop = threading.Event()
    result: list[Any] = []
    client = threading.Thread(target=lambda: result.append(rayi.run_rllink(stop=stop, **kwargs)))
    client.start()
    try:
        assert wait_for(lambda: _holding_every_create(server), 60)
        stop.set()
        client.join(timeout=30)  # a bound for a broken client, not a speed target
        assert not client.is_alive()
    finally:
        stop.set()
        with contextlib.suppress(RuntimeError):
            client.join(timeout=60)
    (stats,) = result
    assert stats.stop_reason == "stopped" and stats.steps == 0 and stats.worlds == 0
    return stats


def test_a_stopped_connect_is_let_go_and_leaves_nothing_behind(
    stalling: tuple[str, Stalling], learner: FakeLearner
) -> None:
    address, server = stalling
    before = set(threading.enumerate())
    _stopped_while_held(
        server,
        addresses=[address],
        rllib=learner.address,
        num_envs=WORLDS,
        policy="random",
        timeout=3.0,  # the attempt's own bound: it ends by itself this long after
    )
    # The attempt let go ends within its timeout and closes what it opened.
    assert wait_for(server.all_ended, 30)
    assert wait_for(lambda: not _new_threads(before), 30), _new_threads(before)


def test_a_connect_that_succeeds_after_the_stop_is_closed_at_once(
    stalling: tuple[str, Stalling], learner: FakeLearner
) -> None:
    """The worlds answer only after the client stopped waiting: the attempt let go opens them,
    then leaves and destroys every world and ends its streams."""
    address, server = stalling
    _stopped_while_held(
        server, addresses=[address], rllib=learner.address, num_envs=WORLDS, policy="random"
    )
    server.release.set()  # the connect goes on, and succeeds: nobody wants its worlds
    assert wait_for(server.all_ended, 30), server.kinds
    with server.lock:
        kinds = collections.Counter(server.kinds)
    assert kinds["join_world"] == kinds["leave_world"] == kinds["destroy_world"] == WORLDS
    assert kinds["step"] == 0


def _new_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since ``before``, but the server's handler pool (kept idle for reuse)."""
    new = set(threading.enumerate()) - before
    return [t.name for t in new if not t.name.startswith("ThreadPoolExecutor")]
