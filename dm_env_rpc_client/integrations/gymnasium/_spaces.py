"""Gymnasium spaces from dm_env_rpc TensorSpecs, and values in and out of them.

``spaces_from_specs`` maps each TensorSpec to a space (the table is in
``docs/gymnasium.md`` and in its docstring) and nests dotted names as ``Dict``
spaces. ``SpaceAdapter`` keeps one side (actions or observations) of a world:
its space, and the small conversions between the adaptor's nested dicts and
the space's values (a lone tensor unwrapped, NumPy scalars as 0-d arrays).
Tensors with no gymnasium space (string arrays, variable dimensions, protos)
raise ``SpecError`` naming the tensor and how to leave it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import gymnasium
import numpy as np
from dm_env import specs as dm_specs
from gymnasium import spaces

from ... import errors, specs, tensors
from ..._proto import dm_env_rpc_pb2

TensorSpec = dm_env_rpc_pb2.TensorSpec

_NO_SPACE = "The {kind} {name!r} is {what}, which has no gymnasium space. {fix}"
_LEAVE_OUT = {
    "observation": "Leave it out: pass requested_observations=[...] without it.",
    "action": (
        "Leave it out: pass actions=[...] without it (the server then gets no value for it)."
    ),
}
_TEXT_SAMPLE_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "
TEXT_MAX_LENGTH = 1 << 20
"""The longest string an ``AnyText`` space admits."""


class AnyText(spaces.Text):
    """A ``Text`` space that admits any Python string of up to ``max_length`` characters.

    A server may send any Unicode text, and gymnasium's ``Text`` admits only the
    characters of its charset, so ``contains`` checks the type and length only.
    ``sample()`` draws up to 16 letters, digits and spaces (a server may refuse
    more exotic text, and a million-character sample helps no one).

    Args:
      max_length: the longest string admitted.
      seed: the space's random seed.
    """

    def __init__(self, max_length: int = TEXT_MAX_LENGTH, seed: Any = None) -> None:
        super().__init__(max_length, min_length=0, charset=_TEXT_SAMPLE_CHARS, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is None and probability is None:
            length = int(self.np_random.integers(0, min(16, self.max_length) + 1))
            return super().sample(mask=(length, None))
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"


def space_from_spec(spec: TensorSpec, kind: str = "observation") -> gymnasium.Space[Any]:
    """The gymnasium space of one TensorSpec (see ``spaces_from_specs`` for the table).

    Args:
      spec: the TensorSpec.
      kind: ``"observation"`` or ``"action"``, for the error message.

    Raises:
      SpecError: the tensor has no gymnasium space; the message names it and says
        how to leave it out.
    """
    dtype = tensors.DATA_TYPE_TO_NUMPY[spec.dtype]
    shape = tuple(spec.shape)
    what = None
    if any(dim < 0 for dim in shape):
        what = f"of variable shape {list(shape)}"
    elif dtype.kind == "O":
        what = "a proto tensor"
    elif dtype.kind == "U" and shape:
        what = f"a string array of shape {list(shape)}"
    if what is not None:
        raise errors.SpecError(
            _NO_SPACE.format(kind=kind, name=spec.name, what=what, fix=_LEAVE_OUT[kind])
        )
    if dtype.kind == "U":
        return AnyText()
    if dtype.kind == "b":
        return spaces.Box(0, 1, shape, np.bool_)  # type: ignore[arg-type]
    converted = specs.tensor_spec_to_dm_env_spec(spec)
    if isinstance(converted, dm_specs.DiscreteArray):
        return spaces.Discrete(converted.num_values, dtype=dtype.type)
    low, high = specs.bounds(spec)
    return spaces.Box(np.broadcast_to(low, shape), np.broadcast_to(high, shape), shape, dtype.type)


def spaces_from_specs(
    tensor_specs: Mapping[int, TensorSpec] | Iterable[TensorSpec],
    *,
    names: Iterable[str] | None = None,
    kind: str = "observation",
) -> spaces.Dict:
    """The gymnasium ``Dict`` space of a world's actions or observations.

    ============================== ==================================================
    TensorSpec                     space
    ============================== ==================================================
    bounded numeric                ``Box(low, high, shape, dtype)``: dtype kept, scalar
                                   bounds broadcast to the shape
    scalar integer, min 0 and max  ``Discrete(max + 1, dtype=dtype)`` (a dm_env
                                   ``DiscreteArray``)
    unbounded numeric              ``Box`` over the dtype's range (integers) or
                                   ``[-inf, inf]`` (floats)
    bool                           ``Box(False, True, shape, bool)``
    scalar string                  ``AnyText()``: any ``str``
    string array, variable (-1)    ``SpecError`` naming the tensor and saying how to
    dimension, proto               leave it out
    dotted names ``a.b``           nested ``Dict({"a": Dict({"b": ...})})``
    ============================== ==================================================

    Args:
      tensor_specs: ``{uid: TensorSpec}`` (as in ``ActionObservationSpecs``) or TensorSpecs.
      names: only these tensors (dotted names); default all of them.
      kind: ``"observation"`` or ``"action"``, for error messages.

    Returns:
      A ``Dict`` space keyed like the SDK's nested values.

    Raises:
      SpecError: a tensor has no gymnasium space, or ``names`` lists an unknown name.
    """
    values = tensor_specs.values() if isinstance(tensor_specs, Mapping) else tensor_specs
    by_name = {spec.name: spec for spec in values}
    wanted = list(by_name) if names is None else list(names)
    for name in wanted:
        if name not in by_name:
            known = ", ".join(sorted(by_name)) or "(none)"
            raise errors.UnknownNameError(f"Unknown {kind} name {name!r}. Known names: {known}.")
    flat = {name: space_from_spec(by_name[name], kind) for name in wanted}
    return _as_dict(specs.unflatten(flat))


def _as_dict(tree: Mapping[str, Any]) -> spaces.Dict:
    return spaces.Dict(
        {
            key: _as_dict(value) if isinstance(value, Mapping) else value
            for key, value in tree.items()
        }
    )


class SpaceAdapter:
    """One side of a world as a gymnasium space, and its values in and out.

    Args:
      tensor_specs: the side's ``{uid: TensorSpec}``.
      names: the dotted names it shows (observations: what the adaptor returns).
      kind: ``"observation"`` or ``"action"``.
      unwrap_single: a side of exactly one tensor is that tensor's space, not a ``Dict``.
    """

    def __init__(
        self,
        tensor_specs: Mapping[int, TensorSpec],
        names: Iterable[str],
        kind: str,
        unwrap_single: bool,
    ) -> None:
        self.names = list(names)
        self.dict_space = spaces_from_specs(tensor_specs, names=self.names, kind=kind)
        self.single = self.names[0] if unwrap_single and len(self.names) == 1 else None
        self.space: gymnasium.Space[Any] = (
            self.dict_space if self.single is None else leaf(self.dict_space, self.single)
        )
        # Where a NumPy scalar must become a 0-d array (Box holds arrays; Discrete scalars).
        self._boxes = [
            name.split(".")
            for name in self.names
            if isinstance(leaf(self.dict_space, name), spaces.Box)
            and not leaf(self.dict_space, name).shape
        ]
        self._scalars = [
            name
            for name in self.names
            if isinstance(leaf(self.dict_space, name), (spaces.Box, spaces.Discrete))
            and not leaf(self.dict_space, name).shape
        ]

    def to_sdk(self, value: Any, lenient: bool = False) -> Any:
        """A gymnasium value (an action) as the SDK's nested dict.

        Args:
          value: a value of ``space`` (one world's).
          lenient: also take what TorchRL's ``GymWrapper`` sends: the bare value
            of a one-tensor ``Dict``, and a scalar tensor as shape ``[1]``.
        """
        if self.single is not None or (lenient and len(self.names) == 1 and _bare(value)):
            value = specs.unflatten({self.names[0]: value})
        if lenient and self._scalars and isinstance(value, Mapping):
            flat = dict(specs.flatten(value))
            for name in self._scalars:
                item = flat.get(name)
                if isinstance(item, np.ndarray) and item.shape == (1,):
                    flat[name] = item.reshape(())
            value = specs.unflatten(flat)
        return value

    def from_sdk(self, value: dict[str, Any]) -> Any:
        """The SDK's nested dict (an observation; changed in place) as a value of the space."""
        for path in self._boxes:
            parent = value
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = np.asarray(parent[path[-1]])
        if self.single is None:
            return value
        return leaf(value, self.single)


def _bare(value: Any) -> bool:
    """Not a mapping: a lone tensor's value."""
    return not isinstance(value, Mapping)


def leaf(tree: Any, dotted: str) -> Any:
    """The value (or space) at a dotted name of a nested dict (or ``Dict`` space)."""
    for part in dotted.split("."):
        tree = tree[part]
    return tree
