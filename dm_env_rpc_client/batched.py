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
thread for the whole batch, one HTTP/2 connection per 100 worlds of a server,
``max_streams_per_connection``): a fraction of the CPU per step of a reader
thread per stream, which matters when the client limits the batch. As a
response lands the loop only moves that world's step-type state machine on;
finished steps are handed to ``recv`` through one condition variable, so the
calling thread wakes once per ``recv``, not once per world, and decodes all the
steps it takes at once (``_adaptor.stacked``).

One thread drives a batch (``send``, ``recv``, ``step``, ``reset``); the loop thread
only writes requests, files responses, watches deadlines and restarts worlds.

Failures. A world *fails* when its stream breaks, a step fails at the
transport, or it passes its deadline: ``step_timeout`` seconds with steps in
flight and no response (checked a few times a second), or a ``recv(env_ids=...)``
whose ``timeout`` runs out. Its unanswered steps are dropped then, so that no
late response can ever answer a later request. What follows is the policy's:

- ``on_world_failure="raise"`` (the default): raised once as a ``WorldError``
  naming the world (``WorldTimeoutError`` for a deadline), the cause chained;
  sending to that world again raises ``WorldError``.
- ``on_world_failure="restart"``: the world alone is made again
  (``_batch.restart``); its next step is FIRST with ``truncated`` set, answering
  the steps it had in flight; one that cannot be restored is removed.

