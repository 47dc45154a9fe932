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

``connect`` runs every world's stream on one background asyncio loop (one
thread for the whole batch, one HTTP/2 connection per server address): that
costs a fraction of the CPU per step of a reader thread per stream, which
matters when the client, not the servers, is what limits the batch. As a
response lands the loop only moves that world's step-type state machine on;
finished steps are handed to ``recv`` through one condition variable, so the
calling thread wakes once per ``recv``, not once per world, and decodes all the
steps it takes at once (``_stacked``).

One thread drives a batch (``send``, ``recv``, ``step``, ``reset``); the loop
thread only writes requests and files responses. A failure of one world raises
``WorldError`` naming its index and address.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from dm_env_rpc_client import errors, messages
from dm_env_rpc_client._loop import LoopConnection, LoopThread
from dm_env_rpc_client._stacked import BatchedTimeStep, StackedDecoder, batch_of, split_actions
from dm_env_rpc_client.aio import AsyncConnection
from dm_env_rpc_client.connection import ConnectionLike, create_channel
from dm_env_rpc_client.environment import DmEnvAdaptor, create_and_join_world, join_world

_WORLD_FAILED = "World {index} at {address} failed: {error}"
_TOO_FEW = "Only {pending} steps are in flight; cannot receive {wanted}. send() more first."
_WORLD_IDLE = "World {index} has {pending} steps in flight; cannot receive {wanted} of it."
_RECV_TIMEOUT = "Fewer than {wanted} steps finished within {timeout} s ({ready} did)."
_NO_RESPONSE = "no response within {timeout} s"
_SEED_TWICE = (
    "create_world_settings already holds {name!r}, and seed= sets it per world: "
    "pass one of the two, or a different seed_setting."
)
_SEED_REFUSED = (
    "The server at {address} refused the create setting {name!r} ({error}); the worlds are "
    "created without it, so only what the client draws is seeded. Pass seed_setting= with "
    "the name the server takes, or seed_setting=None to silence this."
)
_NAMES_COUNT = "Give one world name per world: {names} names for {count} worlds."
_NO_WAITER = 1 << 62
LATENCY_SAMPLES = 100_000  # latencies kept for percentiles; older ones are dropped


