"""Ray integration: server fleets and sharded stepping on one local Ray of this machine.

One Ray (``num_cpus=2``, no dashboard, loopback addresses only) serves the whole
module and is shut down at its end; every test checks it leaves no actor,
placement group or process behind.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import trustme
from conftest import run_child, wait_for
from faulty import refusing_servers

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.catch import Catch
from dm_env_rpc_client.stepping import RunStats

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
rayi = pytest.importorskip("dm_env_rpc_client.integrations.ray")
# Ray workers cannot import this test module: its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CPUS = 2
FRACTION = 0.5  # CPUs per server or shard actor: two servers and two shards fit in 2 CPUs


def make_catch(settings: dict) -> Catch:
    return Catch(**settings)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (dead, not yet reaped by its Ray parent) counts as gone.
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _descendants(root: int) -> set[int]:
    """The live processes below ``root`` (this test's Ray: its GCS, raylet and workers)."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {pid for pid in found if _alive(pid)}


def _all_free() -> bool:
    """Every CPU is free again and every placement group removed."""
    groups = ray.util.placement_group_table().values()
    return ray.available_resources().get("CPU") == CPUS and all(
        group["state"] == "REMOVED" for group in groups
    )


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray for the module; at the end, none of its processes may be left.

    ``ray.init`` changes this process's environment (``RAY_AUTH_MODE``,
    ``PYTHONBREAKPOINT``, ...) and ``ray.shutdown`` leaves it so: it is put back, so
    that later tests' subprocesses do not inherit it.
    """
    before = _descendants(os.getpid())
    environment = dict(os.environ)
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # set by conftest: loopback
    assert rayi.init_ray("local", num_cpus=CPUS, log_to_driver=False)
    try:
        yield
    finally:
        started = _descendants(os.getpid()) - before  # Ray's processes, found while they run
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environment)
        assert started
        assert wait_for(lambda: not any(_alive(pid) for pid in started), timeout=30)


@pytest.fixture
def clean_ray(local_ray: None) -> Iterator[None]:
    """Checks that the test left no actor, placement group or reserved CPU behind."""
    yield
    assert wait_for(_all_free, timeout=30), (ray.available_resources(), ray.cluster_resources())


def _step(addresses: list[str], worlds: int = 4, **connect: object) -> int:
    with dmr.BatchedEnvironment.connect(addresses, worlds, timeout=30, **connect) as batch:
        batch.reset()
        steps = batch.step({"paddle": np.zeros(worlds, np.int8)})
        return len(steps.env_ids)


def test_fleet_serves_and_closes_leaving_nothing(clean_ray: None) -> None:
    fleet = rayi.ServerFleet(make_catch, 2, num_cpus=FRACTION)
    with fleet:
        servers = fleet.servers()
        assert [s.server for s in servers] == [0, 1]
        addresses = fleet.addresses
        assert len(set(addresses)) == 2
        assert all(a.startswith("127.0.0.1:") for a in addresses)  # the node's IP (loopback here)
        assert [h.ok for h in fleet.health()] == [True, True]
        assert _step(addresses) == 4
    pids = [s.pid for s in servers]
    assert wait_for(lambda: not any(_alive(pid) for pid in pids), timeout=30)
    fleet.close()  # idempotent
    with pytest.raises(rayi.FleetError, match="closed"):
        fleet.addresses  # noqa: B018


def test_fleet_restarts_a_killed_server_and_reports_its_address(clean_ray: None) -> None:
    with rayi.ServerFleet(make_catch, 2, num_cpus=FRACTION, max_restarts=1) as fleet:
        first = fleet.servers()
        os.kill(first[0].pid, signal.SIGKILL)
        assert wait_for(lambda: fleet.servers()[0].pid != first[0].pid, timeout=60)
        now = fleet.servers()
        assert fleet.restarts == 1
        assert now[1] == first[1]
        # Same node, port free again: it binds its old address.
        assert now[0].address == first[0].address
        assert [h.ok for h in fleet.health()] == [True, True]
        assert _step(fleet.addresses) == 4


def test_fleet_reports_a_server_dead_beyond_its_restarts(clean_ray: None) -> None:
    with rayi.ServerFleet(make_catch, 1, num_cpus=FRACTION, max_restarts=0, timeout=10) as fleet:
        memos = list(pathlib.Path(tempfile.gettempdir()).glob(f"*{fleet._fleet_id}*"))
        assert len(memos) == 1  # the server's port, for a restart on this node
        os.kill(fleet.servers()[0].pid, signal.SIGKILL)
        assert wait_for(lambda: not fleet.health(timeout=2)[0].ok, timeout=30)
        health = fleet.health(timeout=2)[0]
        assert health.address is None and "Actor" in (health.error or "")
        with pytest.raises(rayi.FleetError, match="Server 0 of the fleet"):
            fleet.servers(timeout=2)
    assert not memos[0].exists()  # close() removes what the killed server left


def test_fleet_that_cannot_be_placed_says_what_to_do(clean_ray: None) -> None:
    with pytest.raises(rayi.FleetError, match="could not place 2 servers of 8 CPU") as caught:
        rayi.ServerFleet(make_catch, 2, num_cpus=8, timeout=1)
    assert "num_cpus" in str(caught.value)
    with pytest.raises(ValueError, match="Unknown placement strategy 'SPREADS'"):
        rayi.ServerFleet(make_catch, 2, strategy="SPREADS")
    with pytest.raises(
        ValueError, match="num_servers=0 cannot work: pass a whole number of at least 1"
    ):
        rayi.ServerFleet(make_catch, 0)


def test_fleet_serves_tls_with_credentials_passed_through(clean_ray: None) -> None:
    authority = trustme.CA()
    cert = authority.issue_cert("localhost")
    chain = b"".join(blob.bytes() for blob in cert.cert_chain_pems)
    server_credentials = functools.partial(
        grpc.ssl_server_credentials, [(cert.private_key_pem.bytes(), chain)]
    )
    client_credentials = grpc.ssl_channel_credentials(authority.cert_pem.bytes())
    with rayi.ServerFleet(
        make_catch, 1, num_cpus=FRACTION, host="localhost", credentials=server_credentials
    ) as fleet:
        assert fleet.addresses[0].startswith("localhost:")
        assert fleet.health(credentials=client_credentials)[0].ok
        assert not fleet.health(timeout=1)[0].ok  # plaintext to a TLS server gets no answer
        assert _step(fleet.addresses, 2, credentials=client_credentials) == 2


def test_fleet_keeps_strangers_out_with_mutual_tls_and_a_token(clean_ray: None) -> None:
    authority, stranger = trustme.CA(), trustme.CA()
    server, client = authority.issue_cert("localhost"), authority.issue_cert("client@example")
    server_credentials = functools.partial(
        grpc.ssl_server_credentials,
        [(server.private_key_pem.bytes(), server.cert_chain_pems[0].bytes())],
        root_certificates=authority.cert_pem.bytes(),
        require_client_auth=True,
    )

    def credentials_of(cert: Any) -> Callable[[], grpc.ChannelCredentials]:
        """Picklable: a shard makes them (credential objects do not travel)."""
        return functools.partial(
            grpc.ssl_channel_credentials,
            authority.cert_pem.bytes(),
            private_key=cert.private_key_pem.bytes(),
            certificate_chain=cert.cert_chain_pems[0].bytes(),
        )

    client_credentials = credentials_of(client)

    with rayi.ServerFleet(
        make_catch, 1, num_cpus=FRACTION, host="localhost", credentials=server_credentials,
        token="fleet-token",
    ) as fleet:  # fmt: skip
        assert fleet.metadata == dmr.token_metadata("fleet-token")
        assert fleet.health(credentials=client_credentials())[0].ok  # it sends the token
        address = fleet.addresses[0]
        with (
            dmr.connect(address, credentials=client_credentials(), timeout=30) as conn,
            pytest.raises(dmr.AuthenticationError, match="carries none"),
        ):
            conn.send(dmr.dm_env_rpc_pb2.CreateWorldRequest(), timeout=30)
        other = credentials_of(stranger.issue_cert("client@example"))
        with pytest.raises(dmr.AuthenticationError, match="client certificate it trusts"):
            dmr.connect(address, credentials=other(), metadata=fleet.metadata, timeout=30)
        run = rayi.run_sharded(  # the fleet's token, and each shard makes its credentials
            fleet, num_worlds=2, num_shards=1, steps=20, seed=0, credentials=client_credentials
        )
        assert run.stats.steps == 20
        with pytest.raises(rayi.ShardError, match="client certificate it trusts"):
            rayi.run_sharded(
                fleet, num_worlds=1, num_shards=1, steps=5, credentials=other, timeout=20
            )


def _catch_policy(timestep: dmr.BatchedTimeStep) -> dict[str, np.ndarray]:
    """Moves the paddle towards the ball: deterministic, so recorded actions can be checked."""
    boards = timestep.observation["board"]
    actions = []
    for board in boards:
        ball = np.argwhere(board[:-1] > 0)
        paddle = int(np.argmax(board[-1]))
        target = int(ball[0][1]) if len(ball) else paddle
        actions.append(int(np.sign(target - paddle)))
    return {"paddle": np.asarray(actions, np.int8)}


def test_sharded_run_adds_up_and_records_every_shard(
    clean_ray: None, tmp_path: pathlib.Path
) -> None:
    record = tmp_path / "episodes"
    with rayi.ServerFleet(make_catch, 2, num_cpus=FRACTION) as fleet:
        seen: list[int] = []
        run = rayi.run_sharded(
            fleet,
            num_worlds=8,
            num_shards=2,
            steps=1200,
            seed=7,
            record=record,
            num_cpus=FRACTION,
            progress=seen.append,
        )
    assert [s.worlds for s in run.shards] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    total, parts = run.stats, [s.stats for s in run.shards]
    assert total.worlds == 8 and run.steps == 1200 == sum(p.steps for p in parts)
    assert total.episodes == sum(p.episodes for p in parts) > 0
    assert total.returns == parts[0].returns + parts[1].returns
    assert total.episodes == len(total.returns)
    assert total.world_seeds == list(range(7, 15))  # world i created with seed + i
    latencies = np.concatenate([p.latencies for p in parts]) * 1e3
    assert latencies.size == 1200
    assert run.latency_p99_ms == pytest.approx(np.percentile(latencies, 99))
    assert total.elapsed == max(p.elapsed for p in parts)
    assert all(s.cpu > 0 for s in run.shards)
    assert seen and seen[-1] <= 1200 and seen == sorted(seen)
    # Every shard's episodes came back into one folder, and every one loads.
    assert run.recorded == sorted(record.glob("episode_*.npz"))
    episodes = list(dmr.iter_episodes(record))
    assert len(episodes) == len(run.recorded)
    assert {e.world for e in episodes} == set(range(8))
    assert all(e.seed == 7 + e.world for e in episodes)  # world i created with seed + i
    complete = [e for e in episodes if not e.truncated]
    assert len(complete) == total.episodes
    assert sorted(float(np.nansum(e.reward)) for e in complete) == sorted(total.returns)
    assert total.recorded_episodes == len(episodes) == sum(p.recorded_episodes for p in parts)


def test_sharded_run_steps_with_a_policy_in_the_shards(
    clean_ray: None, tmp_path: pathlib.Path
) -> None:
    with rayi.ServerFleet(make_catch, 2, num_cpus=FRACTION) as fleet:
        run = rayi.run_sharded(
            fleet.addresses,
            num_worlds=4,
            num_shards=2,
            steps=400,
            seed=0,
            policy=_catch_policy,
            record=tmp_path / "policy",
            num_cpus=FRACTION,
        )
    assert run.steps == 400 and run.stats.episodes > 0
    assert all(r == 1.0 for r in run.stats.returns)  # the policy always catches
    for episode in dmr.iter_episodes(tmp_path / "policy"):
        # The recorded action at t is what the policy chose for observation t.
        for t in range(len(episode)):
            expected = _catch_policy(_one(episode.observation["board"][t]))
            assert episode.action["paddle"][t] == expected["paddle"][0]


def _one(board: np.ndarray) -> dmr.BatchedTimeStep:
    return dmr.BatchedTimeStep(
        step_type=np.zeros(1, np.uint8),
        reward=np.zeros(1),
        discount=np.ones(1),
        observation={"board": board[None]},
        env_ids=np.zeros(1, np.int64),
    )


def test_a_server_killed_mid_run_is_restarted_and_the_run_completes(clean_ray: None) -> None:
    """Ray restarts the fleet's server; the shards' worlds restart on it or the other one."""
    with rayi.ServerFleet(make_catch, 2, num_cpus=FRACTION, max_restarts=1) as fleet:
        victim = fleet.servers()[0]
        killed = []

        def kill_once(total: int) -> None:  # the progress callback, in this process
            if total >= 300 and not killed:
                os.kill(victim.pid, signal.SIGKILL)
                killed.append(total)

        run = rayi.run_sharded(
            fleet,
            num_worlds=4,
            num_shards=2,
            steps=6000,
            seed=0,
            num_cpus=FRACTION,
            progress=kill_once,
            connect_options={"on_world_failure": "restart"},
        )
        assert killed, "the run ended before the server was killed"
        # Every step is taken: those in flight to the killed server are sent again (issue 37,
        # defect 7), so the run still takes exactly the steps it was asked for.
        assert run.steps == sum(s.stats.steps for s in run.shards) == 6000
        # Worlds 0 and 2 lived on the killed server, one in each shard.
        assert run.restarts == 2 == sum(s.restarts for s in run.shards)
        assert [s.restarts for s in run.shards] == [1, 1]
        # The merged stats list them by their index in the whole run, not the shard's.
        assert sorted(r.split(":")[0] for r in run.stats.restarts) == ["world 0", "world 2"]
        assert run.stats.worlds_lost == 0
        assert wait_for(lambda: fleet.servers()[0].pid != victim.pid, timeout=60)
        assert fleet.restarts == 1 and [h.ok for h in fleet.health()] == [True, True]


def test_a_shard_that_cannot_connect_is_named(clean_ray: None) -> None:
    with (
        rayi.ServerFleet(make_catch, 1, num_cpus=FRACTION) as fleet,
        pytest.raises(rayi.ShardError, match=r"Shard \d \(worlds") as caught,
    ):
        rayi.run_sharded(
            fleet,
            num_worlds=2,
            num_shards=2,
            steps=10,
            create_world_settings={"no_such_setting": 1},
            num_cpus=FRACTION,
        )
    assert "no_such_setting" in str(caught.value)
    assert caught.value.worlds in ([0], [1])


def test_a_fleet_without_room_for_the_worlds_names_its_stream_limit(clean_ray: None) -> None:
    """A shard whose worlds outnumber its server's streams fails with the server's advice."""
    with rayi.ServerFleet(make_catch, 1, num_cpus=FRACTION, max_workers=2) as fleet:
        with pytest.raises(rayi.ShardError, match=r"Shard 0 \(worlds 0-2\)") as caught:
            rayi.run_sharded(fleet, num_worlds=3, num_shards=1, steps=10, num_cpus=FRACTION)
        assert wait_for(lambda: fleet.health()[0].ok, timeout=30)  # the refusal leaves it serving
    message = str(caught.value)
    assert "serves at most 2 streams at once" in message
    assert "max_workers=N" in message


def test_split_and_summarize_without_ray() -> None:
    assert rayi.split(8, 3) == [[0, 1, 2], [3, 4], [5, 6, 7]]
    assert rayi.split(2, 2) == [[0], [1]]
    with pytest.raises(ValueError, match="Cannot split 2 worlds into 3 shards"):
        rayi.split(2, 3)
    rng = np.random.default_rng(0)
    fast = rng.uniform(0.001, 0.002, 9_900)
    slow = rng.uniform(0.050, 0.060, 100)
    shards = [
        rayi.ShardStats(
            0, [0], RunStats(1, 9_900, 3, 0, [1.0, -1.0, 1.0], fast, 2.0), 1.5, 0, 0, {}
        ),
        rayi.ShardStats(1, [1], RunStats(1, 100, 1, 0, [1.0], slow, 1.0), 0.5, 2, 0, {}),
    ]
    run = rayi.summarize(shards)
    assert (run.steps, run.stats.episodes, run.restarts, run.stats.worlds) == (10_000, 4, 2, 2)
    assert run.steps_per_second == 5_000.0
    assert run.cpu_us_per_step == pytest.approx(200.0)  # (1.5 + 0.5) s over 10,000 steps
    # The p99 over all steps, not the mean of the shards' p99s.
    everything = np.concatenate([fast, slow]) * 1e3
    assert run.latency_p99_ms == pytest.approx(np.percentile(everything, 99))
    mean_of_shards = np.mean([np.percentile(s.stats.latencies * 1e3, 99) for s in shards])
    assert abs(run.latency_p99_ms - mean_of_shards) > 1.0


def test_without_ray_the_import_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "try:\n"
        "    import dm_env_rpc_client.integrations.ray\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'dm_env_rpc_client[ray]'" in out.stdout
    # The core never imports Ray, nor the integration.
    core = "import sys, dm_env_rpc_client.cli; print(sorted({'ray'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", core], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


class _EnvContext(dict):
    """Stands in for RLlib's EnvContext where RLlib is not installed: a dict with worker_index."""

    def __init__(self, config: dict, worker_index: int) -> None:
        super().__init__(config)
        self.worker_index = worker_index


