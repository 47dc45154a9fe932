"""Batched stepping under faults: never a wrong, lost or half-sent step (issue 12, defects 1-8)."""

from __future__ import annotations

import os
import pickle
import signal
import statistics
import sys
import time
from typing import Any

import numpy as np
import pytest
from conftest import run_child, sigstop, wait_for
from faulty import (
    Counter,
    faulty_server,
    float_specs,
    lifecycle,
    reference_servicer_server,
    refusing_leave,
    refusing_servers,
)

from dm_env_rpc_client import errors
from dm_env_rpc_client._batch.restart import RestartPolicy
from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.connection import (
    DEFAULT_OPTIONS,
    FAST_KEEPALIVE_DETECTION_S,
    FAST_KEEPALIVE_OPTIONS,
    KEEPALIVE_DETECTION_S,
    connect,
)
from dm_env_rpc_client.environment import create_and_join_world, create_world, join_world
from dm_env_rpc_client.server import serve

ZEROS4 = {"paddle": np.zeros(4, np.int8)}


@pytest.fixture
def counter_server() -> Any:
    Counter.gate.clear()
    Counter.gate_at = -1
    with serve(lambda settings: Counter(**settings)) as server:
        yield server
    Counter.gate.set()


# --- defect 1: a late answer never answers a later request ------------------------------


def test_adaptor_after_a_timeout_gets_the_answer_to_its_own_request(counter_server) -> None:
    Counter.gate_at = 2  # the second step answers late
    with connect(counter_server.address, timeout=10) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=0.3)
        env.reset()
        assert env.step({"a": 0}).observation["count"] == 1
        with pytest.raises(errors.RequestTimeoutError):
            env.step({"a": 0})
        Counter.gate.set()
        third = env.step({"a": 0})
        assert third.observation["count"] == 3  # not the late answer (2) to the step before
        assert third.step_type == dm_env_step_type("MID")


def dm_env_step_type(name: str) -> Any:
    import dm_env

    return dm_env.StepType[name]


def test_batch_after_a_timeout_drops_the_late_answer(counter_server) -> None:
    Counter.gate_at = 2  # a blocked step holds its whole server: world 1 lives on another
    with (
        serve(lambda settings: Counter(**settings)) as other,
        BatchedEnvironment.connect([counter_server.address, other.address], 2) as envs,
    ):
        envs.reset()
        actions = {"a": np.zeros(2, np.int8)}
        envs.send({"a": np.zeros(1, np.int8)}, [0])  # world 0 is one step ahead
        envs.recv(env_ids=[0], timeout=10)
        envs.send(actions, [0, 1])  # world 0's second step waits at the gate
        with pytest.raises(errors.WorldTimeoutError) as info:
            envs.recv(env_ids=[0, 1], timeout=0.3)
        assert isinstance(info.value, TimeoutError) and info.value.index == 0
        assert isinstance(info.value.__cause__, errors.RequestTimeoutError)
        Counter.gate.set()
        healthy = envs.recv(1, timeout=10)  # world 1's step was kept
        assert healthy.env_ids.tolist() == [1] and healthy.observation["count"].tolist() == [1]
        assert envs.pending() == 0
        assert [f.outcome for f in envs.failures] == ["raised"]
        assert envs.failures[0].steps_lost == 1


# --- defect 2: all or nothing -------------------------------------------------------------


def test_a_refused_action_sends_nothing(counter_server) -> None:
    with BatchedEnvironment.connect([counter_server.address], 3) as envs:
        envs.reset()
        with pytest.raises(errors.WorldError, match="World 2") as info:
            envs.step({"a": np.array([0, 1, 5], np.int8)})  # 5 is out of bounds for world 2
        assert isinstance(info.value.__cause__, errors.SpecValidationError)
        assert envs.pending() == 0
        step = envs.step({"a": np.zeros(3, np.int8)})
        assert step.observation["count"].tolist() == [1, 1, 1]  # no world took a step before


