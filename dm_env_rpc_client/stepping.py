"""``dmr.collect``: step a batch of worlds with random actions or a policy, and count what happened.

::

    import dm_env_rpc_client as dmr

    with dmr.BatchedEnvironment.connect([address] * 4, seed=1) as batch:
        stats = dmr.collect(batch, steps=2_000, seed=1)
    stats.steps, stats.episodes, stats.returns

This is the command line's ``run`` as a Python call (the Ray shards, the RLlink
client and the benchmarks use it too), with the same guarantees (``_stepping.loop``):

- **Random actions** (``policy=None``, the default) are reproducible: world
  ``i`` takes exactly its share of the steps and draws its actions from a
  generator seeded from ``seed + i``; up to ``pipeline`` steps (8) are in
  flight per world.
- **A policy**: every world is reset, then ``policy(timestep)`` is called with
  each batch of steps received (a ``BatchedTimeStep`` of the worlds that just
  finished a step) and returns their actions, stacked like
  ``BatchedEnvironment.step`` takes them. One step is in flight per world.
- ``steps``: a total, or one count per world (``steps[i]`` for world ``i``,
  exactly, with a policy too). With a policy, a world whose count is spent
  keeps its last step unanswered; ``stats.waiting`` holds those steps. On a
  multi-agent batch the counts are per agent slot, and a world's agents must
  have the same count (whole worlds step).
- ``resume=stats``: go on where an earlier run of this batch stopped, in rounds
  (collect, train, collect again): no reset; the policy acts first on
  ``stats.waiting``; steps left in flight (a stopped run) are received;
  an episode that spans the runs counts once, whole, in the run it ends in.
- ``record``: a ``Recording`` that gets every step (the caller closes it).
- ``progress``: ``True`` shows a tqdm bar; a callable is called with the
  number of steps of each batch received (``bar.update`` fits).
- ``stop``: a ``threading.Event``; setting it ends the loop between steps
  (``stats.interrupted``).
- ``observers``: ``RunObserver``s, told of every batch received (before its
  actions are chosen) and of the run's restarts, relaunches, lost worlds and
  the error that ends it (``RunEvent``).
- Nothing waits without end: no step within ``timeout`` seconds raises
  ``RequestTimeoutError`` naming the worlds waited on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import errors
from ._base import checks as _checks
from ._stepping.events import RunEvent, RunObserver
from ._stepping.loop import Policy, step
from ._stepping.tally import RunStats
from .batched import BatchedEnvironment, BatchedTimeStep
from .recording import Recording

__all__ = ["DEFAULT_PIPELINE", "RunEvent", "RunObserver", "RunStats", "collect"]

DEFAULT_PIPELINE = 8  # steps in flight per world with random actions (the CLI's --pipeline)
_NOT_A_BATCH = "collect() steps a dmr.BatchedEnvironment, not {kind}: connect one first."
_POLICY_TYPE = (
    "policy is a callable policy(timestep) -> actions, or None for random actions; not {kind}."
)
_POLICY_PIPELINE = (
    "pipeline={pipeline} with a policy cannot work: a policy chooses each world's action "
    "from its step before, so one step is in flight per world; leave pipeline out."
)
_PROGRESS = "progress is None, True (a tqdm bar) or a callable taking a step count; not {kind}."
_RECORD = "record is a dmr.Recording (or has its add_batch and truncate) or None, not {kind}."
_STOP = "stop is a threading.Event or None, not {kind}."
_OBSERVER = "observers[{index}] has no on_steps and on_event (see dmr.RunObserver): {kind}."
_STEPS_PER_WORLD = (
    "steps has {given} counts for a batch of {worlds} worlds: give one count per world "
    "(batch.envs), or one total."
)
_RESUME = (
    "resume is the RunStats of an earlier collect() on this batch of {worlds} worlds, not {kind}."
)
_MULTIAGENT_COUNTS = (
    "A multi-agent batch steps whole worlds: steps[{slot}] = {count} differs from "
    "steps[{first}] = {other}, another agent of world {world}; give every agent of a world "
    "the same count (slot w * num_agents + a is agent a of world w)."
)
_RESUME_KIND = (
    "resume= goes on from a run {then}, and this one is {now}: resume a run of the same kind."
)


def _check_whole_worlds(steps: list[int], group: int) -> None:
    """Each world's agents (``group`` slots a world) have the same count, or an error names one."""
    for slot in range(len(steps)):
        first = slot - slot % group
        if steps[slot] != steps[first]:
            raise errors.ArgumentValueError(
                _MULTIAGENT_COUNTS.format(
                    slot=slot,
                    count=steps[slot],
                    first=first,
                    other=steps[first],
                    world=slot // group,
                )
            )


