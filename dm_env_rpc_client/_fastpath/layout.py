"""Decoding a run of same-shaped step responses from their bytes, with a few NumPy calls.

A server of a fixed-shape environment sends step responses that serialize to
the same bytes except inside the payloads: the state, the map keys, the
tensors' tags, lengths and shapes are the same on every step; only the numbers
differ. ``Layout`` is learned from one response that ``ObservationPlan`` has
fully checked and decoded: the offsets of each requested observation's payload
body in its serialization (``SerializeToString``, canonical for a parsed
message) and every other byte ("structure"). A run of N responses is then one
join into an ``[N, length]`` byte array, one comparison of all their structure
bytes with the learned ones, and one slice, copy and view per observation.

It is exact by construction: protobuf parses bytes deterministically, so N
responses whose structure bytes equal those of a checked response parse into
messages of the same fields, tensors and shapes, differing only in the payload
values that are sliced out. The state's one byte is not structure (a run mixes
RUNNING and TERMINATED steps; the adaptor checks each state). Anything the
layout does not cover (another length, any other structure byte, a payload of
variable width such as int32 varints, strings) returns None and the caller
decodes as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._codec.dtypes import DATA_TYPE_TO_NUMPY
from .wire_step import (
    _OBSERVATION_TAG,
    _STATE_TAG,
    _WALKED,
    _Unexpected,
    entry,
    payload_body,
    structure_runs,
)

_STEP_TAG = 3 << 3 | 2  # EnvironmentResponse.step: a length-delimited field 3

# Tensor payload field number -> the dtype of its body bytes, for payloads whose body is a
# fixed number of bytes per element: those _wire_step walks, and bools (varints, but a
# serialized bool is 0 or 1, one byte).
_BODY_DTYPES: dict[int, np.dtype] = {
    **{number: wire for number, (_, wire, _) in _WALKED.items()},
    9: np.dtype(np.bool_),
}


class _Slot(NamedTuple):
    name: str
    start: int
    stop: int
    wire: np.dtype
    native: np.dtype
    shape: tuple[int, ...]
    elements: int


class Layout:
    """The byte layout of one checked response (see the module docs); made by ``learn``."""

    def __init__(
        self,
        data: bytes,
        structure: np.ndarray,
        runs: list[tuple[int, int, bytes]],
        slots: list[_Slot],
        state_at: int | None = None,
    ) -> None:
        self.length = len(data)
        self.state_at = state_at  # the state's one byte's offset, if the state comes first
        self._structure = structure  # indices of the structure bytes
        self._expected = np.frombuffer(data, np.uint8)[structure].copy()  # their values
        self._runs = runs  # the structure as runs of bytes, to check one response without NumPy
        self._slots = slots
        self.frame = _frame(data, runs, state_at)

    def one(self, data: bytes) -> dict[str, Any] | None:
        """The observations of one serialized response (as ``ObservationPlan.decode``), or None."""
        if len(data) != self.length:
            return None
        for start, stop, expected in self._runs:
            if data[start:stop] != expected:
                return None
        out: dict[str, Any] = {}
        for slot in self._slots:
            flat = np.frombuffer(data, slot.wire, slot.elements, slot.start).astype(slot.native)
            out[slot.name] = flat.reshape(slot.shape) if slot.shape else flat[0]
        return out

    def fits(self, data: bytes, offset: int = 0) -> bool:
        """Whether ``data[offset:]`` is a response of this layout: of its length, with its every
        structure byte (all but the payloads' and the state's value), as ``one`` checks."""
        if len(data) - offset != self.length:
            return False
        for start, stop, expected in self._runs:
            if data[offset + start : offset + stop] != expected:
                return False
        return True

    def columns(self, parts: Sequence[bytes]) -> dict[str, np.ndarray] | None:
        """``{name: [N, *shape] array}`` from N serialized responses, or None if one does not fit."""
        length = self.length
        if parts and set(map(len, parts)) != {length}:
            return None
        rows = np.frombuffer(b"".join(parts), np.uint8).reshape(len(parts), length)
        if not (rows[:, self._structure] == self._expected).all():
            return None
        out = {}
        for slot in self._slots:
            body = rows[:, slot.start : slot.stop].copy().view(slot.wire)
            out[slot.name] = body.astype(slot.native, copy=False).reshape((len(parts), *slot.shape))
        return out


def learn(data: bytes, columns: Sequence[Any]) -> Layout | None:
    """The layout of ``data`` (a serialized StepResponse whose observations ``columns`` decoded).

    ``columns`` are ``_fastpath.decode._Column``s (name, uid, spec dtype and shape). None
    when a requested observation's payload is not of fixed width, or the bytes
    are in an order or form this module does not read.
    """
    try:
        bodies, state_at = _walk(data)
    except (_Unexpected, IndexError):
        return None
    structure = np.ones(len(data), bool)
    slots = []
    for column in columns:
        found = bodies.get(column.uid)
        if found is None:
            return None
        field, start, stop = found
        wire = _BODY_DTYPES.get(field)
        count = math.prod(column.shape)
        if wire is None or column.variable or (stop - start) != count * wire.itemsize:
            return None
        native = DATA_TYPE_TO_NUMPY[column.data_type]
        slots.append(_Slot(column.name, start, stop, wire, native, column.shape, count))
        structure[start:stop] = False
    varying = [(slot.start, slot.stop) for slot in slots]
    if state_at is not None:
        structure[state_at] = False
        varying.append((state_at, state_at + 1))
    runs = structure_runs(data, sorted(varying))
    return Layout(data, np.flatnonzero(structure), runs, slots, state_at)


def _walk(data: bytes) -> tuple[dict[int, tuple[int, int, int]], int | None]:
    """``{uid: (payload field, body start, body stop)}`` and the state byte's offset."""
    pos, end = 0, len(data)
    state_at = None
    if end and data[0] == _STATE_TAG:
        if data[1] >= 0x80:
            raise _Unexpected
        state_at, pos = 1, 2
    bodies: dict[int, tuple[int, int, int]] = {}
    while pos < end:
        if data[pos] != _OBSERVATION_TAG:
            raise _Unexpected
        uid, start, pos = entry(data, pos + 1, bodies)
        if start >= pos or data[start] >> 3 not in _BODY_DTYPES:
            raise _Unexpected
        bodies[uid] = (data[start] >> 3, *payload_body(data, start, pos))  # the shape: structure
    if pos != end:
        raise _Unexpected
    return bodies, state_at


