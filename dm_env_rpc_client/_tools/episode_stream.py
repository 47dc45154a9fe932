"""Episodes cut from a batch's stacked steps: ``EpisodeStream``, behind ``Recording.add_batch``.

The stepping thread hands over each ``recv``'s ``BatchedTimeStep`` with its actions as
they are: one reference per ``recv`` (``Block``), no per-world copy, no per-step
object. A run of blocks is then joined into one set of columns (``joined``: one
concatenation per column, the actions' dicts turned into columns); a writer process
gets them joined (a few arrays to pickle and send, not a block's worth of small
objects per ``recv``), except an observation column of large rows (images), whose
blocks' parts travel as they are. ``EpisodeStream.cut_joined`` groups the rows by
world with one stable sort and one gather per column, and walks each world's rows
from boundary to boundary (FIRST and LAST steps; MID steps are never visited one by
one). A finished episode goes to the writer as a ``recording.Episode``, its columns
sliced from the gathered ones (joined only when it spans several cuts); the rows of
an episode still running stay with its world (as ranges of those columns) until a
later cut ends it.

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


_BIG_ROW = 1024  # bytes: an observation column of larger rows is joined on the writer's side
Joined = tuple[np.ndarray, Columns]  # rows' worlds, columns (a list: parts still to join)


def joined(blocks: Sequence[Block]) -> Joined | None:
    """The blocks' rows as one set of columns (``obs/``, ``act/`` prefixes), and their worlds
    (None for no blocks).

    An observation column of rows over ``_BIG_ROW`` bytes stays a list of the blocks'
    arrays (``cut_joined`` joins it): a writer process gets them as they are.
    """
    if not blocks:
        return None
    lengths = [len(b.step_type) for b in blocks]
    columns: Columns = {
        "step_type": _concatenated([b.step_type for b in blocks]),
        "reward": _concatenated([b.reward for b in blocks]),
        "discount": _concatenated([b.discount for b in blocks]),
        "state": _concatenated(
            [
                np.full(len(b.step_type), _UNKNOWN, np.uint8) if b.state is None else b.state
                for b in blocks
            ]
        ),
    }
    for name in dict.fromkeys(name for b in blocks for name in b.observation):
        parts = _parts([b.observation for b in blocks], name, lengths)
        row = parts[0].dtype.itemsize * int(np.prod(parts[0].shape[1:]))
        big = len(parts) > 1 and parts[0].dtype != object and row > _BIG_ROW
        columns[f"obs/{name}"] = parts if big else _concatenated(parts)
    for name, column in _action_columns([a for b in blocks for a in b.actions]).items():
        columns[f"act/{name}"] = column
    return _concatenated([b.env_ids for b in blocks]), columns


def _parts(groups: Sequence[Mapping[str, Any]], name: str, lengths: Sequence[int]) -> list[Any]:
    """Column ``name`` of several groups of rows; zeros for a group without it (a piece of
    FIRST steps has no action columns; a step outside an episode may differ)."""
    example = next(group[name] for group in groups if name in group)
    return [
        group[name] if name in group else np.zeros((rows, *example.shape[1:]), example.dtype)
        for group, rows in zip(groups, lengths, strict=True)
    ]


def _concatenated(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Columns joined; an object column of per-row arrays where their shapes differ."""
    if len(parts) == 1:
        return parts[0]
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
        # Running episodes' pieces: (a cut's gathered columns, first row, end row).
        self._open: list[list[tuple[Columns, int, int]] | None] = [None] * worlds
        self._numbers = [0] * worlds

    def cut(self, blocks: Sequence[Block], worlds: Sequence[int] = ()) -> None:
        """Cuts the episodes that ``blocks`` end; then ends ``worlds``' running ones as cut."""
        self.cut_joined(joined(blocks), worlds)

    def cut_joined(self, rows: Joined | None, worlds: Sequence[int] = ()) -> None:
        """``cut`` of blocks already ``joined`` (None: no rows)."""
        if rows is not None:
            env_ids, columns = rows
            order = np.argsort(env_ids, kind="stable")
            ids = env_ids[order]
            columns = {
                name: (column if isinstance(column, np.ndarray) else _concatenated(column))[order]
                for name, column in columns.items()
            }
            step_type = columns["step_type"]
            marks = np.flatnonzero(step_type != 1).tolist()  # FIRST and LAST rows
            present = np.flatnonzero(np.diff(ids, prepend=-1, append=-1)).tolist()
            kinds = step_type[marks].tolist()
            at = 0
            for lo, hi in itertools.pairwise(present):
                stop = at
                while stop < len(marks) and marks[stop] < hi:
                    stop += 1
                self._walk(int(ids[lo]), columns, lo, hi, marks[at:stop], kinds[at:stop])
                at = stop
        for world in worlds:
            self._end(world, truncated=True, interrupted=False)

    def _walk(
        self, world: int, columns: Columns, lo: int, hi: int, marks: list[int], kinds: list[int]
    ) -> None:
        """World ``world``'s rows ``lo`` to ``hi``; ``marks`` are its FIRST and LAST rows."""
        start = lo
        for row, kind in zip(marks, kinds, strict=True):
            if kind == _FIRST:
                self._extend(world, columns, start, row)
                self._end(world, truncated=True, interrupted=False)
                self._open[world] = []
                start = row
            elif kind == _LAST:
                if self._open[world] is None:
                    start = row + 1  # not in an episode: dropped
                    continue
                self._extend(world, columns, start, row + 1)
                state = int(columns["state"][row])
                if state == _UNKNOWN:
                    interrupted = bool(columns["discount"][row] != 0.0)
                else:
                    interrupted = state == _INTERRUPTED
                self._end(world, truncated=False, interrupted=interrupted)
                start = row + 1
        self._extend(world, columns, start, hi)

    def _extend(self, world: int, columns: Columns, start: int, stop: int) -> None:
        pieces = self._open[world]
        if pieces is not None and stop > start:
            pieces.append((columns, start, stop))

    def _end(self, world: int, *, truncated: bool, interrupted: bool) -> None:
        pieces, self._open[world] = self._open[world], None
        if pieces is None or sum(stop - start for _, start, stop in pieces) < 2:
            return  # no transition: nothing to keep
        if len(pieces) == 1:
            columns, start, stop = pieces[0]
            whole = {name: column[start:stop] for name, column in columns.items()}
        else:
            groups = [{n: c[start:stop] for n, c in cols.items()} for cols, start, stop in pieces]
            lengths = [stop - start for _, start, stop in pieces]
            whole = {
                name: _concatenated(_parts(groups, name, lengths))
                for name in dict.fromkeys(name for group in groups for name in group)
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
