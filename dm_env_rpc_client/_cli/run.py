"""The ``run`` command's stepping loop and its summary (used by ``cli.py``).

``step_worlds(batch, ...)`` steps every world of a ``BatchedEnvironment`` with
random actions, pipelined, and returns a ``RunStats``:

- Reproducible: world ``i`` takes exactly its share of the steps
  (``steps // worlds``, one more for the first ``steps % worlds`` worlds), and
  draws its actions from a generator of its own, seeded from ``seed + i`` (a
  stream apart from the one its server gets). So the same command, against
  servers seeded the same way, plays the same steps whatever order the
  responses come back in.
- Variable-length actions are sent world by world when they do not stack.
- Each pass sends to the worlds that steps just came back from (and those not
  yet full): its cost follows the steps it handles, not the number of worlds;
  every world is looked at only at the start and after a failure.
- Ctrl-C or SIGTERM (``stop`` set) ends the loop between steps: what was received
  is counted and recorded, and ``interrupted`` is set.
- A stall raises ``RequestTimeoutError`` after ``timeout`` seconds without a
  step, naming every world that has steps in flight and its address.
- A world removed from the batch (its restarts failed) stops taking steps: its
  cut episode is recorded truncated, its unanswered steps are not sent again,
  and the other worlds go on. ``restarts`` and ``worlds_lost`` list the
  batch's failures.

``EpisodeTally`` is the accounting both stepping loops share (this one, and the
Ray shards' policy loop): episodes, returns, recording, removed worlds,
restarts. ``first_world`` names the worlds by their index in a larger run
(a shard's), in the restarts and in a stall's message.

``RunStats.merge`` sums several loops' statistics (several shards of one run);
latency percentiles come from every step's latency. ``summary`` is the one
dict both the table and ``--json`` print, and ``print_summary`` prints it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import errors
from ..batched import BatchedEnvironment, BatchedTimeStep
from ..launch import LaunchedServers, launch
from ..random_actions import random_action
from ..recording import Recording
from .args import check_launch_flags, token

ACTION_STREAM = 1  # world i's actions: numpy.random.default_rng((seed + i, ACTION_STREAM))
_SLICE = 0.25  # seconds between checks for a stop signal while waiting for steps
_STALLED = (
    "No step finished within {timeout} s. Waiting on: {waiting}. The server may be stopped, "
    "overloaded or unreachable; pass a longer --timeout if it is only slow."
)


@dataclasses.dataclass
class RunStats:
    """What one run (or one shard of it) did.

    Attributes:
      worlds: worlds stepped.
      steps: steps received.
      episodes: episodes that reached their LAST step.
      unfinished: episodes still running when the run stopped.
      returns: the return of every finished episode, world by world.
      latencies: each step's round trip in seconds (the latest ones per batch).
      elapsed: seconds from the first send to the last step (the longest shard).
      world_seeds: each world's seed, None where its server took none.
      recorded: the recording folder, if any.
      recorded_episodes: episode files written, truncated ones included.
      recorded_truncated: truncated episode files written.
      interrupted: the run was stopped by Ctrl-C or SIGTERM.
      restarts: "world i: old address -> new address (cause)" per world restarted after a failure.
      worlds_lost: worlds removed from the batch after failing (not restorable).
      relaunches: "server i (address): why; down S s; outcome" per launched server death.
    """

    worlds: int = 0
    steps: int = 0
    episodes: int = 0
    unfinished: int = 0
    returns: list[float] = dataclasses.field(default_factory=list)
    latencies: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    elapsed: float = 0.0
    world_seeds: list[int | None] = dataclasses.field(default_factory=list)
    recorded: str | None = None
    recorded_episodes: int = 0
    recorded_truncated: int = 0
    interrupted: bool = False
    restarts: list[str] = dataclasses.field(default_factory=list)
    worlds_lost: int = 0
    relaunches: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def merge(cls, parts: Sequence[RunStats]) -> RunStats:
        """One RunStats for several shards that ran side by side."""
        return cls(
            worlds=sum(p.worlds for p in parts),
            steps=sum(p.steps for p in parts),
            episodes=sum(p.episodes for p in parts),
            unfinished=sum(p.unfinished for p in parts),
            returns=[r for p in parts for r in p.returns],
            latencies=np.concatenate([p.latencies for p in parts]) if parts else np.zeros(0),
            elapsed=max((p.elapsed for p in parts), default=0.0),
            world_seeds=[s for p in parts for s in p.world_seeds],
            recorded=next((p.recorded for p in parts if p.recorded), None),
            recorded_episodes=sum(p.recorded_episodes for p in parts),
            recorded_truncated=sum(p.recorded_truncated for p in parts),
            interrupted=any(p.interrupted for p in parts),
            restarts=[r for p in parts for r in p.restarts],
            worlds_lost=sum(p.worlds_lost for p in parts),
            relaunches=[r for p in parts for r in p.relaunches],
        )


def _stack(actions: list[Any]) -> Any:
    first = actions[0]
    if isinstance(first, dict):
        return {key: _stack([a[key] for a in actions]) for key in first}
    return np.stack([np.asarray(a) for a in actions])


def _send(batch: BatchedEnvironment, ids: list[int], actions: list[Any]) -> list[int]:
    """Sends each world of ``ids`` its action; returns the worlds it sent to.

    A world removed from the batch since ``ids`` was chosen is refused by
    ``send``; it is left out (a stacked send sends nothing then, being all or
    nothing, and the loop chooses again).
    """
    try:
        stacked = _stack(actions)
    except ValueError:  # variable-length actions of different lengths: one world at a time
        sent = []
        for world, action in zip(ids, actions, strict=True):
            if send_unless_removed(batch, _stack([action]), [world]):
                sent.append(world)
        return sent
    return ids if send_unless_removed(batch, stacked, ids) else []


def send_unless_removed(batch: BatchedEnvironment, actions: Any, ids: Sequence[int]) -> bool:
    """``batch.send(actions, ids)``; False, with nothing sent, if one of them was removed.

    Raises:
      WorldError: a world of ``ids`` still in the batch refused the step.
    """
    try:
        batch.send(actions, ids)
    except errors.WorldError as error:
        if error.index in batch.live_ids:
            raise
        return False
    return True


def _stalled(
    batch: BatchedEnvironment, timeout: float, first_world: int
) -> errors.RequestTimeoutError:
    waiting = [
        f"world {first_world + world} at {batch.addresses[world]} "
        f"({batch.in_flight(world)} in flight)"
        for world in range(len(batch.envs))  # removed worlds too: len(batch) leaves them out
        if batch.in_flight(world)
    ]
    return errors.RequestTimeoutError(
        _STALLED.format(timeout=timeout, waiting="; ".join(waiting) or "nothing")
    )


def recv_until_stopped(
    batch: BatchedEnvironment, timeout: float, stop: threading.Event, first_world: int = 0
) -> BatchedTimeStep | None:
    """The next finished steps, or None once ``stop`` is set.

    Raises:
      RequestTimeoutError: no step finished within ``timeout``; names the worlds waited on.
      WorldError: a world failed (or was removed, with nothing else in flight).
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return batch.recv(1, timeout=max(0.0, min(_SLICE, left)))
        except errors.RequestTimeoutError:
            if stop.is_set():
                return None
            if left <= _SLICE:
                raise _stalled(batch, timeout, first_world) from None


