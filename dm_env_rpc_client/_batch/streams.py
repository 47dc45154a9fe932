"""A batch's event loop, channels and streams: ``start_streams`` (for every kind of batch).

One background event loop (a ``LoopThread``) runs every stream of a batch. Streams
to one address share a channel, at most ``max_streams_per_connection`` streams
on each (``_batch.channels``); gRPC never retries a batch's stream (the batch's
own failure policy deals with a broken world). Before anything is opened,
``check_descriptors`` makes sure the process may open a connection to every
server. ``BatchedEnvironment.connect`` (``_batch.opening``) and
``MultiAgentBatch.connect`` (``_batch.agent_opening``) open their streams here.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc

from .. import errors
from .._base import checks as _checks
from .._transport import ready as _ready
from .._transport.loop import LoopConnection, LoopThread
from ..aio import AsyncConnection
from ..connection import create_channel
from .channels import DEFAULT_STREAMS_PER_CONNECTION, ChannelPool, connections_needed
from .options import ConnectionOptions

try:
    import resource
except ImportError:  # not on Windows: no descriptor limit to check there
    resource = None  # type: ignore[assignment]

OPENING_PER_SERVER = 64  # worlds being opened at once on one server
# File descriptors a connection to one server takes (its socket), and what gRPC and the
# loop need besides (epoll, wake-up pipes, a restart's new connection).
DESCRIPTORS_PER_SERVER = 1
DESCRIPTORS_SPARE = 32
# gRPC's retry machinery keeps state per stream (about 6 KB of a world's 45 at 1,024 worlds); a
# batch never has gRPC retry a stream (its own restart policy deals with a broken world).
_NO_RETRIES = ("grpc.enable_retries", 0)
_TOO_MANY_SERVERS = (
    "Connecting to {servers} servers needs about {needed} file descriptors (one connection "
    "each, and {spare} spare; {open} are open already), but this process may open only "
    "{limit} (RLIMIT_NOFILE; the hard limit is {hard}). Raise it before connecting: "
    "`ulimit -n {suggest}` in the shell, or resource.setrlimit(resource.RLIMIT_NOFILE, "
    "({suggest}, hard)) in Python; or use fewer servers per client."
)

OpenStream = Callable[..., Coroutine[Any, Any, LoopConnection]]


def start_streams(
    name: str,
    addresses: Sequence[str],
    streams: int,
    timeout: float | None,
    connection: ConnectionOptions,
) -> tuple[LoopThread, dict[str, grpc.aio.Channel], OpenStream]:
    """A batch's background loop (thread ``name``), its channels (made on first use, at most
    ``max_streams_per_connection`` streams on each) and its ``open_stream(address,
    wait=timeout, *, first=False)``; for ``streams`` streams over ``addresses`` in all.

    Raises:
      ArgumentValueError: a bad ``max_response_bytes`` or ``max_streams_per_connection``.
      ArgumentTypeError: ``metadata`` that is not a sequence of (key, value) pairs.
      DmEnvRpcConnectionError: too few file descriptors for the connections.
    """
    credentials, options, insecure, metadata, wait_for_ready = connection[:5]
    max_response_bytes = connection.max_response_bytes
    if max_response_bytes is not None:
        _checks.check_count(max_response_bytes, "max_response_bytes")
    per_connection = connection.max_streams_per_connection
    if per_connection is None:  # the default (the command line's, unless given)
        per_connection = DEFAULT_STREAMS_PER_CONNECTION
    per_connection = _checks.check_count(per_connection, "max_streams_per_connection")
    batch_options = list(options or ())
    if not any(option == _NO_RETRIES[0] for option, _ in batch_options):
        batch_options.insert(0, _NO_RETRIES)
    _checks.check_metadata(metadata)
    # before gRPC or the loop open any (gRPC aborts without them)
    check_descriptors(addresses, connections_needed(addresses, streams, per_connection))
    runner = LoopThread(name=name)
    channels: dict[str, grpc.aio.Channel] = {}

    def make_channel(address: str, extra: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        opts = [*batch_options, *extra]
        return create_channel(
            address,
            credentials=credentials,
            options=opts,
            insecure=insecure,
            aio=True,
            max_response_bytes=max_response_bytes,
        )

    pool = ChannelPool(make_channel, per_connection, channels)
    tls = credentials is not None
    # A channel's readiness probe, shared by the worlds first opened on it while it connects:
    # each stream probing for itself made one unary call per stream (to the server too) for
    # most streams of each new channel (up to OPENING_PER_SERVER of them at once).
    probes: dict[str, asyncio.Future[str | None]] = {}

    async def ready(key: str, channel: grpc.aio.Channel, address: str, wait: float | None) -> None:
        probe = probes.get(key)
        if probe is None:
            probe = probes[key] = asyncio.ensure_future(
                _ready.wait_ready_async(channel, wait, wait_for_ready, tls)
            )
            probe.add_done_callback(functools.partial(_probed, probes, key))
        verdict = await asyncio.shield(probe)
        if verdict is not None:
            raise await _ready.connect_error_async(verdict, address, wait, channel)

    async def open_stream(
        address: str, wait: float | None = timeout, *, first: bool = False
    ) -> LoopConnection:
        """A stream to ``address``; a world's first (``first``) fails at once on a refusing port
        unless ``wait_for_ready``; a restart's waits for its server to come back."""
        channel, slot = pool.acquire(address)
        try:
            if first or channel.get_state() == grpc.ChannelConnectivity.READY:
                if channel.get_state() != grpc.ChannelConnectivity.READY:
                    await ready(slot.key, channel, address, wait)
                stream = await AsyncConnection.open(channel, metadata)
                stream.address = address
                opened = LoopConnection(runner, stream)
            else:
                opened = await LoopConnection.open(
                    runner,
                    address,
                    channel=channel,
                    timeout=wait,
                    metadata=metadata,
                    wait_for_ready=True,
                    tls=tls,
                )
        except BaseException:
            slot.released = True
            raise
        slot.connection = opened
        opened.slot = slot  # type: ignore[attr-defined]
        return opened

    return runner, channels, open_stream


def _probed(probes: dict[str, asyncio.Future[Any]], key: str, probe: asyncio.Future[Any]) -> None:
    """A shared readiness probe ended: the next stream on its channel probes anew. Its error
    is taken here (a channel closed under it, the batch closing) so none is logged unseen."""
    if probes.get(key) is probe:
        del probes[key]
    if not probe.cancelled():
        probe.exception()


def check_descriptors(addresses: Sequence[str], connections: int | None = None) -> None:
    """Raises ``DmEnvRpcConnectionError`` if the process may not open its connections.

    Streams to one server share its connections, so the worlds count only as
    ``connections`` (default: one per distinct server). Checked where the limit
    can be read (Unix).
    """
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        already = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS): count none open
        already = 0
    servers = len(set(addresses)) if connections is None else connections
    needed = servers * DESCRIPTORS_PER_SERVER + DESCRIPTORS_SPARE
    if already + needed > soft:
        suggest = already + needed if hard == resource.RLIM_INFINITY else hard
        raise errors.DmEnvRpcConnectionError(
            _TOO_MANY_SERVERS.format(
                servers=servers,
                needed=needed,
                spare=DESCRIPTORS_SPARE,
                open=already,
                limit=soft,
                hard="unlimited" if hard == resource.RLIM_INFINITY else hard,
                suggest=max(suggest, already + needed),
            )
        )
