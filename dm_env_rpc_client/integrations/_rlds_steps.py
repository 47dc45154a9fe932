"""An episode's steps as envlogger ``Data`` protos, without envlogger's per-step Python walk.

``envlogger.converters.codec.encode(StepData(timestep, action, None))`` walks the
nested step in Python, allocating every sub-message, at about 100 µs a step for
Catch: most of what RLDS recording cost. ``StepEncoder`` encodes one step with
``codec.encode`` once per step layout (FIRST or not, the columns' dtypes and
shapes) as a template, finds the template's leaf messages, and for every step
only puts that step's values into them, the way ``codec`` would:

- a leaf whose steps are arrays of float32, int8, int16, uint8 or uint16: the
  big-endian bytes ``codec`` stores (the column converted once per episode);
- a leaf whose steps are NumPy scalars (1-D columns) or arrays of other numeric
  types and bools: the repeated field ``codec`` fills;
- anything else (ragged tensors, strings): ``codec.encode`` of that value.

So the protos are equal, field for field, to ``codec``'s (the tests compare them
for every dtype), and ``envlogger.Reader`` decodes the same steps.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import dm_env
import numpy as np
from envlogger import step_data
from envlogger.converters import codec

from .. import recording, specs

# dtype -> (Values field, big-endian dtype): codec stores these as bytes.
_BYTES = {
    np.dtype(np.int8): ("int8_values", ">i1"),
    np.dtype(np.int16): ("int16_values", ">i2"),
    np.dtype(np.uint8): ("uint8_values", ">u1"),
    np.dtype(np.uint16): ("uint16_values", ">u2"),
}
_FLOAT32_ARRAY = ("float_values_buffer", ">f4")
# dtype -> (repeated Values field, Python type) of codec's scalars and arrays.
_REPEATED = {
    np.dtype(np.float32): ("float_values", float),  # scalars only: arrays go as bytes
    np.dtype(np.float64): ("double_values", float),
    np.dtype(np.int32): ("int32_values", int),
    np.dtype(np.int64): ("int64_values", int),
    np.dtype(np.uint32): ("uint32_values", int),
    np.dtype(np.uint64): ("uint64_values", int),
    np.dtype(np.bool_): ("bool_values", bool),
}
Prepare = Callable[[Any], Any]
Put = Callable[[Any, int], None]

if not hasattr(codec.np, "unicode_"):
    # envlogger 1.2's codec names np.unicode_, gone in NumPy 2 (np.str_ is the same type):
    # its module alone gets a NumPy with the alias back; numpy itself is left as it is.
    _numpy = types.ModuleType("numpy")
    _numpy.__dict__.update(vars(np))
    _numpy.unicode_ = np.str_  # type: ignore[attr-defined]
    codec.np = _numpy


def _at(tree: Any, index: int) -> Any:
    if isinstance(tree, Mapping):
        return {key: _at(value, index) for key, value in tree.items()}
    return tree[index]


def step(episode: recording.Episode, t: int) -> step_data.StepData:
    """Step ``t`` of ``episode`` as envlogger's ``StepData`` (what ``EnvLogger`` would log)."""
    first = t == 0
    timestep = dm_env.TimeStep(
        dm_env.StepType(int(episode.step_type[t])),
        None if first else episode.reward[t],
        None if first else episode.discount[t],
        _at(episode.observation, t),
    )
    return step_data.StepData(timestep, None if first else _at(episode.action, t - 1), None)


def _leaf(data: Any, name: str) -> Any:
    for key in name.split("."):
        data = data.dict.values[key]
    return data


def _setter(slot: Any, column: Any) -> tuple[Prepare, Put]:
    """How to put a value of a column like ``column`` into the leaf message ``slot``: a
    function of the whole column, run once per episode, and one of its result and a row."""
    if isinstance(column, np.ndarray) and column.dtype.kind in "biuf":
        values = slot.datum.values
        if column.ndim > 1 and column.dtype == np.float32:
            field, big_endian = _FLOAT32_ARRAY
        else:
            field, big_endian = _BYTES.get(column.dtype, ("", ""))
        if field:

            def put_bytes(converted: Any, row: int) -> None:  # a slice: a scalar's is native
                setattr(values, field, converted[row : row + 1].tobytes())

            return (lambda whole: whole.astype(big_endian)), put_bytes
        if column.dtype in _REPEATED:
            repeated, kind = _REPEATED[column.dtype]
            target = getattr(values, repeated)
            if column.ndim == 1:  # a scalar a step

                def put_scalar(whole: Any, row: int) -> None:
                    target[0] = kind(whole[row])

                return _same, put_scalar

            def put_array(whole: Any, row: int) -> None:
                del target[:]
                target.extend(whole[row].ravel().tolist())

            return _same, put_array

    def put_encoded(whole: Any, row: int) -> None:
        slot.CopyFrom(codec.encode(whole[row]))

    return _same, put_encoded