# --- defect 7: bad arguments and decode errors --------------------------------------------


def test_bad_arguments_get_clear_errors(counter_server) -> None:
    with BatchedEnvironment.connect([counter_server.address], 2) as envs:
        envs.reset()
        with pytest.raises(errors.SpecValidationError, match="got NoneType"):
            envs.step(None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="env_ids holds 5; give world indices from 0 to 1"):
            envs.send({"a": np.zeros(1, np.int8)}, [5])
        with pytest.raises(ValueError, match="env_ids holds -1"):
            envs.send({"a": np.zeros(1, np.int8)}, [-1])
        with pytest.raises(ValueError, match="env_ids holds 0.5"):
            envs.send({"a": np.zeros(1, np.int8)}, [0.5])  # type: ignore[list-item]
        assert envs.pending() == 0
        envs.send({"a": np.zeros(1, np.int8)}, [np.int64(1)])  # NumPy indices are fine
        assert envs.recv(1, timeout=10).env_ids.tolist() == [1]
        with pytest.raises(errors.SpecValidationError, match="list"):
            envs.envs[0].step([1])  # type: ignore[arg-type]


def test_an_undecodable_observation_names_its_world_and_keeps_the_others(counter_server) -> None:
    specs = float_specs((2,))

    def answer(request: Any) -> Any:
        done = lifecycle(request, specs)
        if done is not None:
            return done
        tensor = dm_env_rpc_pb2.Tensor(shape=[3])  # 3 elements promised, 2 sent
        tensor.floats.array.extend([1.0, 2.0])
        step = dm_env_rpc_pb2.StepResponse(state=dm_env_rpc_pb2.RUNNING, observations={1: tensor})
        return dm_env_rpc_pb2.EnvironmentResponse(step=step)

    with (
        faulty_server(answer) as bad,
        BatchedEnvironment.connect([bad, counter_server.address], 2) as envs,
    ):
        envs.send({}, [0])
        envs.send({"a": np.zeros(1, np.int8)}, [1])
        assert wait_for(lambda: envs._ready == 2)
        with pytest.raises(errors.WorldError, match="World 0") as info:
            envs.recv(2, timeout=10)
        assert info.value.index == 0 and info.value.address == bad
        assert isinstance(info.value.__cause__, (errors.TensorError, errors.ObservationError))
        kept = envs.recv(1, timeout=10)
        assert kept.env_ids.tolist() == [1] and envs.pending() == 0


# --- defect 3: no received step is dropped -------------------------------------------------


def test_killing_a_server_loses_no_healthy_step(server_process) -> None:
    servers = [server_process() for _ in range(2)]
    with BatchedEnvironment.connect([s.address for s in servers], 4, timeout=20) as envs:
        envs.reset()
        sent, received = [0] * 4, [0] * 4
        ready = [0, 1, 2, 3]
        for _ in range(4):  # four steps in flight per world
            envs.send(ZEROS4, ready)
            for index in ready:
                sent[index] += 1
        failed: set[int] = set()
        for turn in range(200):
            if turn == 20:
                servers[1].kill()  # worlds 1 and 3
            try:
                batch = envs.recv(1, timeout=10)
            except errors.WorldError as error:
                failed.add(error.index)
                continue
            ids = batch.env_ids.tolist()
            for index in ids:
                received[index] += 1
            again = [i for i in ids if i not in failed]
            if turn < 150 and again:
                envs.send({"paddle": np.zeros(len(again), np.int8)}, again)
                for index in again:
                    sent[index] += 1
            if turn >= 150 and envs.pending() == 0:
                break
        assert failed == {1, 3}
        assert received[0] == sent[0] and received[2] == sent[2]  # every healthy step came back
        lost = {f.index: f.steps_lost for f in envs.failures}
        assert received[1] + lost[1] == sent[1] and received[3] + lost[3] == sent[3]


