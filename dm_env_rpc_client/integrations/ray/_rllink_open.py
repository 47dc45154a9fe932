"""Opening the RLlink client's worlds, single- or multi-agent, and stoppable while it waits.

``open_worlds(..., stop=stop)`` connects a ``BatchedEnvironment`` (or, with
``num_agents`` of 2 or more, a ``dmr.MultiAgentBatch`` of worlds with that many
agents each), the way ``run_rllink`` needs them. A connect waits for every
world's answers, each bounded by ``timeout`` (30 s by default): a server that
accepts and never answers holds it that long. So the connect runs on a thread of
its own, and the caller looks at ``stop`` every ``SLICE`` seconds, as every other
wait of the client does:

- the connect ends first: its batch is returned, or its error raised;
- ``stop`` is set first: ``LinkStopped`` is raised at once, and the attempt is let
  go. It still ends within its own bounds, and leaves nothing behind: a connect
  that fails undoes itself (the batch's all or nothing: worlds made are left and
  destroyed, streams closed), and one that succeeds after it was let go is closed
  at once (its worlds left and destroyed). Its thread is a daemon, so a process
  that exits meanwhile (the command line after Ctrl-C or SIGTERM) is not held up,
  and its sockets close with it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...batched import BatchedEnvironment
from ...multiagent import MultiAgentBatch
from ._rllink_wire import SLICE, STOPPED, LinkStopped

CLOSE_S = 5.0  # at most this long to close a batch whose attempt was let go


class _Attempt:
    """One connect on its thread: its batch or error, or let go (then it closes what it got)."""

    def __init__(self, connect: Callable[[], BatchedEnvironment], timeout: float) -> None:
        self.connect, self.timeout = connect, timeout
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.batch: BatchedEnvironment | None = None
        self.error: BaseException | None = None
        self.let_go = False

    def run(self) -> None:
        try:
            batch = self.connect()
        except BaseException as exc:  # handed to the caller (or dropped if let go)
            with self.lock:
                self.error = exc
                self.done.set()
            return
        with self.lock:
            if not self.let_go:
                self.batch = batch
                self.done.set()
                return
        with contextlib.suppress(Exception):
            batch.close(timeout=min(self.timeout, CLOSE_S))
        self.done.set()


def open_worlds(
    addresses: str | Sequence[str],
    num_envs: int | None,
    *,
    num_agents: int = 1,
    stop: threading.Event,
    timeout: float,
    **connect_kwargs: Any,
) -> BatchedEnvironment:
    """Connects the worlds; see the module docs.

    Args:
      addresses: the worlds' servers.
      num_envs: how many worlds (default one per address).
      num_agents: agents per world; 2 or more opens a ``dmr.MultiAgentBatch``.
      stop: ends the wait (``LinkStopped``) when set.
      timeout: seconds for each world's answers (and for closing a batch let go).
      **connect_kwargs: more ``connect`` arguments (``seed``, ``on_world_failure``, ...).

    Returns:
      The batch (agent slots, for multi-agent worlds).

    Raises:
      LinkStopped: ``stop`` was set before the worlds were open (nothing is kept).
      WorldError: a world could not be created or joined (nothing is left behind).
    """
    if num_agents > 1:

        def connect() -> BatchedEnvironment:
            return MultiAgentBatch.connect(
                addresses, num_envs, num_agents, timeout=timeout, **connect_kwargs
            )

    else:

        def connect() -> BatchedEnvironment:
            return BatchedEnvironment.connect(
                addresses, num_envs, timeout=timeout, **connect_kwargs
            )

    attempt = _Attempt(connect, timeout)
    if stop.is_set():
        raise LinkStopped(STOPPED)
    threading.Thread(target=attempt.run, name="rllink-open-worlds", daemon=True).start()
    while not attempt.done.wait(SLICE):
        if not stop.is_set():
            continue
        with attempt.lock:
            if not attempt.done.is_set():
                attempt.let_go = True
                raise LinkStopped(STOPPED)
    if attempt.error is not None:
        raise attempt.error
    assert attempt.batch is not None
    return attempt.batch
