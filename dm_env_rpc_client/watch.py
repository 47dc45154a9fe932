"""Watch a run live in a browser: frames of the worlds, returns, steps/s, events, pause.

A ``Watcher`` is a run observer (``on_steps``, ``on_event``) that serves a page
on 127.0.0.1 and prints nothing itself; ``url`` is the page's address::

    import dm_env_rpc_client as dmr
    from dm_env_rpc_client.watch import Watcher

    with Watcher() as watcher:                       # serves http://127.0.0.1:8765/
        print("watch at", watcher.url)
        stats = dmr.collect(batch, steps=10_000, observers=[watcher])

The page shows a grid of the worlds (each world's picture observation, chosen
as ``dmr.show`` chooses them, with a picker when there are several; the numbers
of the others; a page of ``page_size`` worlds at a time, or the worlds picked),
each episode's return over the run per world and their running mean, steps/s,
the run's events as they happen (restarts, relaunches, lost worlds, errors), and
pause and resume.

Cost. ``on_steps`` queues the batch's step types, rewards and world ids (three
references) and returns; a thread of the watcher counts them a few times a
second. No observation is kept,
copied or encoded while no page is open (``batches_captured`` and
``frames_encoded`` stay 0). With a page open, once per push (``fps`` times a
second) and only for the pages that took the last push, the watcher asks the
stepping thread to keep the next batches by reference until each shown world
that is stepping has appeared in one (``on_steps`` then also strikes their
worlds off a set); the thread encodes that step of each world once (its raw
pixels, base64) and pushes it over Server-Sent Events to every page showing it.
A page that falls behind is not encoded for until it has taken its last push.

Pausing: ``pause()`` (or the page's button) makes the next ``on_steps`` wait
until ``resume()``, ``close()``, or the run's ``stop`` event is set: the
stepping loop calls it before choosing actions, so the run stops between steps.

Security. Bound to loopback by default. Bound to another interface, the page
and its stream need the token that ``url`` carries. The page shows what the
worlds return and the run's events: never settings, addresses' credentials or
the environment of the process.

Threads: one daemon thread serves, one per open page streams, one counts and
encodes; all end with ``close()`` (and die with the process, which they never
keep alive). A closed tab is dropped at the stream's next write (at most
1 s): its thread ends and nothing stays queued.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

from ._watch import frames as _frames
from ._watch.server import WatchPortError, WatchServer, is_loopback
from ._watch.tally import Log, Tally
from .stepping import RunEvent

__all__ = ["WatchPortError", "Watcher"]

_IDLE_TICK = 0.25  # seconds between counts while no page is open
_BAD_FPS = "fps must be a number from 1 to 60, not {value!r}."
_BAD_PAGE = "page_size must be a whole number from 1 to 256, not {value!r}."


class _Subscriber:
    """One open page: what it shows and what it was sent."""

    def __init__(self, ident: int, shown: list[int]) -> None:
        self.id = ident
        self.shown = shown
        self.key: str | None = None
        self.sent: dict[int, int] = {}  # world -> version of its frame sent
        self.returns, self.events = 0, 0  # cursors into the logs
        self.tick = -1  # the watcher's tick of the last push built for it
        self.hello = True


class Watcher:
    """A run observer that serves a live page of the run; see the module docs.

    Args:
      host: the interface to serve on (default loopback); another one needs the token in ``url``.
      port: the port; None takes the first free one from 8765 (``url`` says which).
      fps: pushes a second to each open page (frames of its shown worlds).
      page_size: worlds a page shows at a time (it can pick others).
      stop: the run's stop event: a paused ``on_steps`` returns once it is set.

    Attributes:
      page_size: worlds a page shows at a time.
      frames_encoded: world frames encoded so far (none while no page is open).
      batches_captured: batches of steps kept by reference for frames (none while no page
        is open).
      closed: ``close`` was called.

    Raises:
      WatchPortError: ``port`` is taken (or ``host`` is not this machine's); from ``start``.
      ValueError: ``fps`` or ``page_size`` out of range.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        fps: float = 15.0,
        page_size: int = 16,
        stop: threading.Event | None = None,
    ) -> None:
        if not isinstance(fps, (int, float)) or not 1 <= fps <= 60:
            raise ValueError(_BAD_FPS.format(value=fps))
        if not isinstance(page_size, int) or not 1 <= page_size <= 256:
            raise ValueError(_BAD_PAGE.format(value=page_size))
        self._host, self._port, self._fps, self.page_size = host, port, float(fps), page_size
        self._stop = stop
        self.closed = False
        self._queue: collections.deque[tuple[Any, Any, Any, Any]] = collections.deque()
        self._watched = False  # a page is open: tick at fps
        # Worlds whose next step ``on_steps`` should keep for a frame (None: keep nothing).
        self._request: set[int] | None = None
        self._requested: set[int] = set()  # the worlds of the request last made
        self._requested_keys: set[str | None] = set()  # and the pictures its pages show
        self._resumed = threading.Event()
        self._resumed.set()
        self._lock = threading.Lock()
        self._tick_cond = threading.Condition(self._lock)
        self._tick = 0
        self._subscribers: dict[int, _Subscriber] = {}
        self._ids = itertools.count(1)
        self._tally = Tally()
        self._events = Log(1000)
        self._frames: dict[int, dict[str, Any]] = {}  # world -> its newest encoded frame
        self._versions = itertools.count(1)
        self._keys: list[str] = []
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._server: WatchServer | None = None
        self._thread: threading.Thread | None = None
        self.frames_encoded = 0  # world frames encoded so far (none while no page is open)
        self.batches_captured = 0  # batches kept by reference for frames (idem)

    # --- the run's side -------------------------------------------------------------------

    def on_steps(self, timestep: Any) -> None:
        """Takes a batch of steps (a ``BatchedTimeStep``); waits here while paused.

        Args:
          timestep: the steps just received, before actions are chosen for them.
        """
        if self.closed:
            return
        request = self._request
        if request is None:
            self._queue.append((timestep.env_ids, timestep.step_type, timestep.reward, None))
        else:  # a push is due: keep this batch until each requested world has been in one
            self._queue.append((timestep.env_ids, timestep.step_type, timestep.reward, timestep))
            self.batches_captured += 1
            request.difference_update(timestep.env_ids.tolist())
            if not request and self._request is request:
                self._request = None
        if not self._resumed.is_set():
            while not self._resumed.wait(0.25):
                if self.closed or (self._stop is not None and self._stop.is_set()):
                    return

    def on_event(self, event: RunEvent) -> None:
        """Takes one of the run's events (a restart, relaunch, lost world, error)."""
        entry = {"kind": event.kind, "world": event.world, "message": event.message}
        with self._lock:
            self._events.extend([{**entry, "time": event.time}])

    # --- controls -------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether the run is held at its next batch of steps."""
        return not self._resumed.is_set()

    def pause(self) -> None:
        """Holds the run at its next ``on_steps`` until ``resume``."""
        self._resumed.clear()

    def resume(self) -> None:
        """Lets a paused run go on."""
        self._resumed.set()

    @property
    def subscribers(self) -> int:
        """Pages open now."""
        with self._lock:
            return len(self._subscribers)

    @property
    def steps(self) -> int:
        """Steps counted so far (a fraction of a second behind the run)."""
        return self._tally.total

    @property
    def url(self) -> str:
        """The page's address (with the token when bound beyond loopback)."""
        if self._server is None:
            raise RuntimeError("The watcher is not started: call start() or use it in a with.")
        host = self._host if ":" not in self._host else f"[{self._host}]"
        query = "" if self._server.loopback else f"?token={self._server.token}"
        return f"http://{host}:{self._server.port}/{query}"

    @property
    def loopback(self) -> bool:
        """Whether the page is served on loopback only."""
        return is_loopback(self._host)

    def start(self) -> Watcher:
        """Binds the port and starts serving; returns self.

        Raises:
          WatchPortError: the port is taken or the host cannot be bound.
        """
        if self._server is None:
            self._server = WatchServer(self, self._host, self._port)
            self._server.start()
            self._thread = threading.Thread(
                target=self._count_and_encode, name="dm_env_rpc_client-watch-frames", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stops serving, ends every page's stream, lets a paused run go. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._resumed.set()
        with self._tick_cond:
            self._tick_cond.notify_all()
        if self._server is not None:
            self._server.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._queue.clear()
        self._frames.clear()

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the hub the server serves --------------------------------------------------------

    def subscribe(self) -> _Subscriber:
        """Registers a page (the server's stream calls this)."""
        with self._lock:
            subscriber = _Subscriber(next(self._ids), list(range(self.page_size)))
            self._subscribers[subscriber.id] = subscriber
            self._watched = True
        return subscriber

    def unsubscribe(self, subscriber: _Subscriber) -> None:
        """Forgets a page; the last one gone stops frames being kept."""
        with self._lock:
            self._subscribers.pop(subscriber.id, None)
            if not self._subscribers:
                self._watched = False
                self._request = None
                self._frames.clear()
                self._tally.latest.clear()

    def wait_tick(self, last: int, timeout: float) -> int:
        """Waits for a tick newer than ``last``, at most ``timeout`` s; returns the newest."""
        with self._tick_cond:
            if self._tick == last and not self.closed:
                self._tick_cond.wait(timeout)
            return self._tick

    def control(self, body: dict[str, Any]) -> bool:
        """A page's request: ``action`` pause/resume, ``shown`` worlds, ``key`` picture."""
        ident, key = body.get("sub"), body.get("key")
        if not isinstance(ident, int) or not (key is None or isinstance(key, str)):
            return False
        with self._lock:
            subscriber = self._subscribers.get(ident)
            if subscriber is None:
                return False
            shown = body.get("shown")
            if shown is not None:
                if not isinstance(shown, list) or not all(isinstance(w, int) for w in shown):
                    return False
                subscriber.shown, subscriber.sent = [w for w in shown if w >= 0][:256], {}
            if "key" in body:
                subscriber.key, subscriber.sent = key, {}
        action = body.get("action")
        if action == "pause":
            self.pause()
        elif action == "resume":
            self.resume()
        elif action is not None:
            return False
        return True

    def message(self, subscriber: _Subscriber) -> dict[str, Any]:
        """What ``subscriber``'s page has not been sent yet (the stream's next message)."""
        with self._lock:
            tally = self._tally
            message: dict[str, Any] = {
                "steps": tally.total,
                "sps": self._steps_per_second(),
                "paused": self.paused,
                "worlds": len(tally.counts),
                "keys": self._keys,
                "page_size": self.page_size,
                "returns": tally.returns.since(subscriber.returns),
                "events": self._events.since(subscriber.events),
                "frames": [],
            }
            if subscriber.hello:
                message["sub"], subscriber.hello = subscriber.id, False
            subscriber.tick = self._tick  # it takes this push: due for the next one
            subscriber.returns, subscriber.events = tally.returns.end, self._events.end
            for world in subscriber.shown:
                frame = self._frames.get(world)
                if frame is None or subscriber.sent.get(world) == frame["version"]:
                    continue
                subscriber.sent[world] = frame["version"]
                key = subscriber.key if subscriber.key in frame["images"] else None
                key = key or next(iter(sorted(frame["images"])), None)
                message["frames"].append(
                    {
                        "world": world,
                        "step": frame["step"],
                        "key": key,
                        "image": frame["images"].get(key) if key else None,
                        "numbers": frame["numbers"],
                    }
                )
        return message

    # --- the watcher's own thread ---------------------------------------------------------

    def _steps_per_second(self) -> float:
        rate = self._rate
        if len(rate) < 2 or rate[-1][0] <= rate[0][0]:
            return 0.0
        return round((rate[-1][1] - rate[0][1]) / (rate[-1][0] - rate[0][0]), 1)

    def _count_and_encode(self) -> None:
        due = time.monotonic()
        while not self.closed:
            due += 1.0 / self._fps if self._watched else _IDLE_TICK
            time.sleep(max(0.0, due - time.monotonic()))  # ticks on a schedule, not after work
            due = max(due, time.monotonic() - 1.0 / self._fps)  # no burst after a stall
            queue, tally = self._queue, self._tally
            items = [queue.popleft() for _ in range(len(queue))]
            requested, keys = self._requested, self._requested_keys
            tally.take(items, requested)
            del items
            if not self._watched:
                tally.latest.clear()  # steps captured while the last page was open: let them go
            now = time.monotonic()
            if not self._rate or now - self._rate[-1][0] >= 0.1:
                self._rate.append((now, tally.total))
            while len(self._rate) > 2 and now - self._rate[0][0] > 2.0:
                self._rate.popleft()  # steps/s over the last 2 s
            encoded = self._encode(requested, keys)  # the steps captured for this push
            with self._lock:
                # Pages that took the last push are due for the next one; a page still
                # writing (a slow tab) is not captured or encoded for.
                ready = [s for s in self._subscribers.values() if s.tick == self._tick]
                wanted = {w for s in ready for w in s.shown}
                self._requested_keys = {s.key for s in ready}
            # The next push's steps: the due pages' worlds that are stepping (a removed or
            # paused world would keep every batch captured until the next tick).
            request = wanted & tally.stepped if self._watched else set()
            self._requested = set(request)
            self._request = request or None
            with self._tick_cond:
                self._frames.update(encoded)
                self._tick += 1
                self._tick_cond.notify_all()

    def _encode(self, wanted: set[int], keys: set[str | None]) -> dict[int, dict[str, Any]]:
        latest, encoded = self._tally.latest, {}
        for world in wanted:
            entry = latest.pop(world, None)
            if entry is None:
                continue
            timestep, position, step = entry
            if not self._keys:
                self._keys = _frames.image_keys(timestep.observation, position)
            chosen = {k for k in keys if k} | set(self._keys[:1])
            frame = _frames.frame(timestep.observation, position, chosen)
            self.frames_encoded += 1
            encoded[world] = {**frame, "step": step, "version": next(self._versions)}
        latest.clear()  # steps of worlds no page is due for: let them go
        return encoded
