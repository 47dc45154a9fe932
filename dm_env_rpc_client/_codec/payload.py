"""Varint and payload codec: flat NumPy arrays <-> the wire bytes of Tensor payloads.

Numeric payloads are written and read as the raw bytes of the packed repeated
field: the wire bytes of a packed ``repeated float`` are exactly a
little-endian float32 array, and varint fields (int32, int64, uint32, uint64,
bool) are encoded and decoded with vectorized NumPy code. No Python lists.
"""

from __future__ import annotations

import numpy as np
from google.protobuf import message

from .dtypes import _BYTES, _FIELD_TO_DATA_TYPE, _FIXED, _PAYLOAD, DATA_TYPE_TO_NUMPY, DataType

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


_ARRAY_TAG = 1 << 3 | 2  # XxxArray.array: packed (or bytes), field 1


def _payload_body(serialized: bytes) -> bytes | memoryview | None:
    """The content of field 1 of a serialized ``XxxArray`` sub-message.

    None when the bytes hold anything but that one field (an unknown field a
    server added): its bytes are not the array's, and the caller reads the
    message's parsed ``array`` instead.
    """
    if not serialized:
        return b""
    if serialized[0] != _ARRAY_TAG:
        return None
    length, pos = _read_varint(serialized, 1)
    if pos + length != len(serialized):
        return None
    return memoryview(serialized)[pos:]


_FLOAT32 = np.dtype(np.float32)


def _read_fixed(payload: message.Message, wire: str, dtype: np.dtype) -> np.ndarray:
    """A fresh, aligned, writable array from a fixed-width payload (one copy, no lists).

    A view of the serialized bytes would save the copy but would be read-only and
    misaligned (the payload starts after a tag and a length), which slows every
    NumPy operation on it and upsets libraries that take arrays zero-copy.
    """
    body = _payload_body(payload.SerializeToString())
    if body is None:
        return np.array(payload.array, dtype)  # type: ignore[attr-defined]
    return np.frombuffer(body, dtype=wire).astype(dtype)


def _unpack_numeric(data_type: int, payload: message.Message) -> np.ndarray:
    dtype = DATA_TYPE_TO_NUMPY[data_type]
    if data_type in _BYTES:
        return np.frombuffer(payload.array, dtype=dtype)  # type: ignore[attr-defined]
    if data_type in _FIXED:
        return _read_fixed(payload, _FIXED[data_type], dtype)
    body = _payload_body(payload.SerializeToString())
    if body is None:
        return np.array(payload.array, dtype)  # type: ignore[attr-defined]
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


def _shape_bytes(shape: tuple[int, ...]) -> bytes:
    if not shape:
        return b""
    dims = b"".join([_varint(dim & 0xFFFFFFFFFFFFFFFF) for dim in shape])
    return b"\x7a" + _varint(len(dims)) + dims


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
