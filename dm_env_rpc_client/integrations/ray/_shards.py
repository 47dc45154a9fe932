"""Sharded stepping: K Ray actors each step a ``BatchedEnvironment`` over their share of worlds.

``run_sharded(fleet_or_addresses, num_worlds=..., num_shards=K, steps=...)``
splits the worlds into K contiguous shares; world ``i`` lives on server
``i % len(addresses)`` and has create setting ``seed = seed + i`` when a seed
is given. Each shard (a Ray actor, placed with the ``SPREAD`` strategy) opens
its worlds, then steps them right there, with random actions (drawn from world
``i``'s own generator, seeded ``seed + i``, so a world's actions do not depend on
K) or with a user ``policy``. No step goes through the driver; the driver only
polls each shard's step count for the progress bar.

Each shard steps with the library's one stepping loop (``dmr.collect``'s,
``_stepping.loop.step``, told the index of its first world in the run), so a
shard steps exactly as ``dm-env-rpc-client run`` does: world ``i``'s random
actions come from its own generator, seeded from ``seed + i``, whatever K is.

What comes back is a ``ShardedRun``: the shards' ``RunStats`` merged
(``RunStats.merge``: steps, episodes and returns added up, latency percentiles
over every step's round trip, not averaged over shards) and each shard's
``ShardStats``. With ``record=DIR`` each shard records its episodes and the
recordings come back to the driver, which writes them all into ``DIR`` (file
names and metadata carry the world's index in the whole run, so they never
clash).

A policy is ``policy(timestep) -> actions``: ``timestep`` is the
``BatchedTimeStep`` of the shard's worlds that just finished a step (its
``env_ids`` index the shard's own worlds), and ``actions`` is a nested dict of
arrays for those worlds, batch axis first. With a policy every world has one
step in flight; random actions keep ``pipeline`` steps in flight per world.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np
import ray

from ... import errors
from ..._stepping.loop import Policy, step
from ..._stepping.tally import RunStats
from ...batched import BatchedEnvironment
from ...launch import launch
from ...recording import Recording, prepare_folder
from ._fleet import _NOT_INITIALIZED, FleetError, ServerFleet, _first_line, fleet_addresses

_BAD_SPLIT = "Cannot split {worlds} worlds into {shards} shards; need 1 <= shards <= worlds."
_SHARD_FAILED = "Shard {shard} (worlds {first}-{last}) failed: {error}"
_NOT_READY = (
    "{pending} of {count} shards did not connect their worlds within {timeout} s (not placed: "
    "the cluster has {available}; or the servers are slow). Ask for fewer shards or CPUs per "
    "shard (num_cpus=...), or a longer timeout."
)
_POLL = 0.25  # seconds between progress polls


class ShardStats(NamedTuple):
    """What one shard did.

    Attributes:
      shard: the shard's index.
      worlds: the indices of its worlds in the whole run.
      stats: its ``RunStats`` (world seeds and returns in world order).
      cpu: CPU seconds its process spent stepping (all its threads).
      restarts: worlds restarted after a failure (``failures`` of the shard's batch
        restarted, under ``connect_options={"on_world_failure": "restart"}``).
      lost: steps sent to a failed world that no server answered; the world's
        one FIRST step after its restart answers them all, and ``stats.steps``
        counts that one.
      recordings: recorded episodes, file name -> ``.npz`` bytes.
    """

    shard: int
    worlds: list[int]
    stats: RunStats
    cpu: float
    restarts: int
    lost: int
    recordings: dict[str, bytes]


class ShardedRun(NamedTuple):
    """A sharded run: the shards' stats merged, and each shard's.

    Attributes:
      stats: ``RunStats.merge`` of the shards: worlds, steps, episodes,
        returns and latencies over all of them; ``elapsed`` is the slowest
        shard's (they step side by side).
      shards: each shard's ``ShardStats``.
      cpu_us_per_step: the shards' CPU time per step, in microseconds: what a
        step costs the clients, wherever they run.
      restarts: world restarts over all shards.
      recorded: the episode files written (with ``record``), sorted.
    """

    stats: RunStats
    shards: list[ShardStats]
    cpu_us_per_step: float
    restarts: int
    recorded: list[pathlib.Path]

    @property
    def steps(self) -> int:
        """Steps over all shards."""
        return self.stats.steps

    @property
    def steps_per_second(self) -> float:
        """Steps over all shards per second of the slowest shard."""
        return self.stats.steps / self.stats.elapsed if self.stats.elapsed else float("nan")

    @property
    def latency_p50_ms(self) -> float:
        """The median round trip over every step of every shard."""
        return _percentile(self.stats.latencies, 50)

    @property
    def latency_p99_ms(self) -> float:
        """The 99th percentile round trip over every step of every shard."""
        return _percentile(self.stats.latencies, 99)


def _percentile(latencies: np.ndarray, q: float) -> float:
    return float(np.percentile(latencies, q) * 1e3) if latencies.size else float("nan")


def split(num_worlds: int, num_shards: int) -> list[list[int]]:
    """Indices of each shard's worlds: contiguous shares, sizes differing by at most one.

    Raises:
      ValueError: ``num_shards`` is not between 1 and ``num_worlds``.
    """
    if not 1 <= num_shards <= num_worlds:
        raise errors.ArgumentValueError(_BAD_SPLIT.format(worlds=num_worlds, shards=num_shards))
    bounds = [round(k * num_worlds / num_shards) for k in range(num_shards + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(num_shards)]


def summarize(shards: Sequence[ShardStats], recorded: Sequence[pathlib.Path] = ()) -> ShardedRun:
    """Merges the shards' stats (``RunStats.merge``: latency percentiles over all their steps)."""
    stats = RunStats.merge([s.stats for s in shards])
    cpu = sum(s.cpu for s in shards)
    return ShardedRun(
        stats=stats,
        shards=list(shards),
        cpu_us_per_step=cpu / stats.steps * 1e6 if stats.steps else float("nan"),
        restarts=sum(s.restarts for s in shards),
        recorded=sorted(recorded),
    )


