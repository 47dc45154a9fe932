"""Rich displays for notebooks: spec tables, TimeSteps, and images as inline PNG.

``show(value)`` wraps a TimeStep, a BatchedTimeStep (a grid of the worlds), an
observation dict or an array in an object
that Jupyter renders as HTML (``_repr_html_``) and, for a single image, as PNG
(``_repr_png_``); outside Jupyter its ``repr`` is a readable summary::

    import numpy as np
    import dm_env_rpc_client as dmr

    picture = dmr.show(np.zeros((32, 32, 3), np.uint8))   # renders as an image
    summary = dmr.show(np.arange(10.0))                     # shape, dtype, min, max

Images are uint8 ``[H, W, 3]`` (RGB), ``[H, W, 4]`` (RGBA) or ``[H, W]`` (grey)
arrays; float ``[H, W]`` arrays with values in ``[0, 1]`` (such as the Catch
board) are shown as grey images too. PNGs are encoded with the standard library
(``zlib``), so no imaging package is needed. Small images are scaled up with
nearest-neighbour pixels so that they are visible.

Presentation depends on the core, never the reverse: this module imports no
core module but the leaf ``_codec.nesting``, and the core's ``_repr_html_`` methods
import it only when a notebook renders them, passing plain rows and values.
"""

from __future__ import annotations

import base64
import html
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import dm_env
import numpy as np

from ._codec.nesting import flatten

_MIN_SIDE = 128  # small images are scaled up to at least this many pixels


def _as_image(value: Any) -> np.ndarray | None:
    """The uint8 image for an array that looks like a picture, else None."""
    if not isinstance(value, np.ndarray) or value.size == 0 or value.ndim not in (2, 3):
        return None
    if value.ndim == 3 and value.shape[2] not in (3, 4):
        return None
    if value.dtype == np.uint8:
        return value
    if value.dtype.kind == "f" and value.ndim == 2 and value.min() >= 0 and value.max() <= 1:
        return (value * 255).round().astype(np.uint8)
    return None


