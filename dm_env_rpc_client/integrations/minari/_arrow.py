"""Episodes as Arrow record batches in the layout Minari's ``arrow`` storage reads.

One record batch per episode of ``T`` transitions, ``T + 1`` rows, written as
``data/<episode id>/part-0.arrow`` (an Arrow IPC file; the folder's name is the
episode id, as Minari's directory partitioning on ``episode_id`` has it):

==================  =====================================================================
column              rows
==================  =====================================================================
``observations``    the ``T + 1`` observations
``actions``         the ``T`` actions, then one null-like padding row
``rewards``         float64: ``rewards[t]`` follows ``actions[t]``; 0.0 padding
``terminations``    bool: True on the last transition of a TERMINATED episode
``truncations``     bool: True on the last transition of an INTERRUPTED or cut episode
==================  =====================================================================

Values by space: ``Box`` (and ``MultiBinary``) as fixed-size lists of the flattened
values, ``Discrete`` as plain integers, ``Dict`` as a struct of its keys. Written by
this module, read back by ``minari``'s own reader (the tests check every step).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from gymnasium import spaces

from ... import errors

_NO_COLUMN = (
    "The {kind} {name!r} has the space {space}, which the Minari arrow format cannot hold. "
    "Leave it out (requested_observations=[...] / actions=[...] in Python), or record with "
    "--format npz or --format rlds, which keep it."
)


def check_space(space: spaces.Space[Any], kind: str, name: str = "") -> None:
    """Raises ``RecordingError`` naming the first part of ``space`` this layout cannot hold."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            check_space(sub, kind, f"{name}.{key}" if name else key)
    elif not isinstance(space, spaces.Box | spaces.Discrete | spaces.MultiBinary):
        raise errors.RecordingError(_NO_COLUMN.format(kind=kind, name=name, space=space))


def encode(space: spaces.Space[Any], values: Any, rows: int) -> pa.Array:
    """``values`` (``[n, ...]``, ``n <= rows``) as an Arrow column of ``rows`` rows, zero-padded."""
    if isinstance(space, spaces.Dict):
        assert isinstance(values, Mapping)
        names = list(space.spaces)
        columns = [encode(space.spaces[key], values[key], rows) for key in names]
        return pa.StructArray.from_arrays(columns, names=names)
    array = np.asarray(values, dtype=space.dtype)
    if isinstance(space, spaces.Discrete):
        flat = array.reshape(len(array))
        if len(flat) < rows:
            flat = np.concatenate([flat, np.zeros(rows - len(flat), flat.dtype)])
        return pa.array(flat, type=pa.from_numpy_dtype(space.dtype))
    width = int(np.prod(space.shape, dtype=np.int64)) if space.shape else 1
    flat = array.reshape(len(array) * width)  # a view of the stacked episode: no copy
    if len(array) < rows:
        flat = np.concatenate([flat, np.zeros((rows - len(array)) * width, flat.dtype)])
    item = pa.from_numpy_dtype(space.dtype)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=item), list_size=width)


def _stacked(trees: list[Any], rows: int, kept: np.ndarray | None) -> Any:
    """The episodes' leaves joined into ``rows`` rows; with ``kept``, zeros where it is False."""
    if isinstance(trees[0], Mapping):
        return {key: _stacked([tree[key] for tree in trees], rows, kept) for key in trees[0]}
    joined = np.concatenate([np.asarray(tree) for tree in trees])
    if kept is None:
        return joined
    out = np.zeros((rows, *joined.shape[1:]), joined.dtype)
    out[kept] = joined
    return out


