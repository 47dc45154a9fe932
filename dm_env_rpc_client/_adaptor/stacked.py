"""Batches: ``BatchedTimeStep``, stacking and splitting, and decoding many StepResponses at once.

``BatchedEnvironment`` on its loop turns each response only into a step type as
it lands (the state machine must advance in request order), and leaves the
observations to ``decode``, which runs once per ``recv`` in the caller's thread:
the adaptor's ``ObservationPlan`` (``_fastpath.decode``) checks every response against
the specs, as for a single step, and decodes each observation of all the worlds
with one NumPy call, instead of one ``unpack_tensor``, one dict and one TimeStep
per world and a ``np.stack`` at the end. The result is exactly what
``DmEnvAdaptor.step_response`` and stacking would give (the tests compare the
two); anything the fast path does not cover (strings, variable shapes,
broadcasts) is unpacked tensor by tensor. A response that contradicts the specs
raises ``ObservationError`` with its position.

It relies on every world sharing the template adaptor's wire specs, and on the
adaptor's own ``reward``/``discount`` rules (the batch makes plain
``DmEnvAdaptor``s), and reads the private spec tables of its ``AdaptorCore``
(``_adaptor.core``; this module never imports ``environment``).
``DmEnvAdaptor.step_iter`` uses ``columns`` the same way for a run of one
world's finished steps, and then the adaptor's own rules step by step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import dm_env
import numpy as np

from .. import errors, specs
from .._fastpath.decode import ObservationPlan
from .._proto import dm_env_rpc_pb2
from .core import DISCOUNT, REWARD, AdaptorCore

State = dm_env_rpc_pb2.EnvironmentStateType
_FIRST = int(dm_env.StepType.FIRST)
_BAD_BATCH = "Action {name!r} has batch size {actual} but {expected} worlds were stepped."
_NOT_BATCHED = (
    "Batched actions are one dict of arrays with the batch axis first, e.g. "
    "envs.step({example}) for {count} worlds, or a list of {count} per-world dicts; "
    "got {what}."
)


class BatchedTimeStep(NamedTuple):
    """TimeSteps of several worlds, stacked along the first axis.

    Attributes:
      step_type: uint8 ``[B]`` of ``dm_env.StepType`` values.
      reward: float64 ``[B]``; NaN on FIRST steps (dm_env's "no reward yet"). For
        sums over steps use ``reward_or_zero``, which has 0.0 there.
      discount: float64 ``[B]``; NaN on FIRST steps.
      observation: nested dict of ``[B, ...]`` arrays (object arrays when shapes differ).
      env_ids: int ``[B]``: which worlds these are.
      truncated: bool ``[B]``: True on the FIRST step of a world that was
        restarted after a failure (``on_world_failure="restart"``): its previous
        episode was cut short without a LAST step, so count it as truncated.
        ``BatchedEnvironment`` always fills it; None only in batches built by hand.
      state: uint8 ``[B]``: the server's ``EnvironmentStateType`` of each step
        (``RUNNING``, ``TERMINATED`` or ``INTERRUPTED``; ``dmr.dm_env_rpc_pb2``
        names them). A LAST step is TERMINATED when the episode ended by itself
        and INTERRUPTED when it was cut short (Gymnasium's ``terminated`` and
        ``truncated``); the discount does not tell the two apart.
        ``BatchedEnvironment`` always fills it; None only in batches built by hand.
    """

    step_type: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    observation: dict[str, Any]
    env_ids: np.ndarray
    truncated: np.ndarray | None = None
    state: np.ndarray | None = None

    def at(self, position: int) -> dm_env.TimeStep:
        """The ``dm_env.TimeStep`` of one world of the batch."""

        def number(value: float) -> float | None:
            return None if np.isnan(value) else float(value)

        def pick(tree: Any) -> Any:
            if isinstance(tree, Mapping):
                return {key: pick(value) for key, value in tree.items()}
            return tree[position]

        return dm_env.TimeStep(
            dm_env.StepType(int(self.step_type[position])),
            number(self.reward[position]),
            number(self.discount[position]),
            pick(self.observation),
        )

    def first(self) -> np.ndarray:
        return self.step_type == dm_env.StepType.FIRST

    @property
    def reward_or_zero(self) -> np.ndarray:
        """``reward`` with 0.0 on FIRST steps, where it is NaN: ``returns += batch.reward_or_zero``.

        The reward Gymnasium and EnvPool give; ``reward`` keeps dm_env's meaning (a
        FIRST step has no reward), and other values (a NaN the server sent) stay as they are.
        """
        return np.where(self.first(), 0.0, self.reward)

    def _repr_html_(self) -> str:
        """A grid of the worlds' pictures, step types and rewards (as ``dmr.show(batch)``)."""
        from .. import display  # presentation: only when rendered

        return display.batch_html(self)

    def last(self) -> np.ndarray:
        return self.step_type == dm_env.StepType.LAST


