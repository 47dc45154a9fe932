"""A stand-in RLlib learner that speaks RLlink on a loopback port, for the RLlink client's tests.

It answers the way Ray's ``EnvRunnerServerForExternalInference`` does (framing
and messages from ``ray.rllib.env.external.rllink``): ``PONG`` to ``PING``,
``SET_CONFIG`` (a pickled ``AlgorithmConfig``) to ``GET_CONFIG``, ``SET_STATE``
(an RLModule's weights) to ``GET_STATE`` and ``EPISODES_AND_GET_STATE``, nothing
to ``EPISODES``; it keeps every episode it receives. It misbehaves on purpose:

- ``drop_after=N``: after taking the N-th batch of episodes it hangs up instead
  of answering (then listens again);
- ``gone_after=N``: after answering the N-th batch it hangs up and stops listening;
- ``stall_after=N``: once it has answered the config and taken N batches, it
  neither reads nor answers any more, the connection kept open (a learner that
  stopped: a client waits for its weights, or fills the socket with episodes
  it does not read; its receive buffer is kept small so that this comes soon);
- ``weights``: the weights it sends (default those of the config's module; an
  off-policy client asks for none, so ``{}`` spares building a module and torch).

Its ``weights_seq_no`` is the batches it took. With ``stale_every_other`` it
answers as Ray's server does under RLlib 2.60, which calls ``set_state`` twice an
iteration (the weights, then the connector states): every second batch is answered
with the weights it had (the seq no unchanged), and they move at the next
``GET_STATE``. With ``frozen_after=N`` they never move past N.

No RLlib training runs: it is the learner's side of the socket only.
"""

from __future__ import annotations

import contextlib
import fcntl
import pickle
import socket
import struct
import termios
import threading
from typing import Any

from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.env.external.rllink import get_rllink_message, send_rllink_message
from ray.rllib.env.single_agent_episode import SingleAgentEpisode


class FakeLearner:
    """See the module docs. ``address`` is where it listens; ``close()`` ends it."""

    def __init__(
        self,
        config: Any,
        *,
        weights: Any = None,
        drop_after: int | None = None,
        gone_after: int | None = None,
        stall_after: int | None = None,
        stale_every_other: bool = False,
        frozen_after: int | None = None,
    ) -> None:
        self.config = config
        self.weights = (
            weights
            if weights is not None
            else config.get_rl_module_spec(inference_only=True).build().get_state()
        )
        self.drop_after, self.gone_after, self.stall_after = drop_after, gone_after, stall_after
        self.episodes: list[SingleAgentEpisode] = []
        self.batches = 0
        self.stale_every_other, self.frozen_after = stale_every_other, frozen_after
        self.seq, self.pending = 0, False  # weights_seq_no; an update due at the next GET_STATE
        self.kinds: list[str] = []  # every message's type, in order
        self.connections = 0
        self.stalled: socket.socket | None = None  # the connection it stopped reading
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if stall_after is not None:  # (accepted sockets inherit it)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with client:
                try:
                    self._talk(client)
                except ConnectionError:
                    continue

    def unread_bytes(self) -> int:
        """Bytes the client sent that the stalled connection did not read (0 if none)."""
        if self.stalled is None:
            return 0
        waiting = fcntl.ioctl(self.stalled.fileno(), termios.FIONREAD, b"\0" * 4)
        return int(struct.unpack("i", waiting)[0])

    def _talk(self, client: socket.socket) -> None:
        configured = False
        while True:
            if configured and self.stall_after is not None and self.batches >= self.stall_after:
                self.stalled = client
                self._closed.wait()
                return
            kind, body = get_rllink_message(client)
            self.kinds.append(kind.name)
            if kind.name == "PING":
                send_rllink_message(client, {"type": "PONG"})
            elif kind.name == "GET_CONFIG":
                send_rllink_message(
                    client, {"type": "SET_CONFIG", "config": pickle.dumps(self.config)}
                )
                configured = True
            elif kind.name == "GET_STATE":
                if self.pending:
                    self.pending = False
                    self._update()
                self._state(client)
            elif kind.name in ("EPISODES", "EPISODES_AND_GET_STATE"):
                self.episodes.extend(SingleAgentEpisode.from_state(s) for s in body["episodes"])
                self.batches += 1
                if self.batches == self.drop_after:
                    return  # hangs up with the episodes taken, unanswered
                if self.batches == self.stall_after:
                    continue  # takes them and says nothing more
                if self.stale_every_other and self.batches % 2 == 0:
                    self.pending = True  # answered with the weights it had
                else:
                    self._update()
                if kind.name == "EPISODES_AND_GET_STATE":
                    self._state(client)
                if self.batches == self.gone_after:
                    self.close()
                    return

    def _update(self) -> None:
        if self.frozen_after is None or self.seq < self.frozen_after:
            self.seq += 1

    def _state(self, client: socket.socket) -> None:
        state = {COMPONENT_RL_MODULE: self.weights, "weights_seq_no": self.seq}
        send_rllink_message(client, {"type": "SET_STATE", "state": state})

    def close(self) -> None:
        """Stops listening (idempotent)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
