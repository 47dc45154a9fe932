"""The ``dm-env-rpc-client`` command line (also ``python -m dm_env_rpc_client``).

Commands:

- ``run``: random actions over one or more worlds, pipelined (``dmr.collect``); no ``--address``:
  it starts the embedded Catch server, in a child process sized for the worlds (``--in-process``:
  in this one), or ``--launch "CMD {port}" --num-servers K`` servers (``dmr.launch``). Prints a
  summary (``--json``: JSON): steps, episodes, returns, steps/s, latency, seeds, recording,
  relaunches. ``--ray [auto|ADDRESS|local] --num-shards K``: K Ray actors step the worlds.
  ``--watch``: a live page of the run (``_cli.watch``).
- ``specs ADDRESS``: prints the action and observation specs of a world, by name.
- ``check ADDRESS``: checks a server against the protocol (``_cli.check``); 0 if it conforms.
- ``serve``: serves Catch, or your own environment factory, until Ctrl-C
  (the same program as ``python -m dm_env_rpc_client.server``).

Tokens: ``--token-file FILE``, ``--token`` or ``DMR_TOKEN`` (``--launch``: in ``DMR_TOKEN``).

Before connecting, ``run`` and ``specs`` check each address: a host that does not resolve, or
a port that refuses connections, fails at once saying so; a remote host needs ``--insecure`` or TLS.

Exit codes: 0 success; 1 an error, printed as one paragraph (``--debug`` for
the traceback and gRPC's own log lines); 2 bad arguments; 3 ``run`` lost a world
(it could not be restored); 130 Ctrl-C (``run`` prints its summary first; 143
when SIGTERM stops ``run``, likewise).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.metadata
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from . import errors, specs
from ._base.cli_args import (
    SETTING_HELP,
    UsageError,
    check_no_url_scheme,
    launch_flags,
    parse_setting,
    positive_float,
    positive_int,
    token_flags,
)
from ._base.cli_args import channel_kwargs as _channel_kwargs
from ._base.quiet import quiet_grpc_logs
from ._base.signals import set_from_handler
from ._cli import record as _record_cli
from ._cli import watch as _watch_cli
from ._cli.check import add_check_command
from ._cli.rllink import add_rllib_flags
from ._cli.run import launched, print_summary
from .batched import BatchedEnvironment
from .connection import connect, is_local
from .environment import create_and_join_world, join_world, specs_table
from .recording import prepare_folder
from .server import serve
from .server._subprocess import server_subprocess
from .server.catch import Catch
from .stepping import RunStats, collect

INTERRUPTED = 130
WORLD_LOST = 3  # run finished, but a world failed and could not be restored
TERMINATED = 143  # 128 + SIGTERM, as a shell reports it
DEFAULT_TIMEOUT = 30.0
EMBEDDED_MIN_WORKERS = 64  # the embedded server serves at least this many worlds at once
_PROBE_TIMEOUT = 5.0  # seconds for the address checks (resolve, then a TCP connect)

_BAD_ADDRESS = "The address {address!r} is not host:port (e.g. 127.0.0.1:50051) or unix:PATH."
_NO_RESOLVE = "The host {host!r} of {address} does not resolve ({error}); check the name."
_SLOW_RESOLVE = "The host {host!r} of {address} did not resolve within {timeout} s."
_REFUSED = (
    "Nothing accepts connections at {address} (connection refused). Start the server there, "
    "or check the host and port."
)
_PLAINTEXT = (
    "{address} is a remote host: pass --insecure to talk to it in plaintext, or --tls / "
    "--root-certificates PEM to use TLS."
)
_SEED_TWICE = (
    "--create-setting {name}=... and --seed both set the world's seed: use --seed "
    "(world i gets seed + i), or pass --seed-setting '' to keep your own."
)
_WORLD_COUNT = (
    "--world names {names} worlds but --num-envs asks for {count}; give one name per world."
)
_WORLD_CREATE = "--world joins existing worlds: --create-setting does not apply to them."
_ARGV = "argv is a list of arguments, not the string {argv!r}: pass {split!r}."
_IN_PROCESS = (
    "--in-process starts the embedded server in this process, and --address names servers "
    "that run already: give one or the other."
)


def _settings(pairs: Sequence[tuple[str, Any]] | None) -> dict[str, Any]:
    return specs.unflatten(dict(pairs or ()))


def _record_folder(text: str) -> str:
    """argparse type for --record: an empty or new folder, created now."""
    try:
        prepare_folder(text)
    except errors.RecordingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# --- connecting -------------------------------------------------------------------------


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a host:port address; None for other gRPC targets (unix:, dns:///...)."""
    check_no_url_scheme(address)
    schemes = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")
    if "://" in address or address.startswith(schemes):
        return None
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UsageError(_BAD_ADDRESS.format(address=address))
    return host.strip("[]"), int(port_text)


