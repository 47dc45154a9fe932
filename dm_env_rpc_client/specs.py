"""TensorSpecs: the UID <-> name ``SpecManager`` that packs and checks values, and spec tables.

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

The spec helpers live in their own modules and are importable from here too:
bounds (``bounds``, ``set_bounds``: ``_codec.bounds``), nesting (``flatten``,
``unflatten``: ``_codec.nesting``) and ``dm_env.specs`` conversion
(``tensor_spec_to_dm_env_spec`` and back, ``VariableArray``: ``_codec.spec_conversion``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from . import errors, tensors
from ._base import checks as _checks
from ._codec.bounds import Bounds, bounds, set_bounds
from ._codec.nesting import flatten, unflatten
from ._codec.spec_conversion import (
    VariableArray,
    VariableBoundedArray,
    dm_env_spec_to_tensor_spec,
    flatten_dm_env_specs,
    tensor_spec_to_dm_env_spec,
)
from ._proto import dm_env_rpc_pb2

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


_SPECS_MAPPING = "a mapping {uid: TensorSpec} (e.g. a JoinWorldResponse's specs.observations)"


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
        _checks.check_type(specs, Mapping, "specs", _SPECS_MAPPING)
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
        from . import display  # presentation: only when rendered

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
        try:
            nested = any(isinstance(v, Mapping) for v in values.values())
        except AttributeError:
            what = "a dict of values keyed by name (e.g. {'paddle': 1})"
            _checks.check_type(values, Mapping, "values", what)
            raise
        if nested:
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
        kind = type(value)
        # A Python number, or a NumPy scalar of the spec's own dtype, for a scalar spec.
        if kind in compiled.scalar_types or (compiled.scalar_types and kind is dtype.type):
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
        else:
            self._check_bounds(compiled, array)
        # A numeric array of the spec's dtype takes pack_tensor's fast path (dtype=None).
        return tensors.pack_tensor(array, None if array.dtype == dtype else dtype)

    def _check_bounds(self, compiled: _Compiled, array: np.ndarray) -> None:
        """Raises ``SpecValidationError`` for the first element outside the spec's bounds.

        ``array`` is of the spec's shape, or (``_fastpath.step_encoder``) of several worlds'
        actions stacked along a leading axis; NaN lies in bounds.
        """
        if compiled.bounds is None or not array.size:
            return
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
                    name=compiled.spec.name,
                    low=low_at,
                    high=high_at,
                    value=f"{array[index]}{where}",
                )
            )

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


def specs_table(manager: SpecManager) -> list[tuple[str, int, str, tuple[int, ...], str]]:
    """Rows of (name, uid, dtype, shape, bounds) for display."""
    rows = []
    for name in manager.names():
        spec = manager.name_to_spec(name)
        dtype = tensors.DATA_TYPE_TO_NUMPY[spec.dtype]
        bound = ""
        if dtype.kind in "iuf" and (spec.HasField("min") or spec.HasField("max")):
            low, high = bounds(spec)
            bound = f"[{low}, {high}]"
        rows.append((name, manager.name_to_uid(name), str(dtype), tuple(spec.shape), bound))
    return rows


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
    "specs_table",
    "tensor_spec_to_dm_env_spec",
    "unflatten",
]
