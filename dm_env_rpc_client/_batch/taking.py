"""What ``recv`` takes from a batch's loop, and ``send``'s checks of the worlds it names.

The loop files each finished step under its world (``BatchCore._file``);
``take_filed`` takes every filed step, ``collect_plain`` counts and decodes the
usual batch (a plain step per world: no failure, error or restart among them),
and ``decode`` / ``decode_apart`` decode a batch, or find the one step of it
that does not decode (the others are filed again, ``put_back``). The usual case
runs in a few C-level passes (``zip``, ``map``, ``set``) over the steps, not a
Python loop: at thousands of worlds these run once per step, on the thread that
calls ``recv`` and ``send``.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._adaptor.stacked import BatchedTimeStep, batch_of
from .core import BatchCore
from .outcomes import _flagged

_BAD_ID = "env_ids holds {value!r}; give world indices from 0 to {last} (see envs.live_ids)."
_ONE, _POP = {1}, collections.deque.popleft
_PLAIN, _PAIRS = {tuple}, {2}  # a plain step's outcome: a (step type, response) tuple
_STATE = operator.attrgetter("state")
_WIRE_SPECS = operator.attrgetter("_wire_specs")


def checked_ids(count: int, env_ids: Sequence[int]) -> list[int]:
    """``env_ids`` as indices of a batch of ``count`` worlds.

    Raises:
      ValueError: one is not a whole number from 0 to ``count - 1``; names it.
    """
    last = count - 1
    # The usual case at C level: whole numbers (an integer array's, or any that
    # operator.index takes), all in range; anything else gets the loop's message below.
    if isinstance(env_ids, np.ndarray) and env_ids.ndim == 1 and env_ids.dtype.kind in "iu":
        ids = env_ids.tolist()
    else:
        if not isinstance(env_ids, (list, tuple)):
            env_ids = list(env_ids)  # read once, by the loop below too
        try:
            ids = list(map(operator.index, env_ids))
        except TypeError:
            ids = []
    if ids and min(ids) >= 0 and max(ids) <= last:
        return ids
    ids = []
    for value in env_ids:
        try:
            index = operator.index(value)
        except TypeError:
            raise ValueError(_BAD_ID.format(value=value, last=last)) from None
        if not 0 <= index <= last:
            raise ValueError(_BAD_ID.format(value=value, last=last))
        ids.append(index)
    return ids


def take_filed(core: BatchCore) -> list[tuple[int, Any, float]]:
    """Takes every filed step: (world, outcome, latency), by world, oldest first."""
    with core._lock:
        done, worlds, core._filed = core._done, sorted(set(core._filed)), []
        queues = list(map(done.__getitem__, worlds))
        if set(map(len, queues)) == _ONE:  # one step each, the usual
            outcomes, latencies = zip(*map(_POP, queues), strict=True)
            taken = list(zip(worlds, outcomes, latencies, strict=True))
        else:
            taken = [
                (index, *item)
                for index, queue in zip(worlds, queues, strict=True)
                for item in queue
            ]
            for queue in queues:
                queue.clear()
        core._ready -= len(taken)
    return taken


def put_back(core: BatchCore, items: list[tuple[int, Any, float]]) -> None:
    """Files ``items`` again at the front of their worlds' queues, in their order."""
    with core._lock:
        for index, outcome, latency in reversed(items):
            queue = core._done[index]
            if not queue:
                core._filed.append(index)
            queue.appendleft((outcome, latency))
        core._ready += len(items)


def as_joined(core: BatchCore, env_ids: list[int]) -> bool:
    """Whether every world of ``env_ids`` has the specs it joined with."""
    specs = map(_WIRE_SPECS, map(core.envs.__getitem__, env_ids))
    return all(map(operator.is_, specs, map(core._joined_specs.__getitem__, env_ids)))


def collect_plain(core: BatchCore, taken: list[tuple[int, Any, float]]) -> BatchedTimeStep | None:
    """``recv``'s batch from ``taken`` if each is a plain step (else None, nothing done): the
    worlds' steps counted as received, their latencies kept, and the batch decoded."""
    if not taken:
        return None
    worlds, outcomes, waits = zip(*taken, strict=True)
    if set(map(type, outcomes)) != _PLAIN or set(map(len, outcomes)) != _PAIRS:
        return None
    in_flight = core._in_flight
    for index in worlds:
        in_flight[index] -= 1
    core._in_flight_total -= len(worlds)
    core.latencies.extend(waits)
    kinds, answers = zip(*outcomes, strict=True)
    try:
        stacked = decode(core, list(worlds), kinds, answers)
    except Exception:  # find the world whose step does not decode
        return decode_apart(core, taken)
    return _flagged(stacked, None, list(map(_STATE, answers)))


def decode(
    core: BatchCore, env_ids: list[int], step_types: Sequence[Any], responses: Sequence[Any]
) -> BatchedTimeStep:
    """The batch of these steps: decoded at once, or (specs differ) one TimeStep per world."""
    if core._decoder is not None and as_joined(core, env_ids):
        return core._decoder.decode(step_types, responses, env_ids)
    # Specs differ between worlds (or changed on reset): one TimeStep per world.
    timesteps = [
        core.envs[index]._timestep(step_type, response)
        for index, step_type, response in zip(env_ids, step_types, responses, strict=True)
    ]
    return batch_of(timesteps, env_ids)


def decode_apart(core: BatchCore, taken: list[tuple[int, Any, float]]) -> BatchedTimeStep:
    """Raises ``WorldError`` for the first step that does not decode; the rest stay filed."""
    for position, (index, outcome, _) in enumerate(taken):
        try:
            core.envs[index]._timestep(outcome[0], outcome[1])
        except Exception as exc:
            rest = taken[:position] + taken[position + 1 :]
            for other, other_outcome, _ in rest:  # they are filed again below
                core._count(other, other_outcome[2] if len(other_outcome) > 2 else 1)
            put_back(core, rest)
            raise core._wrap(index, exc) from exc
    raise AssertionError("the batch did not decode, but each step does")