def _same(column: Any) -> Any:
    return column


class StepEncoder:
    """Encodes episodes' steps as envlogger ``Data`` protos (see the module docs)."""

    def __init__(self) -> None:
        # (first, layout) -> the template and its leaves: (column's name, offset, prepare, put)
        self._templates: dict[Any, tuple[Any, list[tuple[str, int, Prepare, Put]]]] = {}
        self._metadata: dict[Any, Any] = {}

    def steps(self, episode: recording.Episode) -> Iterator[Any]:
        """Every step of ``episode``, as the ``Data`` proto ``codec.encode`` gives.

        The proto yielded is reused for a later step: hand it on (``add_step``)
        before asking for the next.
        """
        columns: dict[str, Any] = {"step_type": episode.step_type}
        columns.update(("obs/" + k, v) for k, v in specs.flatten(episode.observation).items())
        columns.update(("act/" + k, v) for k, v in specs.flatten(episode.action).items())
        columns.update(reward=episode.reward, discount=episode.discount)
        layout = tuple((name, _layout(value)) for name, value in columns.items())
        bound: dict[bool, tuple[Any, list[tuple[Put, Any, int]]]] = {}
        for t in range(len(episode.step_type)):
            first = t == 0
            if first not in bound:
                template = self._templates.get((first, layout))
                if template is None:
                    template = self._templates[first, layout] = _template(episode, t, columns)
                data, leaves = template
                puts = [
                    (put, prepare(columns[name]), offset) for name, offset, prepare, put in leaves
                ]
                bound[first] = data, puts
            data, puts = bound[first]
            for put, column, offset in puts:
                put(column, t - offset)
            yield data

    def metadata(self, values: dict[str, Any]) -> Any:
        """``codec.encode(values)`` for a flat dict of NumPy scalars and strings, likewise."""
        layout = tuple(
            (name, _layout(np.asarray(value)[np.newaxis])) for name, value in values.items()
        )
        template = self._metadata.get(layout)
        if template is None:
            data = codec.encode(values)
            columns = {name: np.asarray(value)[np.newaxis] for name, value in values.items()}
            leaves = [_setter(data.dict.values[name], column) for name, column in columns.items()]
            template = self._metadata[layout] = data, leaves
        data, leaves = template
        for (prepare, put), value in zip(leaves, values.values(), strict=True):
            put(prepare(np.asarray(value)[np.newaxis]), 0)
        return data


def _template(
    episode: recording.Episode, t: int, columns: dict[str, Any]
) -> tuple[Any, list[tuple[str, int, Prepare, Put]]]:
    """Step ``t`` encoded by ``codec``, and its leaves (see ``StepEncoder``)."""
    data = codec.encode(step(episode, t))
    timestep = data.tuple.values[0].tuple
    bigint = timestep.values[0].datum.values.bigint_values

    def put_step_type(step_types: Any, row: int) -> None:
        bigint[0] = bytes((int(step_types[row]),))  # codec's bytes of a small int

    leaves: list[tuple[str, int, Prepare, Put]] = [("step_type", 0, _same, put_step_type)]
    for name, column in columns.items():
        group, _, key = name.partition("/")
        if group == "obs":
            leaves.append((name, 0, *_setter(_leaf(timestep.values[3], key), column)))
        elif t > 0 and group == "act":
            leaves.append((name, 1, *_setter(_leaf(data.tuple.values[1], key), column)))
        elif t > 0 and name in ("reward", "discount"):
            slot = timestep.values[1 if name == "reward" else 2]
            leaves.append((name, 0, *_setter(slot, column)))
    return data, leaves


def _layout(column: Any) -> Any:
    if isinstance(column, np.ndarray) and column.dtype != object:
        return column.dtype.str, column.shape[1:]
    return "steps"