def test_a_reset_that_fails_for_one_world_still_resets_the_others(server_process) -> None:
    servers = [server_process() for _ in range(2)]
    with BatchedEnvironment.connect([s.address for s in servers], 4, timeout=20) as envs:
        envs.reset()
        mid = envs.step(ZEROS4)
        assert mid.step_type.tolist() == [1, 1, 1, 1]
        servers[1].kill()  # worlds 1 and 3
        with pytest.raises(errors.WorldError) as info:
            envs.reset([3, 0, 1, 2], timeout=10)
        assert info.value.index == 3  # the first of env_ids to fail
        firsts = info.value.reset_steps
        assert firsts is not None and firsts.env_ids.tolist() == [0, 2]  # not lost
        assert firsts.first().all() and firsts.observation["board"].shape[0] == 2
        copied = pickle.loads(pickle.dumps(info.value))  # as Ray hands it to the driver
        assert copied.index == 3 and copied.reset_steps.env_ids.tolist() == [0, 2]
        # The healthy worlds go on: they step, and reset again.
        envs.send({"paddle": np.zeros(2, np.int8)}, [0, 2])
        assert envs.recv(2, timeout=10).step_type.tolist() == [1, 1]
        assert envs.reset([0, 2], timeout=10).first().all()


# --- defect 4: a stalled world is reported while the others run ----------------------------


def test_a_stopped_server_is_reported_within_the_step_timeout(server_process) -> None:
    servers = [server_process() for _ in range(2)]
    envs = BatchedEnvironment.connect([s.address for s in servers], 4, step_timeout=1.0)
    try:
        envs.reset()
        envs.step(ZEROS4, timeout=10)
        sigstop(servers[1].process)
        stopped = time.monotonic()
        envs.send(ZEROS4, [0, 1, 2, 3])
        healthy = envs.recv(2, timeout=10)
        assert sorted(healthy.env_ids.tolist()) == [0, 2]
        for world in (1, 3):  # each stalled world is reported once, oldest first
            with pytest.raises(errors.WorldTimeoutError, match="step_timeout of 1.0 s") as info:
                envs.recv(1, timeout=10)
            assert info.value.index == world and info.value.address == servers[1].address
        assert time.monotonic() - stopped < 1.0 + 0.25 + 2  # timeout + check interval + slack
        assert envs.pending() == 0
        envs.send({"paddle": np.zeros(2, np.int8)}, [0, 2])  # the healthy worlds go on
        assert sorted(envs.recv(2, timeout=10).env_ids.tolist()) == [0, 2]
    finally:
        os.kill(servers[1].process.pid, signal.SIGCONT)
        envs.close(timeout=2)


def test_keepalive_finds_a_stopped_server_without_any_timeout(server_process) -> None:
    """No request timeout, no step_timeout: keepalive alone ends what waits on a stopped server,
    within FAST_KEEPALIVE_DETECTION_S with the fast options the SDK's server accepts, for a
    plain Connection and for the batch's worlds."""
    servers = [server_process() for _ in range(2)]
    envs = BatchedEnvironment.connect(
        [s.address for s in servers], 4, step_timeout=None, options=FAST_KEEPALIVE_OPTIONS
    )
    conn = connect(servers[1].address, timeout=10, options=FAST_KEEPALIVE_OPTIONS)
    try:
        envs.reset()
        env = join_world(conn, create_world(conn, {}, timeout=10), timeout=10)
        env.reset()
        sigstop(servers[1].process)
        stopped = time.monotonic()
        envs.send(ZEROS4, [0, 1, 2, 3])
        pending = conn.send_async(dm_env_rpc_pb2.StepRequest())
        assert sorted(envs.recv(2, timeout=10).env_ids.tolist()) == [0, 2]
        failed = []
        for _ in (1, 3):  # each stalled world is reported once; None of them hangs
            with pytest.raises(errors.WorldError) as info:
                envs.recv(1, timeout=60)
            assert not isinstance(info.value, errors.WorldTimeoutError)
            assert isinstance(info.value.__cause__, errors.ConnectionClosedError)
            failed.append(info.value.index)
        assert sorted(failed) == [1, 3]
        error = pending.exception(timeout=60)
        assert isinstance(error, errors.ConnectionClosedError), error
        assert "ping timeout" in str(error) or "keepalive timeout" in str(error)
        # The documented bound, with room for a loaded machine.
        assert time.monotonic() - stopped < FAST_KEEPALIVE_DETECTION_S + 15
        envs.send({"paddle": np.zeros(2, np.int8)}, [0, 2])  # the healthy worlds go on
        assert sorted(envs.recv(2, timeout=10).env_ids.tolist()) == [0, 2]
    finally:
        os.kill(servers[1].process.pid, signal.SIGCONT)
        conn.close()
        envs.close(timeout=2)