def step_worlds(
    batch: BatchedEnvironment,
    *,
    steps: int,
    pipeline: int,
    timeout: float,
    seed: int,
    recording: Recording | None = None,
    stop: threading.Event | None = None,
    progress: Any = None,
    first_world: int = 0,
) -> RunStats:
    """Steps every world with random actions; see the module docs.

    Args:
      batch: the worlds.
      steps: total steps over all worlds.
      pipeline: steps in flight per world.
      timeout: seconds without any finished step before giving up.
      seed: world ``i``'s actions come from ``default_rng((seed + i, ACTION_STREAM))``.
      recording: where to record the episodes (closed by the caller).
      stop: set it (from a signal handler) to end the run between steps.
      progress: a tqdm-like bar (``update(n)``), or None.
      first_world: the index of world 0 in the whole run (a shard's first world).

    Raises:
      RequestTimeoutError: no step finished within ``timeout``; names the worlds.
      WorldError: a world failed (under ``on_world_failure="raise"``).
    """
    stop = stop or threading.Event()
    count = len(batch.envs)  # every world; a removed one stops taking steps
    spec = batch.action_spec()
    rngs = [np.random.default_rng((seed + world, ACTION_STREAM)) for world in range(count)]
    left = [steps // count + (world < steps % count) for world in range(count)]
    stats = RunStats(worlds=count, world_seeds=list(batch.world_seeds))
    tally = EpisodeTally(batch, stats, recording, in_episode=False, first_world=first_world)
    # The worlds that may take a step: every world at first, then those a step came back
    # from (or not yet full): each pass costs what it sends and receives, not the batch's size.
    wanting = set(range(count))
    live: set[int] = set()
    failures = -1  # len(batch.failures) when ``live`` was taken
    started = time.perf_counter()
    while stats.steps < steps and not stop.is_set():
        if len(batch.failures) != failures or count - len(live) > len(tally.removed):
            # A world failed (or a removed one is not let go of yet): look at every world.
            failures, live = len(batch.failures), set(batch.live_ids)
            for world in tally.let_go_of_removed(live):
                left[world] = 0
        ids = sorted(w for w in wanting if left[w] and w in live and batch.in_flight(w) < pipeline)
        wanting.clear()
        sent: set[int] = set()
        if ids:
            actions = [random_action(spec, rngs[world]) for world in ids]
            sent = set(_send(batch, ids, actions))
            for world, action in zip(ids, actions, strict=True):
                if world in sent:
                    tally.sent[world].append(action)
                    left[world] -= 1
                if world not in sent or batch.in_flight(world) < pipeline:
                    wanting.add(world)  # not sent (removed meanwhile), or room for more
        if not sent and not batch.pending():  # (a step just sent is pending)
            # Every step sent; the rest were lost with a restarted or removed world
            # (batch.failures), or every world that could still step is gone.
            break
        try:
            result = recv_until_stopped(batch, timeout, stop, first_world)
        except errors.WorldError as error:
            if error.index in batch.live_ids:
                raise
            continue  # a world was removed: the loop above lets it go
        if result is None:
            break
        tally.take(result, progress)
        wanting.update(result.env_ids.tolist())
    tally.finish(time.perf_counter() - started, interrupted=stop.is_set())
    return stats


class EpisodeTally:
    """Counts received steps into a ``RunStats``: episodes, returns, recording, failures.

    The one accounting of both stepping loops (random actions here, a policy on
    the Ray shards). ``sent[world]`` holds the actions sent to each world, oldest
    first; ``take`` pairs each received step with its action. ``first_world`` is
    the index of world 0 in the whole run, for the restarts' listing.
    """

    def __init__(
        self,
        batch: BatchedEnvironment,
        stats: RunStats,
        recording: Recording | None,
        *,
        in_episode: bool,
        first_world: int = 0,
    ) -> None:
        count = len(batch.envs)
        self.batch, self.stats, self.recording = batch, stats, recording
        self.first_world = first_world
        self.sent: list[collections.deque[Any]] = [collections.deque() for _ in range(count)]
        self.running = np.zeros(count)
        self.in_episode = [in_episode] * count
        self.returns: list[list[float]] = [[] for _ in range(count)]
        self.removed: set[int] = set()

    def let_go_of_removed(self, live: set[int]) -> list[int]:
        """Lets go of the worlds removed from the batch since the last call; returns them.

        A world is let go of once it is out of ``live`` and the batch has
        handed over all it had (its steps received before the removal are
        counted like any other). Its episode was cut: it is recorded truncated
        and not counted as unfinished; its unanswered steps are forgotten (no
        server answers them, and they are not sent again).
        """
        gone = [
            w
            for w in range(len(self.sent))
            if w not in live and w not in self.removed and not self.batch.in_flight(w)
        ]
        for world in gone:
            self.removed.add(world)
            self.in_episode[world] = False
            self.sent[world].clear()
            if self.recording is not None:
                self.recording.truncate(world)
        return gone

    def take(self, result: BatchedTimeStep, progress: Any = None) -> None:
        """Counts (and records) every step of ``result``."""
        sent, in_episode, running = self.sent, self.in_episode, self.running
        actions: list[Any] = []
        for position, world in enumerate(result.env_ids):
            if result.truncated is not None and result.truncated[position]:
                # Restarted: this FIRST step answers every step the world had in flight
                # (the others are counted in the failure's steps_lost, not sent again).
                for _ in range(_steps_lost(self.batch, world) - 1):
                    sent[world].popleft()
                in_episode[world] = False
            action = sent[world].popleft()
            step_type = int(result.step_type[position])
            if step_type == 0:
                running[world], in_episode[world] = 0.0, True
            else:
                running[world] += result.reward[position]
            if step_type == 2 and in_episode[world]:
                self.returns[world].append(float(running[world]))
                self.stats.episodes += 1
                in_episode[world] = False
            actions.append(None if step_type == 0 else action)
        if self.recording is not None:
            self.recording.add_batch(result, actions)
        self.stats.steps += len(result.env_ids)
        if progress is not None:
            progress.update(len(result.env_ids))

    def finish(self, elapsed: float, *, interrupted: bool) -> None:
        """Fills the run's totals: time, unfinished episodes, returns (by world), latencies,
        restarts and worlds lost."""
        stats = self.stats
        stats.elapsed = elapsed
        stats.interrupted = interrupted
        stats.unfinished = sum(self.in_episode)
        stats.returns = [r for world_returns in self.returns for r in world_returns]
        stats.latencies = np.asarray(self.batch.latencies, dtype=np.float64)
        failures = self.batch.failures
        stats.restarts = [
            f"world {self.first_world + f.index}: {f.address} -> {f.new_address} "
            f"({type(f.cause).__name__})"
            for f in failures
            if f.outcome == "restarted"
        ]
        stats.worlds_lost = sum(f.outcome == "removed" for f in failures)
        stats.relaunches = [
            f"server {r.index} ({r.address}): {r.reason.split(';')[0]}, down {r.downtime:.2f} s, "
            f"{r.outcome}"
            for r in self.batch.relaunches
        ]


def launched(args: Any) -> LaunchedServers | None:
    """The servers of ``run --launch`` (started here; None without ``--launch``).

    Raises:
      UsageError: launch flags that do not go together.
      ServerLaunchError, ValueError: from ``dmr.launch``.
    """
    check_launch_flags(args)
    if not args.launch:
        return None
    return launch(
        args.launch,
        args.num_servers or 1,
        ready_timeout=max(60.0, args.timeout),
        token=token(args),
    )


def _steps_lost(batch: BatchedEnvironment, world: int) -> int:
    """How many steps the latest restart of ``world`` answered with its FIRST step."""
    failure = batch._latest_failure(world)
    return max(1, failure.steps_lost) if failure is not None else 1


def summary(stats: RunStats) -> dict[str, Any]:
    """The run's summary as one flat dict (the ``--json`` object; the table shows the same)."""
    returns = stats.returns
    latencies_ms = stats.latencies * 1e3

    def rounded(value: Any, digits: int = 3) -> float | None:
        return None if value is None else round(float(value), digits)

    return {
        "worlds": stats.worlds,
        "steps": stats.steps,
        "episodes": stats.episodes,
        "unfinished_episodes": stats.unfinished,
        "return_mean": rounded(np.mean(returns)) if returns else None,
        "return_min": rounded(min(returns)) if returns else None,
        "return_max": rounded(max(returns)) if returns else None,
        "steps_per_second": rounded(stats.steps / stats.elapsed, 1) if stats.elapsed else None,
        "latency_p50_ms": rounded(np.percentile(latencies_ms, 50)) if latencies_ms.size else None,
        "latency_p99_ms": rounded(np.percentile(latencies_ms, 99)) if latencies_ms.size else None,
        "world_seeds": stats.world_seeds,
        "recorded_to": stats.recorded,
        "recorded_episodes": stats.recorded_episodes,
        "recorded_truncated": stats.recorded_truncated,
        "restarts": stats.restarts,
        "worlds_lost": stats.worlds_lost,
        "relaunches": stats.relaunches,
        "interrupted": stats.interrupted,
    }


def _seeds_text(seeds: list[int | None]) -> str:
    if not seeds or all(seed is None for seed in seeds):
        return "none"
    if all(seed is not None for seed in seeds) and len(seeds) > 1:
        return f"{seeds[0]} to {seeds[-1]} (world i: {seeds[0]} + i)"
    return ", ".join("none" if seed is None else str(seed) for seed in seeds)


def print_summary(stats: RunStats, *, as_json: bool = False) -> None:
    """Prints the summary: a table, or one JSON object with ``as_json``."""
    data = summary(stats)
    if as_json:
        print(json.dumps(data), flush=True)
        return

    def number(key: str, digits: int = 3) -> str:
        value = data[key]
        return "n/a" if value is None else f"{value:.{digits}f}"

    rows = [
        ("worlds", str(data["worlds"])),
        ("steps", str(data["steps"])),
        ("episodes", str(data["episodes"])),
        ("unfinished", str(data["unfinished_episodes"])),
        ("return mean", number("return_mean")),
        ("return min", number("return_min")),
        ("return max", number("return_max")),
        ("steps/s", number("steps_per_second", 1)),
        ("latency p50 ms", number("latency_p50_ms")),
        ("latency p99 ms", number("latency_p99_ms")),
        ("world seeds", _seeds_text(data["world_seeds"])),
    ]
    if data["recorded_to"] is not None:
        rows.append(
            (
                "recorded to",
                f"{data['recorded_to']} ({data['recorded_episodes']} episodes, "
                f"{data['recorded_truncated']} of them truncated)",
            )
        )
    if data["restarts"] or data["worlds_lost"]:
        listed = "; ".join(data["restarts"]) or "none"
        rows.append(("restarts", f"{len(data['restarts'])} ({listed})"))
        rows.append(("worlds lost", str(data["worlds_lost"])))
    if data["relaunches"]:
        rows.append(("relaunches", f"{len(data['relaunches'])} ({'; '.join(data['relaunches'])})"))
    if data["interrupted"]:
        rows.append(("interrupted", "yes (Ctrl-C or SIGTERM)"))
    print("\n".join(f"{label:<16}{value}" for label, value in rows), flush=True)
