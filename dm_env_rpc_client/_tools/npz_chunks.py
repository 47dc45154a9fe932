"""The ``.npz`` layouts of a recording: one episode per file, or several (``NpzWriter``'s chunks).

Creating a file is what an episode file costs most: on the ext4 disk of the 2-core
machine the benchmarks run on, the kernel takes 250-700 µs to create one (its
``open(O_CREAT)``), against about 30 µs for the ``writev`` and ``rename`` that follow.
Catch's episodes are 10 steps, so a file per episode cost the writer 40-60 µs per step
in the kernel alone. ``NpzWriter(episodes_per_file=N)`` (what ``run --record`` uses)
keeps each world's finished episodes until it has ``N`` of them, or ``CHUNK_BYTES`` of
arrays, and writes them as one file, their arrays joined along the steps:

``episodes_<world>_<first>-<last>.npz`` (``n`` episodes of one world, numbered
``first`` to ``last``; ``S`` steps in all, ``T_i + 1`` for episode ``i``):

==============================  ================  =======================================
key                             shape             meaning
==============================  ================  =======================================
``step_type``                   ``[S]`` uint8     the episodes' step types, one after another
``reward``, ``discount``        ``[S]`` float64   likewise (NaN at each episode's FIRST)
``observation/<name>``          ``[S, ...]``      likewise
``action/<name>``               ``[S - n, ...]``  each episode's ``T_i`` actions, one after another
``meta/world``, ``meta/seed``   ``[]`` int64      as in an episode file
``meta/episode``                ``[n]`` int64     each episode's number in its world
``meta/length``                 ``[n]`` int64     each episode's ``T_i``
``meta/truncated``              ``[n]`` bool      as in an episode file, per episode
``meta/interrupted``            ``[n]`` bool      likewise
==============================  ================  =======================================

Ragged tensors are stored as in an episode file, over all the file's steps. The
rule that ends a chunk depends on the episodes only (``N`` episodes, ``CHUNK_BYTES``,
or an episode whose tensors differ in name or dtype from the chunk's), so the same
episodes always give the same files. An episode held for a later chunk is copied (a few
KB for Catch), so a world holds at most ``CHUNK_BYTES`` of its own, never a view that
keeps a whole flush's columns alive; one written at once (large) is not copied.
``read`` reads both layouts.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import specs
from .episode_stream import stacked

CHUNK_BYTES = 1 << 20
"""A chunk holding this many bytes of arrays is written, however few episodes it has: a
world's large episodes are not held back (nor kept in memory) for long."""
NO_SEED = -1
_GROUPS = ("observation", "action")
_BASE = ("step_type", "reward", "discount")
_NAME = re.compile(r"episodes?_(\d+)_(\d+)")
Arrays = dict[str, np.ndarray]


def _stack(group: str, values: Mapping[str, Any], arrays: Arrays) -> None:
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            arrays[f"{group}/{name}"] = value
        else:  # a variable-length tensor: flattened values plus each step's shape
            _ragged_arrays(f"{group}/{name}", [np.asarray(part) for part in value], arrays)


def _ragged_arrays(key: str, parts: Sequence[np.ndarray], arrays: Arrays) -> None:
    arrays[f"ragged/{key}"] = np.concatenate([part.ravel() for part in parts])
    arrays[f"ragged_shape/{key}"] = np.array([part.shape for part in parts], np.int64).reshape(
        len(parts), -1
    )


def _meta(episode: Any) -> tuple[int, int]:
    return episode.world or 0, NO_SEED if episode.seed is None else episode.seed


def episode_arrays(episode: Any) -> Arrays:
    """The arrays of one episode's file (``recording``'s layout)."""
    world, seed = _meta(episode)
    arrays: Arrays = {
        "step_type": episode.step_type,
        "reward": episode.reward,
        "discount": episode.discount,
        "meta/world": np.array(world, np.int64),
        "meta/episode": np.array(episode.episode or 0, np.int64),
        "meta/seed": np.array(seed, np.int64),
        "meta/truncated": np.array(episode.truncated),
        "meta/interrupted": np.array(episode.interrupted),
    }
    _stack("observation", specs.flatten(episode.observation), arrays)
    _stack("action", specs.flatten(episode.action), arrays)
    return arrays


