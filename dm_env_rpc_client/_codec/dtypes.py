"""The DataType <-> NumPy dtype tables and lookups, with the Tensor payload field of each.

The tables are drawn in the ``tensors`` module docstring. Lookups of a dtype
with no dm_env_rpc payload raise ``UnsupportedDtypeError`` with a fix to try.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import errors
from .._proto import dm_env_rpc_pb2
from .tensor_errors import _BAD_DTYPE_ARG, _NO_PAYLOAD, _UNSUPPORTED_DTYPE, _UNSUPPORTED_FIXES

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


def _aliases() -> dict[type, int]:
    """Every NumPy scalar type whose dtype is one of ``DATA_TYPE_TO_NUMPY``'s.

    NumPy has several scalar types per dtype: on Linux ``np.ulonglong`` (what a
    Python int of 2**63 or more becomes) is not ``np.uint64`` (``np.ulong``),
    though their dtypes are equal; ``np.intc`` is int32, ``np.longlong`` int64.
    Each is keyed here by its own type, so a lookup by ``dtype.type`` finds it.
    """
    table = {dtype.type: data_type for data_type, dtype in DATA_TYPE_TO_NUMPY.items()}
    for scalar in set(np.sctypeDict.values()):
        dtype = np.dtype(scalar)
        for data_type, supported in DATA_TYPE_TO_NUMPY.items():
            if dtype.kind in "biuf" and dtype == supported:
                table.setdefault(dtype.type, data_type)
    return table


# Keyed by scalar type (np.dtype(...).type, so '<U3' and '<U9' both match), aliases included.
NUMPY_TO_DATA_TYPE: Mapping[type, int] = _aliases()

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
}  # dtype equality and hashing ignore the scalar type: np.dtype(np.ulonglong) finds UINT64


def _name(data_type: int) -> str:
    return dm_env_rpc_pb2.DataType.Name(data_type)  # type: ignore[arg-type]


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
      UnsupportedDtypeError: for dtypes with no dm_env_rpc payload (float16, int16, ...),
        or a name NumPy does not know.
    """
    try:
        dtype = np.dtype(np_type)
    except TypeError as exc:
        raise errors.UnsupportedDtypeError(
            _UNKNOWN_DTYPE.format(value=np_type, error=exc)
        ) from None
    data_type = NUMPY_TO_DATA_TYPE.get(dtype.type)
    if data_type is None:
        raise _unsupported(dtype)
    return data_type


def get_tensor_type(tensor: dm_env_rpc_pb2.Tensor) -> type:
    """Returns the NumPy scalar type of a Tensor's payload.

    Raises:
      EmptyTensorError: if no payload is set.
      TensorTypeError: ``tensor`` is not a Tensor message.
    """
    try:
        field = tensor.WhichOneof("payload")
    except AttributeError:
        raise not_a_tensor(tensor) from None
    if field is None:
        raise errors.EmptyTensorError(_NO_PAYLOAD.format(shape=list(tensor.shape)))
    return DATA_TYPE_TO_NUMPY[_FIELD_TO_DATA_TYPE[field]].type


_UNKNOWN_DTYPE = "{value!r} is not a NumPy dtype ({error}); pass one, e.g. np.float32 or 'int64'."
_NOT_A_TENSOR = (
    "tensor is a dm_env_rpc Tensor message (as dmr.pack_tensor makes), not {kind}; "
    "to make one from a value, use dmr.pack_tensor(value)."
)


def not_a_tensor(value: Any) -> errors.TensorTypeError:
    """The error for something other than a Tensor message where one goes."""
    return errors.TensorTypeError(_NOT_A_TENSOR.format(kind=f"a {type(value).__name__}"))


def _unsupported(dtype: np.dtype) -> errors.UnsupportedDtypeError:
    fix = _UNSUPPORTED_FIXES.get(dtype.kind, "convert it to one of those.")
    what = f"dtype {dtype} (numpy.{dtype.type.__name__}, {dtype.itemsize} bytes)"
    return errors.UnsupportedDtypeError(_UNSUPPORTED_DTYPE.format(what=what, fix=fix))


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
