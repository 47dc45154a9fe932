"""``WriterProcess``: a recording's episodes cut and written in a child process.

``Recording(..., background="process")`` (as ``run --record`` makes it) hands
each flush of stacked steps (``episode_stream.Block``, joined into one set of
columns by ``episode_stream.joined`` before they are pickled) to one. The stepping
process is bound by its GIL (the calling thread and the batch's event loop), so
a writer *thread* costs the batch its steps/s one for one; a child process cuts
and writes on another core, and the stepping side only pickles (protocol 5:
arrays travel as out-of-band buffers, written from their own memory with
``os.writev``, never copied in Python) and queues.

- **Start:** ``python -c`` running this module's ``_child``, fed through
  its stdin; its first message is the writer itself (pickled: a writer must be
  picklable before its first episode, as ``NpzWriter``, ``MinariWriter`` and
  ``RldsWriter`` are) with the worlds and seeds of the ``EpisodeStream`` it runs.
- **Back-pressure:** a sender thread writes the queued messages to the pipe. At
  most ``max_bytes`` of messages wait; past that the stepping thread waits for
  the child, at most ``timeout`` seconds without progress, then gets a
  ``RecordingError``.
- **Errors:** the child sends its error (the writer's class, the exception and
  its message, which names the file) back on a pipe of its own and stops; the
  parent raises it as a ``RecordingError`` at its next flush or at ``close``.
- **Never outliving its parent:** at end of file on its stdin (the parent closed
  it, or died: SIGKILL included) or when its parent is no longer its parent
  (checked every second), the child closes its writer (committing every
  complete episode it has) and exits. It ignores SIGINT: Ctrl-C in a terminal
  goes to the whole process group, and the parent decides what the run does.
  ``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that started the
  child ends, and would kill the child before its last commit.
- **Priority:** the child runs at niceness ``NICE`` (10): the batch's steps go
  first, and the writer catches up in the gaps.
- **Close:** a ``close`` message cuts every world's running episode as
  truncated, closes the writer and answers with the counts; waited for at most
  ``timeout`` seconds after the last message went out, then the child is killed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import errors
from .episode_stream import Block, EpisodeStream, joined

NICE = 10
"""The child's niceness: on a machine short of cores it writes in the gaps the stepping
process and the servers leave, rather than delaying their steps (it only has to keep up on
average: ``max_bytes`` bounds how far behind it may fall)."""
_HEAD = struct.Struct("<QI")  # pickle length, number of out-of-band buffers
_SIZE = struct.Struct("<Q")
_IOV_MAX = 512
_CHILD = f"import sys; from {__name__} import _child; sys.exit(_child(int(sys.argv[1])))"
_FAILED = "Recording into {directory} failed in its writer process ({writer}): {error}"
_NOT_PICKLABLE = (
    "Recording(background='process') sends the writer {writer} to a child process, and it cannot "
    "be pickled ({error}): record with background='thread', or make the writer picklable."
)
_STALLED = (
    "The writer process of {directory} ({writer}) took no data for {timeout} s while "
    "{queued} MB waited: it is stuck or far too slow for this run."
)


def _message(obj: Any) -> list[bytes | memoryview]:
    """``obj`` framed for the pipe: head, sizes, pickle, then its buffers as views."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    sizes = b"".join(_SIZE.pack(view.nbytes) for view in views)
    return [_HEAD.pack(len(data), len(views)) + sizes, data, *views]


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