A server's error for one request (``DmEnvRpcError``) and an observation that
cannot be decoded are not failures: they raise ``WorldError`` for that step, and
the world goes on. Every failure is in ``failures``. No received step is ever
dropped: a call that raises leaves the other worlds' steps for the next ``recv``.
``send`` checks and packs every action before it sends any: all or nothing.
"""

from __future__ import annotations

import collections
import functools
import operator
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from . import errors
from ._adaptor.stacked import BatchedTimeStep, batch_of, split_actions
from ._base import checks as _checks
from ._batch import taking as _taking
from ._batch.channels import DEFAULT_STREAMS_PER_CONNECTION
from ._batch.closing import close_batch
from ._batch.core import BatchCore
from ._batch.opening import open_batch
from ._batch.options import ConnectionOptions, FailurePolicy, ungroup
from ._batch.outcomes import _FAILED, _REMOVED_STATE, _Failure, _flagged, _is_bad
from ._batch.reset import reset_each
from ._batch.restart import RAISE, RestartPolicy, WorldFailure
from ._transport.loop import call_on_loop
from .random_actions import random_batch

_CLOSED = operator.attrgetter("_closed")
_TOO_FEW = "Only {pending} steps are in flight; cannot receive {wanted}. send() more first."
_WORLD_IDLE = "World {index} has {pending} steps in flight; cannot receive {wanted} of it."
_RECV_TIMEOUT = "Fewer than {wanted} steps finished within {timeout} s ({ready} did)."
_NO_RESPONSE = "no response within {timeout} s"
_ALL_REMOVED = "Every world of the batch was removed after failing; see envs.failures."
_RESET_TWICE = "env_ids names world {index} twice; reset each world once."
_RESET_IN_FLIGHT = (
    "World {index} has {pending} step(s) in flight; recv() them before resetting it "
    "(their answers would come after its FIRST step)."
)


class BatchedEnvironment(BatchCore):
    """N remote worlds stepped as one batch. See the module docs.

    Args:
      envs: the worlds, one connection each.
      addresses: the server address of each world, for error messages.
      connections: connections to close with the batch (``connect`` fills this).

    Attributes:
      envs: the worlds' ``DmEnvAdaptor``s (a restarted world's is replaced).
      addresses: each world's server address (where a restarted world now is).
      latencies: round trips in seconds (send to response) of the latest
        ``LATENCY_SAMPLES`` steps received, for percentiles.
      world_seeds: the seed each world was created with (``connect(seed=...)``),
        None where it got none.
      failures: a ``WorldFailure`` per world failure, oldest first.
    """

    @classmethod
    @_checks.keywords_checked
    def connect(
        cls,
        addresses: str | Sequence[str],
        num_envs: int | None = None,
        *,
        create_world_settings: Mapping[str, Any] | None = None,
        join_world_settings: Mapping[str, Any] | None = None,
        requested_observations: Sequence[str] | None = None,
        timeout: float | None = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        insecure: bool = False,
        metadata: Sequence[tuple[str, str]] | None = None,
        seed: int | None = None,
        seed_setting: str | None = "seed",
        world_names: Sequence[str] | None = None,
        on_world_failure: str = RAISE,
        step_timeout: float | None = 30.0,
        restart: RestartPolicy | None = None,
        wait_for_ready: bool = False,
        max_streams_per_connection: int | None = DEFAULT_STREAMS_PER_CONNECTION,
        max_response_bytes: int | None = None,
        connection: ConnectionOptions | None = None,
        failure_policy: FailurePolicy | None = None,
    ) -> BatchedEnvironment:
        """Creates and joins ``num_envs`` worlds (default: one per address), round-robin.

        Every world gets its own stream, all on one background event loop. All or
        nothing: if a world cannot be opened, every world made is left and
        destroyed (named worlds only left) before the error is raised.

        Seeds follow gymnasium's ``reset(seed=s)`` convention for vector envs:
        world ``i`` gets ``seed + i``, in its create settings under
        ``seed_setting``. A server that refuses that setting (INVALID_ARGUMENT
        naming it) gets the worlds created without it, with a warning;
        ``world_seeds`` says which seed each world got.

        Args:
          addresses: server addresses (``host:port``, ``unix:path``), or ``dmr.launch``'s servers.
          num_envs: how many worlds; default one per address.
          create_world_settings: settings for every CreateWorldRequest.
          join_world_settings: settings for every JoinWorldRequest.
          requested_observations: the observation names every world returns (as
            for ``DmEnvAdaptor``; a restarted world too); None returns all.
          timeout: seconds to wait for each server to answer, and for each response
            of the worlds' ``reset``, ``close`` and lifecycle calls.
          credentials: channel credentials for TLS (as for ``dmr.connect``).
          options: extra gRPC channel options.
          insecure: allow plaintext to a remote host.
          metadata: gRPC metadata for every stream (``dmr.token_metadata(token)``).
          seed: world ``i`` is created with ``seed + i`` under ``seed_setting``;
            None leaves the settings as they are.
          seed_setting: the create setting that carries the seed; None never sets it.
          world_names: join these existing worlds (world ``i`` joins
            ``world_names[i]``) instead of creating new ones; they are left, not
            destroyed, on close, and get no seed.
          on_world_failure: ``"raise"`` or ``"restart"`` (see the module docs).
          step_timeout: a world with steps in flight that gets no response for
            this many seconds has failed (None: never; then a stopped server is
            found only by keepalive, within ``KEEPALIVE_DETECTION_S``).
          restart: the bounds of a restart (``RestartPolicy()`` by default).
          wait_for_ready: wait for servers still starting, as for ``dmr.connect``.
          max_streams_per_connection: the most worlds on one HTTP/2 connection (100,
            the lowest stream limit common in the wild; see ``_batch.channels``).
          max_response_bytes: the largest answer taken (None: any size).
          connection: ``credentials`` to ``max_response_bytes`` (the seven keywords of
            how to connect) as one ``dmr.ConnectionOptions`` (instead of those keywords).
          failure_policy: ``on_world_failure``, ``step_timeout`` and ``restart`` as one
            ``dmr.FailurePolicy`` (instead of those keywords).

        Raises:
          ValueError: no address, no world, ``seed`` and ``create_world_settings``
            both set the seed setting, ``world_names`` does not match
            ``num_envs``, an unknown ``on_world_failure``, ``requested_observations``
            given as one string, or a keyword given alone and in its group too.
          UnknownNameError: a requested observation the worlds do not have (it
            lists the known names).
          WorldError: naming the world that could not be created or joined.
        """
        grouped = ungroup(
            connection,
            failure_policy,
            credentials=credentials,
            options=options,
            insecure=insecure,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
            on_world_failure=on_world_failure,
            step_timeout=step_timeout,
            restart=restart,
            max_streams_per_connection=max_streams_per_connection,
            max_response_bytes=max_response_bytes,
        )
        return open_batch(
            cls,
            addresses,
            num_envs,
            create_world_settings=create_world_settings,
            join_world_settings=join_world_settings,
            requested_observations=requested_observations,
            timeout=timeout,
            seed=seed,
            seed_setting=seed_setting,
            world_names=world_names,
            **grouped,
        )

    def __len__(self) -> int:
        """The number of worlds in the batch (removed ones not counted)."""
        return len(self.live_ids)

    @property
    def live_ids(self) -> list[int]:
        """The indices of the worlds still in the batch (all but removed ones), in order."""
        return [index for index, state in enumerate(self._state) if state != _REMOVED_STATE]

    def action_spec(self) -> Any:
        """The action spec of one world (all worlds are expected to share it)."""
        return self.envs[0].action_spec()

    def observation_spec(self) -> Any:
        """The observation spec of one world."""
        return self.envs[0].observation_spec()

    @property
    def num_envs(self) -> int:
        """How many worlds ``step`` takes actions for (``len(envs)``; removed ones not counted)."""
        return len(self)

    def reset(
        self, env_ids: Sequence[int] | None = None, timeout: float | None = None
    ) -> BatchedTimeStep:
        """Resets worlds and returns their FIRST steps, in the order of ``env_ids``.

        Args:
          env_ids: the worlds to reset (EnvPool's ``reset(env_id)``); default every
            world in the batch. The others go on where they are.
          timeout: seconds to wait for each response.

        Raises:
          ValueError: not a world index, one named twice, or a world with steps in
            flight (``recv`` them first).
          WorldError: a world failed or did not answer within ``timeout``, for the
            first such world of ``env_ids``. Every other world was still reset:
            the error's ``reset_steps`` holds their FIRST steps (None if none).
        """
        ids = self._checked_ids(env_ids)
        for position, index in enumerate(ids):
            if index in ids[:position]:
                raise ValueError(_RESET_TWICE.format(index=index))
            if self.in_flight(index):
                pending = self.in_flight(index)
                raise ValueError(_RESET_IN_FLIGHT.format(index=index, pending=pending))
        return reset_each(self, ids, timeout)

    def random_actions(
        self, rng: np.random.Generator | int | None = None, env_ids: Sequence[int] | None = None
    ) -> Any:
        """Random actions for ``env_ids`` (default every world), stacked as ``step`` takes them.

        Args:
          rng: a NumPy Generator or a seed; default the batch's own generator,
            seeded by ``connect(seed=...)`` when one was given.
          env_ids: the worlds to draw for, in ``send`` order.

        Returns:
          A nested dict of ``[len(env_ids), ...]`` arrays (``dmr.random_batch``).
        """
        count = len(self._checked_ids(env_ids))
        return random_batch(self.action_spec(), count, self._actions_rng if rng is None else rng)

    def step(self, actions: Any, timeout: float | None = None) -> BatchedTimeStep:
        """Steps every world in the batch with its slice of ``actions`` (batch axis first).

        The batch axis runs over ``live_ids`` (every world, unless some were
        removed). A world that is being restarted answers with its FIRST step
        once it is back, so this waits for it (bounded by ``timeout``).

        A list of one action dict per world works too (``[{"paddle": 0}] * 4``).

        Raises:
          SpecValidationError: the actions do not fit the batch or the specs.
          WorldError: a world failed or did not answer within ``timeout``.
        """
        env_ids = self._checked_ids(None)
        self.send(actions, env_ids)
        return self.recv(len(env_ids), timeout=timeout, env_ids=env_ids)

    def _checked_ids(self, env_ids: Sequence[int] | None) -> list[int]:
        """``env_ids`` as world indices of the batch, or the live ones; raises for bad ones."""
        if env_ids is None:
            ids = self.live_ids
            if not ids:
                raise errors.WorldError(_ALL_REMOVED, -1, None)
            return ids
        return _taking.checked_ids(len(self._state), env_ids)

    def send(self, actions: Any, env_ids: Sequence[int]) -> None:
        """Sends one step to each world in ``env_ids`` (actions stacked in that order); returns at once.

        ``actions`` is a dict of arrays with the batch axis first, or a list of
        one action dict per world of ``env_ids``. Every action is checked and
        packed before anything is sent: if one is refused, no world was stepped.

        Raises:
          SpecValidationError: the actions do not fit the batch or the specs.
          ValueError: ``env_ids`` holds something that is not a world index.
          WorldError: a world failed earlier (``on_world_failure="raise"``),
            was removed, or its connection is closed.
        """
        ids = self._checked_ids(env_ids)
        states = self._state
        if _FAILED in states or _REMOVED_STATE in states:  # (a C-level look at every world)
            for index in ids:
                if states[index] in (_FAILED, _REMOVED_STATE):
                    raise self._refusal(index)
        wire = self._encoded(actions, ids)
        if wire is None:  # the per-world path: it raises each world's own errors
            if self._runner is None:  # adaptors over connections of their own
                packed = self._step_requests(actions, ids)
                sent = time.perf_counter()
                for index, request in zip(ids, packed, strict=True):
                    future = self.envs[index].connection.send_async(request)
                    self._count(index, 1)
                    callback = functools.partial(self._finished, index, self._gen[index], sent)
                    future.add_done_callback(callback)
                return
            wire = self._step_requests(actions, ids, as_bytes=True)
        # On the batch's loop: requests are packed here, then written by one loop call.
        sent = time.perf_counter()
        in_flight = self._in_flight
        for index in ids:
            in_flight[index] += 1
        self._in_flight_total += len(ids)
        assert self._runner is not None
        self._runner.call(self._write_steps, ids, wire, sent)

    def _encoded(self, actions: Any, ids: list[int]) -> list[bytes] | None:
        """Every world's request bytes by the fast path (``_fastpath.step_encoder``), or None.

        It applies to stacked actions for worlds whose specs are those the batch
        was opened with (all alike) and whose adaptors are open.
        """
        encoder = self._encoder
        if encoder is None or not isinstance(actions, Mapping):
            return None
        if any(map(_CLOSED, map(self.envs.__getitem__, ids))) or not _taking.as_joined(self, ids):
            return None
        return encoder.encode(actions, len(ids))

    def _step_requests(self, actions: Any, ids: list[int], as_bytes: bool = False) -> list[Any]:
        """One StepRequest per world of ``ids``, or (``as_bytes``) its EnvironmentRequest bytes
        (``_step_data``: most actions without building messages); raises ``WorldError`` naming
        a world whose action is refused."""
        per_world = split_actions(actions, len(ids), self.envs[0].action_manager.names())
        packed = []
        for index, action in zip(ids, per_world, strict=True):
            env = self.envs[index]
            try:
                packed.append(env._step_data(action)[0] if as_bytes else env.step_request(action))
            except errors.DmEnvRpcClientError as exc:
                raise self._wrap(index, exc) from exc
        return packed

    def pending(self) -> int:
        """The number of steps sent and not yet received."""
        return self._in_flight_total + self._auto_total

    def in_flight(self, index: int) -> int:
        """The number of steps sent to world ``index`` and not yet received."""
        return self._in_flight[index] + self._auto_sent[index]

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
        collects exactly the oldest step of each of those worlds, in that order
        (a world removed meanwhile is left out of the result).

        Raises:
          WorldError: a world failed or a step of it was refused (names its index
            and address; the other worlds' finished steps stay for the next
            ``recv``); with ``env_ids``, a ``WorldTimeoutError`` when one of them did
            not finish within ``timeout``, which counts as that world's failure.
          RequestTimeoutError: fewer than ``min_count`` steps finished within ``timeout``.
          ValueError: fewer steps are in flight than asked for.
        """
        if env_ids is not None:
            return self._recv_worlds(self._checked_ids(env_ids), timeout)
        if self.pending() < min_count:
            raise ValueError(_TOO_FEW.format(pending=self.pending(), wanted=min_count))
        if not self._wait(lambda: self._ready >= min_count, min_count, timeout):
            raise errors.RequestTimeoutError(
                _RECV_TIMEOUT.format(wanted=min_count, timeout=timeout, ready=self._ready)
            )
        return self._collect(_taking.take_filed(self), min_count, timeout)

    def _recv_worlds(self, env_ids: list[int], timeout: float | None) -> BatchedTimeStep:
        wanted = collections.Counter(env_ids)
        for index, count in wanted.items():
            if self.in_flight(index) < count:
                raise ValueError(
                    _WORLD_IDLE.format(index=index, pending=self.in_flight(index), wanted=count)
                )

        def ready() -> bool:
            return all(len(self._done[index]) >= count for index, count in wanted.items())

        if not self._wait(ready, len(env_ids), timeout):
            with self._cond:
                late = next(i for i, n in wanted.items() if len(self._done[i]) < n)
            cause = errors.RequestTimeoutError(_NO_RESPONSE.format(timeout=timeout))
            self._timed_out(late, cause)
            raise self._wrap(late, cause) from cause
        with self._cond:
            taken = [
                (index, *self._done[index].popleft()) for index in env_ids if self._done[index]
            ]
            self._ready -= len(taken)
        return self._collect(taken, 0, timeout)

    def _timed_out(self, index: int, cause: BaseException) -> None:
        """``recv`` gave up on world ``index``: it failed, and its unanswered steps are dropped."""
        if self._runner is not None:
            lost = self._runner.run(call_on_loop(self._fail, index, cause, True), timeout=10)
        else:
            with self._cond:
                self._gen[index] += 1
                self._state[index] = _FAILED
            lost = self._in_flight[index] - len(self._done[index])
            self.failures.append(
                WorldFailure(
                    index, self.addresses[index], cause, time.time(), 0, "raised", None, lost, 0.0
                )
            )
        if self._policy == RAISE:
            self._count(index, -lost)

    def _collect(
        self, taken: list[tuple[int, Any, float]], min_count: int, timeout: float | None
    ) -> BatchedTimeStep:
        plain = _taking.collect_plain(self, taken) if self._runner is not None else None
        if plain is not None:  # the usual batch
            return plain
        removed = [item for item in taken if isinstance(item[1], _Failure) and item[1].removed]
        if removed:  # a removed world's steps are accounted for, not returned
            for index, outcome, _ in removed:
                self._count(index, -outcome.lost)
            taken = [item for item in taken if item not in removed]
            if not taken:
                if min_count and self.pending():
                    return self.recv(min_count, timeout)
                raise self._refusal(removed[0][0])
        bad = next((k for k, (_, outcome, _) in enumerate(taken) if _is_bad(outcome)), None)
        if bad is not None:
            index, outcome, _ = taken[bad]
            _taking.put_back(self, taken[:bad] + taken[bad + 1 :])
            self._count(index, -(outcome.lost if isinstance(outcome, _Failure) else 1))
            cause = outcome.cause if isinstance(outcome, _Failure) else outcome
            if isinstance(cause, errors.WorldError):
                raise cause
            raise self._wrap(index, cause) from cause
        env_ids = [index for index, _, _ in taken]
        self.latencies.extend(latency for _, _, latency in taken)
        if self._runner is None:  # (TimeStep, state) already
            for index in env_ids:
                self._count(index, -1)
            timesteps, states = zip(*(outcome for _, outcome, _ in taken), strict=True)
            return _flagged(batch_of(timesteps, env_ids), None, states)
        in_flight, answered = self._in_flight, 0
        for index, outcome, _ in taken:
            steps = outcome[2] if len(outcome) > 2 else 1
            in_flight[index] -= steps
            answered += steps
        self._in_flight_total -= answered
        step_types = [outcome[0] for _, outcome, _ in taken]
        responses = [outcome[1] for _, outcome, _ in taken]
        try:
            stacked = _taking.decode(self, env_ids, step_types, responses)
        except Exception:  # find the world whose step does not decode
            return _taking.decode_apart(self, taken)
        truncated = [len(outcome) > 2 for _, outcome, _ in taken]
        return _flagged(stacked, truncated, [response.state for response in responses])

    def close(self, timeout: float = 10.0) -> None:
        """Leaves every world and closes what this batch opened. Idempotent; bounded by ``timeout``.

        A dead or hung server is waited for at most ``timeout`` (10 s) to answer the leaves and
        destroys; tearing the streams down after that takes at most 10 s more (gRPC's own)."""
        if not self._closed:
            close_batch(self, timeout)

    def __enter__(self) -> BatchedEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchedEnvironment({len(self.envs)} worlds on {sorted(set(map(str, self.addresses)))})"

    def _repr_html_(self) -> str:
        from . import display  # presentation: only when rendered

        fields = {"worlds": len(self.envs), "addresses": sorted(set(map(str, self.addresses)))}
        return display.environment_html("BatchedEnvironment", fields, *self.envs[0]._spec_rows())
