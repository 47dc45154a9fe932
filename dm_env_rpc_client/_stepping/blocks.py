"""The run loop's random actions, drawn a block at a time and taken stacked.

Drawing one random action per world per step (``random_action``) cost the run
loop more than the rest of a step (a few NumPy calls per action, and stacking
the actions for ``send``). ``ActionBlocks`` draws each world's next ``BLOCK``
actions at once from the world's own generator (``random_batch(spec, BLOCK,
rng)``: one NumPy call per action leaf), into one table per leaf of ``[worlds,
BLOCK, *shape]``, and ``take(worlds)`` gives each of those worlds its next
action, stacked in ``send`` order, with one indexing per leaf.

A world's actions depend on its generator and ``BLOCK`` alone, never on the
order in which the worlds' steps come back, on the number of worlds or on how a
run is split into shards: the same call plays the same actions. (For an action
of one leaf they are what ``random_action`` would draw one by one; with several
leaves, a block draws ``BLOCK`` of the first, then of the next, and so on.)

It applies to specs whose leaves all have a fixed shape and a numeric or bool
dtype, of at most ``MAX_ACTION_BYTES`` in all (so the tables stay small: 2 KB a
world); ``applies`` says whether it does, and the loop draws one by one otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dm_env.specs as dm_specs
import numpy as np

from ..random_actions import random_batch

BLOCK = 32  # actions drawn per world at once
MAX_ACTION_BYTES = 64  # the largest action (all its leaves) drawn a block at a time


def _leaves(spec: Any) -> list[Any]:
    """The specs of a nested dict/list of specs, in ``random_batch``'s order."""
    if isinstance(spec, Mapping):
        return [leaf for value in spec.values() for leaf in _leaves(value)]
    if isinstance(spec, (list, tuple)):
        return [leaf for value in spec for leaf in _leaves(value)]
    return [spec]


def _rebuild(spec: Any, leaves: Any) -> Any:
    """``spec``'s structure with its leaves taken in order from the iterator ``leaves``."""
    if isinstance(spec, Mapping):
        return {key: _rebuild(value, leaves) for key, value in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(_rebuild(value, leaves) for value in spec)
    return next(leaves)


def applies(spec: Any) -> bool:
    """Whether ``spec``'s actions can be drawn a block at a time (see the module docs)."""
    leaves = _leaves(spec)
    if not leaves or not all(isinstance(leaf, dm_specs.Array) for leaf in leaves):
        return False
    if isinstance(spec, (list, tuple)):
        return False  # (a tuple spec's structure may be a NamedTuple's: drawn one by one)
    size = 0
    for leaf in leaves:
        dtype = np.dtype(leaf.dtype)
        if isinstance(leaf, dm_specs.StringArray) or dtype.kind not in "biuf":
            return False
        if any(dim < 0 for dim in leaf.shape):
            return False
        size += dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64))
    return size <= MAX_ACTION_BYTES


class ActionBlocks:
    """Each world's random actions, drawn ``BLOCK`` at a time (see the module docs).

    Args:
      spec: the batch's action spec (``applies(spec)`` must hold).
      rngs: world ``i``'s generator is ``rngs[i]``.
    """

    def __init__(self, spec: Any, rngs: Sequence[np.random.Generator]) -> None:
        self._spec, self._rngs = spec, rngs
        count = len(rngs)
        self._tables = [
            np.empty((count, BLOCK, *leaf.shape), np.dtype(leaf.dtype)) for leaf in _leaves(spec)
        ]
        self._next = np.full(count, BLOCK, np.int64)  # each world's next row; BLOCK: draw

    def take(self, worlds: Sequence[int]) -> Any:
        """The next action of each of ``worlds`` (no world twice), stacked in that order.

        Returns:
          The spec's structure with ``[len(worlds), *shape]`` arrays.
        """
        return _rebuild(self._spec, iter(self._take_leaves(worlds)))

    def take_rounds(self, rounds: Sequence[Sequence[int]]) -> Any:
        """``take`` of each round (no world twice in one), stacked one round after another:
        a world's actions in its order of steps.

        Returns:
          The spec's structure with ``[sum of the rounds' lengths, *shape]`` arrays.
        """
        if len(rounds) == 1:
            return self.take(rounds[0])
        parts = [self._take_leaves(part) for part in rounds]
        return _rebuild(
            self._spec, iter([np.concatenate(leaf) for leaf in zip(*parts, strict=True)])
        )

    def _take_leaves(self, worlds: Sequence[int]) -> list[np.ndarray]:
        rows = np.asarray(worlds, np.int64)
        at = self._next[rows]
        for world in rows[at == BLOCK].tolist():  # a world whose block is used up
            self._draw(world)
        at[at == BLOCK] = 0
        self._next[rows] = at + 1
        return [table[rows, at] for table in self._tables]

    def _draw(self, world: int) -> None:
        block = random_batch(self._spec, BLOCK, self._rngs[world])
        for table, values in zip(self._tables, _leaves(block), strict=True):
            table[world] = values
