"""The watcher without a browser: frames, cost when unwatched, pause, its server's security,
ports, closed pages, events, a SIGKILLed parent and ``run --watch``.

The page itself is checked in a real browser in test_watch_browser.py.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import weakref
from typing import Any

import numpy as np
import pytest
from conftest import run_child, wait_for

import dm_env_rpc_client as dmr
from dm_env_rpc_client import BatchedEnvironment, RestartPolicy
from dm_env_rpc_client._watch import frames
from dm_env_rpc_client._watch.tally import Tally
from dm_env_rpc_client.watch import Watcher, WatchPortError

# Restarts that give up fast, as in test_faults.py.
FAST = RestartPolicy(attempts=6, total=20.0, backoff=0.05, max_backoff=0.5, connect_timeout=1.0)


def stepping(batch: Any, observers: list[Any], stop: threading.Event) -> threading.Thread:
    """``dmr.collect`` on a thread of its own until ``stop`` is set, told to ``observers``."""
    runner = threading.Thread(
        target=dmr.collect, args=(batch, 10**9), kwargs={"stop": stop, "observers": observers}
    )
    runner.start()
    return runner


def test_pictures_are_chosen_as_show_chooses_them_and_the_rest_are_numbers() -> None:
    observation = {
        "rgb": np.arange(2 * 4 * 3 * 3, dtype=np.uint8).reshape(2, 4, 3, 3),
        "rgba": np.zeros((2, 4, 3, 4), np.uint8),
        "grey": np.zeros((2, 4, 3), np.uint8),
        "board": np.array([np.eye(3, 2), np.ones((3, 2))], np.float32),
        "depth": np.full((2, 3, 2), 7.5, np.float32),  # float beyond [0, 1]: numbers
        "arm": {"joints": np.arange(2 * 20, dtype=np.float64).reshape(2, 20)},
    }
    assert frames.image_keys(observation, 1) == ["board", "grey", "rgb", "rgba"]
    frame = frames.frame(observation, 1, ["rgb", "board"])
    assert sorted(frame["images"]) == ["board", "rgb"]
    rgb = frame["images"]["rgb"]
    assert (rgb["h"], rgb["w"], rgb["c"]) == (4, 3, 3)
    pixels = np.frombuffer(base64.b64decode(rgb["data"]), np.uint8).reshape(4, 3, 3)
    np.testing.assert_array_equal(pixels, observation["rgb"][1])
    board = np.frombuffer(base64.b64decode(frame["images"]["board"]["data"]), np.uint8)
    assert frame["images"]["board"]["c"] == 1 and (board == 255).all()
    numbers = dict(frame["numbers"])
    assert numbers["depth"].startswith("[7.5, 7.5") and "shape [3, 2]" in numbers["depth"]
    assert "(20 values)" in numbers["arm.joints"] and numbers["arm.joints"].startswith("[20, 21")


def test_the_tally_counts_episodes_across_batches_and_ticks() -> None:
    def batch(ids: list[int], kinds: list[int], rewards: list[float]) -> tuple[Any, ...]:
        return (np.array(ids), np.array(kinds, np.uint8), np.array(rewards), None)

    tally = Tally()
    # World 0: FIRST, MID, LAST over three batches and two ticks: return 1 + 2 = 3.
    # World 1: starts mid-episode (no return for it), then a FIRST cut short by another
    # FIRST (a restart: no return), then FIRST, LAST: return 5. A stray LAST counts nothing.
    tally.take([batch([0, 1], [0, 1], [9, 4]), batch([1, 0], [2, 1], [1, 1])], set())
    tally.take([batch([1], [0], [0]), batch([0, 1], [2, 1], [2, 7])], set())
    tally.take([batch([1], [0], [0]), batch([1], [2], [5]), batch([1], [2], [3])], set())
    assert tally.counts == [3, 7] and tally.total == 10
    assert tally.returns.items == [(0, 6, 3.0), (1, 9, 5.0)]
    assert tally.stepped == {1}


def test_captured_steps_carry_their_worlds_step_index() -> None:
    tally = Tally()
    first = (np.array([0, 1]), np.zeros(2, np.uint8), np.zeros(2), None)
    captured = object()
    second = (np.array([1, 0, 1]), np.ones(3, np.uint8), np.ones(3), captured)
    tally.take([first, second], {1})
    assert tally.latest == {1: (captured, 2, 3)} and tally.stepped == {0, 1}


def _stream(url: str) -> Any:
    return urllib.request.urlopen(url + "stream", timeout=10)


def _next_message(response: Any) -> dict[str, Any]:
    while True:
        line = response.readline()
        if not line:
            raise EOFError("the stream ended")
        if line.startswith(b"data: "):
            return json.loads(line[6:])


@pytest.fixture
def batch(catch_server: Any) -> Any:
    envs = BatchedEnvironment.connect([catch_server.address], 4, seed=0)
    envs.reset()
    yield envs
    envs.close(timeout=5)


def test_with_no_page_open_no_observation_is_kept(batch: Any) -> None:
    with Watcher() as watcher:
        kept = []

        class Spy:
            def on_steps(self, timestep: Any) -> None:
                kept.append(weakref.ref(timestep.observation["board"]))

            def on_event(self, event: Any) -> None:
                pass

        dmr.collect(batch, 400, observers=[Spy(), watcher])
        assert wait_for(lambda: watcher.steps == 400)
        gc.collect()
        assert all(ref() is None for ref in kept[:-1])  # not one board held (the last is local)
        assert watcher._frames == {} and watcher._tally.latest == {}
        assert watcher.frames_encoded == 0 and watcher.batches_captured == 0


def test_a_page_gets_frames_steps_and_returns_and_a_closed_one_is_let_go(batch: Any) -> None:
    stop = threading.Event()
    with Watcher(stop=stop) as watcher:
        runner = stepping(batch, [watcher], stop)
        try:
            threads = threading.active_count()
            response = _stream(watcher.url)
            first = _next_message(response)
            assert first["sub"] == 1 and watcher.subscribers == 1
            worlds: dict[int, int] = {}
            returns = 0
            while len(worlds) < 4 or returns == 0 or min(worlds.values()) < 50:
                message = _next_message(response)
                returns += len(message["returns"])
                for frame in message["frames"]:
                    assert frame["step"] > worlds.get(frame["world"], 0)  # newer each time
                    worlds[frame["world"]] = frame["step"]
                    assert frame["key"] == "board" and frame["image"]["c"] == 1
            assert message["keys"] == ["board"] and message["worlds"] == 4
            response.close()
            assert wait_for(lambda: watcher.subscribers == 0, timeout=10)
            assert wait_for(lambda: threading.active_count() == threads, timeout=10)
            assert watcher._frames == {} and runner.is_alive()
            # No page: no batch is kept for frames any more, and none is encoded.
            captured, encoded, steps = (
                watcher.batches_captured,
                watcher.frames_encoded,
                watcher.steps,
            )
            assert wait_for(lambda: watcher.steps > steps + 400)
            assert (watcher.batches_captured, watcher.frames_encoded) == (captured, encoded)
            assert watcher._request is None and watcher._tally.latest == {}
        finally:
            stop.set()
            runner.join(timeout=30)


def test_frames_are_kept_and_encoded_only_for_a_page_that_took_its_last_push(batch: Any) -> None:
    stop = threading.Event()
    with Watcher(stop=stop) as watcher:
        runner = stepping(batch, [watcher], stop)
        try:
            slow = watcher.subscribe()  # a page whose stream has not taken a push yet
            steps = watcher.steps
            assert wait_for(lambda: watcher.steps > steps + 400)
            assert watcher.batches_captured == 0 and watcher.frames_encoded == 0
            watcher.message(slow)  # it takes one push: due for the next one
            assert wait_for(lambda: watcher.frames_encoded > 0)
            assert watcher.batches_captured > 0
            # One push's worth of frames for it (each of its 4 worlds at most once), then
            # none until it takes the next.
            steps = watcher.steps
            assert wait_for(lambda: watcher.steps > steps + 400)
            encoded, steps = watcher.frames_encoded, watcher.steps
            assert wait_for(lambda: watcher.steps > steps + 400)
            assert watcher.frames_encoded == encoded <= 4
            frames = watcher.message(slow)["frames"]
            assert len({f["world"] for f in frames}) == len(frames) == encoded
            assert wait_for(lambda: watcher.frames_encoded > encoded)
        finally:
            stop.set()
            runner.join(timeout=30)


def test_pause_holds_the_run_until_resume_close_or_stop(batch: Any) -> None:
    stop = threading.Event()
    watcher = Watcher(stop=stop).start()
    counted = []
    runner = threading.Thread(
        target=lambda: counted.append(dmr.collect(batch, 10**9, stop=stop, observers=[watcher]))
    )
    try:
        watcher.pause()
        runner.start()
        assert wait_for(lambda: watcher.steps > 0)  # the first batch is taken, then it waits
        held = watcher.steps
        assert wait_for(lambda: len(watcher._queue) == 0)
        assert not wait_for(lambda: watcher.steps > held, timeout=0.5)
        watcher.resume()
        assert wait_for(lambda: watcher.steps > held + 100)
        watcher.pause()
        stop.set()  # a paused run still ends when it is stopped
        runner.join(timeout=10)
        assert not runner.is_alive() and counted
    finally:
        stop.set()
        watcher.close()
        runner.join(timeout=10)


def test_controls_need_the_token_and_loopback_refuses_other_host_names() -> None:
    with Watcher() as watcher:
        response = _stream(watcher.url)
        subscriber = _next_message(response)["sub"]
        token = watcher._server.token

        def post(body: dict[str, Any], headers: dict[str, str]) -> int:
            request = urllib.request.Request(
                watcher.url + "control", json.dumps(body).encode(), headers, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    return int(answer.status)
            except urllib.error.HTTPError as error:
                return int(error.code)

        assert post({"sub": subscriber, "action": "pause"}, {}) == 403
        assert not watcher.paused
        assert post({"sub": subscriber, "action": "pause"}, {"X-Watch-Token": token}) == 200
        assert watcher.paused
        assert post({"sub": 999, "action": "resume"}, {"X-Watch-Token": token}) == 400
        assert post({"sub": subscriber, "shown": "all"}, {"X-Watch-Token": token}) == 400
        rebound = urllib.request.Request(watcher.url, headers={"Host": f"evil.example:{80}"})
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(rebound, timeout=5)
        page = urllib.request.urlopen(watcher.url, timeout=5).read().decode()
        assert token in page and "__WATCH_TOKEN__" not in page
        response.close()


def _lan_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_beyond_loopback_every_request_needs_the_token() -> None:
    address = _lan_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    with Watcher(host=address) as watcher:
        assert not watcher.loopback and "?token=" in watcher.url
        bare = watcher.url.split("?")[0]
        for url in (bare, bare + "stream"):
            with pytest.raises(urllib.error.HTTPError, match="403"):
                urllib.request.urlopen(url, timeout=5)
        assert "Watching a run" in urllib.request.urlopen(watcher.url, timeout=5).read().decode()


def test_a_taken_port_is_a_named_error_or_the_next_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(WatchPortError, match=f"Port {port} on 127.0.0.1 is taken"):
            Watcher(port=port).start()
        with Watcher() as first, Watcher() as second:  # no port given: the next free one
            assert first.url != second.url
    with pytest.raises(WatchPortError, match="Cannot watch on '192.0.2.1'"):
        Watcher(host="192.0.2.1").start()
    with pytest.raises(ValueError, match="fps must be"):
        Watcher(fps=0)


class Events:
    """A run observer that keeps the run's events."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_steps(self, timestep: Any) -> None:
        pass

    def on_event(self, event: Any) -> None:
        self.events.append(event)


