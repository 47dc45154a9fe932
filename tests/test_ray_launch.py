"""Launched servers on Ray: ``LaunchedFleet`` (a command per actor) and ``run --ray --launch``.

On a local Ray listening on loopback only, as ``test_ray.py`` runs it.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("ray")

import ray
from conftest import run_child, wait_for
from test_launch import _command, _none_left, _running, _tag
from test_ray import CLI, _step, _summary_rows, clean_ray, local_ray  # noqa: F401

from dm_env_rpc_client.integrations.ray import LaunchedFleet


@pytest.mark.usefixtures("clean_ray")
def test_a_launched_fleet_serves_and_a_dead_actor_leaves_no_process() -> None:
    tag = _tag()
    with LaunchedFleet(_command(tag), 2, num_cpus=0.5, max_restarts=0, grace=1.0) as fleet:
        assert _step(fleet.addresses, worlds=4) == 4
        infos = fleet.servers()
        assert sorted(info.pid for info in infos) == sorted(_running(tag))
        assert fleet.relaunches() == []
        ray.kill(fleet._actors[0], no_restart=True)  # the actor's process dies: so must its server
        assert wait_for(lambda: infos[0].pid not in _running(tag), timeout=30)
        assert infos[1].pid in _running(tag)
    assert _none_left(tag)


@pytest.mark.usefixtures("clean_ray")
def test_a_launched_fleet_with_a_bad_template_fails_before_any_actor() -> None:
    with pytest.raises(ValueError, match=r"no \{port\}"):
        LaunchedFleet([sys.executable, "-c", "pass"], 1)


_SHARDED = ("--ray", "local", "--num-shards", "2", "--num-envs", "4", "--steps", "400")


def test_cli_run_on_ray_launches_servers_in_each_shard() -> None:
    tag = _tag()
    command = " ".join(_command(tag))
    result = run_child(
        [*CLI, "run", *_SHARDED, "--launch", command, "--num-servers", "1", "--quiet"],
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    rows = _summary_rows(result.stdout)
    assert rows["steps"] == "400" and rows["worlds"] == "4"
    assert _none_left(tag)
