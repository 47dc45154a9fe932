"""Actions and steps of multi-agent worlds by agent: checks, interleaving, splitting.

``check_agents`` refuses actions that name an agent the world does not have or
leave out one that must act (every joined agent acts in each step), before
anything is sent; ``interleave`` turns every agent's stacked actions into one
stacked dict over a batch's agent slots (slot ``w * num_agents + a``), so the
batch's encoder packs them at once; ``take_rows`` cuts one agent's steps out of a
batch of slots, and ``cut_by_agent`` a batch into every agent's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import errors
from .._adaptor.stacked import BatchedTimeStep, stack
from .._base import checks as _checks

_UNKNOWN_AGENT = "actions name {unknown}, which this world does not have; its agents are {agents}."
_MISSING_AGENT = (
    "actions hold nothing for {missing}: every joined agent acts in each step (a lockstep "
    "server waits for it); give each of {agents} an action ({{}} for its spec's defaults)."
)
_NOT_BY_AGENT = "actions_by_agent must be a dict {{agent name: action}}, not {kind}."


def _names(items: Sequence[str]) -> str:
    return ", ".join(repr(item) for item in items)


def check_agents(actions_by_agent: Any, agents: Sequence[str]) -> None:
    """Refuses actions that are not a dict by agent, name an unknown agent, or miss one.

    Raises:
      ArgumentTypeError: not a mapping.
      ArgumentValueError: an unknown agent, or a joined agent without an action.
    """
    if (
        type(actions_by_agent) is dict
        and len(actions_by_agent) == len(agents)
        and all(map(actions_by_agent.__contains__, agents))
    ):
        return  # the usual: exactly the agents (C-level passes)
    if not isinstance(actions_by_agent, Mapping):
        raise errors.ArgumentTypeError(_NOT_BY_AGENT.format(kind=_checks.kind(actions_by_agent)))
    unknown = [str(name) for name in actions_by_agent if name not in agents]
    if unknown:
        raise errors.ArgumentValueError(
            _UNKNOWN_AGENT.format(unknown=_names(unknown), agents=_names(agents))
        )
    missing = [name for name in agents if name not in actions_by_agent]
    if missing:
        raise errors.ArgumentValueError(
            _MISSING_AGENT.format(missing=_names(missing), agents=_names(agents))
        )


def take_rows(batch: BatchedTimeStep, rows: np.ndarray | slice, ids: np.ndarray) -> BatchedTimeStep:
    """The steps of ``batch`` at ``rows`` (indices, or a slice: views), as worlds ``ids``."""
    observation = batch.observation
    if set(map(type, observation.values())) <= _ARRAY:  # flat: one indexing per name
        observation = {key: value[rows] for key, value in observation.items()}
    else:
        observation = _pick(observation, rows)
    truncated, state = batch.truncated, batch.state
    return _new_step(
        (
            batch.step_type[rows],
            batch.reward[rows],
            batch.discount[rows],
            observation,
            ids,
            None if truncated is None else truncated[rows],
            None if state is None else state[rows],
        )
    )


_ARRAY = {np.ndarray}
_new_step = BatchedTimeStep._make  # (tuple.__new__ underneath: no per-field defaults work)


def _pick(tree: Any, rows: np.ndarray | slice) -> Any:
    if isinstance(tree, Mapping):
        return {key: _pick(value, rows) for key, value in tree.items()}
    return tree[rows]


def cut_by_agent(
    batch: BatchedTimeStep, agents: Sequence[str], worlds: Sequence[int] | None, differ: bool
) -> dict[str, BatchedTimeStep]:
    """``batch`` (of agent slots, slot ``w * len(agents) + a``) cut by agent name, each with its
    world indices as ``env_ids``. Steps of every agent of ``worlds``, world by world (what
    ``recv`` and ``reset`` give for those worlds' slots), are cut by strided views; any other
    batch by its ``env_ids``. ``differ``: the agents' observation specs differ, so each
    agent's observations are made its own again (``own_observations``)."""
    count = len(agents)
    if worlds is not None and len(batch.env_ids) == len(worlds) * count:
        ids = np.asarray(worlds)
        cut = {
            name: take_rows(batch, slice(agent, None, count), ids)
            for agent, name in enumerate(agents)
        }
    else:
        slots = np.asarray(batch.env_ids)
        agent_of = slots % count
        cut = {
            name: take_rows(batch, rows, slots[rows] // count)
            for agent, name in enumerate(agents)
            for rows in (np.flatnonzero(agent_of == agent),)
        }
    if differ:
        for name, steps in cut.items():
            cut[name] = steps._replace(observation=own_observations(steps.observation))
    return cut


def own_observations(observation: Mapping[str, Any]) -> dict[str, Any]:
    """One agent's rows of a batch over agents whose observations differ, as its own: the
    names the others' alone have (None in its rows) left out, and the rest stacked again
    (``stack`` held them as object arrays of the rows' values)."""
    own: dict[str, Any] = {}
    for name, column in observation.items():
        if isinstance(column, Mapping):
            own[name] = own_observations(column)
        elif column.dtype != object or not len(column):
            own[name] = column
        elif all(item is not None for item in column):
            own[name] = stack(list(column))
    return own


def interleave(actions_by_agent: Mapping[str, Any], agents: Sequence[str], worlds: int) -> Any:
    """Every agent's stacked actions as one stacked dict over the slots (world-major), when
    every agent gives flat arrays of the same names with the batch axis first; else None (the
    per-slot path, which raises each slot's own errors)."""
    every = [actions_by_agent[agent] for agent in agents]
    first = every[0]
    if not isinstance(first, Mapping):
        return None
    keys = first.keys()
    if any(not isinstance(actions, Mapping) or actions.keys() != keys for actions in every):
        return None
    count = len(agents)
    stacked = {}
    for name in keys:
        found = [_as_array(actions[name]) for actions in every]
        arrays = [array for array in found if array is not None]
        if len(arrays) < count:
            return None
        head = arrays[0]
        if head.ndim == 0 or head.shape[0] != worlds:
            return None
        if len({(array.shape, array.dtype) for array in arrays}) == 1:  # the usual: alike
            joined = np.empty((worlds, count, *head.shape[1:]), head.dtype)
            for agent, array in enumerate(arrays):
                joined[:, agent] = array
        else:
            if any(array.ndim == 0 or array.shape[0] != worlds for array in arrays):
                return None
            joined = np.stack(arrays, axis=1)  # [worlds, agents, ...]
        stacked[name] = joined.reshape(worlds * count, *joined.shape[2:])
    return stacked


def _as_array(value: Any) -> np.ndarray | None:
    """``value`` as an array; None for a nested dict (the per-slot path takes it)."""
    if type(value) is np.ndarray:
        return value
    if isinstance(value, Mapping):
        return None
    return np.asarray(value)
