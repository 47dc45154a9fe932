"""Whether a server answers: the readiness probe of ``connect`` and ``connect_async``.

A unary call to a method no server has returns as soon as a server answers
anything (UNIMPLEMENTED). Without ``wait_for_ready`` its first attempt fails at
once when the port refuses connections (``ConnectRefusedError``); any other
failure of that attempt (a TLS handshake, a resolver) falls back to waiting, as
``wait_for_ready=True`` does from the start: gRPC retries with backoff until
the server answers or the timeout passes (``ConnectTimeoutError``, which says
when the last attempt was refused). Two failures of the first attempt fail at
once too, as ``AuthenticationError``, since waiting cannot mend them: a TLS
handshake that failed (an untrusted certificate, TLS meeting plaintext), and,
on a TLS channel (``tls=True``), a server that closed the connection in the
handshake (it wants a client certificate it trusts: mutual TLS). ``grpc.channel_ready_future`` would do too,
but its connectivity poll makes the channel's close take 0.2 s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from .. import errors

PROBE_METHOD = "/dm_env_rpc_client.Probe/Ready"  # no server serves it: any answer means ready
REFUSED_CHECK = 0.5  # seconds for the check, after a timeout, whether the port refuses
CONNECT_TIMEOUT = (
    "Could not connect to {address} within {timeout} s. Check that the server is running "
    "and the address is right, or pass a longer timeout.{refused}"
)
_LAST_REFUSED = " The last attempt was refused: nothing accepts connections there."
_REFUSED = (
    "Nothing accepts connections at {address} (connection refused). Start the server there, "
    "or check the host and port; to wait for a server that is still starting, pass "
    "wait_for_ready=True (connect then retries until timeout)."
)
_HANDSHAKE = (
    "The TLS handshake with {address} failed ({details}). If the server's certificate is "
    "not trusted, pass the CA that signed it (grpc.ssl_channel_credentials(root_certificates="
    "CA); --root-certificates CA); if the server speaks plaintext, connect without TLS."
)
_HUNG_UP = (
    "The server at {address} closed the connection during the TLS handshake ({details}): it "
    "requires a client certificate it trusts (mutual TLS), and this client sent none or one "
    "signed by another CA. Pass one signed by the CA the server trusts: "
    "grpc.ssl_channel_credentials(root_certificates=CA, private_key=KEY, "
    "certificate_chain=CERT) in Python, --certificate CERT --private-key KEY on the command line."
)
REFUSED, TIMEOUT = "refused", "timeout"
HANDSHAKE, HUNG_UP = "handshake: ", "hung up: "  # verdicts, followed by gRPC's details


def refused(exc: grpc.RpcError) -> bool:
    """Whether a failed call failed because the connection was refused."""
    code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
    return code == grpc.StatusCode.UNAVAILABLE and "refused" in str(details).lower()


def _verdict(exc: grpc.RpcError, tls: bool) -> str | None:
    """A first attempt's failure: REFUSED, TIMEOUT, HANDSHAKE or HUNG_UP and gRPC's details,
    "" (another: wait) or None (answered)."""
    if refused(exc):
        return REFUSED
    code = exc.code()  # type: ignore[attr-defined]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TIMEOUT
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    details = str(exc.details())  # type: ignore[attr-defined]
    if "handshake failed" in details.lower():
        return HANDSHAKE + details
    if tls and "socket closed" in details.lower():
        return HUNG_UP + details
    return ""


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def wait_ready(
    channel: grpc.Channel, timeout: float | None, wait_for_ready: bool, tls: bool = False
) -> str | None:
    """None once the server answers on ``channel``; else why not (see ``_verdict``);
    ``tls``: the channel has TLS credentials."""
    probe = channel.unary_unary(PROBE_METHOD)
    deadline = None if timeout is None else time.monotonic() + timeout
    if not wait_for_ready:
        try:
            probe(b"", timeout=timeout)
            return None
        except grpc.RpcError as exc:
            if (verdict := _verdict(exc, tls)) != "":
                return verdict
    try:
        probe(b"", timeout=_remaining(deadline), wait_for_ready=True)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
            return TIMEOUT
    return None


async def wait_ready_async(
    channel: grpc.aio.Channel, timeout: float | None, wait_for_ready: bool, tls: bool = False
) -> str | None:
    """``wait_ready`` for a ``grpc.aio`` channel."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not wait_for_ready:
        try:
            await channel.unary_unary(PROBE_METHOD)(b"", timeout=timeout)
        except grpc.RpcError as exc:
            if (verdict := _verdict(exc, tls)) != "":
                return verdict
    try:
        await asyncio.wait_for(channel.channel_ready(), _remaining(deadline))
    except asyncio.TimeoutError:
        return TIMEOUT
    return None


def connect_error(
    verdict: str, address: str, timeout: float | None, channel: Any
) -> errors.DmEnvRpcConnectionError:
    """The error for ``wait_ready``'s verdict; after a timeout, one quick attempt more says
    whether the port refuses."""
    if (early := _early_error(verdict, address)) is not None:
        return early
    try:
        channel.unary_unary(PROBE_METHOD)(b"", timeout=REFUSED_CHECK)
        last_refused = False
    except grpc.RpcError as exc:
        last_refused = refused(exc)
    return _timeout_error(address, timeout, last_refused)


async def connect_error_async(
    verdict: str, address: str, timeout: float | None, channel: grpc.aio.Channel
) -> errors.DmEnvRpcConnectionError:
    """``connect_error`` for a ``grpc.aio`` channel."""
    if (early := _early_error(verdict, address)) is not None:
        return early
    try:
        await channel.unary_unary(PROBE_METHOD)(b"", timeout=REFUSED_CHECK)
        last_refused = False
    except grpc.RpcError as exc:
        last_refused = refused(exc)
    return _timeout_error(address, timeout, last_refused)


def _early_error(verdict: str, address: str) -> errors.DmEnvRpcConnectionError | None:
    """The error of a first attempt that failed for good (refused, a TLS handshake); else None."""
    if verdict == REFUSED:
        return errors.ConnectRefusedError(_REFUSED.format(address=address))
    for prefix, template in ((HANDSHAKE, _HANDSHAKE), (HUNG_UP, _HUNG_UP)):
        if verdict.startswith(prefix):
            details = verdict[len(prefix) :]
            message = template.format(address=address, details=details)
            return errors.AuthenticationError(message, grpc.StatusCode.UNAVAILABLE, details)
    return None


def _timeout_error(
    address: str, timeout: float | None, last_refused: bool
) -> errors.ConnectTimeoutError:
    return errors.ConnectTimeoutError(
        CONNECT_TIMEOUT.format(
            address=address, timeout=timeout, refused=_LAST_REFUSED if last_refused else ""
        )
    )
