"""TensorSpec <-> ``dm_env.specs`` conversion, and dm_env specs with variable dimensions.

Variable dimensions (a negative entry in ``TensorSpec.shape``) become
:class:`VariableArray` / :class:`VariableBoundedArray` dm_env specs: their
``shape`` keeps the ``-1`` and their ``validate`` accepts any length on that
axis; ``generate_value`` gives length 0 there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from dm_env import specs as dm_specs

from .. import errors
from .._base import checks as _checks
from .._proto import dm_env_rpc_pb2
from .bounds import bounds, set_bounds
from .dtypes import DATA_TYPE_TO_NUMPY, DataType, np_type_to_data_type

TensorSpec = dm_env_rpc_pb2.TensorSpec


def _fits_variable(shape: tuple[int, ...], actual: tuple[int, ...]) -> bool:
    return len(shape) == len(actual) and all(
        want < 0 or want == got for want, got in zip(shape, actual, strict=True)
    )


class VariableArray(dm_specs.Array):
    """A ``dm_env`` Array spec with variable (-1) dimensions: any length fits there."""

    def validate(self, value: Any) -> np.ndarray:
        value = np.asarray(value)
        if not _fits_variable(self.shape, value.shape):
            self._fail_validation(f"Expected shape {self.shape} but found {value.shape}")
        if value.dtype != self.dtype:
            self._fail_validation(f"Expected dtype {self.dtype} but found {value.dtype}")
        return value

    def generate_value(self) -> np.ndarray:
        return np.zeros([max(dim, 0) for dim in self.shape], self.dtype)


class VariableBoundedArray(dm_specs.BoundedArray):
    """A ``dm_env`` BoundedArray with variable (-1) dimensions and scalar bounds."""

    def __init__(self, shape: Iterable[int], dtype: Any, minimum: Any, maximum: Any, name: str):
        # BoundedArray broadcasts bounds against the shape, which -1 breaks: use ().
        super().__init__((), dtype, minimum, maximum, name)
        self._shape = tuple(int(dim) for dim in shape)

    def validate(self, value: Any) -> np.ndarray:
        value = np.asarray(value)
        if not _fits_variable(self.shape, value.shape):
            self._fail_validation(f"Expected shape {self.shape} but found {value.shape}")
        if (value < self.minimum).any() or (value > self.maximum).any():
            self._fail_validation(
                f"Values were not all within bounds {self.minimum} <= {value} <= {self.maximum}"
            )
        return value

    def generate_value(self) -> np.ndarray:
        shape = [max(dim, 0) for dim in self.shape]
        return np.full(shape, self.minimum, self.dtype)


def tensor_spec_to_dm_env_spec(spec: TensorSpec) -> dm_specs.Array:
    """Converts a TensorSpec into a ``dm_env`` spec.

    STRING -> ``StringArray``; PROTO -> ``Array`` of object; numeric without bounds ->
    ``Array``; a scalar integer spec with min 0 and a max -> ``DiscreteArray``; other
    bounded specs -> ``BoundedArray``. Variable shapes -> ``VariableArray`` /
    ``VariableBoundedArray``.

    Raises:
      ArgumentTypeError: ``spec`` is not a TensorSpec.
    """
    _checks.check_tensor_spec(spec)
    shape = tuple(spec.shape)
    dtype = DATA_TYPE_TO_NUMPY[spec.dtype]
    variable = any(dim < 0 for dim in shape)
    if dtype.kind == "U":
        if variable:
            return VariableArray(shape, np.object_, name=spec.name)
        return dm_specs.StringArray(shape, name=spec.name)
    if dtype.kind == "O":
        return (VariableArray if variable else dm_specs.Array)(shape, dtype, name=spec.name)
    if not (spec.HasField("min") or spec.HasField("max")):
        return (VariableArray if variable else dm_specs.Array)(shape, dtype, name=spec.name)
    low, high = bounds(spec)
    if (
        dtype.kind in "iu"
        and shape == ()
        and spec.HasField("min")
        and spec.HasField("max")
        and low == 0
    ):
        return dm_specs.DiscreteArray(int(high) + 1, dtype=dtype, name=spec.name)
    if variable:
        return VariableBoundedArray(shape, dtype, low, high, spec.name)
    return dm_specs.BoundedArray(shape, dtype, low, high, name=spec.name)


def dm_env_spec_to_tensor_spec(spec: dm_specs.Array, name: str | None = None) -> TensorSpec:
    """Converts a ``dm_env`` spec into a TensorSpec (the way back).

    Args:
      spec: an ``Array``, ``BoundedArray``, ``DiscreteArray`` or ``StringArray``.
      name: the TensorSpec name; defaults to ``spec.name``.

    Raises:
      UnsupportedDtypeError: for a dtype dm_env_rpc cannot carry.
      ArgumentTypeError: ``spec`` is not a dm_env spec.
    """
    _checks.check_type(spec, dm_specs.Array, "spec", "a dm_env spec (dm_env.specs.Array, ...)")
    name = spec.name if name is None else name
    if isinstance(spec, dm_specs.StringArray):
        return TensorSpec(name=name or "", shape=spec.shape, dtype=DataType.STRING)
    dtype = np.dtype(spec.dtype)
    data_type = DataType.PROTO if dtype.kind == "O" else np_type_to_data_type(dtype)
    out = TensorSpec(name=name or "", shape=spec.shape, dtype=data_type)  # type: ignore[arg-type]
    if isinstance(spec, dm_specs.BoundedArray):
        minimum, maximum = np.asarray(spec.minimum), np.asarray(spec.maximum)
        low = minimum.flat[0] if minimum.size and np.all(minimum == minimum.flat[0]) else minimum
        high = maximum.flat[0] if maximum.size and np.all(maximum == maximum.flat[0]) else maximum
        set_bounds(out, low, high)
    return out


def flatten_dm_env_specs(nested: Any, prefix: str = "") -> dict[str, dm_specs.Array]:
    """Flattens a nested structure of dm_env specs into ``{dotted name: spec}``.

    Dicts nest by key; a single spec at the top level is named by ``prefix`` or its own name.
    """
    if isinstance(nested, dm_specs.Array):
        return {prefix or nested.name or "": nested}
    if isinstance(nested, Mapping):
        flat: dict[str, dm_specs.Array] = {}
        for key, value in nested.items():
            flat.update(flatten_dm_env_specs(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(nested, (list, tuple)):
        flat = {}
        for index, value in enumerate(nested):
            flat.update(flatten_dm_env_specs(value, f"{prefix}.{index}" if prefix else str(index)))
        return flat
    raise errors.SpecError(f"Cannot convert {type(nested).__name__} at {prefix!r} to a spec.")
