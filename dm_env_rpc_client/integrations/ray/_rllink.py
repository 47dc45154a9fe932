"""The RLlink client: dm_env_rpc worlds stepped here, for an RLlib learner elsewhere.

``run_rllink(addresses, rllib=[...])`` connects to one or more RLlib
``EnvRunnerServerForExternalInference`` ports (``ray._rllink_wire``), takes the
learner's config (its spaces, checked against the worlds' by
``ray._rllink_spaces``) and weights, builds the RLModule here, and steps the
worlds through one ``BatchedEnvironment``, one step in flight per world, in
rounds:

1. every world whose round is not over gets its next action as soon as its
   step comes back: one forward pass (``forward_exploration``) over all the
   worlds of that ``recv``, the action sampled from the module's action
   distribution with its ``action_logp`` and ``action_dist_inputs`` kept for PPO;
2. a round ends when each link's worlds have recorded its share of env steps
   (``steps_per_send``, by default the learner's train batch split over the
   links) and nothing is in flight; the episodes (``ray._rllink_episodes``) go
   to each link with ``EPISODES_AND_GET_STATE``, all links first, then the
   client waits for every ``SET_STATE`` (the learner trains meanwhile) and
   loads the newest weights: the next round is on-policy.

With ``policy=callable`` the user's policy acts instead (scripted, human, an
old checkpoint: the old stack's ``log_action``): ``policy(timestep)`` gets a
``BatchedTimeStep`` and returns the worlds' actions (stacked, as for
``BatchedEnvironment.send``). The episodes say ``custom_data["behavior"] ==
"external"`` and carry no ``action_logp``; they go with ``EPISODES`` (no waiting
for weights, which off-policy learners such as DQN do not send back until they
start learning).

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
from ..._stepping.loop import recv_until_stopped, send_unless_removed
from ...batched import BatchedEnvironment
from ._rllink_episodes import OFF_POLICY, ON_POLICY, EpisodeBook
from ._rllink_module import ModuleActor
from ._rllink_spaces import SpaceBridge
from ._rllink_wire import (
    EPISODES,
    EPISODES_AND_GET_STATE,
    SET_STATE,
    LearnerUnreachableError,
    Link,
    LinkDroppedError,
)

Policy = Callable[[BatchedTimeStep], Mapping[str, Any]]
RANDOM = "random"
_NO_LINKS = "run_rllink needs at least one RLlib address (rllib=['HOST:PORT'])."
_BAD_POLICY = "policy={policy!r}: give a callable, 'random', or None (the learner's RLModule)."


@dataclasses.dataclass
class RLlinkStats:
    """What a ``run_rllink`` run did.

    Attributes:
      worlds: worlds stepped.
      steps: env steps recorded (FIRST steps not counted).
      episodes: episodes that reached their LAST step.
      returns: the return of each of them.
      rounds: batches of episodes shipped (to every link).
      steps_shipped: env steps shipped and taken by the learner.
      unconfirmed_steps: env steps sent whole whose answer never came (the
        learner may or may not have them; never sent twice).
      unshipped_steps: env steps recorded and not shipped when the run ended.
      weight_updates: new weights loaded.
      truncated_by_failure: episodes cut by a world's failure (shipped truncated).
      cut_after_ship: episodes cut by a failure right after their chunk was shipped
        (no step left to mark truncated; see ``ray._rllink_episodes``).
      reconnects: one line per RLlib connection made again.
      restarts: one line per world restarted by the batch.
      worlds_lost: worlds removed from the batch.
      elapsed: seconds of the run.
      learner_gone: the run ended because the learner did not come back.
      stop_reason: why the run ended.
      behavior: ``"rl_module"`` (on-policy) or ``"external"`` (the user's policy).
    """

    worlds: int = 0
    steps: int = 0
    episodes: int = 0
    returns: list[float] = dataclasses.field(default_factory=list)
    rounds: int = 0
    steps_shipped: int = 0
    unconfirmed_steps: int = 0
    unshipped_steps: int = 0
    weight_updates: int = 0
    truncated_by_failure: int = 0
    cut_after_ship: int = 0
    reconnects: list[str] = dataclasses.field(default_factory=list)
    restarts: list[str] = dataclasses.field(default_factory=list)
    worlds_lost: int = 0
    elapsed: float = 0.0
    learner_gone: bool = False
    stop_reason: str = ""
    behavior: str = ON_POLICY

    def summary(self) -> dict[str, Any]:
        """The stats as one flat, JSON-ready dict."""
        data = dataclasses.asdict(self)
        returns = data.pop("returns")
        data["return_mean"] = round(float(np.mean(returns)), 3) if returns else None
        data["steps_per_second"] = round(self.steps / self.elapsed, 1) if self.elapsed else None
        return data


def _subset(timestep: BatchedTimeStep, positions: Sequence[int]) -> BatchedTimeStep:
    """The worlds at ``positions`` of a ``BatchedTimeStep``."""
    index = np.asarray(positions, dtype=np.int64)

    def pick(tree: Any) -> Any:
        if isinstance(tree, Mapping):
            return {key: pick(value) for key, value in tree.items()}
        return np.asarray(tree)[index]

    return BatchedTimeStep(
        step_type=timestep.step_type[index],
        reward=timestep.reward[index],
        discount=timestep.discount[index],
        observation=pick(timestep.observation),
        env_ids=timestep.env_ids[index],
        truncated=None if timestep.truncated is None else timestep.truncated[index],
        state=None if timestep.state is None else timestep.state[index],
    )


class _Run:
    """One ``run_rllink`` run: the worlds, the links, the book and the stats."""

    def __init__(
        self,
        batch: BatchedEnvironment,
        links: list[Link],
        *,
        policy: Policy | str | None,
        steps_per_send: int | None,
        timeout: float,
        wait: float,
        learner_timeout: float,
        stop: threading.Event,
        say: Callable[[str], None],
        torch_threads: int | None,
    ) -> None:
        self.batch, self.links = batch, links
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
        behavior = ON_POLICY if policy is None else OFF_POLICY
        self.book = EpisodeBook(count, len(links), behavior)
        self.stats = RLlinkStats(worlds=count, behavior=behavior)
        self.left = [0] * count
        self.let_go: set[int] = set()

    # --- stepping -----------------------------------------------------------------

    def _new_round(self) -> None:
        live = set(self.batch.live_ids)
        for link in range(len(self.links)):
            mine = [w for w in live if w % len(self.links) == link]
            each = math.ceil(self.share[link] / max(1, len(mine)))
            for world in mine:
                self.left[world] = each

    def _act(self, chunks: list[BatchedTimeStep]) -> None:
        """Chooses and sends the actions of the worlds of ``chunks`` (live ones)."""
        live = set(self.batch.live_ids)
        chunks = [
            _subset(c, [p for p, w in enumerate(c.env_ids) if int(w) in live]) for c in chunks
        ]
        chunks = [c for c in chunks if len(c.env_ids)]
        if not chunks:
            return
        if self.actor is not None:
            ids = [int(w) for c in chunks for w in c.env_ids]
            obs = np.stack([self.book.last_obs[w] for w in ids])
            actions, extras = self.actor.act(obs)
            self._send(ids, actions, self.bridge.to_world(actions), extras)
            return
        assert self.policy is not None
        for chunk in chunks:
            ids = [int(w) for w in chunk.env_ids]
            world_actions = self.policy(chunk)
            learner = self.bridge.to_learner(world_actions)
            self._send(ids, learner, world_actions, [{} for _ in ids])

    def _send(
        self, ids: list[int], learner: np.ndarray, world: Any, extras: list[dict[str, Any]]
    ) -> None:
        while not send_unless_removed(self.batch, world, ids):
            live = set(self.batch.live_ids)  # a world was removed meanwhile: without it
            keep = [p for p, w in enumerate(ids) if w in live]
            if not keep:
                return
            ids = [ids[p] for p in keep]
            learner, extras = learner[keep], [extras[p] for p in keep]
            world = _pick(world, keep)
        for position, world_id in enumerate(ids):
            self.book.acted(world_id, learner[position], extras[position])

    def _round(self, parked: list[BatchedTimeStep]) -> list[BatchedTimeStep] | None:
        """Steps one round; returns the worlds waiting for the next, or None if stopped."""
        self._new_round()
        self._act(parked)
        parked = []
        while self.batch.pending():
            try:
                ready = recv_until_stopped(self.batch, self.timeout, self.stop)
            except errors.WorldError as error:
                if error.index in self.batch.live_ids:
                    raise
                continue  # a removed world: let go of at the round's end
            if ready is None:
                return None
            observations = self.bridge.observations(ready)
            for position in range(len(ready.env_ids)):
                if int(ready.step_type[position]) != 0:
                    self.left[int(ready.env_ids[position])] -= 1
            self.stats.steps += len(self.book.take(ready, observations))
            more = [p for p, w in enumerate(ready.env_ids) if self.left[int(w)] > 0]
            rest = [p for p, w in enumerate(ready.env_ids) if self.left[int(w)] <= 0]
            if more:
                self._act([_subset(ready, more)])
            if rest:
                parked.append(_subset(ready, rest))
        live = set(self.batch.live_ids)
        for world in range(len(self.batch.envs)):
            if world not in live and world not in self.let_go:
                self.let_go.add(world)
                self.book.let_go(world)
        return parked

    # --- shipping -----------------------------------------------------------------

    def _reconnect(self, link: Link, why: str) -> None:
        self.say(f"lost the RLlib learner at {link.address} ({why}); reconnecting")
        link.open(self.wait)  # LearnerUnreachableError: gone for good
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
        chunks = self.book.ship()
        on_policy = self.actor is not None
        kind = EPISODES_AND_GET_STATE if on_policy else EPISODES
        delivered: list[tuple[Link, int]] = []
        sizes = [sum(len(e) for e in episodes) for episodes in chunks]
        for index, (link, episodes) in enumerate(zip(self.links, chunks, strict=True)):
            payload = [e.get_state() for e in episodes]
            try:
                self._deliver(link, kind, payload, sizes[index])
            except LearnerUnreachableError:
                self.stats.unshipped_steps += sum(sizes[index:])  # taken from the book, not sent
                raise
            delivered.append((link, sizes[index]))
        states = []
        for link, steps in delivered:
            if not on_policy:
                self.stats.steps_shipped += steps
                continue
            try:
                states.append(link.expect(SET_STATE, kind, self.learner_timeout)["state"])
                self.stats.steps_shipped += steps
            except LinkDroppedError as exc:
                self.stats.unconfirmed_steps += steps
                self._reconnect(link, str(exc))
                states.append(link.state(self.timeout))
        self.stats.rounds += 1
        if states and self.actor is not None:
            newest = max(states, key=lambda state: int(state.get("weights_seq_no", 0) or 0))
            self.actor.load(newest)
            self.stats.weight_updates += 1
        returns = self.book.returns
        recent = f", return mean {np.mean(returns[-100:]):.3f}" if returns else ""
        self.say(
            f"round {self.stats.rounds}: shipped {sum(s for _, s in delivered)} steps "
            f"to {len(delivered)} learner port(s){recent}"
        )

    def run(self, rounds: int | None) -> RLlinkStats:
        started = time.perf_counter()
        first = self.batch.reset(timeout=self.timeout)
        self.book.take(first, self.bridge.observations(first))
        parked: list[BatchedTimeStep] | None = [first]
        try:
            while parked is not None and (rounds is None or self.stats.rounds < rounds):
                parked = self._round(parked)
                if parked is None:
                    self.stats.stop_reason = "stopped"
                    break
                self._ship()
            else:
                self.stats.stop_reason = self.stats.stop_reason or f"{rounds} rounds done"
        except LearnerUnreachableError as exc:
            self.stats.learner_gone = True
            self.stats.stop_reason = str(exc)
        self._finish(time.perf_counter() - started)
        return self.stats

    def _finish(self, elapsed: float) -> None:
        stats, book = self.stats, self.book
        stats.elapsed = elapsed
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


def _pick(actions: Any, keep: Sequence[int]) -> Any:
    if isinstance(actions, Mapping):
        return {key: _pick(value, keep) for key, value in actions.items()}
    return np.asarray(actions)[list(keep)]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_rllink(
    addresses: str | Sequence[str],
    rllib: str | Sequence[str],
    *,
    num_envs: int | None = None,
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
    **connect_kwargs: Any,
) -> RLlinkStats:
    """Steps dm_env_rpc worlds for RLlib learners reached over RLlink; see the module docs.

    Args:
      addresses: the worlds' servers (as for ``BatchedEnvironment.connect``).
      rllib: the learners' ``EnvRunnerServerForExternalInference`` ports,
        ``host:port`` each (runner ``i`` listens on ``env_config["port"] + i``).
        World ``w`` feeds port ``w % len(rllib)``.
      num_envs: how many worlds (default one per address).
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
      **connect_kwargs: more ``BatchedEnvironment.connect`` arguments
        (``create_world_settings``, ``requested_observations``, ``insecure``, ...).

    Returns:
      The run's ``RLlinkStats``. A learner gone for good mid-run is not an error:
      ``learner_gone`` is set.

    Raises:
      LearnerUnreachableError: no learner answered at the start within ``wait``.
      SpaceMismatchError: the learner's observation or action space (or weights)
        does not fit the worlds'; the message says which.
      WorldError: a world could not be created, or failed under ``"raise"``.
    """
    if isinstance(policy, str) and policy != RANDOM:
        raise errors.ArgumentValueError(_BAD_POLICY.format(policy=policy))
    ports = [rllib] if isinstance(rllib, str) else list(rllib)
    if not ports:
        raise errors.ArgumentValueError(_NO_LINKS)
    say = say or _stderr
    links = [Link(address, say) for address in ports]
    batch = None
    try:
        for link in links:
            link.open(wait)
        batch = BatchedEnvironment.connect(
            addresses,
            num_envs,
            seed=seed,
            on_world_failure=on_world_failure,
            timeout=timeout,
            step_timeout=timeout,
            **connect_kwargs,
        )
        run = _Run(
            batch,
            links,
            policy=policy,
            steps_per_send=steps_per_send,
            timeout=timeout,
            wait=wait,
            learner_timeout=learner_timeout,
            stop=stop or threading.Event(),
            say=say,
            torch_threads=torch_threads,
        )
        return run.run(rounds)
    finally:
        for link in links:
            link.close()
        if batch is not None:
            batch.close(timeout=min(timeout, 5.0))
