"""TensorSpecs: bounds, the UID <-> name ``SpecManager``, and ``dm_env.specs`` conversion.

A server describes its actions and observations as ``{uid: TensorSpec}`` maps.
``SpecManager`` turns user-facing values keyed by name (nested dicts for dotted
names: ``"arm.joint"`` is ``{"arm": {"joint": ...}}``) into ``{uid: Tensor}``
and back, validating dtype, shape and bounds on the way out::

    import numpy as np
    import dm_env_rpc_client as dmr

    spec = dmr.dm_env_rpc_pb2.TensorSpec(name="arm.joint", shape=[2], dtype=dmr.DataType.FLOAT)
    dmr.set_bounds(spec, -1.0, 1.0)
    manager = dmr.SpecManager({7: spec})
    tensors = manager.pack({"arm": {"joint": np.array([0.5, -0.5], np.float32)}})
    assert manager.unpack(tensors)["arm"]["joint"].tolist() == [0.5, -0.5]

Variable dimensions (a negative entry in ``TensorSpec.shape``) become
:class:`VariableArray` / :class:`VariableBoundedArray` dm_env specs: their
``shape`` keeps the ``-1`` and their ``validate`` accepts any length on that
axis; ``generate_value`` gives length 0 there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
from dm_env import specs as dm_specs

from dm_env_rpc_client import errors, tensors
from dm_env_rpc_client._proto import dm_env_rpc_pb2

TensorSpec = dm_env_rpc_pb2.TensorSpec
DataType = dm_env_rpc_pb2.DataType

_UNKNOWN_NAME = "Unknown {kind} name {name!r}. Known names: {known}."
_UNKNOWN_UID = "Unknown {kind} UID {uid}. Known UIDs: {known}."
_DUPLICATE = "{kind} specs {first} and {second} share the name {name!r}; names must be unique."
_WRONG_DTYPE = "{kind} {name!r} expects dtype {expected} but got {actual}; {fix}"
_WRONG_SHAPE = "{kind} {name!r} expects shape {expected} but got shape {actual}."
_OUT_OF_BOUNDS = (
    "{kind} {name!r} must lie in [{low}, {high}] but got {value}. Clip the value to its bounds."
)
_NON_NUMERIC_BOUNDS = "TensorSpec {name!r} has non-numeric dtype {dtype}, which has no bounds."
_BOUND_DTYPE = "TensorSpec {name!r} has dtype {dtype} but its {which} is of type {payload}."
_BAD_BOUNDS = "TensorSpec {name!r} has invalid bounds: {problem}."
_NESTING_CLASH = (
    "Names {a!r} and {b!r} cannot both be nested: one is a prefix of the other. "
    "Use nested=False to keep dotted keys."
)


class Bounds(NamedTuple):
    """Inclusive bounds of a numeric TensorSpec: scalars or arrays of its shape."""

    min: Any
    max: Any


def _numeric_dtype(spec: TensorSpec) -> np.dtype:
    dtype = tensors.DATA_TYPE_TO_NUMPY.get(spec.dtype)
    if dtype is None or dtype.kind not in "iuf":
        name = tensors._name(spec.dtype) if spec.dtype in tensors.DATA_TYPE_TO_NUMPY else spec.dtype
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
    if tensors._FIELD_TO_DATA_TYPE[payload] != spec.dtype:
        raise errors.BoundsError(
            _BOUND_DTYPE.format(
                name=spec.name, dtype=tensors._name(spec.dtype), which=which, payload=payload
            )
        )
    flat = tensors.payload_to_array(value, payload)
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
    """
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
            data = tensors.array_to_value_bytes(spec.dtype, flat)
            getattr(spec, which).MergeFromString(data)


# --- nesting ------------------------------------------------------------------------------


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flattens nested dicts into dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def unflatten(values: Mapping[str, Any]) -> dict[str, Any]:
    """Nests dotted keys: ``{"a.b": 1}`` -> ``{"a": {"b": 1}}``.

    Raises:
      SpecError: when one name is a prefix of another (``"a"`` and ``"a.b"``).
    """
    nested: dict[str, Any] = {}
    for name, value in values.items():
        parts = name.split(".")
        node = nested
        for index, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise errors.SpecError(
                    _NESTING_CLASH.format(a=".".join(parts[: index + 1]), b=name)
                )
            node = child
        if parts[-1] in node:
            raise errors.SpecError(_NESTING_CLASH.format(a=name, b=f"{name}.*"))
        node[parts[-1]] = value
    return nested