def test_a_restart_reaches_the_page_as_an_event(server_process: Any) -> None:
    servers = [server_process() for _ in range(2)]
    envs = BatchedEnvironment.connect(
        [s.address for s in servers], 2, seed=0, on_world_failure="restart", restart=FAST
    )
    stop, seen = threading.Event(), Events()
    with Watcher() as watcher:
        subscriber = watcher.subscribe()
        runner = stepping(envs, [seen, watcher], stop)
        try:
            assert wait_for(lambda: watcher.steps > 20)
            servers[1].kill()  # world 1's server
            assert wait_for(lambda: any(e.kind == "restart" for e in seen.events), timeout=30)
        finally:
            stop.set()
            runner.join(timeout=30)
            envs.close(timeout=5)
        (event,) = [e for e in seen.events if e.kind == "restart"]
        assert event.world == 1
        assert servers[1].address in event.message and servers[0].address in event.message
        sent = watcher.message(subscriber)["events"]
        assert [(e["kind"], e["world"], e["message"]) for e in sent] == [
            (event.kind, event.world, event.message)
        ]
        assert watcher.message(subscriber)["events"] == []  # each sent once


_CHILD = """
import sys, threading
import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.catch import Catch
from dm_env_rpc_client.watch import Watcher
server = dmr.serve(lambda settings: Catch(**settings))
batch = dmr.BatchedEnvironment.connect([server.address], 2, seed=0)
batch.reset()
watcher = Watcher().start()
print(watcher.url, flush=True)
dmr.collect(batch, 10**9, observers=[watcher])
"""