def test_rllib_creator_gives_runners_and_vector_indices_distinct_worlds(clean_ray: None) -> None:
    gymnasium = pytest.importorskip("gymnasium")
    with rayi.ServerFleet(make_catch, 2, num_cpus=FRACTION) as fleet:
        env_config = rayi.rllib_env_config(fleet, seed=100, connector_flattens=True)
        try:
            # What RLlib does under VECTOR_ENTRY_POINT (Ray 2.60): `env_context | {"num_envs":
            # n}` drops the EnvContext, worker_index with it; every runner must still get a slot.
            context = _EnvContext(env_config, worker_index=1)
            merged = context | {"num_envs": 3}
            assert type(merged) is dict and "worker_index" not in merged
            first = rayi.rllib_env_creator(merged)
            second = rayi.rllib_env_creator(context | {"num_envs": 3})
            # Given a worker_index (an EnvContext), the creator uses it.
            fifth = rayi.rllib_env_creator(_EnvContext({**env_config, "num_envs": 2}, 5))
            try:
                seeds = [env.batch.world_seeds for env in (first, second, fifth)]
                assert seeds == [[100, 101, 102], [103, 104, 105], [110, 111]]
                # Runners start on different servers, so they spread over the fleet.
                assert first.batch.addresses[0] != second.batch.addresses[0]
                observations, _ = first.reset()
                assert observations.shape == (3, 10, 5)
            finally:
                for env in (first, second, fifth):
                    env.close()
            # The same path through gymnasium's registry, as RLlib's EnvRunner takes it.
            gymnasium.register(
                "DmEnvRpcRayTest-v0",
                vector_entry_point=lambda num_envs: rayi.rllib_env_creator(
                    context | {"num_envs": num_envs}
                ),
            )
            envs = gymnasium.make_vec(
                "DmEnvRpcRayTest-v0",
                num_envs=3,
                vectorization_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT,
            )
            try:
                assert envs.unwrapped.batch.world_seeds == [106, 107, 108]  # the third slot
                envs.reset()
                _, rewards, _, _, _ = envs.step(envs.action_space.sample())
                assert rewards.shape == (3,)
            finally:
                envs.close()
        finally:
            rayi.free_rllib_env_config(env_config)
            rayi.free_rllib_env_config(env_config)  # idempotent