def episode_name(world: int, episode: int) -> str:
    """The file name of one episode."""
    return f"episode_{world:03d}_{episode:06d}.npz"


def order(name: str) -> tuple[int, int, str]:
    """A sort key of episode and chunk files: world, then (first) episode."""
    match = _NAME.match(name)
    return (int(match[1]), int(match[2]), name) if match else (-1, -1, name)


class _Pending:
    """One world's episodes waiting for their chunk, flattened once."""

    def __init__(self) -> None:
        self.episodes: list[Any] = []  # for their metadata
        self.flat: list[dict[str, dict[str, Any]]] = []  # their arrays, in _BASE and _GROUPS
        self.signature: Any = None
        self.nbytes = 0


def _signature(flat: Mapping[str, Mapping[str, Any]]) -> Any:
    """The tensors' names and dtypes: a chunk's episodes share them (ragged or not)."""
    return tuple(
        (group, name, (value if isinstance(value, np.ndarray) else np.asarray(value[0])).dtype.str)
        for group in _GROUPS
        for name, value in flat[group].items()
    )


def _nbytes(flat: Mapping[str, Mapping[str, Any]]) -> int:
    return sum(
        value.nbytes if isinstance(value, np.ndarray) else sum(np.asarray(p).nbytes for p in value)
        for group in flat.values()
        for value in group.values()
    )


class Chunks:
    """Each world's finished episodes, gathered into chunks (see the module docs).

    Args:
      episodes_per_file: the most episodes a chunk holds.
    """

    def __init__(self, episodes_per_file: int) -> None:
        self.episodes_per_file = episodes_per_file
        self._pending: dict[int, _Pending] = {}

    def add(self, episode: Any) -> list[tuple[str, Arrays]]:
        """Takes one episode; returns the chunks it completes (file name, arrays)."""
        flat = {group: specs.flatten(getattr(episode, group)) for group in _GROUPS}
        signature = _signature(flat)
        flat["base"] = {name: getattr(episode, name) for name in _BASE}
        world = _meta(episode)[0]
        pending = self._pending.setdefault(world, _Pending())
        done = []
        if pending.episodes and pending.signature != signature:
            done.append(self._take(world))
            pending = self._pending.setdefault(world, _Pending())
        size = _nbytes(flat)
        if (
            len(pending.episodes) + 1 < self.episodes_per_file
            and pending.nbytes + size < CHUNK_BYTES
        ):  # held for a while: its own copy, not a view holding a whole flush's columns
            flat = {group: {k: _owned(v) for k, v in flat[group].items()} for group in flat}
        pending.episodes.append(episode)
        pending.flat.append(flat)
        pending.signature = signature
        pending.nbytes += size
        if len(pending.episodes) >= self.episodes_per_file or pending.nbytes >= CHUNK_BYTES:
            done.append(self._take(world))
        return done

    def drain(self) -> list[tuple[str, Arrays]]:
        """Every world's chunk in the making (for ``close``), by world."""
        return [self._take(world) for world in sorted(self._pending)]

    def _take(self, world: int) -> tuple[str, Arrays]:
        pending = self._pending.pop(world)
        episodes = pending.episodes
        first, last = episodes[0].episode or 0, episodes[-1].episode or 0
        return f"episodes_{world:03d}_{first:06d}-{last:06d}.npz", _pack(pending)