def episodes_batch(
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    episodes: list[tuple[Any, Any, np.ndarray, bool]],
) -> tuple[pa.RecordBatch, list[int]]:
    """Several episodes' rows in one record batch, and where each starts (plus the end).

    ``episodes`` holds ``(observations, actions, rewards, terminated)`` per episode
    (``T + 1`` observations, ``T`` actions and rewards); an episode not terminated is
    truncated. Each episode's rows are ``batch.slice(starts[i], starts[i + 1] - starts[i])``:
    one column conversion for all of them, and one ``concatenate`` per leaf (no
    per-episode NumPy call: Catch's episodes are 10 steps).
    """
    lengths = [len(rewards) + 1 for _, _, rewards, _ in episodes]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = int(starts[-1])
    ends = starts[1:] - 2  # each episode's last transition
    terminations = np.zeros(rows, np.bool_)
    truncations = np.zeros(rows, np.bool_)
    terminated = np.array([done for *_, done in episodes], np.bool_)
    terminations[ends[terminated]] = True
    truncations[ends[~terminated]] = True
    # Actions and rewards have one row fewer than observations: a zero padding row each.
    kept = np.ones(rows, np.bool_)
    kept[starts[1:] - 1] = False
    rewards = _stacked([np.asarray(r, np.float64) for *_, r, _ in episodes], rows, kept)
    batch = pa.RecordBatch.from_pydict(
        {
            "observations": encode(
                observation_space, _stacked([o for o, *_ in episodes], rows, None), rows
            ),
            "actions": encode(
                action_space, _stacked([a for _, a, _, _ in episodes], rows, kept), rows
            ),
            "rewards": pa.array(rewards),
            "terminations": pa.array(terminations),
            "truncations": pa.array(truncations),
        }
    )
    return batch, starts.tolist()


class IpcFiles:
    """Arrow IPC files of one record batch each, all of one schema, as pyarrow writes them.

    ``pa.ipc.new_file`` costs about 40 µs a file in Python (a writer, its schema
    written again, a footer): more than the rest of a 10-step episode's columns.
    A file of one batch is the magic and the schema message (the same for every
    file), the batch's message (``RecordBatch.serialize``), then the footer, in
    which only the batch's block (its offset, metadata length and body length)
    changes. The first file is pyarrow's own and gives the rest as a template;
    the second is made both ways and compared byte for byte, and only if they are
    equal are later files assembled from the template (otherwise every file stays
    pyarrow's own).
    """

    def __init__(self) -> None:
        self._template: tuple[bytes, bytes, bytes] | None = None
        self._files = 0

    def parts(self, batch: pa.RecordBatch) -> list[Any]:
        """The file holding ``batch`` alone, as buffers to write one after the other."""
        self._files += 1
        if self._template is not None and self._files > 2:
            return self._assembled(batch)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, batch.schema) as file:
            file.write_batch(batch)
        own = sink.getvalue().to_pybytes()
        if self._files == 1:
            self._template = _template(own, batch)
        elif self._template is not None and b"".join(self._assembled(batch)) != own:
            self._template = None  # this pyarrow writes files some other way: keep its own
        return [own]

    def _assembled(self, batch: pa.RecordBatch) -> list[Any]:
        assert self._template is not None
        head, before, after = self._template
        message = batch.serialize()
        return [head, message, before, _block(len(head), message), after]


def _template(own: bytes, batch: pa.RecordBatch) -> tuple[bytes, bytes, bytes] | None:
    """``own`` (pyarrow's file of ``batch``) cut around the batch's message and block."""
    message = batch.serialize().to_pybytes()
    offset = own.find(message)
    if offset <= 0 or own.find(message, offset + 1) != -1:
        return None
    block = _block(offset, message)
    tail = own[offset + len(message) :]
    where = tail.find(block)
    if where == -1 or tail.find(block, where + 1) != -1:
        return None
    return own[:offset], tail[:where], tail[where + len(block) :]


_BLOCK = struct.Struct("<qi4xq")  # the footer's Block: offset, metaDataLength, bodyLength


def _block(offset: int, message: Any) -> bytes:
    """The footer's Block of ``message`` (a serialized record batch) at ``offset`` in the file:
    its metadata's length (the 8-byte prefix, then the length it gives) and its body's."""
    view = memoryview(message)
    metadata = 8 + int.from_bytes(view[4:8], "little")
    return _BLOCK.pack(offset, metadata, view.nbytes - metadata)