# --- SpecManager ------------------------------------------------------------------------------


class _Compiled(NamedTuple):
    uid: int
    spec: TensorSpec
    dtype: np.dtype
    shape: tuple[int, ...]
    variable: bool
    bounds: Bounds | None
    # For a scalar numeric spec: the Python scalar types it takes as they are, and the
    # range (bounds and dtype range) as Python numbers, None for no limit. A value in
    # it is checked without NumPy.
    scalar_types: tuple[type, ...] = ()
    scalar_limits: tuple[Any, Any] | None = None


def _scalar_bounds(found: Bounds | None) -> tuple[Any, Any] | None:
    """Bounds as Python numbers when both are scalars (None otherwise, or without bounds)."""
    if found is None or np.ndim(found[0]) or np.ndim(found[1]):
        return None
    return np.asarray(found[0]).item(), np.asarray(found[1]).item()


# The Python scalar types a dtype kind takes without a lossy cast (the rules of _numeric).
_SCALAR_TYPES = {"b": (bool,), "i": (int,), "u": (int,), "f": (float,)}


def _scalar_fast_path(
    dtype: np.dtype, shape: tuple[int, ...], found: Bounds | None
) -> tuple[tuple[type, ...], tuple[Any, Any] | None]:
    """``(scalar_types, scalar_limits)`` for a spec (no types: no fast path)."""
    types = _SCALAR_TYPES.get(dtype.kind, ())
    limits = _scalar_bounds(found)
    if shape or not types or (found is not None and limits is None):
        return (), None
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = (info.min, info.max) if limits is None else limits
        limits = (max(low, int(info.min)), min(high, int(info.max)))
    elif dtype.kind == "f" and limits is None:
        # What the dtype holds; inf and NaN lie outside and take the general checks.
        top = float(np.finfo(dtype).max)
        limits = (-top, top)
    return types, limits


