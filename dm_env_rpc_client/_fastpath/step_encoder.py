"""Many worlds' step requests at once, as wire bytes: the fast path of ``BatchedEnvironment.send``.

``StepEncoder.encode`` takes stacked actions (``{name: [N, ...] array}``) for N
worlds that share one adaptor's action specs and returns each world's
``EnvironmentRequest`` bytes: exactly the bytes of
``messages.envelope(env.step_request(action))`` for the world's slice, without a
protobuf message per world. Each action is checked once for the whole batch, by
the ``SpecManager`` checks the per-world path runs (the dtype as ``_numeric``
takes it, the shape ``[N, *spec.shape]``, the bounds).

The payload of a fixed-width action is the raw little-endian bytes of its array
(``tensors``), so every world's request is one template with that world's
payload bytes written into it. A template is one real request, packed and
serialized by the per-world path once per set of action names (in the order the
caller gives them: the order of the request's map entries depends on it; it is
protobuf's map order, not the caller's, but the same each time), with the
places of its payloads read from its bytes; the requests of all the worlds are
then written by one NumPy copy per action. Varint payloads (int32, int64,
uint32, uint64, bool) qualify when all their values take varints of one length,
as small non-negative integers (discrete actions) do.

``encode`` returns None for anything else, and the caller takes the per-world
path, which raises its own errors (naming the world): a value that fails a check,
an unknown name, a string, proto, empty or variable-shape spec, a list of
per-world dicts, varints of different lengths.

``ActionEncoder`` does the same for one step of one adaptor (``step``,
``step_async``, ``step_iter``): ``encode(action)`` returns exactly the bytes of
``messages.envelope(env.step_request(action))``, or None. Its templates are the
request's bytes cut at its payloads (keyed by the names in the caller's order
and the payloads' lengths, with the order the payloads lie in), and the request
is one ``b"".join`` of them with the action's payloads. A scalar value that ``SpecManager._pack_one`` takes without
NumPy (a Python number, or a NumPy scalar of the spec's dtype, within
``scalar_limits``) is encoded without NumPy: ``struct`` for float and double, a
table for int8, uint8 and bool, a varint for the others (a negative int32 or
int64 as its 64-bit two's complement: 10 bytes, as protobuf writes it). Any
other value of a covered spec goes through the per-world path's checks
(``_numeric``, the shape, ``_check_bounds``) and ``_payloads``. Anything else
returns None, and the adaptor takes the ``step_request`` path, which raises
its own errors.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
from google.protobuf import message

from .. import errors, messages, specs
from .._codec.payload import _encode_varints, _read_varint, _varint
from .wire_step import _Unexpected, entry, payload_body

MAX_TEMPLATES = 32  # sets of action names (with payload sizes) kept; others take the slow path
_STEP_TAG = 3 << 3 | 2  # EnvironmentRequest.step
_ENTRY_TAG = 1 << 3 | 2  # StepRequest.actions: a map entry (uid, Tensor), as observations'


class _Adaptor(Protocol):
    """What the encoders need of an adaptor (``AdaptorCore``, which imports this module)."""

    _actions: specs.SpecManager

    def _step_request(self, action: Any) -> message.Message: ...


class _Template(NamedTuple):
    """One world's request bytes, and where each action's payload lies in them."""

    data: np.ndarray  # uint8
    spans: list[tuple[int, int]]  # (start, stop) per action, in the caller's name order


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _payloads(array: np.ndarray, count: int) -> np.ndarray | None:
    """Each world's payload bytes, ``[count, size]`` uint8; None if varint lengths differ."""
    kind = array.dtype.kind
    if kind == "f":
        wire = array.astype(array.dtype.newbyteorder("<"), copy=False)
        return np.ascontiguousarray(wire).reshape(count, -1).view(np.uint8)
    if array.dtype.itemsize == 1 and kind != "b":  # int8, uint8: a ``bytes`` field
        return np.ascontiguousarray(array).reshape(count, -1).view(np.uint8)
    flat = array.reshape(-1)
    if kind != "b":  # int32, int64, uint32, uint64: varints of one length only
        wide = flat.astype(np.int64 if kind == "i" else np.uint64, copy=False).view(np.uint64)
        if _varint_size(int(wide.min())) != _varint_size(int(wide.max())):
            return None
    return np.frombuffer(_encode_varints(flat), np.uint8).reshape(count, -1)


