"""Shared tokens: how a client sends one and how a server checks it.

A server that requires a token (``dmr.serve(..., token=)``, ``serve --token-file``,
``ServerFleet(token=)``, ``dmr.launch(token=)``) refuses every stream whose gRPC
metadata lacks ``authorization: Bearer <token>`` (HTTP's header, which proxies
and gRPC tooling know) with UNAUTHENTICATED, and a message that says what is
missing. A wrong token is told it is wrong; no message repeats a token.
Tokens are compared in constant time (the SHA-256 digests of the two, with
``hmac.compare_digest``, so neither the content nor the length leaks).

A token is printable ASCII without spaces (what gRPC metadata values carry),
at least one character. On the command line it comes from ``--token``, from
``--token-file FILE`` (which ``ps`` does not show), or from the environment
variable ``DMR_TOKEN`` (``TOKEN_ENV``), in that order; launched servers get it
there too, never in their command line::

    metadata = token_metadata("s3cret")       # (("authorization", "Bearer s3cret"),)
    refusal(metadata, "s3cret")               # None: let in
    refusal((), "s3cret")                     # the UNAUTHENTICATED message
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import errors

TOKEN_ENV = "DMR_TOKEN"  # the environment variable of the command line and launched servers
TOKEN_KEY = "authorization"  # the metadata key; its value is "Bearer <token>"
_SCHEME = "bearer"

_NOT_TEXT = "{name} is a string of printable ASCII without spaces, not {kind}."
_BAD_TOKEN = (
    "{name} must be printable ASCII without spaces or line breaks, at least one "
    "character (gRPC metadata carries nothing else); the given one is not (not shown)."
)
_EMPTY_FILE = "The token file {path} is empty: write the token in it (one line)."
_BAD_FILE = "Cannot read the token file {path} ({error}); give a readable file."
MISSING = (
    "This server requires a token, and the request carries none. Send the gRPC metadata "
    "'authorization: Bearer <token>': metadata=dmr.token_metadata(token) in Python, or "
    "--token-file FILE (or the DMR_TOKEN environment variable) on the command line."
)
WRONG = (
    "The token the request carries is not this server's (it is not repeated here). Check "
    "the token the client was given (metadata=dmr.token_metadata(token), --token-file, "
    "or DMR_TOKEN)."
)
NOT_BEARER = (
    "The request's 'authorization' metadata is not 'Bearer <token>' (it is not repeated "
    "here). Send metadata=dmr.token_metadata(token)."
)


def check_token(token: Any, name: str = "token") -> str:
    """``token`` if it can travel as metadata; see the module docs.

    Raises:
      ArgumentTypeError: not a string.
      ArgumentValueError: empty, or not printable ASCII without spaces (the token
        is not shown).
    """
    if not isinstance(token, str):
        raise errors.ArgumentTypeError(_NOT_TEXT.format(name=name, kind=type(token).__name__))
    if not token or not all("!" <= char <= "~" for char in token):
        raise errors.ArgumentValueError(_BAD_TOKEN.format(name=name))
    return token


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries ``token`` to a server that requires it.

    Pass it as ``metadata=`` to ``dmr.connect``, ``dmr.connect_async`` or
    ``BatchedEnvironment.connect`` (or in ``connect_kwargs`` of the Gymnasium
    and Stable-Baselines3 bridges); add your own pairs with ``+``.

    Args:
      token: the server's token.

    Returns:
      ``(("authorization", "Bearer <token>"),)``.

    Raises:
      ArgumentTypeError: ``token`` is not a string.
      ArgumentValueError: ``token`` is empty or not printable ASCII without spaces.
    """
    return ((TOKEN_KEY, f"Bearer {check_token(token)}"),)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in the file at ``path``, without the surrounding whitespace.

    Raises:
      ArgumentValueError: the file cannot be read, is empty, or holds no valid token.
    """
    try:
        with open(path, encoding="ascii") as file:
            token = file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ArgumentValueError(_BAD_FILE.format(path=path, error=exc)) from exc
    if not token:
        raise errors.ArgumentValueError(_EMPTY_FILE.format(path=path))
    return check_token(token, f"the token in {path}")


def resolve_token(
    token: str | None, token_file: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The command line's token: ``--token``, else ``--token-file``, else ``DMR_TOKEN``.

    Raises:
      ArgumentValueError: both flags given, or a token (or file) that cannot be used.
    """
    if token is not None and token_file is not None:
        raise errors.ArgumentValueError("Give --token or --token-file, not both.")
    if token is not None:
        return check_token(token, "--token")
    if token_file is not None:
        return read_token_file(token_file)
    value = (os.environ if environ is None else environ).get(TOKEN_ENV)
    return None if not value else check_token(value.strip(), TOKEN_ENV)


def with_token(
    metadata: Sequence[tuple[str, str]] | None, token: str | None
) -> tuple[tuple[str, str], ...] | None:
    """``metadata`` plus the token's pair (none is added if it has an authorization pair)."""
    if token is None:
        return None if metadata is None else tuple(metadata)
    pairs = tuple(metadata or ())
    if any(key.lower() == TOKEN_KEY for key, _ in pairs):
        return pairs
    return pairs + token_metadata(token)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def refusal(metadata: Iterable[tuple[str, Any]] | None, token: str) -> str | None:
    """None when ``metadata`` carries ``token``; else the UNAUTHENTICATED message.

    Every authorization pair is compared (in constant time), so a proxy's own
    pair in front of the client's does not lock the client out.
    """
    given = [
        value.decode("latin-1") if isinstance(value, bytes) else str(value)
        for key, value in metadata or ()
        if key.lower() == TOKEN_KEY
    ]
    if not given:
        return MISSING
    expected = _digest(token)
    bearer = False
    for value in given:
        scheme, _, sent = value.strip().partition(" ")
        if scheme.lower() != _SCHEME:
            continue
        bearer = True
        if hmac.compare_digest(_digest(sent.strip()), expected):
            return None
    return WRONG if bearer else NOT_BEARER
