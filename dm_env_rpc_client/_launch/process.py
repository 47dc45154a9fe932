"""One launched server process: the command line, the fork, the log, readiness, the stop.

The machinery of ``launch`` (the public face):

- ``command_line(template, host, port)``: the template split like a shell
  would (``shlex``) or taken as a list, with ``{port}`` and ``{host}`` replaced
  in every word; ``{port}`` must appear.
- ``start(...)``: the process is forked by one long-lived daemon thread (the
  *spawner*), in a session of its own (so a terminal's Ctrl-C reaches only
  this process, which then stops it), with its output in a log file of its own.
  On Linux the child asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGTERM)``)
  for a SIGTERM when its parent dies, then execs the command: a few lines of
  Python run as ``python -S -c`` (not a ``preexec_fn``, which would run Python
  in a forked copy of a threaded, gRPC-holding process: that crashes). The
  signal fires when the *thread* that forked it ends, which is why one thread
  that lives as long as the interpreter forks every server. A *watchdog*, a tiny Python child that
  holds a pipe from this process, escalates: when the pipe closes (this
  process died, even by SIGKILL) it sends SIGTERM to every server's process
  group, waits ``grace`` seconds and SIGKILLs what is left.
- ``wait_ready(...)``: polls, with a deadline, until the server answers the
  protocol: a stream opens and a ``LeaveWorldRequest`` gets an answer (an
  error status counts: the server spoke dm_env_rpc, and so does UNAUTHENTICATED,
  a server that wants a token the probe lacks). A server that accepts
  connections before it can serve is simply polled again. The probe takes
  ``connect``'s ``credentials`` and ``metadata`` (a TLS server, a token).
- ``stop(...)``: SIGTERM to the process group, ``grace`` seconds, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import grpc

from .. import errors
from .._proto import dm_env_rpc_pb2
from ..connection import connect

_TAIL_BYTES = 2000
_NO_PORT = (
    "The command {template!r} has no {{port}}: put {{port}} where the server takes its port "
    "(e.g. 'my_server --port {{port}}', or 'docker run --rm -p {{port}}:10000 IMAGE')."
)
_EMPTY = "The command to launch is empty; give a program and its arguments."
_PORT_TAKEN = (
    "Port {port} on {host} is already in use by another process; the server launched there "
    "could not listen. Pick another port, or leave ports unset to get free ones."
)
_EXEC_WITH_DEATH_SIGNAL = r"""
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before the request took hold
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    print(f"cannot run {sys.argv[2]!r}: {exc.strerror}", flush=True)
    os._exit(127)
"""
_WATCHDOG = r"""
import os, signal, sys, time
groups = set()
for line in sys.stdin:
    word = line.strip()
    if word.startswith("-"):
        groups.discard(int(word[1:]))
    elif word:
        groups.add(int(word))
grace = float(sys.argv[1])
def signal_all(signum):
    for group in list(groups):
        try:
            os.killpg(group, signum)
        except OSError:
            groups.discard(group)
signal_all(signal.SIGTERM)
deadline = time.monotonic() + grace
while groups and time.monotonic() < deadline:
    time.sleep(0.05)
    signal_all(0)
signal_all(signal.SIGKILL)
"""


def command_line(template: str | Sequence[str], host: str, port: int) -> list[str]:
    """The template's words with ``{port}`` and ``{host}`` filled in.

    Raises:
      ArgumentValueError: the template is empty or has no ``{port}`` (a ValueError).
    """
    words = shlex.split(template) if isinstance(template, str) else [str(w) for w in template]
    if not words:
        raise errors.ArgumentValueError(_EMPTY)
    if not any("{port}" in word for word in words):
        raise errors.ArgumentValueError(_NO_PORT.format(template=template))
    return [word.replace("{port}", str(port)).replace("{host}", host) for word in words]


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's pick); the server binds it next."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raises ``ServerLaunchError`` if something listens on ``host:port`` already."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        if sock.connect_ex((host, port)) == 0:
            raise errors.ServerLaunchError(_PORT_TAKEN.format(host=host, port=port))


def tail(path: str, size: int = _TAIL_BYTES) -> str:
    """The last ``size`` bytes of the file at ``path``, as text ('' if unreadable)."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - size))
            return log.read().decode("utf-8", "replace")
    except OSError:
        return ""