def _learn(
    manager: specs.SpecManager, step_request: Callable[[Any], message.Message], action: Any
) -> tuple[bytes, list[tuple[int, int]]] | None:
    """A template's source: one real request for ``action`` made by ``step_request`` (its
    EnvironmentRequest bytes) and where each action's payload lies in it, in ``action``'s
    name order; None if its bytes are not laid out as ``_payload_spans`` reads them."""
    data, _ = messages.envelope(step_request(action))
    spans = _payload_spans(data, [manager.name_to_uid(name) for name in action])
    return None if spans is None else (data, spans)


def _payload_spans(data: bytes, uids: list[int]) -> list[tuple[int, int]] | None:
    """Where the payload of each of ``uids`` lies in a step's EnvironmentRequest bytes.

    Returns None unless the bytes are laid out as expected: a ``step`` field holding
    map entries (key, then a Tensor whose first field is its payload) and whatever
    follows them (``requested_observations``). The entries and payloads are read as
    a response's observations are (``_fastpath.wire_step``).
    """
    found: dict[int, tuple[int, int]] = {}
    try:
        tag, pos = _read_varint(data, 0)
        _, pos = _read_varint(data, pos)
        if tag != _STEP_TAG:
            return None
        while pos < len(data):
            tag, at = _read_varint(data, pos)
            if tag == _ENTRY_TAG:
                uid, start, pos = entry(data, at, found)
                found[uid] = payload_body(data, start, pos)
            else:
                length, at = _read_varint(data, at)
                pos = at + length
    except (_Unexpected, IndexError):
        return None
    if pos != len(data) or sorted(found) != sorted(uids):
        return None
    return [found[uid] for uid in uids]


def _covered(manager: specs.SpecManager) -> dict[str, specs._Compiled]:
    """The specs the fast paths cover: fixed-width numeric, a known shape, some elements."""
    return {
        name: compiled
        for name, compiled in manager._by_name.items()
        if compiled.dtype.kind in "biuf" and not compiled.variable and math.prod(compiled.shape) > 0
    }


class StepEncoder:
    """Encodes the step requests of worlds that share ``template``'s action specs.

    Args:
      template: one of the worlds' adaptors; its action specs and requested
        observations are every world's.
    """

    def __init__(self, template: _Adaptor) -> None:
        self._adaptor = template
        self._manager = template._actions
        self._covered = _covered(self._manager)
        self._templates: dict[tuple[Any, ...], _Template | None] = {}

    def encode(self, actions: Mapping[str, Any], count: int) -> list[bytes] | None:
        """Each world's EnvironmentRequest bytes, or None: take the per-world path.

        Args:
          actions: ``{name: [count, ...] array}`` (nested dicts alike).
          count: how many worlds are stepped.
        """
        if not count or not actions:
            return None
        if any(isinstance(value, Mapping) for value in actions.values()):
            actions = specs.flatten(actions)  # as SpecManager.pack flattens each world's
        manager = self._manager
        given, payloads = [], []
        for name, value in actions.items():
            compiled = self._covered.get(name)
            if compiled is None:
                return None
            try:
                given_array = np.asarray(value)
            except Exception:  # the per-world path raises its error
                return None
            if given_array.shape != (count, *compiled.shape):
                return None
            try:
                array = manager._numeric(compiled, given_array)
                manager._check_bounds(compiled, array)
            except errors.SpecValidationError:
                return None
            payload = _payloads(array, count)
            if payload is None:
                return None
            given.append(given_array)
            payloads.append(payload)
        names = tuple(actions)
        key = (names, tuple(payload.shape[1] for payload in payloads))
        if key not in self._templates:
            if len(self._templates) >= MAX_TEMPLATES:
                return None
            first = {name: array[0] for name, array in zip(names, given, strict=True)}
            self._templates[key] = self._template_for(first, payloads)
        template = self._templates[key]
        if template is None:
            return None
        return _rows(template, payloads, count)

    def _template_for(self, first: dict[str, Any], payloads: list[np.ndarray]) -> _Template | None:
        """The template of the first world's request; None if its payloads are not where
        and what ``_payloads`` makes them (then these names always take the slow path)."""
        learned = _learn(self._manager, self._adaptor._step_request, first)
        if learned is None:
            return None
        data, spans = learned
        template = np.frombuffer(data, np.uint8)
        for (start, stop), payload in zip(spans, payloads, strict=True):
            if not np.array_equal(template[start:stop], payload[0]):
                return None
        return _Template(template, spans)


