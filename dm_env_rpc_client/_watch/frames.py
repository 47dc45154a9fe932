"""One world's observation at one step, as the watch page draws it.

``frame(observation, position, keys)`` reads world ``position`` of a batch's
stacked observation (no copy of the other worlds) and returns a JSON-ready dict:

- ``images``: for each key of ``keys`` that holds a picture there (uint8
  ``[H, W]``, ``[H, W, 3]`` or ``[H, W, 4]``, or a float ``[H, W]`` in [0, 1],
  as ``display.show`` draws them), ``{"h", "w", "c", "data"}``: the raw uint8
  pixels, row by row, base64. The page puts them into a canvas of the image's own
  size, so that a canvas pixel is the observation's pixel (no lossy codec, and no
  PNG to encode: base64 of the bytes costs less than any compression here).
- ``numbers``: ``[name, text]`` for every other observation, its first values.

``image_keys(observation, position)`` lists the keys that hold a picture.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .._codec.nesting import flatten
from ..display import _as_image

MAX_VALUES = 12  # values shown of a non-image observation


def _world(value: Any, position: int) -> Any:
    return value[position] if isinstance(value, np.ndarray) and value.ndim else value


def image_keys(observation: Mapping[str, Any], position: int) -> list[str]:
    """The (dotted) observation names that hold a picture for world ``position``, sorted."""
    flat = flatten(observation)
    return sorted(k for k, v in flat.items() if _as_image(_world(v, position)) is not None)


def _numbers(value: Any) -> str:
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        text = repr(array.tolist())
        return text if len(text) <= 80 else text[:77] + "..."
    flat = array.ravel()
    shown = ", ".join(f"{v:.4g}" for v in flat[:MAX_VALUES].tolist())
    more = f", ... ({flat.size} values)" if flat.size > MAX_VALUES else ""
    shape = f" shape {list(array.shape)}" if array.ndim else ""
    return f"[{shown}{more}]{shape}" if array.ndim else shown


def frame(observation: Mapping[str, Any], position: int, keys: Iterable[str]) -> dict[str, Any]:
    """World ``position``'s pictures under ``keys`` and the numbers of everything else.

    Args:
      observation: a ``BatchedTimeStep``'s (nested) observation.
      position: the world's position in that batch.
      keys: the picture names to encode (others that are pictures are left out).

    Returns:
      ``{"images": {name: {"h", "w", "c", "data"}}, "numbers": [[name, text], ...]}``.
    """
    wanted = set(keys)
    images: dict[str, Any] = {}
    numbers: list[list[str]] = []
    for name, stacked in flatten(observation).items():
        value = _world(stacked, position)
        image = _as_image(value)
        if image is None:
            numbers.append([name, _numbers(value)])
        elif name in wanted:
            pixels = np.ascontiguousarray(image)
            images[name] = {
                "h": int(pixels.shape[0]),
                "w": int(pixels.shape[1]),
                "c": 1 if pixels.ndim == 2 else int(pixels.shape[2]),
                "data": base64.b64encode(pixels.tobytes()).decode("ascii"),
            }
    return {"images": images, "numbers": numbers}