# --- defect 5 and 8: bounded by default, quiet, cheap -------------------------------------


_FAILED_CONNECTS = """
import socket
import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.catch import Catch

probe = socket.socket()
probe.bind(("127.0.0.1", 0))
nobody = f"127.0.0.1:{probe.getsockname()[1]}"
probe.close()
with dmr.serve(Catch) as server:
    cases = [[server.address]] * 12 + [[nobody], [server.address, nobody]] * 2
    for addresses in cases:
        settings = {"bogus": 1} if addresses == [server.address] else {}
        try:
            dmr.BatchedEnvironment.connect(
                addresses, 4, timeout=1, create_world_settings=settings
            )
        except dmr.WorldError:
            pass
    with dmr.BatchedEnvironment.connect(server.address, 2) as envs:  # the next one works
        envs.reset()
print("ok")
"""


def test_failed_connects_print_nothing() -> None:
    """gRPC printed "RuntimeError: Event loop is closed" tracebacks after a failed connect."""
    result = run_child([sys.executable, "-c", _FAILED_CONNECTS], timeout=90)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
    assert result.stderr == ""


def test_close_is_cheap_right_after_connect(catch_server) -> None:
    times = []
    for _ in range(5):
        conn = connect(catch_server.address, timeout=10)
        started = time.perf_counter()
        conn.close()
        times.append(time.perf_counter() - started)
    # gRPC's connectivity poll made every close take 0.2 s; now it takes about 1 ms.
    assert statistics.median(times) < 0.1


def test_adaptors_time_out_by_default(catch_server) -> None:
    with connect(catch_server.address, timeout=10) as conn:
        env, _ = create_and_join_world(conn, {}, {})
        assert env._timeout == 60.0
        env.close()


def test_close_destroys_the_world_when_leave_is_refused() -> None:
    seen: list[str] = []
    answer = refusing_leave(float_specs(), seen)

    with faulty_server(answer) as address, connect(address, timeout=10) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=5)
        with pytest.raises(errors.DmEnvRpcError, match="cannot leave"):
            env.close()
        assert seen[-2:] == ["leave_world", "destroy_world"]
        env.close()  # idempotent


def _reference_server(answer: Any) -> Any:
    """A server built on the reference package's servicer (default gRPC server options)."""
    from dm_env_rpc.v1 import dm_env_rpc_pb2 as ref_pb2
    from dm_env_rpc.v1 import dm_env_rpc_pb2_grpc as ref_grpc

    class Servicer(ref_grpc.EnvironmentServicer):
        def Process(self, request_iterator: Any, context: Any) -> Any:
            for request in request_iterator:
                ours = dm_env_rpc_pb2.EnvironmentRequest.FromString(request.SerializeToString())
                yield ref_pb2.EnvironmentResponse.FromString(answer(ours).SerializeToString())

    return reference_servicer_server(Servicer(), max_workers=4)


