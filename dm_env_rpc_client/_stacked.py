"""Many StepResponses decoded at once into arrays with a leading batch axis.

``BatchedEnvironment`` on its loop turns each response only into a step type as
it lands (the state machine must advance in request order), and leaves the
observations to ``decode``, which runs once per ``recv`` in the caller's thread:
each observation of all the worlds is joined as raw bytes and decoded by one
NumPy call (``tensors.stack_tensors``), instead of one ``unpack_tensor``, one
dict and one TimeStep per world and a ``np.stack`` at the end. The result is
exactly what ``DmEnvAdaptor.step_response`` and stacking would give (the tests
compare the two); anything the fast path does not cover (strings, variable
shapes, broadcasts, a missing observation) is unpacked tensor by tensor.

It relies on every world sharing the template adaptor's wire specs, and on the
adaptor's own ``reward``/``discount`` rules (the batch makes plain
``DmEnvAdaptor``s), and reads the adaptor's private spec tables for it.
``DmEnvAdaptor.step_iter`` uses ``columns`` the same way for a run of one
world's finished steps, and then the adaptor's own rules step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import dm_env
import numpy as np

from dm_env_rpc_client import specs, tensors
from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client.environment import DISCOUNT, REWARD, DmEnvAdaptor

State = dm_env_rpc_pb2.EnvironmentStateType
_FIRST = int(dm_env.StepType.FIRST)


class _Column(NamedTuple):
    name: str
    uid: int
    data_type: int
    shape: tuple[int, ...]


class Stacked(NamedTuple):
    """Decoded batch: step types, rewards and discounts (NaN on FIRST), observations."""

    step_type: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    observation: dict[str, Any]


class StackedDecoder:
    """Decodes the step responses of worlds that share ``template``'s wire specs.

    Args:
      template: one of the worlds' adaptors (or the one adaptor, for a run of its steps).
    """

    def __init__(self, template: DmEnvAdaptor) -> None:
        manager = template._observations
        self._template = template
        self._columns = [
            _Column(name, uid, spec.dtype, tuple(spec.shape))
            for name in template._visible + template._hidden
            for uid in [manager.name_to_uid(name)]
            for spec in [manager.uid_to_spec(uid)]
        ]
        self._hidden = set(template._hidden)

    def columns(self, responses: Sequence[dm_env_rpc_pb2.StepResponse]) -> dict[str, Any] | None:
        """Each requested observation of all the responses, by name (flat, hidden ones too).

        A column is a ``[N, ...]`` array where the fast path applies, else the list
        of the N values as ``unpack_tensor`` gives them. None if a response lacks
        a requested observation.
        """
        flat: dict[str, Any] = {}
        for column in self._columns:
            try:
                items = [response.observations[column.uid] for response in responses]
            except KeyError:
                return None
            stacked = tensors.stack_tensors(items, column.data_type, column.shape)
            flat[column.name] = (
                stacked if stacked is not None else [tensors.unpack_tensor(i) for i in items]
            )
        return flat

    def decode(
        self,
        step_types: Sequence[int],
        responses: Sequence[dm_env_rpc_pb2.StepResponse],
        stack: Callable[[Sequence[Any]], Any],
    ) -> Stacked | None:
        """The stacked batch, or None if a response lacks a requested observation.

        ``stack`` stacks a column of per-world values that the fast path left as a list.
        """
        template = self._template
        count = len(responses)
        kinds = np.array(step_types, dtype=np.uint8)
        first = kinds == _FIRST
        columns = self.columns(responses)
        if columns is None:
            return None
        flat = {
            name: value if isinstance(value, np.ndarray) else stack(value)
            for name, value in columns.items()
        }
        reward = _per_world(flat[REWARD], count) if template._has_reward else np.zeros(count)
        if template._has_discount:
            discount = _per_world(flat[DISCOUNT], count)
        else:
            states = np.array([response.state for response in responses])
            discount = np.where(states == State.TERMINATED, 0.0, 1.0)
        reward[first] = np.nan
        discount[first] = np.nan
        observation = {name: value for name, value in flat.items() if name not in self._hidden}
        if template._nested and template._dotted:
            observation = specs.unflatten(observation)
        return Stacked(kinds, reward, discount, observation)


def _per_world(values: Any, count: int) -> np.ndarray:
    """One float64 per world from a stacked reward or discount observation (a copy)."""
    return np.array(values, dtype=np.float64).reshape(count)
