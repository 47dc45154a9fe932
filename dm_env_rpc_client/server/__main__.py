"""python -m dm_env_rpc_client.server: serve an environment over dm_env_rpc until stopped.

Serves the built-in Catch game (``--env catch``), the multi-agent Paddles game
(``--game paddles``; ``--game`` is another name of ``--env``), one large float32
observation (``--env large --size N``), or your own ``dm_env.Environment`` (or
``MultiAgentEnvironment``) factory (``--env package.module:factory``, called as ``factory(settings)``
with each CreateWorldRequest's settings as a nested dict; a class is called
with the settings as keyword arguments). Before serving it
makes one environment with no settings, to refuse flags the environment
rejects (``--skip-check`` for a factory that needs settings).

Strangers kept out: ``--token-file FILE`` (or ``--token``, or the ``DMR_TOKEN``
environment variable) makes every stream carry that token; ``--client-ca CA``
with ``--certificate``/``--private-key`` admits only clients with a certificate
CA signed (mutual TLS).

Prints one line, ``Serving <env> on <host:port>``, then serves until Ctrl-C
(exit code 130) or SIGTERM (exit code 0). Errors print one line and exit with 1
(2 for bad flags); ``--debug`` shows tracebacks and gRPC's own log lines.
``dm-env-rpc-client serve`` is the same program.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import dm_env
import grpc

from .._base.cli_args import (
    UsageError,
    port,
    positive_float,
    positive_int,
    read_pem,
    token,
    token_flags,
)
from .._base.quiet import quiet_grpc_logs
from .._base.signals import set_from_handler
from . import _factory, serve
from ._registry import DEFAULT_AGENT_TIMEOUT
from .catch import Catch
from .envs import LargeObservation
from .multiagent import MultiAgentEnvironment
from .paddles import Paddles

ENVS: dict[str, Callable[..., dm_env.Environment | MultiAgentEnvironment]] = {
    "catch": Catch,
    "large": LargeObservation,
    "paddles": Paddles,
}
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 0
DEFAULT_MAX_WORKERS = 64
INTERRUPTED = 130
DESCRIPTION = " ".join((__doc__ or "").split("\n\n")[1].replace("``", "").split())

_BAD_ENV = "{text!r} is neither a built-in environment ({names}) nor package.module:factory"
_NO_FACTORY = "cannot load the factory {text!r}: {error}"
_BAD_FLAGS = (
    "the {env} environment refused its flags ({error}). Fix the flags, "
    "or pass --skip-check if the factory needs settings that only clients give."
)
_SIZE_ONLY_LARGE = "--size applies to --env large only"
_TLS_PAIR = "--certificate and --private-key go together (PEM files); give both or neither"
_CLIENT_CA_NEEDS_TLS = "--client-ca needs --certificate and --private-key"


def env_name(text: str) -> str:
    """An argparse type: a built-in environment name, or an importable package.module:factory."""
    if text in ENVS:
        return text
    module, sep, attribute = text.partition(":")
    if not sep or not module or not attribute:
        raise argparse.ArgumentTypeError(_BAD_ENV.format(text=text, names=", ".join(sorted(ENVS))))
    try:
        factory = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(_NO_FACTORY.format(text=text, error=exc)) from None
    if not callable(factory):
        raise argparse.ArgumentTypeError(_NO_FACTORY.format(text=text, error="not callable"))
    return text


def make_factory(name: str, defaults: dict[str, Any]) -> Callable[[dict[str, Any]], Any]:
    """Returns ``make_env(settings)`` for a built-in name (with command-line defaults) or a factory."""
    if name in ENVS:
        env_class = ENVS[name]

        def make_env(settings: dict[str, Any]) -> dm_env.Environment | MultiAgentEnvironment:
            return env_class(**{**defaults, **settings})

        return make_env
    module, _, attribute = name.partition(":")
    # A class gets the settings as keyword arguments, as serve() gives them.
    return _factory(getattr(importlib.import_module(module), attribute))


def _credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    key = read_pem(args.private_key, "--private-key")
    chain = read_pem(args.certificate, "--certificate")
    client_ca = read_pem(args.client_ca, "--client-ca")
    if key is None or chain is None:
        return None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _watch_parent(stop: Callable[[], None]) -> None:
    """Calls ``stop`` when standard input ends: the parent that holds its other end died."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        stop()

    threading.Thread(target=watch, name="dm_env_rpc_server-parent", daemon=True).start()


