"""argparse value types and checks shared by the command line programs.

Each type raises ``argparse.ArgumentTypeError`` with a message that says what
a good value looks like; argparse names the flag and exits with code 2.
Checks made after parsing raise ``UsageError``, which the programs print as
one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import grpc

_BAD_FILE = "cannot read the {flag} file ({error}); give a readable PEM file."
_TLS_AND_INSECURE = "--insecure and the TLS flags contradict each other; give one or the other."
_KEY_PAIR = "--certificate and --private-key go together (client certificate for mutual TLS)."
_SCHEME = (
    "--address {address!r} has a URL scheme: gRPC addresses have none. Give {bare!r}; for "
    "TLS add --tls (or --root-certificates PEM), for plaintext to a remote host --insecure."
)

SETTING_HELP = (
    "KEY=VALUE; repeat the flag for more. Values parse as int, float, true/false, "
    "else a string; dotted keys nest (arm.speed=2 gives {'arm': {'speed': 2}})"
)


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    """A number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0 picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a whole number, not {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (0 picks a free one), not {value}")
    return value


def parse_setting(text: str) -> tuple[str, Any]:
    """``key=value``: ints, floats, true/false, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"settings look like key=value, not {text!r}")
    value: Any = raw
    lowered = raw.lower()
    if lowered in ("true", "false"):
        value = lowered == "true"
    else:
        for convert in (int, float):
            try:
                value = convert(raw)
                break
            except ValueError:
                continue
    return key, value


class UsageError(Exception):
    """A bad flag value or combination found after parsing: one line, exit code 2."""


def check_no_url_scheme(address: str) -> None:
    """Refuses ``http://host:port`` and its kind (``https``, ``grpc``, ``grpcs``, ``tcp``).

    Raises:
      UsageError: naming the address, the address without the scheme, and the TLS flags.
    """
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() in ("http", "https", "grpc", "grpcs", "tcp"):
        raise UsageError(_SCHEME.format(address=address, bare=rest.rstrip("/")))


def read_pem(path: str | None, flag: str) -> bytes | None:
    """The bytes of the PEM file given to ``flag`` (None when not given).

    Raises:
      UsageError: the file cannot be read; names the flag.
    """
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise UsageError(_BAD_FILE.format(flag=flag, error=exc)) from exc


def tls_credentials(args: argparse.Namespace) -> Callable[[], grpc.ChannelCredentials] | None:
    """The TLS flags (``--tls``, ``--root-certificates``, ``--certificate``, ``--private-key``)
    as a function that makes the channel credentials; None without them.

    A function, not the credentials, so that it pickles (a Ray shard calls it).

    Raises:
      UsageError: a PEM file cannot be read; names the flag.
    """
    if not (args.tls or args.root_certificates or args.certificate or args.private_key):
        return None
    return functools.partial(
        grpc.ssl_channel_credentials,
        root_certificates=read_pem(args.root_certificates, "--root-certificates"),
        private_key=read_pem(args.private_key, "--private-key"),
        certificate_chain=read_pem(args.certificate, "--certificate"),
    )


def launch_flags(parser: argparse.ArgumentParser) -> None:
    """The ``run`` command's server flags: ``--launch COMMAND`` and ``--num-servers K`` (its
    launched servers), ``--max-streams-per-connection N`` (``BatchedEnvironment.connect``'s)."""
    parser.add_argument(
        "--max-streams-per-connection",
        type=positive_int,
        metavar="N",
        help="worlds on one HTTP/2 connection; more get more connections (default: "
        "BatchedEnvironment.connect's, 100, the stream limit of many proxies)",
    )
    parser.add_argument(
        "--launch",
        metavar="COMMAND",
        help="start the servers: a command with {port} in it, e.g. 'my_player --port {port}' "
        "(relaunched if they die; with --ray, each shard launches its own)",
    )
    parser.add_argument(
        "--num-servers",
        type=positive_int,
        metavar="K",
        help="with --launch: how many servers (per shard with --ray; default 1)",
    )


def check_launch_flags(args: argparse.Namespace) -> None:
    """Raises ``UsageError`` for launch flags that do not go together."""
    if args.launch and args.address:
        raise UsageError("give --launch or --address, not both")
    if args.num_servers is not None and not args.launch:
        raise UsageError("--num-servers goes with --launch")


def token_flags(parser: Any, side: str) -> None:
    """``--token`` and ``--token-file`` on ``parser`` (a parser or an argument group);
    ``side``: what the token does there ("require" for a server, "send" for a client)."""
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"{side} the shared token in FILE (default: the DMR_TOKEN environment variable)",
    )
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help=f"{side} this shared token (other users see it in ps: prefer --token-file)",
    )


def token(args: argparse.Namespace) -> str | None:
    """The token of ``--token``, ``--token-file`` or ``DMR_TOKEN`` (None without any).

    Raises:
      UsageError: both flags, an unreadable or empty file, or a token that is not
        printable ASCII without spaces (the token is not shown).
    """
    from .tokens import resolve_token

    try:
        return resolve_token(args.token, args.token_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def token_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...] | None:
    """The metadata that sends ``token(args)`` (None without a token).

    Raises:
      UsageError: as ``token``.
    """
    from .tokens import token_metadata as metadata

    sent = token(args)
    return None if sent is None else metadata(sent)


def channel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``credentials`` / ``insecure`` / ``options`` / ``metadata`` for the SDK, from the TLS
    flags and the token (``--token``, ``--token-file``, ``DMR_TOKEN``).

    Raises:
      UsageError: TLS flags with ``--insecure``, half a client key pair, an unreadable
        PEM file, or a token that cannot be used.
    """
    tls = bool(args.tls or args.root_certificates or args.certificate or args.private_key)
    if tls and args.insecure:
        raise UsageError(_TLS_AND_INSECURE)
    if (args.certificate is None) != (args.private_key is None):
        raise UsageError(_KEY_PAIR)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    make_credentials = tls_credentials(args)
    return {
        "credentials": None if make_credentials is None else make_credentials(),
        "insecure": args.insecure,
        "options": options or None,
        "metadata": token_metadata(args),
    }