def collect(
    batch: BatchedEnvironment,
    steps: int | Sequence[int] = 10_000,
    *,
    policy: Callable[[BatchedTimeStep], Mapping[str, Any]] | None = None,
    seed: int = 0,
    timeout: float = 30.0,
    record: Recording | None = None,
    progress: bool | Callable[[int], Any] | None = None,
    stop: threading.Event | None = None,
    observers: Sequence[RunObserver] = (),
    pipeline: int | None = None,
    resume: RunStats | None = None,
) -> RunStats:
    """Steps every world of ``batch`` until ``steps`` steps came back; see the module docs.

    Args:
      batch: the worlds (``dmr.BatchedEnvironment.connect``).
      steps: total steps over all worlds (with a policy, the opening reset's FIRST
        steps not counted), or a sequence of each world's count.
      policy: ``policy(timestep) -> actions`` for the worlds of ``timestep.env_ids``;
        None (the default) for random actions.
      seed: with random actions, world ``i`` draws its actions from a generator
        seeded from ``seed + i``.
      timeout: seconds without any finished step before giving up (and for a
        policy's opening reset).
      record: a ``dmr.Recording`` to record every episode in (not closed here).
      progress: None, True (a tqdm bar), or a callable taking the number of steps
        of each batch received.
      stop: set it (from another thread or a signal handler) to end the run
        between steps.
      observers: ``dmr.RunObserver``s told of every batch received and of the
        run's events, on this thread.
      pipeline: steps in flight per world with random actions (default
        ``DEFAULT_PIPELINE``); 1 with a policy.
      resume: the ``RunStats`` of an earlier run of this batch, of the same kind
        (random actions or a policy), to go on from (see the module docs).

    Returns:
      What the run did: steps, episodes, returns, latencies, restarts, worlds lost.

    Raises:
      ArgumentTypeError, ArgumentValueError: an argument that cannot work (named).
      RequestTimeoutError: no step finished within ``timeout``; names the worlds.
      WorldError: a world failed (under ``on_world_failure="raise"``).
    """
    if not isinstance(batch, BatchedEnvironment):
        raise errors.ArgumentTypeError(_NOT_A_BATCH.format(kind=_checks.kind(batch)))
    count = len(batch.envs)
    if isinstance(steps, Sequence) and not isinstance(steps, str):
        if len(steps) != count:
            raise errors.ArgumentValueError(_STEPS_PER_WORLD.format(given=len(steps), worlds=count))
        steps = [_checks.check_count(n, f"steps[{i}]", low=0) for i, n in enumerate(steps)]
        _check_whole_worlds(steps, int(getattr(batch, "num_agents", 1)))
    else:
        steps = _checks.check_count(steps, "steps", low=0)
    _checks.check_count(seed, "seed", low=-(2**63))
    seconds = _checks.check_seconds(timeout, allow_none=False)
    assert seconds is not None
    if policy is not None and not callable(policy):
        raise errors.ArgumentTypeError(_POLICY_TYPE.format(kind=_checks.kind(policy)))
    if pipeline is None:
        pipeline = 1 if policy is not None else DEFAULT_PIPELINE
    _checks.check_count(pipeline, "pipeline")
    if policy is not None and pipeline != 1:
        raise errors.ArgumentValueError(_POLICY_PIPELINE.format(pipeline=pipeline))
    if record is not None and not all(hasattr(record, name) for name in ("add_batch", "truncate")):
        raise errors.ArgumentTypeError(_RECORD.format(kind=_checks.kind(record)))
    if stop is not None and not isinstance(stop, threading.Event):
        raise errors.ArgumentTypeError(_STOP.format(kind=_checks.kind(stop)))
    if resume is not None:
        carry = resume.carry if isinstance(resume, RunStats) else None
        if carry is None or len(carry.in_episode) != count:
            raise errors.ArgumentTypeError(_RESUME.format(worlds=count, kind=_checks.kind(resume)))
        if carry.policy != (policy is not None):
            kinds = ("with random actions", "with a policy")
            raise errors.ArgumentValueError(
                _RESUME_KIND.format(then=kinds[carry.policy], now=kinds[policy is not None])
            )
    for index, observer in enumerate(observers):
        if not (hasattr(observer, "on_steps") and hasattr(observer, "on_event")):
            raise errors.ArgumentTypeError(
                _OBSERVER.format(index=index, kind=_checks.kind(observer))
            )
    bar: Any = None
    update: Callable[[int], Any] | None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, unit="step")
        update = bar.update
    elif progress is None or progress is False:
        update = None
    elif callable(progress):
        update = progress
    else:
        raise errors.ArgumentTypeError(_PROGRESS.format(kind=_checks.kind(progress)))
    policy_: Policy | None = policy
    try:
        return step(
            batch,
            steps=steps,
            policy=policy_,
            pipeline=pipeline,
            seed=seed,
            timeout=seconds,
            recording=record,
            stop=stop,
            progress=update,
            observers=tuple(observers),
            resume=resume,
        )
    finally:
        if bar is not None:
            bar.close()
