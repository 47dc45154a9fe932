"""What a server sends, checked against its specs and decoded: one path for every way of stepping.

``ObservationPlan`` is compiled once per set of specs and requested
observations. Lockstep ``step``, ``step_async``, ``step_iter`` and the batch
all decode through it, so they accept and refuse the same responses:

- every requested observation must be in the response;
- no observation UID outside the specs may be;
- each tensor's payload must be of its spec's dtype (an int64 payload for a
  float32 spec is refused, not converted), and its shape must fit the spec's
  (a ``-1`` in the spec fits any length; a one-element payload may broadcast to
  a fully known shape, as the protocol allows).

A response that breaks these raises ``ObservationError`` (a ``ProtocolError``)
naming the observation, its UID and, for a run of responses, the position of
the offending one. Observations the specs have but nobody requested are
dropped. The checks run on the parsed messages before any payload is decoded
(a shape of (52428800, 1) for a [2, 3] spec is refused without decoding), and
cost a few hundred nanoseconds per tensor: a map lookup, ``WhichOneof`` and a
shape comparison.

``decode`` gives one response's observations; ``columns`` gives a run of
responses' observations stacked as ``[N, ...]`` arrays, decoding each
fixed-width observation of all of them with one NumPy call
(``tensors.stack_tensors``), which is what makes ``step_iter`` and the batch
cheaper per step than stepping one at a time. Once a run has been checked this
way, the plan learns its byte layout (``_fastpath.layout``): later runs whose responses
serialize to the same bytes outside the payloads skip the per-tensor checks,
which they would pass by construction (8 Catch responses: 45 µs to 11 µs).

A plan made with ``copy=False`` gives each large walked payload
(``_fastpath.wire_step.WireTensor``) as a read-only view of its response's bytes where
it can (``WireTensor.viewable``), and ``columns`` leaves such an observation
as the list of the N views rather than stacking it (which would copy); where
it cannot, the usual copy, stacked.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import errors, tensors
from .._codec.payload import _ARRAY_TAG
from .._proto import dm_env_rpc_pb2
from . import layout as _layout
from .raw_step import RawStep
from .wire_step import WireTensor

_TENSOR_FIELDS = dm_env_rpc_pb2.Tensor.DESCRIPTOR.fields_by_name
_StepResponse = dm_env_rpc_pb2.StepResponse
# What a layout reads from its bytes (SerializeToString): a parsed StepResponse, or a batch's
# answer still in its bytes (_fastpath.raw_step).
_SERIALIZED = (_StepResponse, RawStep)
_SERIALIZED_KINDS, _RAW_ONLY = set(_SERIALIZED), {RawStep}
_BODY = operator.attrgetter("body")
_LAYOUTS = 16  # how many times a plan learns a response layout (see _learn)
_FIELD_OF_TYPE = {
    field.number: field.name
    for field in dm_env_rpc_pb2.Tensor.DESCRIPTOR.oneofs_by_name["payload"].fields
}

# Scalar payloads read without NumPy's array machinery: the field's one element, as the
# NumPy scalar unpack_tensor would give.
_SCALAR_TYPES: dict[str, Any] = {
    "floats": np.float32,
    "doubles": np.float64,
    "int32s": np.int32,
    "int64s": np.int64,
    "uint32s": np.uint32,
    "uint64s": np.uint64,
    "bools": np.bool_,
}

# Fixed-width payload fields: the little-endian wire dtype of their packed array.
_FIXED_WIRE: dict[str, np.dtype] = {"floats": np.dtype("<f4"), "doubles": np.dtype("<f8")}

_WHERE = "The server's step response{position}"
_MISSING = (
    "{where} lacks the requested observation {name!r} (UID {uid}). The server does not "
    "send what was asked of it: check its step code, or request fewer observations "
    "(requested_observations=)."
)
_UNKNOWN = (
    "{where} carries observation UID {uid}, which is not in the server's specs (known UIDs: "
    "{known}). The server's step code and its specs disagree: fix the server."
)
_WRONG_DTYPE = (
    "{where} carries observation {name!r} (UID {uid}) as {actual} but its spec says "
    "{expected}. The server's step code and its specs disagree: fix the server."
)
_WRONG_SHAPE = (
    "{where} carries observation {name!r} (UID {uid}) with shape {actual} but its spec says "
    "{expected}. The server's step code and its specs disagree: fix the server."
)
_BAD_COUNT = (
    "{where} carries observation {name!r} (UID {uid}) with shape {shape} ({count:,} elements) "
    "but a payload of {found:,} elements; refused before anything was decoded. The server's "
    "step code builds a malformed tensor: fix the server."
)
_UNREADABLE = (
    "{where} carries observation {name!r} (UID {uid}), which cannot be decoded ({error}); "
    "fix the server."
)


def _type_name(data_type: int) -> str:
    try:
        name = dm_env_rpc_pb2.DataType.Name(data_type)  # type: ignore[arg-type]
    except ValueError:
        return f"DataType {data_type}"
    dtype = tensors.DATA_TYPE_TO_NUMPY.get(data_type)
    return name if dtype is None or dtype.kind in "OU" else f"{name} ({dtype.name})"


def _fits(spec_shape: tuple[int, ...], shape: Sequence[int]) -> bool:
    return len(spec_shape) == len(shape) and all(
        want < 0 or want == got for want, got in zip(spec_shape, shape, strict=True)
    )


class _Column(NamedTuple):
    name: str
    uid: int
    data_type: int
    field: str | None  # the payload oneof field of data_type
    shape: tuple[int, ...]
    shape_list: list[int]  # for a cheap comparison with a message's repeated shape field
    variable: bool  # the spec has a -1 dimension
    scalar: Any  # for a scalar spec of a repeated-field payload: the NumPy scalar type
    fixed: tuple[np.dtype, np.dtype, int, int] | None  # (wire, native, count, serialized size)


class ObservationPlan:
    """Checks and decodes the requested observations of StepResponses. See the module docs.

    Args:
      specs: the observation specs, ``{uid: TensorSpec}``.
      uids: the requested observations' UIDs, in the order to return them.
      copy: False gives large walked payloads as read-only views (see the module docs).
    """

    def __init__(
        self,
        specs: Mapping[int, dm_env_rpc_pb2.TensorSpec],
        uids: Sequence[int],
        copy: bool = True,
    ) -> None:
        self._specs = dict(specs)
        self._copy = copy
        self.columns_spec = [
            _Column(
                spec.name,
                uid,
                spec.dtype,
                _FIELD_OF_TYPE.get(spec.dtype),
                tuple(spec.shape),
                list(spec.shape),
                any(dim < 0 for dim in spec.shape),
                None if spec.shape else _SCALAR_TYPES.get(_FIELD_OF_TYPE.get(spec.dtype, "")),
                _fixed(spec),
            )
            for uid in uids
            for spec in [self._specs[uid]]
        ]
        self._uids = {column.uid for column in self.columns_spec}
        self._layout: _layout.Layout | None = None  # see columns and _layout
        self._layouts_left = _LAYOUTS

    # --- checks -----------------------------------------------------------------------------

    def _error(self, template: str, position: int | None, column: _Column, **fields: Any) -> Any:
        where = _WHERE.format(position="" if position is None else f" at position {position}")
        message = template.format(where=where, name=column.name, uid=column.uid, **fields)
        return errors.ObservationError(message, column.name, column.uid, position)

    def _tensors(
        self, observations: Mapping[int, dm_env_rpc_pb2.Tensor], position: int | None
    ) -> list[dm_env_rpc_pb2.Tensor]:
        """The requested tensors of one response, in order; raises on a missing or unknown UID."""
        found = [observations.get(column.uid) for column in self.columns_spec]
        if len(observations) != len(found) or None in found:
            for column, tensor in zip(self.columns_spec, found, strict=True):
                if tensor is None:
                    raise self._error(_MISSING, position, column)
            for uid in observations:
                if uid not in self._specs:
                    where = _WHERE.format(
                        position="" if position is None else f" at position {position}"
                    )
                    raise errors.ObservationError(
                        _UNKNOWN.format(where=where, uid=uid, known=sorted(self._specs)),
                        None,
                        uid,
                        position,
                    )
        return found  # type: ignore[return-value]

    def _check(self, column: _Column, tensor: Any, position: int | None) -> bool:
        """Checks one tensor's payload type and declared shape; True if exactly the spec's shape.

        A declared shape with a -1 (inferred from the element count) is checked
        once decoded (``_unpack``). A payload whose element count contradicts the
        shape (and is not one element, a broadcast) is refused here, before
        anything is decoded, where its length is known without decoding: a
        walked payload, or a parsed float or double one.
        """
        which: str | None = tensor.WhichOneof("payload")
        if which != column.field:
            actual = "no payload"
            if which is not None:
                actual = f"{which} ({_type_name(_TENSOR_FIELDS[which].number)})"
            raise self._error(
                _WRONG_DTYPE, position, column, actual=actual, expected=_type_name(column.data_type)
            )
        if tensor.__class__ is WireTensor and tensor.bad is not None:
            shape = list(tensor.shape)
            found = tensor.bad if tensor.bad % 1 else int(tensor.bad)
            raise self._error(
                _BAD_COUNT, position, column, shape=shape, count=math.prod(shape), found=found
            )
        exact = not column.variable and tensor.shape == column.shape_list
        if not exact:
            shape = list(tensor.shape)
            if -1 not in shape and not _fits(column.shape, shape):
                raise self._error(
                    _WRONG_SHAPE, position, column, actual=shape, expected=column.shape_list
                )
        if column.fixed is not None and tensor.__class__ is not WireTensor:
            # A parsed float/double payload's length is at hand: refuse a wrong one here.
            found = len(getattr(tensor, which).array)  # type: ignore[arg-type]
            count = column.fixed[2]
            if found != count and found != 1:  # not a broadcast either
                shape = list(tensor.shape)
                raise self._error(
                    _BAD_COUNT, position, column, shape=shape, count=count, found=found
                )
        return exact

    def _unpack(
        self, column: _Column, tensor: dm_env_rpc_pb2.Tensor, position: int | None, exact: bool
    ) -> Any:
        """Decodes one checked tensor; unless ``exact``, checks the decoded shape too."""
        if exact and column.scalar is not None:
            array = getattr(tensor, column.field)  # type: ignore[arg-type]
            if len(array.array) == 1:
                return column.scalar(array.array[0])
        if isinstance(tensor, WireTensor):  # exact shape and count, by construction
            return tensor.array(self._copy)
        if exact and column.fixed is not None:
            # The packed array's bytes follow a tag and a length: read them at their offset.
            wire, native, count, size = column.fixed
            serialized = getattr(tensor, column.field).SerializeToString()  # type: ignore[arg-type]
            if len(serialized) == size and count and serialized[0] == _ARRAY_TAG:
                flat = np.frombuffer(serialized, wire, count, size - count * wire.itemsize)
                return flat.astype(native).reshape(column.shape)
        try:
            value = tensors.unpack_tensor(tensor)
        except errors.TensorError as exc:
            raise self._error(_UNREADABLE, position, column, error=exc) from exc
        if not exact:
            shape = getattr(value, "shape", ())
            if not _fits(column.shape, shape):
                raise self._error(
                    _WRONG_SHAPE, position, column, actual=list(shape), expected=column.shape_list
                )
        return value

    # --- decoding ---------------------------------------------------------------------------

    def decode(
        self, observations: Mapping[int, dm_env_rpc_pb2.Tensor], position: int | None = None
    ) -> dict[str, Any]:
        """One response's requested observations by (dotted) name, checked.

        Args:
          observations: ``step_response.observations``.
          position: the response's position in a run, for error messages.

        Raises:
          ObservationError: a missing, unknown, mistyped or misshapen observation.
        """
        return {
            column.name: self._unpack(
                column, tensor, position, self._check(column, tensor, position)
            )
            for column, tensor in zip(
                self.columns_spec, self._tensors(observations, position), strict=True
            )
        }

    def decode_response(self, response: Any) -> dict[str, Any]:
        """``decode(response.observations)``, by the learned layout when the response fits it."""
        if type(response) not in _SERIALIZED or (self._layout is None and self._layouts_left <= 0):
            return self.decode(response.observations)
        data = response.SerializeToString()
        if self._layout is not None:
            fast = self._layout.one(data)
            if fast is not None:
                return fast
        decoded = self.decode(response.observations)
        if self._layouts_left > 0:
            self._learn(data, decoded)
        return decoded

    def columns(self, responses: Sequence[dm_env_rpc_pb2.StepResponse]) -> dict[str, Any]:
        """Each requested observation of all the responses, by name, checked.

        A column is a ``[N, ...]`` array where every tensor has the spec's exact
        shape and a fixed-width dtype, else the list of the N decoded values (for
        a plan made with ``copy=False``, also where all N can be views).

        Raises:
          ObservationError: as ``decode``, naming the offending response's position.
        """
        parts: list[Any] | None = None
        layouts = self._layout is not None or self._layouts_left > 0
        kinds = set(map(type, responses))
        if layouts and kinds <= _SERIALIZED_KINDS:
            # A batch's answers are RawSteps: their bytes as the server sent them, unparsed.
            bodies: list[Any] = list(map(_BODY, responses)) if kinds == _RAW_ONLY else [None]
            if None in bodies:  # some are messages (or known only as messages)
                bodies = [response.SerializeToString() for response in responses]
            parts = bodies
            if self._layout is not None:
                fast = self._layout.columns(parts)
                if fast is not None:
                    return fast
        found = [
            self._tensors(response.observations, position)
            for position, response in enumerate(responses)
        ]
        flat: dict[str, Any] = {}
        for index, column in enumerate(self.columns_spec):
            items = [tensors_of[index] for tensors_of in found]
            exact = True
            for position, tensor in enumerate(items):
                exact = self._check(column, tensor, position) and exact
            stacked = _stack(items, column, self._copy) if exact else None
            if stacked is None:
                flat[column.name] = [
                    self._unpack(column, tensor, position, exact=False)
                    for position, tensor in enumerate(items)
                ]
            else:
                flat[column.name] = stacked
        if parts is not None and self._layouts_left > 0:
            self._learn(parts[0], {name: column[0] for name, column in flat.items()})
        return flat

    def _learn(self, data: bytes, checked: dict[str, Any]) -> None:
        """Learns the layout of a response whose observations were just checked and decoded.

        Kept only if decoding ``data`` by it gives exactly the ``checked`` values
        (dtype, shape and bytes).
        A plan relearns after a run that did not fit, at most ``_LAYOUTS`` times
        (a server whose layout keeps changing costs a bounded number of walks).
        """
        self._layouts_left -= 1
        layout = _layout.learn(data, self.columns_spec)
        fast = layout.columns([data]) if layout is not None else None
        if fast is not None and all(
            _same(fast[name][0], np.asarray(value)) for name, value in checked.items()
        ):
            self._layout = layout


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _fixed(spec: dm_env_rpc_pb2.TensorSpec) -> tuple[np.dtype, np.dtype, int, int] | None:
    """For a fixed-width spec of a known shape: wire and native dtypes, count, serialized size."""
    wire = _FIXED_WIRE.get(_FIELD_OF_TYPE.get(spec.dtype, ""))
    if wire is None or any(dim < 0 for dim in spec.shape):
        return None
    count = math.prod(spec.shape)
    body = count * wire.itemsize
    length = 1  # the bytes of the body's length varint
    while body >> (7 * length):
        length += 1
    return wire, tensors.DATA_TYPE_TO_NUMPY[spec.dtype], count, 1 + length + body


def _stack(items: Sequence[Any], column: _Column, copy: bool = True) -> np.ndarray | None:
    """``[N, *shape]`` from tensors of the spec's exact shape, or None (then one by one).

    Walked payloads mixed with parsed ones are left one by one, and so are
    those that can all be views, unless ``copy``.
    """
    if any(isinstance(item, WireTensor) for item in items):
        if not all(isinstance(item, WireTensor) for item in items):
            return None
        if not copy and all(item.viewable() for item in items):
            return None  # one view per step: stacking would copy
        out = np.empty((len(items), *column.shape), tensors.DATA_TYPE_TO_NUMPY[column.data_type])
        for row, item in zip(out.reshape(len(items), -1), items, strict=True):
            row[...] = item.view()  # the one copy of each payload
        return out
    return tensors.stack_tensors(items, column.data_type, column.shape, checked=True)  # _check
