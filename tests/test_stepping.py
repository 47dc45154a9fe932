"""``dmr.collect``: the one stepping loop's public face, its observers and its argument checks.

The loop's guarantees under failures (removed worlds, restarts, recording) are tested in
``test_batch_cost.py`` and ``test_ray_no_cluster.py`` through ``dmr.collect`` too; here:
what observers are told, a policy's steps, ``stop`` from an observer, and bad arguments.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any, ClassVar

import numpy as np
import pytest
from conftest import sigstop

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server import Server


class Watcher:
    """Keeps what a run tells it; sets ``stop`` once ``stop_at`` steps were seen."""

    def __init__(self, stop: threading.Event | None = None, stop_at: int = -1) -> None:
        self.batches: list[dmr.BatchedTimeStep] = []
        self.events: list[dmr.RunEvent] = []
        self.stop, self.stop_at = stop, stop_at

    def on_steps(self, timestep: dmr.BatchedTimeStep) -> None:
        self.batches.append(timestep)
        if self.stop is not None and sum(len(b.env_ids) for b in self.batches) >= self.stop_at:
            self.stop.set()

    def on_event(self, event: dmr.RunEvent) -> None:
        self.events.append(event)


def towards_ball(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
    """Moves each paddle towards its ball: every episode is caught (return 1)."""
    actions = []
    for board in timestep.observation["board"]:
        column = board[:-1].max(axis=0).argmax()
        actions.append(np.sign(column - board[-1].argmax()))
    return {"paddle": np.asarray(actions, np.int8)}


def test_random_actions_are_reproducible_and_every_batch_is_observed(
    catch_server: Server,
) -> None:
    watcher, counted = Watcher(), []
    with dmr.BatchedEnvironment.connect([catch_server.address], 3, seed=4) as batch:
        stats = dmr.collect(batch, 301, seed=4, observers=[watcher], progress=counted.append)
    assert isinstance(watcher, dmr.RunObserver)
    assert stats.steps == 301 and stats.worlds == 3 and stats.world_seeds == [4, 5, 6]
    assert sum(counted) == 301 == sum(len(b.env_ids) for b in watcher.batches)
    assert watcher.events == [] and not stats.interrupted and stats.episodes > 0
    # Each world took its share (101, 100, 100) of the steps.
    shares = np.bincount(np.concatenate([b.env_ids for b in watcher.batches]), minlength=3)
    assert shares.tolist() == [101, 100, 100]
    with dmr.BatchedEnvironment.connect([catch_server.address], 3, seed=4) as batch:
        assert dmr.collect(batch, 301, seed=4, progress=True).returns == stats.returns


class _SendingThreads(dmr.BatchedEnvironment):
    """Keeps the name of each thread that sent steps."""

    threads: ClassVar[set[str]] = set()

    def send(self, actions: Any, env_ids: Any) -> None:
        type(self).threads.add(threading.current_thread().name)
        super().send(actions, env_ids)


def test_a_run_with_nothing_of_the_callers_per_pass_steps_from_the_loop_and_plays_the_same(
    catch_server: Server,
) -> None:
    """Issue 36: random actions with no observer, progress or recording step from the batch's
    loop thread (no hand-off per pass); the steps, shares and returns are those of the same run
    stepped from the caller's thread (an observer keeps it there)."""
    runs = []
    for observers in ([Watcher()], []):
        _SendingThreads.threads = set()
        with _SendingThreads.connect([catch_server.address], 3, seed=4) as batch:
            stats = dmr.collect(batch, 301, seed=4, pipeline=4, observers=observers)
            assert stats.steps == 301 and batch.pending() == 0 and not stats.interrupted
        runs.append((stats, _SendingThreads.threads))
    (by_caller, caller_threads), (by_loop, loop_threads) = runs
    assert caller_threads == {threading.current_thread().name}
    assert len(loop_threads) == 1 and loop_threads != caller_threads
    assert by_loop.returns == by_caller.returns and by_loop.episodes == by_caller.episodes


def test_stop_set_from_another_thread_ends_a_run_on_the_loop_between_steps(
    catch_server: Server,
) -> None:
    stop = threading.Event()
    with dmr.BatchedEnvironment.connect([catch_server.address], 2, seed=1) as batch:

        def stop_once_stepping() -> None:
            deadline = time.monotonic() + 30
            while len(batch.latencies) < 50 and time.monotonic() < deadline:
                time.sleep(0.01)  # polling the run's progress, with a deadline
            stop.set()

        stopper = threading.Thread(target=stop_once_stepping)
        stopper.start()
        stats = dmr.collect(batch, 10**9, stop=stop, pipeline=8, timeout=30)
        stopper.join(30)
        assert stats.interrupted and 50 <= stats.steps < 10**9
        # Every step received was counted; those still in flight stay the batch's.
        assert stats.steps == len(batch.latencies)


