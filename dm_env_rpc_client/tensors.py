"""NumPy <-> dm_env_rpc ``Tensor`` codec, without Python lists.

``pack_tensor`` turns a value into a ``Tensor`` and ``unpack_tensor`` turns it
back. Numeric payloads are written and read as the raw bytes of the packed
repeated field: the wire bytes of a packed ``repeated float`` are exactly a
little-endian float32 array, and varint fields (int32, int64, uint32, uint64,
bool) are encoded and decoded with vectorized NumPy code. The wire bytes equal
those of the reference ``dm-env-rpc`` package for the same input and dtype.

=========  ===========  ===========================  =================================
DataType   payload      NumPy dtype                  notes
=========  ===========  ===========================  =================================
FLOAT      ``floats``   ``float32``                  fixed width, raw bytes
DOUBLE     ``doubles``  ``float64``                  fixed width, raw bytes
INT8       ``int8s``    ``int8``                     ``bytes`` field; read-only view
INT32      ``int32s``   ``int32``                    varint
INT64      ``int64s``   ``int64``                    varint
UINT8      ``uint8s``   ``uint8``                    ``bytes`` field; read-only view
UINT32     ``uint32s``  ``uint32``                   varint
UINT64     ``uint64s``  ``uint64``                   varint
BOOL       ``bools``    ``bool``                     varint (one byte each)
STRING     ``strings``  ``str`` (``<U``)             Python ``str`` only
PROTO      ``protos``   ``object`` of ``Any``        messages are packed into ``Any``
=========  ===========  ===========================  =================================

Unpacked int8 and uint8 arrays are read-only views of the payload's ``bytes``
(no copy); call ``.copy()`` to get a writable array. Every other dtype unpacks
to a fresh, writable array.

Shapes: ``[]`` is a scalar and unpacks to a NumPy scalar (``str`` for strings,
``Any`` for protos). A payload of exactly one element with a larger shape is a
broadcast and unpacks to the full array; ``pack_tensor(..., try_compress=True)``
produces one when every element is equal. At most one dimension may be negative
(variable); its length is inferred from the element count.

Integers that do not fit an explicitly requested integer dtype are refused
(``IntegerRangeError``) unless ``on_overflow="wrap"`` (two's-complement
wrap-around, as ``ndarray.astype`` does) or ``on_overflow="clip"`` (saturate at the
dtype's limits) is given.

Example::

    import numpy as np
    import dm_env_rpc_client as dmr

    tensor = dmr.pack_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert dmr.unpack_tensor(tensor).shape == (2, 3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from google.protobuf import any_pb2, message

from . import errors
from ._codec.dtypes import (
    _BYTES,
    _BYTES_FIELD,
    _FIXED,
    _NATIVE_NUMERIC,
    _PAYLOAD,
    DATA_TYPE_TO_NUMPY,
    NUMPY_TO_DATA_TYPE,
    DataType,
    _name,
    _resolve_dtype,
    _unsupported,
    data_type_to_np_type,
    get_tensor_type,
    not_a_tensor,
    np_type_to_data_type,
)
from ._codec.payload import (
    _ARRAY_TAG,
    _FLOAT32,
    _build,
    _payload_body,
    _read_fixed,
    _shape_bytes,
    _varint,
    array_to_value_bytes,
    payload_to_array,
)
from ._codec.tensor_errors import (
    _BAD_OBJECTS,
    _BAD_OVERFLOW,
    _COUNT_MISMATCH,
    _FRACTIONAL,
    _INTEGER_RANGE,
    _NO_PAYLOAD,
    _NOT_A_STRING,
    _RAGGED,
    _TWO_VARIABLE,
    _UNSUPPORTED_DTYPE,
    _UNSUPPORTED_FIXES,
)
from ._proto import dm_env_rpc_pb2

OnOverflow = Literal["error", "wrap", "clip"]
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Payloads whose one-element, shape-[] Tensor unpacks to this NumPy scalar, read straight from
# the message (a seed, a size, a flag): the general decoder costs far more for one element.
_SCALARS: dict[str, type[np.generic]] = {
    "int64s": np.int64,
    "int32s": np.int32,
    "uint64s": np.uint64,
    "uint32s": np.uint32,
    "doubles": np.float64,
    "bools": np.bool_,
}


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bytes, bytearray)):
        raise errors.UnsupportedDtypeError(
            _UNSUPPORTED_DTYPE.format(what="bytes", fix=_UNSUPPORTED_FIXES["S"])
        )
    if isinstance(value, message.Message):
        array = np.empty((), dtype=object)
        array[()] = value
        return array
    try:
        return np.asarray(value)
    except ValueError as exc:
        raise errors.RaggedArrayError(_RAGGED.format(error=exc)) from exc


def _check_objects(array: np.ndarray) -> int:
    """Returns STRING or PROTO for an object array, or raises."""
    flat = array.ravel()
    if flat.size == 0:
        return DataType.PROTO
    first = flat[0]
    expected: type = str if isinstance(first, str) else message.Message
    for index, item in enumerate(flat):
        if not isinstance(item, expected):
            if isinstance(item, (list, tuple, np.ndarray)):
                raise errors.RaggedArrayError(_RAGGED.format(error="found nested sequences"))
            template = _NOT_A_STRING if expected is str else _BAD_OBJECTS
            raise errors.TensorTypeError(
                template.format(index=index, type_name=type(item).__name__)
            )
    return DataType.STRING if expected is str else DataType.PROTO


def _convert_numeric(array: np.ndarray, data_type: int, on_overflow: str) -> np.ndarray:
    target = DATA_TYPE_TO_NUMPY[data_type]
    if array.dtype == target:
        return array
    if target.kind in "iu" and array.dtype.kind in "iuf" and array.size:
        if array.dtype.kind == "f" and not np.array_equal(array, np.trunc(array)):
            raise errors.TensorValueError(_FRACTIONAL.format(dtype=target.name))
        info = np.iinfo(target)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            if on_overflow == "clip":
                array = np.clip(array, info.min, info.max)
            elif on_overflow == "error":
                raise errors.IntegerRangeError(
                    _INTEGER_RANGE.format(
                        dtype=target.name, low=low, high=high, min=info.min, max=info.max
                    )
                )
            elif array.dtype.kind == "f":  # wrap floats through int64
                array = array.astype(np.int64)
    return array.astype(target)


# --- public API -----------------------------------------------------------------------------


def pack_tensor(
    value: Any,
    dtype: Any = None,
    *,
    try_compress: bool = False,
    on_overflow: OnOverflow = "error",
) -> dm_env_rpc_pb2.Tensor:
    """Packs a value into a dm_env_rpc ``Tensor``.

    Args:
      value: a NumPy array or scalar, a Python scalar, ``str``, a protobuf message,
        or (nested) lists of those.
      dtype: the payload type: a dm_env_rpc ``DataType`` or a NumPy dtype. If None,
        it follows from the value (Python ``int`` -> int64, ``float`` -> float64).
      try_compress: if every element is equal, send one element with the full
        shape (a broadcast tensor).
      on_overflow: what to do when integers do not fit an explicit integer dtype:
        ``"error"`` (default), ``"wrap"`` or ``"clip"``.

    Returns:
      The Tensor.

    Raises:
      UnsupportedDtypeError: for a dtype with no dm_env_rpc payload.
      RaggedArrayError: for nested sequences of unequal lengths.
      IntegerRangeError: for integers that do not fit ``dtype``.
      TensorTypeError: for non-str elements of a STRING tensor, or mixed objects.
    """
    if dtype is None and type(value) is np.ndarray and not try_compress:
        field = _BYTES_FIELD.get(value.dtype)
        if field is not None:  # the fastest path: int8/uint8 into a ``bytes`` field
            tensor = dm_env_rpc_pb2.Tensor(shape=value.shape)
            getattr(tensor, field).array = value.tobytes()
            return tensor
        data_type = _NATIVE_NUMERIC.get(value.dtype)
        if data_type is not None:  # the fast path: a numeric array as it is
            return _pack_numeric(value.shape, value.reshape(-1), data_type)
    if on_overflow not in ("error", "wrap", "clip"):
        raise errors.ArgumentValueError(_BAD_OVERFLOW.format(value=on_overflow))
    if dtype is None and type(value) is int and _INT64_MIN <= value <= _INT64_MAX:
        # A Python int (a seed, a setting) made directly: the same message as the general
        # path's, at a fifteenth of its cost (its varint encoder is built for arrays).
        return dm_env_rpc_pb2.Tensor(int64s=dm_env_rpc_pb2.Tensor.Int64Array(array=[value]))
    array = _as_array(value)
    requested: int | None = None if dtype is None else _resolve_dtype(dtype)
    kind = array.dtype.kind
    if kind == "O":
        data_type = _check_objects(array)
        if requested is not None and requested != data_type and array.size:
            if requested == DataType.STRING:
                raise errors.TensorTypeError(
                    _NOT_A_STRING.format(index=0, type_name=type(array.flat[0]).__name__)
                )
            raise errors.TensorTypeError(
                f"Cannot pack {_name(data_type)} elements as "
                f"{_name(requested)}; pass dtype=None or convert the elements."
            )
        data_type = requested if requested is not None else data_type
    elif kind == "U":
        data_type = DataType.STRING
        if requested not in (None, DataType.STRING):
            raise errors.TensorTypeError(
                f"Cannot pack str values as {_name(requested)}; convert them first."
            )
    else:
        if kind not in "biuf" or array.dtype.type not in NUMPY_TO_DATA_TYPE:
            raise _unsupported(array.dtype)
        if requested in (DataType.STRING, DataType.PROTO):
            raise errors.TensorTypeError(
                f"Cannot pack {array.dtype} values as {_name(requested)}; "
                "pass str or protobuf message values."
            )
        data_type = requested if requested is not None else NUMPY_TO_DATA_TYPE[array.dtype.type]
        array = _convert_numeric(array, data_type, on_overflow)

    shape = array.shape
    flat = array.reshape(-1)
    if try_compress and flat.size > 1 and bool(np.all(flat == flat[0])):
        flat = flat[:1]

    field = _PAYLOAD[data_type][0]
    if data_type == DataType.STRING or data_type == DataType.PROTO:
        tensor = dm_env_rpc_pb2.Tensor(shape=shape)
        payload = getattr(tensor, field)
        payload.SetInParent()
        if data_type == DataType.STRING:
            payload.array.extend(flat.tolist())
        else:
            for item in flat:
                if isinstance(item, any_pb2.Any):
                    payload.array.append(item)
                else:
                    payload.array.add().Pack(item)
        return tensor

    return _pack_numeric(shape, flat, data_type)


def tensor_wire_bytes(value: Any, dtype: Any = None) -> bytes | bytearray:
    """The serialized ``Tensor`` for a value, without building a message when it can.

    A NumPy array of a native numeric dtype (and no ``dtype`` asked) is written
    straight to wire bytes; anything else goes through ``pack_tensor``. Servers
    use this to splice tensors into responses without copying them into messages.
    """
    if dtype is None and type(value) is np.ndarray:
        data_type = _NATIVE_NUMERIC.get(value.dtype)
        if data_type is not None:
            number = _PAYLOAD[data_type][1]
            return _build(number, data_type, value.reshape(-1), _shape_bytes(value.shape))
    return pack_tensor(value, dtype).SerializeToString()


def _pack_numeric(
    shape: tuple[int, ...], flat: np.ndarray, data_type: int
) -> dm_env_rpc_pb2.Tensor:
    if data_type in _BYTES:  # a ``bytes`` field: assigning it is cheapest
        tensor = dm_env_rpc_pb2.Tensor(shape=shape)
        getattr(tensor, _PAYLOAD[data_type][0]).array = flat.tobytes()
        return tensor
    number = _PAYLOAD[data_type][1]
    return dm_env_rpc_pb2.Tensor.FromString(_build(number, data_type, flat, _shape_bytes(shape)))  # type: ignore[arg-type]


def _resolve_shape(shape: list[int], count: int) -> tuple[int, ...]:
    negative = [i for i, dim in enumerate(shape) if dim < 0]
    if len(negative) > 1:
        raise errors.ShapeError(_TWO_VARIABLE.format(shape=shape))
    if negative:
        known = int(np.prod([d for d in shape if d >= 0], dtype=np.int64))
        if known == 0 or count % known:
            raise errors.ShapeError(
                _COUNT_MISMATCH.format(
                    count=count, shape=shape, detail=" (the variable dimension cannot be inferred)"
                )
            )
        resolved = list(shape)
        resolved[negative[0]] = count // known
        return tuple(resolved)
    raise errors.ShapeError(_COUNT_MISMATCH.format(count=count, shape=shape, detail=""))


def unpack_tensor(tensor: dm_env_rpc_pb2.Tensor) -> Any:
    """Unpacks a dm_env_rpc ``Tensor`` into a NumPy array or scalar.

    Args:
      tensor: the Tensor.

    Returns:
      A NumPy array of the Tensor's shape; for shape ``[]`` a NumPy scalar
      (``str`` for strings, ``google.protobuf.Any`` for protos).

    Raises:
      EmptyTensorError: if no payload is set.
      ShapeError: for two variable dimensions, or an element count that fits no shape.
      TensorTypeError: ``tensor`` is not a Tensor message.
    """
    try:
        field = tensor.WhichOneof("payload")
    except AttributeError:
        raise not_a_tensor(tensor) from None
    shape = tensor.shape
    if field == "floats":  # the common cases first, with the least Python overhead
        flat = _read_fixed(tensor.floats, "<f4", _FLOAT32)
    elif field == "uint8s":
        flat = np.frombuffer(tensor.uint8s.array, dtype=np.uint8)
    elif field is None:
        raise errors.EmptyTensorError(_NO_PAYLOAD.format(shape=list(shape)))
    else:
        scalar = _SCALARS.get(field)
        if scalar is not None and not shape:
            values = getattr(tensor, field).array
            if len(values) == 1:  # what payload_to_array's one element would be, made directly
                return scalar(values[0])
        flat = payload_to_array(tensor, field)
    if shape:
        try:  # the common case; NumPy also infers a single -1 dimension as we do
            return flat.reshape(shape)
        except ValueError:
            pass  # a broadcast, or an invalid shape: sorted out below
    dims = tuple(shape)
    count = flat.size
    if not dims:
        if count != 1:
            raise errors.ShapeError(_COUNT_MISMATCH.format(count=count, shape=[], detail=""))
        item = flat[0]
        return str(item) if isinstance(item, np.str_) else item
    if math.prod(dims) == count and min(dims) >= 0:
        return flat.reshape(dims)
    if count == 1 and min(dims) >= 0:  # a broadcast (needs a fully known shape)
        return np.full(dims, flat[0], dtype=flat.dtype)
    return flat.reshape(_resolve_shape(list(dims), count))


def stack_tensors(
    items: Sequence[dm_env_rpc_pb2.Tensor],
    data_type: int,
    shape: Sequence[int],
    *,
    checked: bool = False,
) -> np.ndarray | None:
    """Stacks Tensors of one fixed-width dtype and one known shape as a ``[N, *shape]`` array.

    The fast path for a batch of observations: the payloads are joined as raw
    bytes and decoded by one NumPy call. Returns None, and the caller unpacks
    the Tensors one by one, unless every Tensor has the ``data_type``'s payload
    field (float, double, int8 or uint8), exactly ``shape`` (no variable
    dimension) and exactly its element count (no broadcast).

    Args:
      items: the Tensors, e.g. one observation of many worlds.
      data_type: their ``DataType`` per the spec.
      shape: their shape per the spec.
      checked: the caller has checked already that every Tensor has the payload
        field and the shape (``_fastpath.decode``); each payload's size is still checked.
    """
    if data_type not in _FIXED and data_type not in _BYTES:
        return None
    field: str = _PAYLOAD[data_type][0]
    dims = tuple(shape)
    if any(d < 0 for d in dims):
        return None
    dtype = DATA_TYPE_TO_NUMPY[data_type]
    parts: list[bytes | memoryview] = []
    fixed = data_type in _FIXED
    each = math.prod(dims) * dtype.itemsize  # every payload's size: a sum could hide two wrong
    for tensor in items:
        if not checked and (tensor.WhichOneof("payload") != field or tuple(tensor.shape) != dims):
            return None
        payload = getattr(tensor, field)
        parts.append(payload.SerializeToString() if fixed else payload.array)
    wire = _FIXED[data_type] if fixed else dtype
    if fixed and each:
        # A packed array of ``each`` bytes serializes to its tag (field 1), the body's length
        # and the body: when every part is that, the bodies are one NumPy slice of the join.
        size = 1 + len(_varint(each)) + each
        if all(len(part) == size and part[0] == _ARRAY_TAG for part in parts):
            rows = np.frombuffer(b"".join(parts), np.uint8).reshape(len(items), size)
            body = rows[:, size - each :].copy().view(wire)
            return body.astype(dtype, copy=False).reshape((len(items), *dims))
    if fixed:
        bodies = [_payload_body(part) for part in parts]  # type: ignore[arg-type]
        if any(body is None for body in bodies):
            return None  # a payload with more than its array: one by one
        parts = bodies  # type: ignore[assignment]
    if any(len(part) != each for part in parts):
        return None
    return np.frombuffer(b"".join(parts), dtype=wire).astype(dtype).reshape((len(items), *dims))


__all__ = [
    "DATA_TYPE_TO_NUMPY",
    "NUMPY_TO_DATA_TYPE",
    "DataType",
    "OnOverflow",
    "array_to_value_bytes",
    "data_type_to_np_type",
    "get_tensor_type",
    "np_type_to_data_type",
    "pack_tensor",
    "payload_to_array",
    "stack_tensors",
    "unpack_tensor",
]
