"""What the conformance checks share: the rules, the ``Probe``, spec checks, random actions.

``RULES`` maps each rule id to its sentence. A ``Probe`` holds the address,
the limits and the verdicts so far; its ``send`` waits at most ``timeout``
seconds and marks a stream that timed out or ended as broken. The checks
themselves are in ``_tools.conformance_checks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np

from .. import errors, tensors
from .._codec.bounds import bounds
from .._codec.dtypes import _FIELD_TO_DATA_TYPE, DATA_TYPE_TO_NUMPY
from .._codec.nesting import flatten
from .._proto import dm_env_rpc_pb2 as pb
from ..connection import Connection, connect
from ..random_actions import random_action
from ..specs import SpecManager

RULES: Mapping[str, str] = {
    "connect": "The server accepts a Process stream at the address.",
    "lifecycle.create": "CreateWorld answers with a world name.",
    "lifecycle.join": "JoinWorld of the created world answers with the specs.",
    "lifecycle.step": "Steps after joining answer a valid state, the first one RUNNING.",
    "lifecycle.reset": "Reset answers with JoinWorld's specs, and the next step is RUNNING.",
    "lifecycle.reset-world": "ResetWorld of the joined world succeeds, and steps go on.",
    "lifecycle.leave": "LeaveWorld succeeds after joining.",
    "lifecycle.destroy": "DestroyWorld of the world, once left, succeeds.",
    "specs.unique-names": "Spec names are unique among the actions and among the observations.",
    "specs.dtypes": "Every spec has a valid dtype (not INVALID_DATA_TYPE, a known value).",
    "specs.shapes": "Every spec shape has at most one variable (negative) dimension.",
    "specs.bounds": "Bounds are numeric, of the spec's dtype, scalar or of its shape, min <= max.",
    "step.observations": "A step returns exactly the observations requested, of their specs' "
    "dtypes and shapes.",
    "step.first-ignores-actions": "The first step after joining ignores its actions "
    "(even an unknown UID).",
    "pipeline.order": "Requests sent without waiting are answered in order.",
    "errors.step-before-join": "A step before joining is answered with an error status.",
    "errors.reset-before-join": "A reset before joining is answered with an error status.",
    "errors.unknown-uid": "A step with an unknown action UID is answered with an error status.",
    "errors.wrong-dtype": "A step with an action of the wrong dtype is answered with an error "
    "status.",
    "errors.unknown-world": "JoinWorld of a world that does not exist is answered with an error "
    "status.",
    "errors.stream-survives": "After an error answer the stream still answers the next request.",
    "multi-client.concurrent": "Two clients at once are both served, or the second is refused "
    "with an error, never left waiting.",
    "episodes.first-after-last": "The step after a TERMINATED or INTERRUPTED one answers RUNNING "
    "(a new sequence).",
    "multi-agent.join": "Two connections join one world as two agents, and their first steps, "
    "sent together, answer RUNNING.",
    "multi-agent.reset-world": "ResetWorld from a third connection makes both agents' next "
    "steps answer INTERRUPTED, and the steps after them RUNNING.",
    "multi-agent.leave": "After one agent leaves, the other agent's steps are still answered.",
    "multi-agent.destroy-joined": "DestroyWorld from a connection joined to the world is "
    "answered with an error status.",
    "latency.step": "Single steps are answered (round trips timed: p50, p99).",
}

Verdict = tuple[str, str]  # (status, detail)
UNKNOWN_WORLD = "dm-env-rpc-client-conformance-no-such-world"
STATE = pb.EnvironmentStateType
ENDED = (STATE.TERMINATED, STATE.INTERRUPTED)


class NoWorld(Exception):
    """A world for a check could not be made (the lifecycle rules say why)."""


def state_name(state: int) -> str:
    return STATE.Name(cast(Any, state)) if state in STATE.values() else str(state)


def dtype_name(dtype: int) -> str:
    return pb.DataType.Name(cast(Any, dtype)) if dtype in pb.DataType.values() else str(dtype)


def uid_not_in(uids: Any) -> int:
    taken = set(uids)
    return next(uid for uid in range(len(taken) + 1) if uid not in taken)


def _pack_settings(settings: Mapping[str, Any]) -> dict[str, pb.Tensor]:
    """World settings as Tensors: nested dicts become dotted keys; Tensors stay as they are."""
    return {
        key: value if isinstance(value, pb.Tensor) else tensors.pack_tensor(value)
        for key, value in flatten(settings).items()
    }


class Probe:
    """What the checks share: the address, the limits, the settings and the verdicts so far."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        create_settings: dict[str, Any],
        join_settings: dict[str, Any],
        seed: int,
        connect_kwargs: dict[str, Any],
        world_name: str | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.create_settings = _pack_settings(create_settings)
        self.join_settings = _pack_settings(join_settings)
        self.rng = np.random.default_rng(seed)
        self.connect_kwargs = connect_kwargs
        self.given_world = world_name  # join this world instead of creating worlds
        self.verdicts: dict[str, Verdict] = {}
        self.broken: set[int] = set()  # ids of connections whose stream timed out or ended

    def record(self, rule: str, status: str, detail: str = "") -> None:
        """Keeps the first verdict on a rule, except that a failure replaces a pass or skip."""
        previous = self.verdicts.get(rule)
        if previous is None or (status == "fail" and previous[0] != "fail"):
            self.verdicts[rule] = (status, detail)

    def describe(self, exc: BaseException) -> str:
        """What an exception from ``send`` says about the server."""
        if isinstance(exc, errors.RequestTimeoutError):
            return f"no answer within {self.timeout:g} s"
        if isinstance(exc, errors.ConnectionClosedError):
            return f"the stream ended ({exc.code.name if exc.code else 'closed'}: {exc})"
        if isinstance(exc, errors.DmEnvRpcError):
            return f"error status {exc.code.name}: {exc.message}"
        return f"{type(exc).__name__}: {exc}"

    @contextlib.contextmanager
    def stream(self) -> Iterator[Connection]:
        """A new stream to the server, closed afterwards."""
        conn = connect(self.address, timeout=self.timeout, **self.connect_kwargs)
        try:
            yield conn
        finally:
            conn.close()

    def send(self, conn: Connection, request: Any) -> Any:
        """Sends and waits up to ``timeout``; a stream that times out or ends is marked broken."""
        if id(conn) in self.broken:
            raise errors.ConnectionClosedError("the stream is given up after an earlier failure")
        try:
            return conn.send(request, timeout=self.timeout)
        except (errors.RequestTimeoutError, errors.ConnectionClosedError):
            self.broken.add(id(conn))
            raise

    def expect(self, rule: str, conn: Connection, request: Any) -> Any:
        """Sends a request that must succeed; on failure records ``rule`` failed, returns None."""
        try:
            return self.send(conn, request)
        except errors.DmEnvRpcClientError as exc:
            self.record(rule, "fail", f"{type(request).__name__}: {self.describe(exc)}")
            return None

    def world(self, conn: Connection) -> tuple[str, pb.ActionObservationSpecs]:
        """Creates (unless one is given) and joins a world on ``conn``; raises ``NoWorld``."""
        try:
            name = self.given_world
            if name is None:
                create = pb.CreateWorldRequest(settings=self.create_settings)
                name = self.send(conn, create).world_name
            join = pb.JoinWorldRequest(world_name=name, settings=self.join_settings)
            return name, self.send(conn, join).specs
        except errors.DmEnvRpcClientError as exc:
            raise NoWorld(f"could not make a world to check it on ({self.describe(exc)})") from exc

    def cleanup(self, conn: Connection, world_name: str) -> None:
        """Leaves the world and destroys it (not a given one), ignoring failures (they are not
        this check's rules)."""
        requests: list[Any] = [pb.LeaveWorldRequest()]
        if self.given_world is None:
            requests.append(pb.DestroyWorldRequest(world_name=world_name))
        for request in requests:
            with contextlib.suppress(errors.DmEnvRpcClientError):
                self.send(conn, request)


