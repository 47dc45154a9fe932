"""The watch page's HTTP server: the page, its Server-Sent Events stream, its controls.

Standard library only (``http.server``): one daemon thread accepts, one daemon
thread per open page streams. Routes:

- ``GET /``: the page (``page.html``), with the server's token written in.
- ``GET /stream?sub=...``: Server-Sent Events, one ``data:`` JSON message per
  tick of the hub (``Hub.message``); it ends when the tab closes (the next
  write fails: the subscriber is dropped at once) or the hub closes.
- ``POST /control``: a JSON body ``{"sub", "action"?, "shown"?, "key"?}``.

Security: bound to loopback, a request must name the server as ``127.0.0.1``,
``localhost`` or ``[::1]`` (a page of another site that rebinds its DNS name
to 127.0.0.1 is refused). Bound to any other interface, every request needs
``?token=...`` (the URL the watcher prints has it). A control request always
needs the token in an ``X-Watch-Token`` header, which a page of another
origin cannot send without a CORS preflight that this server never answers.
"""

from __future__ import annotations

import errno
import http.server
import importlib.resources
import ipaddress
import json
import secrets
import socket
import threading
import urllib.parse
from typing import Any, Protocol

from .. import errors

FIRST_PORT, PORTS_TRIED = 8765, 20  # with no port given: the first free one from 8765 on
_PORT_TAKEN = (
    "Port {port} on {host} is taken by another program; give another port (--watch-port), "
    "or none to take the next free one from {first}."
)
_BAD_HOST = "Cannot watch on {host!r}: {error}. Give an address of this machine, e.g. 127.0.0.1."
_BODY_LIMIT = 64 * 1024  # bytes of a control request read at most


class WatchPortError(errors.DmEnvRpcClientError, OSError):
    """The watch page's port is taken (or cannot be bound); the message says what to do."""


class Hub(Protocol):
    """What the server needs of the watcher."""

    closed: bool

    def subscribe(self) -> Any:
        """A new page's subscriber (with an ``id``)."""

    def unsubscribe(self, subscriber: Any) -> None:
        """Forgets a page that went away."""

    def wait_tick(self, last: int, timeout: float) -> int:
        """The next tick after ``last`` (or the same one after ``timeout``)."""

    def message(self, subscriber: Any) -> dict[str, Any]:
        """What the page has not been sent yet."""

    def control(self, body: dict[str, Any]) -> bool:
        """Applies a control request; False when it names no open page."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _page() -> str:
    return (importlib.resources.files(__package__) / "page.html").read_text(encoding="utf-8")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: WatchServer
    timeout = 10.0  # a page that stops reading fails its writes after this, freeing its thread

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the run's terminal is not the server's log."""

    def _allowed(self, query: dict[str, list[str]]) -> bool:
        server = self.server
        if server.loopback:
            name = urllib.parse.urlsplit(f"//{self.headers.get('Host', '')}").hostname or ""
            if name not in ("127.0.0.1", "localhost", "::1"):
                return False
        else:
            given = query.get("token", [""])[0] or self.headers.get("X-Watch-Token", "")
            if not secrets.compare_digest(given, server.token):
                return False
        return True

    def _reply(self, code: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        """The page, or its event stream."""
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if not self._allowed(query):
            self._reply(403, b"Forbidden: open the URL the watcher printed (with its token).\n")
        elif url.path == "/":
            page = _page().replace("__WATCH_TOKEN__", self.server.token)
            self._reply(200, page.encode("utf-8"), "text/html; charset=utf-8")
        elif url.path == "/stream":
            self._stream()
        else:
            self._reply(404, b"Not found\n")

    def do_POST(self) -> None:
        """A control request from the page."""
        url = urllib.parse.urlsplit(self.path)
        given = self.headers.get("X-Watch-Token", "")
        if url.path != "/control" or not self._allowed({}):
            self._reply(404 if url.path != "/control" else 403, b"No\n")
            return
        if not secrets.compare_digest(given, self.server.token):
            self._reply(403, b"Forbidden: the X-Watch-Token header is missing or wrong.\n")
            return
        length = min(int(self.headers.get("Content-Length") or 0), _BODY_LIMIT)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._reply(400, b"The body must be a JSON object.\n")
            return
        if not isinstance(body, dict) or not self.server.hub.control(body):
            self._reply(400, b"Unknown subscriber or bad control request.\n")
            return
        self._reply(200, b"{}", "application/json")

    def _stream(self) -> None:
        hub = self.server.hub
        threading.current_thread().name = "dm_env_rpc_client-watch-stream"
        subscriber = hub.subscribe()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            tick = -1
            while not hub.closed:
                data = json.dumps(hub.message(subscriber), separators=(",", ":"))
                self.wfile.write(b"data: " + data.encode("utf-8") + b"\n\n")
                self.wfile.flush()
                tick = hub.wait_tick(tick, 1.0)
        except OSError:
            pass  # the tab closed (or stopped reading): drop it, the run goes on
        finally:
            hub.unsubscribe(subscriber)


class WatchServer(http.server.ThreadingHTTPServer):
    """The page's server; ``serve_forever`` runs on a daemon thread (``start``).

    Args:
      hub: the watcher it serves.
      host: the interface to bind.
      port: the port; None takes the first free one from ``FIRST_PORT``.

    Raises:
      WatchPortError: ``port`` is taken, or ``host`` cannot be bound.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, hub: Hub, host: str, port: int | None) -> None:
        self.hub, self.token, self.loopback = hub, secrets.token_urlsafe(16), is_loopback(host)
        if ":" in host:
            self.address_family = socket.AF_INET6
        candidates = (
            [port] if port is not None else [*range(FIRST_PORT, FIRST_PORT + PORTS_TRIED), 0]
        )
        for candidate in candidates:
            try:
                super().__init__((host, candidate), _Handler)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise WatchPortError(_BAD_HOST.format(host=host, error=exc)) from exc
                if port is not None:
                    raise WatchPortError(
                        _PORT_TAKEN.format(port=port, host=host, first=FIRST_PORT)
                    ) from exc
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port bound."""
        return int(self.server_address[1])

    def start(self) -> None:
        """Serves on a daemon thread."""
        self._thread = threading.Thread(
            target=self.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="dm_env_rpc_client-watch",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops serving and closes the port (the streams end with the hub)."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
        self.server_close()