def check_address(address: str, kwargs: dict[str, Any], timeout: float, quiet: bool) -> None:
    """Fails fast on an address that cannot work; see the module docs.

    Raises:
      UsageError: not host:port, or plaintext to a remote host without --insecure.
      DmEnvRpcConnectionError: the host does not resolve, or the port refuses.
    """
    target = _host_port(address)
    if target is None:
        return
    host, port = target
    probe_timeout = min(timeout, _PROBE_TIMEOUT)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dm_env_rpc_client-resolve")
    try:  # getaddrinfo has no timeout of its own
        found = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        infos = found.result(timeout=probe_timeout)
    except socket.gaierror as exc:
        raise errors.DmEnvRpcConnectionError(
            _NO_RESOLVE.format(host=host, address=address, error=exc.strerror)
        ) from exc
    except concurrent.futures.TimeoutError:
        raise errors.DmEnvRpcConnectionError(
            _SLOW_RESOLVE.format(host=host, address=address, timeout=probe_timeout)
        ) from None
    finally:
        pool.shutdown(wait=False)
    if kwargs["credentials"] is None and not kwargs["insecure"] and not is_local(address):
        raise UsageError(_PLAINTEXT.format(address=address))
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.settimeout(probe_timeout)
        try:
            probe.connect(sockaddr)
        except ConnectionRefusedError as exc:
            raise errors.DmEnvRpcConnectionError(_REFUSED.format(address=address)) from exc
        except OSError:
            pass  # unreachable or slow: gRPC waits for it, up to the timeout
    if not quiet:
        print(f"Connecting to {address} (waiting up to {timeout:g} s)...", file=sys.stderr)


