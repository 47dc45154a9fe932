"""Worlds of the embedded server: a dm_env.Environment with its wire specs.

A ``World`` owns one environment; its ``WireSpecs`` (one per agent in a
multi-agent world, ``_multiworld``) are everything needed to speak about it on the
wire: ``{uid: TensorSpec}`` maps for actions and observations (dotted names from
the nested dm_env specs, UIDs numbered from 1 in sorted-name order, so they are
stable), action decoding with validation, and observation encoding.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import dm_env
import grpc
import numpy as np
from dm_env import specs as dm_specs
from google.rpc import status_pb2

from .. import specs, tensors
from .._codec.payload import _varint
from .._proto import dm_env_rpc_pb2


class ServerError(Exception):
    """A request failed; answered as an error Status with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _flatten_specs(nested: Any, fallback: str) -> dict[str, dm_specs.Array]:
    if isinstance(nested, dm_specs.Array):
        return {fallback: nested}
    return specs.flatten_dm_env_specs(nested)


class _WireSpec:
    """One action or observation: its dm_env spec, TensorSpec and NumPy dtype."""

    __slots__ = ("dm_spec", "dtype", "limits", "name", "scalar", "shape", "tensor_spec", "uid")

    def __init__(self, uid: int, name: str, dm_spec: dm_specs.Array) -> None:
        self.uid = uid
        self.name = name
        self.dm_spec = dm_spec
        self.tensor_spec = specs.dm_env_spec_to_tensor_spec(dm_spec, name)
        self.dtype = tensors.DATA_TYPE_TO_NUMPY[self.tensor_spec.dtype]
        self.shape = tuple(dm_spec.shape)
        # A scalar numeric spec checks its values in Python, without dm_env's validate():
        # ``limits`` are its bounds as Python numbers (None: any value of the dtype).
        bounded = isinstance(dm_spec, dm_specs.BoundedArray)
        found = specs.Bounds(dm_spec.minimum, dm_spec.maximum) if bounded else None
        self.limits = specs._scalar_bounds(found)
        self.scalar = (
            not self.shape and self.dtype.kind in "iuf" and (self.limits is not None or not bounded)
        )


def _lookup(table: Mapping[int, _WireSpec], uid: int, kind: str) -> _WireSpec:
    """The spec of a UID, or INVALID_ARGUMENT listing the known UIDs and names."""
    spec = table.get(uid)
    if spec is None:
        known = ", ".join(f"{u} ({s.name})" for u, s in table.items())
        raise ServerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Unknown {kind} UID {uid}. Known {kind} UIDs: {known}.",
        )
    return spec


def _same(one: Any, other: Any) -> bool:
    """Whether two worlds' specs are equal (dm_env's ``==``: shape, dtype, name, bounds)."""
    try:
        return bool(one == other)
    except Exception:  # a spec whose == does not give one truth value: not the same
        return False


def _number(flat: Mapping[str, dm_specs.Array]) -> dict[int, _WireSpec]:
    return {uid: _WireSpec(uid, name, flat[name]) for uid, name in enumerate(sorted(flat), start=1)}


