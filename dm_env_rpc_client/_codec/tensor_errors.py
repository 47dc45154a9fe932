"""Error message templates of the tensor codec; each says what to do next.

Formatted with ``str.format`` by ``tensors``, ``_codec.dtypes`` and ``_codec.payload`` and
raised as the ``errors`` module's tensor errors.
"""

from __future__ import annotations

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
