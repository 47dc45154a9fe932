"""The adaptor's non-I/O core, shared by the sync and the asyncio environment.

``AdaptorCore`` holds one joined world's specs and turns actions into
StepRequests and StepResponses into ``dm_env.TimeStep``s; it never sends
anything. ``DmEnvAdaptor`` (``environment``) and the batch decoder
(``_adaptor.stacked``) build on it.

Step types follow the server's states in request order: RUNNING after RUNNING
is MID, RUNNING otherwise FIRST, TERMINATED or INTERRUPTED after RUNNING LAST;
any other transition raises ``ProtocolError``. The ``reward`` and ``discount``
observations, when the server offers them, become ``TimeStep.reward`` and
``TimeStep.discount`` and are left out of the observation unless requested by
name. Without a reward observation the reward is 0.0; without a discount
observation the discount is 1.0 while RUNNING or INTERRUPTED and 0.0 on
TERMINATED. Reward and discount are None on FIRST, as dm_env requires (the
reference package passes a server's discount through on FIRST). Override
``reward()`` and ``discount()`` to change this.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import dm_env
import numpy as np
from dm_env import specs as dm_specs

from .. import errors, messages, specs, tensors
from .._base import checks as _checks
from .._base.futures import TimedFuture
from .._fastpath.decode import ObservationPlan
from .._fastpath.step_encoder import ActionEncoder
from .._proto import dm_env_rpc_pb2

State = dm_env_rpc_pb2.EnvironmentStateType
# Plain ints and StepTypes for the per-step state machine (the enum wrapper's attribute
# lookups cost more than the rest of it).
_RUNNING = int(State.RUNNING)
_ENDED = (int(State.TERMINATED), int(State.INTERRUPTED))
_FIRST, _MID, _LAST = dm_env.StepType.FIRST, dm_env.StepType.MID, dm_env.StepType.LAST
_STEP, _STEP_REQUEST = "step", "StepRequest"  # the payload field and type of a step request
REWARD = "reward"
DISCOUNT = "discount"
CLOSE_TIMEOUT = 10.0  # the most close() waits for each response by default

_BAD_TRANSITION = (
    "The server's state went from {before} to {after}, which no step type describes. "
    "Usually the server ended a sequence that had not started (two ends in a row), or "
    "did not start a new sequence after TERMINATED/INTERRUPTED/reset."
)
_INVALID_STATE = (
    "The server sent the invalid state {state}; it must be RUNNING, TERMINATED or INTERRUPTED."
)
_CLOSED = "The environment is closed; create or join a world again."
_NOT_A_DICT = (
    "An action is a dict keyed by action name, e.g. env.step({example}); got {type_name} "
    "{value}. The actions are: {names}."
)


def _plain(value: Any) -> str:
    """A value as a user would type it: ``1`` for ``np.int8(1)``, lists for arrays."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def not_a_dict_error(action: Any, names: list[str]) -> errors.SpecValidationError:
    """The error for an action that is not a dict, showing the dict form with its names."""
    shown = _plain(action)
    if len(names) == 1:
        example = f"{{{names[0]!r}: {shown}}}"
    else:
        example = "{" + ", ".join(f"{name!r}: ..." for name in names[:3]) + "}"
    return errors.SpecValidationError(
        _NOT_A_DICT.format(
            example=example,
            type_name=type(action).__name__,
            value=shown,
            names=", ".join(repr(name) for name in names) or "(none)",
        )
    )


def _state_name(state: int | None) -> str:
    return "none (no step yet)" if state is None else State.Name(state)  # type: ignore[arg-type]


def pack_settings(
    settings: Mapping[str, Any] | None, name: str = "settings"
) -> dict[str, dm_env_rpc_pb2.Tensor]:
    """Packs settings (nested dicts of Python or NumPy values) as ``{dotted key: Tensor}``.

    Raises:
      ArgumentTypeError: settings that are not a dict, naming them as ``name``.
    """
    _checks.check_settings(settings, name)
    if not settings:
        return {}
    return {key: tensors.pack_tensor(value) for key, value in specs.flatten(settings).items()}