def _say(line: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # nobody reads our output any more
        print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    """Serves until SIGINT (returns 130) or SIGTERM (returns 0), as the module docs say."""
    defaults = {} if args.size is None else {"size": args.size}
    make_env = make_factory(args.env, defaults)
    if not args.skip_check:
        try:
            make_env({}).close()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise UsageError(_BAD_FLAGS.format(env=args.env, error=error)) from exc
    credentials = _credentials(args)
    required = token(args)
    stop = threading.Event()
    code = [0]

    def stop_with(exit_code: int) -> Callable[..., None]:
        def handler(*_: object) -> None:
            code[0] = exit_code
            set_from_handler(stop)  # (stop.set() here may deadlock: _base.signals)

        return handler

    signal.signal(signal.SIGTERM, stop_with(0))
    if args.exit_with_parent:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C, then ends us
        _watch_parent(stop_with(0))
    else:
        signal.signal(signal.SIGINT, stop_with(INTERRUPTED))
    address = f"{args.host}:{args.port}"
    with serve(
        make_env,
        address,
        credentials=credentials,
        max_workers=args.max_workers,
        agent_timeout=args.agent_timeout,
        token=required,
    ) as server:
        mutual = args.client_ca is not None
        tls = " (mutual TLS)" if mutual else " (TLS)" if credentials is not None else ""
        _say(f"Serving {args.env} on {server.address}{tls}{' (token)' if required else ''}")
        while not stop.wait(0.5):
            pass
    _say("Stopped.")
    return code[0]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The arguments of the serve program (shared with ``dm-env-rpc-client serve``)."""
    parser = parser or argparse.ArgumentParser(
        prog="python -m dm_env_rpc_client.server",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--env",
        "--game",
        dest="env",
        type=env_name,
        default="catch",
        help="catch, paddles (multi-agent), large, or package.module:factory (default: catch)",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"interface (default: {DEFAULT_HOST})")
    parser.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help="0 to 65535; 0 picks a free port (default: 0)",
    )
    parser.add_argument(
        "--size", type=positive_int, default=None, help="observation size, --env large only"
    )
    parser.add_argument(
        "--max-workers",
        type=positive_int,
        default=DEFAULT_MAX_WORKERS,
        help=f"most streams (worlds) served at once (default: {DEFAULT_MAX_WORKERS})",
    )
    parser.add_argument(
        "--agent-timeout",
        type=positive_float,
        default=DEFAULT_AGENT_TIMEOUT,
        metavar="SECONDS",
        help="multi-agent worlds: how long a step waits for the other agents (or its turn) "
        f"before it is refused, naming them (default: {DEFAULT_AGENT_TIMEOUT:g})",
    )
    parser.add_argument("--certificate", metavar="PEM", help="serve TLS: certificate chain file")
    parser.add_argument("--private-key", metavar="PEM", help="serve TLS: private key file")
    parser.add_argument(
        "--client-ca",
        metavar="PEM",
        help="mutual TLS: require client certificates signed by this CA",
    )
    token_flags(parser, "require")
    parser.add_argument(
        "--skip-check", action="store_true", help="do not make one environment at start"
    )
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks and gRPC's log lines",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses flag combinations argparse cannot express (exits with 2)."""
    if args.size is not None and args.env != "large":
        parser.error(_SIZE_ONLY_LARGE)
    if (args.certificate is None) != (args.private_key is None):
        parser.error(_TLS_PAIR)
    if args.client_ca is not None and args.certificate is None:
        parser.error(_CLIENT_CA_NEEDS_TLS)


def serve_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Checks the flags and serves; errors print one line (exit 2 for flags, else 1)."""
    debug = getattr(args, "debug", False)
    check_args(parser, args)
    try:
        return run(args)
    except UsageError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is in use
        if debug:
            raise
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; with ``argv`` None (the program), gRPC's log lines are silenced too, until
    this returns (the process's environment and standard error are then as they were).

    Args:
      argv: the arguments (without the program's name), or None for ``sys.argv[1:]``.

    Returns:
      The exit code: 130 after Ctrl-C, 0 after SIGTERM, 1 a server error (the port in
      use), 2 bad flags.
    """
    parser = build_parser()
    if argv is not None:
        return serve_command(parser, parser.parse_args(argv))
    with quiet_grpc_logs(sys.argv[1:]):
        return serve_command(parser, parser.parse_args(None))


if __name__ == "__main__":
    sys.exit(main())
