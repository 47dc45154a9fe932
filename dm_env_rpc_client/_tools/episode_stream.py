"""Episodes cut from a batch's stacked steps: ``EpisodeStream``, behind ``Recording.add_batch``.

The stepping thread hands over each ``recv``'s ``BatchedTimeStep`` with its actions as
they are: one reference per ``recv`` (``Block``), no per-world copy, no per-step
object. ``EpisodeStream.cut`` (on the writer's thread under ``Recording(background=True)``)
then takes a run of blocks at once: it concatenates their columns, groups the rows by
world with one stable sort and one gather per column, and walks each world's rows
from boundary to boundary (FIRST and LAST steps; MID steps are never visited one by
one). A finished episode goes to the writer as a ``recording.Episode``; the rows of an
episode still running stay with its world (as views) until a later block ends it.

Episodes are cut by the rules of ``EpisodeRecorder``, so both give the same episodes:
a FIRST step ends a running episode as truncated (a restarted world, a reset), a LAST
step ends it (INTERRUPTED when its state says so, else by its discount), steps outside
an episode (joined mid-episode, after a LAST) are dropped, and ``cut(worlds=...)``
ends the named worlds' episodes as truncated. An episode with no transition is dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import specs

_FIRST, _LAST = 0, 2
_INTERRUPTED = 3  # EnvironmentStateType.INTERRUPTED
_UNKNOWN = 255  # no state given: the discount tells (0: TERMINATED)
Columns = dict[str, Any]


class Block(NamedTuple):
    """One ``recv``'s steps, as the batch gave them (see ``BatchedTimeStep``)."""

    step_type: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    state: np.ndarray | None
    env_ids: np.ndarray
    observation: Mapping[str, Any]  # flat: dotted name -> [n, ...] array (object for ragged)
    actions: Sequence[Mapping[str, Any] | None]  # per row; None on FIRST rows


def stacked(parts: Sequence[Any]) -> Any:
    """Per-step values as one ``[T, ...]`` array, or a list of arrays where shapes differ."""
    arrays = [np.asarray(part) for part in parts]
    return np.stack(arrays) if len({a.shape for a in arrays}) == 1 else arrays


def _action_columns(actions: Sequence[Mapping[str, Any] | None]) -> Columns:
    """Per-row action dicts (None on FIRST rows) as flat ``[n, ...]`` columns (zeros on FIRST)."""
    template = next((a for a in actions if a is not None), None)
    if template is None:
        return {}
    nested = any(isinstance(value, Mapping) for value in template.values())
    rows = [None if a is None else (specs.flatten(a) if nested else a) for a in actions]
    flat = specs.flatten(template) if nested else template
    columns: Columns = {}
    for name, example in flat.items():
        filler = np.zeros_like(np.asarray(example))
        values = [filler if row is None else row[name] for row in rows]
        try:
            columns[name] = np.asarray(values) if filler.dtype != object else _objects(values)
        except ValueError:  # shapes differ from row to row
            columns[name] = _objects(values)
    return columns


def _objects(values: Sequence[Any]) -> np.ndarray:
    column = np.empty(len(values), object)
    column[:] = [np.asarray(value) for value in values]
    return column


def _concatenate(blocks: Sequence[Block]) -> tuple[np.ndarray, Columns]:
    """The blocks' rows as one set of columns (``obs/``, ``act/`` prefixes), and their worlds."""
    lengths = [len(b.step_type) for b in blocks]
    columns: Columns = {
        "step_type": np.concatenate([b.step_type for b in blocks]),
        "reward": np.concatenate([b.reward for b in blocks]),
        "discount": np.concatenate([b.discount for b in blocks]),
        "state": np.concatenate(
            [
                np.full(len(b.step_type), _UNKNOWN, np.uint8) if b.state is None else b.state
                for b in blocks
            ]
        ),
    }
    for name in dict.fromkeys(name for b in blocks for name in b.observation):
        columns[f"obs/{name}"] = _filled([b.observation for b in blocks], name, lengths)
    for name, column in _action_columns([a for b in blocks for a in b.actions]).items():
        columns[f"act/{name}"] = column
    return np.concatenate([b.env_ids for b in blocks]), columns