class AdaptorCore:
    """One joined world's specs, step-type state machine and reward/discount routing (no I/O).

    Args:
      specs: the ``ActionObservationSpecs`` from the JoinWorldResponse.
      requested_observations: observation names to return; None returns all
        (without ``reward`` and ``discount``, which go into the TimeStep).
      nested_tensors: give and take nested dicts for dotted names.
      validate: check actions against their specs before sending.
      world_name: the joined world's name.
      copy_observations: False gives large observations as read-only views of
        the response bytes, without a copy (see ``DmEnvAdaptor``).
    """

    _timeout: float | None = None  # each response's wait; the I/O adaptors set their own
    _extension_names: Sequence[str] = ()  # set by _attach_extensions

    def __init__(
        self,
        specs: dm_env_rpc_pb2.ActionObservationSpecs,
        requested_observations: Iterable[str] | None = None,
        nested_tensors: bool = True,
        *,
        validate: bool = True,
        world_name: str | None = None,
        copy_observations: bool = True,
    ) -> None:
        self._nested = nested_tensors
        self._validate = validate
        self._copy_observations = copy_observations
        self._requested_names = (
            None if requested_observations is None else list(requested_observations)
        )
        self.world_name = world_name
        self._last_state: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._set_specs(specs)

    def _set_specs(self, wire_specs: dm_env_rpc_pb2.ActionObservationSpecs) -> None:
        self._wire_specs = wire_specs
        self._actions = specs.SpecManager(
            wire_specs.actions, validate=self._validate, kind="action"
        )
        self._observations = specs.SpecManager(wire_specs.observations, kind="observation")
        names = self._observations.names()
        self._has_reward = REWARD in names
        self._has_discount = DISCOUNT in names
        if self._requested_names is None:
            visible = [name for name in names if name not in (REWARD, DISCOUNT)]
        else:
            visible = list(self._requested_names)
            for name in visible:
                self._observations.name_to_uid(name)  # raises UnknownNameError
        self._visible = visible
        self._dotted = any("." in name for name in visible)  # else nesting changes nothing
        self._hidden = [
            name for name in (REWARD, DISCOUNT) if name in names and name not in visible
        ]
        self._uids = [self._observations.name_to_uid(name) for name in visible + self._hidden]
        self._request_uids = sorted(self._uids)  # in a StepRequest, in the reference's order
        self._plan = ObservationPlan(wire_specs.observations, self._uids, self._copy_observations)
        # Step requests as bytes without messages (``_step_data``); not for a subclass that
        # makes its own requests, nor without validation (pack_tensor's own conversions).
        cls = type(self)
        own_requests = (
            cls.step_request is AdaptorCore.step_request
            and cls._step_request is AdaptorCore._step_request
        )
        self._encoder = ActionEncoder(self._actions) if self._validate and own_requests else None

    # --- the TimeStep state machine ------------------------------------------------------

    def step_response(self, response: dm_env_rpc_pb2.StepResponse) -> dm_env.TimeStep:
        """The TimeStep of a StepResponse to a request from ``step_request``.

        For driving the connection yourself: call it once per response, in
        request order, as it advances the step-type state machine.

        Raises:
          ProtocolError: an impossible state transition.
        """
        step_type = self._advance(response.state)
        return self._timestep(step_type, response)

    def _advance(self, state: int) -> dm_env.StepType:
        """Moves the state machine on by one response's state; returns its step type."""
        with self._lock:
            before = self._last_state
            if state == _RUNNING:
                step_type = _MID if before == _RUNNING else _FIRST
            elif state in _ENDED:
                if before != _RUNNING:
                    raise errors.ProtocolError(
                        _BAD_TRANSITION.format(before=_state_name(before), after=_state_name(state))
                    )
                step_type = _LAST
            else:
                raise errors.ProtocolError(_INVALID_STATE.format(state=state))
            self._last_state = state
        return step_type

    def _timestep(
        self, step_type: dm_env.StepType, response: dm_env_rpc_pb2.StepResponse
    ) -> dm_env.TimeStep:
        observations = self._plan.decode_response(response)
        return self._timestep_of(step_type, response.state, observations)

    def _timestep_of(
        self, step_type: dm_env.StepType, state: int, observations: dict[str, Any]
    ) -> dm_env.TimeStep:
        """The TimeStep from decoded flat observations (``reward``/``discount`` included)."""
        reward = self.reward(state, step_type, observations)
        discount = self.discount(state, step_type, observations)
        for name in self._hidden:
            observations.pop(name, None)
        if self._nested and self._dotted:
            observations = specs.unflatten(observations)
        return dm_env.TimeStep(step_type, reward, discount, observations)

    def _run_timesteps(
        self, responses: Sequence[dm_env_rpc_pb2.StepResponse], decoder: Any
    ) -> Iterator[dm_env.TimeStep]:
        """The TimeSteps of a run of consecutive responses, in request order.

        Moves the state machine on by all of them first; a run of several is
        decoded at once by ``decoder`` (a ``_adaptor.stacked.StackedDecoder`` of this
        adaptor). If a response has a state no step type describes, or contradicts
        the specs, the steps before it are yielded, then its ``ProtocolError`` (or
        ``ObservationError``) is raised: no good step is lost. The responses after
        it still move the state machine on, as the steps left in flight do.
        """
        step_types: list[dm_env.StepType] = []
        bad_state: errors.ProtocolError | None = None
        for response in responses:
            try:
                step_type = self._advance(response.state)
            except errors.ProtocolError as exc:
                bad_state = bad_state or exc  # the first; the state machine stays where it was
                continue
            if bad_state is None:
                step_types.append(step_type)
        yield from self._decoded(step_types, responses[: len(step_types)], decoder)
        if bad_state is not None:
            raise bad_state

    def _decoded(
        self,
        step_types: Sequence[dm_env.StepType],
        responses: Sequence[dm_env_rpc_pb2.StepResponse],
        decoder: Any,
    ) -> Iterator[dm_env.TimeStep]:
        """The TimeSteps of responses whose step types are known (``_run_timesteps``)."""
        if len(responses) <= 1:
            for step_type, response in zip(step_types, responses, strict=True):
                yield self._timestep(step_type, response)
            return
        try:
            columns = decoder.columns(responses)
        except errors.ObservationError as exc:
            good = exc.position or 0  # the steps before the offending one are delivered
            for step_type, response in zip(step_types[:good], responses[:good], strict=True):
                yield self._timestep(step_type, response)
            raise
        for index, (step_type, response) in enumerate(zip(step_types, responses, strict=True)):
            observations = {name: column[index] for name, column in columns.items()}
            yield self._timestep_of(step_type, response.state, observations)

    def reward(
        self, state: int, step_type: dm_env.StepType, observations: Mapping[str, Any]
    ) -> Any:
        """The TimeStep reward: the ``reward`` observation; None on FIRST. Override freely.

        Args:
          state: the server's EnvironmentStateType.
          step_type: the dm_env StepType.
          observations: the flat observations, including reward and discount.
        """
        if step_type == dm_env.StepType.FIRST:
            return None
        if self._has_reward:
            return observations.get(REWARD)
        return 0.0

    def discount(
        self, state: int, step_type: dm_env.StepType, observations: Mapping[str, Any]
    ) -> Any:
        """The TimeStep discount: None on FIRST, the ``discount`` observation, else by state.

        Override freely. (The reference package passes a discount observation
        through on FIRST steps too, which breaks dm_env's contract.)
        """
        if step_type == dm_env.StepType.FIRST:
            return None
        if self._has_discount and DISCOUNT in observations:
            return observations[DISCOUNT]
        return 0.0 if state == State.TERMINATED else 1.0

    # --- requests and specs ----------------------------------------------------------------

    def _reset_done(self, response: dm_env_rpc_pb2.ResetResponse) -> None:
        """After a ResetResponse: take its specs if they changed; the next step is FIRST."""
        if response.specs != self._wire_specs:
            self._set_specs(response.specs)
        with self._lock:
            self._last_state = State.INTERRUPTED

    def _close_timeout(self, timeout: float | None) -> float:
        """What ``close`` waits for each response: ``timeout``, else the adaptor's, at most 10 s."""
        if timeout is not None:
            _checks.check_seconds(timeout)
            return timeout
        return CLOSE_TIMEOUT if self._timeout is None else min(self._timeout, CLOSE_TIMEOUT)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.ConnectionClosedError(_CLOSED)

    def step_request(self, action: Mapping[str, Any] | None) -> dm_env_rpc_pb2.StepRequest:
        """The StepRequest for an action (packed and checked against the specs).

        For driving the connection yourself (``step_async`` does this for you):
        send it, then pass its response to ``step_response``.

        Raises:
          UnknownNameError: for an action name not in the specs.
          SpecValidationError: for a wrong dtype, shape or bound, or an action
            that is not a dict (the message shows the dict form).
          ConnectionClosedError: the environment is closed.
        """
        self._check_open()
        return self._step_request(action)

    def _step_request(self, action: Mapping[str, Any] | None) -> dm_env_rpc_pb2.StepRequest:
        """``step_request`` without the check that the environment is open."""
        if action is not None and not isinstance(action, Mapping):
            raise not_a_dict_error(action, self._actions.names())
        packed = self._actions.pack(action) if action else {}
        return dm_env_rpc_pb2.StepRequest(actions=packed, requested_observations=self._request_uids)

    def _step_data(self, action: Mapping[str, Any] | None) -> tuple[bytes, str, str]:
        """``step_request(action)`` as EnvironmentRequest bytes, for a connection of the SDK.

        Returns ``(bytes, the response field expected, the request's type name)`` (the
        name for a timeout's message). The bytes are those of
        ``messages.envelope(self.step_request(action))``; a ``dict`` action of
        numeric values is encoded without building messages (``ActionEncoder``),
        anything else goes through ``step_request`` and raises its errors.
        """
        encoder = self._encoder
        if encoder is not None:
            self._check_open()
            data = encoder.encode(action, self._step_request)
            if data is not None:
                return data, _STEP, _STEP_REQUEST
        request = self.step_request(action)
        data, expected = messages.envelope(request)
        return data, expected, type(request).__name__

    def observation_spec(self) -> dict[str, Any]:
        converted = {
            name: specs.tensor_spec_to_dm_env_spec(self._observations.name_to_spec(name))
            for name in self._visible
        }
        return specs.unflatten(converted) if self._nested else converted

    def action_spec(self) -> dict[str, Any]:
        return self._actions.dm_env_specs(nested=self._nested)

    def reward_spec(self) -> dm_specs.Array:
        if self._has_reward:
            return specs.tensor_spec_to_dm_env_spec(self._observations.name_to_spec(REWARD))
        return dm_specs.Array((), np.float64, name=REWARD)

    def discount_spec(self) -> dm_specs.BoundedArray:
        if self._has_discount:
            spec = specs.tensor_spec_to_dm_env_spec(self._observations.name_to_spec(DISCOUNT))
            if isinstance(spec, dm_specs.BoundedArray):
                return spec
            return dm_specs.BoundedArray(spec.shape, spec.dtype, 0.0, 1.0, name=DISCOUNT)
        return dm_specs.BoundedArray((), np.float64, 0.0, 1.0, name=DISCOUNT)

    def _spec_rows(self) -> tuple[list[Any], list[Any]]:
        """Spec table rows of the actions and of the observations a TimeStep carries."""
        visible = set(self._visible)  # as the text repr and observation_spec() list them
        observations = [row for row in specs.specs_table(self._observations) if row[0] in visible]
        return specs.specs_table(self._actions), observations

    def __repr__(self) -> str:
        address = getattr(getattr(self, "_connection", None), "address", None)
        actions = ", ".join(self._actions.names())
        observations = ", ".join(self._visible)
        state = "closed" if self._closed else "open"
        return (
            f"{type(self).__name__}(world={self.world_name!r}, address={address!r}, {state}, "
            f"actions=[{actions}], observations=[{observations}])"
        )

    @property
    def _dm_env_rpc_specs(self) -> dm_env_rpc_pb2.ActionObservationSpecs:
        """The joined world's ``ActionObservationSpecs``, under the reference adaptor's name
        (subclasses written for it read it in their ``action_spec`` or ``reset``)."""
        return self._wire_specs

    def _attach_extensions(self, extensions: Mapping[str, Any] | None) -> None:
        """Sets each extension as an attribute, as the reference's ``extensions=`` does.

        ``properties`` takes the place of ``env.properties``; another name the
        adaptor already has raises ``ValueError``, as the reference does.
        """
        self._extension_names = list(extensions or ())
        for name, extension in (extensions or {}).items():
            if name == "properties":
                self._properties = extension
            elif hasattr(self, name):
                raise errors.ArgumentValueError(
                    f"DmEnvAdaptor already has attribute {name!r}; rename the extension."
                )
            else:
                setattr(self, name, extension)

    def _release_extensions(self) -> None:
        """On close: the extensions' attributes become None, as in the reference."""
        for name in self._extension_names:
            if name != "properties":
                setattr(self, name, None)

    @property
    def action_manager(self) -> specs.SpecManager:
        """The SpecManager of the actions."""
        return self._actions

    @property
    def observation_manager(self) -> specs.SpecManager:
        """The SpecManager of the observations."""
        return self._observations


