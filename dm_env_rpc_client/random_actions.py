"""Random actions for any dm_env action spec, deterministic for a seed.

``random_action(action_spec, rng)`` draws one action for a spec or a nested
dict (or list) of specs:

============================  ==================================================
spec                          value
============================  ==================================================
``DiscreteArray``             uniform integer in ``[0, num_values)``
bounded integers              uniform integer in ``[minimum, maximum]``
bounded floats                uniform float in ``[minimum, maximum)``
unbounded integers            uniform integer in ``[-100, 100]``, within the dtype
unbounded floats              uniform float in ``[-1, 1)``
half-bounded floats/ints      the bound and 2 (floats) or 200 (ints) beyond it
``bool``                      ``True`` or ``False``, each with probability 1/2
``StringArray`` / ``str``     1 to 8 lowercase ASCII letters
variable (-1) dimension       a length drawn uniformly from ``[1, 4]``
============================  ==================================================

``rng`` is a ``numpy.random.Generator`` or an integer seed. ``random_batch(spec,
num_envs, rng)`` draws a whole batch at once, stacked with the batch axis first
(what ``BatchedEnvironment.step`` takes), one NumPy call per spec.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from typing import Any

import numpy as np
from dm_env import specs as dm_specs

from . import errors

UNBOUNDED_INT = 100
UNBOUNDED_FLOAT = 1.0
VARIABLE_LENGTH = (1, 4)
STRING_LENGTH = (1, 8)
_LETTERS = np.array(list(string.ascii_lowercase))


def _shape(spec: dm_specs.Array, rng: np.random.Generator) -> tuple[int, ...]:
    low, high = VARIABLE_LENGTH
    return tuple(int(rng.integers(low, high + 1)) if dim < 0 else dim for dim in spec.shape)


def _limits(spec: dm_specs.Array) -> tuple[Any, Any]:
    if isinstance(spec, dm_specs.BoundedArray):
        return np.asarray(spec.minimum), np.asarray(spec.maximum)
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "f":
        return np.asarray(-np.inf), np.asarray(np.inf)
    info = np.iinfo(dtype)
    return np.asarray(info.min), np.asarray(info.max)


def _numbers(spec: dm_specs.Array, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    low, high = _limits(spec)
    if low.size == 1 and high.size == 1:  # scalar bounds, the common case: no array math
        return _scalar_bounds_drawer(spec, dtype, low.item(), high.item(), shape)(rng)
    if dtype.kind == "f":
        low_f = np.broadcast_to(low.astype(np.float64), shape)
        high_f = np.broadcast_to(high.astype(np.float64), shape)
        finite_low, finite_high = np.isfinite(low_f), np.isfinite(high_f)
        lo = np.where(finite_low, low_f, np.where(finite_high, high_f - 2, -UNBOUNDED_FLOAT))
        hi = np.where(finite_high, high_f, np.where(finite_low, low_f + 2, UNBOUNDED_FLOAT))
        return np.asarray(rng.uniform(lo, hi)).astype(dtype).reshape(shape)
    info = np.iinfo(dtype)
    wide = np.int64 if dtype.kind == "i" or dtype.itemsize < 8 else np.uint64
    typed_min, typed_max = dtype.type(info.min), dtype.type(info.max)
    if not isinstance(spec, dm_specs.BoundedArray):
        low = np.asarray(max(int(typed_min), -UNBOUNDED_INT))
        high = np.asarray(min(int(typed_max), UNBOUNDED_INT))
    elif np.all(low == typed_min) and not np.all(high == typed_max):
        low = np.maximum(high.astype(np.float64) - 2 * UNBOUNDED_INT, int(typed_min)).astype(wide)
    elif np.all(high == typed_max) and not np.all(low == typed_min):
        high = np.minimum(low.astype(np.float64) + 2 * UNBOUNDED_INT, int(typed_max)).astype(wide)
    low_b = np.broadcast_to(np.asarray(low).astype(wide), shape)
    high_b = np.broadcast_to(np.asarray(high).astype(wide), shape)
    return rng.integers(low_b, high_b, endpoint=True, dtype=wide).astype(dtype).reshape(shape)


def _scalar_bounds_drawer(
    spec: dm_specs.Array, dtype: np.dtype, low: Any, high: Any, shape: tuple[int, ...]
) -> Any:
    """``rng -> values`` for numbers with scalar bounds (the table above), the range worked
    out once. A scalar is drawn with ``size=None`` (the same value as ``size=()``, a third of
    the time)."""
    size = shape or None
    if dtype.kind == "f":
        finite_low, finite_high = math.isfinite(low), math.isfinite(high)
        lo = low if finite_low else (high - 2 if finite_high else -UNBOUNDED_FLOAT)
        hi = high if finite_high else (low + 2 if finite_low else UNBOUNDED_FLOAT)
        return lambda rng: np.asarray(rng.uniform(lo, hi, size=size)).astype(dtype)
    info = np.iinfo(dtype)
    wide = np.int64 if dtype.kind == "i" or dtype.itemsize < 8 else np.uint64
    if not isinstance(spec, dm_specs.BoundedArray):
        lo, hi = max(info.min, -UNBOUNDED_INT), min(info.max, UNBOUNDED_INT)
    else:
        lo, hi = int(low), int(high)
        if lo == info.min and hi != info.max:
            lo = max(hi - 2 * UNBOUNDED_INT, info.min)
        elif hi == info.max and lo != info.min:
            hi = min(lo + 2 * UNBOUNDED_INT, info.max)
    return lambda rng: rng.integers(lo, hi, size=size, endpoint=True, dtype=wide).astype(dtype)


def _strings(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    low, high = STRING_LENGTH
    out = np.empty(shape, dtype=object)
    for index in np.ndindex(shape):
        length = int(rng.integers(low, high + 1))
        out[index] = "".join(rng.choice(_LETTERS, length))
    return out


def random_action(action_spec: Any, rng: np.random.Generator | int) -> Any:
    """Draws a random action for a dm_env spec or a nested dict/list of specs.

    Args:
      action_spec: e.g. ``env.action_spec()``.
      rng: a NumPy Generator, or an integer seed.

    Returns:
      Values of the same structure: NumPy arrays or scalars (``str`` for
      scalar string specs, object arrays of ``str`` otherwise).

    Raises:
      SpecError: for a spec with no random values (object/proto dtypes).
    """
    return _walk(action_spec, _generator(rng), None)


def action_drawer(action_spec: Any) -> Any:
    """``draw(rng)``: what ``random_action(action_spec, rng)`` draws, the same values from the
    same generator, with the spec's work (bounds, dtype, shape) done once, not per draw.

    Args:
      action_spec: a spec or a nested dict/list of specs.

    Returns:
      A function of a NumPy Generator.

    Raises:
      SpecError: for something that is not a dm_env spec.
    """
    if isinstance(action_spec, Mapping):
        parts = [(key, action_drawer(value)) for key, value in action_spec.items()]
        return lambda rng: {key: draw(rng) for key, draw in parts}
    if isinstance(action_spec, (list, tuple)):
        kind, items = type(action_spec), [action_drawer(value) for value in action_spec]
        return lambda rng: kind(draw(rng) for draw in items)
    _check_spec(action_spec)
    spec, dtype = action_spec, np.dtype(action_spec.dtype)
    fixed = all(dim >= 0 for dim in spec.shape)
    if fixed and dtype.kind in "iuf" and not isinstance(spec, dm_specs.DiscreteArray):
        low, high = _limits(spec)
        if low.size == 1 and high.size == 1:
            shape = tuple(spec.shape)
            numbers = _scalar_bounds_drawer(spec, dtype, low.item(), high.item(), shape)
            return numbers if shape or dtype.kind != "f" else lambda rng: numbers(rng)[()]
    return lambda rng: _draw(spec, rng, None)


def _check_spec(action_spec: Any) -> None:
    if not isinstance(action_spec, dm_specs.Array):
        raise errors.SpecError(
            f"Cannot draw a random action for {type(action_spec).__name__}; pass dm_env specs."
        )


def _walk(action_spec: Any, generator: np.random.Generator, count: int | None) -> Any:
    """``_draw`` for every spec of a nested dict/list of specs, keeping its structure."""
    if isinstance(action_spec, Mapping):
        return {key: _walk(value, generator, count) for key, value in action_spec.items()}
    if isinstance(action_spec, (list, tuple)):
        return type(action_spec)(_walk(value, generator, count) for value in action_spec)
    _check_spec(action_spec)
    return _draw(action_spec, generator, count)


def _draw(spec: dm_specs.Array, generator: np.random.Generator, count: int | None) -> Any:
    """One value for ``spec``, or with ``count`` a ``[count, ...]`` batch of them."""
    if count is not None and any(dim < 0 for dim in spec.shape):
        out = np.empty(count, dtype=object)  # each world draws its own lengths
        for index in range(count):
            out[index] = np.asarray(_draw(spec, generator, None))
        return out
    shape = _shape(spec, generator)
    if count is not None:
        shape = (count, *shape)
    if isinstance(spec, dm_specs.DiscreteArray):
        value: Any = generator.integers(0, spec.num_values, size=shape).astype(spec.dtype)
    elif isinstance(spec, dm_specs.StringArray) or np.dtype(spec.dtype).kind in "US":
        value = _strings(shape, generator)
        return value[()] if shape == () else value
    else:
        kind = np.dtype(spec.dtype).kind
        if kind == "b":
            value = generator.random(shape) < 0.5
        elif kind in "iuf":
            value = _numbers(spec, shape, generator)
        else:
            raise errors.SpecError(
                f"Action {spec.name!r} has dtype {spec.dtype}, which has no random "
                "values; supply this action yourself."
            )
    value = np.asarray(value, dtype=spec.dtype)
    return value[()] if shape == () else value


def random_batch(action_spec: Any, num_envs: int, rng: np.random.Generator | int) -> Any:
    """Draws random actions for ``num_envs`` worlds at once, stacked (batch axis first).

    What ``BatchedEnvironment.step`` takes: each leaf is a ``[num_envs, *shape]``
    array drawn as ``random_action`` draws one value (the table above), in one
    NumPy call per leaf; a spec with a variable dimension gives an object
    array of ``num_envs`` arrays of their own lengths.

    Args:
      action_spec: e.g. ``envs.action_spec()``: a spec or a nested dict/list of specs.
      num_envs: how many worlds.
      rng: a NumPy Generator, or an integer seed.

    Returns:
      Values of the same structure as ``action_spec``, each with a leading batch axis.

    Raises:
      SpecError: for a spec with no random values (object/proto dtypes).
      ValueError: ``num_envs`` below 1.
    """
    if num_envs < 1:
        raise errors.ArgumentValueError(f"num_envs={num_envs} cannot work: pass at least 1.")
    return _walk(action_spec, _generator(rng), num_envs)


def _generator(rng: Any) -> np.random.Generator:
    """``rng`` if a Generator, else a Generator seeded with it (an int)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (str, bytes, float, Mapping)):
        raise errors.ArgumentTypeError(
            f"rng is a NumPy Generator or an integer seed (e.g. 0), not {type(rng).__name__} "
            f"{rng!r}."
        )
    return np.random.default_rng(rng)