def _filled(groups: Sequence[Mapping[str, Any]], name: str, lengths: Sequence[int]) -> np.ndarray:
    """Column ``name`` of several groups of rows, joined; zeros for a group without it (a
    piece of FIRST steps has no action columns; a step outside an episode may differ)."""
    example = next(group[name] for group in groups if name in group)
    parts = [
        group[name] if name in group else np.zeros((rows, *example.shape[1:]), example.dtype)
        for group, rows in zip(groups, lengths, strict=True)
    ]
    return _concatenated(parts)


def _concatenated(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Columns joined; an object column of per-row arrays where their shapes differ."""
    if len({p.shape[1:] for p in parts}) > 1 or any(p.dtype == object for p in parts):
        parts = [p if p.dtype == object else _objects(list(p)) for p in parts]
    return np.concatenate(parts)


class EpisodeStream:
    """Cuts blocks of stacked steps into episodes and hands each to ``emit``.

    Args:
      worlds: how many worlds the batch has.
      seeds: each world's seed (None: none).
      first_world: the index of world 0 in the episodes' metadata.
      emit: called with each finished episode's fields (``recording.Episode``'s keywords).
    """

    def __init__(
        self,
        worlds: int,
        seeds: Sequence[int | None],
        first_world: int,
        emit: Callable[..., None],
    ) -> None:
        self._seeds = list(seeds)
        self._first_world = first_world
        self._emit = emit
        self._open: list[list[Columns] | None] = [None] * worlds  # running episodes' pieces
        self._numbers = [0] * worlds

    def cut(self, blocks: Sequence[Block], worlds: Sequence[int] = ()) -> None:
        """Cuts the episodes that ``blocks`` end; then ends ``worlds``' running ones as cut."""
        if blocks:
            env_ids, columns = _concatenate(blocks)
            order = np.argsort(env_ids, kind="stable")
            ids = env_ids[order]
            columns = {name: column[order] for name, column in columns.items()}
            present = np.flatnonzero(np.diff(ids, prepend=-1, append=-1))
            for lo, hi in itertools.pairwise(present.tolist()):
                piece = {name: column[lo:hi] for name, column in columns.items()}
                self._walk(int(ids[lo]), piece)
        for world in worlds:
            self._end(world, truncated=True, interrupted=False)

    def _walk(self, world: int, piece: Columns) -> None:
        step_type = piece["step_type"]
        start = 0
        for row in np.flatnonzero(step_type != 1).tolist():
            if step_type[row] == _FIRST:
                self._extend(world, piece, start, row)
                self._end(world, truncated=True, interrupted=False)
                self._open[world] = []
                start = row
            elif step_type[row] == _LAST:
                if self._open[world] is None:
                    start = row + 1  # not in an episode: dropped
                    continue
                self._extend(world, piece, start, row + 1)
                state = int(piece["state"][row])
                if state == _UNKNOWN:
                    interrupted = bool(piece["discount"][row] != 0.0)
                else:
                    interrupted = state == _INTERRUPTED
                self._end(world, truncated=False, interrupted=interrupted)
                start = row + 1
        self._extend(world, piece, start, len(step_type))

    def _extend(self, world: int, piece: Columns, start: int, stop: int) -> None:
        pieces = self._open[world]
        if pieces is not None and stop > start:
            pieces.append({name: column[start:stop] for name, column in piece.items()})

    def _end(self, world: int, *, truncated: bool, interrupted: bool) -> None:
        pieces, self._open[world] = self._open[world], None
        if pieces is None or sum(len(p["step_type"]) for p in pieces) < 2:
            return  # no transition: nothing to keep
        lengths = [len(p["step_type"]) for p in pieces]
        whole = {
            name: pieces[0][name] if len(pieces) == 1 else _filled(pieces, name, lengths)
            for name in dict.fromkeys(name for piece in pieces for name in piece)
        }
        observation: Columns = {}
        action: Columns = {}
        for name, column in whole.items():
            group, _, key = name.partition("/")
            if group == "obs":
                observation[key] = stacked(list(column)) if column.dtype == object else column
            elif group == "act":
                rows = column[1:]  # the FIRST row has no action
                action[key] = stacked(list(rows)) if rows.dtype == object else rows
        self._numbers[world] += 1
        self._emit(
            step_type=whole["step_type"],
            reward=whole["reward"],
            discount=whole["discount"],
            observation=specs.unflatten(observation),
            action=specs.unflatten(action),
            world=self._first_world + world,
            episode=self._numbers[world],
            seed=self._seeds[world],
            truncated=truncated,
            interrupted=interrupted,
        )