def stack(values: Sequence[Any]) -> Any:
    """Stacks per-world values (nested dicts alike); object arrays when shapes differ.

    Dicts whose keys differ (the agents of a multi-agent world, each observing its own
    things) stack to the union of their keys, a key's column an object array holding
    None where a world's dict lacks it.
    """
    first = values[0]
    if isinstance(first, Mapping):
        keys = first.keys()
        if any(value.keys() != keys for value in values):
            return _stack_apart(values)
        return {key: stack([value[key] for value in values]) for key in first}
    arrays = [np.asarray(value) for value in values]
    if all(a.shape == arrays[0].shape for a in arrays):
        return np.stack(arrays)
    out = np.empty(len(arrays), dtype=object)
    for index, array in enumerate(arrays):
        out[index] = array
    return out


def _stack_apart(values: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``stack`` of dicts whose keys differ (see there)."""
    keys = dict.fromkeys(key for value in values for key in value)
    out: dict[str, Any] = {}
    for key in keys:
        column = [value.get(key) for value in values]
        if all(item is not None for item in column):
            out[key] = stack(column)
            continue
        out[key] = np.empty(len(column), dtype=object)
        for index, item in enumerate(column):
            out[key][index] = item
    return out


def unstack(actions: Mapping[str, Any], count: int, prefix: str = "") -> list[dict[str, Any]]:
    """Splits batched actions (batch axis first) into one dict per world."""
    out: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in actions.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            for target, part in zip(out, unstack(value, count, name + "."), strict=True):
                target[key] = part
            continue
        array = np.asarray(value)
        if array.ndim == 0 or array.shape[0] != count:
            actual = "none (a scalar)" if array.ndim == 0 else array.shape[0]
            raise errors.SpecValidationError(
                _BAD_BATCH.format(name=name, actual=actual, expected=count)
            )
        for index in range(count):
            out[index][key] = array[index]
    return out


def split_actions(actions: Any, count: int, names: Sequence[str]) -> list[Mapping[str, Any]]:
    """One action dict per world, from the stacked form or a list of per-world dicts.

    Args:
      actions: ``{name: [count, ...] array}`` (nested dicts alike), or a list or
        tuple of ``count`` dicts, one per world in order.
      count: how many worlds are stepped.
      names: the action names, for the example in an error message.

    Raises:
      SpecValidationError: anything else, with a message that shows the stacked form.
    """
    if isinstance(actions, Mapping):
        return unstack(actions, count)  # type: ignore[return-value]
    if isinstance(actions, (list, tuple)):
        if len(actions) == count and all(isinstance(a, Mapping) for a in actions):
            return list(actions)
        kinds = sorted({type(a).__name__ for a in actions}) or ["nothing"]
        what = f"a {type(actions).__name__} of {len(actions)} ({', '.join(kinds)})"
    else:
        what = f"{type(actions).__name__}"
    first = names[0] if names else "name"
    example = f"{{{first!r}: np.array([...] * {count})}}"
    raise errors.SpecValidationError(_NOT_BATCHED.format(example=example, count=count, what=what))


def batch_of(timesteps: Sequence[dm_env.TimeStep], env_ids: Sequence[int]) -> BatchedTimeStep:
    """Stacks one TimeStep per world."""

    def number(value: Any) -> float:
        return float("nan") if value is None else float(np.asarray(value))

    return BatchedTimeStep(
        step_type=np.array([int(t.step_type) for t in timesteps], np.uint8),
        reward=np.array([number(t.reward) for t in timesteps]),
        discount=np.array([number(t.discount) for t in timesteps]),
        observation=stack([t.observation for t in timesteps]),
        env_ids=np.asarray(env_ids, dtype=np.int64),
    )


class StackedDecoder:
    """Decodes the step responses of worlds that share ``template``'s wire specs.

    Args:
      template: one of the worlds' adaptors (or the one adaptor, for a run of its steps).
    """

    def __init__(self, template: AdaptorCore) -> None:
        self._template = template
        self._plan = template._plan
        self._hidden = set(template._hidden)

    @property
    def plan(self) -> ObservationPlan:
        """The plan it decodes by (the template's)."""
        return self._plan

    def columns(self, responses: Sequence[Any]) -> dict[str, Any]:
        """Each requested observation of all the responses, by name (flat, hidden ones too).

        A column is a ``[N, ...]`` array where the fast path applies, else the list
        of the N values as ``unpack_tensor`` gives them.

        Raises:
          ObservationError: a response contradicts the specs (``_fastpath.decode``); its
            ``position`` says which.
        """
        return self._plan.columns(responses)

    def decode(
        self,
        step_types: Sequence[int],
        responses: Sequence[Any],
        env_ids: Sequence[int],
    ) -> BatchedTimeStep:
        """The stacked batch.

        Raises:
          ObservationError: a response contradicts the specs; its ``position``
            indexes ``responses``.
        """
        template = self._template
        count = len(responses)
        kinds = np.array(step_types, dtype=np.uint8)
        first = kinds == _FIRST
        columns = self._plan.columns(responses)
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
        return BatchedTimeStep(
            kinds, reward, discount, observation, np.asarray(env_ids, dtype=np.int64)
        )


def _per_world(values: Any, count: int) -> np.ndarray:
    """One float64 per world from a stacked reward or discount observation (a copy)."""
    return np.array(values, dtype=np.float64).reshape(count)