def test_rllib_creator_refuses_a_config_it_did_not_make() -> None:
    with pytest.raises(ValueError, match="rllib_env_config"):
        rayi.rllib_env_creator({"num_envs": 2})
    with pytest.raises(ValueError, match="no worker_index"):
        rayi.rllib_env_creator({"addresses": ["127.0.0.1:1"], "num_envs": 2})


def paddle_moves(envs: Any) -> Any:
    """Catch's int8 paddle move (-1, 0, 1) as a Discrete(3) action: RLlib takes no int Box."""
    from gymnasium.spaces import Discrete
    from gymnasium.wrappers.vector import TransformAction

    return TransformAction(
        envs, lambda moves: (np.asarray(moves) - 1).astype(np.int8), single_action_space=Discrete(3)
    )


@pytest.mark.training
def test_rllib_ppo_trains_on_catch_served_by_a_fleet(clean_ray: None) -> None:
    """PPO (new API stack, torch on CPU) samples Catch from a fleet and learns finite losses."""
    pytest.importorskip("ray.rllib", reason="needs RLlib: pip install -e '.[rllib]'")
    gymnasium = pytest.importorskip("gymnasium")
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module import FlattenObservations

    with rayi.ServerFleet(make_catch, 2, num_cpus=0.25) as fleet:
        env_config = rayi.rllib_env_config(
            fleet, seed=0, wrap=paddle_moves, connector_flattens=True
        )
        config = (
            PPOConfig()
            .environment(env=rayi.register_rllib_env(), env_config=env_config)
            .env_runners(
                num_env_runners=2,
                num_envs_per_env_runner=2,
                num_cpus_per_env_runner=0.5,
                rollout_fragment_length=64,
                gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT,
                # Catch's board is a 2-D Box; RLlib's default encoders take 1-D or 3-D.
                env_to_module_connector=lambda env, spaces=None, device=None: FlattenObservations(),
            )
            .training(train_batch_size_per_learner=256, minibatch_size=64, num_epochs=1)
            .learners(num_learners=0)
            .debugging(seed=0)
        )
        algo = config.build_algo()
        try:
            results = [algo.train() for _ in range(2)]
            # Each runner got worlds of its own: distinct seeds, none shared.
            seeds = algo.env_runner_group.foreach_env_runner(
                lambda runner: runner.env.unwrapped.batch.world_seeds, local_env_runner=False
            )
        finally:
            algo.stop()
            rayi.free_rllib_env_config(env_config)
    for result in results:
        assert result["env_runners"]["num_env_steps_sampled"] > 0
        losses = result["learners"]["default_policy"]
        assert np.isfinite(losses["total_loss"]) and np.isfinite(losses["policy_loss"])
    flat = [seed for runner in seeds for seed in runner]
    assert len(seeds) == 2 and len(flat) == 4 and len(set(flat)) == 4


