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

Where every leaf has a fixed width on the wire (bytes of fixed-shape arrays,
packed floats, doubles and bools, the step type: Catch's steps, images), the
template is serialized once and an episode's steps are built as bytes all at
once: one ``[steps, size]`` uint8 array, each leaf's column (converted as
``codec`` converts it) written into its byte range, found by setting the leaf
to all-0x00 then all-0x01 bytes and comparing the serializations (and checked
against the proto path on the first step it encodes). ``add_step`` gets them as
``SerializedData``: its pybind11 proto caster asks a Python proto only for
``DESCRIPTOR.full_name`` and ``SerializeToString()``, then parses the bytes
into its C++ message, so no Python proto is filled or serialized per step.
Other leaves (varint integers, ragged tensors, strings) keep the proto path.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import dm_env
import numpy as np
from envlogger import step_data
from envlogger.converters import codec
from envlogger.proto import storage_pb2

from ... import recording, specs

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
Pack = Callable[[Any], np.ndarray]  # rows of a column -> their wire bytes, [rows, width] uint8
_CHUNK_BYTES = 4 << 20  # steps built as bytes at once: at most this much


class SerializedData:
    """A ``Data`` proto already serialized, as envlogger's ``add_step`` takes it (module docs)."""

    __slots__ = ("data",)
    DESCRIPTOR = storage_pb2.Data.DESCRIPTOR

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def SerializeToString(self, **_: Any) -> bytes:
        """The bytes (what a proto's ``SerializeToString`` gives)."""
        return self.data


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


def _wire(dtype: str, width: int) -> Pack:
    """Rows of a column as ``dtype``'s bytes (``>``: codec's big-endian bytes; ``<``: a
    packed repeated field's), ``[rows, width]`` uint8."""
    return lambda whole: np.ascontiguousarray(whole, dtype).view(np.uint8).reshape(-1, width)


def _setter(slot: Any, column: Any) -> tuple[Prepare, Put, Pack | None]:
    """How to put a value of a column like ``column`` into the leaf message ``slot``: a
    function of the whole column, run once per episode, one of its result and a row, and
    (for a leaf of fixed width on the wire) one giving rows' wire bytes, else None."""
    if isinstance(column, np.ndarray) and column.dtype.kind in "biuf":
        values = slot.datum.values
        if column.ndim > 1 and column.dtype == np.float32:
            field, big_endian = _FLOAT32_ARRAY
        else:
            field, big_endian = _BYTES.get(column.dtype, ("", ""))
        if field:

            def put_bytes(converted: Any, row: int) -> None:  # a slice: a scalar's is native
                setattr(values, field, converted[row : row + 1].tobytes())

            width = column[:1].nbytes
            return (lambda whole: whole.astype(big_endian)), put_bytes, _wire(big_endian, width)
        if column.dtype in _REPEATED:
            repeated, kind = _REPEATED[column.dtype]
            target = getattr(values, repeated)
            # Packed on the wire: floats, doubles and bools have a fixed width, varints do not.
            little = {"f": f"<f{column.itemsize}", "b": "|u1"}.get(column.dtype.kind)
            pack = _wire(little, column[:1].nbytes) if little else None
            if column.ndim == 1:  # a scalar a step

                def put_scalar(whole: Any, row: int) -> None:
                    target[0] = kind(whole[row])

                return _same, put_scalar, pack

            def put_array(whole: Any, row: int) -> None:
                del target[:]
                target.extend(whole[row].ravel().tolist())

            return _same, put_array, pack

    def put_encoded(whole: Any, row: int) -> None:
        slot.CopyFrom(codec.encode(whole[row]))

    return _same, put_encoded, None


def _same(column: Any) -> Any:
    return column


Leaf = tuple[str, int, Prepare, Put, "Pack | None"]  # column's name, row offset, ...
Packed = tuple[np.ndarray, list[tuple[str, int, Pack, int, int]]]  # bytes; name, offset, pack,
# position, width


class StepEncoder:
    """Encodes episodes' steps as envlogger ``Data`` protos (see the module docs)."""

    def __init__(self) -> None:
        # (first, layout) -> the template, its leaves, and its bytes when every leaf is packable
        self._templates: dict[Any, tuple[Any, list[Leaf], Packed | None]] = {}
        self._metadata: dict[Any, Any] = {}

    def steps(self, episode: recording.Episode) -> Iterator[Any]:
        """Every step of ``episode``, as the ``Data`` proto ``codec.encode`` gives (or its
        bytes, as ``SerializedData``).

        What is yielded is reused for a later step: hand it on (``add_step``)
        before asking for the next.
        """
        columns: dict[str, Any] = {"step_type": episode.step_type}
        columns.update(("obs/" + k, v) for k, v in specs.flatten(episode.observation).items())
        columns.update(("act/" + k, v) for k, v in specs.flatten(episode.action).items())
        columns.update(reward=episode.reward, discount=episode.discount)
        layout = tuple((name, _layout(value)) for name, value in columns.items())
        count = len(episode.step_type)
        for first, start, stop in ((True, 0, min(1, count)), (False, 1, count)):
            if stop <= start:
                continue
            template = self._templates.get((first, layout))
            if template is None:
                template = self._templates[first, layout] = _template(episode, start, columns)
            data, leaves, packed = template
            if packed is not None:
                yield from _packed_steps(packed, columns, start, stop)
                continue
            puts = [
                (put, prepare(columns[name]), offset) for name, offset, prepare, put, _ in leaves
            ]
            for t in range(start, stop):
                for put, column, offset in puts:
                    put(column, t - offset)
                yield data

    def metadata(self, values: dict[str, Any]) -> SerializedData:
        """``codec.encode(values)`` for a flat dict of NumPy scalars and strings, as bytes."""
        layout = tuple((name, type(value)) for name, value in values.items())
        template = self._metadata.get(layout)
        if template is None:
            data = codec.encode(values)
            setters = [_scalar_setter(data.dict.values[k], v) for k, v in values.items()]
            template = self._metadata[layout] = data, setters
        data, setters = template
        for set_value, value in zip(setters, values.values(), strict=True):
            set_value(value)
        return SerializedData(data.SerializeToString())


