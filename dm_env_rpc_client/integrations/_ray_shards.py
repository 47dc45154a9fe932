"""Sharded stepping: K Ray actors each step a ``BatchedEnvironment`` over their share of worlds.

``run_sharded(fleet_or_addresses, num_worlds=..., num_shards=K, steps=...)``
splits the worlds into K contiguous shares; world ``i`` lives on server
``i % len(addresses)`` and has create setting ``seed = seed + i`` when a seed
is given. Each shard (a Ray actor, placed with the ``SPREAD`` strategy) opens
its worlds, then steps them right there, with random actions (drawn from world
``i``'s own generator, seeded ``seed + i``, so a world's actions do not depend on
K) or with a user ``policy``. No step goes through the driver; the driver only
polls each shard's step count for the progress bar.

What comes back is a ``ShardedRun``: the totals over all shards (steps,
episodes, returns, steps/s, latency percentiles computed over every step's
round trip, not averaged over shards) and each shard's ``ShardStats``. With
``record=DIR`` each shard records its episodes and the recordings come back to
the driver, which writes them all into ``DIR`` (file names carry the global
world index, so they never clash).

A policy is ``policy(timestep) -> actions``: ``timestep`` is the
``BatchedTimeStep`` of the shard's worlds that just finished a step (its
``env_ids`` index the shard's own worlds), and ``actions`` is a nested dict of
arrays for those worlds, batch axis first. With a policy every world has one
step in flight; random actions keep ``pipeline`` steps in flight per world.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np
import ray

from dm_env_rpc_client import errors
from dm_env_rpc_client.batched import BatchedEnvironment, BatchedTimeStep
from dm_env_rpc_client.integrations._ray_fleet import (
    _NOT_INITIALIZED,
    FleetError,
    ServerFleet,
    _first_line,
    fleet_addresses,
)
from dm_env_rpc_client.random_actions import random_action
from dm_env_rpc_client.recording import EpisodeRecorder, prepare_folder

Policy = Callable[[BatchedTimeStep], Mapping[str, Any]]
_BAD_SPLIT = "Cannot split {worlds} worlds into {shards} shards; need 1 <= shards <= worlds."
_SHARD_FAILED = "Shard {shard} (worlds {first}-{last}) failed: {error}"
_POLL = 0.25  # seconds between progress polls


class ShardStats(NamedTuple):
    """What one shard did.

    Attributes:
      shard: the shard's index.
      worlds: the global indices of its worlds.
      steps: steps received (the FIRST steps that start episodes included).
      episodes: episodes that ended (LAST steps).
      returns: each ended episode's return, in the order they ended.
      elapsed: seconds spent stepping.
      cpu: CPU seconds the shard's process spent meanwhile (all its threads).
      latencies: round trip of every step in seconds (the latest 100,000).
      restarts: worlds restarted after a failure (the batch's ``failures``).
      recordings: recorded episodes, file name -> ``.npz`` bytes.
    """

    shard: int
    worlds: list[int]
    steps: int
    episodes: int
    returns: list[float]
    elapsed: float
    cpu: float
    latencies: np.ndarray
    restarts: int
    recordings: dict[str, bytes]


class ShardedRun(NamedTuple):
    """The totals of a sharded run, and each shard's stats.

    Attributes:
      worlds: worlds over all shards.
      steps: steps over all shards.
      episodes: ended episodes over all shards.
      returns: every ended episode's return, shard by shard.
      elapsed: the slowest shard's stepping time (the shards step at once).
      steps_per_second: ``steps / elapsed``.
      cpu_us_per_step: the shards' CPU time per step, in microseconds: what one
        step costs the clients, wherever they run.
      latency_p50_ms: median round trip over every step of every shard.
      latency_p99_ms: 99th percentile of the same.
      restarts: world restarts over all shards.
      recorded: the episode files written (with ``record``), sorted.
      shards: each shard's ``ShardStats``.
    """

    worlds: int
    steps: int
    episodes: int
    returns: list[float]
    elapsed: float
    steps_per_second: float
    cpu_us_per_step: float
    latency_p50_ms: float
    latency_p99_ms: float
    restarts: int
    recorded: list[pathlib.Path]
    shards: list[ShardStats]


def split(num_worlds: int, num_shards: int) -> list[list[int]]:
    """Global world indices of each shard: contiguous shares, sizes differing by at most one.

    Raises:
      ValueError: ``num_shards`` is not between 1 and ``num_worlds``.
    """
    if not 1 <= num_shards <= num_worlds:
        raise ValueError(_BAD_SPLIT.format(worlds=num_worlds, shards=num_shards))
    bounds = [round(k * num_worlds / num_shards) for k in range(num_shards + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(num_shards)]


def summarize(shards: Sequence[ShardStats], recorded: Sequence[pathlib.Path] = ()) -> ShardedRun:
    """Adds the shards' stats up; latency percentiles over all their steps at once."""
    steps = sum(s.steps for s in shards)
    elapsed = max((s.elapsed for s in shards), default=0.0)
    latencies = np.concatenate([s.latencies for s in shards]) if shards else np.zeros(0)
    p50, p99 = np.percentile(latencies * 1e3, [50, 99]) if latencies.size else (float("nan"),) * 2
    return ShardedRun(
        worlds=sum(len(s.worlds) for s in shards),
        steps=steps,
        episodes=sum(s.episodes for s in shards),
        returns=[r for s in shards for r in s.returns],
        elapsed=elapsed,
        steps_per_second=steps / elapsed if elapsed > 0 else float("nan"),
        cpu_us_per_step=sum(s.cpu for s in shards) / steps * 1e6 if steps else float("nan"),
        latency_p50_ms=float(p50),
        latency_p99_ms=float(p99),
        restarts=sum(s.restarts for s in shards),
        recorded=sorted(recorded),
        shards=list(shards),
    )


class ShardError(errors.DmEnvRpcClientError):
    """A shard of a sharded run failed; names the shard and its global worlds.

    Attributes:
      shard: the shard's index.
      worlds: the global indices of its worlds.
    """

    def __init__(self, message: str, shard: int, worlds: Sequence[int]) -> None:
        super().__init__(message)
        self.shard = shard
        self.worlds = list(worlds)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.shard, self.worlds))


