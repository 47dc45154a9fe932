"""Launching dm_env_rpc server processes: compiled players, simulators, containers.

``launch(command, num_servers)`` starts ``num_servers`` copies of a command
template, each on a port of its own, waits until each answers the protocol,
and hands back their addresses::

    import dm_env_rpc_client as dmr

    with dmr.launch("my_player --port {port}", num_servers=2) as servers:
        with dmr.BatchedEnvironment.connect(servers, num_envs=8) as envs:
            envs.reset()

- The template is split like a shell would (or given as a list of words);
  ``{port}`` (required) and ``{host}`` are filled in per server. Ports are free
  loopback ports unless ``ports=`` names them. A container is the same thing:
  ``docker run --rm -p {port}:10000 IMAGE``.
- Readiness is a bounded wait until the server *answers*: a stream opens and a
  request gets a reply. A server that accepts connections before it can serve
  is polled again, never slept on. A process that exits while starting, or
  does not answer within ``ready_timeout``, raises ``ServerLaunchError`` naming
  the command, its exit code, the tail of its output and its log file; every
  server started so far is stopped first.
- Each process writes its output (stdout and stderr) to a log file of its own
  (``servers.servers[i].log_path``), in ``log_dir`` or a temporary folder.
- Stopping is SIGTERM to the server's process group, ``grace`` seconds, then
  SIGKILL: on ``close()``, on leaving the ``with`` block, at interpreter exit,
  and on SIGTERM or Ctrl-C to this process (a SIGTERM handler that exits
  cleanly is installed while nothing else handles SIGTERM). If this process is
  SIGKILLed, the servers still die: the kernel sends them SIGTERM (Linux), and
  a small watchdog process SIGKILLs whatever is left after ``grace``.
- Relaunch (``relaunch=RelaunchPolicy()``, the default): a server that exits
  is started again on the same port, with bounded attempts and backoff, and
  waited for like at launch. ``relaunches`` records each: which server, why
  (exit code and output), how long it was down. ``BatchedEnvironment`` worlds
  on it are restored there under ``on_world_failure="restart"``.
- Strangers kept out: ``token=`` reaches each server in the environment
  variable ``DMR_TOKEN`` (never its command line, which ``ps`` shows; a server
  of your own reads it from there, as ``dm-env-rpc-client serve`` does), and
  the readiness probe sends it. ``credentials=`` are the probe's channel
  credentials for servers that serve TLS (with a client certificate for mutual
  TLS). ``BatchedEnvironment.connect(servers, ...)`` takes both from the
  servers unless given its own (``servers.metadata``, ``servers.credentials``).

The private ``_launch.process`` forks, watches, probes and stops one process.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, overload

import grpc

from . import errors
from ._base import checks as _checks
from ._base import tokens as _tokens
from ._launch import process as _process

_NO_SERVERS = "num_servers must be at least 1, not {count}."
_PORTS_COUNT = "Give one port per server: {ports} ports for {count} servers."
_EXITED = (
    "Server {index} ({command!r}) exited with code {code} while starting. Its last output: "
    "{tail!r}. Full log: {log}. Run the command yourself to see why."
)
_NOT_READY = (
    "Server {index} ({command!r}) did not answer the dm_env_rpc protocol on {address} within "
    "{timeout} s (last probe: {error}); it was stopped (exit code {code}). Its last output: "
    "{tail!r}. Full log: {log}. Check that it serves dm_env_rpc on the port given as {{port}}, "
    "or pass a longer ready_timeout."
)
_GONE = "Server {index} ({command!r}) is not running: it gave up relaunching; see relaunches."


class RelaunchPolicy(NamedTuple):
    """The bounds of relaunching a server that exited.

    Attributes:
      attempts: at most this many starts per death.
      backoff: seconds before the second start; it doubles after each failed one.
      max_backoff: the longest wait between two starts.
    """

    attempts: int = 5
    backoff: float = 0.5
    max_backoff: float = 10.0


@dataclasses.dataclass
class Relaunch:
    """One death of a launched server and what followed (``LaunchedServers.relaunches``).

    Recorded as soon as the death is seen (``outcome="relaunching"``) and updated in
    place when the relaunch ends.

    Attributes:
      index: the server's index.
      address: its address (a relaunched server keeps its port).
      reason: why it was relaunched (its exit code, and the tail of its output).
      died: when the death was seen (``time.time()``).
      downtime: seconds from the death to serving again (or to giving up).
      attempts: starts made.
      outcome: ``"relaunched"``, ``"gave up"``, or ``"relaunching"`` while under way.
    """

    index: int
    address: str
    reason: str
    died: float
    downtime: float
    attempts: int
    outcome: str


@dataclasses.dataclass
class LaunchedServer:
    """One launched server process.

    Attributes:
      index: its index among the launched servers.
      command: the command line it runs (template filled in).
      address: ``host:port``.
      log_path: the file its output goes to (appended to on relaunch).
      process: the running process (replaced on relaunch).
    """

    index: int
    command: list[str]
    address: str
    log_path: str
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        """The process id (also its process group id)."""
        return self.process.pid


class LaunchedServers(Sequence[str]):
    """Servers started by ``launch``; a context manager that stops them. See the module docs.

    It is also the sequence of their addresses (``servers[0]``, ``len(servers)``,
    ``list(servers)``), so it goes wherever addresses go.

    Attributes:
      servers: one ``LaunchedServer`` per server.
      relaunches: one ``Relaunch`` per server death, oldest first.
      metadata: the metadata that carries ``launch``'s token (None without one).
      credentials: ``launch``'s channel credentials (None without them).
    """

    def __init__(
        self,
        servers: list[LaunchedServer],
        *,
        grace: float,
        ready_timeout: float,
        relaunch: RelaunchPolicy | None,
        options: tuple[Mapping[str, str] | None, str | None, float] = (None, None, 5.0),
        probe: Mapping[str, Any] | None = None,
    ) -> None:
        self.servers = servers
        self._probe = dict(probe or {})  # connect()'s credentials and metadata, for relaunches
        self.metadata = self._probe.get("metadata")
        self.credentials = self._probe.get("credentials")
        self._options = options  # (env, cwd, grace) to start a server again
        self.relaunches: list[Relaunch] = []
        self._grace = grace
        self._ready_timeout = ready_timeout
        self._policy = relaunch
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._given_up: set[int] = set()
        self._supervisor: threading.Thread | None = None
        _OPEN.add(self)
        if relaunch is not None:
            self._supervisor = threading.Thread(
                target=self._supervise, name="dm_env_rpc_client-relauncher", daemon=True
            )
            self._supervisor.start()

    @property
    def addresses(self) -> list[str]:
        """Each server's ``host:port``, in order."""
        return [server.address for server in self.servers]

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self.addresses[index]

    def __len__(self) -> int:
        return len(self.servers)

    @property
    def closed(self) -> bool:
        """``close()`` was called."""
        return self._closing.is_set()

    def alive(self, index: int) -> bool:
        """Whether server ``index``'s process is running now."""
        return self.servers[index].process.poll() is None

    def close(self) -> None:
        """Stops every server (SIGTERM, grace, SIGKILL) and the relauncher. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=self._ready_timeout + 2 * self._grace + 5)
        with self._lock:
            for server in self.servers:
                _process.stop(server.process, self._grace)
        _OPEN.discard(self)

    def __enter__(self) -> LaunchedServers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{sum(map(self.alive, range(len(self.servers))))} up"
        return f"LaunchedServers({self.addresses}, {state})"

    def _supervise(self) -> None:
        while not self._closing.wait(0.05):
            for server in self.servers:
                if server.index in self._given_up or server.process.poll() is None:
                    continue
                if self._closing.is_set():
                    return
                self._relaunch(server)

    def _relaunch(self, server: LaunchedServer) -> None:
        assert self._policy is not None
        died, started = time.time(), time.monotonic()
        reason = f"{_exit_text(server.process.returncode)}; last output: {_process.tail(server.log_path, 300)!r}"
        attempts, outcome = 0, "gave up"
        record = Relaunch(server.index, server.address, reason, died, 0.0, 0, "relaunching")
        self.relaunches.append(record)
        while attempts < self._policy.attempts and not self._closing.is_set():
            if attempts:
                pause = min(self._policy.max_backoff, self._policy.backoff * 2 ** (attempts - 1))
                if self._closing.wait(pause):
                    break
            attempts += 1
            try:
                with self._lock:
                    if self._closing.is_set():
                        break
                    host, _, port = server.address.rpartition(":")
                    _process.check_port_free(host, int(port))
                    server.process = _start(server.command, server.log_path, self._options)
            except errors.ServerLaunchError as exc:
                reason += f"; start {attempts}: {exc}"
                continue
            error = _process.wait_ready(
                server.process, server.address, self._ready_timeout, **self._probe
            )
            if error is None:
                outcome = "relaunched"
                break
            _process.stop(server.process, self._grace)
            reason += f"; start {attempts}: {_why(error, server)}"
        if outcome != "relaunched":
            self._given_up.add(server.index)
        record.reason, record.attempts = reason, attempts
        record.downtime = time.monotonic() - started
        record.outcome = outcome  # last: a reader that sees the outcome sees the rest


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _why(error: BaseException, server: LaunchedServer) -> str:
    if isinstance(error, ChildProcessError):
        return _exit_text(server.process.returncode)
    return f"no answer ({error})"


def _start(
    words: list[str], log_path: str, options: tuple[Mapping[str, str] | None, str | None, float]
) -> subprocess.Popen[bytes]:
    environment, cwd, grace = options
    with open(log_path, "ab") as log:
        return _process.start(words, log, environment, cwd, grace)


@_checks.keywords_checked
def launch(
    command: str | Sequence[str],
    num_servers: int = 1,
    *,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    ready_timeout: float = 60.0,
    grace: float = 5.0,
    log_dir: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    relaunch: RelaunchPolicy | None = RelaunchPolicy(),  # noqa: B008 (an immutable tuple)
    token: str | None = None,
    credentials: grpc.ChannelCredentials | Callable[[], grpc.ChannelCredentials] | None = None,
) -> LaunchedServers:
    """Starts ``num_servers`` copies of ``command`` and waits until each answers.

    Args:
      command: a command template, as one string (split like a shell would) or
        a list of words; ``{port}`` is required, ``{host}`` is optional.
      num_servers: how many servers.
      host: the host the servers listen on and are reached at (loopback by default).
      ports: one port per server; default free ports picked by the kernel.
      ready_timeout: seconds each server has to start answering.
      grace: seconds between SIGTERM and SIGKILL when stopping a server.
      log_dir: the folder of the log files (``server-<i>.log``); default a new
        temporary folder, kept after the servers stop.
      env: environment variables added to this process's for the servers.
      cwd: the servers' working directory.
      relaunch: the bounds of relaunching a server that exits; None never relaunches.
      token: a shared token the servers require: each gets it in the environment
        variable ``DMR_TOKEN`` (``dmr.TOKEN_ENV``), never in its command line; the
        readiness probe sends it. None sends none.
      credentials: channel credentials for servers that serve TLS (a client
        certificate in them for mutual TLS), or a function that makes them (so
        that they travel to Ray actors); the readiness probe uses them.

    Returns:
      The running servers (use as a context manager, or call ``close()``).

    Raises:
      ArgumentTypeError: a command that is neither a string nor a list, a misspelled
        keyword, or a count or seconds of the wrong type.
      ArgumentValueError: ``{port}`` missing, an empty command, ``num_servers`` below 1,
        ``ports`` not one per server, seconds not above 0, or a token that cannot
        travel as gRPC metadata.
      ServerLaunchError: a program that does not exist, a port already taken, a
        server that exited while starting or did not answer in time (naming the
        command, exit code, output tail and log file). Nothing is left running.
    """
    _checks.check_type(
        command, (str, list, tuple), "command", "a command template: a string or a list of words"
    )
    if isinstance(num_servers, int) and not isinstance(num_servers, bool) and num_servers < 1:
        raise errors.ArgumentValueError(_NO_SERVERS.format(count=num_servers))
    _checks.check_count(num_servers, "num_servers")
    _checks.check_seconds(ready_timeout, "ready_timeout", allow_none=False)
    _checks.check_seconds(grace, "grace", allow_none=False)
    if ports is not None and len(ports) != num_servers:
        raise errors.ArgumentValueError(_PORTS_COUNT.format(ports=len(ports), count=num_servers))
    _process.command_line(command, host, 0)  # checks the template before anything starts
    for port in ports or ():
        _process.check_port_free(host, port)
    folder = log_dir or tempfile.mkdtemp(prefix="dm_env_rpc_client-launch-")
    os.makedirs(folder, exist_ok=True)
    probe: dict[str, Any] = {}
    if token is not None:
        env = {**(env or {}), _tokens.TOKEN_ENV: _tokens.check_token(token)}
        probe["metadata"] = _tokens.token_metadata(token)
    if credentials is not None:
        probe["credentials"] = (
            credentials if isinstance(credentials, grpc.ChannelCredentials) else credentials()
        )
    _catch_sigterm()
    options = (env, cwd, grace)
    started: list[LaunchedServer] = []
    try:
        for index in range(num_servers):
            port = ports[index] if ports is not None else _process.free_port(host)
            while ports is None and any(s.address.endswith(f":{port}") for s in started):
                port = _process.free_port(host)  # the kernel may hand a port out again
            words = _process.command_line(command, host, port)
            log_path = os.path.join(folder, f"server-{index}.log")
            process = _start(words, log_path, options)
            started.append(LaunchedServer(index, words, f"{host}:{port}", log_path, process))
        deadline = time.monotonic() + ready_timeout
        for server in started:
            remaining = max(0.0, deadline - time.monotonic())
            error = _process.wait_ready(server.process, server.address, remaining, **probe)
            if error is not None:
                raise _launch_error(server, error, ready_timeout, grace)
    except BaseException:
        for server in started:
            _process.stop(server.process, grace)
        raise
    return LaunchedServers(
        started,
        grace=grace,
        ready_timeout=ready_timeout,
        relaunch=relaunch,
        options=options,
        probe=probe,
    )


def _launch_error(
    server: LaunchedServer, error: BaseException, timeout: float, grace: float
) -> errors.ServerLaunchError:
    command = shlex.join(server.command)
    if isinstance(error, ChildProcessError):
        code = server.process.returncode
        return errors.ServerLaunchError(
            _EXITED.format(
                index=server.index,
                command=command,
                code=code,
                tail=_process.tail(server.log_path),
                log=server.log_path,
            )
        )
    code = _process.stop(server.process, grace)
    return errors.ServerLaunchError(
        _NOT_READY.format(
            index=server.index,
            command=command,
            address=server.address,
            timeout=timeout,
            error=" ".join(str(error).split()),
            code=code,
            tail=_process.tail(server.log_path),
            log=server.log_path,
        )
    )


# --- stopping at exit and on SIGTERM -------------------------------------------------------

_OPEN: weakref.WeakSet[LaunchedServers] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for servers in list(_OPEN):
        servers.close()


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _catch_sigterm() -> None:
    """SIGTERM exits through ``SystemExit`` (so ``with`` blocks and atexit stop the servers)
    where nothing else handles it; only the main thread can set a handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