class BatchedEnvironment:
    """N remote worlds stepped as one batch. See the module docs.

    Args:
      envs: the worlds, one connection each.
      addresses: the server address of each world, for error messages.
      connections: connections to close with the batch (``connect`` fills this).

    Attributes:
      envs: the worlds' ``DmEnvAdaptor``s.
      addresses: each world's server address.
      latencies: round trips in seconds (send to response) of the latest
        ``LATENCY_SAMPLES`` steps received, for percentiles.
      world_seeds: the seed each world was created with (``connect(seed=...)``),
        None where it got none.
    """

    def __init__(
        self,
        envs: Sequence[DmEnvAdaptor],
        addresses: Sequence[str | None] | None = None,
        *,
        connections: Sequence[ConnectionLike] = (),
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
        self.world_seeds: list[int | None] = [None] * len(self.envs)
        self._runner: LoopThread | None = None
        self._streams: list[AsyncConnection] = []  # with a runner: each world's stream
        # With a runner and the same specs everywhere: the batch-at-once decoder, and the
        # specs it was made for (a world whose specs change on reset is decoded alone).
        self._decoder: StackedDecoder | None = None
        self._joined_specs: list[Any] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closed = False
        # Finished steps, per world in request order: (outcome, latency). The outcome is the
        # exception of a failed step, else a TimeStep (adaptors over their own connections) or
        # (step type, StepResponse) (on the batch's loop; recv decodes these).
        self._cond = threading.Condition(threading.Lock())
        self._done: list[collections.deque[tuple[Any, float]]] = [
            collections.deque() for _ in self.envs
        ]
        self._ready = 0  # finished and not yet received, over all worlds
        self._want = _NO_WAITER  # recv wakes when _ready reaches this
        self._in_flight = [0] * len(self.envs)  # sent and not yet received, per world
        # Round trips in seconds, send to response, of the latest LATENCY_SAMPLES steps.
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)

    @classmethod
    def connect(
        cls,
        addresses: str | Sequence[str],
        num_envs: int | None = None,
        *,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        insecure: bool = False,
        metadata: Sequence[tuple[str, str]] | None = None,
        seed: int | None = None,
        seed_setting: str | None = "seed",
        world_names: Sequence[str] | None = None,
    ) -> BatchedEnvironment:
        """Creates and joins ``num_envs`` worlds (default: one per address), round-robin.

        Every world gets its own stream; streams to the same address share one
        channel, and all of them run on one background event loop.

        Seeds follow gymnasium's ``reset(seed=s)`` convention for vector envs:
        world ``i`` gets ``seed + i``, in its create settings under
        ``seed_setting``. A server that refuses that setting (INVALID_ARGUMENT
        naming it) gets the worlds created without it, with a warning;
        ``world_seeds`` says which seed each world got.

        Args:
          addresses: server addresses (``host:port`` or ``unix:path``), or one address.
          num_envs: how many worlds; default one per address.
          create_world_settings: settings for every CreateWorldRequest.
          join_world_settings: settings for every JoinWorldRequest.
          timeout: seconds to wait for each server to answer, and for each response
            of the worlds' ``reset``, ``close`` and lifecycle calls.
          credentials: channel credentials for TLS (as for ``dmr.connect``).
          options: extra gRPC channel options.
          insecure: allow plaintext to a remote host.
          metadata: gRPC metadata for every stream.
          seed: world ``i`` is created with ``seed + i`` under ``seed_setting``;
            None leaves the settings as they are.
          seed_setting: the create setting that carries the seed; None never sets it.
          world_names: join these existing worlds (world ``i`` joins
            ``world_names[i]``) instead of creating new ones; they are left, not
            destroyed, on close, and get no seed.

        Raises:
          ValueError: no address, no world, ``seed`` and ``create_world_settings``
            both set the seed setting, or ``world_names`` does not match ``num_envs``.
          WorldError: naming the world that could not be created or joined.
        """
        if isinstance(addresses, str):
            addresses = [addresses]
        count = len(addresses) if num_envs is None else num_envs
        if world_names is not None:
            count = len(world_names) if num_envs is None else count
            if len(world_names) != count:
                raise ValueError(_NAMES_COUNT.format(names=len(world_names), count=count))
        if not addresses or count < 1:
            raise ValueError("Give at least one address and one world.")
        if seed is not None and world_names is None and seed_setting is not None:
            if seed_setting in (create_world_settings or {}):
                raise ValueError(_SEED_TWICE.format(name=seed_setting))
        else:
            seed_setting = None
        seeds: list[int | None] = [None] * count
        runner = LoopThread(name="dm_env_rpc_client-batched")
        channels: dict[str, grpc.aio.Channel] = {}

        async def open_stream(address: str) -> LoopConnection:
            channel = channels.get(address)
            if channel is None:
                channel = channels[address] = create_channel(
                    address, credentials=credentials, options=options, insecure=insecure, aio=True
                )
            return await LoopConnection.open(
                runner, address, channel=channel, timeout=timeout, metadata=metadata
            )

        envs: list[DmEnvAdaptor] = []
        connections: list[LoopConnection] = []
        used: list[str] = []
        try:
            for index in range(count):
                address = addresses[index % len(addresses)]
                try:
                    conn = runner.run(open_stream(address))
                    connections.append(conn)
                    if world_names is not None:
                        env = join_world(
                            conn, world_names[index], join_world_settings, timeout=timeout
                        )
                    else:
                        settings = dict(create_world_settings or {})
                        if seed_setting is not None and seed is not None:
                            settings[seed_setting] = seeds[index] = seed + index
                        try:
                            env, _ = create_and_join_world(
                                conn, settings, join_world_settings, timeout=timeout
                            )
                        except errors.InvalidArgumentError as exc:
                            if seed_setting is None or repr(seed_setting) not in str(exc):
                                raise
                            warnings.warn(
                                _SEED_REFUSED.format(address=address, name=seed_setting, error=exc),
                                stacklevel=2,
                            )
                            seed_setting, seeds[index] = None, None
                            settings = dict(create_world_settings or {})
                            env, _ = create_and_join_world(
                                conn, settings, join_world_settings, timeout=timeout
                            )
                except errors.DmEnvRpcClientError as exc:
                    raise errors.WorldError(
                        _WORLD_FAILED.format(index=index, address=address, error=exc),
                        index,
                        address,
                    ) from exc
                envs.append(env)
                used.append(address)
        except BaseException:
            _shut_down(runner, connections, channels)
            raise
        batch = cls(envs, used, connections=connections)
        batch.world_seeds = seeds
        batch._runner, batch._channels = runner, channels
        batch._streams = [conn.async_connection for conn in connections]
        batch._joined_specs = [env._wire_specs for env in envs]
        if all(specs == batch._joined_specs[0] for specs in batch._joined_specs):
            batch._decoder = StackedDecoder(envs[0])
        return batch

    def __len__(self) -> int:
        return len(self.envs)

    def _wrap(self, index: int, exc: BaseException) -> errors.WorldError:
        address = self.addresses[index]
        return errors.WorldError(
            _WORLD_FAILED.format(index=index, address=address, error=exc), index, address
        )

    def action_spec(self) -> Any:
        """The action spec of one world (all worlds are expected to share it)."""
        return self.envs[0].action_spec()

    def observation_spec(self) -> Any:
        """The observation spec of one world."""
        return self.envs[0].observation_spec()

    def reset(self, timeout: float | None = None) -> BatchedTimeStep:
        """Resets every world and returns their FIRST steps.

        Raises:
          WorldError: a world failed or did not answer within ``timeout``.
        """
        timesteps = []
        for index, env in enumerate(self.envs):
            try:
                timesteps.append(env.reset(timeout=timeout))
            except errors.DmEnvRpcClientError as exc:
                raise self._wrap(index, exc) from exc
        return batch_of(timesteps, range(len(self.envs)))

    def step(self, actions: Any, timeout: float | None = None) -> BatchedTimeStep:
        """Steps every world with its slice of ``actions`` (batch axis first).

        A list of one action dict per world works too (``[{"paddle": 0}] * 4``).

        Raises:
          SpecValidationError: the actions do not fit the batch or the specs.
          WorldError: a world failed or did not answer within ``timeout``.
        """
        env_ids = list(range(len(self.envs)))
        self.send(actions, env_ids)
        return self.recv(len(env_ids), timeout=timeout, env_ids=env_ids)

    def send(self, actions: Any, env_ids: Sequence[int]) -> None:
        """Sends one step to each world in ``env_ids`` (actions stacked in that order); returns at once.

        ``actions`` is a dict of arrays with the batch axis first, or a list of
        one action dict per world of ``env_ids``.

        Raises:
          SpecValidationError: the actions do not fit the batch or the specs.
          WorldError: a world's connection is closed.
        """
        per_world = split_actions(actions, len(env_ids), self.envs[0].action_manager.names())
        sent = time.perf_counter()
        if self._runner is None:  # adaptors over connections of their own
            for index, action in zip(env_ids, per_world, strict=True):
                try:
                    future = self.envs[index].step_async(action)
                except errors.DmEnvRpcClientError as exc:
                    raise self._wrap(index, exc) from exc
                self._in_flight[index] += 1
                future.add_done_callback(functools.partial(self._finished, index, sent))
            return
        # On the batch's loop: requests are packed here, then written by one loop call.
        batch: list[tuple[int, bytes, str]] = []
        for index, action in zip(env_ids, per_world, strict=True):
            try:
                data, expected = messages.envelope(self.envs[index].step_request(action))
            except errors.DmEnvRpcClientError as exc:
                if batch:
                    self._runner.call(self._write_steps, batch, sent)
                raise self._wrap(index, exc) from exc
            batch.append((index, data, expected))
            self._in_flight[index] += 1
        self._runner.call(self._write_steps, batch, sent)

    def _write_steps(self, batch: list[tuple[int, bytes, str]], sent: float) -> None:
        # On the loop: queue each world's request; _landed files its response.
        for index, data, expected in batch:
            future = self._streams[index]._submit(data, expected)
            future.add_done_callback(functools.partial(self._landed, index, sent))

    def _landed(self, index: int, sent: float, future: asyncio.Future[Any]) -> None:
        # Only the state machine moves here (in request order); recv decodes the observations.
        try:
            response = future.result()
            outcome: Any = (self.envs[index]._advance(response.state), response)
        except BaseException as exc:
            outcome = exc
        self._file(index, sent, outcome)

    def _finished(self, index: int, sent: float, future: concurrent.futures.Future[Any]) -> None:
        try:
            outcome = future.result()
        except BaseException as exc:
            outcome = exc
        self._file(index, sent, outcome)

    def _file(self, index: int, sent: float, outcome: Any) -> None:
        # On the loop (or a connection's reader thread): file the step and wake recv if due.
        latency = time.perf_counter() - sent
        with self._cond:
            self._done[index].append((outcome, latency))
            self._ready += 1
            if self._ready >= self._want:
                self._cond.notify()

    def pending(self) -> int:
        """The number of steps sent and not yet received."""
        return sum(self._in_flight)

    def in_flight(self, index: int) -> int:
        """The number of steps sent to world ``index`` and not yet received."""
        return self._in_flight[index]

    def _wait(self, ready: Callable[[], bool], wanted: int, timeout: float | None) -> bool:
        with self._cond:
            self._want = wanted
            try:
                return self._cond.wait_for(ready, timeout)
            finally:
                self._want = _NO_WAITER

    def recv(
        self,
        min_count: int = 1,
        timeout: float | None = None,
        *,
        env_ids: Sequence[int] | None = None,
    ) -> BatchedTimeStep:
        """Collects at least ``min_count`` finished steps, whichever worlds finish first.

        Returns every step that has finished by then (a world with several
        finished steps appears once per step, oldest first). With ``env_ids``,
        collects exactly the oldest step of each of those worlds, in that order.

        Raises:
          WorldError: a world failed (names its index and address), or, with
            ``env_ids``, did not finish within ``timeout``.
          RequestTimeoutError: fewer than ``min_count`` steps finished within ``timeout``.
          ValueError: fewer steps are in flight than asked for.
        """
        if env_ids is not None:
            return self._recv_worlds(list(env_ids), timeout)
        if self.pending() < min_count:
            raise ValueError(_TOO_FEW.format(pending=self.pending(), wanted=min_count))
        if not self._wait(lambda: self._ready >= min_count, min_count, timeout):
            raise errors.RequestTimeoutError(
                _RECV_TIMEOUT.format(wanted=min_count, timeout=timeout, ready=self._ready)
            )
        with self._cond:
            taken = [
                (index, *queue.popleft())
                for index, queue in enumerate(self._done)
                for _ in range(len(queue))
            ]
            self._ready -= len(taken)
        return self._collect(taken)

    def _recv_worlds(self, env_ids: list[int], timeout: float | None) -> BatchedTimeStep:
        wanted = collections.Counter(env_ids)
        for index, count in wanted.items():
            if self._in_flight[index] < count:
                raise ValueError(
                    _WORLD_IDLE.format(index=index, pending=self._in_flight[index], wanted=count)
                )

        def ready() -> bool:
            return all(len(self._done[index]) >= count for index, count in wanted.items())

        if not self._wait(ready, len(env_ids), timeout):
            with self._cond:
                late = next(i for i, n in wanted.items() if len(self._done[i]) < n)
            raise self._wrap(late, errors.RequestTimeoutError(_NO_RESPONSE.format(timeout=timeout)))
        with self._cond:
            taken = [(index, *self._done[index].popleft()) for index in env_ids]
            self._ready -= len(taken)
        return self._collect(taken)

    def _collect(self, taken: list[tuple[int, Any, float]]) -> BatchedTimeStep:
        for index, _, latency in taken:
            self._in_flight[index] -= 1
            self.latencies.append(latency)
        for index, outcome, _ in taken:
            if isinstance(outcome, errors.DmEnvRpcClientError):
                raise self._wrap(index, outcome) from outcome
            if isinstance(outcome, BaseException):
                raise outcome
        env_ids = [index for index, _, _ in taken]
        if self._runner is None:  # TimeSteps already
            return batch_of([outcome for _, outcome, _ in taken], env_ids)
        step_types = [outcome[0] for _, outcome, _ in taken]
        responses = [outcome[1] for _, outcome, _ in taken]
        try:
            if self._decoder is not None and all(
                self.envs[index]._wire_specs is self._joined_specs[index] for index in env_ids
            ):
                return self._decoder.decode(step_types, responses, env_ids)
            # Specs differ between worlds (or changed on reset): one TimeStep per world.
            timesteps = []
            for position, (index, step_type, response) in enumerate(
                zip(env_ids, step_types, responses, strict=True)
            ):
                try:
                    timesteps.append(self.envs[index]._timestep(step_type, response))
                except errors.ObservationError as exc:
                    exc.position = position
                    raise
        except errors.ObservationError as exc:  # the one decode path's checks (_decode)
            raise self._wrap(env_ids[exc.position or 0], exc) from exc
        return batch_of(timesteps, env_ids)

    def close(self, timeout: float = 10.0) -> None:
        """Leaves every world and closes what this batch opened. Idempotent; bounded by ``timeout``."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        for env in self.envs:
            remaining = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(errors.DmEnvRpcClientError):  # a dead world: nothing to leave
                env.close(timeout=remaining)
        if self._runner is None:
            for conn in self._connections:
                conn.close()
        else:
            _shut_down(self._runner, self._connections, self._channels)
        self._connections = []

    def __enter__(self) -> BatchedEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchedEnvironment({len(self.envs)} worlds on {sorted(set(map(str, self.addresses)))})"

    def _repr_html_(self) -> str:
        from dm_env_rpc_client import display  # presentation: only when rendered

        fields = {"worlds": len(self.envs), "addresses": sorted(set(map(str, self.addresses)))}
        return display.environment_html("BatchedEnvironment", fields, *self.envs[0]._spec_rows())


def _shut_down(
    runner: LoopThread,
    connections: Sequence[ConnectionLike],
    channels: dict[str, grpc.aio.Channel],
) -> None:
    """Closes the streams, then the channels, then the loop; never raises for a dead server."""
    for conn in connections:
        with contextlib.suppress(errors.DmEnvRpcClientError):
            conn.close()

    async def close_channels() -> None:
        await asyncio.gather(*(channel.close() for channel in channels.values()))

    with contextlib.suppress(errors.DmEnvRpcClientError):
        runner.run(close_channels(), timeout=10)
    channels.clear()  # freed channels let gRPC close their TCP connections now
    runner.close()
