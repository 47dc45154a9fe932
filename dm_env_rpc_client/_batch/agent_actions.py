"""Actions and steps of multi-agent worlds by agent: checks, interleaving, splitting.

``check_agents`` refuses actions that name an agent the world does not have or
leave out one that must act (every joined agent acts in each step), before
anything is sent; ``interleave`` turns every agent's stacked actions into one
stacked dict over a batch's agent slots (slot ``w * num_agents + a``), so the
batch's encoder packs them at once; ``take_rows`` cuts one agent's steps out of a
batch of slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import errors
from .._adaptor.stacked import BatchedTimeStep
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

    def pick(tree: Any) -> Any:
        if isinstance(tree, Mapping):
            return {key: pick(value) for key, value in tree.items()}
        return tree[rows]

    return BatchedTimeStep(
        batch.step_type[rows],
        batch.reward[rows],
        batch.discount[rows],
        pick(batch.observation),
        ids,
        None if batch.truncated is None else batch.truncated[rows],
        None if batch.state is None else batch.state[rows],
    )


def interleave(actions_by_agent: Mapping[str, Any], agents: Sequence[str], worlds: int) -> Any:
    """Every agent's stacked actions as one stacked dict over the slots (world-major), when
    every agent gives flat arrays of the same names with the batch axis first; else None (the
    per-slot path, which raises each slot's own errors)."""
    first = actions_by_agent[agents[0]]
    if not isinstance(first, Mapping):
        return None
    names = list(first)
    columns: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for agent in agents:
        actions = actions_by_agent[agent]
        if not isinstance(actions, Mapping) or list(actions) != names:
            return None
        for name in names:
            value = actions[name]
            if isinstance(value, Mapping):
                return None
            array = np.asarray(value)
            if array.ndim == 0 or array.shape[0] != worlds:
                return None
            columns[name].append(array)
    stacked = {}
    for name, arrays in columns.items():
        joined = np.stack(arrays, axis=1)  # [worlds, agents, ...]
        stacked[name] = joined.reshape(worlds * len(agents), *joined.shape[2:])
    return stacked