class ShardError(errors.DmEnvRpcClientError):
    """A shard of a sharded run failed; names the shard and its worlds.

    Attributes:
      shard: the shard's index.
      worlds: the indices of its worlds in the whole run.
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
        self._stop = threading.Event()
        options = dict(connect_options)
        credentials = options.pop("credentials", None)
        if credentials is not None:
            options["credentials"] = credentials()
        self._seed = None if seed is None else seed + worlds[0]  # world i: seed + i overall
        # (command, servers[, token]): this shard's own servers
        launched = options.pop("launch", None)
        self._servers = None
        if launched:
            token = launched[2] if len(launched) > 2 else None
            self._servers = launch(launched[0], launched[1], token=token)
        try:
            self._batch = BatchedEnvironment.connect(
                self._servers or addresses, len(addresses), seed=self._seed, **options
            )
        except BaseException:
            if self._servers is not None:
                self._servers.close()
            raise

    def progress(self) -> int:
        return self._received

    def update(self, count: int) -> None:  # the progress the stepping loop reports
        self._received += count

    def stop(self) -> None:
        self._stop.set()

    def run(self, steps: int, policy: Policy | None, pipeline: int, record: bool) -> ShardStats:
        folder = tempfile.TemporaryDirectory(prefix="dm_env_rpc_shard-") if record else None
        recording = (
            Recording(
                folder.name, len(self._worlds), self._batch.world_seeds, first_world=self._worlds[0]
            )
            if folder is not None
            else None
        )
        common: dict[str, Any] = {
            "steps": steps,
            "timeout": self._timeout,
            "recording": recording,
            "stop": self._stop,
            "progress": self.update,
            "first_world": self._worlds[0],  # restarts name worlds by their index in the run
        }
        cpu = time.process_time()
        try:
            stats = step(
                self._batch,
                policy=policy,
                pipeline=pipeline if policy is None else 1,
                seed=self._seed or 0,
                **common,
            )
        finally:
            if recording is not None:
                recording.close()  # unfinished episodes are kept, marked truncated
        cpu = time.process_time() - cpu
        recordings: dict[str, bytes] = {}
        if folder is not None and recording is not None:
            stats.recorded_episodes, stats.recorded_truncated = (
                recording.episodes,
                recording.truncated,
            )
            recordings = {p.name: p.read_bytes() for p in pathlib.Path(folder.name).glob("*.npz")}
            folder.cleanup()
        return ShardStats(
            shard=self._shard,
            worlds=list(self._worlds),
            stats=stats,
            cpu=cpu,
            restarts=sum(f.outcome == "restarted" for f in self._batch.failures),
            lost=sum(f.steps_lost for f in self._batch.failures),
            recordings=recordings,
        )

    def close(self) -> None:
        self._batch.close()
        if self._servers is not None:
            self._servers.close()


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
    stop: threading.Event | None = None,
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
        its random actions from a generator seeded from ``seed + i``.
      record: a new or empty folder: every shard's episodes are written there.
      create_world_settings: settings for every CreateWorldRequest.
      join_world_settings: settings for every JoinWorldRequest.
      timeout: seconds for each server answer and each step's response; also
        how long the shards may take to be placed and connect their worlds.
      credentials: a function returning ``grpc.ChannelCredentials`` for a TLS
        fleet, called in each shard (credential objects do not pickle).
      insecure: allow plaintext to non-loopback addresses (a fleet's servers
        listen on their node's IP; default True).
      connect_options: more keyword arguments for ``BatchedEnvironment.connect``
        (``metadata``: by default a ``ServerFleet``'s own, ``fleet.metadata``,
        which carries its token).
      num_cpus: CPUs reserved per shard (fractions allowed).
      progress: called in this process with the total steps received so far,
        about four times a second.
      stop: set it (from a signal handler, say) to end every shard between
        steps; what they did so far comes back, marked interrupted.

    Returns:
      The merged stats and each shard's (``ShardedRun``).

    Raises:
      FleetError: Ray is not initialized, or the fleet is closed or unreachable.
      ShardError: a shard could not connect its worlds or failed while
        stepping; names the shard, its worlds and the cause.
      RecordingError: ``record`` is not a new or empty folder.
      RequestTimeoutError: the shards were not placed and connected within ``timeout``.
      ValueError: a bad ``num_shards``, ``num_worlds`` or ``steps``.
    """
    if not ray.is_initialized():
        raise FleetError(_NOT_INITIALIZED)
    if steps < 0:
        raise errors.ArgumentValueError(f"steps must be 0 or more, not {steps}.")
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
    if options.get("metadata") is None and isinstance(source, ServerFleet):
        options["metadata"] = source.metadata  # the fleet's token
    shard_class = ray.remote(_Shard).options(
        num_cpus=num_cpus, max_concurrency=3, scheduling_strategy="SPREAD"
    )
    actors: list[Any] = [
        shard_class.remote(k, share, [addresses[w % len(addresses)] for w in share], seed, options)
        for k, share in enumerate(shares)
    ]
    try:
        # Every shard connects its worlds first, so they all start stepping at once.
        connected = [actor.progress.remote() for actor in actors]
        _, pending = ray.wait(connected, num_returns=len(connected), timeout=timeout)
        if pending:
            raise errors.RequestTimeoutError(
                _NOT_READY.format(
                    pending=len(pending),
                    count=len(actors),
                    timeout=timeout,
                    available=ray.available_resources(),
                )
            )
        _gather(actors, shares, connected, None, None)
        cumulative = [round(steps * (share[-1] + 1) / num_worlds) for share in shares]
        quotas = [b - a for a, b in zip([0, *cumulative[:-1]], cumulative, strict=True)]
        runs = [
            actor.run.remote(quota, policy, max(1, pipeline), folder is not None)
            for actor, quota in zip(actors, quotas, strict=True)
        ]
        stats = _gather(actors, shares, runs, progress, stop)
    finally:
        _close(actors, timeout)
    recorded = []
    if folder is not None:
        for shard in stats:
            for name, data in sorted(shard.recordings.items()):
                recorded.append(_write_atomically(folder / name, data))
    run = summarize(stats, recorded)
    if folder is not None:
        run.stats.recorded = str(folder)
    return run


def _gather(
    actors: list[Any],
    shares: list[list[int]],
    refs: list[Any],
    progress: Callable[[int], None] | None,
    stop: threading.Event | None,
) -> list[Any]:
    """Waits for one call per shard (polling progress meanwhile); a failure names its shard."""
    pending = list(refs)
    stopped = False
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL)
        if stop is not None and stop.is_set() and not stopped:
            stopped = True
            for actor in actors:
                actor.stop.remote()
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
