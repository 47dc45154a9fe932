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
caller gives them: the order of the request's map entries follows it), with the
places of its payloads read from its bytes; the requests of all the worlds are
then written by one NumPy copy per action. Varint payloads (int32, int64,
uint32, uint64, bool) qualify when all their values take varints of one length,
as small non-negative integers (discrete actions) do.

``encode`` returns None for anything else, and the caller takes the per-world
path, which raises its own errors (naming the world): a value that fails a check,
an unknown name, a string, proto, empty or variable-shape spec, a list of
per-world dicts, varints of different lengths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from dm_env_rpc_client import errors, messages, specs
from dm_env_rpc_client._adaptor_core import AdaptorCore
from dm_env_rpc_client._wire import _encode_varints, _read_varint
from dm_env_rpc_client._wire_step import _Unexpected, entry, payload_body

MAX_TEMPLATES = 32  # sets of action names (with payload sizes) kept; others take the slow path
_STEP_TAG = 3 << 3 | 2  # EnvironmentRequest.step
_ENTRY_TAG = 1 << 3 | 2  # StepRequest.actions: a map entry (uid, Tensor), as observations'


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


def _payload_spans(data: bytes, uids: list[int]) -> list[tuple[int, int]] | None:
    """Where the payload of each of ``uids`` lies in a step's EnvironmentRequest bytes.

    Returns None unless the bytes are laid out as expected: a ``step`` field holding
    map entries (key, then a Tensor whose first field is its payload) and whatever
    follows them (``requested_observations``). The entries and payloads are read as
    a response's observations are (``_wire_step``).
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


class StepEncoder:
    """Encodes the step requests of worlds that share ``template``'s action specs.

    Args:
      template: one of the worlds' adaptors; its action specs and requested
        observations are every world's.
    """

    def __init__(self, template: AdaptorCore) -> None:
        self._adaptor = template
        self._manager = template._actions
        # The specs the fast path covers: fixed-width numeric, a known shape, some elements.
        self._covered = {
            name: compiled
            for name, compiled in self._manager._by_name.items()
            if compiled.dtype.kind in "biuf"
            and not compiled.variable
            and math.prod(compiled.shape) > 0
        }
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
        data, _ = messages.envelope(self._adaptor._step_request(first))
        uids = [self._manager.name_to_uid(name) for name in first]
        spans = _payload_spans(data, uids)
        if spans is None:
            return None
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
