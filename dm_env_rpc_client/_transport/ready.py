"""Whether a server answers: the readiness probe of ``connect`` and ``connect_async``.

A unary call to a method no server has returns as soon as a server answers
anything (UNIMPLEMENTED). Without ``wait_for_ready`` its first attempt fails at
once when the port refuses connections (``ConnectRefusedError``); any other
failure of that attempt (a TLS handshake, a resolver) falls back to waiting, as
``wait_for_ready=True`` does from the start: gRPC retries with backoff until
the server answers or the timeout passes (``ConnectTimeoutError``, which says
when the last attempt was refused). ``grpc.channel_ready_future`` would do too,
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
REFUSED, TIMEOUT = "refused", "timeout"


def refused(exc: grpc.RpcError) -> bool:
    """Whether a failed call failed because the connection was refused."""
    code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
    return code == grpc.StatusCode.UNAVAILABLE and "refused" in str(details).lower()


def _verdict(exc: grpc.RpcError) -> str | None:
    """A first attempt's failure: REFUSED, TIMEOUT, "" (another: wait) or None (answered)."""
    if refused(exc):
        return REFUSED
    code = exc.code()  # type: ignore[attr-defined]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TIMEOUT
    return "" if code == grpc.StatusCode.UNAVAILABLE else None


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def wait_ready(channel: grpc.Channel, timeout: float | None, wait_for_ready: bool) -> str | None:
    """None once the server answers on ``channel``; else why not: REFUSED or TIMEOUT."""
    probe = channel.unary_unary(PROBE_METHOD)
    deadline = None if timeout is None else time.monotonic() + timeout
    if not wait_for_ready:
        try:
            probe(b"", timeout=timeout)
            return None
        except grpc.RpcError as exc:
            if (verdict := _verdict(exc)) != "":
                return verdict
    try:
        probe(b"", timeout=_remaining(deadline), wait_for_ready=True)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
            return TIMEOUT
    return None


async def wait_ready_async(
    channel: grpc.aio.Channel, timeout: float | None, wait_for_ready: bool
) -> str | None:
    """``wait_ready`` for a ``grpc.aio`` channel."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not wait_for_ready:
        try:
            await channel.unary_unary(PROBE_METHOD)(b"", timeout=timeout)
        except grpc.RpcError as exc:
            if (verdict := _verdict(exc)) != "":
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
    if verdict == REFUSED:
        return errors.ConnectRefusedError(_REFUSED.format(address=address))
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
    if verdict == REFUSED:
        return errors.ConnectRefusedError(_REFUSED.format(address=address))
    try:
        await channel.unary_unary(PROBE_METHOD)(b"", timeout=REFUSED_CHECK)
        last_refused = False
    except grpc.RpcError as exc:
        last_refused = refused(exc)
    return _timeout_error(address, timeout, last_refused)


def _timeout_error(
    address: str, timeout: float | None, last_refused: bool
) -> errors.ConnectTimeoutError:
    return errors.ConnectTimeoutError(
        CONNECT_TIMEOUT.format(
            address=address, timeout=timeout, refused=_LAST_REFUSED if last_refused else ""
        )
    )
