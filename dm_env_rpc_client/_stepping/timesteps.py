"""Parts of a ``BatchedTimeStep``: some of its rows (``rows``), several joined (``join``).

The stepping loop keeps the steps it got no action for (a world whose steps are
spent, or a run that stopped) as rows of the batches they came in, and joins
them into one ``BatchedTimeStep`` at the end (``RunStats.waiting``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..batched import BatchedTimeStep


def rows(timestep: BatchedTimeStep, positions: Sequence[int]) -> BatchedTimeStep:
    """The steps at ``positions`` of ``timestep``, in that order."""
    index = np.asarray(positions, dtype=np.int64)

    def pick(tree: Any) -> Any:
        if isinstance(tree, Mapping):
            return {key: pick(value) for key, value in tree.items()}
        return None if tree is None else np.asarray(tree)[index]

    return BatchedTimeStep(*(pick(field) for field in timestep))


def drop_worlds(part: BatchedTimeStep | None, worlds: set[int]) -> BatchedTimeStep | None:
    """``part`` without the steps of ``worlds``; None if no step is left."""
    if part is None:
        return None
    ids = part.env_ids.tolist()
    keep = [position for position, world in enumerate(ids) if world not in worlds]
    if not keep:
        return None
    return part if len(keep) == len(ids) else rows(part, keep)


def join(parts: Sequence[BatchedTimeStep]) -> BatchedTimeStep | None:
    """The steps of ``parts`` one after the other, or None if there are none.

    ``truncated`` and ``state`` are None if one part has None (hand-built batches);
    observations whose shapes differ between parts become object arrays.
    """
    parts = [part for part in parts if len(part.env_ids)]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]

    def cat(values: list[Any]) -> Any:
        if any(value is None for value in values):
            return None
        if isinstance(values[0], Mapping):
            return {key: cat([value[key] for value in values]) for key in values[0]}
        arrays = [np.asarray(value) for value in values]
        try:
            return np.concatenate(arrays)
        except ValueError:  # shapes differ: one object per row
            flat = [row for array in arrays for row in array]
            out = np.empty(len(flat), dtype=object)
            for position, row in enumerate(flat):
                out[position] = row
            return out

    return BatchedTimeStep(
        *(cat([getattr(p, name) for p in parts]) for name in BatchedTimeStep._fields)
    )