def _pack(pending: _Pending) -> Arrays:
    episodes = pending.episodes
    arrays: Arrays = {
        name: _joined([flat["base"][name] for flat in pending.flat]) for name in _BASE
    }
    world, seed = _meta(episodes[0])
    arrays["meta/world"] = np.array(world, np.int64)
    arrays["meta/seed"] = np.array(seed, np.int64)
    arrays["meta/episode"] = np.array([e.episode or 0 for e in episodes], np.int64)
    arrays["meta/length"] = np.array([len(e.step_type) - 1 for e in episodes], np.int64)
    arrays["meta/truncated"] = np.array([e.truncated for e in episodes], bool)
    arrays["meta/interrupted"] = np.array([e.interrupted for e in episodes], bool)
    for group in _GROUPS:
        for name in pending.flat[0][group]:
            values = [flat[group][name] for flat in pending.flat]
            if (
                all(isinstance(v, np.ndarray) for v in values)
                and len({v.shape[1:] for v in values}) == 1
            ):
                arrays[f"{group}/{name}"] = _joined(values)
            else:  # ragged, or shapes that differ from episode to episode
                rows = [np.asarray(row) for value in values for row in value]
                _ragged_arrays(f"{group}/{name}", rows, arrays)
    return arrays


def _owned(value: Any) -> Any:
    """An array copied out of the buffer it is a view of; a ragged list as it is."""
    return value.copy() if isinstance(value, np.ndarray) and value.base is not None else value


def _joined(values: list[np.ndarray]) -> np.ndarray:
    """The arrays joined along the steps; one alone as it is (a large episode is not copied)."""
    return values[0] if len(values) == 1 else np.concatenate(values)


def _per_step(values: np.ndarray, shapes: np.ndarray) -> list[np.ndarray]:
    parts, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        parts.append(values[start : start + size].reshape(tuple(int(n) for n in shape)))
        start += size
    return parts


def read(data: Any, make: Callable[..., Any]) -> list[Any]:
    """The episodes of an opened ``.npz`` (``np.load``'s), either layout, made by ``make``.

    ``make`` is called with ``recording.Episode``'s fields.
    """
    files = data.files
    columns: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
    for key in files:
        kind, _, rest = key.partition("/")
        if kind in columns:
            columns[kind][rest] = data[key]
        elif kind == "ragged":
            group, _, name = rest.partition("/")
            columns[group][name] = _per_step(data[key], data[f"ragged_shape/{rest}"])
    meta = {key[len("meta/") :]: data[key] for key in files if key.startswith("meta/")}
    seed = int(meta["seed"]) if "seed" in meta else NO_SEED
    common = {
        "world": int(meta["world"]) if "world" in meta else None,
        "seed": None if seed == NO_SEED else seed,
    }
    if "length" not in meta:  # one episode
        return [
            make(
                step_type=data["step_type"],
                reward=data["reward"],
                discount=data["discount"],
                observation=specs.unflatten(columns["observation"]),
                action=specs.unflatten(columns["action"]),
                episode=int(meta["episode"]) if "episode" in meta else None,
                truncated=bool(meta.get("truncated", False)),
                interrupted=bool(meta.get("interrupted", False)),
                **common,
            )
        ]
    lengths = [int(n) for n in meta["length"]]
    steps = list(itertools.accumulate(n + 1 for n in lengths))[:-1]
    actions = list(itertools.accumulate(lengths))[:-1]
    split = {
        "observation": {k: _split(v, steps) for k, v in columns["observation"].items()},
        "action": {k: _split(v, actions) for k, v in columns["action"].items()},
    }
    base = {name: np.split(data[name], steps) for name in _BASE}
    return [
        make(
            step_type=base["step_type"][i],
            reward=base["reward"][i],
            discount=base["discount"][i],
            observation=specs.unflatten({k: v[i] for k, v in split["observation"].items()}),
            action=specs.unflatten({k: v[i] for k, v in split["action"].items()}),
            episode=int(meta["episode"][i]),
            truncated=bool(meta["truncated"][i]),
            interrupted=bool(meta["interrupted"][i]),
            **common,
        )
        for i in range(len(lengths))
    ]


def _split(column: Any, at: list[int]) -> list[Any]:
    if isinstance(column, np.ndarray):
        return np.split(column, at)
    bounds = [0, *at, len(column)]
    return [stacked(column[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