class StepFuture(TimedFuture):
    """The Future of ``step_async``: its TimeStep is made on the first ``result()``.

    The reader thread files each response as ``(step type, response)``, moving
    the state machine on in request order, and leaves the observations to
    ``make(step_type, response)``, which runs once, in the thread that first asks
    for the result (or the exception). Decoding on the reader held the GIL on
    the path every response takes: at 16 steps in flight against a sync server
    that cost about 25 µs of client CPU per step and a fifth of the steps/s.
    A response that contradicts the specs fails the Future with its
    ``ObservationError`` all the same (``result()`` raises it, ``exception()``
    returns it).
    """

    what = "step"

    def __init__(self, make: Callable[[Any, Any], dm_env.TimeStep]) -> None:
        super().__init__()
        self._make = make
        self._made_lock = threading.Lock()
        self._made: tuple[bool, Any] | None = None  # (made, TimeStep or the exception)

    def _timestep(self, filed: tuple[Any, Any]) -> tuple[bool, Any]:
        made = self._made
        if made is None:
            with self._made_lock:
                made = self._made
                if made is None:
                    step_type, response = filed
                    try:
                        made = (True, self._make(step_type, response))
                    except Exception as exc:
                        made = (False, exc)
                    self._made = made
        return made

    def result(self, timeout: float | None = None) -> Any:
        # The request's own error, or a timeout, is raised here.
        made, value = self._timestep(super().result(timeout))
        if not made:
            raise value
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        if error is not None:
            return error
        made, value = self._timestep(super().result())
        return None if made else value