# --- specs ------------------------------------------------------------------------------


def spec_problems(uid: int, spec: pb.TensorSpec, kind: str) -> dict[str, str]:
    """The spec rules ``spec`` breaks, each with a sentence naming it."""
    what = f"{kind} {spec.name!r} (UID {uid})"
    problems = {}
    if spec.dtype not in DATA_TYPE_TO_NUMPY:
        problems["specs.dtypes"] = f"{what} has dtype {dtype_name(spec.dtype)}"
    if sum(dim < 0 for dim in spec.shape) > 1:
        problems["specs.shapes"] = f"{what} has shape {list(spec.shape)}"
    has_bounds = spec.min.WhichOneof("payload") or spec.max.WhichOneof("payload")
    if has_bounds and "specs.dtypes" not in problems:
        try:
            bounds(spec)
        except errors.BoundsError as exc:
            problems["specs.bounds"] = str(exc)
    return problems


def check_specs(probe: Probe, specs: pb.ActionObservationSpecs) -> set[int]:
    """Records the ``specs.*`` rules; returns the UIDs of the specs that break none."""
    found: dict[str, list[str]] = {rule: [] for rule in RULES if rule.startswith("specs.")}
    valid = set()
    for kind, group in (("action", specs.actions), ("observation", specs.observations)):
        names: dict[str, int] = {}
        for uid, spec in group.items():
            problems = spec_problems(uid, spec, kind)
            if spec.name in names:
                problems["specs.unique-names"] = (
                    f"{kind} UIDs {names[spec.name]} and {uid} are both named {spec.name!r}"
                )
            names.setdefault(spec.name, uid)
            for rule, problem in problems.items():
                found[rule].append(problem)
            if not problems:
                valid.add(uid)
    for rule, seen in found.items():
        probe.record(rule, "fail" if seen else "pass", "; ".join(seen))
    return valid