CLI = [sys.executable, "-m", "dm_env_rpc_client"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_child([*CLI, *args], timeout=100)


def test_cli_run_on_ray_matches_a_local_run_and_records_every_shard(
    tmp_path: pathlib.Path,
) -> None:
    """``run --ray local --num-shards 2`` (its own Ray, in the subprocess) plays the same steps."""
    common = ["run", "--num-envs", "4", "--steps", "400", "--seed", "3", "--json", "--quiet"]
    local = _cli(*common)
    assert local.returncode == 0, local.stderr
    sharded = _cli(*common, "--ray", "local", "--num-shards", "2", "--record", str(tmp_path / "r"))
    assert sharded.returncode == 0, sharded.stderr
    ours, theirs = json.loads(sharded.stdout), json.loads(local.stdout)
    # Same worlds (seeds 3 + i), same actions (world i's generator), so the same episodes.
    for key in ("worlds", "steps", "episodes", "return_mean", "world_seeds"):
        assert ours[key] == theirs[key], key
    assert ours["recorded_episodes"] == len(list(dmr.iter_episodes(tmp_path / "r"))) > 0
    assert {e.world for e in dmr.iter_episodes(tmp_path / "r")} == {0, 1, 2, 3}
    refused = _cli("run", "--ray", "--num-envs", "2", "--num-shards", "3", "--steps", "10")
    assert refused.returncode == 2 and "--num-shards 3 is more than the 2 worlds" in refused.stderr


def _ray_actors(root: int, name: str) -> list[int]:
    """The processes below ``root`` that host a Ray actor of class ``name``."""
    found = []
    for pid in _descendants(root):
        try:
            title = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith(b"ray::" + name.encode()):
            found.append(pid)
    return sorted(found)


def _summary_rows(table: str) -> dict[str, str]:
    """The summary table's rows: label (16 columns) -> value."""
    return {line[:16].rstrip(): line[16:] for line in table.splitlines() if line.strip()}


def _run_on_ray_and_kill(
    kill: Callable[[subprocess.Popen[bytes]], None], *extra: str, steps: int = 10000
) -> tuple[int, dict[str, str]]:
    """``run --ray local`` over 4 worlds in 2 shards; ``kill(process)`` is called once a
    tenth of the steps came back (seconds of stepping are left). Returns the exit code and
    the summary table's rows."""
    command = [*CLI, "run", "--ray", "local", "--num-shards", "2", "--num-envs", "4", *extra]
    process = subprocess.Popen(
        [*command, "--steps", str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stderr, stdout = process.stderr, process.stdout
    assert stderr is not None and stdout is not None
    progress = bytearray()  # standard error: the progress bar

    def drain() -> None:
        while chunk := stderr.read1(65536):
            progress.extend(chunk)

    def received() -> int:
        counts = re.findall(rb"(\d+)/%d" % steps, bytes(progress))
        return int(counts[-1]) if counts else 0

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert wait_for(lambda: received() >= steps // 10 or process.poll() is not None, 180)
        assert process.poll() is None, progress.decode(errors="replace")[-3000:]
        kill(process)
        code = process.wait(timeout=240)  # a hang guard, not a speed check
        table = stdout.read().decode()
    finally:
        if process.poll() is None:  # stop it as Ctrl-C does: it shuts its Ray down
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    reader.join(timeout=30)
    assert code in (0, 3), (table, progress.decode(errors="replace")[-3000:])
    return code, {line[:16].rstrip(): line[16:] for line in table.splitlines() if line.strip()}


@pytest.mark.timeout(300)  # starts a Ray of its own, on a loaded machine
def test_cli_run_on_ray_restarts_the_worlds_of_a_killed_server() -> None:
    """``run --ray local``: a fleet server SIGKILLed mid-run; its worlds (one in each shard)
    are made again, the run completes, and the summary lists both restarts."""

    def kill_a_server(process: subprocess.Popen[bytes]) -> None:
        servers = _ray_actors(process.pid, "_ServerHost")
        assert len(servers) == 2, servers
        os.kill(servers[0], signal.SIGKILL)

    code, rows = _run_on_ray_and_kill(kill_a_server)
    assert code == 0 and rows["worlds lost"] == "0"
    assert 10000 - 2 * 8 <= int(rows["steps"]) <= 10000  # pipeline 8: lost with the server
    count, listed = rows["restarts"].split(" ", 1)
    restarted = re.findall(r"world (\d+): ", listed)
    # Server k served worlds k and k + 2: world k in shard 0, world k + 2 in shard 1, which
    # names it by its index in the whole run (not 0 or 1, its index in the shard).
    assert int(count) == 2 and sorted(restarted) in (["0", "2"], ["1", "3"]), listed


@pytest.mark.timeout(300)
def test_cli_run_on_ray_exits_3_when_worlds_are_lost(
    server_process: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worlds whose server is gone while the other refuses to make worlds are lost: the
    other worlds run to the end, the summary counts the lost ones, and the exit code is 3."""
    flag, servers = refusing_servers(server_process, tmp_path, monkeypatch)

    def kill_a_server(_: subprocess.Popen[bytes]) -> None:
        flag.touch()  # from now on both servers refuse CreateWorld
        servers[1].kill()  # worlds 1 and 3: one in each shard

    addresses = [s.address for s in servers]
    code, rows = _run_on_ray_and_kill(kill_a_server, "--address", *addresses)
    assert code == 3 and rows["worlds lost"] == "2" and rows["restarts"] == "0 (none)"
    # Worlds 0 and 2 took their shares (2,500 steps each); 1 and 3 stopped at the kill.
    assert 5000 < int(rows["steps"]) < 7500
