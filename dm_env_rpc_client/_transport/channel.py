"""gRPC channels with the SDK's defaults: options, and credentials chosen by address.

Loopback, ``0.0.0.0``/``[::]`` (this host) and ``unix:`` addresses get local
credentials; ``credentials`` give TLS; a remote host in plaintext needs
``insecure=True``. ``connection`` re-exports these names.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

import grpc

from .. import errors
from .._base import checks as _checks

# Channel options: unlimited message sizes; quick reconnect backoff so connect() notices a
# server that comes up late; and keepalive, so that a half-open connection (a stopped server, a
# dropped network) is found within KEEPALIVE_DETECTION_S while a request waits, even one sent
# with timeout=None (every default timeout is far shorter). The pace is the one every gRPC server
# accepts: a server with gRPC's default ping policy (the reference package's, most in the wild)
# takes a ping at most every 5 minutes while it sends no data, counts a faster one as a strike,
# and after 2 strikes ends the connection with GOAWAY too_many_pings, killing every world on it.
# Keepalive pings are not held back by grpc.http2.max_pings_without_data (measured with grpcio
# 1.85: with pings every 10 s, an idle stream was ended after about 2 minutes on both the SDK's
# and the reference package's server, with that option at 1 too). So a ping goes out after
# 330 s without reads (10% above the 5 minutes) and must be answered within 20 s; gRPC's own
# flow-control pings get the same 20 s deadline (grpc.http2.ping_timeout_ms, 60 s unless set),
# or a keepalive that finds one in flight would wait for it. A server that allows faster pings
# (the SDK's own server allows one every 5 s) can be watched closer: FAST_KEEPALIVE_OPTIONS.
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 330_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)
KEEPALIVE_DETECTION_S = 350.0  # keepalive_time + ping timeout: half-open found by then
# For servers that accept a ping every 10 s while idle (the SDK's own server does): pass as
# options= to find a stopped server within FAST_KEEPALIVE_DETECTION_S.
FAST_KEEPALIVE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
)
FAST_KEEPALIVE_DETECTION_S = 15.0

_NEEDS_CREDENTIALS = (
    "Refusing a plaintext connection to the remote host {address}. Pass credentials= "
    "(e.g. grpc.ssl_channel_credentials()) for TLS, or insecure=True to send plaintext."
)


def is_local(address: str) -> bool:
    """Whether an address is a unix socket, a loopback host, or ``0.0.0.0``/``[::]``.

    A connection to the unspecified address reaches this host (over loopback),
    so it gets local credentials too, as the reference's default gives it.
    """
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def create_channel(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    insecure: bool = False,
    aio: bool = False,
    max_response_bytes: int | None = None,
) -> Any:
    """Opens a gRPC channel with the SDK's defaults (see the module docs).

    Loopback and ``unix:`` addresses get local credentials; ``credentials``
    give TLS; a remote host in plaintext needs ``insecure=True``.
    ``max_response_bytes`` caps an answer's size (``grpc.max_receive_message_length``);
    None leaves any size (or what ``options`` say).

    Raises:
      ArgumentError: ``max_response_bytes`` is not a whole number of at least 1.
      DmEnvRpcConnectionError: for plaintext to a remote host without ``insecure=True``.
    """
    _checks.check_address(address)
    if max_response_bytes is not None:
        _checks.check_count(max_response_bytes, "max_response_bytes")
        options = [*(options or ()), ("grpc.max_receive_message_length", max_response_bytes)]
    if credentials is not None and not isinstance(credentials, grpc.ChannelCredentials):
        what = "gRPC channel credentials (e.g. grpc.ssl_channel_credentials()) or None"
        _checks.check_type(credentials, grpc.ChannelCredentials, "credentials", what)
    merged = dict(DEFAULT_OPTIONS)
    merged.update(dict(options or ()))
    opts = list(merged.items())
    module: Any = grpc.aio if aio else grpc
    if credentials is not None:
        return module.secure_channel(address, credentials, opts)
    if is_local(address):
        kind = (
            grpc.LocalConnectionType.UDS
            if address.startswith("unix")
            else grpc.LocalConnectionType.LOCAL_TCP
        )
        return module.secure_channel(address, grpc.local_channel_credentials(kind), opts)
    if insecure:
        return module.insecure_channel(address, opts)
    raise errors.DmEnvRpcConnectionError(_NEEDS_CREDENTIALS.format(address=address))
