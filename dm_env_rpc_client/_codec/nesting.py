"""Nested dicts <-> dotted names: ``{"arm": {"joint": 1}}`` <-> ``{"arm.joint": 1}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import errors

_NESTING_CLASH = (
    "Names {a!r} and {b!r} cannot both be nested: one is a prefix of the other. "
    "Use nested=False to keep dotted keys."
)


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
    if not any("." in name for name in values):
        return dict(values)  # nothing to nest (and so no clash)
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
