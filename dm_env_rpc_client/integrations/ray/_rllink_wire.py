"""One RLlink connection to an RLlib ``EnvRunnerServerForExternalInference``, and its errors.

RLlink (``ray.rllib.env.external.rllink``, protocol 0.0.1 in Ray 2.60) frames each
message as 8 ASCII digits (the body's length, zero-padded) and a msgpack body
(``msgpack_numpy`` arrays) holding a ``"type"`` field: the client sends ``PING``,
``GET_CONFIG``, ``GET_STATE``, ``EPISODES`` or ``EPISODES_AND_GET_STATE``; the
server answers ``PONG``, ``SET_CONFIG`` (``{"config": pickled AlgorithmConfig}``)
and ``SET_STATE`` (``{"state": {"rl_module": weights, "weights_seq_no": n}}``).
The server answers ``EPISODES`` with nothing and ``EPISODES_AND_GET_STATE`` with
``SET_STATE`` once the learner has trained on them.

``Link`` is one such connection; every call is bounded:

- ``open(wait)`` connects and handshakes (``PING``/``PONG``), retrying with
  backoff for up to ``wait`` seconds and saying each time what it waits for
  (a ``LearnerUnreachableError`` after that);
- ``request(kind, reply, timeout)`` sends one message and, with ``reply``,
  waits up to ``timeout`` for that answer (``LinkDroppedError`` if the
  connection breaks or the time runs out);
- ``answer_ready()`` tells, without blocking, whether an answer (or a hang-up) waits;
- ``peer_closed()`` tells, without blocking, whether the learner hung up
  (so a batch of episodes is not written into a dead socket, where it would
  vanish unseen).

Every wait (a backoff, a connect, a send into a learner that does not read, an
answer that does not come) looks at the run's ``stop`` every ``SLICE`` seconds
and raises ``LinkStopped`` once it is set: Ctrl-C or SIGTERM ends a client
promptly whatever it waits for. A message cut short so is discarded by the server.

Ray's server takes one client per port; a second client waits until the first
hangs up (the server then listens again after 5 s).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ... import errors

HEADER = 8  # ASCII digits of the body's length
PING, PONG = "PING", "PONG"
GET_CONFIG, SET_CONFIG = "GET_CONFIG", "SET_CONFIG"
GET_STATE, SET_STATE = "GET_STATE", "SET_STATE"
EPISODES, EPISODES_AND_GET_STATE = "EPISODES", "EPISODES_AND_GET_STATE"
FIRST_BACKOFF, MAX_BACKOFF = 0.5, 5.0  # seconds between connection attempts
SLICE = 0.25  # seconds between looks at the run's stop event while waiting
STOPPED = "stopped"  # RLlinkStats.stop_reason when the run's stop was set
_CONNECT_TIMEOUT = 5.0
_HANDSHAKE_TIMEOUT = 30.0
_WAITING = (
    "waiting for the RLlib learner at {address} (an EnvRunnerServerForExternalInference "
    "listening there): {error}; retrying in {delay:.1f} s, for {left:.0f} s more"
)
_UNREACHABLE = (
    "No RLlib EnvRunnerServerForExternalInference answered at {address} within {wait:.0f} s "
    "({error}). Start the learner with env_runner_cls=EnvRunnerServerForExternalInference and "
    "env_config={{'port': P}} (runner i listens on P + i, on localhost), or pass a longer wait."
)
_DROPPED = "The RLlib learner at {address} {what}: {error}."
_BAD_REPLY = "The RLlib learner at {address} answered {got!r} to {sent}, where {want} was due."
_BIG = 10**8  # the header's largest length plus one


class RLlinkError(errors.DmEnvRpcClientError):
    """An RLlink client's error: the learner's side of an ``run_rllink`` run."""


class LearnerUnreachableError(RLlinkError, ConnectionError):
    """No RLlib learner answered at an address within the wait."""


class LinkDroppedError(RLlinkError, ConnectionError):
    """An RLlink connection broke, or an answer did not come in time."""


class LinkStopped(RLlinkError):
    """The run's ``stop`` was set while a link waited (not an error: the run ends)."""


