"""A run's statistics (``RunStats``) and the accounting that fills them (``EpisodeTally``).

``EpisodeTally`` counts every received step into a ``RunStats``: episodes,
returns, recording, removed worlds, restarts. ``sent[world]`` holds the actions
sent to each world, oldest first; ``take`` pairs each received step with its
action. ``first_world`` names the worlds by their index in a larger run (a Ray
shard's), in the restarts' listing.

``RunStats.merge`` sums several loops' statistics (several shards of one run);
latency percentiles come from every step's latency.

A run can go on where another stopped (``dmr.collect(resume=stats)``): the
tally then starts from the other's ``Carry`` (each world's running episode and
return, its steps still in flight, the worlds let go of) instead of from nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._adaptor.stacked import unstack
from ..batched import BatchedEnvironment, BatchedTimeStep
from ..recording import Recording


@dataclasses.dataclass
class RunStats:
    """What one run (or one shard of it) did: ``dmr.collect``'s result.

    Attributes:
      worlds: worlds stepped.
      steps: steps received (with a policy, the FIRST steps of the opening reset not counted).
      episodes: episodes that reached their LAST step.
      unfinished: episodes still running when the run stopped.
      returns: the return of every finished episode, world by world.
      latencies: each step's round trip in seconds, this run's (the batch keeps its latest
        100,000).
      elapsed: seconds from the first send to the last step (the longest shard).
      world_seeds: each world's seed, None where its server took none.
      recorded: the recording folder, if any (filled by the caller that closes it).
      recorded_episodes: episode files written, truncated ones included (likewise).
      recorded_truncated: truncated episode files written (likewise).
      interrupted: the run was stopped (``stop`` set: Ctrl-C or SIGTERM on the command line).
      restarts: "world i: old address -> new address (cause)" per world restarted after a failure.
      worlds_lost: worlds removed from the batch after failing (not restorable).
      relaunches: "server i (address): why; down S s; outcome" per launched server death.
      waiting: with a policy, the steps that got no action when the run ended (a world's
        steps spent, or the run stopped), one per world, as the policy would have got them:
        where ``collect(resume=stats)`` goes on from. None if there are none.
      carry: what else ``collect(resume=stats)`` needs to go on where this run stopped
        (each world's running episode and return, steps in flight, worlds let go of).
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
    waiting: BatchedTimeStep | None = dataclasses.field(default=None, compare=False)
    carry: Carry | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def merge(cls, parts: Sequence[RunStats]) -> RunStats:
        """One RunStats for several shards that ran side by side.

        Args:
          parts: the shards' statistics, in world order.

        Returns:
          Their sums (steps, episodes, returns, ...); ``elapsed`` is the longest shard's.
          (No ``waiting`` or ``carry``: shards are not resumed as one run.)
        """
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


@dataclasses.dataclass
class Carry:
    """What a run hands to the one that resumes it (besides ``RunStats.waiting``).

    Attributes:
      in_episode: per world, whether it is inside an episode it will finish.
      running: per world, the return so far of that episode.
      sent: per world, the actions of its steps still in flight, oldest first.
      removed: the worlds let go of (removed from the batch).
      policy: the run was a policy's (not random actions).
    """

    in_episode: list[bool]
    running: np.ndarray
    sent: list[collections.deque[Any]]
    removed: set[int]
    policy: bool = False


_POP = collections.deque.popleft


class EpisodeTally:
    """Counts received steps into a ``RunStats``: episodes, returns, recording, failures.

    Args:
      batch: the worlds.
      stats: filled in place.
      recording: where received steps are recorded, or None.
      in_episode: the worlds start inside an episode (after a reset).
      first_world: the index of world 0 in the whole run, for the restarts' listing.
      carry: go on from the run that left this (``in_episode`` is then ignored).
    """

    def __init__(
        self,
        batch: BatchedEnvironment,
        stats: RunStats,
        recording: Recording | None,
        *,
        in_episode: bool,
        first_world: int = 0,
        carry: Carry | None = None,
    ) -> None:
        count = len(batch.envs)
        self.batch, self.stats, self.recording = batch, stats, recording
        self.first_world = first_world
        self.returns: list[list[float]] = [[] for _ in range(count)]
        if carry is None:
            carry = Carry([in_episode] * count, np.zeros(count), [], set())
            carry.sent = [collections.deque() for _ in range(count)]
        self.sent, self.running = carry.sent, carry.running.copy()
        self.in_episode, self.removed = list(carry.in_episode), set(carry.removed)

    def carry(self) -> Carry:
        """What a run that resumes this one starts from."""
        return Carry(list(self.in_episode), self.running.copy(), self.sent, set(self.removed))

    def let_go_of_removed(self, live: set[int]) -> list[int]:
        """Lets go of the worlds removed from the batch since the last call.

        A world is let go of once it is out of ``live`` and the batch has
        handed over all it had (its steps received before the removal are
        counted like any other). Its episode was cut: it is recorded truncated
        and not counted as unfinished; its unanswered steps are forgotten (no
        server answers them, and they are not sent again).

        Args:
          live: the batch's ``live_ids``.

        Returns:
          The worlds let go of by this call.
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

    def sent_stacked(self, worlds: list[int], actions: Any) -> None:
        """``actions`` (stacked, in the order of ``worlds``) were sent: each world's joins its
        ``sent`` (the action itself only when recording; else a placeholder, never read)."""
        per_world = unstack(actions, len(worlds)) if self.recording is not None else None
        deques = map(self.sent.__getitem__, worlds)
        if per_world is None:
            for queue in deques:
                queue.append(None)
        else:
            for queue, action in zip(deques, per_world, strict=True):
                queue.append(action)

    def take(
        self, result: BatchedTimeStep, progress: Callable[[int], Any] | None = None
    ) -> dict[int, int]:
        """Counts (and records) every step of ``result``.

        Args:
          result: steps received, each answering the oldest action in ``sent``.
          progress: called with the number of steps counted, or None.

        Returns:
          For each restarted world, the steps it had in flight that no server
          answered and this result does not count (its FIRST step answers the
          oldest of them): the caller sends that many more, so the run still
          takes all its steps.
        """
        worlds = result.env_ids.tolist()
        if len(set(worlds)) == len(worlds) and (
            result.truncated is None or not result.truncated.any()
        ):
            self._take_apart(result, worlds, progress)  # (the usual batch, in NumPy calls)
            return {}
        return self._take_each(result, worlds, progress)

    def _take_each(
        self, result: BatchedTimeStep, worlds: list[int], progress: Callable[[int], Any] | None
    ) -> dict[int, int]:
        """``take``, step by step (a world twice in ``result``, or a restart's FIRST step)."""
        sent, in_episode, running = self.sent, self.in_episode, self.running
        actions: list[Any] = []
        dropped: dict[int, int] = {}
        unasked = 0  # FIRST steps that answer no step sent (``_batch.agents._file_firsts``)
        for position, world in enumerate(worlds):
            if result.truncated is not None and result.truncated[position]:
                # Restarted: this FIRST step answers every step the world had in flight
                # (the others are counted in the failure's steps_lost, and made up).
                answered = _steps_lost(self.batch, world)
                for _ in range(answered - 1):
                    sent[world].popleft()
                if answered > 1:
                    dropped[world] = dropped.get(world, 0) + answered - 1
                in_episode[world] = False
                unasked += not answered
            else:
                answered = 1
            action = sent[world].popleft() if answered else None
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
        self.stats.steps += len(actions) - unasked
        if progress is not None:
            progress(len(actions) - unasked)
        return dropped

    def _take_apart(
        self, result: BatchedTimeStep, worlds: list[int], progress: Callable[[int], Any] | None
    ) -> None:
        """``take`` for a batch of one step per world and no restart: what ``_take_each`` does,
        with a few NumPy calls for all the steps (a world's return adds the same float64s in the same
        order), and a Python loop over the episodes that start or end only."""
        sent, in_episode, running = self.sent, self.in_episode, self.running
        actions = list(map(_POP, map(sent.__getitem__, worlds)))
        ids, kinds = result.env_ids, np.asarray(result.step_type)
        first, last = kinds == 0, kinds == 2
        running[ids[first]] = 0.0
        for world in ids[first].tolist():
            in_episode[world] = True
        going = ~first
        running[ids[going]] += np.asarray(result.reward)[going]
        for world in ids[last].tolist():
            if in_episode[world]:
                self.returns[world].append(float(running[world]))
                self.stats.episodes += 1
                in_episode[world] = False
        if self.recording is not None:
            kinds_list = kinds.tolist()
            actions = [None if k == 0 else a for k, a in zip(kinds_list, actions, strict=True)]
            self.recording.add_batch(result, actions)
        self.stats.steps += len(worlds)
        if progress is not None:
            progress(len(worlds))

    def finish(self, elapsed: float, *, interrupted: bool) -> None:
        """Fills the run's totals: time, unfinished episodes, returns (by world), latencies,
        restarts and worlds lost.

        Args:
          elapsed: seconds the run took.
          interrupted: the run was stopped before its steps were done.
        """
        stats = self.stats
        stats.elapsed = elapsed
        stats.interrupted = interrupted
        stats.carry = self.carry()
        stats.unfinished = sum(self.in_episode)
        stats.returns = [r for world_returns in self.returns for r in world_returns]
        # This run's steps only (a resumed run's batch has those of the runs before, too),
        # and without copying the batch's 100,000 kept latencies for a short run.
        kept = self.batch.latencies
        count = min(stats.steps, len(kept))
        stats.latencies = np.fromiter(itertools.islice(reversed(kept), count), np.float64, count)[
            ::-1
        ].copy()
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


def _steps_lost(batch: BatchedEnvironment, world: int) -> int:
    """How many steps the latest restart of ``world`` answered with its FIRST step (0: an
    agent of a multi-agent world that had none in flight)."""
    per_slot = getattr(batch, "_answered_by_first", None)  # a multi-agent world's agent slot
    if per_slot is not None:
        return int(per_slot(world))
    failure = batch._latest_failure(world)
    return max(1, failure.steps_lost) if failure is not None else 1
