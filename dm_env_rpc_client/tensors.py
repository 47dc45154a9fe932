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
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from google.protobuf import any_pb2, message

from dm_env_rpc_client import errors
from dm_env_rpc_client._proto import dm_env_rpc_pb2

DataType = dm_env_rpc_pb2.DataType

DATA_TYPE_TO_NUMPY: Mapping[int, np.dtype] = {  # keyed by DataType values
    DataType.FLOAT: np.dtype(np.float32),
    DataType.DOUBLE: np.dtype(np.float64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.BOOL: np.dtype(np.bool_),
    DataType.STRING: np.dtype(np.str_),
    DataType.PROTO: np.dtype(object),
}

# Keyed by dtype *kind+size* through np.dtype(...).type, so '<U3' and '<U9' both match.
NUMPY_TO_DATA_TYPE: Mapping[type, int] = {
    dtype.type: data_type for data_type, dtype in DATA_TYPE_TO_NUMPY.items()
}

# DataType -> (Tensor payload field name, Tensor field number, TensorSpec.Value field number)
_PAYLOAD: dict[int, tuple[str, int, int | None]] = {
    DataType.FLOAT: ("floats", 1, 9),
    DataType.DOUBLE: ("doubles", 2, 10),
    DataType.INT8: ("int8s", 3, 11),
    DataType.INT32: ("int32s", 4, 12),
    DataType.INT64: ("int64s", 5, 13),
    DataType.UINT8: ("uint8s", 6, 14),
    DataType.UINT32: ("uint32s", 7, 15),
    DataType.UINT64: ("uint64s", 8, 16),
    DataType.BOOL: ("bools", 9, None),
    DataType.STRING: ("strings", 10, None),
    DataType.PROTO: ("protos", 11, None),
}
_FIELD_TO_DATA_TYPE: dict[str, int] = {
    field: data_type for data_type, (field, _, _) in _PAYLOAD.items()
}
_FIXED: dict[int, str] = {DataType.FLOAT: "<f4", DataType.DOUBLE: "<f8"}
_BYTES: set[int] = {DataType.INT8, DataType.UINT8}
_VARINT: set[int] = {
    DataType.INT32,
    DataType.INT64,
    DataType.UINT32,
    DataType.UINT64,
    DataType.BOOL,
}

# Native-byte-order numeric dtypes that pack as they are.
_BYTES_FIELD: dict[np.dtype, str] = {np.dtype(np.int8): "int8s", np.dtype(np.uint8): "uint8s"}
_NATIVE_NUMERIC: dict[np.dtype, int] = {
    DATA_TYPE_TO_NUMPY[data_type]: data_type for data_type in (*_FIXED, *_BYTES, *_VARINT)
}


def _name(data_type: int) -> str:
    return dm_env_rpc_pb2.DataType.Name(data_type)  # type: ignore[arg-type]


OnOverflow = Literal["error", "wrap", "clip"]

_UNSUPPORTED_DTYPE = (
    "dm_env_rpc has no payload for {what}. Supported dtypes: float32, float64, int8, int32, "
    "int64, uint8, uint32, uint64, bool, str and protobuf messages; {fix}"
)
_UNSUPPORTED_FIXES = {
    "f": "cast it, e.g. value.astype(np.float32).",
    "i": "cast it, e.g. value.astype(np.int32).",
    "u": "cast it, e.g. value.astype(np.uint32).",
    "c": "split complex values into real and imaginary float arrays.",
    "S": "decode bytes to str, or pass raw bytes as a uint8 array (np.frombuffer(b, np.uint8)).",
    "M": "convert datetimes to numbers, e.g. value.astype('datetime64[ns]').astype(np.int64).",
    "m": "convert timedeltas to numbers, e.g. value.astype('timedelta64[ns]').astype(np.int64).",
}
_RAGGED = (
    "Cannot pack a ragged value: nested sequences have unequal lengths ({error}). "
    "Pad them to one shape, or send each as its own tensor."
)
_INTEGER_RANGE = (
    "Value out of range for {dtype}: values span [{low}, {high}] but {dtype} holds "
    "[{min}, {max}]. Pass a wider dtype, or on_overflow='wrap' or 'clip' to convert anyway."
)
_FRACTIONAL = (
    "Cannot pack non-integral floating-point values as {dtype} without losing the fractional "
    "part; round them first (np.rint) or pick a floating-point dtype."
)
_TWO_VARIABLE = (
    "Shape {shape} has more than one negative (variable) dimension; at most one is allowed."
)
_COUNT_MISMATCH = (
    "A tensor with {count} element(s) cannot have shape {shape}"
    "{detail}. Check the sender's shape, or send a broadcast of exactly one element."
)
_NO_PAYLOAD = (
    "The Tensor has no payload set (shape {shape}). Set one of its payload fields "
    "(floats, doubles, int8s, ..., protos), e.g. with pack_tensor()."
)
_NOT_A_STRING = (
    "A STRING tensor takes Python str only, but element {index} is {type_name}. "
    "Decode bytes with .decode() or convert values with str()."
)
_BAD_OBJECTS = (
    "An object array must hold only str or only protobuf messages, but element {index} is "
    "{type_name}. Convert the elements, or pass a numeric array."
)
_BAD_DTYPE_ARG = (
    "Unknown dtype {dtype!r}: pass a dm_env_rpc DataType (e.g. DataType.FLOAT) or a NumPy "
    "dtype (e.g. np.float32)."
)
_BAD_OVERFLOW = "on_overflow must be 'error', 'wrap' or 'clip', not {value!r}."


# --- varint wire encoding -------------------------------------------------------------


def _varint(value: int) -> bytes:
    """Encodes one non-negative integer (< 2**64) as a protobuf varint."""
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_ONE_BYTE = [bytes([value]) for value in range(0x80)]


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _encode_varints(values: np.ndarray) -> bytes:
    """Vectorized varint encoding of a 1-D integer or bool array.

    Signed values are sign-extended to 64 bits first, as protobuf does for
    int32 and int64. Every element is written with the same number of bytes,
    the width of the largest: protobuf parsers accept such over-long varints,
    and ``pack_tensor`` parses its bytes into a message, whose serialization is
    canonical again (so the wire bytes still equal the reference package's).
    """
    if values.dtype == np.bool_ or values.size == 0:
        return values.astype(np.uint8).tobytes()
    if values.dtype.kind == "i":
        wide = values.astype(np.int64, copy=False).view(np.uint64)
    else:
        wide = values.astype(np.uint64, copy=False)
    top = int(wide.max())
    if top < 0x80:
        return wide.astype(np.uint8).tobytes()
    width = (top.bit_length() + 6) // 7
    out = np.empty((wide.size, width), dtype=np.uint8)
    # Bits above 32 of an int32 are copies of its sign: compute the low five
    # bytes from a 32-bit view, and the rest from the sign alone.
    low = (
        values.astype(np.int32, copy=False).view(np.uint32) if values.dtype.itemsize <= 4 else wide
    )
    computed = min(width, 5) if low is not wide else width
    for k in range(computed):
        column = out[:, k]
        np.bitwise_and((low >> low.dtype.type(7 * k)).astype(np.uint8), np.uint8(0x7F), out=column)
        if k < width - 1:
            column |= np.uint8(0x80)
    if computed < width:
        negative = (values < 0).view(np.uint8)
        # byte 4 holds bits 28..34: bits 32..34 are the sign.
        out[:, 4] |= negative * np.uint8(0x70)
        for k in range(5, width):
            fill = np.uint8(0x01) if k == width - 1 else np.uint8(0x7F)
            np.multiply(negative, fill, out=out[:, k])
            if k < width - 1:
                out[:, k] |= np.uint8(0x80)
    return out.tobytes()


def _decode_varints(data: bytes | memoryview, dtype: np.dtype) -> np.ndarray:
    """Vectorized decoding of packed varints into an array of ``dtype``."""
    raw = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(raw < 0x80)
    count = ends.size
    if count == raw.size:  # every value fits one byte
        return raw.astype(dtype)
    index_type = np.int32 if raw.size < 2**31 - 16 else np.int64
    ends = ends.astype(index_type, copy=False)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    width = int(lengths.max())
    # 32-bit results need only the low 35 bits: the first five bytes.
    narrow = dtype.itemsize <= 4
    acc_type = np.uint32 if narrow else np.uint64
    used = min(width, 5) if narrow else width
    wide = (raw[starts] & np.uint8(0x7F)).astype(acc_type)
    last = raw.size - 1
    for k in range(1, used):
        index = np.minimum(starts + k, last)
        part = raw[index] & np.uint8(0x7F)
        part *= lengths > k
        wide |= part.astype(acc_type) << acc_type(7 * k)
    if dtype.kind == "i":
        return wide.view(np.int32 if narrow else np.int64).astype(dtype, copy=False)
    return wide.astype(dtype, copy=False)


# --- payload (sub-message) encoding -------------------------------------------------------


def _numeric_payload(data_type: int, flat: np.ndarray) -> bytes:
    """The serialized ``XxxArray`` sub-message (field 1) for a 1-D numeric array."""
    if data_type in _FIXED:
        body = flat.astype(_FIXED[data_type], copy=False).tobytes()
    elif data_type in _BYTES:
        body = flat.tobytes()
    else:
        body = _encode_varints(flat)
    if not body:
        return b""
    return b"\x0a" + _varint(len(body)) + body


def _payload_body(serialized: bytes) -> bytes | memoryview:
    """The content of field 1 of a serialized ``XxxArray`` sub-message."""
    if not serialized:
        return b""
    length, pos = _read_varint(serialized, 1)
    return memoryview(serialized)[pos : pos + length]


_FLOAT32 = np.dtype(np.float32)


def _read_fixed(payload: message.Message, wire: str, dtype: np.dtype) -> np.ndarray:
    """A fresh, aligned, writable array from a fixed-width payload (one copy, no lists).

    A view of the serialized bytes would save the copy but would be read-only and
    misaligned (the payload starts after a tag and a length), which slows every
    NumPy operation on it and upsets libraries that take arrays zero-copy.
    """
    serialized = payload.SerializeToString()
    if not serialized:
        return np.empty(0, dtype)
    _, pos = _read_varint(serialized, 1)
    return np.frombuffer(serialized, dtype=wire, offset=pos).astype(dtype)


def _unpack_numeric(data_type: int, payload: message.Message) -> np.ndarray:
    dtype = DATA_TYPE_TO_NUMPY[data_type]
    if data_type in _BYTES:
        return np.frombuffer(payload.array, dtype=dtype)  # type: ignore[attr-defined]
    if data_type in _FIXED:
        return _read_fixed(payload, _FIXED[data_type], dtype)
    body = _payload_body(payload.SerializeToString())
    if data_type == DataType.BOOL:
        return np.frombuffer(body, dtype=np.uint8) != 0
    return _decode_varints(body, dtype)


def payload_to_array(proto: message.Message, field: str) -> np.ndarray:
    """Reads the flat 1-D array of a payload oneof field (Tensor or TensorSpec.Value).

    Args:
      proto: a ``Tensor`` or ``TensorSpec.Value``.
      field: the name of its payload field that is set (e.g. ``"floats"``).

    Returns:
      A 1-D NumPy array of the payload's elements.
    """
    data_type = _FIELD_TO_DATA_TYPE[field]
    payload = getattr(proto, field)
    if data_type == DataType.STRING:
        return np.array(list(payload.array), dtype=np.str_)
    if data_type == DataType.PROTO:
        out = np.empty(len(payload.array), dtype=object)
        for index, item in enumerate(payload.array):
            out[index] = item
        return out
    return _unpack_numeric(data_type, payload)


def array_to_value_bytes(data_type: int, flat: np.ndarray) -> bytes:
    """Serializes a flat numeric array as a ``TensorSpec.Value`` (for spec bounds).

    Args:
      data_type: a numeric DataType other than BOOL.
      flat: the already-converted 1-D array.

    Returns:
      Bytes that ``TensorSpec.Value.FromString`` parses.
    """
    _, _, value_field = _PAYLOAD[data_type]
    assert value_field is not None
    return bytes(_build(value_field, data_type, flat, b""))


# --- dtype handling -------------------------------------------------------------------------


def data_type_to_np_type(data_type: int) -> type:
    """Returns the NumPy scalar type for a dm_env_rpc ``DataType``.

    Raises:
      UnsupportedDtypeError: for INVALID_DATA_TYPE or an unknown value.
    """
    try:
        return DATA_TYPE_TO_NUMPY[data_type].type
    except KeyError:
        raise errors.UnsupportedDtypeError(_BAD_DTYPE_ARG.format(dtype=data_type)) from None


def np_type_to_data_type(np_type: Any) -> int:
    """Returns the dm_env_rpc ``DataType`` for a NumPy dtype or scalar type.

    Raises:
      UnsupportedDtypeError: for dtypes with no dm_env_rpc payload (float16, int16, ...).
    """
    dtype = np.dtype(np_type)
    data_type = NUMPY_TO_DATA_TYPE.get(dtype.type)
    if data_type is None:
        raise _unsupported(dtype)
    return data_type


def get_tensor_type(tensor: dm_env_rpc_pb2.Tensor) -> type:
    """Returns the NumPy scalar type of a Tensor's payload.

    Raises:
      EmptyTensorError: if no payload is set.
    """
    field = tensor.WhichOneof("payload")
    if field is None:
        raise errors.EmptyTensorError(_NO_PAYLOAD.format(shape=list(tensor.shape)))
    return DATA_TYPE_TO_NUMPY[_FIELD_TO_DATA_TYPE[field]].type


def _unsupported(dtype: np.dtype) -> errors.UnsupportedDtypeError:
    fix = _UNSUPPORTED_FIXES.get(dtype.kind, "convert it to one of those.")
    return errors.UnsupportedDtypeError(_UNSUPPORTED_DTYPE.format(what=f"dtype {dtype}", fix=fix))


def _resolve_dtype(dtype: Any) -> int:
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype in DATA_TYPE_TO_NUMPY:
        return dtype
    if isinstance(dtype, (int, bool)) and not isinstance(dtype, np.generic):
        raise errors.UnsupportedDtypeError(_BAD_DTYPE_ARG.format(dtype=dtype))
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        raise errors.UnsupportedDtypeError(_BAD_DTYPE_ARG.format(dtype=dtype)) from None
    return np_type_to_data_type(numpy_dtype)


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
        raise ValueError(_BAD_OVERFLOW.format(value=on_overflow))
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


def _shape_bytes(shape: tuple[int, ...]) -> bytes:
    if not shape:
        return b""
    dims = b"".join([_varint(dim & 0xFFFFFFFFFFFFFFFF) for dim in shape])
    return b"\x7a" + _varint(len(dims)) + dims


def _pack_numeric(
    shape: tuple[int, ...], flat: np.ndarray, data_type: int
) -> dm_env_rpc_pb2.Tensor:
    if data_type in _BYTES:  # a ``bytes`` field: assigning it is cheapest
        tensor = dm_env_rpc_pb2.Tensor(shape=shape)
        getattr(tensor, _PAYLOAD[data_type][0]).array = flat.tobytes()
        return tensor
    number = _PAYLOAD[data_type][1]
    return dm_env_rpc_pb2.Tensor.FromString(_build(number, data_type, flat, _shape_bytes(shape)))  # type: ignore[arg-type]


# Wire bytes per element of each payload _build writes in one piece.
_ITEMSIZE: dict[int, int] = {
    data_type: np.dtype(_FIXED.get(data_type, DATA_TYPE_TO_NUMPY[data_type])).itemsize
    for data_type in (*_FIXED, *_BYTES)
}
_SMALL_PAYLOAD = 4096  # bytes


def _build(number: int, data_type: int, flat: np.ndarray, trailer: bytes) -> bytearray:
    """Serializes ``field number { array: flat }`` + trailer into one buffer.

    Fixed-width and byte payloads are written straight into the preallocated
    buffer with a single NumPy copy (converting to little-endian on the way).
    """
    if data_type in _FIXED or data_type in _BYTES:
        target = _FIXED.get(data_type, DATA_TYPE_TO_NUMPY[data_type])
        size = flat.size * _ITEMSIZE[data_type]
        inner_head = b"\x0a" + _varint(size) if size else b""
        head = _varint(number << 3 | 2) + _varint(len(inner_head) + size) + inner_head
        if size <= _SMALL_PAYLOAD:  # a few elements: one tobytes() beats the view below
            return bytearray(head + flat.astype(target, copy=False).tobytes() + trailer)
        buffer = bytearray(len(head) + size + len(trailer))
        buffer[: len(head)] = head
        if size:
            np.frombuffer(buffer, dtype=target, count=flat.size, offset=len(head))[:] = flat
        buffer[len(head) + size :] = trailer
        return buffer
    inner = _numeric_payload(data_type, flat)
    return bytearray(_varint(number << 3 | 2) + _varint(len(inner)) + inner + trailer)


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
    """
    field = tensor.WhichOneof("payload")
    shape = tensor.shape
    if field == "floats":  # the common cases first, with the least Python overhead
        flat = _read_fixed(tensor.floats, "<f4", _FLOAT32)
    elif field == "uint8s":
        flat = np.frombuffer(tensor.uint8s.array, dtype=np.uint8)
    elif field is None:
        raise errors.EmptyTensorError(_NO_PAYLOAD.format(shape=list(shape)))
    else:
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
    items: Sequence[dm_env_rpc_pb2.Tensor], data_type: int, shape: Sequence[int]
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
    for tensor in items:
        if tensor.WhichOneof("payload") != field or tuple(tensor.shape) != dims:
            return None
        payload = getattr(tensor, field)
        parts.append(_payload_body(payload.SerializeToString()) if fixed else payload.array)
    data = b"".join(parts)
    if len(data) != len(items) * math.prod(dims) * dtype.itemsize:
        return None
    wire = _FIXED[data_type] if fixed else dtype
    return np.frombuffer(data, dtype=wire).astype(dtype).reshape((len(items), *dims))


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