class _Interrupted(Exception):
    """What the test's SIGINT handler raises (Ctrl-C's KeyboardInterrupt would end pytest)."""


def test_an_exception_in_the_callers_wait_cancels_the_run_on_the_loop(
    catch_server: Server,
) -> None:
    """A signal handler's exception while the caller waits for a run stepping from the loop
    (Ctrl-C) is raised, and the run stops between steps: nothing of it is left on the loop."""

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        with dmr.BatchedEnvironment.connect([catch_server.address], 2, seed=1) as batch:
            main = threading.main_thread().ident
            assert main is not None and batch._runner is not None

            def interrupt_once_stepping() -> None:
                deadline = time.monotonic() + 30
                while len(batch.latencies) < 50 and time.monotonic() < deadline:
                    time.sleep(0.01)  # polling the run's progress, with a deadline
                signal.pthread_kill(main, signal.SIGINT)

            interrupter = threading.Thread(target=interrupt_once_stepping)
            interrupter.start()
            with pytest.raises(_Interrupted):
                dmr.collect(batch, 10**9, pipeline=8, timeout=30)
            interrupter.join(30)
            loop = batch._runner.loop

            async def runs_left() -> list[str]:
                names = [task.get_coro().__qualname__ for task in asyncio.all_tasks()]
                return [name for name in names if "run_on_loop" in name]

            deadline = time.monotonic() + 10
            while batch._runner.run(runs_left(), 10) and time.monotonic() < deadline:
                time.sleep(0.01)  # the cancelled run ends at its next wait
            assert batch._runner.run(runs_left(), 10) == []
            while batch.pending():  # its steps in flight are the batch's, and still answered
                batch.recv(batch.pending(), timeout=10)
            assert loop.is_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_policy_gets_the_steps_of_the_worlds_that_just_finished(catch_server: Server) -> None:
    seen: list[list[int]] = []

    def policy(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
        seen.append(timestep.env_ids.tolist())
        return towards_ball(timestep)

    watcher = Watcher()
    with dmr.BatchedEnvironment.connect([catch_server.address], 4, seed=0) as batch:
        stats = dmr.collect(batch, 200, policy=policy, observers=[watcher])
    assert stats.steps == 200 and stats.episodes > 0 and set(stats.returns) == {1.0}
    # The reset's FIRST steps come first, to the observers and the policy, then each batch.
    assert watcher.batches[0].env_ids.tolist() == [0, 1, 2, 3]
    assert watcher.batches[0].step_type.tolist() == [0] * 4
    assert sum(len(ids) for ids in seen) == 200
    # The policy acts for the worlds of each batch; for the last, only as many as steps are left.
    observed = [b.env_ids.tolist() for b in watcher.batches[: len(seen)]]
    assert observed[:-1] == seen[:-1] and observed[-1][: len(seen[-1])] == seen[-1]


def test_an_observer_stops_the_run_between_steps(catch_server: Server) -> None:
    stop = threading.Event()
    watcher = Watcher(stop, stop_at=50)
    with dmr.BatchedEnvironment.connect([catch_server.address], 2, seed=1) as batch:
        stats = dmr.collect(batch, 10_000, stop=stop, observers=[watcher], pipeline=1)
    assert stats.interrupted and 50 <= stats.steps < 60


class ActAt(Watcher):
    """A ``Watcher`` that calls ``act()`` once, on the stepping thread, after ``at`` steps."""

    def __init__(self, at: int, act: Any) -> None:
        super().__init__()
        self.at, self.act, self.done = at, act, False

    def on_steps(self, timestep: dmr.BatchedTimeStep) -> None:
        super().on_steps(timestep)
        if not self.done and sum(len(b.env_ids) for b in self.batches) >= self.at:
            self.done = True
            self.act()


def test_observers_hear_of_restarts(server_process: Any) -> None:
    servers = [server_process(), server_process()]
    watcher = ActAt(100, servers[1].kill)  # worlds 1 and 3: made again on server 0
    with dmr.BatchedEnvironment.connect(
        [s.address for s in servers], 4, seed=0, on_world_failure="restart", step_timeout=5
    ) as batch:
        stats = dmr.collect(batch, 1000, observers=[watcher], pipeline=2)
    restarts = [e for e in watcher.events if e.kind == "restart"]
    assert sorted(e.world for e in restarts) == [1, 3], watcher.events
    assert all(servers[0].address in e.message for e in restarts)
    assert len(stats.restarts) == 2 and stats.worlds_lost == 0


def test_observers_hear_of_the_error_that_ends_the_run(server_process: Any) -> None:
    server = server_process()
    watcher = Watcher()

    class KillAt(Watcher):
        def on_steps(self, timestep: dmr.BatchedTimeStep) -> None:
            if server.process.poll() is None:
                server.kill()

    with (
        dmr.BatchedEnvironment.connect([server.address], 2, seed=0, step_timeout=5) as batch,
        pytest.raises(dmr.WorldError) as caught,
    ):
        dmr.collect(batch, 1000, observers=[watcher, KillAt()], timeout=10)
    errors = [e for e in watcher.events if e.kind == "error"]
    assert len(errors) == 1 and errors[0].world == caught.value.index
    assert str(caught.value) in errors[0].message


def test_bad_arguments_are_named(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect([catch_server.address], 1) as batch:
        with pytest.raises(dmr.ArgumentValueError, match=r"pipeline=4 with a policy"):
            dmr.collect(batch, 10, policy=towards_ball, pipeline=4)
        with pytest.raises(dmr.ArgumentTypeError, match=r"progress is None, True"):
            dmr.collect(batch, 10, progress="yes")  # type: ignore[arg-type]
        with pytest.raises(dmr.ArgumentTypeError, match=r"policy is a callable"):
            dmr.collect(batch, 10, policy={"paddle": 0})  # type: ignore[arg-type]
        with pytest.raises(dmr.ArgumentTypeError, match=r"observers\[0\] has no on_steps"):
            dmr.collect(batch, 10, observers=[print])  # type: ignore[list-item]
        with pytest.raises(dmr.ArgumentTypeError, match=r"steps is a whole number"):
            dmr.collect(batch, 1.5)  # type: ignore[arg-type]
        assert dmr.collect(batch, 0).steps == 0
    with pytest.raises(dmr.ArgumentTypeError, match=r"collect\(\) steps a dmr.BatchedEnvironment"):
        dmr.collect([catch_server.address], 10)  # type: ignore[arg-type]


def test_steps_in_flight_to_a_dead_server_are_made_up(server_process: Any) -> None:
    """Issue 37 defect 7: the steps a restart drops (in flight to the dead server) are sent
    again, so the run takes exactly its steps; the restarts are still listed."""
    servers = [server_process(), server_process()]
    # Stopped, server 1's worlds 1 and 3 get steps that no one answers, until their
    # step_timeout; then they are made again on server 0.
    watcher = ActAt(200, lambda: sigstop(servers[1].process))
    with dmr.BatchedEnvironment.connect(
        [s.address for s in servers], 4, seed=0, on_world_failure="restart", step_timeout=5
    ) as batch:
        stats = dmr.collect(batch, 2000, observers=[watcher], pipeline=8)
        dropped = sum(f.steps_lost - 1 for f in batch.failures if f.steps_lost)
    assert len(stats.restarts) == 2 and stats.worlds_lost == 0
    assert dropped > 0, batch.failures  # steps were in flight to the dead server
    assert stats.steps == 2000 == sum(len(b.env_ids) for b in watcher.batches)


def _taken(batches: list[dmr.BatchedTimeStep], worlds: int) -> list[int]:
    """Steps received per world in ``batches``."""
    ids = [b.env_ids for b in batches]
    return np.bincount(np.concatenate(ids), minlength=worlds).tolist() if ids else [0] * worlds


def test_each_world_takes_its_count_and_resume_goes_on_without_a_reset(
    catch_server: Server,
) -> None:
    """Rounds (collect, do something, collect again): per-world counts, ``stats.waiting``
    (each world's last step, unanswered), ``resume=`` acting on them with no reset."""
    first, second, acted = Watcher(), Watcher(), []

    def policy(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
        acted.append(timestep.env_ids.tolist())
        return towards_ball(timestep)

    with dmr.BatchedEnvironment.connect([catch_server.address], 4, seed=0) as batch:
        stats = dmr.collect(batch, [5, 0, 12, 3], policy=policy, observers=[first])
        assert first.batches[0].step_type.tolist() == [0] * 4  # the reset
        assert stats.steps == 20 and _taken(first.batches[1:], 4) == [5, 0, 12, 3]
        assert stats.waiting is not None and sorted(stats.waiting.env_ids.tolist()) == [0, 1, 2, 3]
        # The waiting steps are each world's latest: world 1's is its reset's FIRST step.
        waiting = dict(zip(stats.waiting.env_ids.tolist(), stats.waiting.step_type, strict=True))
        assert waiting[1] == 0 and waiting[0] == 1
        acted.clear()
        again = dmr.collect(batch, [4, 1, 7, 0], policy=policy, observers=[second], resume=stats)
    # No reset: the policy acted on the waiting steps first; world 1's next step is a MID one.
    assert sorted(acted[0]) == [0, 1, 2] and second.batches[0].step_type.min() >= 1
    assert again.steps == 12 and _taken(second.batches, 4) == [4, 1, 7, 0]
    # World 0 (5 + 4 steps) and world 2 (12 + 7: its second episode) finish an episode each.
    assert again.episodes == 2 and again.returns == [1.0, 1.0]
    assert again.waiting is not None and sorted(again.waiting.env_ids.tolist()) == [0, 1, 2, 3]


def test_an_episode_that_spans_two_runs_counts_once_in_the_run_it_ends_in(
    catch_server: Server,
) -> None:
    """Random actions: the 10-step episode (FIRST and 9 more) of each world is cut 5 + 5
    between two runs; the second counts it, whole, because it resumes the first."""
    with dmr.BatchedEnvironment.connect([catch_server.address], 2, seed=3) as batch:
        stats = dmr.collect(batch, [5, 5], seed=3, pipeline=1)
        assert stats.episodes == 0 and stats.unfinished == 2 and stats.waiting is None
        again = dmr.collect(batch, [5, 5], seed=3, pipeline=1, resume=stats)
    assert again.episodes == 2 and len(again.returns) == 2 and again.unfinished == 0


def test_per_world_counts_and_resume_that_cannot_work_are_named(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect([catch_server.address], 2) as batch:
        with pytest.raises(dmr.ArgumentValueError, match=r"steps has 3 counts .* 2 worlds"):
            dmr.collect(batch, [1, 2, 3])
        with pytest.raises(dmr.ArgumentValueError, match=r"steps\[1\]=-1 cannot work"):
            dmr.collect(batch, [1, -1])
        random_run = dmr.collect(batch, [2, 2])
        with pytest.raises(dmr.ArgumentValueError, match=r"run with random actions, and this"):
            dmr.collect(batch, 2, policy=towards_ball, resume=random_run)
        with pytest.raises(dmr.ArgumentTypeError, match=r"RunStats of an earlier collect"):
            dmr.collect(batch, 2, resume="last time")  # type: ignore[arg-type]
    with (
        dmr.BatchedEnvironment.connect([catch_server.address], 3) as other,
        pytest.raises(dmr.ArgumentTypeError, match=r"batch of 3 worlds"),
    ):
        dmr.collect(other, 2, resume=random_run)


def test_a_batch_is_counted_alike_at_once_and_step_by_step(catch_server: Server) -> None:
    # EpisodeTally.take counts the usual batch (one step per world, no restart) with NumPy
    # calls (_take_apart), others step by step (_take_each): the two count the same.
    from dm_env_rpc_client._stepping.tally import EpisodeTally, RunStats

    rng = np.random.default_rng(7)
    with dmr.BatchedEnvironment.connect([catch_server.address], 5, seed=0) as batch:
        tallies = [EpisodeTally(batch, RunStats(), None, in_episode=False) for _ in range(2)]
        for _ in range(200):
            ids = rng.permutation(5)[: rng.integers(1, 6)]
            kinds = rng.choice(np.array([0, 1, 1, 1, 2], np.uint8), len(ids))
            reward = np.where(kinds == 0, np.nan, rng.normal(size=len(ids)))
            result = dmr.BatchedTimeStep(
                kinds, reward, reward, {}, ids, np.zeros(len(ids), bool), kinds
            )
            for tally in tallies:
                for world in ids.tolist():
                    tally.sent[world].append(world)
            tallies[0]._take_apart(result, ids.tolist(), None)
            assert tallies[1]._take_each(result, ids.tolist(), None) == {}
        fast, slow = tallies
        assert (fast.stats.steps, fast.stats.episodes) == (slow.stats.steps, slow.stats.episodes)
        assert fast.stats.episodes > 20
        assert fast.returns == slow.returns and fast.in_episode == slow.in_episode
        np.testing.assert_array_equal(fast.running, slow.running)
        assert [list(q) for q in fast.sent] == [list(q) for q in slow.sent] == [[]] * 5