class Frame(NamedTuple):
    """A layout's answers as the ``EnvironmentResponse`` bytes the loop reads (see ``_frame``):
    their ``length``, the structure ``runs`` in them (the step field's tag and length
    first), where the state's byte is (``state_at``) and where the StepResponse starts
    (``body_at``)."""

    length: int
    runs: tuple[tuple[int, int, bytes], ...]
    state_at: int
    body_at: int


def _frame(data: bytes, runs: list[tuple[int, int, bytes]], state_at: int | None) -> Frame | None:
    """The ``Frame`` of a StepResponse of ``data``'s layout sent alone in an
    ``EnvironmentResponse`` (its step field: tag, a canonical length of one or two bytes,
    the body), or None where the state does not come first or the body is too long.

    Exact as ``fits`` is: bytes of the frame's length whose runs match are that
    field's tag, that length and a body that ``fits``, so they parse to a step answer
    whose state is the byte at ``state_at``."""
    length = len(data)
    if state_at != 1 or length >= 1 << 14:
        return None
    head = (
        bytes([_STEP_TAG, length])
        if length < 0x80
        else bytes([_STEP_TAG, length & 0x7F | 0x80, length >> 7])
    )
    at = len(head)
    shifted = [(start + at, stop + at, expected) for start, stop, expected in runs]
    if shifted and shifted[0][0] == at:  # the body's first run follows the head: one run
        first = shifted[0]
        shifted[0] = (0, first[1], head + first[2])
    else:
        shifted.insert(0, (0, at, head))
    return Frame(at + length, tuple(shifted), at + state_at, at)
