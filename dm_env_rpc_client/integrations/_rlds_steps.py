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

from dm_env_rpc_client import recording, specs

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
Setter = Callable[[int], None]

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


def _setter(slot: Any, column: Any, offset: int) -> Setter:
    """Puts the value of step ``t`` (``column[t - offset]``) into the leaf message ``slot``."""
    if isinstance(column, np.ndarray) and column.dtype.kind in "biuf":
        values = slot.datum.values
        if column.ndim > 1 and column.dtype == np.float32:
            field, big_endian = _FLOAT32_ARRAY
        else:
            field, big_endian = _BYTES.get(column.dtype, ("", ""))
        if field:
            converted = column.astype(big_endian)

            def put_bytes(t: int) -> None:  # a slice: a scalar's tobytes is native-endian
                setattr(values, field, converted[t - offset : t - offset + 1].tobytes())

            return put_bytes
        if column.dtype in _REPEATED:
            repeated, kind = _REPEATED[column.dtype]
            target = getattr(values, repeated)
            if column.ndim == 1:  # a scalar a step

                def put_scalar(t: int) -> None:
                    target[0] = kind(column[t - offset])

                return put_scalar

            def put_array(t: int) -> None:
                del target[:]
                target.extend(column[t - offset].ravel().tolist())

            return put_array

    def put_encoded(t: int) -> None:
        slot.CopyFrom(codec.encode(column[t - offset]))

    return put_encoded


class StepEncoder:
    """Encodes episodes' steps as envlogger ``Data`` protos (see the module docs)."""

    def __init__(self) -> None:
        self._templates: dict[Any, Any] = {}  # (first, layout) -> Data

    def steps(self, episode: recording.Episode) -> Iterator[Any]:
        """Every step of ``episode``, as the ``Data`` proto ``codec.encode`` gives.

        The proto yielded is reused for a later step: hand it on (``add_step``)
        before asking for the next.
        """
        observation = specs.flatten(episode.observation)
        action = specs.flatten(episode.action)
        layout = (
            tuple((name, _layout(value)) for name, value in observation.items()),
            tuple((name, _layout(value)) for name, value in action.items()),
        )
        bound: dict[bool, tuple[Any, list[Setter]]] = {}
        for t in range(len(episode.step_type)):
            first = t == 0
            if first not in bound:
                data = self._templates.get((first, layout))
                if data is None:
                    data = self._templates[first, layout] = codec.encode(step(episode, t))
                bound[first] = (data, self._bind(data, episode, observation, action, first))
            data, setters = bound[first]
            for put in setters:
                put(t)
            yield data

    def _bind(
        self, data: Any, episode: recording.Episode, observation: Any, action: Any, first: bool
    ) -> list[Setter]:
        timestep = data.tuple.values[0].tuple
        step_types = episode.step_type

        bigint = timestep.values[0].datum.values.bigint_values

        def put_step_type(t: int) -> None:
            bigint[0] = bytes((int(step_types[t]),))  # codec's bytes of a small int

        setters: list[Setter] = [put_step_type]
        setters += [
            _setter(_leaf(timestep.values[3], name), column, 0)
            for name, column in observation.items()
        ]
        if not first:
            setters.append(_setter(timestep.values[1], episode.reward, 0))
            setters.append(_setter(timestep.values[2], episode.discount, 0))
            setters += [
                _setter(_leaf(data.tuple.values[1], name), column, 1)
                for name, column in action.items()
            ]
        return setters


def _layout(column: Any) -> Any:
    if isinstance(column, np.ndarray) and column.dtype != object:
        return column.dtype.str, column.shape[1:]
    return "steps"