class _Spawner:
    """The one thread that forks launched servers, and the watchdog process (see module docs)."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._watchdog_grace = 0.0

    def call(self, function: Callable[[], Any]) -> Any:
        """Runs ``function`` on the spawner thread; returns its result or raises its error."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="dm_env_rpc_client-launcher", daemon=True
                )
                self._thread.start()
        answer: queue.Queue[Any] = queue.Queue()
        self._requests.put((function, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            function, answer = self._requests.get()
            try:
                answer.put((True, function()))
            except BaseException as exc:
                answer.put((False, exc))

    def watch(self, group: int, grace: float) -> None:
        """Tells the watchdog about a process group (starting the watchdog if needed)."""
        with self._lock:
            if self._watchdog is None or self._watchdog.poll() is not None:
                self._watchdog = subprocess.Popen(
                    [sys.executable, "-S", "-c", _WATCHDOG, str(grace)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    close_fds=True,
                )
            self._send(f"{group}\n")

    def forget(self, group: int) -> None:
        """The group was stopped: the watchdog lets go of it."""
        with self._lock:
            self._send(f"-{group}\n")

    def _send(self, line: str) -> None:
        watchdog = self._watchdog
        if watchdog is not None and watchdog.stdin is not None:
            with contextlib.suppress(OSError):
                watchdog.stdin.write(line.encode())
                watchdog.stdin.flush()


SPAWNER = _Spawner()


def start(
    words: Sequence[str],
    log: IO[bytes],
    environment: Mapping[str, str] | None,
    cwd: str | None,
    grace: float,
) -> subprocess.Popen[bytes]:
    """Starts ``words`` with its output in ``log``; watched by the spawner's watchdog.

    Raises:
      ServerLaunchError: the program does not exist or cannot run.
    """
    env = None if environment is None else {**os.environ, **environment}
    program = words[0]
    if shutil.which(program, path=(env or os.environ).get("PATH")) is None:
        where = "is not executable" if os.path.exists(program) else "does not exist"
        raise errors.ServerLaunchError(
            f"Cannot start {shlex.join(words)!r}: the program {program!r} {where} "
            "(check its path, the PATH, and that it is executable)."
        )
    line = list(words)
    if sys.platform.startswith("linux"):
        line = [sys.executable, "-S", "-c", _EXEC_WITH_DEATH_SIGNAL, str(os.getpid()), *line]

    def fork() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            line,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    try:
        process: subprocess.Popen[bytes] = SPAWNER.call(fork)
    except OSError as exc:
        raise errors.ServerLaunchError(
            f"Cannot start {shlex.join(words)!r}: {exc.strerror or exc} "
            f"({words[0]!r}: check the program's path and that it is executable)."
        ) from exc
    SPAWNER.watch(process.pid, grace)
    return process


def stop(process: subprocess.Popen[bytes], grace: float) -> int | None:
    """SIGTERM to the process group, ``grace`` seconds, SIGKILL; returns the exit code."""
    group = process.pid
    if process.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    with contextlib.suppress(OSError):
        os.killpg(group, signal.SIGKILL)  # the process, or what it left in its group
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5.0)
    SPAWNER.forget(group)
    return process.poll()


def answers(address: str, timeout: float, **probe: Any) -> BaseException | None:
    """None if the server at ``address`` answers a request within ``timeout``; else the error.

    ``probe``: more arguments for ``connect`` (``credentials``, ``metadata``).
    """
    deadline = time.monotonic() + timeout
    try:
        with connect(address, timeout=timeout, **probe) as conn:
            remaining = max(0.05, deadline - time.monotonic())
            # An error status is an answer too: the server speaks the protocol.
            with contextlib.suppress(errors.DmEnvRpcError):
                conn.send(dm_env_rpc_pb2.LeaveWorldRequest(), timeout=remaining)
        return None
    except errors.AuthenticationError as exc:
        # UNAUTHENTICATED is an answer (the server is up; the client will hear why);
        # a failed TLS handshake is not.
        return None if exc.code == grpc.StatusCode.UNAUTHENTICATED else exc
    except errors.DmEnvRpcClientError as exc:
        return exc


def wait_ready(
    process: subprocess.Popen[bytes], address: str, timeout: float, **probe: Any
) -> BaseException | None:
    """Polls until the server answers or ``timeout`` passes (see the module docs).

    Returns None once ready; the last probe's error when the time ran out; or
    ``ChildProcessError`` when the process exited first.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    pause = 0.02
    while True:
        if process.poll() is not None:
            return ChildProcessError(process.returncode)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return last or TimeoutError(f"no answer within {timeout} s")
        last = answers(address, min(1.0, remaining), **probe)
        if last is None:
            if process.poll() is not None:  # someone else answered on that port
                return ChildProcessError(process.returncode)
            return None
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(0.25, pause * 2)