class WireSpecs:
    """One agent's specs on the wire: UIDs, TensorSpecs, action decoding, observation encoding."""

    _single_action: bool
    _single_observation: bool
    actions: dict[int, _WireSpec]
    observations: dict[int, _WireSpec]
    observation_by_name: dict[str, _WireSpec]
    specs: dm_env_rpc_pb2.ActionObservationSpecs
    join_response: bytes  # EnvironmentResponse{join_world: {specs}}, serialized once

    def __init__(
        self,
        action_spec: Any,
        observation_spec: Any,
        reward_spec: Any,
        discount_spec: Any,
        like: WireSpecs | None = None,
    ) -> None:
        """The wire specs of these dm_env specs; ``like`` (same specs, compared) lends its own."""
        self._signature = (action_spec, observation_spec, reward_spec, discount_spec)
        if like is not None and _same(like._signature, self._signature):
            # Made once per server, not per world (it was most of creating a world).
            self._single_action = like._single_action
            self._single_observation = like._single_observation
            self.actions, self.observations = like.actions, like.observations
            self.observation_by_name, self.specs = like.observation_by_name, like.specs
            self.join_response = like.join_response
            return
        self._single_action = isinstance(action_spec, dm_specs.Array)
        self.actions = _number(_flatten_specs(action_spec, "action"))
        observations = _flatten_specs(observation_spec, "observation")
        for extra, spec in zip(("reward", "discount"), self._signature[2:], strict=True):
            if extra not in observations:
                observations[extra] = spec
        self._single_observation = isinstance(observation_spec, dm_specs.Array)
        self.observations = _number(observations)
        self.observation_by_name = {spec.name: spec for spec in self.observations.values()}
        self.specs = dm_env_rpc_pb2.ActionObservationSpecs(
            actions={uid: spec.tensor_spec for uid, spec in self.actions.items()},
            observations={uid: spec.tensor_spec for uid, spec in self.observations.items()},
        )
        self.join_response = dm_env_rpc_pb2.EnvironmentResponse(
            join_world=dm_env_rpc_pb2.JoinWorldResponse(specs=self.specs)
        ).SerializeToString()

    def decode_actions(self, actions: Mapping[int, dm_env_rpc_pb2.Tensor]) -> Any:
        """Unpacks and validates the actions of a StepRequest into the env's structure.

        Actions the request leaves out take their spec's ``generate_value()``.

        Raises:
          ServerError: INVALID_ARGUMENT naming the action and what was expected.
        """
        values: dict[str, Any] = {}
        for uid, tensor in actions.items():
            spec = _lookup(self.actions, uid, "action")
            values[spec.name] = self._decode(spec, tensor)
        for spec in self.actions.values():
            if spec.name not in values:
                values[spec.name] = spec.dm_spec.generate_value()
        if self._single_action:
            return values["action"]
        return specs.unflatten(values)

    @staticmethod
    def _decode(spec: _WireSpec, tensor: dm_env_rpc_pb2.Tensor) -> Any:
        try:
            sent = tensors.get_tensor_type(tensor)
            if sent != spec.dtype.type:
                raise ValueError(f"expected dtype {spec.dtype} but got {np.dtype(sent)}")
            unpacked = tensors.unpack_tensor(tensor)
            if spec.scalar and isinstance(unpacked, np.generic):
                limits = spec.limits
                if limits is None or limits[0] <= unpacked.item() <= limits[1]:
                    return np.asarray(unpacked)
                # Out of bounds (or NaN): dm_env's validate() below decides and explains.
            value = np.asarray(unpacked)
            if spec.dtype.kind == "U":
                value = value.astype(object)
            spec.dm_spec.validate(value)
        except (TypeError, ValueError) as exc:
            raise ServerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Invalid action {spec.name!r} (UID {spec.uid}): {exc}. Expected {spec.dm_spec!r}.",
            ) from exc
        return value

    def check_observation_uids(self, uids: Any) -> None:
        """Raises INVALID_ARGUMENT for an unknown observation UID (before anything steps)."""
        table = self.observations
        for uid in uids:
            if uid not in table:
                _lookup(table, uid, "observation")

    def encode_observations(
        self, timestep: dm_env.TimeStep, uids: Any
    ) -> list[tuple[int, bytes | bytearray]]:
        """Packs the requested observations of a TimeStep as ``(uid, Tensor wire bytes)``.

        Raises:
          ServerError: INVALID_ARGUMENT for an unknown observation UID.
        """
        observation = timestep.observation
        flat: Mapping[str, Any]
        if self._single_observation:
            flat = {"observation": observation}
        elif isinstance(observation, Mapping):
            flat = specs.flatten(observation)
        else:
            flat = {}
        out = []
        for uid in uids:
            spec = _lookup(self.observations, uid, "observation")
            if spec.name in flat:
                value = flat[spec.name]
            elif spec.name == "reward":
                # dm_env gives None on the first step; the wire gets a neutral 0.
                value = 0 if timestep.reward is None else timestep.reward
            elif spec.name == "discount":
                value = 1 if timestep.discount is None else timestep.discount
            else:
                raise ServerError(
                    grpc.StatusCode.INTERNAL,
                    f"The environment's observation has no {spec.name!r} although its "
                    "observation_spec() lists it.",
                )
            if spec.dtype.kind in "UO":
                out.append((uid, tensors.tensor_wire_bytes(value)))
            else:
                out.append((uid, tensors.tensor_wire_bytes(np.asarray(value, dtype=spec.dtype))))
        return out


class World(WireSpecs):
    """One single-agent environment behind the protocol, joined by one connection at a time."""

    def __init__(
        self, name: str, env: dm_env.Environment, creator: object, like: World | None = None
    ) -> None:
        """A world of ``env``; one ``like`` it (same specs, compared) lends its wire specs."""
        self.name = name
        self.env = env
        self.creator = creator
        self.joined_by: object | None = None
        self.epoch = 0  # bumped by ResetWorld
        self.lock = threading.Lock()
        self.destroyed = False
        super().__init__(
            env.action_spec(), env.observation_spec(), env.reward_spec(), env.discount_spec(), like
        )

    def destroy(self) -> None:
        """Marks the world destroyed and closes its environment."""
        self.destroyed = True
        with contextlib.suppress(Exception):
            self.env.close()


def step_response(state: int, observations: list[tuple[int, Any]]) -> bytes:
    """``EnvironmentResponse{step: StepResponse{state, observations}}`` as wire bytes.

    The observation tensors are spliced in as they are (one copy, no messages).
    """
    parts = [b"\x08", _varint(state)]
    for uid, tensor in observations:
        head = b"\x08" + _varint(uid) + b"\x12" + _varint(len(tensor))
        parts += [b"\x12", _varint(len(head) + len(tensor)), head, tensor]
    step = b"".join(parts)
    return b"\x1a" + _varint(len(step)) + step


def error_response(code: grpc.StatusCode, message: str) -> dm_env_rpc_pb2.EnvironmentResponse:
    """``EnvironmentResponse{error: Status{code, message}}``."""
    return dm_env_rpc_pb2.EnvironmentResponse(
        error=status_pb2.Status(code=code.value[0], message=message)
    )
