"""What a batch offers: num_envs, per-world reset, batched random actions, a reward that adds up."""

from __future__ import annotations

import numpy as np
import pytest
from dm_env import specs as dm_specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client.random_actions import random_action, random_batch
from dm_env_rpc_client.server import Server

SETTINGS = {"rows": 3, "columns": 3}  # episodes of two steps: many FIRST steps


def test_num_envs(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(catch_server.address, 3, timeout=10) as envs:
        assert envs.num_envs == 3 == len(envs)


def test_reset_of_some_worlds_leaves_the_others_where_they_are(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(
        catch_server.address, 3, create_world_settings={"rows": 3, "seed": 2}, timeout=10
    ) as envs:
        envs.reset()
        assert envs.step({"paddle": np.zeros(3, np.int8)}).step_type.tolist() == [1, 1, 1]
        some = envs.reset([2, 0], timeout=10)
        assert some.env_ids.tolist() == [2, 0]
        assert some.first().all() and some.observation["board"].shape == (2, 3, 5)
        after = envs.step({"paddle": np.zeros(3, np.int8)})
        # Episodes of three rows end on their third step: worlds 0 and 2 were reset (their
        # second step, MID); world 1 was not (its third, LAST).
        assert after.step_type.tolist() == [1, 2, 1]
        with pytest.raises(ValueError, match="env_ids holds 3; give world indices from 0 to 2"):
            envs.reset([3])
        with pytest.raises(ValueError, match="names world 1 twice"):
            envs.reset([1, 1])


def test_reset_refuses_a_world_with_steps_in_flight(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(catch_server.address, 2, timeout=10) as envs:
        envs.reset()
        envs.send({"paddle": np.zeros(1, np.int8)}, [1])
        with pytest.raises(ValueError, match=r"World 1 has 1 step\(s\) in flight; recv\(\)"):
            envs.reset()
        envs.reset([0])  # world 0 has none
        assert envs.recv(1, timeout=10).env_ids.tolist() == [1]
        assert envs.reset().first().all()


def test_random_actions_for_the_whole_batch(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(
        catch_server.address, 4, create_world_settings=SETTINGS, seed=5, timeout=10
    ) as envs:
        envs.reset()
        actions = envs.random_actions()
        assert actions["paddle"].shape == (4,) and actions["paddle"].dtype == np.int8
        assert set(actions["paddle"].tolist()) <= {-1, 0, 1}
        assert envs.step(actions).step_type.shape == (4,)
        assert envs.random_actions(env_ids=[3, 1])["paddle"].shape == (2,)
        seeded = envs.random_actions(rng=7)["paddle"]
        assert np.array_equal(seeded, envs.random_actions(rng=7)["paddle"])


def test_random_batch_draws_as_random_action_does() -> None:
    spec = {
        "arm": {
            "joint": dm_specs.BoundedArray((2,), np.float32, [-1.0, 0.0], [0.0, 2.0], name="j"),
            "grip": dm_specs.DiscreteArray(3, name="g"),
        },
        "word": dm_specs.StringArray((), name="w"),
        "path": dm_specs.Array((-1, 2), np.int32, name="p"),
        "on": dm_specs.Array((), bool, name="on"),
    }
    batch = random_batch(spec, 5, np.random.default_rng(0))
    joint = batch["arm"]["joint"]
    assert joint.shape == (5, 2) and joint.dtype == np.float32
    assert (joint[:, 0] >= -1).all() and (joint[:, 0] <= 0).all() and (joint[:, 1] >= 0).all()
    assert batch["arm"]["grip"].shape == (5,) and set(batch["arm"]["grip"].tolist()) <= {0, 1, 2}
    assert batch["word"].shape == (5,) and all(isinstance(w, str) for w in batch["word"])
    assert batch["path"].dtype == object and len(batch["path"]) == 5
    assert all(p.shape[1] == 2 and 1 <= p.shape[0] <= 4 for p in batch["path"])
    assert batch["on"].shape == (5,) and batch["on"].dtype == np.bool_
    again = random_batch(spec, 5, 0)
    assert np.array_equal(again["arm"]["joint"], joint)  # a seed draws the same batch
    # Each world's action fits its spec, as random_action's do.
    for index in range(5):
        spec["arm"]["joint"].validate(joint[index])
    assert random_action(spec, 1)["arm"]["joint"].shape == (2,)  # the single draw as before
    with pytest.raises(ValueError, match="at least 1"):
        random_batch(spec, 0, 0)


def test_the_batch_reward_adds_up_where_dm_env_says_nan(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(
        catch_server.address, 2, create_world_settings=SETTINGS, timeout=10
    ) as envs:
        envs.reset()
        returns = np.zeros(2)
        nan_returns = np.zeros(2)
        firsts = 0
        for _ in range(9):
            batch = envs.step({"paddle": np.zeros(2, np.int8)})
            firsts += int(batch.first().sum())
            returns += batch.reward_or_zero
            nan_returns += batch.reward
        assert firsts > 0  # the automatic resets happened
        assert np.isnan(nan_returns).all()  # dm_env's NaN on FIRST steps poisons a sum
        assert np.isfinite(returns).all()
        assert np.array_equal(batch.reward_or_zero[~batch.first()], batch.reward[~batch.first()])
        assert (batch.reward_or_zero[batch.first()] == 0).all()


RUNNING, TERMINATED, INTERRUPTED = (
    dmr.dm_env_rpc_pb2.RUNNING,
    dmr.dm_env_rpc_pb2.TERMINATED,
    dmr.dm_env_rpc_pb2.INTERRUPTED,
)


def _states_of_two_episodes(envs: dmr.BatchedEnvironment) -> list[list[int]]:
    """``state`` of a reset and the next three steps (the third starts the next episodes)."""
    batch = envs.reset()
    states = [batch.state.tolist()]
    for _ in range(3):
        batch = envs.step({"paddle": np.zeros(2, np.int8)})
        assert batch.state is not None and batch.state.dtype == np.uint8
        states.append(batch.state.tolist())
    return states


@pytest.mark.parametrize("own_connections", [False, True])
def test_state_tells_terminated_from_interrupted(
    catch_server: Server, own_connections: bool
) -> None:
    # Catch of 3 rows ends by itself on its second step; of 4 rows with max_steps=2 it is
    # cut short there. Both are LAST steps with discount 1 or 0; only the state says which.
    for settings, ended in (({"rows": 3}, TERMINATED), ({"rows": 4, "max_steps": 2}, INTERRUPTED)):
        if own_connections:
            conns = [dmr.connect(catch_server.address, timeout=10) for _ in range(2)]
            adaptors = [dmr.create_and_join_world(c, settings, timeout=10)[0] for c in conns]
            envs = dmr.BatchedEnvironment(adaptors, connections=conns)
        else:
            envs = dmr.BatchedEnvironment.connect(
                catch_server.address, 2, create_world_settings=settings, timeout=10
            )
        with envs:  # closes the adaptors and connections too
            states = _states_of_two_episodes(envs)
        assert states == [[RUNNING] * 2, [RUNNING] * 2, [ended] * 2, [RUNNING] * 2]


def test_requested_observations_reach_every_world(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(
        catch_server.address, 2, requested_observations=["board", "reward"], timeout=10
    ) as envs:
        batch = envs.step({"paddle": np.zeros(2, np.int8)})
        assert set(batch.observation) == {"board", "reward"}
        assert batch.observation["reward"].shape == (2,)
    with dmr.BatchedEnvironment.connect(
        catch_server.address, 2, requested_observations=["reward"], timeout=10
    ) as envs:
        assert set(envs.reset().observation) == {"reward"}  # the board is not sent


def test_an_unknown_requested_observation_is_named_with_the_known_ones(
    catch_server: Server,
) -> None:
    with pytest.raises(
        dmr.UnknownNameError,
        match="Unknown observation name 'bord'. Known names: 'board', 'discount', 'reward'",
    ):
        dmr.BatchedEnvironment.connect(
            catch_server.address, 2, requested_observations=["board", "bord"], timeout=10
        )
    with pytest.raises(ValueError, match=r"not the string 'board': pass \['board'\]"):
        dmr.BatchedEnvironment.connect(
            catch_server.address, 2, requested_observations="board", timeout=10
        )
    # Nothing was left behind: the server still takes new worlds on a fresh batch.
    with dmr.BatchedEnvironment.connect(catch_server.address, 2, timeout=10) as envs:
        assert envs.reset().first().all()


def test_a_restarted_world_returns_the_requested_observations(server_process) -> None:
    servers = [server_process("catch"), server_process("catch")]
    with dmr.BatchedEnvironment.connect(
        [server.address for server in servers],
        2,
        requested_observations=["board", "reward"],
        on_world_failure="restart",
        timeout=10,
    ) as envs:
        envs.reset()
        servers[1].kill()
        for _ in range(50):  # world 1 comes back on the other server within a few steps
            batch = envs.step({"paddle": np.zeros(2, np.int8)}, timeout=30)
            if batch.truncated.any():
                break
        assert batch.truncated.tolist() == [False, True]
        assert set(batch.observation) == {"board", "reward"}
        assert batch.observation["board"].shape == (2, 10, 5)
        assert envs.addresses[1] == servers[0].address
        for world in envs.envs:  # the restarted world's adaptor asks for them too
            assert set(world.observation_spec()) == {"board", "reward"}


def test_connect_takes_its_keywords_grouped_or_one_by_one(catch_server: Server) -> None:
    """``connection=ConnectionOptions(...)`` and ``failure_policy=FailurePolicy(...)`` do what
    their keywords do; the keywords alone still work; one given both ways is refused."""
    metadata = [("x-run", "grouped")]
    policy = dmr.RestartPolicy(attempts=2)
    with dmr.BatchedEnvironment.connect(
        catch_server.address,
        2,
        connection=dmr.ConnectionOptions(metadata=metadata, wait_for_ready=True),
        failure_policy=dmr.FailurePolicy("restart", step_timeout=7.0, restart=policy),
        timeout=10,
    ) as grouped:
        assert grouped._policy == "restart" and grouped._restart_policy == policy
        assert grouped._step_timeout == 7.0
        assert grouped.step({"paddle": np.zeros(2, np.int8)}).step_type.tolist() == [0, 0]
    with dmr.BatchedEnvironment.connect(
        catch_server.address,
        2,
        metadata=metadata,
        on_world_failure="restart",
        step_timeout=7.0,
        restart=policy,
        timeout=10,
    ) as single:
        assert single._policy == "restart" and single._restart_policy == policy
        assert single._step_timeout == 7.0
    with pytest.raises(dmr.ArgumentValueError, match=r"step_timeout=5.0 is given both"):
        dmr.BatchedEnvironment.connect(
            catch_server.address, step_timeout=5.0, failure_policy=dmr.FailurePolicy()
        )
    with pytest.raises(dmr.ArgumentTypeError, match=r"connection is a dmr.ConnectionOptions"):
        dmr.BatchedEnvironment.connect(catch_server.address, connection={"insecure": True})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'restarts'"):  # checked inside the group too
        dmr.BatchedEnvironment.connect(
            catch_server.address, failure_policy=dmr.FailurePolicy("restarts")
        )


def test_create_settings_are_checked_once_before_anything_opens(
    catch_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dm_env_rpc_client._base import checks

    looks: list[str] = []
    check = checks.check_settings
    monkeypatch.setattr(
        checks, "check_settings", lambda v, n="settings": looks.append(n) or check(v, n)
    )
    with dmr.BatchedEnvironment.connect(
        catch_server.address, 3, create_world_settings={"rows": 4}, seed=1, timeout=10
    ):
        assert looks == ["create_world_settings", "join_world_settings"]
    # A value that cannot be sent fails before any connection is tried (port 1 refuses).
    with pytest.raises(dmr.TensorTypeError):
        dmr.BatchedEnvironment.connect("127.0.0.1:1", create_world_settings={"a": object()})
