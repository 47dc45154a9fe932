"""BatchedEnvironment.connect: per-world seeds (seed + i), joining existing worlds, stream limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dm_env
import numpy as np
import pytest

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.catch import Catch


@pytest.fixture
def recorded() -> Iterator[tuple[Server, list[dict[str, Any]]]]:
    """A Catch server that keeps every create settings dict it was given."""
    seen: list[dict[str, Any]] = []

    def make_env(settings: dict[str, Any]) -> dm_env.Environment:
        seen.append(settings)
        return Catch(**settings)

    with serve(make_env) as server:
        yield server, seen


def test_world_i_is_created_with_seed_plus_i(
    recorded: tuple[Server, list[dict[str, Any]]],
) -> None:
    server, seen = recorded
    with dmr.BatchedEnvironment.connect(
        [server.address], 3, seed=5, create_world_settings={"rows": 4}
    ) as batch:
        assert batch.world_seeds == [5, 6, 7]
        # the settings world i was made with (and would be made again with on a restart)
        assert [r.create_settings for r in batch._recipes] == [
            {"rows": 4, "seed": 5 + i} for i in range(3)
        ]
        batch.reset()
    # the worlds are created all at once: in any order
    assert sorted((s["seed"], s["rows"]) for s in seen) == [(5, 4), (6, 4), (7, 4)]


def test_no_seed_leaves_the_settings_alone(
    recorded: tuple[Server, list[dict[str, Any]]],
) -> None:
    server, seen = recorded
    with dmr.BatchedEnvironment.connect([server.address], 2) as batch:
        assert batch.world_seeds == [None, None]
    assert seen == [{}, {}]


def test_a_custom_seed_setting_name() -> None:
    seen: list[int] = []

    def make_env(settings: dict[str, Any]) -> dm_env.Environment:
        seen.append(int(settings.pop("random_seed")))
        return Catch(**settings)

    with (
        serve(make_env) as server,
        dmr.BatchedEnvironment.connect(
            [server.address], 2, seed=10, seed_setting="random_seed"
        ) as batch,
    ):
        assert batch.world_seeds == [10, 11]
    assert sorted(seen) == [10, 11]  # created all at once: in any order


def test_a_server_that_refuses_the_seed_setting_gets_unseeded_worlds() -> None:
    def make_env(settings: dict[str, Any]) -> dm_env.Environment:
        if "seed" in settings:
            raise TypeError("unexpected setting 'seed'")
        return Catch(**settings)

    with (
        serve(make_env) as server,
        pytest.warns(UserWarning, match=r"refused the create setting 'seed'.*seed_setting=None"),
        dmr.BatchedEnvironment.connect([server.address], 2, seed=3) as batch,
    ):
        assert batch.world_seeds == [None, None]
        assert batch.step({"paddle": np.zeros(2, np.int8)}).step_type.tolist() == [0, 0]


def test_seed_twice_is_refused(recorded: tuple[Server, list[dict[str, Any]]]) -> None:
    server, seen = recorded
    with pytest.raises(ValueError, match="already holds 'seed'"):
        dmr.BatchedEnvironment.connect(
            [server.address], 2, seed=3, create_world_settings={"seed": 1}
        )
    assert seen == []


def test_join_existing_worlds_by_name(catch_server: Server) -> None:
    with dmr.connect(catch_server.address) as owner:
        names = [dmr.create_world(owner, {"rows": 3}) for _ in range(2)]
        with dmr.BatchedEnvironment.connect(
            [catch_server.address], world_names=names, seed=9
        ) as batch:
            assert len(batch) == 2 and batch.world_seeds == [None, None]
            assert batch.reset().observation["board"].shape == (2, 3, 5)
        # Joined, not created: closing the batch left the worlds, which still exist.
        env = dmr.join_world(owner, names[0])
        assert env.reset().observation["board"].shape == (3, 5)
        env.close()
        with pytest.raises(ValueError, match="one world name per world: 2 names for 3"):
            dmr.BatchedEnvironment.connect([catch_server.address], 3, world_names=names)


def test_more_worlds_than_the_server_serves_says_what_to_do() -> None:
    with serve(lambda settings: Catch(**settings), max_workers=2) as server:
        with pytest.raises(dmr.WorldError) as failed:
            dmr.BatchedEnvironment.connect([server.address], 3)
        message = str(failed.value)
        # the streams open all at once: which world the server refuses is chance
        assert f"World {failed.value.index} " in message and "RESOURCE_EXHAUSTED" in message
        assert "at most 2 streams" in message and "--max-workers" in message
        assert "open a new connection" not in message
        with dmr.BatchedEnvironment.connect([server.address], 2) as batch:  # both freed
            assert len(batch) == 2
