"""Inclusive bounds of numeric TensorSpecs: read, check and write ``min``/``max``.

An unset bound is the dtype's limit (``-inf``/``inf`` for floats). Bounds are
scalars, or arrays of the spec's shape; a variable shape takes scalars only.
Every bad bound raises ``BoundsError`` naming the spec and the problem.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import errors
from .._base import checks as _checks
from .._proto import dm_env_rpc_pb2
from .dtypes import _FIELD_TO_DATA_TYPE, DATA_TYPE_TO_NUMPY, _name
from .payload import array_to_value_bytes, payload_to_array

TensorSpec = dm_env_rpc_pb2.TensorSpec

_NON_NUMERIC_BOUNDS = "TensorSpec {name!r} has non-numeric dtype {dtype}, which has no bounds."
_BOUND_DTYPE = "TensorSpec {name!r} has dtype {dtype} but its {which} is of type {payload}."
_BAD_BOUNDS = "TensorSpec {name!r} has invalid bounds: {problem}."


class Bounds(NamedTuple):
    """Inclusive bounds of a numeric TensorSpec: scalars or arrays of its shape."""

    min: Any
    max: Any


def _numeric_dtype(spec: TensorSpec) -> np.dtype:
    dtype = DATA_TYPE_TO_NUMPY.get(spec.dtype)
    if dtype is None or dtype.kind not in "iuf":
        name = _name(spec.dtype) if spec.dtype in DATA_TYPE_TO_NUMPY else spec.dtype
        raise errors.BoundsError(_NON_NUMERIC_BOUNDS.format(name=spec.name, dtype=name))
    return dtype


def _range(dtype: np.dtype) -> tuple[Any, Any]:
    if dtype.kind == "f":
        return dtype.type(-np.inf), dtype.type(np.inf)
    info = np.iinfo(dtype)
    return dtype.type(info.min), dtype.type(info.max)


def _read_bound(spec: TensorSpec, which: str, dtype: np.dtype, default: Any) -> Any:
    value = getattr(spec, which)
    payload = value.WhichOneof("payload")
    if payload is None:
        return default
    if _FIELD_TO_DATA_TYPE[payload] != spec.dtype:
        raise errors.BoundsError(
            _BOUND_DTYPE.format(
                name=spec.name, dtype=_name(spec.dtype), which=which, payload=payload
            )
        )
    flat = payload_to_array(value, payload)
    if flat.size == 1:
        return flat[0]
    shape = tuple(spec.shape)
    if any(dim < 0 for dim in shape):
        raise errors.BoundsError(
            _BAD_BOUNDS.format(
                name=spec.name,
                problem=f"a variable shape {list(shape)} takes scalar bounds only",
            )
        )
    if flat.size != math.prod(shape):
        raise errors.BoundsError(
            _BAD_BOUNDS.format(
                name=spec.name,
                problem=f"{which} has {flat.size} elements but shape {list(shape)} needs 1 "
                f"or {math.prod(shape)}",
            )
        )
    return flat.reshape(shape)


def _check_bounds(name: str, dtype: np.dtype, minimum: Any, maximum: Any) -> None:
    low, high = np.asarray(minimum), np.asarray(maximum)
    if dtype.kind == "f" and (np.isnan(low).any() or np.isnan(high).any()):
        raise errors.BoundsError(_BAD_BOUNDS.format(name=name, problem="NaN is not a bound"))
    if np.any(low > high):
        raise errors.BoundsError(
            _BAD_BOUNDS.format(
                name=name, problem=f"min {_show(minimum)} is larger than max {_show(maximum)}"
            )
        )


def _show(value: Any) -> Any:
    array = np.asarray(value)
    return array.reshape(-1)[0] if array.size == 1 else array.tolist()


def bounds(spec: TensorSpec) -> Bounds:
    """Returns the inclusive bounds of a numeric TensorSpec.

    An unset bound is the dtype's limit (``-inf``/``inf`` for floats).

    Args:
      spec: the TensorSpec.

    Returns:
      ``Bounds(min, max)``: NumPy scalars, or arrays of the spec's shape.

    Raises:
      BoundsError: for a non-numeric dtype, a bound of another type, a bound of
        the wrong size, NaN, or min > max.
      ArgumentTypeError: ``spec`` is not a TensorSpec.
    """
    _checks.check_tensor_spec(spec)
    dtype = _numeric_dtype(spec)
    low, high = _range(dtype)
    minimum = _read_bound(spec, "min", dtype, low)
    maximum = _read_bound(spec, "max", dtype, high)
    _check_bounds(spec.name, dtype, minimum, maximum)
    return Bounds(minimum, maximum)


def _bound_value(spec: TensorSpec, dtype: np.dtype, value: Any, which: str) -> Any:
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise errors.BoundsError(
            _BAD_BOUNDS.format(name=spec.name, problem=f"{which} {value!r} is not a number")
        )
    if array.dtype.kind == "f" and np.isnan(array).any():
        raise errors.BoundsError(_BAD_BOUNDS.format(name=spec.name, problem="NaN is not a bound"))
    shape = tuple(spec.shape)
    if array.size != 1:
        if any(dim < 0 for dim in shape):
            raise errors.BoundsError(
                _BAD_BOUNDS.format(
                    name=spec.name,
                    problem=f"a variable shape {list(shape)} takes scalar bounds only",
                )
            )
        if array.shape != shape:
            raise errors.BoundsError(
                _BAD_BOUNDS.format(
                    name=spec.name,
                    problem=f"{which} has shape {array.shape}; use a scalar or shape {shape}",
                )
            )
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if array.dtype.kind == "f" and not np.array_equal(array, np.trunc(array)):
            raise errors.BoundsError(
                _BAD_BOUNDS.format(name=spec.name, problem=f"{which} {value} is not integral")
            )
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise errors.BoundsError(
                _BAD_BOUNDS.format(
                    name=spec.name,
                    problem=f"{which} {value} does not fit {dtype.name} [{info.min}, {info.max}]",
                )
            )
    elif array.size and np.isfinite(array).all():
        info = np.finfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise errors.BoundsError(
                _BAD_BOUNDS.format(
                    name=spec.name, problem=f"{which} {value} does not fit {dtype.name}"
                )
            )
    return array.astype(dtype).reshape(-1)


def set_bounds(spec: TensorSpec, minimum: Any, maximum: Any) -> None:
    """Sets (or, with None, clears) the inclusive bounds of a numeric TensorSpec.

    Args:
      spec: a TensorSpec whose name, dtype and shape are already set.
      minimum: a scalar or an array of the spec's shape, or None to clear.
      maximum: a scalar or an array of the spec's shape, or None to clear.

    Raises:
      BoundsError: for a non-numeric dtype, values not representable in the dtype,
        NaN, per-element bounds on a variable shape, or min > max.
    """
    dtype = _numeric_dtype(spec)
    low = None if minimum is None else _bound_value(spec, dtype, minimum, "min")
    high = None if maximum is None else _bound_value(spec, dtype, maximum, "max")
    if low is not None and high is not None:
        _check_bounds(spec.name, dtype, low, high)
    for which, flat in (("min", low), ("max", high)):
        getattr(spec, which).Clear()
        if flat is not None:
            data = array_to_value_bytes(spec.dtype, flat)
            getattr(spec, which).MergeFromString(data)