def _rows(template: _Template, payloads: list[np.ndarray], count: int) -> list[bytes]:
    """``count`` copies of the template, each with its world's payloads written in."""
    size = template.data.size
    rows = np.empty((count, size), np.uint8)
    rows[:] = template.data
    for (start, stop), payload in zip(template.spans, payloads, strict=True):
        rows[:, start:stop] = payload
    data = rows.tobytes()
    return [data[index * size : (index + 1) * size] for index in range(count)]


# --- one step of one adaptor ----------------------------------------------------------------

_MASK64 = (1 << 64) - 1
# Dtypes whose array bytes (C order) are their payload's: bytes fields, and the fixed-width
# ones on a little-endian host.
_RAW: set[np.dtype] = {np.dtype(np.int8), np.dtype(np.uint8)}
if sys.byteorder == "little":
    _RAW |= {np.dtype(np.float32), np.dtype(np.float64)}
_UNSEEN: Any = object()


def _signed_varint(value: Any) -> bytes:
    """An int32 or int64 element: a negative one as its 64-bit two's complement (10 bytes)."""
    return _varint(int(value) & _MASK64)


def _unsigned_varint(value: Any) -> bytes:
    return _varint(int(value))


def _byte_table(low: int, high: int) -> Callable[[Any], bytes]:
    """The one-byte payload of each value in [low, high] (looked up by Python or NumPy value)."""
    return {value: bytes((value & 0xFF,)) for value in range(low, high + 1)}.__getitem__


# How a scalar the checks of ``SpecManager._pack_one`` took becomes its payload's bytes.
_SCALAR_WRITERS: dict[str, Callable[[Any], bytes]] = {
    "float32": struct.Struct("<f").pack,  # rounds as NumPy's cast; OverflowError: the slow path
    "float64": struct.Struct("<d").pack,
    "int8": _byte_table(-128, 127),
    "uint8": _byte_table(0, 255),
    "bool": {False: b"\x00", True: b"\x01"}.__getitem__,
    "int32": _signed_varint,
    "int64": _signed_varint,
    "uint32": _unsigned_varint,
    "uint64": _unsigned_varint,
}


class _Scalar(NamedTuple):
    """A scalar spec's fast path: the value types it takes as they are, their range, the writer."""

    accepted: frozenset[type]
    low: Any
    high: Any
    write: Callable[[Any], bytes]


class _Pieces(NamedTuple):
    """A template: a request's bytes between its payloads, and which payload goes where."""

    between: tuple[bytes, ...]  # before the first payload, ..., after the last; b"" for each
    order: tuple[int, ...] | None  # the caller's index of each payload in place; None: in order