class SpaceMismatchError(RLlinkError, ValueError):
    """The learner's observation or action space does not fit the worlds' (the message says which)."""


def _msgpack() -> Any:
    try:
        import msgpack
        import msgpack_numpy
    except ImportError as exc:  # pragma: no cover - both are in the rllib extra
        raise ImportError(
            "The RLlink client needs msgpack and msgpack-numpy (RLlink's message format): "
            "pip install 'dm_env_rpc_client[rllib]'"
        ) from exc
    msgpack_numpy.patch()
    return msgpack


class Link:
    """One RLlink connection (see the module docs).

    Args:
      address: ``host:port`` of the EnvRunnerServerForExternalInference.
      say: where progress notes go (``print`` to stderr in the CLI).
      stop: the run's stop event: every wait ends with ``LinkStopped`` once it is set.
    """

    def __init__(
        self, address: str, say: Callable[[str], None], stop: threading.Event | None = None
    ) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise errors.ArgumentValueError(
                f"The RLlib address {address!r} is not host:port (e.g. 127.0.0.1:5555)."
            )
        self.address, self._host, self._port = address, host, int(port)
        self._say = say
        self._stop = stop or threading.Event()
        self._sock: socket.socket | None = None
        self._packer = _msgpack()

    def open(self, wait: float) -> None:
        """Connects and handshakes, retrying with backoff for up to ``wait`` seconds.

        Raises:
          LearnerUnreachableError: no learner answered within ``wait``.
          LinkStopped: the run's stop was set.
        """
        self.close()
        deadline = time.monotonic() + wait
        delay = FIRST_BACKOFF
        while True:
            try:
                self._sock = self._connect()
                self.request(PING, PONG, _HANDSHAKE_TIMEOUT)
                return
            except (OSError, LinkDroppedError) as exc:
                self.close()
                left = deadline - time.monotonic()
                error = str(exc.__cause__ or exc)
                if left <= 0:
                    raise LearnerUnreachableError(
                        _UNREACHABLE.format(address=self.address, wait=wait, error=error)
                    ) from exc
                delay = min(delay, left)
                self._say(
                    _WAITING.format(address=self.address, error=error, delay=delay, left=left)
                )
                if self._stop.wait(delay):  # a backoff between attempts, or stopped
                    raise LinkStopped(STOPPED) from None
                delay = min(delay * 2, MAX_BACKOFF)

    def _connect(self) -> socket.socket:
        """A TCP connection to the learner, tried for up to ``_CONNECT_TIMEOUT`` seconds."""
        deadline = time.monotonic() + _CONNECT_TIMEOUT
        family, kind, proto, _, where = socket.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            code = sock.connect_ex(where)
            while code in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
                self._check_stop()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("timed out")
                _, writable, _ = select.select([], [sock], [], min(SLICE, left))
                if writable:
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
            sock.setblocking(True)
            return sock
        except BaseException:
            sock.close()
            raise

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise LinkStopped(STOPPED)

    def config(self, timeout: float) -> Any:
        """The learner's ``AlgorithmConfig`` (``GET_CONFIG``)."""
        body = self.request(GET_CONFIG, SET_CONFIG, timeout)
        # Unpickling runs the learner's code: trust only a learner you pointed the client at.
        return pickle.loads(body["config"])

    def state(self, timeout: float) -> dict[str, Any]:
        """The learner's current weights (``GET_STATE``): ``{"rl_module": ..., ...}``."""
        return dict(self.request(GET_STATE, SET_STATE, timeout)["state"])

    def request(self, kind: str, reply: str | None, timeout: float, **body: Any) -> dict[str, Any]:
        """Sends one message; with ``reply``, waits up to ``timeout`` for it.

        Returns:
          The reply's body (without ``type``), or ``{}`` without ``reply``.

        Raises:
          LinkDroppedError: the connection broke, closed, or did not answer in time.
          RLlinkError: the learner answered something else.
        """
        self.send(kind, timeout, **body)
        return {} if reply is None else self.expect(reply, kind, timeout)

    def send(self, kind: str, timeout: float, **body: Any) -> None:
        """Sends one message of type ``kind``, taking up to ``timeout`` seconds.

        Raises:
          LinkDroppedError: not connected, the connection broke, or the learner took
            nothing for ``timeout`` seconds (a message cut short is discarded by the
            server: it may be sent again).
          LinkStopped: the run's stop was set (the message may be cut short).
        """
        if self._sock is None:
            raise LinkDroppedError(
                _DROPPED.format(address=self.address, what="is not connected", error="closed")
            )
        data = self._packer.packb({"type": kind, **body}, use_bin_type=True)
        view = memoryview(str(len(data)).zfill(HEADER).encode() + data)
        idle = time.monotonic() + timeout  # a learner that takes nothing for this long
        try:
            while view:
                self._check_stop()
                left = idle - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"it took nothing for {timeout:.0f} s")
                self._sock.settimeout(min(SLICE, left))
                try:
                    sent = self._sock.send(view)
                except TimeoutError:
                    continue
                view = view[sent:]
                idle = time.monotonic() + timeout
        except OSError as exc:
            raise LinkDroppedError(
                _DROPPED.format(address=self.address, what=f"did not take {kind}", error=exc)
            ) from exc

    def expect(self, reply: str, sent: str, timeout: float) -> dict[str, Any]:
        """Waits up to ``timeout`` for a ``reply`` message (the answer to ``sent``); its body.

        Raises:
          LinkDroppedError: the connection broke, closed, or did not answer in time.
          RLlinkError: the learner answered something else.
          LinkStopped: the run's stop was set.
        """
        if self._sock is None:
            raise LinkDroppedError(
                _DROPPED.format(address=self.address, what="is not connected", error="closed")
            )
        message = self._receive(sent, timeout)
        got = message.pop("type", None)
        if got != reply:
            raise RLlinkError(
                _BAD_REPLY.format(address=self.address, got=got, sent=sent, want=reply)
            )
        return message

    def _receive(self, sent: str, timeout: float) -> dict[str, Any]:
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        try:
            header = self._exactly(HEADER, deadline)
            if not header.isdigit():
                raise RLlinkError(f"The RLlib learner at {self.address} sent a bad header.")
            message = self._packer.unpackb(self._exactly(int(header), deadline), raw=False)
        except (OSError, EOFError) as exc:
            what = f"did not answer {sent} within {timeout:.0f} s"
            if not isinstance(exc, TimeoutError):
                what = f"hung up while {sent} waited for its answer"
            raise LinkDroppedError(
                _DROPPED.format(address=self.address, what=what, error=exc)
            ) from exc
        if not isinstance(message, dict):
            raise RLlinkError(f"The RLlib learner at {self.address} sent a message with no type.")
        return message

    def _exactly(self, count: int, deadline: float) -> bytes:
        assert self._sock is not None
        chunks, got = [], 0
        while got < count:
            self._check_stop()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self._sock.settimeout(min(SLICE, left))
            try:
                chunk = self._sock.recv(min(count - got, 1 << 20))
            except TimeoutError:
                continue
            if not chunk:
                raise EOFError("the connection was closed")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def answer_ready(self) -> bool:
        """True if the learner has sent something not read yet (or hung up); never blocks."""
        if self._sock is None:
            return True
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def peer_closed(self) -> bool:
        """True if the learner hung up (or is not connected); never blocks."""
        if self._sock is None:
            return True
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
                return False
            self._sock.setblocking(False)
            try:
                return self._sock.recv(1, socket.MSG_PEEK) == b""
            finally:
                self._sock.setblocking(True)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        """Closes the connection (idempotent)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