def test_a_sigkilled_parent_leaves_nothing_behind(tmp_path: Any) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        url = child.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        response = _stream(url)
        _next_message(response)  # a page is open
        port = int(url.rsplit(":", 1)[1].strip("/"))
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
        with pytest.raises((EOFError, OSError)):
            while True:
                _next_message(response)

        def refused() -> bool:
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) != 0

        assert wait_for(refused, timeout=10)
    finally:
        child.kill()
        child.wait()


def test_run_watch_prints_the_url_and_runs(tmp_path: Any) -> None:
    command = [sys.executable, "-m", "dm_env_rpc_client", "run", "--in-process", "--quiet"]
    done = run_child([*command, "--steps", "300", "--watch", "--json"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 300
    assert "watch the run at http://127.0.0.1:" in done.stderr
    exposed = run_child([*command, "--steps", "20", "--watch", "--watch-host", "0.0.0.0"])
    assert exposed.returncode == 0, exposed.stderr
    assert "?token=" in exposed.stderr and "bound to 0.0.0.0, not loopback" in exposed.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = run_child([*command, "--steps", "20", "--watch", "--watch-port", port])
    assert busy.returncode == 1 and f"WatchPortError: Port {port} on 127.0.0.1" in busy.stderr
    ray = run_child([*command, "--steps", "20", "--watch", "--ray"])
    assert ray.returncode == 2 and "--watch watches a run stepped in this process" in ray.stderr