@pytest.mark.parametrize("kind", ["default grpc server", "reference servicer"])
def test_a_stream_idle_for_seconds_under_fast_pings_stays_usable(kind: str) -> None:
    """A stream pinged every 0.5 s, idle twice for 2.5 s, on a server with gRPC's default ping
    limits: no GOAWAY in that time, and it steps after each idle spell. Seconds only: the
    default keepalive's fit with that policy over minutes is
    test_default_keepalive_keeps_to_the_ping_policy_of_a_default_grpc_server's."""
    specs = float_specs()
    fast = [("grpc.keepalive_time_ms", 500), ("grpc.keepalive_timeout_ms", 2_000)]

    def answer(request: Any) -> Any:
        done = lifecycle(request, specs)
        if done is not None:
            return done
        tensor = dm_env_rpc_pb2.Tensor(shape=[2])
        tensor.floats.array.extend([1.0, 2.0])
        step = dm_env_rpc_pb2.StepResponse(state=dm_env_rpc_pb2.RUNNING, observations={1: tensor})
        return dm_env_rpc_pb2.EnvironmentResponse(step=step)

    server = faulty_server(answer) if kind == "default grpc server" else _reference_server(answer)
    with server as address, connect(address, timeout=10, options=fast) as conn:
        env = join_world(conn, "w", timeout=5)
        env.reset()
        # Idle on purpose for ten keepalive periods, busy, then idle again: a server that
        # counted the pings as abuse would send GOAWAY (too_many_pings) and end the stream.
        for _ in range(2):
            time.sleep(2.5)
            assert not conn.closed
            for _ in range(50):
                assert env.step({}).observation["x"].tolist() == [1.0, 2.0]


# --- the restart policy ----------------------------------------------------------------------

FAST = RestartPolicy(attempts=6, total=20.0, backoff=0.05, max_backoff=0.5, connect_timeout=1.0)


def _drive(envs: BatchedEnvironment, turns: int, on_turn: Any = None) -> dict[str, Any]:
    """Steps every live world with one step in flight each, for ``turns`` recvs and until two
    worlds were restarted (at most 30 s); returns step counts and the flags seen."""
    seen: dict[str, Any] = {"steps": [0] * 4, "truncated": [], "first": []}
    envs.send({"paddle": np.zeros(len(envs.live_ids), np.int8)}, envs.live_ids)
    deadline = time.monotonic() + 30
    turn = 0
    while turn < turns or (len(seen["truncated"]) < 2 and time.monotonic() < deadline):
        if on_turn is not None:
            on_turn(turn, seen)
        turn += 1
        batch = envs.recv(1, timeout=20)
        ids = batch.env_ids.tolist()
        for position, index in enumerate(ids):
            seen["steps"][index] += 1
            if batch.truncated[position]:
                seen["truncated"].append(index)
                seen["first"].append(int(batch.step_type[position]))
        envs.send({"paddle": np.zeros(len(ids), np.int8)}, ids)
    return seen


def test_a_killed_server_costs_its_worlds_an_episode_not_the_run(server_process) -> None:
    servers = [server_process() for _ in range(2)]
    addresses = [s.address for s in servers]
    envs = BatchedEnvironment.connect(
        addresses, 4, on_world_failure="restart", restart=FAST, step_timeout=5
    )
    try:
        envs.reset()
        growth: dict[str, int] = {}

        def kill_then_watch(turn: int, seen: dict[str, Any]) -> None:
            if turn == 40:
                servers[1].kill()  # worlds 1 and 3
                growth["healthy_at_kill"] = seen["steps"][0] + seen["steps"][2]
            if turn == 80:
                growth["healthy_later"] = seen["steps"][0] + seen["steps"][2]

        seen = _drive(envs, 400, kill_then_watch)
        assert growth["healthy_later"] > growth["healthy_at_kill"]
        assert sorted(seen["truncated"]) == [1, 3]  # each restarted world flagged once
        assert set(seen["first"]) == {int(dm_env_step_type("FIRST"))}
        restarts = [f for f in envs.failures if f.outcome == "restarted"]
        assert sorted(f.index for f in restarts) == [1, 3]
        for failure in restarts:
            assert failure.address == addresses[1] and failure.new_address == addresses[0]
            assert isinstance(failure.cause, errors.ConnectionClosedError)
            assert failure.attempts >= 2 and failure.downtime > 0 and failure.steps_lost == 1
        assert envs.addresses == [addresses[0]] * 4
        assert seen["steps"][1] > 10 and seen["steps"][3] > 10  # they step again, elsewhere
    finally:
        envs.close(timeout=5)
    assert wait_for(lambda: not _batch_threads(), timeout=5)  # nothing left behind


