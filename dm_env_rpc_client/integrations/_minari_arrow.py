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

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from gymnasium import spaces

from .. import errors

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


def _joined(trees: list[Any]) -> Any:
    if isinstance(trees[0], Mapping):
        return {key: _joined([tree[key] for tree in trees]) for key in trees[0]}
    return np.concatenate([np.asarray(tree) for tree in trees])


def episodes_batch(
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    episodes: list[tuple[Any, Any, np.ndarray, bool]],
) -> tuple[pa.RecordBatch, list[int]]:
    """Several episodes' rows in one record batch, and where each starts (plus the end).

    ``episodes`` holds ``(observations, actions, rewards, terminated)`` per episode
    (``T + 1`` observations, ``T`` actions and rewards); an episode not terminated is
    truncated. Each episode's rows are ``batch.slice(starts[i], starts[i + 1] - starts[i])``,
    as ``episode_batch`` gives them: one column conversion for all of them.
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
    # Actions and rewards have one row fewer than observations: a padding row each.
    actions = _joined([_with_padding(actions) for _, actions, _, _ in episodes])
    rewards = np.concatenate([np.append(np.asarray(r, np.float64), 0.0) for *_, r, _ in episodes])
    batch = pa.RecordBatch.from_pydict(
        {
            "observations": encode(observation_space, _joined([o for o, *_ in episodes]), rows),
            "actions": encode(action_space, actions, rows),
            "rewards": pa.array(rewards),
            "terminations": pa.array(terminations),
            "truncations": pa.array(truncations),
        }
    )
    return batch, starts.tolist()


def _with_padding(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {key: _with_padding(value) for key, value in tree.items()}
    array = np.asarray(tree)
    return np.concatenate([array, np.zeros((1, *array.shape[1:]), array.dtype)])
