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
# dropped network) is found within KEEPALIVE_DETECTION_S while a request waits. A ping goes out
# after 10 s without reads and must be answered within 5 s. gRPC also pings on its own (to size
# its flow-control window, right after data arrives); a keepalive that finds such a ping in
# flight waits for it, and that ping's deadline is grpc.http2.ping_timeout_ms, 60 s unless set:
# so it is set to 5 s too, or a server stopped just after it answered is found only after a
# minute (measured with grpcio 1.85). Servers accept these pings: a default gRPC server allows
# pings every 5 minutes only while it sends no data, and counts 2 "strikes" before it answers
# too_many_pings; gRPC clients send at most 2 pings (grpc.http2.max_pings_without_data) before
# they send data again, so an idle stream costs the server at most one strike.
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)
KEEPALIVE_DETECTION_S = 15.0  # keepalive_time + ping timeout: half-open found by then

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
) -> Any:
    """Opens a gRPC channel with the SDK's defaults (see the module docs).

    Loopback and ``unix:`` addresses get local credentials; ``credentials``
    give TLS; a remote host in plaintext needs ``insecure=True``.

    Raises:
      DmEnvRpcConnectionError: for plaintext to a remote host without ``insecure=True``.
    """
    _checks.check_address(address)
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
