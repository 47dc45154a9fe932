"""The RLlink client: dm_env_rpc worlds stepped here, for an RLlib learner elsewhere.

``run_rllink(addresses, rllib=[...])`` connects to one or more RLlib
``EnvRunnerServerForExternalInference`` ports (``ray._rllink_wire``), takes the
learner's config (its spaces, checked against the worlds' by
``ray._rllink_spaces``) and weights, builds the RLModule here, and steps the
worlds of one ``BatchedEnvironment`` through ``dmr.collect`` (the library's one
stepping loop), one step in flight per world, in rounds:

1. a round is ``collect(batch, counts, policy=..., observers=[...], resume=last)``:
   each world of a link takes its part of the link's share of env steps
   (``steps_per_send``, by default the learner's train batch split over the
   links), and goes on from where the last round left it (no reset). Every
   batch of steps received is recorded (the observer, ``ray._rllink_episodes``),
   then its worlds get their actions from one forward pass
   (``forward_exploration``) over all of them, sampled from the module's action
   distribution with ``action_logp`` and ``action_dist_inputs`` kept for PPO. A
   FIRST step records no env step, so a link still short gets a second
   ``collect`` for the rest (the counts are scaled by the steps per env step seen
   so far, so this is rare);
2. once every link has its share and nothing is in flight, the episodes go to
   each link with ``EPISODES_AND_GET_STATE``, all links first. The learner trains
   on them while the next round steps (acting with the weights it has, at most one
   round old): between batches of steps the client looks (every ``POLL`` seconds,
   without waiting) whether every link's ``SET_STATE`` has come and loads the
   newest weights at once. Before shipping the next round it waits for those
   weights if they have not come: at most one round is in flight, and each step's
   ``action_logp`` is that of the weights that acted, which PPO's ratio corrects
   for. ``lockstep=True`` waits for them right after shipping instead: every
   round on-policy, the learner and the worlds taking turns.

With ``policy=callable`` the user's policy acts instead (scripted, human, an
old checkpoint: the old stack's ``log_action``): ``policy(timestep)`` gets a
``BatchedTimeStep`` and returns the worlds' actions (stacked, as for
``BatchedEnvironment.send``). The episodes say ``custom_data["behavior"] ==
"external"`` and carry no ``action_logp``; they go with ``EPISODES`` (no waiting
for weights, which off-policy learners such as DQN do not send back until they
start learning), or with ``paced=True`` as on-policy rounds are (one in flight,
the weights that come back ignored, the next round shipped once they have moved:
``ray._rllink_pace``): a round per training iteration, so the learner's updates
per env step are what its config says.

Faults. Worlds fail as the batch's ``on_world_failure`` says (``"restart"`` by
default): a restarted world's cut episode is shipped truncated, a removed
world's too; no step is recorded twice or shipped twice. A learner that hangs
up, or is not there yet, is waited for with backoff (``wait`` seconds, saying
so through ``say``); episodes whose message was cut short are sent again; a
message sent whole whose answer never came is counted in
``unconfirmed_steps``, never sent twice. A learner gone for longer than ``wait``
mid-run ends the run cleanly: ``learner_gone`` is set and the stats say what
was done. If this process is killed, the learner's server notices the closed
socket and listens again, for this client or another.

Multi-agent worlds (``num_agents``): one policy shared by every agent, each
agent's episodes its own (``ray._rllink_agents``).

Stopping. ``stop`` set (Ctrl-C or SIGTERM on the command line) ends the run in
whatever it waits for: connecting or reconnecting to a learner, connecting to
the worlds (``ray._rllink_open``: the attempt is let go and undoes itself), stepping
(``collect`` looks between steps), shipping into a learner that does not read,
waiting for weights. Every wait looks at it every quarter second (``SLICE``).
The stats say ``stop_reason == "stopped"``; steps recorded and not shipped are
``unshipped_steps``, steps shipped whose weights never came ``unconfirmed_steps``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ... import errors
from ..._adaptor.stacked import BatchedTimeStep
from ..._base import checks as _checks
from ...batched import BatchedEnvironment
from ...stepping import RunEvent, RunStats, collect
from ._rllink_agents import agent_labels, agents_of, check_shared, world_counts
from ._rllink_episodes import OFF_POLICY, ON_POLICY, EpisodeBook, wire_state
from ._rllink_module import ModuleActor
from ._rllink_open import open_worlds
from ._rllink_pace import Pacer
from ._rllink_spaces import SpaceBridge
from ._rllink_stats import RLlinkStats
from ._rllink_wire import (
    EPISODES,
    EPISODES_AND_GET_STATE,
    SET_STATE,
    STOPPED,
    LearnerUnreachableError,
    Link,
    LinkDroppedError,
    LinkStopped,
)

Policy = Callable[[BatchedTimeStep], Mapping[str, Any]]
RANDOM = "random"
POLL = 0.005  # seconds between looks for the weights of the round in flight, while stepping
_NO_LINKS = "run_rllink needs at least one RLlib address (rllib=['HOST:PORT'])."
_ALL_LOST = "every world was lost (see restarts and worlds_lost)"
_BAD_POLICY = "policy={policy!r}: give a callable, 'random', or None (the learner's RLModule)."


@dataclasses.dataclass
class _Shipped:
    """One link's part of a round shipped on-policy, and its answer once read."""

    link: Link
    steps: int
    state: dict[str, Any] | None = None  # the SET_STATE message's body, once read
    dropped: str | None = None  # why the link broke before its answer came