def _batch_threads() -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name == "dm_env_rpc_client-batched"]


def test_a_world_comes_back_on_its_own_restarted_server(server_process) -> None:
    server = server_process()
    port = server.address.rsplit(":", 1)[1]
    envs = BatchedEnvironment.connect(
        [server.address], 2, on_world_failure="restart", restart=FAST, step_timeout=5
    )
    try:
        envs.reset()
        envs.step({"paddle": np.zeros(2, np.int8)}, timeout=10)
        server.kill()
        envs.send({"paddle": np.zeros(2, np.int8)}, [0, 1])
        again = server_process("catch", "--port", port)  # the same port, a new process
        assert again.address == server.address
        batch = envs.recv(env_ids=[0, 1], timeout=20)
        assert batch.first().all() and batch.truncated.all()
        assert [f.new_address for f in envs.failures] == [server.address] * 2
        after = envs.step({"paddle": np.zeros(2, np.int8)}, timeout=10)
        assert not after.truncated.any() and not after.first().any()
    finally:
        envs.close(timeout=5)


def test_a_stopped_server_s_worlds_restart_elsewhere(server_process) -> None:
    servers = [server_process() for _ in range(2)]
    addresses = [s.address for s in servers]
    envs = BatchedEnvironment.connect(
        addresses, 4, on_world_failure="restart", restart=FAST, step_timeout=1.0
    )
    try:
        envs.reset()
        sigstop(servers[1].process)
        stopped = time.monotonic()
        seen = _drive(envs, 300)
        assert sorted(seen["truncated"]) == [1, 3]
        detected = [f.time for f in envs.failures]
        assert all(f.outcome == "restarted" for f in envs.failures)
        assert all(isinstance(f.cause, errors.RequestTimeoutError) for f in envs.failures)
        assert {f.new_address for f in envs.failures} == {addresses[0]}
        assert len(detected) == 2
        assert seen["steps"][0] > 50 and seen["steps"][2] > 50
        assert time.monotonic() - stopped < 60
    finally:
        os.kill(servers[1].process.pid, signal.SIGCONT)
        envs.close(timeout=5)


def test_a_world_that_cannot_be_restored_is_removed(server_process, tmp_path, monkeypatch) -> None:
    flag, servers = refusing_servers(server_process, tmp_path, monkeypatch)
    addresses = [s.address for s in servers]
    policy = RestartPolicy(
        attempts=3, total=10.0, backoff=0.01, max_backoff=0.05, connect_timeout=0.5
    )
    envs = BatchedEnvironment.connect(addresses, 4, on_world_failure="restart", restart=policy)
    try:
        envs.reset()
        flag.touch()  # from now on both servers refuse CreateWorld
        servers[1].kill()  # worlds 1 and 3: their server is gone, the other one refuses
        steps = [0] * 4
        envs.send({"paddle": np.zeros(4, np.int8)}, [0, 1, 2, 3])
        deadline = time.monotonic() + 30
        while envs.live_ids != [0, 2] or envs.pending() > 2:
            assert time.monotonic() < deadline, envs.failures
            batch = envs.recv(1, timeout=20)
            ids = batch.env_ids.tolist()
            for index in ids:
                steps[index] += 1
            envs.send({"paddle": np.zeros(len(ids), np.int8)}, ids)
        assert steps[0] > 0 and steps[2] > 0  # the healthy worlds went on meanwhile
        assert sorted(f.index for f in envs.failures) == [1, 3]
        for failure in envs.failures:
            assert failure.outcome == "removed" and failure.attempts == 3
            assert isinstance(failure.cause, errors.ConnectionClosedError)
            assert "no more worlds" in str(failure.last_error) or isinstance(
                failure.last_error, errors.ConnectTimeoutError
            )
        assert len(envs) == 2
        step = envs.step({"paddle": np.zeros(2, np.int8)}, timeout=10)  # the batch goes on
        assert step.env_ids.tolist() == [0, 2]
        with pytest.raises(errors.WorldError, match="removed from the batch after 3"):
            envs.send({"paddle": np.zeros(1, np.int8)}, [1])
    finally:
        envs.close(timeout=5)


