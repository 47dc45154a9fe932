"""``assert_same``: two decoded values are equal and of equal types, for tests that compare paths."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_same(a: Any, b: Any) -> None:
    """Equal values of equal types: dicts with their keys in one order, tuples (TimeSteps)
    element by element, arrays and NumPy scalars of one dtype and shape."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b