class SpecManager:
    """Maps names to UIDs for a set of TensorSpecs, and packs and unpacks values.

    Args:
      specs: ``{uid: TensorSpec}``, e.g. ``join_response.specs.actions``.
      validate: check dtype, shape and bounds when packing (switch off for speed).
      kind: the word used in error messages ("action", "observation", ...).

    Raises:
      DuplicateNameError: if two specs share a name.
    """

    def __init__(
        self, specs: Mapping[int, TensorSpec], *, validate: bool = True, kind: str = "tensor"
    ) -> None:
        self._kind = kind
        self._validate = validate
        self._by_uid: dict[int, _Compiled] = {}
        self._by_name: dict[str, _Compiled] = {}
        for uid, spec in specs.items():
            previous = self._by_name.get(spec.name)
            if previous is not None:
                raise errors.DuplicateNameError(
                    _DUPLICATE.format(kind=kind, first=previous.uid, second=uid, name=spec.name)
                )
            dtype = tensors.DATA_TYPE_TO_NUMPY.get(spec.dtype)
            if dtype is None:
                raise errors.SpecError(
                    f"{kind} {spec.name!r} (UID {uid}) has invalid dtype {spec.dtype}."
                )
            shape = tuple(spec.shape)
            has_bounds = dtype.kind in "iuf" and (spec.HasField("min") or spec.HasField("max"))
            found = bounds(spec) if has_bounds else None
            scalar_types, scalar_limits = _scalar_fast_path(dtype, shape, found)
            compiled = _Compiled(
                uid=int(uid),
                spec=spec,
                dtype=dtype,
                shape=shape,
                variable=any(dim < 0 for dim in shape),
                bounds=found,
                scalar_types=scalar_types,
                scalar_limits=scalar_limits,
            )
            self._by_uid[int(uid)] = compiled
            self._by_name[spec.name] = compiled
        self._nested = any("." in name for name in self._by_name)

    def __repr__(self) -> str:
        return f"SpecManager({self._kind}s={sorted(self._by_name)})"

    def __len__(self) -> int:
        return len(self._by_uid)

    def _repr_html_(self) -> str:
        from dm_env_rpc_client import display
        from dm_env_rpc_client.environment import specs_table

        return display.specs_html(specs_table(self), f"{self._kind}s")

    def names(self) -> list[str]:
        """Returns the spec names, in UID order of the specs given."""
        return list(self._by_name)

    def uids(self) -> list[int]:
        """Returns the UIDs."""
        return list(self._by_uid)

    def _lookup_name(self, name: str) -> _Compiled:
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(repr(n) for n in sorted(self._by_name)) or "(none)"
            raise errors.UnknownNameError(
                _UNKNOWN_NAME.format(kind=self._kind, name=name, known=known)
            ) from None

    def _lookup_uid(self, uid: int) -> _Compiled:
        try:
            return self._by_uid[uid]
        except KeyError:
            known = ", ".join(str(u) for u in sorted(self._by_uid)) or "(none)"
            raise errors.UnknownUidError(
                _UNKNOWN_UID.format(kind=self._kind, uid=uid, known=known)
            ) from None

    def name_to_uid(self, name: str) -> int:
        """Returns the UID of a name; raises UnknownNameError listing the known names."""
        return self._lookup_name(name).uid

    def uid_to_name(self, uid: int) -> str:
        """Returns the name of a UID; raises UnknownUidError listing the known UIDs."""
        return self._lookup_uid(uid).spec.name

    def name_to_spec(self, name: str) -> TensorSpec:
        """Returns the TensorSpec of a name."""
        return self._lookup_name(name).spec

    def uid_to_spec(self, uid: int) -> TensorSpec:
        """Returns the TensorSpec of a UID."""
        return self._lookup_uid(uid).spec

    def pack(self, values: Mapping[str, Any]) -> dict[int, dm_env_rpc_pb2.Tensor]:
        """Packs values keyed by name (nested dicts or dotted keys) into ``{uid: Tensor}``.

        Raises:
          UnknownNameError: for a name not in the specs (the message lists the known ones).
          SpecValidationError: for a wrong dtype, shape or an out-of-bounds value
            (when validation is on).
        """
        if any(isinstance(v, Mapping) for v in values.values()):
            values = flatten(values)
        packed = {}
        for name, value in values.items():
            compiled = self._lookup_name(name)
            packed[compiled.uid] = self._pack_one(compiled, value)
        return packed

    def _pack_one(self, compiled: _Compiled, value: Any) -> dm_env_rpc_pb2.Tensor:
        dtype = compiled.dtype
        if not self._validate:
            return tensors.pack_tensor(value, dtype)
        if type(value) in compiled.scalar_types:  # a Python number for a scalar spec
            limits = compiled.scalar_limits
            if limits is None or limits[0] <= value <= limits[1]:
                return tensors.pack_tensor(np.array(value, dtype))
            # Out of range (or NaN): the checks below raise the right error.
        name = compiled.spec.name
        if dtype.kind in "US":
            array = np.asarray(value)
            if array.dtype.kind != "U" and not (array.dtype == object or array.size == 0):
                raise errors.SpecValidationError(
                    _WRONG_DTYPE.format(
                        kind=self._kind,
                        name=name,
                        expected="str",
                        actual=array.dtype,
                        fix="pass Python str values.",
                    )
                )
        elif dtype.kind == "O":
            array = np.empty((), dtype=object) if not isinstance(value, np.ndarray) else value
            if not isinstance(value, np.ndarray):
                array[()] = value
        else:
            array = self._numeric(compiled, value)
        self._check_shape(compiled, array.shape)
        scalar = compiled.scalar_limits
        if scalar is not None and array.ndim == 0 and scalar[0] <= array.item() <= scalar[1]:
            pass  # in bounds (NaN fails the comparison and takes the general check below)
        elif compiled.bounds is not None and array.size:
            low, high = compiled.bounds
            bad = (array < low) | (array > high)
            if bad.any():
                index = tuple(int(i) for i in np.argwhere(bad)[0])
                low_at = np.broadcast_to(low, array.shape)[index]
                high_at = np.broadcast_to(high, array.shape)[index]
                where = f" at index {index}" if index else ""
                raise errors.SpecValidationError(
                    _OUT_OF_BOUNDS.format(
                        kind=self._kind,
                        name=name,
                        low=low_at,
                        high=high_at,
                        value=f"{array[index]}{where}",
                    )
                )
        # A numeric array of the spec's dtype takes pack_tensor's fast path (dtype=None).
        return tensors.pack_tensor(array, None if array.dtype == dtype else dtype)

    def _numeric(self, compiled: _Compiled, value: Any) -> np.ndarray:
        dtype, name = compiled.dtype, compiled.spec.name
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            if array.dtype == dtype:
                return array
            ok = np.can_cast(array.dtype, dtype, "same_kind") and (
                array.dtype.kind != "b" or dtype.kind == "b"
            )
            actual: object = array.dtype
            fix = f"cast it with .astype(np.{dtype.name})."
        else:
            try:
                array = np.asarray(value)
            except ValueError as exc:
                raise errors.RaggedArrayError(f"{self._kind} {name!r}: {exc}") from exc
            kind = array.dtype.kind
            ok = (kind == "b" and dtype.kind == "b") or (
                (kind in "iu" and dtype.kind in "iuf") or (kind == "f" and dtype.kind == "f")
            )
            actual = f"{type(value).__name__} ({array.dtype})"
            fix = f"pass a value of dtype {dtype.name}."
        if not ok:
            raise errors.SpecValidationError(
                _WRONG_DTYPE.format(
                    kind=self._kind, name=name, expected=dtype.name, actual=actual, fix=fix
                )
            )
        if dtype.kind in "iu" and array.dtype.kind in "iu" and array.size:
            info = np.iinfo(dtype)
            if array.min() < info.min or array.max() > info.max:
                raise errors.SpecValidationError(
                    _OUT_OF_BOUNDS.format(
                        kind=self._kind, name=name, low=info.min, high=info.max, value=value
                    )
                    + f" ({dtype.name} cannot hold it.)"
                )
        if dtype.kind == "f" and array.dtype.kind == "f" and array.dtype.itemsize > dtype.itemsize:
            with np.errstate(over="ignore"):
                cast = array.astype(dtype)
            overflow = np.isinf(cast) & np.isfinite(array)
            if overflow.any():
                index = tuple(int(i) for i in np.argwhere(overflow)[0])
                top = np.finfo(dtype).max
                where = f" at index {index}" if index else ""
                raise errors.SpecValidationError(
                    _OUT_OF_BOUNDS.format(
                        kind=self._kind,
                        name=name,
                        low=str(-top),
                        high=str(top),
                        value=f"{array[index]}{where}",
                    )
                    + f" ({dtype.name} cannot hold it.)"
                )
            return cast
        return array.astype(dtype)

    def _check_shape(self, compiled: _Compiled, actual: tuple[int, ...]) -> None:
        expected = compiled.shape
        if actual == expected:
            return
        fits = len(actual) == len(expected) and all(
            want < 0 or want == got for want, got in zip(expected, actual, strict=True)
        )
        if not compiled.variable or not fits:
            raise errors.SpecValidationError(
                _WRONG_SHAPE.format(
                    kind=self._kind,
                    name=compiled.spec.name,
                    expected=list(expected),
                    actual=list(actual),
                )
            )

    def unpack(
        self, tensors_by_uid: Mapping[int, dm_env_rpc_pb2.Tensor], *, nested: bool = True
    ) -> dict[str, Any]:
        """Unpacks ``{uid: Tensor}`` into values keyed by name.

        Args:
          tensors_by_uid: e.g. ``step_response.observations``.
          nested: give nested dicts for dotted names (otherwise dotted keys).

        Raises:
          UnknownUidError: for a UID not in the specs.
        """
        values = {
            self._lookup_uid(uid).spec.name: tensors.unpack_tensor(tensor)
            for uid, tensor in tensors_by_uid.items()
        }
        return unflatten(values) if nested and self._nested else values

    def dm_env_specs(self, *, nested: bool = True) -> dict[str, Any]:
        """Returns the specs as ``dm_env.specs`` objects keyed by name."""
        converted = {
            name: tensor_spec_to_dm_env_spec(compiled.spec)
            for name, compiled in self._by_name.items()
        }
        return unflatten(converted) if nested and self._nested else converted


# --- dm_env spec conversion -------------------------------------------------------------------


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
    """
    shape = tuple(spec.shape)
    dtype = tensors.DATA_TYPE_TO_NUMPY[spec.dtype]
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
    """
    name = spec.name if name is None else name
    if isinstance(spec, dm_specs.StringArray):
        return TensorSpec(name=name or "", shape=spec.shape, dtype=DataType.STRING)
    dtype = np.dtype(spec.dtype)
    data_type = DataType.PROTO if dtype.kind == "O" else tensors.np_type_to_data_type(dtype)
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


__all__ = [
    "Bounds",
    "SpecManager",
    "VariableArray",
    "VariableBoundedArray",
    "bounds",
    "dm_env_spec_to_tensor_spec",
    "flatten",
    "flatten_dm_env_specs",
    "set_bounds",
    "tensor_spec_to_dm_env_spec",
    "unflatten",
]