def _scaled(image: np.ndarray) -> np.ndarray:
    factor = max(1, -(-_MIN_SIDE // max(image.shape[0], image.shape[1])))
    if factor == 1:
        return image
    return image.repeat(factor, axis=0).repeat(factor, axis=1)


def png_bytes(image: np.ndarray, *, scale: bool = True) -> bytes:
    """Encodes a uint8 ``[H, W]``, ``[H, W, 3]`` or ``[H, W, 4]`` array as PNG bytes."""
    image = np.ascontiguousarray(_scaled(image) if scale else image, dtype=np.uint8)
    height, width = image.shape[:2]
    channels = 1 if image.ndim == 2 else image.shape[2]
    colour_type = {1: 0, 3: 2, 4: 6}[channels]
    rows = image.reshape(height, width * channels)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def summary(value: Any) -> str:
    """A one-line summary of a value: shape, dtype, min and max for arrays."""
    if isinstance(value, np.ndarray):
        if value.size and value.dtype.kind in "biuf":
            return (
                f"array shape={value.shape} dtype={value.dtype} min={value.min()} max={value.max()}"
            )
        return f"array shape={value.shape} dtype={value.dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _value_html(value: Any) -> str:
    image = _as_image(value)
    if image is not None:
        data = base64.b64encode(png_bytes(image)).decode("ascii")
        title = html.escape(summary(value))
        return (
            f'<img src="data:image/png;base64,{data}" title="{title}" '
            'style="image-rendering: pixelated"/>'
        )
    return f"<code>{html.escape(summary(value))}</code>"


def _rows_html(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    rows = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            rows.extend(_rows_html(value, name + "."))
        else:
            rows.append(
                f"<tr><td><b>{html.escape(name)}</b></td><td>{_value_html(value)}</td></tr>"
            )
    return rows


def number(value: Any) -> str:
    """A reward or discount as a user reads it: ``0.0``, not ``np.float32(0.0)``."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    return repr(value)


def timestep_html(timestep: dm_env.TimeStep) -> str:
    """HTML for a TimeStep: step type, reward, discount, and each observation."""
    head = (
        f"<b>{timestep.step_type.name}</b> reward={html.escape(number(timestep.reward))} "
        f"discount={html.escape(number(timestep.discount))}"
    )
    observation = timestep.observation
    body = observation if isinstance(observation, Mapping) else {"observation": observation}
    return f"<div>{head}<table>{''.join(_rows_html(body))}</table></div>"


def specs_html(spec_rows: list[tuple[str, int, str, tuple[int, ...], str]], title: str) -> str:
    """An HTML table of spec rows (name, uid, dtype, shape, bounds)."""
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for row in spec_rows
    )
    head = "".join(f"<th>{h}</th>" for h in ("name", "uid", "dtype", "shape", "bounds"))
    return f"<table><caption>{html.escape(title)}</caption><tr>{head}</tr>{cells}</table>"


SpecRows = list[tuple[str, int, str, tuple[int, ...], str]]


def environment_html(
    title: str, fields: Mapping[str, Any], action_rows: SpecRows, observation_rows: SpecRows
) -> str:
    """HTML for an environment: its class, some ``name=value`` fields, and spec tables.

    Args:
      title: e.g. ``"DmEnvAdaptor"``.
      fields: shown as ``name=repr(value)`` after the title.
      action_rows: rows as ``specs_html`` takes them.
      observation_rows: the observations a TimeStep carries (as the text repr lists them).
    """
    head = " ".join(f"{name}={html.escape(repr(value))}" for name, value in fields.items())
    return (
        f"<div><b>{html.escape(title)}</b> {head}"
        + specs_html(action_rows, "actions")
        + specs_html(observation_rows, "observations")
        + "</div>"
    )


def _is_batch(value: Any) -> bool:
    """Whether a value is a ``BatchedTimeStep`` (by its fields: this module imports no core)."""
    names = ("step_type", "reward", "discount", "observation", "env_ids")
    return all(hasattr(value, name) for name in names) and isinstance(value.step_type, np.ndarray)


def _batch_image(observation: Any) -> str | None:
    """The name of the first observation whose per-world values are pictures."""
    flat = flatten(observation) if isinstance(observation, Mapping) else {"": observation}
    for name, value in flat.items():
        if isinstance(value, np.ndarray) and len(value) and _as_image(value[0]) is not None:
            return name
    return None


def _world_lines(batch: Any) -> list[str]:
    return [
        f"world {int(env_id)}: {dm_env.StepType(int(kind)).name} "
        f"reward={number(reward)} discount={number(discount)}"
        for env_id, kind, reward, discount in zip(
            batch.env_ids, batch.step_type, batch.reward, batch.discount, strict=True
        )
    ]


def batch_html(batch: Any) -> str:
    """HTML for a ``BatchedTimeStep``: a grid of the worlds' pictures, step types and rewards."""
    observation = batch.observation
    flat = flatten(observation) if isinstance(observation, Mapping) else {"": observation}
    image = _batch_image(observation)
    cells = []
    for index, line in enumerate(_world_lines(batch)):
        picture = _value_html(flat[image][index]) + "<br/>" if image is not None else ""
        cells.append(
            '<div style="display:inline-block;margin:4px;text-align:center;vertical-align:top">'
            f"{picture}<small>{html.escape(line)}</small></div>"
        )
    others = {name: value for name, value in flat.items() if name != image}
    table = f"<table>{''.join(_rows_html(others))}</table>" if others else ""
    title = f"<b>BatchedTimeStep</b> of {len(batch.env_ids)} worlds"
    return f"<div>{title}<div>{''.join(cells)}</div>{table}</div>"


class Display:
    """What ``show`` returns: rendered by Jupyter, readable as text elsewhere."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def _repr_html_(self) -> str:
        if isinstance(self.value, dm_env.TimeStep):
            return timestep_html(self.value)
        if _is_batch(self.value):
            return batch_html(self.value)
        if isinstance(self.value, Mapping):
            return f"<table>{''.join(_rows_html(self.value))}</table>"
        return _value_html(self.value)

    def _repr_png_(self) -> bytes | None:
        image = _as_image(self.value)
        return None if image is None else png_bytes(image)

    def __repr__(self) -> str:
        if isinstance(self.value, dm_env.TimeStep):
            fields = {"observation": self.value.observation}
            lines = [
                f"TimeStep({self.value.step_type.name}, reward={number(self.value.reward)}, "
                f"discount={number(self.value.discount)})"
            ]
        elif _is_batch(self.value):
            fields = {"observation": self.value.observation}
            lines = [f"BatchedTimeStep of {len(self.value.env_ids)} worlds"]
            lines.extend(f"  {line}" for line in _world_lines(self.value))
        elif isinstance(self.value, Mapping):
            fields, lines = dict(self.value), []
        else:
            return summary(self.value)
        for key, value in flatten({k: v for k, v in fields.items()}).items():
            inner = flatten(value) if isinstance(value, Mapping) else {key: value}
            lines.extend(f"  {name}: {summary(item)}" for name, item in inner.items())
        return "\n".join(lines)


def show(value: Any) -> Display:
    """Wraps a value for display in a notebook.

    Args:
      value: a ``dm_env.TimeStep``, a ``BatchedTimeStep`` (a grid of the worlds'
        pictures, step types and rewards), an observation dict or an array.

    Returns:
      A ``Display``: HTML (and PNG for one image) in Jupyter, a summary as text.
    """
    return Display(value)
