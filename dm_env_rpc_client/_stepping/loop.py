"""The one stepping loop: random actions or a policy, pipelined, counted, recorded, watched.

``step(batch, ...)`` steps every world of a ``BatchedEnvironment`` until
``steps`` steps came back, and returns a ``RunStats`` (``dmr.collect`` is its
public face; the command line's ``run``, the Ray shards, the RLlink client and
``bench/`` call it):

- Random actions (``policy=None``) are reproducible: world ``i`` takes exactly
  its share of the steps (``steps // worlds``, one more for the first
  ``steps % worlds`` worlds), and draws its actions from a generator of its
  own, seeded from ``seed + i`` (a stream apart from the one its server gets).
  So the same call, against servers seeded the same way, plays the same steps
  whatever order the responses come back in. Each pass tops every world it
  sends to up to ``pipeline`` steps in flight (in rounds, one send), and waits
  for half of those in flight. A small fixed-shape action spec's are drawn 32 at
  a time per world and taken stacked (``_stepping.blocks``); variable-length
  actions are sent world by world when they do not stack. With nothing of the
  caller's per pass (no recording, progress or observers), the run steps from
  the batch's loop thread (``_stepping.receive``).
- A policy: every world is reset first, then ``policy(timestep)`` gives the
  actions of the worlds of each batch of steps received (one step in flight per
  world); the steps are shared, so a world that answers sooner takes more.
- ``steps`` may instead give each world its count: world ``i`` takes exactly
  ``steps[i]`` (a policy's too). A world with none left keeps its last step in
  ``RunStats.waiting``, unanswered.
- ``resume=stats`` goes on where that run stopped: no reset; a policy acts
  first on ``stats.waiting``; steps it left in flight are received; episodes
  running across the two runs count once, whole, in the run they end in.
- Each pass sends to the worlds that steps just came back from (and, with
  random actions, those not yet full): its cost follows the steps it handles,
  not the number of worlds; every world is looked at only at the start and
  after a failure.
- ``stop`` set (Ctrl-C or SIGTERM) ends the loop between steps: what was
  received is counted and recorded, and ``interrupted`` is set.
- A stall raises ``RequestTimeoutError`` after ``timeout`` seconds without a
  step, naming every world that has steps in flight and its address.
- A world restarted (its server died, or was relaunched) has its steps that
  were in flight answered by one FIRST step (truncating its episode); the
  others are sent again, so the run still takes exactly ``steps`` steps.
- A world removed from the batch (its restarts failed) stops taking steps: its
  cut episode is recorded truncated, its unanswered steps are not sent again,
  and the other worlds go on. ``restarts`` and ``worlds_lost`` list the
  batch's failures.
- A multi-agent batch (``dmr.MultiAgentBatch``: ``num_agents`` slots per world)
  steps whole worlds: a world's agents are always sent their steps together (a
  lockstep server answers none of them until every one has acted), ``steps``
  counts agent-steps and is rounded up to whole world steps, and a stopped run
  receives the world steps still in flight before it returns. So a run never
  leaves an agent waiting at its world's barrier: at its end nothing is in
  flight and every agent of a world has taken the same steps.
- Observers get every received batch (``on_steps``, before actions are chosen
  for it) and the run's restarts, relaunches, lost worlds and the error that
  ends it (``on_event``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import errors
from .._adaptor.stacked import unstack
from ..batched import BatchedEnvironment, BatchedTimeStep
from ..random_actions import action_drawer
from ..recording import Recording
from . import blocks as _blocks
from . import receive as _receive
from .events import RunObserver, Watch
from .receive import recv_until_stopped, stalled
from .tally import EpisodeTally, RunStats
from .timesteps import drop_worlds, join, rows

ACTION_STREAM = 1  # world i's actions: numpy.random.default_rng((seed + i, ACTION_STREAM))
# Each pass waits for this share of the steps in flight (at most one SLICE, then takes what
# came): taking steps one or a few at a time cost a recv, a decode and a send per handful of
# steps (about 25 µs per step more than a quarter at 1,024 worlds); with each world's pipeline
# topped up every pass, half cost less CPU per step than a quarter and stepped faster, from
# 1 x 2 agents to 64 x 4 (issue 36).
RECV_SHARE = 2

Policy = Callable[[BatchedTimeStep], Mapping[str, Any]]
_REMOVED = object()  # recv raised for a world removed meanwhile
PASS, DRAIN = "pass", "drain"  # what _Loop.passes asks its driver to receive


def step(
    batch: BatchedEnvironment,
    *,
    steps: int | Sequence[int],
    policy: Policy | None = None,
    pipeline: int = 1,
    seed: int = 0,
    timeout: float,
    recording: Recording | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[int], Any] | None = None,
    observers: Sequence[RunObserver] = (),
    first_world: int = 0,
    resume: RunStats | None = None,
) -> RunStats:
    """Steps every world; see the module docs.

    Args:
      batch: the worlds.
      steps: total steps over all worlds, or each world's count.
      policy: ``policy(timestep) -> actions`` for the worlds of ``timestep.env_ids``;
        None for random actions.
      pipeline: steps in flight per world (1 with a policy).
      seed: with random actions, world ``i``'s come from ``default_rng((seed + i, ACTION_STREAM))``.
      timeout: seconds without any finished step before giving up (and for a policy's reset).
      recording: where to record the episodes (closed by the caller).
      stop: set it (from a signal handler) to end the run between steps.
      progress: called with the number of steps of each batch received, or None.
      observers: told of every batch received and of the run's events.
      first_world: the index of world 0 in the whole run (a shard's first world).
      resume: a run of this batch (and this kind: random actions or a policy) to go on from.

    Returns:
      What the run did.

    Raises:
      RequestTimeoutError: no step finished within ``timeout``; names the worlds.
      WorldError: a world failed (under ``on_world_failure="raise"``).
    """
    watch = Watch(batch, observers, first_world)
    loop = _Loop(
        batch, steps, policy, pipeline, seed, timeout, recording, stop, progress, watch, resume
    )
    try:
        if _receive.on_loop(batch, policy, recording, progress, observers):
            assert batch._runner is not None
            return _receive.wait_on_loop(batch._runner, loop.run_on_loop())
        return loop.run()
    except Exception as error:
        watch.error(error)
        raise


class _Loop:
    def __init__(
        self,
        batch: BatchedEnvironment,
        steps: int | Sequence[int],
        policy: Policy | None,
        pipeline: int,
        seed: int,
        timeout: float,
        recording: Recording | None,
        stop: threading.Event | None,
        progress: Callable[[int], Any] | None,
        watch: Watch,
        resume: RunStats | None = None,
    ) -> None:
        count = len(batch.envs)  # every world; a removed one stops taking steps
        # Slots that step together: a multi-agent world's agents (see the module docs).
        self.group = group = int(getattr(batch, "num_agents", 1))
        if isinstance(steps, int):
            steps = -(-steps // group) * group
        total = steps if isinstance(steps, int) else sum(steps)
        self.batch, self.steps, self.policy, self.pipeline = batch, total, policy, pipeline
        self.timeout, self.recording, self.progress, self.watch = (
            timeout,
            recording,
            progress,
            watch,
        )
        self.stop = stop or threading.Event()
        self.stats = RunStats(worlds=count, world_seeds=list(batch.world_seeds))
        self.tally = EpisodeTally(
            batch,
            self.stats,
            recording,
            in_episode=policy is not None,
            first_world=watch.first_world,
            carry=None if resume is None else resume.carry,
        )
        # Random actions: each world its share. A policy: one budget shared by every world,
        # unless ``steps`` gives each world its count.
        self.left: list[int] | None = None if isinstance(steps, int) else list(steps)
        self.requested = 0
        self.blocks: _blocks.ActionBlocks | None = None
        self.mixed = False  # agents whose action specs differ: drawn and sent one by one
        if policy is None:
            if self.left is None:
                worlds, rounds = count // group, total // group
                shares = [rounds // worlds + (world < rounds % worlds) for world in range(worlds)]
                self.left = [shares[slot // group] for slot in range(count)]
            # Each agent draws from its own spec (a multi-agent world's agents may differ).
            agent_specs = [batch.envs[agent].action_spec() for agent in range(group)]
            self.spec = agent_specs[0]
            self.mixed = any(spec != self.spec for spec in agent_specs[1:])
            drawers = [action_drawer(spec) for spec in agent_specs]  # random_action's, once
            self.draws = [drawers[slot % group] for slot in range(count)]
            self.rngs = [np.random.default_rng((seed + w, ACTION_STREAM)) for w in range(count)]
            # Drawn a block at a time and taken stacked, where the spec allows (_stepping.blocks)
            # and every agent shares it.
            if not self.mixed and _blocks.applies(self.spec):
                self.blocks = _blocks.ActionBlocks(self.spec, self.rngs)
        # The worlds that may take a step (random actions): every world at first, then those
        # a step came back from (or not yet full). A policy's: the worlds of ``ready``.
        self.wanting = set(range(count)) if policy is None else set()
        self.ready: BatchedTimeStep | None = None if resume is None else resume.waiting
        self.resumed = resume is not None
        self.parked: list[BatchedTimeStep] = []  # a policy's steps left without an action
        self.live: set[int] = set()
        self.failures = -1  # len(batch.failures) when ``live`` was taken; -1: take it again

    def run(self) -> RunStats:
        """The run, its receives waited for on this thread."""
        passes = self.passes()
        try:
            request = next(passes)
            while True:
                request = passes.send(self._receive(*request))
        except StopIteration as end:
            return end.value  # type: ignore[no-any-return]

    async def run_on_loop(self) -> RunStats:
        """The run, its receives waited for on the batch's loop (``_stepping.receive``)."""
        batch, stop, first = self.batch, self.stop, self.watch.first_world
        passes = self.passes()
        try:
            request = next(passes)
            while True:
                kind, count = request
                got: object
                if kind == DRAIN:
                    got = await _receive.take_on_loop(batch, count, self.timeout, first)
                else:
                    try:
                        got = await _receive.recv_on_loop(batch, self.timeout, stop, first, count)
                    except errors.WorldError as error:
                        got = self.removed_or_raise(error)
                request = passes.send(got)
        except StopIteration as end:
            return end.value  # type: ignore[no-any-return]

    def _receive(self, kind: str, count: int) -> object:
        """What ``passes`` asks for (see there), waited for on this thread."""
        if kind == PASS:
            return self._recv(count)
        try:
            return self.batch.recv(count, timeout=self.timeout)
        except errors.RequestTimeoutError:
            raise stalled(self.batch, self.timeout, self.watch.first_world) from None

    def passes(self) -> Generator[tuple[str, int], object, RunStats]:
        """The run, its passes' receives left to the driver: it yields ``(PASS, wanted)`` for
        ``_recv``'s outcome (up to ``wanted`` steps), ``(DRAIN, count)`` for ``count`` steps
        (at most ``timeout`` waited, then ``stalled``), and returns the stats. ``run`` drives
        it from the caller's thread, ``_stepping.on_loop`` from the batch's loop."""
        started = time.perf_counter()
        if self.policy is not None and not self.resumed:
            self._reset()
        stats, batch, stop, tally, watch = self.stats, self.batch, self.stop, self.tally, self.watch
        send = self._send_random if self.policy is None else self._send_chosen
        count, failures, removed = len(batch.envs), batch.failures, tally.removed
        observed = bool(watch.observers)
        # Each pass costs what it sends and receives: a look at every world only after a failure.
        while stats.steps < self.steps and not stop.is_set():
            if len(failures) != self.failures or count - len(self.live) > len(removed):
                self._look()
            if observed:
                watch.poll()
            sent = send()
            if sent is None:
                continue  # a world was removed meanwhile: choose again without it
            if not sent and not batch.pending():  # (a step just sent is pending)
                # Every step sent; the rest were lost with a restarted or removed world
                # (batch.failures), or every world that could still step is gone.
                break
            result = yield PASS, batch.pending() // RECV_SHARE
            if result is _REMOVED:
                continue  # the next pass lets the removed world go
            if result is None:
                break  # stopped
            assert isinstance(result, BatchedTimeStep)
            # Steps a restart dropped (in flight to a dead server) are made up: sent again.
            for world, lost in tally.take(result, self.progress).items():
                if self.left is not None:
                    self.left[world] += lost
                else:
                    self.requested -= lost
            if observed:
                watch.steps(result)
            if self.policy is None:
                self.wanting.update(result.env_ids.tolist())
            else:
                if self.group > 1 and result.truncated is not None and result.truncated.any():
                    self._supersede(result)
                self.ready = result if self.ready is None else join([self.ready, result])
        if self.group > 1 and stop.is_set():
            yield from self._drain()
        watch.poll()
        tally.finish(time.perf_counter() - started, interrupted=stop.is_set())
        assert stats.carry is not None
        stats.carry.policy = self.policy is not None
        if self.policy is not None:
            stats.waiting = join([*self.parked, *([self.ready] if self.ready is not None else [])])
        return stats

    def _drain(self) -> Generator[tuple[str, int], object, None]:
        """A stopped multi-agent run takes the whole world steps still in flight (each barrier
        completes: every agent of the world was sent its step), so none is left waiting."""
        batch = self.batch
        while batch.pending():
            result = yield DRAIN, batch.pending()
            assert isinstance(result, BatchedTimeStep)
            self.tally.take(result, self.progress)
            self.watch.steps(result)

    def _whole(self, slots: list[int]) -> list[int]:
        """The slots of ``slots`` whose world's agents are all there, by world (all of them
        outside a multi-agent batch)."""
        group = self.group
        if group == 1:
            return slots
        there = set(slots)
        agents_there = collections.Counter(slot // group for slot in there)
        return sorted(slot for slot in there if agents_there[slot // group] == group)

    def _reset(self) -> None:
        first = self.batch.reset(timeout=self.timeout)
        if self.recording is not None:
            for position, world in enumerate(first.env_ids.tolist()):
                self.recording.add(world, None, first.at(position))
        self.watch.steps(first)
        self.ready = first

    def _look(self) -> None:
        """After a failure (or while a removed world is not let go of): looks at every world."""
        self.failures, self.live = len(self.batch.failures), set(self.batch.live_ids)
        for world in self.tally.let_go_of_removed(self.live):
            if self.left is not None:
                self.left[world] = 0

    def _send_random(self) -> list[int] | None:
        """Sends random actions to the worlds that want them; returns the worlds sent to."""
        batch, left, live, pipeline = self.batch, self.left, self.live, self.pipeline
        assert left is not None
        in_flight = batch.in_flight
        # Each world that may step: the steps it has room for (one look at it before the send).
        room = {w: min(pipeline - in_flight(w), left[w]) for w in self.wanting if w in live}
        able = sorted(w for w, n in room.items() if n > 0)
        ids = self._whole(able)
        self.wanting.clear()
        if len(ids) < len(able):  # agents whose world's others cannot step yet: later
            self.wanting.update(set(able) - set(ids))
        if not ids:
            return []
        rounds = self._rounds(ids, [room[world] for world in ids])
        flat = rounds[0] if len(rounds) == 1 else [world for part in rounds for world in part]
        if self.blocks is not None:
            return self._send_block(ids, rounds, flat)
        draws, rngs = self.draws, self.rngs
        actions = [draws[world](rngs[world]) for world in flat]
        sent: Sequence[int]
        if self.mixed:  # agents' actions of different specs: one dict per slot, sent at once
            sent = range(len(flat)) if send_unless_removed(batch, actions, flat) else range(0)
        else:
            sent = _send(batch, flat, actions)
        for position in sent:
            world = flat[position]
            self.tally.sent[world].append(actions[position])
            left[world] -= 1
        worlds_sent = {flat[position] for position in sent}
        for world in ids:
            if world not in worlds_sent or batch.in_flight(world) < pipeline:
                self.wanting.add(world)  # not sent (removed meanwhile), or room for more
        if len(sent) < len(flat):
            self.failures = -1  # refused: a world was removed; look again
            if not sent:
                return None
        return list(worlds_sent)

    def _rounds(self, ids: list[int], room: list[int]) -> list[list[int]]:
        """The worlds of ``ids`` sent this pass, round by round: each as many rounds as it has
        ``room`` for (``pipeline`` in flight, its steps left), a multi-agent world's agents alike
        (``ids`` holds whole worlds, each its agents' slots in a row). So the pipeline is kept
        full: a pass tops each world up, not one step more per world a pass."""
        group = self.group
        if group > 1:
            room = [
                min(room[at : at + group]) for at in range(0, len(ids), group) for _ in range(group)
            ]
        most = max(room)
        if most <= 1:
            return [ids]
        return [[w for w, n in zip(ids, room, strict=True) if n > r] for r in range(most)]

    def _send_block(
        self, ids: list[int], rounds: list[list[int]], flat: list[int]
    ) -> list[int] | None:
        """``_send_random``'s send, for actions taken stacked from their blocks."""
        batch, left, pipeline = self.batch, self.left, self.pipeline
        assert left is not None and self.blocks is not None
        actions = self.blocks.take_rounds(rounds)
        if not send_unless_removed(batch, actions, flat):  # all or nothing: none was sent
            self.wanting.update(ids)
            self.failures = -1  # refused: a world was removed; look again
            return None
        self.tally.sent_stacked(flat, actions)
        for world in flat:
            left[world] -= 1
        in_flight = batch.in_flight
        for world in ids:
            if in_flight(world) < pipeline:
                self.wanting.add(world)  # room for more
        return ids

    def _send_chosen(self) -> list[int] | None:
        """Sends the policy's actions to the worlds of ``ready``; returns the worlds sent to.

        Worlds of ``ready`` with no steps left are parked (``RunStats.waiting``); once
        nothing is in flight and steps are left (a restart's lost steps, made up), the
        parked worlds are offered again.
        """
        ready, live, left = self.ready, self.live, self.left
        if ready is None:
            if not self.parked or self.batch.pending() or not self._steps_left_for_parked():
                return []
            ready, self.parked = join(self.parked), []
            assert ready is not None
        ids = ready.env_ids.tolist()
        positions = [p for p, world in enumerate(ids) if world in live]
        rest = None
        if self.group > 1:  # whole worlds only: the others wait here for their agents' steps
            whole = set(self._whole([ids[p] for p in positions]))
            waiting = [p for p in positions if ids[p] not in whole]
            positions = sorted((p for p in positions if ids[p] in whole), key=ids.__getitem__)
            rest = rows(ready, waiting) if waiting else None
        if left is not None:
            chosen = [p for p in positions if left[ids[p]] > 0]
        else:
            chosen = positions[: self.steps - self.requested]
        if not chosen:
            self._park(ready, positions)
            self.ready = rest
            return []
        timestep = ready if len(chosen) == len(ids) else rows(ready, chosen)
        assert self.policy is not None
        actions = self.policy(timestep)
        sent = timestep.env_ids.tolist()
        if not send_unless_removed(self.batch, actions, sent):
            self.ready = ready
            self.failures = -1  # look again, and choose again without the removed world
            return None
        for world, action in zip(sent, unstack(actions, len(sent)), strict=True):
            self.tally.sent[world].append(action)
            if left is not None:
                left[world] -= 1
        self.requested += len(sent)
        if len(chosen) < len(positions):
            taken = set(chosen)
            self._park(ready, [p for p in positions if p not in taken])
        self.ready = rest
        return sent

    def _supersede(self, result: BatchedTimeStep) -> None:
        """A restarted world's FIRST steps replace its agents' steps still waiting for an action
        (an agent answered before another's step was lost: ``_batch.agents._file_firsts``)."""
        assert result.truncated is not None
        cut = set(result.env_ids[result.truncated].tolist())
        self.ready = drop_worlds(self.ready, cut)
        self.parked = [p for p in (drop_worlds(p, cut) for p in self.parked) if p is not None]

    def _park(self, ready: BatchedTimeStep, positions: list[int]) -> None:
        if positions:
            self.parked.append(
                ready if len(positions) == len(ready.env_ids) else rows(ready, positions)
            )

    def _steps_left_for_parked(self) -> bool:
        if self.left is None:
            return self.requested < self.steps
        left = self.left
        return any(left[world] > 0 for part in self.parked for world in part.env_ids.tolist())

    def _recv(self, wanted: int) -> object:
        try:
            return recv_until_stopped(
                self.batch, self.timeout, self.stop, self.watch.first_world, wanted=wanted
            )
        except errors.WorldError as error:
            return self.removed_or_raise(error)

    def removed_or_raise(self, error: errors.WorldError) -> object:
        """A pass's receive raised ``error``: ``_REMOVED`` if its world was removed meanwhile
        (the next pass lets it go), else it is raised."""
        if error.index in self.batch.live_ids:
            raise error
        self.failures = -1
        return _REMOVED


def _stack(actions: list[Any]) -> Any:
    first = actions[0]
    if isinstance(first, dict):
        return {key: _stack([a[key] for a in actions]) for key in first}
    return np.stack([np.asarray(a) for a in actions])


def _send(batch: BatchedEnvironment, ids: list[int], actions: list[Any]) -> Sequence[int]:
    """Sends each world of ``ids`` (a world may be there more than once) its action; returns
    the positions in ``ids`` it sent.

    A world removed from the batch since ``ids`` was chosen is refused by
    ``send``; it is left out (a stacked send sends nothing then, being all or
    nothing, and the loop chooses again).
    """
    try:
        stacked = _stack(actions)
    except ValueError:  # variable-length actions of different lengths: one world at a time
        sent, refused = [], set()
        for position, (world, action) in enumerate(zip(ids, actions, strict=True)):
            if world not in refused and send_unless_removed(batch, _stack([action]), [world]):
                sent.append(position)
            else:
                refused.add(world)  # its later steps stay unsent too: it was removed
        return sent
    return range(len(ids)) if send_unless_removed(batch, stacked, ids) else range(0)


def send_unless_removed(batch: BatchedEnvironment, actions: Any, ids: Sequence[int]) -> bool:
    """``batch.send(actions, ids)``; False, with nothing sent, if one of them was removed.

    Args:
      batch: the worlds.
      actions: stacked actions, in the order of ``ids``.
      ids: the worlds to step.

    Returns:
      Whether the steps were sent.

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