def test_step_iter_after_a_timeout_keeps_step_types_right(counter_server) -> None:
    Counter.gate_at = 3
    with connect(counter_server.address, timeout=10) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=0.3)
        env.reset()
        with pytest.raises(errors.RequestTimeoutError):
            list(env.step_iter([{"a": 0}] * 6, in_flight=4))
        Counter.gate.set()
        after = env.step({"a": 0})  # answered after the six late ones, in order
        assert after.observation["count"] == 7 and after.step_type == dm_env_step_type("MID")


def test_step_async_over_a_broken_stream_loses_no_step_and_makes_none_wrong() -> None:
    """The server's handler fails at its 4th step, which breaks the stream. The TimeSteps of the
    3 steps answered before are made from their responses whenever they are asked for (after
    the break too, in any order); the steps after fail with ConnectionClosedError."""
    specs = float_specs()
    count = [0]

    def answer(request: dm_env_rpc_pb2.EnvironmentRequest) -> Any:
        done = lifecycle(request, specs)
        if done is not None:
            return done
        count[0] += 1
        if count[0] == 4:
            raise RuntimeError("the handler fails: gRPC aborts the stream")
        tensor = dm_env_rpc_pb2.Tensor(shape=[2])
        tensor.floats.array.extend([float(count[0]), 0.0])
        step = dm_env_rpc_pb2.StepResponse(state=dm_env_rpc_pb2.RUNNING, observations={1: tensor})
        return dm_env_rpc_pb2.EnvironmentResponse(step=step)

    with faulty_server(answer) as address, connect(address, timeout=10) as conn:
        env, _ = create_and_join_world(conn, {}, {}, timeout=10)
        futures = [env.step_async({}) for _ in range(6)]
        for future in futures[3:]:
            assert isinstance(future.exception(timeout=10), errors.ConnectionClosedError)
        assert conn.closed
        counts = [future.result().observation for future in reversed(futures[:3])]
    assert [float(x["x"][0]) for x in reversed(counts)] == [1.0, 2.0, 3.0]
    assert [future.result().step_type for future in futures[:3]] == [
        dm_env_step_type("FIRST"),
        dm_env_step_type("MID"),
        dm_env_step_type("MID"),
    ]


def test_default_keepalive_keeps_to_the_ping_policy_of_a_default_grpc_server() -> None:
    """A server with gRPC's default policy takes one ping per 5 minutes while it sends no data
    and ends the connection (GOAWAY too_many_pings) after two faster ones: the default pings
    no faster, and KEEPALIVE_DETECTION_S is what that pace gives."""
    options = dict(DEFAULT_OPTIONS)
    assert options["grpc.keepalive_time_ms"] >= 300_000
    found_ms = options["grpc.keepalive_time_ms"] + options["grpc.keepalive_timeout_ms"]
    assert found_ms == KEEPALIVE_DETECTION_S * 1000
    assert options["grpc.http2.ping_timeout_ms"] <= options["grpc.keepalive_timeout_ms"]
    fast = dict(FAST_KEEPALIVE_OPTIONS)
    assert (
        fast["grpc.keepalive_time_ms"] + fast["grpc.keepalive_timeout_ms"]
    ) == FAST_KEEPALIVE_DETECTION_S * 1000