class ActionEncoder:
    """Encodes one adaptor's step requests as bytes (see the module docstring).

    Args:
      actions: the adaptor's action specs (it makes a new encoder when they change).
    """

    def __init__(self, actions: specs.SpecManager) -> None:
        self._manager = actions
        self._covered = _covered(self._manager)
        self._scalars: dict[str, _Scalar] = {}
        for name, compiled in self._covered.items():
            if compiled.scalar_types:  # _pack_one's test: these types, then the limits
                low, high = compiled.scalar_limits or (False, True)  # None: bool, any bool
                self._scalars[name] = _Scalar(
                    frozenset((*compiled.scalar_types, compiled.dtype.type)),
                    low,
                    high,
                    _SCALAR_WRITERS[compiled.dtype.name],
                )
        # (names, payload lengths) -> the template; None: the slow path always.
        self._templates: dict[tuple[Any, ...], _Pieces | None] = {}

    def encode(self, action: Any, step_request: Callable[[Any], message.Message]) -> bytes | None:
        """The bytes of ``messages.envelope(step_request(action))``, or None: take that path.

        Only ``dict`` actions are encoded (nested dicts are flattened first, as
        ``SpecManager.pack`` does). ``step_request`` is the adaptor's (without the
        check that it is open): a new template is learned from its request. (The
        encoder does not keep it: the adaptor keeps the encoder.)
        """
        if type(action) is not dict:
            return None
        scalars = self._scalars
        payloads = []
        try:
            for name, value in action.items():
                scalar = scalars.get(name)
                if scalar is not None and type(value) in scalar[0]:
                    _, low, high, write = scalar
                    if not low <= value <= high:  # NaN too: the slow path raises or takes it
                        return None
                    payloads.append(write(value))
                elif isinstance(value, Mapping):
                    # No Mapping in it: one level down.
                    return self.encode(specs.flatten(action), step_request)
                else:
                    payload = self._checked_payload(name, value)
                    if payload is None:
                        return None
                    payloads.append(payload)
        except Exception:  # a value the checks refuse: the slow path raises its error
            return None
        key = (tuple(action), tuple(map(len, payloads)))
        pieces = self._templates.get(key, _UNSEEN)
        if pieces is _UNSEEN:
            if len(self._templates) >= MAX_TEMPLATES:
                return None
            pieces = self._templates[key] = self._template_for(action, payloads, step_request)
        if pieces is None:
            return None
        between, order = pieces
        if len(payloads) == 1:
            return between[0] + payloads[0] + between[2]
        parts = list(between)
        parts[1::2] = payloads if order is None else [payloads[index] for index in order]
        return b"".join(parts)

    def _checked_payload(self, name: Any, value: Any) -> bytes | None:
        """The payload of a covered spec's value, by the per-world path's checks; None if not covered.

        Raises:
          SpecValidationError (or any error of the checks): the slow path raises its own.
        """
        compiled = self._covered.get(name)
        if compiled is None:
            return None
        manager = self._manager
        array = manager._numeric(compiled, value)
        if array.shape != compiled.shape:
            return None
        # Within a scalar spec's limits means within its bounds: _pack_one's check.
        manager._check_bounds(compiled, array)
        if array.dtype in _RAW:
            return array.tobytes()
        payload = _payloads(array, 1)
        return None if payload is None else payload.tobytes()

    def _template_for(
        self,
        action: dict[Any, Any],
        payloads: list[bytes],
        step_request: Callable[[Any], message.Message],
    ) -> _Pieces | None:
        """The template of one real request of the slow path; None if its payloads are not
        where and what ``encode`` makes them (then these names always take the slow path)."""
        learned = _learn(self._manager, step_request, action)
        if learned is None:
            return None
        data, spans = learned
        # The map entries lie in protobuf's order, the same for the same names in the same
        # order (its table's), not the caller's: the payloads go in by their places.
        order = sorted(range(len(spans)), key=lambda index: spans[index][0])
        between: list[bytes] = []
        at = 0
        for index in order:
            start, stop = spans[index]
            if start < at or data[start:stop] != payloads[index]:
                return None
            between += (data[at:start], b"")
            at = stop
        between.append(data[at:])
        return _Pieces(tuple(between), None if order == sorted(order) else tuple(order))