class _Run:
    """One ``run_rllink`` run: the worlds, the links, the book and the stats.

    It is the rounds' policy (``choose``) and observer (``on_steps``) for ``dmr.collect``.
    """

    def __init__(
        self,
        batch: BatchedEnvironment,
        links: list[Link],
        stats: RLlinkStats,
        *,
        policy: Policy | str | None,
        steps_per_send: int | None,
        timeout: float,
        wait: float,
        learner_timeout: float,
        stop: threading.Event,
        say: Callable[[str], None],
        torch_threads: int | None,
        lockstep: bool,
        paced: bool,
    ) -> None:
        self.batch, self.links, self.stats = batch, links, stats
        self.policy: Policy | None = None if isinstance(policy, str) else policy
        self.timeout, self.wait, self.learner_timeout = timeout, wait, learner_timeout
        self.stop, self.say = stop, say
        config = links[0].config(timeout)
        self.bridge = SpaceBridge(batch, config.observation_space, config.action_space)
        self.actor: ModuleActor | None = None
        if isinstance(policy, str):  # "random": uniform, seeded by the batch's seed
            self.policy = lambda timestep: batch.random_actions(env_ids=timestep.env_ids.tolist())
        if policy is None:
            self.actor = ModuleActor(config, self.bridge, torch_threads)
            self.actor.load(links[0].state(timeout))
        count = len(batch.envs)
        total = steps_per_send or config.total_train_batch_size
        self.share = [max(1, math.ceil(total / len(links)))] * len(links)
        self.agents = agents_of(batch)  # a multi-agent world's agents: one shared policy
        labels = agent_labels(batch)  # (None for single-agent worlds)
        self.book = EpisodeBook(count, len(links), stats.behavior, self.agents, labels)
        self.let_go: set[int] = set()
        self.last: RunStats | None = None  # the last collect's: the next one resumes it
        self.received = self.recorded = 0  # steps received and env steps recorded, so far
        self.lockstep, self.shipped, self.next_poll = lockstep, 0, 0.0
        self.awaiting: list[_Shipped] = []  # the round in flight: shipped, weights not loaded
        answered = self.actor is not None or paced  # rounds answered with weights: paced
        self.pacer = Pacer(links, timeout, learner_timeout, stop, say) if answered else None

    # --- stepping (through dmr.collect) ---------------------------------------------

    def on_steps(self, timestep: BatchedTimeStep) -> None:
        """Records every step received (the reset's FIRST steps too) in the book, and
        takes the weights of the round in flight if they have come."""
        self.stats.steps += len(self.book.take(timestep, self.bridge.observations(timestep)))
        if self.awaiting and time.monotonic() >= self.next_poll:
            self._poll()

    def on_event(self, event: RunEvent) -> None:
        """Restarts and lost worlds are read from the batch at the end."""

    def choose(self, timestep: BatchedTimeStep) -> Mapping[str, Any]:
        """The actions of the worlds of ``timestep``: one forward pass, or the user's policy.

        Called again for the same steps if a world was removed meanwhile: ``acted``
        keeps the latest choice.
        """
        ids = timestep.env_ids.tolist()
        world: Mapping[str, Any]
        if self.actor is not None:
            obs = np.stack([self.book.last_obs[w] for w in ids])
            learner, extras = self.actor.act(obs)
            self.stats.lagged_steps += len(ids) if self.awaiting else 0
            world = self.bridge.to_world(learner)
        else:
            assert self.policy is not None
            world = self.policy(timestep)
            learner, extras = self.bridge.to_learner(world), [{} for _ in ids]
        for position, world_id in enumerate(ids):
            self.book.acted(world_id, learner[position], extras[position])
        return world

    def _counts(self) -> list[int] | None:
        """Each world's steps for the rest of this round, or None if the round is done.

        A link's worlds share what it still needs of env steps, scaled by the steps
        received per env step recorded so far (a FIRST step records none); a
        multi-agent world's agents get the same count (``ray._rllink_agents``).
        """
        short = [share - done for share, done in zip(self.share, self.book.recorded, strict=True)]
        ratio = self.received / self.recorded if self.recorded else 1.0
        live, slots = self.batch.live_ids, len(self.batch.envs)
        return world_counts(live, self.agents, len(self.links), short, ratio, slots)

    def _round(self) -> bool:
        """Steps one round (until every link has its share); False if stopped."""
        while (counts := self._counts()) is not None:
            before, started = sum(self.book.recorded), time.perf_counter()
            self.last = collect(
                self.batch,
                counts,
                policy=self.choose,
                timeout=self.timeout,
                stop=self.stop,
                observers=[self],
                resume=self.last,
            )
            self.stats.stepping_seconds += time.perf_counter() - started
            if self.last.interrupted:
                return False
            self.received += self.last.steps
            self.recorded += sum(self.book.recorded) - before
            if not self.last.steps:
                break  # every world that could step is gone
        live = set(self.batch.live_ids)
        for world in range(len(self.batch.envs)):
            if world not in live and world not in self.let_go:
                self.let_go.add(world)
                self.book.let_go(world)
        return True

    # --- shipping -----------------------------------------------------------------

    def _reconnect(self, link: Link, why: str) -> None:
        self.say(f"lost the RLlib learner at {link.address} ({why}); reconnecting")
        link.open(self.wait)  # LearnerUnreachableError: gone for good; LinkStopped: stopped
        self.stats.reconnects.append(f"{link.address}: {why}")

    def _deliver(self, link: Link, kind: str, payload: list[Any], steps: int) -> None:
        """Sends one batch whole, reconnecting first if the learner hung up.

        A message cut short by a broken connection is discarded by the server,
        so it is sent again on the new connection; one sent whole is not.
        """
        while True:
            if link.peer_closed():
                self._reconnect(link, "it hung up")
            try:
                link.send(kind, self.timeout, episodes=payload, timesteps=steps)
                return
            except LinkDroppedError as exc:
                self._reconnect(link, str(exc))

    def _ship(self) -> None:
        """Ships the round's episodes to every link.

        On-policy, the previous round's weights are taken first (at most one round in
        flight), and with ``lockstep`` this round's too before stepping on.
        """
        answered = self.pacer is not None  # the learner answers with weights
        if answered:
            self._settle()
        started = time.perf_counter()
        chunks = self.book.ship()
        kind = EPISODES_AND_GET_STATE if answered else EPISODES
        delivered: list[_Shipped] = []
        sizes = [sum(len(e) for e in episodes) for episodes in chunks]
        for index, (link, episodes) in enumerate(zip(self.links, chunks, strict=True)):
            payload = [wire_state(e) for e in episodes]
            try:
                self._deliver(link, kind, payload, sizes[index])
            except (LearnerUnreachableError, LinkStopped):
                self.stats.unshipped_steps += sum(sizes[index:])  # taken from the book, not sent
                if answered:  # sent whole, answers not come
                    self.awaiting = delivered
                else:  # EPISODES sent whole: the learner has them
                    self.stats.steps_shipped += sum(entry.steps for entry in delivered)
                raise
            delivered.append(_Shipped(link, sizes[index]))
        self.stats.shipping_seconds += time.perf_counter() - started
        self.shipped += 1
        if not answered:
            self._confirmed(delivered)
            return
        self.awaiting = delivered
        if self.lockstep:
            self._settle()

    def _poll(self) -> None:
        """Reads the weights that have come for the round in flight, without waiting for
        more; loads them once every link has answered (a drop is left to ``_settle``)."""
        self.next_poll = time.monotonic() + POLL
        for entry in self.awaiting:
            if entry.state is None and entry.dropped is None and entry.link.answer_ready():
                try:
                    entry.state = entry.link.expect(SET_STATE, EPISODES_AND_GET_STATE, self.timeout)
                except LinkDroppedError as exc:
                    entry.dropped = str(exc)
                except LinkStopped:
                    return  # collect sees the stop between steps
        if all(
            entry.state is not None
            and (self.pacer is None or self.pacer.moved(entry.link, entry.state["state"]))
            for entry in self.awaiting
        ):
            self._settle()  # (an answer whose weights did not move is left to it too)

    def _settle(self) -> None:
        """Waits for the weights of the round in flight (each link's ``SET_STATE``), loads
        the newest; a link that hung up meanwhile is reconnected and asked for its state."""
        if not self.awaiting:
            return
        started, states, done = time.perf_counter(), [], list(self.awaiting)
        try:
            while self.awaiting:
                entry = self.awaiting[0]
                if entry.state is None and entry.dropped is None:
                    try:
                        entry.state = entry.link.expect(
                            SET_STATE, EPISODES_AND_GET_STATE, self.learner_timeout
                        )
                    except LinkDroppedError as exc:
                        entry.dropped = str(exc)
                self.awaiting.pop(0)
                if entry.dropped is None:
                    assert entry.state is not None
                    self.stats.steps_shipped += entry.steps
                    state = entry.state["state"]
                    states.append(self.pacer.next(entry.link, state) if self.pacer else state)
                else:
                    self.stats.unconfirmed_steps += entry.steps
                    self._reconnect(entry.link, entry.dropped)
                    states.append(entry.link.state(self.timeout))
                    if self.pacer:
                        self.pacer.rebase(entry.link, states[-1])
        finally:
            self.stats.learner_seconds += time.perf_counter() - started
        if self.actor is not None:  # (paced off-policy: the weights only say "trained")
            newest = max(states, key=lambda state: int(state.get("weights_seq_no", 0) or 0))
            self.actor.load(newest)
            self.stats.weight_updates += 1
        self._confirmed(done, counted=True)

    def _confirmed(self, delivered: list[_Shipped], *, counted: bool = False) -> None:
        """Counts a round taken by the learner, and says so."""
        if not counted:
            self.stats.steps_shipped += sum(entry.steps for entry in delivered)
        self.stats.rounds += 1
        returns = self.book.returns
        recent = f", return mean {np.mean(returns[-100:]):.3f}" if returns else ""
        self.say(
            f"round {self.stats.rounds}: shipped {sum(e.steps for e in delivered)} steps "
            f"to {len(delivered)} learner port(s){recent}"
        )

    def run(self, rounds: int | None) -> None:
        """Steps and ships rounds until ``rounds`` are done, the learner is gone or ``stop``."""
        while rounds is None or self.shipped < rounds:
            if self.stop.is_set() or not self._round():
                raise LinkStopped(STOPPED)
            self._ship()
            if not self.batch.live_ids:
                self._settle()
                self.stats.stop_reason = _ALL_LOST
                return
        self._settle()
        self.stats.stop_reason = f"{rounds} rounds done"

    def finish(self) -> None:
        """Fills the stats from the book and the batch's failures."""
        stats, book = self.stats, self.book
        for entry in self.awaiting:  # sent whole; the answer came (unread by settle) or not
            if entry.state is not None:
                stats.steps_shipped += entry.steps
            else:
                stats.unconfirmed_steps += entry.steps
        stats.returns = list(book.returns)
        stats.episodes = len(book.returns)
        stats.unshipped_steps += book.unshipped_steps()
        stats.truncated_by_failure = book.truncated_by_failure
        stats.cut_after_ship = book.cut_after_ship
        failures = self.batch.failures
        stats.restarts = [
            f"world {f.index}: {f.address} -> {f.new_address} ({type(f.cause).__name__})"
            for f in failures
            if f.outcome == "restarted"
        ]
        stats.worlds_lost = sum(f.outcome == "removed" for f in failures)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_rllink(
    addresses: str | Sequence[str],
    rllib: str | Sequence[str],
    *,
    num_envs: int | None = None,
    num_agents: int = 1,
    policy: Policy | str | None = None,
    rounds: int | None = None,
    steps_per_send: int | None = None,
    seed: int | None = 0,
    on_world_failure: str = "restart",
    timeout: float = 30.0,
    wait: float = 120.0,
    learner_timeout: float = 600.0,
    stop: threading.Event | None = None,
    say: Callable[[str], None] | None = None,
    torch_threads: int | None = 1,
    lockstep: bool = False,
    paced: bool = False,
    **connect_kwargs: Any,
) -> RLlinkStats:
    """Steps dm_env_rpc worlds for RLlib learners reached over RLlink; see the module docs.

    Args:
      addresses: the worlds' servers (as for ``BatchedEnvironment.connect``).
      rllib: the learners' ``EnvRunnerServerForExternalInference`` ports,
        ``host:port`` each (runner ``i`` listens on ``env_config["port"] + i``).
        World ``w`` feeds port ``w % len(rllib)``.
      num_envs: how many worlds (default one per address).
      num_agents: agents per world; 2 or more: multi-agent worlds, one policy shared by
        every agent, each agent's episodes its own (``ray._rllink_agents``).
      policy: None: the learner's RLModule acts (on-policy, for PPO and the
        like); else ``policy(timestep) -> actions`` acts (off-policy data, for
        DQN, SAC and offline RL); ``"random"``: uniform random actions.
      rounds: ship this many batches of episodes, then stop (None: until the
        learner is gone or ``stop`` is set).
      steps_per_send: env steps per round over all links (default the learner's
        ``total_train_batch_size``, which an on-policy learner waits for).
      seed: world ``i`` is created with ``seed + i`` (None: no seed setting).
      on_world_failure: the batch's policy for failed worlds (``"restart"``).
      timeout: seconds for each world answer and each RLlink handshake.
      wait: seconds to keep retrying an RLlib port that refuses or hung up
        (at the start, and mid-run) before giving up on it.
      learner_timeout: seconds to wait for new weights after shipping (a training step).
      stop: set it to end the run between steps (what is unshipped is dropped).
      say: where progress notes go (default: stderr).
      torch_threads: ``torch.set_num_threads`` for the module's forward passes (default 1,
        as Ray's EnvRunners; None leaves this process's setting alone).
      lockstep: on-policy, wait for the weights trained on a round before stepping the
        next (strictly on-policy; default: step the next round while the learner trains,
        acting with weights at most one round old, and load new ones as they come).
      paced: with ``policy``, ship with ``EPISODES_AND_GET_STATE`` as on-policy, one
        round in flight, the next shipped once the learner's weights have moved: the
        client goes at the learner's pace, a round per training iteration (without it,
        it ships ``EPISODES`` as fast as its worlds step). Until the weights first move
        every answer lets the next round go (DQN: best set
        ``num_steps_sampled_before_learning_starts`` to at most a round's steps).
      **connect_kwargs: more ``BatchedEnvironment.connect`` arguments
        (``create_world_settings``, ``requested_observations``, ``insecure``, ...).

    Returns:
      The run's ``RLlinkStats``. A learner gone for good mid-run is not an error:
      ``learner_gone`` is set. Nor is ``stop``, set in any phase (connecting to a
      learner or the worlds, waiting for weights, stepping, shipping, waiting for a
      learner gone): the run ends with ``stop_reason`` ``"stopped"``, at its next
      look at ``stop`` (a quarter of a second apart in every wait).

    Raises:
      LearnerUnreachableError: no learner answered at the start within ``wait``.
      SpaceMismatchError: the learner's observation or action space (or weights) does
        not fit the worlds', or a world's agents differ; the message says which.
      WorldError: a world could not be created, or failed under ``"raise"``.
    """
    if isinstance(policy, str) and policy != RANDOM:
        raise errors.ArgumentValueError(_BAD_POLICY.format(policy=policy))
    _checks.check_count(num_agents, "num_agents")
    ports = [rllib] if isinstance(rllib, str) else list(rllib)
    if not ports:
        raise errors.ArgumentValueError(_NO_LINKS)
    say = say or _stderr
    stop = stop or threading.Event()
    links = [Link(address, say, stop) for address in ports]
    stats = RLlinkStats(behavior=ON_POLICY if policy is None else OFF_POLICY)
    batch, run = None, None
    started, cpu = time.perf_counter(), time.process_time()
    try:
        try:
            for link in links:
                link.open(wait)
            batch = open_worlds(
                addresses,
                num_envs,
                num_agents=num_agents,
                stop=stop,
                seed=seed,
                on_world_failure=on_world_failure,
                timeout=timeout,
                step_timeout=timeout,
                **connect_kwargs,
            )
            stats.agents = agents_of(batch)
            stats.worlds = len(batch.envs) // stats.agents
            if stop.is_set():
                raise LinkStopped(STOPPED)
            check_shared(batch)
            run = _Run(
                batch,
                links,
                stats,
                policy=policy,
                steps_per_send=steps_per_send,
                timeout=timeout,
                wait=wait,
                learner_timeout=learner_timeout,
                stop=stop,
                say=say,
                torch_threads=torch_threads,
                lockstep=lockstep,
                paced=paced,
            )
            started, cpu = time.perf_counter(), time.process_time()
            run.run(rounds)
        except LinkStopped:
            stats.stop_reason = STOPPED
        except LearnerUnreachableError as exc:
            if run is None:
                raise  # no learner at the start: an error
            stats.learner_gone = True
            stats.stop_reason = str(exc)
        if run is not None:
            stats.elapsed = time.perf_counter() - started
            stats.cpu_seconds = time.process_time() - cpu
        if run is not None:
            run.finish()
        return stats
    finally:
        for link in links:
            link.close()
        if batch is not None:
            batch.close(timeout=min(timeout, 5.0))