@contextlib.contextmanager
def _addresses(args: argparse.Namespace, kwargs: dict[str, Any]) -> Iterator[list[str]]:
    if args.address:
        for address in dict.fromkeys(args.address):
            check_address(address, kwargs, args.timeout, args.quiet or args.json)
        yield list(args.address)
        return
    workers = max(EMBEDDED_MIN_WORKERS, args.num_envs)
    if args.in_process:
        with serve(lambda settings: Catch(**settings), max_workers=workers) as server:
            yield [server.address]
        return
    # A child process: the server gets a core (and a GIL) of its own, about twice the steps/s.
    with server_subprocess("catch", max_workers=workers) as server:
        yield [server.address]


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[tuple[threading.Event, list[int]]]:
    """Ctrl-C and SIGTERM set the event instead of ending us: the loop ends between steps.
    Yields the event and the list of the signals received."""
    stop, received = threading.Event(), list[int]()
    if threading.current_thread() is not threading.main_thread():
        yield stop, received  # signals reach the main thread only: they act as usual
        return

    def handler(signum: int, _: object) -> None:
        received.append(signum)
        set_from_handler(stop)  # (stop.set() here may deadlock: _base.signals)

    previous = {
        signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield stop, received
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def run(args: argparse.Namespace) -> int:
    """The ``run`` command; returns 130 after Ctrl-C, 143 after SIGTERM (summary printed)."""
    from tqdm.auto import tqdm

    kwargs = _channel_kwargs(args)
    seed_setting = args.seed_setting or None
    create_settings = _settings(args.create_setting)
    if seed_setting is not None and seed_setting in create_settings and not args.world:
        raise UsageError(_SEED_TWICE.format(name=seed_setting))
    if args.ray is not None:  # sharded on Ray: needs the ray extra, so imported only here
        from .integrations.ray._cli import ray_first, run_on_ray

        with ray_first(args):  # before any gRPC thread of this process: see ray_first
            for address in dict.fromkeys(args.address or ()):
                check_address(address, kwargs, args.timeout, args.quiet or args.json)
            with (
                _stop_on_signals() as (stop, received),
                tqdm(total=args.steps, unit="step", disable=args.quiet or args.json) as progress,
            ):
                shard_args = (args, kwargs, create_settings, run_on_ray, stop, progress)
                stats = _record_cli.sharded(*shard_args)
        report(stats, args)
        return _exit_code(stats, received)
    with launched(args) or _addresses(args, kwargs) as addresses:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = BatchedEnvironment.connect(
                addresses,
                args.num_envs,
                create_world_settings=create_settings,
                join_world_settings=_settings(args.join_setting),
                timeout=args.timeout,
                seed=args.seed,
                seed_setting=seed_setting,
                world_names=args.world,
                on_world_failure=args.on_failure,
                step_timeout=args.timeout,
                max_streams_per_connection=args.max_streams_per_connection,
                **kwargs,
            )
        for warning in caught:  # e.g. a server that takes no seed setting
            print(f"note: {warning.message}", file=sys.stderr)
        failed = True
        try:
            recording = _record_cli.open_recording(args, batch, create_settings)
            with (
                _stop_on_signals() as (stop, received),
                tqdm(total=args.steps, unit="step", disable=args.quiet or args.json) as progress,
                _watch_cli.watching(args, stop) as observers,
            ):
                try:
                    stats = collect(
                        batch,
                        args.steps,
                        pipeline=args.pipeline,
                        timeout=args.timeout,
                        seed=args.seed,
                        record=recording,
                        stop=stop,
                        progress=progress.update,
                        observers=observers,
                    )
                finally:
                    if recording is not None:
                        recording.close()  # unfinished episodes are saved, marked truncated
            failed = False
        finally:
            # After a failure the worlds may be stuck: give up on them quickly.
            batch.close(timeout=min(1.0, args.timeout) if failed else args.timeout)
    if recording is not None:
        stats.recorded = args.record
        stats.recorded_episodes, stats.recorded_truncated = recording.episodes, recording.truncated
    report(stats, args)
    return _exit_code(stats, received)


def _exit_code(stats: RunStats, received: list[int]) -> int:
    """0; 130 after Ctrl-C or 143 after SIGTERM; 3 when a world was lost for good."""
    if stats.interrupted:
        return TERMINATED if signal.SIGTERM in received else INTERRUPTED
    return WORLD_LOST if stats.worlds_lost else 0


def report(stats: RunStats, args: argparse.Namespace) -> None:
    """Prints the run's summary (the one place that does; restarts and shards report here)."""
    print_summary(stats, as_json=args.json)


def show_specs(args: argparse.Namespace) -> int:
    """The ``specs`` command: tables of the actions and observations, sorted by name."""
    kwargs = _channel_kwargs(args)
    check_address(args.address, kwargs, args.timeout, quiet=True)
    with connect(args.address, timeout=args.timeout, **kwargs) as conn:
        if args.world:
            env = join_world(conn, args.world, _settings(args.join_setting), timeout=args.timeout)
        else:
            env, _ = create_and_join_world(
                conn,
                _settings(args.create_setting),
                _settings(args.join_setting),
                timeout=args.timeout,
            )
        try:
            for title, manager in (
                ("actions", env.action_manager),
                ("observations", env.observation_manager),
            ):
                print(_table(title, sorted(specs_table(manager))))
        finally:
            env.close()
    return 0


def _table(title: str, rows: list[tuple[Any, ...]]) -> str:
    header = ("name", "uid", "dtype", "shape", "bounds")
    cells = [header] + [tuple(str(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title]
    for index, row in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


# --- arguments --------------------------------------------------------------------------


def _version() -> str:
    try:
        return importlib.metadata.version("dm_env_rpc_client")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _connection_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection (remote servers)")
    group.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for a server, and for any step (default: {DEFAULT_TIMEOUT:g})",
    )
    group.add_argument("--insecure", action="store_true", help="plaintext to a remote host")
    group.add_argument("--tls", action="store_true", help="TLS, trusting the system's roots")
    group.add_argument(
        "--root-certificates", metavar="PEM", help="TLS, trusting the CA certificates in PEM"
    )
    group.add_argument("--certificate", metavar="PEM", help="mutual TLS: client certificate chain")
    group.add_argument("--private-key", metavar="PEM", help="mutual TLS: client private key")
    group.add_argument(
        "--server-name", metavar="NAME", help="TLS: the name the server's certificate holds"
    )
    token_flags(group, "send")


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    for flag, what in (("--create-setting", "CreateWorld"), ("--join-setting", "JoinWorld")):
        parser.add_argument(
            flag,
            action="append",
            type=parse_setting,
            default=[],
            metavar="KEY=VALUE",
            help=f"a {what} setting: {SETTING_HELP}",
        )


def build_parser() -> argparse.ArgumentParser:
    """The command line's arguments."""
    parser = argparse.ArgumentParser(
        prog="dm-env-rpc-client", description="Drive dm_env_rpc environments."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and gRPC's log lines")
    commands = parser.add_subparsers(dest="command", required=True)

    run_parser = commands.add_parser(
        "run",
        help="random-action stepping over many worlds",
        description="Steps worlds with random actions, pipelined, and prints a summary.",
    )
    run_parser.add_argument(
        "--address", nargs="+", metavar="HOST:PORT", help="servers (default: embedded Catch)"
    )
    run_parser.add_argument(
        "--world", nargs="+", metavar="NAME", help="join these existing worlds, one each"
    )
    run_parser.add_argument(
        "--num-envs", type=positive_int, help="worlds (default: 4, or one per --world name)"
    )
    run_parser.add_argument(
        "--steps", type=positive_int, default=2000, help="total steps (default: 2000)"
    )
    run_parser.add_argument(
        "--pipeline", type=positive_int, default=8, help="steps in flight per world (default: 8)"
    )
    run_parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="world i is created with seed + i, and draws its actions from its own "
        "generator seeded from seed + i (default: 0)",
    )
    run_parser.add_argument(
        "--seed-setting",
        default="seed",
        metavar="NAME",
        help="the create setting that carries the seed; '' to send none (default: seed)",
    )
    _settings_flags(run_parser)
    run_parser.add_argument(
        "--record",
        metavar="DIR",
        type=_record_folder,
        help="record the episodes into DIR, which must be empty or new (see --format)",
    )
    _record_cli.add_flags(run_parser)
    _watch_cli.add_flags(run_parser)
    run_parser.add_argument(
        "--on-failure",
        choices=("restart", "raise"),
        default="restart",
        help="a world whose server dies or stalls: make it again (restart) or stop the run (raise)",
    )
    run_parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    run_parser.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    run_parser.add_argument(
        "--in-process",
        action="store_true",
        help="without --address: run the embedded server in this process, not a child process",
    )
    run_parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="auto|ADDRESS|local",
        help="shard the worlds over Ray actors: 'local' (the default) starts a Ray of this "
        "machine, 'auto' or ADDRESS joins a cluster (needs the ray extra)",
    )
    run_parser.add_argument(
        "--num-shards",
        type=positive_int,
        default=2,
        help="with --ray: shard actors, each stepping its share of the worlds (default: 2)",
    )
    add_rllib_flags(run_parser, _addresses, _stop_on_signals, _channel_kwargs)
    launch_flags(run_parser)
    _connection_flags(run_parser)
    run_parser.set_defaults(handler=run)

    specs_parser = commands.add_parser(
        "specs",
        help="print the specs of a world",
        description="Creates (or joins) a world and prints its specs, sorted by name.",
    )
    specs_parser.add_argument("address", metavar="HOST:PORT", help="the server")
    specs_parser.add_argument("--world", metavar="NAME", help="join this existing world")
    _settings_flags(specs_parser)
    _connection_flags(specs_parser)
    specs_parser.set_defaults(handler=show_specs)

    add_check_command(commands, _connection_flags, _settings_flags, _channel_kwargs, check_address)
    # Imported here, not at module level: `python -m dm_env_rpc_client.server` must not find
    # its __main__ already imported by the package.
    from .server import __main__ as server_main

    serve_parser = commands.add_parser(
        "serve", help="serve Catch or your own environment", description=server_main.DESCRIPTION
    )
    server_main.build_parser(serve_parser)
    serve_parser.set_defaults(handler=lambda a: server_main.serve_command(serve_parser, a))
    for sub in (run_parser, specs_parser):
        sub.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    parser.set_defaults(parsers={"run": run_parser, "specs": specs_parser})
    return parser


def _check_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.in_process and args.address:
        parser.error(_IN_PROCESS)
    if args.world:
        if args.num_envs is not None and args.num_envs != len(args.world):
            parser.error(_WORLD_COUNT.format(names=len(args.world), count=args.num_envs))
        if args.create_setting:
            parser.error(_WORLD_CREATE)
        args.num_envs = len(args.world)
    elif args.num_envs is None:
        args.num_envs = 4


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; ``argv`` None reads ``sys.argv`` (the program).

    The program silences gRPC's C-core log lines (not with ``--debug``) until this
    returns, then puts the environment and standard error back (``_base.quiet``);
    called with a list, nothing is silenced. Returns the exit code (see the module docs).

    Raises:
      ArgumentTypeError: ``argv`` is a string.
    """
    if isinstance(argv, str):
        raise errors.ArgumentTypeError(_ARGV.format(argv=argv, split=argv.split()))
    with quiet_grpc_logs(sys.argv[1:]) if argv is None else contextlib.nullcontext(False):
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "run":
            _check_run(args.parsers["run"], args)
        try:
            code = int(args.handler(args))
            sys.stdout.flush()  # a closed pipe fails here, not at exit
            return code
        except UsageError as exc:
            print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("Interrupted.", file=sys.stderr)
            return INTERRUPTED
        except BrokenPipeError:
            # The reader went away (`specs ... | head`): say nothing more. The program's stdout
            # becomes /dev/null (its flush at exit would fail again); a caller's is left alone.
            if argv is None:
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except (errors.DmEnvRpcClientError, OSError, ValueError, TypeError) as exc:
            if args.debug:
                raise
            message = " ".join(str(exc).split())
            print(f"error: {type(exc).__name__}: {message}", file=sys.stderr)
            print("Run again with --debug for the traceback.", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