def observation_problem(spec: pb.TensorSpec, tensor: pb.Tensor) -> str | None:
    """How an observation differs from its spec's dtype or shape, or None."""
    field = tensor.WhichOneof("payload")
    if field is None:
        return f"{spec.name!r} has no payload"
    if _FIELD_TO_DATA_TYPE[field] != spec.dtype:
        return (
            f"{spec.name!r} is {dtype_name(_FIELD_TO_DATA_TYPE[field])} but its spec says "
            f"{dtype_name(spec.dtype)}"
        )
    try:
        shape = np.shape(tensors.unpack_tensor(tensor))
    except errors.TensorError as exc:
        return f"{spec.name!r} does not unpack: {exc}"
    wanted = list(spec.shape)
    if len(shape) != len(wanted) or any(
        w >= 0 and w != s for w, s in zip(wanted, shape, strict=True)
    ):
        return f"{spec.name!r} has shape {list(shape)} but its spec says {wanted}"
    return None


class Actions:
    """Random valid actions for the action specs that break no spec rule."""

    def __init__(self, specs: pb.ActionObservationSpecs, rng: np.random.Generator) -> None:
        usable = {}
        names: set[str] = set()
        for uid, spec in specs.actions.items():
            if not spec_problems(uid, spec, "action") and spec.name not in names:
                usable[uid] = spec
                names.add(spec.name)
        self.specs = usable
        self._rng = rng
        try:
            self._manager: SpecManager | None = SpecManager(usable, kind="action")
            self._dm_specs = self._manager.dm_env_specs(nested=False)
        except errors.DmEnvRpcClientError:
            self._manager = None

    def draw(self) -> dict[int, pb.Tensor]:
        """One random action for every usable spec, packed by UID."""
        if self._manager is None:
            return {}
        return self._manager.pack(random_action(self._dm_specs, self._rng))

    def step(self, observations: Any = ()) -> pb.StepRequest:
        """A step request with a random action, asking for ``observations``."""
        return pb.StepRequest(actions=self.draw(), requested_observations=list(observations))


def observations_ok(
    probe: Probe, specs: pb.ActionObservationSpecs, valid: set[int], asked: Any, step: Any
) -> bool:
    """Records ``step.observations`` failed if ``step`` does not carry exactly ``asked``."""
    got = sorted(step.observations)
    if got != sorted(set(asked)):
        probe.record("step.observations", "fail", f"asked for UIDs {sorted(set(asked))}, got {got}")
        return False
    for uid, tensor in step.observations.items():
        problem = observation_problem(specs.observations[uid], tensor) if uid in valid else None
        if problem is not None:
            probe.record("step.observations", "fail", problem)
            return False
    return True