def _scalar_setter(slot: Any, value: Any) -> Callable[[Any], None]:
    """How to put a value of ``value``'s type into the leaf message ``slot``, as ``codec``."""
    values = slot.datum.values
    dtype = value.dtype if isinstance(value, np.generic) else None
    if type(value) is str:
        strings = values.string_values
        return lambda new: strings.__setitem__(0, new)
    if dtype in _REPEATED:
        repeated, kind = _REPEATED[dtype]
        target = getattr(values, repeated)
        return lambda new: target.__setitem__(0, kind(new))
    if dtype in _BYTES:
        field, big_endian = _BYTES[dtype]
        return lambda new: setattr(values, field, np.asarray([new], big_endian).tobytes())
    return lambda new: slot.CopyFrom(codec.encode(new))


def _packed_steps(packed: Packed, columns: dict[str, Any], start: int, stop: int) -> Iterator[Any]:
    """Steps ``start`` to ``stop`` as bytes: the template's, each leaf's columns written in."""
    base, leaves = packed
    size = len(base)
    chunk = max(1, _CHUNK_BYTES // max(size, 1))
    serialized = SerializedData()
    for lo in range(start, stop, chunk):
        hi = min(stop, lo + chunk)
        rows = np.empty((hi - lo, size), np.uint8)
        rows[:] = base
        for name, offset, pack, position, width in leaves:
            rows[:, position : position + width] = pack(columns[name][lo - offset : hi - offset])
        blob = rows.tobytes()
        for at in range(0, len(blob), size):
            serialized.data = blob[at : at + size]
            yield serialized


def _pattern(sample: np.ndarray, byte: int) -> np.ndarray:
    """An array like ``sample`` whose every byte is ``byte``."""
    return np.frombuffer(bytes((byte,)) * sample.nbytes, sample.dtype).reshape(sample.shape)


def _packable(data: Any, leaves: list[Leaf], columns: dict[str, Any], t: int) -> Packed | None:
    """The template's bytes and each leaf's byte range, if every leaf has a fixed width on
    the wire (found by setting it to all-0x00 and all-0x01 bytes), checked on step ``t``."""
    fixed = []
    for name, offset, prepare, put, pack in leaves:
        if pack is None:
            return None
        fixed.append((name, offset, prepare, put, pack, columns[name][t - offset][np.newaxis]))

    def serialized() -> np.ndarray:
        return np.frombuffer(data.SerializeToString(deterministic=True), np.uint8)

    for _, _, prepare, put, _, sample in fixed:
        put(prepare(_pattern(sample, 0)), 0)
    base = serialized()
    ranges = []
    for name, offset, prepare, put, pack, sample in fixed:
        if not sample.nbytes:
            continue  # an empty array: nothing on the wire
        put(prepare(_pattern(sample, 1)), 0)
        probe = serialized()
        put(prepare(_pattern(sample, 0)), 0)
        changed = (
            np.flatnonzero(probe != base) if len(probe) == len(base) else np.array([], np.intp)
        )
        if len(changed) != sample.nbytes or changed[-1] - changed[0] != len(changed) - 1:
            return None
        ranges.append((name, offset, pack, int(changed[0]), len(changed)))
    packed = base.copy(), ranges
    for name, offset, prepare, put, _, _ in fixed:  # the proto path's step t ...
        put(prepare(columns[name]), t - offset)
    built = next(_packed_steps(packed, columns, t, t + 1))  # ... is the bytes' step t
    return packed if storage_pb2.Data.FromString(built.data) == data else None


def _template(
    episode: recording.Episode, t: int, columns: dict[str, Any]
) -> tuple[Any, list[Leaf], Packed | None]:
    """Step ``t`` encoded by ``codec``, its leaves and its bytes (see ``StepEncoder``)."""
    data = codec.encode(step(episode, t))
    timestep = data.tuple.values[0].tuple
    bigint = timestep.values[0].datum.values.bigint_values

    def put_step_type(step_types: Any, row: int) -> None:
        bigint[0] = bytes((int(step_types[row]),))  # codec's bytes of a small int

    leaves: list[Leaf] = [("step_type", 0, _same, put_step_type, _wire("|u1", 1))]
    for name, column in columns.items():
        group, _, key = name.partition("/")
        if group == "obs":
            leaves.append((name, 0, *_setter(_leaf(timestep.values[3], key), column)))
        elif t > 0 and group == "act":
            leaves.append((name, 1, *_setter(_leaf(data.tuple.values[1], key), column)))
        elif t > 0 and name in ("reward", "discount"):
            slot = timestep.values[1 if name == "reward" else 2]
            leaves.append((name, 0, *_setter(slot, column)))
    return data, leaves, _packable(data, leaves, columns, t)


def _layout(column: Any) -> Any:
    if isinstance(column, np.ndarray) and column.dtype != object:
        return column.dtype.str, column.shape[1:]
    return "steps"