class _Shard:
    """The actor body: one shard's worlds in one BatchedEnvironment (made a Ray actor)."""

    def __init__(
        self,
        shard: int,
        worlds: list[int],
        addresses: list[str],
        seed: int | None,
        connect_options: dict[str, Any],
    ) -> None:
        self._shard, self._worlds = shard, worlds
        self._timeout = connect_options.get("timeout", 30.0)
        self._received = 0
        options = dict(connect_options)
        credentials = options.pop("credentials", None)
        if credentials is not None:
            options["credentials"] = credentials()
        self._batch = BatchedEnvironment.connect(
            addresses,
            len(addresses),
            seed=None if seed is None else seed + worlds[0],
            **options,
        )

    def progress(self) -> int:
        return self._received

    def run(self, steps: int, policy: Policy | None, pipeline: int, record: bool) -> ShardStats:
        batch, worlds = self._batch, self._worlds
        seeds = batch.world_seeds
        rngs = [np.random.default_rng(seed) for seed in seeds]
        folder = tempfile.TemporaryDirectory(prefix="dm_env_rpc_shard-") if record else None
        recorders = (
            [EpisodeRecorder(folder.name, w, seed=s) for w, s in zip(worlds, seeds, strict=True)]
            if folder is not None
            else None
        )
        sent_actions: list[collections.deque[Any]] = [collections.deque() for _ in worlds]
        running = np.zeros(len(worlds))
        returns: list[float] = []
        spec = batch.action_spec()
        received = sent = 0
        started, cpu = time.perf_counter(), time.process_time()
        ready: BatchedTimeStep | None = None
        if policy is not None:  # the policy needs observations: start from FIRST steps
            ready = batch.reset(timeout=self._timeout)
            for position, world in enumerate(ready.env_ids):
                if recorders is not None:
                    recorders[world].add(None, ready.at(position))
        while received < steps:
            if policy is not None:
                if ready is not None and sent < steps:
                    ids = list(ready.env_ids)[: steps - sent]
                    actions = _head(policy(ready), len(ids))
                    batch.send(actions, ids)
                    for position, world in enumerate(ids):
                        sent_actions[world].append(_index(actions, position))
                    sent += len(ids)
            else:  # random actions: top every world up to `pipeline` steps in flight
                ids = [w for w in range(len(worlds)) if batch.in_flight(w) < pipeline]
                ids = ids[: steps - sent]
                if ids:
                    drawn = [random_action(spec, rngs[w]) for w in ids]
                    batch.send(_stack(drawn), ids)
                    for world, action in zip(ids, drawn, strict=True):
                        sent_actions[world].append(action)
                    sent += len(ids)
            ready = batch.recv(1, timeout=self._timeout)
            for position, world in enumerate(ready.env_ids):
                action = sent_actions[world].popleft()
                step_type = int(ready.step_type[position])
                if step_type != 0:
                    running[world] += ready.reward[position]
                if step_type == 2:
                    returns.append(float(running[world]))
                    running[world] = 0.0
                if recorders is not None:
                    recorders[world].add(None if step_type == 0 else action, ready.at(position))
            received += len(ready.env_ids)
            self._received = received
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        recordings: dict[str, bytes] = {}
        if folder is not None and recorders is not None:
            for recorder in recorders:
                recorder.truncate()  # an unfinished episode is kept, marked truncated
            recordings = {p.name: p.read_bytes() for p in pathlib.Path(folder.name).glob("*.npz")}
            folder.cleanup()
        return ShardStats(
            shard=self._shard,
            worlds=list(worlds),
            steps=received,
            episodes=len(returns),
            returns=returns,
            elapsed=elapsed,
            cpu=cpu,
            latencies=np.asarray(batch.latencies, np.float64),
            restarts=len(getattr(batch, "failures", ())),
            recordings=recordings,
        )

    def close(self) -> None:
        self._batch.close()


