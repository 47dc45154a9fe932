"""Relaunch and balance: a batch's worlds through a server's death, launched or given as addresses.

After recovery the worlds per live server differ by at most one; worlds that
failed over return home at an episode boundary (no step lost, repeated or
truncated by the move); healthy worlds keep stepping throughout.
"""

from __future__ import annotations

import collections
import itertools
import os
import signal
import sys
import time

import numpy as np
from test_launch import STAND_IN, _none_left, _tag

import dm_env_rpc_client as dmr
from dm_env_rpc_client._batch.restart import RestartPolicy
from dm_env_rpc_client.server._subprocess import server_subprocess

_FIRST, _MID, _LAST = 0, 1, 2
_POLICY = RestartPolicy(attempts=3, backoff=0.05, connect_timeout=1.0)


def _step_until(envs, condition, seconds=60.0):
    """Steps every live world until ``condition()`` holds; returns each world's step types."""
    kinds = collections.defaultdict(list)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ids = envs.live_ids
        batch = envs.step({"paddle": np.ones(len(ids), np.int8)}, timeout=30)
        for position, world in enumerate(batch.env_ids.tolist()):
            kind = int(batch.step_type[position])
            kinds[world].append("T" if batch.truncated[position] else kind)
        if condition():
            return kinds
    raise AssertionError(f"not reached in {seconds} s: {collections.Counter(envs.addresses)}")


def _balanced(envs, addresses):
    counts = collections.Counter(envs.addresses)
    return max(counts[a] for a in addresses) - min(counts[a] for a in addresses) <= 1


def _episodes_whole(kinds):
    """Each world's steps follow the protocol: FIRST only at the start, after LAST, or as a
    truncating restart ("T"); a LAST is followed by a FIRST."""
    for world, seq in kinds.items():
        for before, after in itertools.pairwise(seq):
            if before == _LAST:
                assert after in (_FIRST, "T"), (world, seq)
            if after == _FIRST:
                assert before == _LAST, (world, seq)


def test_a_launched_server_killed_mid_run_is_relaunched_and_its_worlds_restored():
    tag = _tag()
    command = [sys.executable, str(STAND_IN), "--port", "{port}", "--tag", tag]
    policy = dmr.RelaunchPolicy(attempts=3, backoff=0.1)
    with (
        dmr.launch(command, 2, relaunch=policy) as servers,
        dmr.BatchedEnvironment.connect(
            servers, num_envs=4, on_world_failure="restart", restart=_POLICY, step_timeout=10
        ) as envs,
    ):
        assert envs.servers is servers
        envs.reset()
        _step_until(envs, lambda: True)
        os.kill(servers.servers[0].pid, signal.SIGKILL)
        kinds = _step_until(
            envs,
            lambda: (
                [r.outcome for r in servers.relaunches] == ["relaunched"]
                and len(envs.failures) >= 2
                and _balanced(envs, servers.addresses)
            ),
        )
        relaunch = envs.relaunches[0]
        assert relaunch.index == 0 and relaunch.outcome == "relaunched"
        assert "killed by SIGKILL" in relaunch.reason
        assert {f.outcome for f in envs.failures} == {"restarted"}
        assert {f.address for f in envs.failures} == {servers.addresses[0]}
        assert all(f.relaunch is relaunch for f in envs.failures)  # each names the relaunch
        assert envs.live_ids == [0, 1, 2, 3]
        assert collections.Counter(envs.addresses) == {a: 2 for a in servers.addresses}
        _episodes_whole(kinds)
    assert _none_left(tag)


def test_worlds_that_failed_over_return_home_at_an_episode_boundary():
    with server_subprocess("catch") as a, server_subprocess("catch") as b:
        port = a.address.rpartition(":")[2]
        with dmr.BatchedEnvironment.connect(
            [a.address, b.address],
            num_envs=4,
            on_world_failure="restart",
            restart=_POLICY,
            step_timeout=10,
        ) as envs:
            envs.reset()
            a.kill()
            # A stays down: its worlds fail over to B, which carries all four.
            _step_until(envs, lambda: envs.addresses.count(b.address) == 4)
            assert len(envs.failures) == 2 and not envs.moves
            with server_subprocess("catch", extra_args=["--port", port]) as again:
                assert again.address == a.address
                kinds = _step_until(envs, lambda: _balanced(envs, [a.address, b.address]))
                assert collections.Counter(envs.addresses) == {a.address: 2, b.address: 2}
                assert len(envs.moves) == 2
                assert {(m.source, m.target) for m in envs.moves} == {(b.address, a.address)}
                # The moves lost, repeated and truncated nothing: no "T" after the failover.
                assert all("T" not in seq for seq in kinds.values())
                _episodes_whole(kinds)
                assert len(envs.failures) == 2
