"""A batch's channels: an address's streams spread over HTTP/2 connections of a capped size.

A server, or a proxy in front of it, may allow only so many streams at once on
one HTTP/2 connection (its SETTINGS_MAX_CONCURRENT_STREAMS: 100 behind Google
front ends, 128 with nginx and AWS ALB). gRPC queues a stream beyond it until
another ends, so a world on it never opens. ``ChannelPool.acquire`` therefore
gives each new stream a channel of its address with fewer than
``per_connection`` live streams, opening another channel when all are full.
Every channel gets its own subchannel pool (``grpc.use_local_subchannel_pool``):
without it gRPC would put channels with identical arguments on one shared
connection, the limit included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

DEFAULT_STREAMS_PER_CONNECTION = 100  # the lowest limit common in the wild (Google front ends)
_OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


class Slot:
    """One stream's place on a channel: live until its stream closes, or released."""

    __slots__ = ("connection", "key", "released")

    def __init__(self, key: str) -> None:
        self.key = key
        self.connection: Any = None  # the stream's connection once open (has ``closed``)
        self.released = False

    @property
    def live(self) -> bool:
        """Whether the slot still takes a stream of its channel."""
        if self.released:
            return False
        return self.connection is None or not self.connection.closed


class ChannelPool:
    """The channels of one batch, by key (``address`` for an address's first, then
    ``address#1``, ``address#2``, ...); ``channels`` is the dict ``shut_down`` closes."""

    def __init__(
        self,
        make: Callable[[str, Sequence[tuple[str, Any]]], grpc.aio.Channel],
        per_connection: int,
        channels: dict[str, grpc.aio.Channel],
    ) -> None:
        self._make = make
        self.per_connection = per_connection
        self.channels = channels
        self._slots: dict[str, list[Slot]] = {}
        self._count: dict[str, int] = {}  # channels per address

    def acquire(self, address: str) -> tuple[grpc.aio.Channel, Slot]:
        """A channel of ``address`` with room for one more stream, and the stream's slot.

        The newest channel first, unscanned: opening fills the channels in turn, so that is
        the one being filled (scanning every channel's slots for each stream made opening
        quadratic in the worlds: a quarter of connect's CPU at 4,096). Only once it is full
        are the channels scanned for slots of streams that ended (a restart's new stream
        takes one), before another channel is opened.
        """
        count = self._count.get(address, 0)
        if count:
            newest = _key(address, count - 1)
            if len(self._slots[newest]) < self.per_connection:
                return self._take(newest)
            for index in range(count):
                key = _key(address, index)
                slots = self._slots[key] = [slot for slot in self._slots[key] if slot.live]
                if len(slots) < self.per_connection:
                    return self._take(key)
        self._count[address] = count + 1
        key = _key(address, count)
        self.channels[key] = self._make(address, (_OWN_CONNECTION,))
        self._slots[key] = []
        return self._take(key)

    def _take(self, key: str) -> tuple[grpc.aio.Channel, Slot]:
        """A new slot on channel ``key`` (which has room)."""
        slot = Slot(key)
        self._slots[key].append(slot)
        return self.channels[key], slot


def _key(address: str, index: int) -> str:
    return address if index == 0 else f"{address}#{index}"


def connections_needed(addresses: Sequence[str], count: int, per_connection: int) -> int:
    """How many connections ``count`` worlds round-robin over ``addresses`` take."""
    needed = 0
    distinct = list(dict.fromkeys(addresses))
    for address in distinct:
        worlds = sum(1 for index in range(count) if addresses[index % len(addresses)] == address)
        needed += -(-worlds // per_connection)
    return needed