def _head(actions: Any, count: int) -> Any:
    if isinstance(actions, Mapping):
        return {key: _head(value, count) for key, value in actions.items()}
    return np.asarray(actions)[:count]


def _index(actions: Any, position: int) -> Any:
    if isinstance(actions, Mapping):
        return {key: _index(value, position) for key, value in actions.items()}
    return np.asarray(actions)[position]


def _stack(actions: list[Any]) -> Any:
    first = actions[0]
    if isinstance(first, Mapping):
        return {key: _stack([a[key] for a in actions]) for key in first}
    return np.stack([np.asarray(a) for a in actions])


def run_sharded(
    source: ServerFleet | Sequence[str],
    *,
    num_worlds: int,
    num_shards: int,
    steps: int,
    policy: Policy | None = None,
    pipeline: int = 8,
    seed: int | None = None,
    record: str | pathlib.Path | None = None,
    create_world_settings: Mapping[str, Any] | None = None,
    join_world_settings: Mapping[str, Any] | None = None,
    timeout: float = 30.0,
    credentials: Callable[[], grpc.ChannelCredentials] | None = None,
    insecure: bool = True,
    connect_options: Mapping[str, Any] | None = None,
    num_cpus: float = 1.0,
    progress: Callable[[int], None] | None = None,
) -> ShardedRun:
    """Steps ``num_worlds`` worlds in ``num_shards`` Ray actors; see the module docs.

    Ray must be initialized first (``ray.init``).

    Args:
      source: a ``ServerFleet``, or server addresses; world ``i`` goes to
        address ``i % len(addresses)``.
      num_worlds: how many worlds over all shards.
      num_shards: how many shard actors (1 to ``num_worlds``).
      steps: total steps over all shards, split in proportion to their worlds.
      policy: ``policy(timestep) -> actions``, run in the shards (Ray pickles
        it); None steps with random actions.
      pipeline: steps in flight per world with random actions.
      seed: world ``i`` is created with setting ``seed = seed + i`` and draws
        its random actions from a generator seeded ``seed + i``.
      record: a new or empty folder: every shard's episodes are written there.
      create_world_settings: settings for every CreateWorldRequest.
      join_world_settings: settings for every JoinWorldRequest.
      timeout: seconds for each server answer and each step's response.
      credentials: a function returning ``grpc.ChannelCredentials`` for a TLS
        fleet, called in each shard (credential objects do not pickle).
      insecure: allow plaintext to non-loopback addresses (a fleet's servers
        listen on their node's IP; default True).
      connect_options: more keyword arguments for ``BatchedEnvironment.connect``.
      num_cpus: CPUs reserved per shard (fractions allowed).
      progress: called in this process with the total steps received so far,
        about four times a second.

    Returns:
      The totals and each shard's stats (``ShardedRun``).

    Raises:
      FleetError: Ray is not initialized, or the fleet is closed or unreachable.
      ShardError: a shard could not connect its worlds or failed while
        stepping; names the shard, its worlds and the cause.
      RecordingError: ``record`` is not a new or empty folder.
      ValueError: a bad ``num_shards``, ``num_worlds`` or ``steps``.
    """
    if not ray.is_initialized():
        raise FleetError(_NOT_INITIALIZED)
    if steps < 0:
        raise ValueError(f"steps must be 0 or more, not {steps}.")
    shares = split(num_worlds, num_shards)
    addresses = fleet_addresses(source)
    folder = prepare_folder(record) if record is not None else None
    options = {
        "create_world_settings": create_world_settings,
        "join_world_settings": join_world_settings,
        "timeout": timeout,
        "credentials": credentials,
        "insecure": insecure,
        **(connect_options or {}),
    }
    shard_class = ray.remote(_Shard).options(
        num_cpus=num_cpus, max_concurrency=2, scheduling_strategy="SPREAD"
    )
    actors: list[Any] = [
        shard_class.remote(k, share, [addresses[w % len(addresses)] for w in share], seed, options)
        for k, share in enumerate(shares)
    ]
    try:
        # Every shard connects its worlds first, so they all start stepping at once.
        _gather(actors, shares, [actor.progress.remote() for actor in actors], None)
        cumulative = [
            round(steps * share[-1] / num_worlds + steps / num_worlds) for share in shares
        ]
        quotas = [b - a for a, b in zip([0, *cumulative[:-1]], cumulative, strict=True)]
        runs = [
            actor.run.remote(quota, policy, max(1, pipeline), folder is not None)
            for actor, quota in zip(actors, quotas, strict=True)
        ]
        stats = _gather(actors, shares, runs, progress)
    finally:
        _close(actors, timeout)
    recorded = []
    if folder is not None:
        for shard in stats:
            for name, data in sorted(shard.recordings.items()):
                recorded.append(_write_atomically(folder / name, data))
    return summarize(stats, recorded)


def _gather(
    actors: list[Any],
    shares: list[list[int]],
    refs: list[Any],
    progress: Callable[[int], None] | None,
) -> list[Any]:
    """Waits for one call per shard (polling progress meanwhile); a failure names its shard."""
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL)
        if progress is not None:
            counts = ray.get([actor.progress.remote() for actor in actors], timeout=_POLL * 40)
            progress(sum(counts))
    results = []
    for k, ref in enumerate(refs):
        try:
            results.append(ray.get(ref, timeout=_POLL * 40))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            cause = getattr(exc, "cause", None) or exc
            share = shares[k]
            raise ShardError(
                _SHARD_FAILED.format(
                    shard=k, first=share[0], last=share[-1], error=_first_line(cause)
                ),
                k,
                share,
            ) from exc
    return results


def _close(actors: list[Any], timeout: float) -> None:
    """Closes every shard's batch, then kills the actors; bounded by ``timeout``."""
    closes = [actor.close.remote() for actor in actors]
    with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
        ray.wait(closes, num_returns=len(closes), timeout=timeout)
    for actor in actors:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(actor, no_restart=True)


def _write_atomically(path: pathlib.Path, data: bytes) -> pathlib.Path:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
    return path