class WriterProcess:
    """Runs an ``EpisodeStream`` and its writer in a child process (see the module docs).

    Args:
      writer: the ``EpisodeWriter`` (picklable; not yet written to).
      episode_type: what the writer is given (``recording.Episode``), called with the
        ``EpisodeStream``'s fields.
      worlds: how many worlds the batch has.
      seeds: each world's seed.
      first_world: the index of world 0 in the episodes' metadata.
      directory: the recording's folder, for error messages.
      max_bytes: how many bytes of steps may wait for the child.
      timeout: seconds the stepping side waits for the child to take data, and
        for it to finish at ``close``.

    Raises:
      RecordingError: the writer cannot be pickled, or the child did not start.
    """

    def __init__(
        self,
        writer: Any,
        episode_type: Any,
        worlds: int,
        seeds: Sequence[int | None],
        first_world: int,
        *,
        directory: Any = "",
        max_bytes: int = 64 << 20,
        timeout: float = 60.0,
    ) -> None:
        self._name = type(writer).__name__
        self._directory = directory
        self._timeout = timeout
        self._max_bytes = max_bytes
        try:
            start = _message(("start", writer, episode_type, worlds, list(seeds), first_world))
        except Exception as exc:
            raise errors.RecordingError(
                _NOT_PICKLABLE.format(writer=self._name, error=exc)
            ) from exc
        # The child imports what this process can: the writer's class, wherever it lives.
        path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(os.getpid())],
                env={**os.environ, "PYTHONPATH": path},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        except OSError as exc:
            raise errors.RecordingError(
                _FAILED.format(directory=directory, writer=self._name, error=exc)
                + " (it could not start): record with background='thread'."
            ) from exc
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin = self._process.stdin
        self._replies = self._process.stdout
        self._queue: queue.SimpleQueue[list[bytes | memoryview] | None] = queue.SimpleQueue()
        self._queued = 0  # bytes waiting in the queue
        self._moved = threading.Condition()
        self._send_error: BaseException | None = None
        self._closed = False
        self._ready = False
        self._failed: str | None = None  # the error raised, raised again by later calls
        self._inbox = bytearray()
        self.result: tuple[int, int, list[str]] = (0, 0, [])
        self._sender = threading.Thread(target=self._send, name="episode-writer-feed", daemon=True)
        self._sender.start()
        self._put(start)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    def _send(self) -> None:
        fd = self._stdin.fileno()
        while (parts := self._queue.get()) is not None:
            try:
                if self._send_error is None:
                    _write_all(fd, parts)
            except OSError as exc:  # the child is gone: its reply says why
                self._send_error = exc
            with self._moved:
                self._queued -= sum(len(part) for part in parts)
                self._moved.notify_all()
        with contextlib.suppress(OSError):
            self._stdin.close()

    def _put(self, parts: list[bytes | memoryview]) -> None:
        size = sum(len(part) for part in parts)
        with self._moved:
            while self._queued and self._queued + size > self._max_bytes:
                before = self._queued
                self._moved.wait(self._timeout)
                self._check()
                if self._queued == before:
                    self._failed = _STALLED.format(
                        directory=self._directory,
                        writer=self._name,
                        timeout=self._timeout,
                        queued=round(before / 1e6, 1),
                    )
                    raise errors.RecordingError(self._failed)
            self._queued += size
        self._queue.put(parts)

    def _check(self) -> None:
        """Raises the child's error, if it stopped with one."""
        if self._failed is not None:
            raise errors.RecordingError(self._failed)
        if self._send_error is not None or self._process.poll() is not None:
            reply = self._read_reply(5.0)
            if reply is not None and reply[0] == "ready":
                reply = self._read_reply(5.0)
            self._raise_reply(reply)

    def _read_reply(self, timeout: float) -> Any:
        """The child's next reply; None if none came within ``timeout`` s or it is gone."""
        fd = self._replies.fileno()
        deadline = time.monotonic() + timeout
        while True:
            inbox = self._inbox
            if len(inbox) >= _SIZE.size:
                end = _SIZE.size + _SIZE.unpack_from(inbox)[0]
                if len(inbox) >= end:
                    reply = pickle.loads(inbox[_SIZE.size : end])
                    del inbox[:end]
                    return reply
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 1 << 20) if ready else b""
            if not chunk:
                return None
            inbox += chunk

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Waits until the child has its writer (imports done), at most ``timeout`` s.

        Raises:
          RecordingError: the child failed, or was not ready in time.
        """
        if self._ready:
            return
        reply = self._read_reply(timeout)
        if reply is None or reply[0] != "ready":
            self._raise_reply(reply)
            raise errors.RecordingError(
                _FAILED.format(
                    directory=self._directory,
                    writer=self._name,
                    error=f"it was not ready within {timeout} s",
                )
            )
        self._ready = True

    def _raise_reply(self, reply: Any) -> None:
        if reply is not None and reply[0] == "error":
            error = reply[1]
        else:
            code = self._process.poll()
            if code is None and self._send_error is None:
                return
            error = f"it exited (code {code}) without saying why"
        self._failed = _FAILED.format(directory=self._directory, writer=self._name, error=error)
        raise errors.RecordingError(self._failed)

    def sync(self, blocks: Sequence[Block] = ()) -> tuple[int, int]:
        """Sends ``blocks`` and waits until the child has written every episode they end.

        Returns:
          The episodes written so far, and how many of them are truncated.

        Raises:
          RecordingError: the child failed, or did not answer within ``timeout`` s.
        """
        self._check()
        self._put(_message(("sync", joined(blocks), [])))
        reply = self._read_reply(self._timeout)
        if reply is not None and reply[0] == "ready":
            reply = self._read_reply(self._timeout)
        if reply is None or reply[0] != "synced":
            self._raise_reply(reply)
            self._failed = _FAILED.format(
                directory=self._directory,
                writer=self._name,
                error=f"it did not answer within {self._timeout} s",
            )
            raise errors.RecordingError(self._failed)
        return reply[1], reply[2]

    def cut(self, blocks: Sequence[Block], worlds: Sequence[int] = ()) -> None:
        """Sends ``blocks`` (and the worlds whose running episodes end as cut) to the child."""
        self._check()
        self._put(_message(("cut", joined(blocks), list(worlds))))

    def close(self, blocks: Sequence[Block] = (), worlds: Sequence[int] = ()) -> None:
        """Sends the last blocks, cuts ``worlds``, waits for the child to finish (bounded).

        ``result`` then holds (episodes, truncated, written paths). Idempotent; after
        an error already raised, it only ends the child.

        Raises:
          RecordingError: the child failed, or did not finish within ``timeout`` s
            after its last data (it is killed).
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._failed is None:
                self._check()
                self._put(_message(("close", joined(blocks), list(worlds))))
        except BaseException:
            self._kill()
            raise
        finally:
            self._queue.put(None)
        if self._failed is not None:
            self._kill()
            return
        self._sender.join(self._timeout)
        reply = self._read_reply(self._timeout)
        if reply is not None and reply[0] == "ready":
            reply = self._read_reply(self._timeout)
        if reply is None:
            self._process.kill()
            self._kill()
            error = f"it did not finish within {self._timeout} s and was killed"
            self._raise_reply(("error", error) if self._process.returncode == -9 else None)
        self._kill()
        if reply[0] != "done":
            self._raise_reply(reply)
        self.result = reply[1:]

    def _kill(self) -> None:
        """Ends the child (at once if it has not ended within 5 s) and its feeding thread."""
        try:
            self._process.wait(5.0 if self._closed and self._failed is None else 0.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._sender.join(5.0)
        self._replies.close()


# The child's side.


def _read_exact(fd: int, size: int, parent: int) -> bytearray | None:
    """``size`` bytes from ``fd``; None at end of file or once ``parent`` is gone."""
    out = bytearray(size)
    view = memoryview(out)
    got = 0
    while got < size:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            if os.getppid() != parent:
                return None
            continue
        count = os.readv(fd, [view[got:]])
        if not count:
            return None
        got += count
    return out


def _receive(fd: int, parent: int) -> Any:
    head = _read_exact(fd, _HEAD.size, parent)
    if head is None:
        return None
    length, count = _HEAD.unpack(head)
    sizes = _read_exact(fd, _SIZE.size * count, parent) if count else bytearray()
    data = _read_exact(fd, length, parent)
    if sizes is None or data is None:
        return None
    buffers = []
    for (size,) in _SIZE.iter_unpack(sizes):
        buffer = _read_exact(fd, size, parent)
        if buffer is None:
            return None
        buffers.append(buffer)
    return pickle.loads(data, buffers=buffers)


def _reply(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj)
    os.write(fd, _SIZE.pack(len(data)) + data)


def _child(parent: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICE)
    replies = os.dup(1)
    os.dup2(2, 1)  # what the libraries print goes to stderr, not into the replies
    source = sys.stdin.fileno()
    writer: Any = None
    episode_type: Any = None
    counts = [0, 0]
    written: list[str] = []

    def emit(**fields: Any) -> None:
        path = writer.write(episode_type(**fields))
        if path is not None:
            written.append(str(path))
        counts[0] += 1
        counts[1] += fields["truncated"]

    try:
        start = _receive(source, parent)
        if start is None:
            return 0
        _, writer, episode_type, worlds, seeds, first_world = start
        _reply(replies, ("ready",))
        stream = EpisodeStream(worlds, seeds, first_world, emit)
        while (message := _receive(source, parent)) is not None:
            kind, rows, cut_worlds = message
            stream.cut_joined(rows, cut_worlds)
            if kind == "sync":
                _reply(replies, ("synced", counts[0], counts[1]))
            elif kind == "close":
                writer.close()
                _reply(replies, ("done", counts[0], counts[1], written))
                return 0
        writer.close()  # the parent is gone: keep every complete episode
        return 0
    except BaseException as exc:
        _reply(replies, ("error", f"{type(exc).__name__}: {exc}"))
        return 1
