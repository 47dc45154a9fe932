"""Many worlds stepped as one batch, with every request pipelined.

``BatchedEnvironment`` drives N ``DmEnvAdaptor`` worlds, one connection each,
possibly on N different servers. Actions and observations are nested dicts of
arrays with a leading batch axis::

    import dm_env_rpc_client as dmr

    with dmr.BatchedEnvironment.connect([address] * 4, create_world_settings={"seed": 1}) as envs:
        batch = envs.reset()
        actions = {"paddle": np.zeros(4, np.int8)}
        batch = envs.step(actions)                 # batch.observation["board"].shape == (4, rows, cols)

Each world moves on to its next sequence the way the protocol does: the step
after a LAST step is the FIRST step of the next sequence (its action is
ignored). In a ``BatchedTimeStep`` the reward and discount of a FIRST step are
NaN, as ``step_type`` says.

``send(actions, env_ids)`` and ``recv()`` step a subset of worlds EnvPool-style:
``recv`` returns whichever worlds finished first, so one slow world does not
stall the others. A world may have several steps in flight.

A failure of one world raises ``WorldError`` naming its index and address.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import dm_env
import numpy as np

from dm_env_rpc_client import errors
from dm_env_rpc_client.connection import Connection, connect
from dm_env_rpc_client.environment import DmEnvAdaptor, create_and_join_world

_WORLD_FAILED = "World {index} at {address} failed: {error}"
_BAD_BATCH = "Action {name!r} has batch size {actual} but {expected} worlds were stepped."


class BatchedTimeStep(NamedTuple):
    """TimeSteps of several worlds, stacked along the first axis.

    Attributes:
      step_type: uint8 ``[B]`` of ``dm_env.StepType`` values.
      reward: float64 ``[B]``; NaN on FIRST steps.
      discount: float64 ``[B]``; NaN on FIRST steps.
      observation: nested dict of ``[B, ...]`` arrays (object arrays when shapes differ).
      env_ids: int ``[B]``: which worlds these are.
    """

    step_type: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    observation: dict[str, Any]
    env_ids: np.ndarray

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

    def last(self) -> np.ndarray:
        return self.step_type == dm_env.StepType.LAST


def _stack(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        return {key: _stack([value[key] for value in values]) for key in first}
    arrays = [np.asarray(value) for value in values]
    if all(a.shape == arrays[0].shape for a in arrays):
        return np.stack(arrays)
    out = np.empty(len(arrays), dtype=object)
    for index, array in enumerate(arrays):
        out[index] = array
    return out


def _unstack(actions: Mapping[str, Any], count: int, prefix: str = "") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in actions.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            for target, part in zip(out, _unstack(value, count, name + "."), strict=True):
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


def _batch(timesteps: Sequence[dm_env.TimeStep], env_ids: Sequence[int]) -> BatchedTimeStep:
    def number(value: Any) -> float:
        return float("nan") if value is None else float(np.asarray(value))

    return BatchedTimeStep(
        step_type=np.array([int(t.step_type) for t in timesteps], np.uint8),
        reward=np.array([number(t.reward) for t in timesteps]),
        discount=np.array([number(t.discount) for t in timesteps]),
        observation=_stack([t.observation for t in timesteps]),
        env_ids=np.asarray(env_ids, dtype=np.int64),
    )


class BatchedEnvironment:
    """N remote worlds stepped as one batch. See the module docs.

    Args:
      envs: the worlds, one connection each.
      addresses: the server address of each world, for error messages.
      connections: connections to close with the batch (``connect`` fills this).
    """

    def __init__(
        self,
        envs: Sequence[DmEnvAdaptor],
        addresses: Sequence[str | None] | None = None,
        *,
        connections: Sequence[Connection] = (),
    ) -> None:
        if not envs:
            raise ValueError("A BatchedEnvironment needs at least one world.")
        self.envs = list(envs)
        self.addresses = (
            list(addresses)
            if addresses is not None
            else [getattr(env.connection, "address", None) for env in self.envs]
        )
        self._connections = list(connections)
        self._inflight: list[collections.deque[tuple[concurrent.futures.Future[Any], float]]] = [
            collections.deque() for _ in self.envs
        ]
        self.latencies: list[float] = []

    @classmethod
    def connect(
        cls,
        addresses: Sequence[str],
        num_envs: int | None = None,
        *,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
        **connect_kwargs: Any,
    ) -> BatchedEnvironment:
        """Creates and joins ``num_envs`` worlds (default: one per address), round-robin.

        Raises:
          WorldError: naming the world that could not be created or joined.
        """
        count = len(addresses) if num_envs is None else num_envs
        if not addresses or count < 1:
            raise ValueError("Give at least one address and one world.")
        envs, connections, used = [], [], []
        try:
            for index in range(count):
                address = addresses[index % len(addresses)]
                try:
                    conn = connect(address, timeout=timeout, **connect_kwargs)
                    connections.append(conn)
                    env, _ = create_and_join_world(conn, create_world_settings, join_world_settings)
                except errors.DmEnvRpcClientError as exc:
                    raise errors.WorldError(
                        _WORLD_FAILED.format(index=index, address=address, error=exc),
                        index,
                        address,
                    ) from exc
                envs.append(env)
                used.append(address)
        except BaseException:
            for conn in connections:
                conn.close()
            raise
        return cls(envs, used, connections=connections)

    def __len__(self) -> int:
        return len(self.envs)

    def _wrap(self, index: int, exc: BaseException) -> errors.WorldError:
        address = self.addresses[index]
        return errors.WorldError(
            _WORLD_FAILED.format(index=index, address=address, error=exc), index, address
        )

    def _result(
        self, index: int, future: concurrent.futures.Future[Any], timeout: float | None
    ) -> Any:
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self._wrap(
                index, errors.RequestTimeoutError(f"no response in {timeout} s")
            ) from None
        except errors.DmEnvRpcClientError as exc:
            raise self._wrap(index, exc) from exc

    def action_spec(self) -> Any:
        """The action spec of one world (all worlds are expected to share it)."""
        return self.envs[0].action_spec()

    def observation_spec(self) -> Any:
        """The observation spec of one world."""
        return self.envs[0].observation_spec()

    def reset(self, timeout: float | None = None) -> BatchedTimeStep:
        """Resets every world and returns their FIRST steps."""
        timesteps = []
        for index, env in enumerate(self.envs):
            try:
                timesteps.append(env.reset())
            except errors.DmEnvRpcClientError as exc:
                raise self._wrap(index, exc) from exc
        return _batch(timesteps, range(len(self.envs)))

    def step(self, actions: Mapping[str, Any], timeout: float | None = None) -> BatchedTimeStep:
        """Steps every world with its slice of ``actions`` (batch axis first)."""
        env_ids = list(range(len(self.envs)))
        self.send(actions, env_ids)
        return self.recv(len(env_ids), timeout=timeout, env_ids=env_ids)

    def send(self, actions: Mapping[str, Any], env_ids: Sequence[int]) -> None:
        """Sends one step to each world in ``env_ids`` (actions stacked in that order); returns at once."""
        per_world = _unstack(actions, len(env_ids))
        for index, action in zip(env_ids, per_world, strict=True):
            try:
                future = self.envs[index].step_async(action)
            except errors.DmEnvRpcClientError as exc:
                raise self._wrap(index, exc) from exc
            self._inflight[index].append((future, time.perf_counter()))

    def pending(self) -> int:
        """The number of steps sent and not yet received."""
        return sum(len(queue) for queue in self._inflight)

    def recv(
        self,
        min_count: int = 1,
        timeout: float | None = None,
        *,
        env_ids: Sequence[int] | None = None,
    ) -> BatchedTimeStep:
        """Collects at least ``min_count`` finished steps, whichever worlds finish first.

        With ``env_ids``, collects exactly one step of each of those worlds, in that order.

        Raises:
          WorldError: a world failed (names its index and address).
          ValueError: fewer steps are in flight than asked for.
        """
        if env_ids is not None:
            timesteps = []
            for index in env_ids:
                future, sent = self._inflight[index].popleft()
                timesteps.append(self._result(index, future, timeout))
                self.latencies.append(time.perf_counter() - sent)
            return _batch(timesteps, env_ids)
        if self.pending() < min_count:
            raise ValueError(
                f"Only {self.pending()} steps are in flight; cannot receive {min_count}."
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        got: list[tuple[int, dm_env.TimeStep]] = []
        while len(got) < min_count:
            # Take every world whose oldest step is done; wait only when none is.
            ready = [i for i, q in enumerate(self._inflight) if q and q[0][0].done()]
            if not ready:
                heads = [q[0][0] for q in self._inflight if q]
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = concurrent.futures.wait(
                    heads, timeout=remaining, return_when=concurrent.futures.FIRST_COMPLETED
                )
                if not done:
                    raise errors.RequestTimeoutError(
                        f"No world finished a step within {timeout} s."
                    )
                continue
            now = time.perf_counter()
            for index in ready:
                future, sent = self._inflight[index].popleft()
                got.append((index, self._result(index, future, 0)))
                self.latencies.append(now - sent)
        return _batch([t for _, t in got], [i for i, _ in got])

    def close(self) -> None:
        """Leaves every world and closes the connections this batch opened. Idempotent."""
        for env in self.envs:
            with contextlib.suppress(errors.DmEnvRpcClientError):  # a dead world: nothing to leave
                env.close()
        for conn in self._connections:
            conn.close()
        self._connections = []

    def __enter__(self) -> BatchedEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchedEnvironment({len(self.envs)} worlds on {sorted(set(map(str, self.addresses)))})"
