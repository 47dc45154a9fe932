"""``dmr.MultiAgentRecording``: multi-agent episodes recorded per agent, read back by the
single-agent readers (``dmr.iter_episodes``, ``dmr.load_episode``, Minari's ``load_dataset``).

Against the SDK's own Paddles server and the foreign reference-package server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from ma_foreign_server import foreign_server

import dm_env_rpc_client as dmr
from dm_env_rpc_client.server import serve
from dm_env_rpc_client.server.paddles import Paddles


@pytest.fixture(params=["sdk", "foreign"])
def address(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "sdk":
        with serve(lambda s: Paddles(**s), agent_timeout=20.0) as server:
            yield server.address
    else:
        with foreign_server(barrier_timeout=20.0) as server:
            yield server.address


def _batch(address: str, worlds: int = 2) -> dmr.MultiAgentBatch:
    return dmr.MultiAgentBatch.connect(
        [address] * worlds, num_agents=2, create_world_settings={"seed": 4}
    )


def test_collect_records_one_ordinary_recording_per_agent(address, tmp_path):
    folder = tmp_path / "run"
    with _batch(address) as batch:
        recording = dmr.MultiAgentRecording.for_batch(folder, batch)
        stats = dmr.collect(batch, steps=4 * 40, seed=0, record=recording)
        recording.close()
    assert json.loads((folder / "agents.json").read_text())["agents"] == ["agent_0", "agent_1"]
    by_agent = {name: list(dmr.iter_episodes(folder / name)) for name in ("agent_0", "agent_1")}
    finished = {
        name: [e for e in episodes if not e.truncated] for name, episodes in by_agent.items()
    }
    assert len(finished["agent_0"]) == len(finished["agent_1"]) >= 4  # both worlds, 40 steps
    assert recording.episodes == sum(len(e) for e in by_agent.values())
    assert stats.episodes >= 8  # every agent's episode counted by collect, too
    for episodes in finished.values():
        for episode in episodes:
            assert episode.world in (0, 1)  # world indices, not slots
            assert episode.observation["board"].shape[1:] in ((10, 5), (10, 8))
            assert episode.action["paddle"].shape == (len(episode),)
            assert episode.step_type[0] == 0 and episode.step_type[-1] == 2
            assert np.isnan(episode.reward[0]) and episode.discount[-1] == 0.0
    # Each world's episode has one file per agent, with the same (world, episode) and length,
    # and each agent sees its own paddle at 1.0 (the other one at 0.5).
    for joined in dmr.iter_agent_episodes(folder):
        if any(e.truncated for e in joined.values()):
            continue
        first, second = joined["agent_0"], joined["agent_1"]
        assert (first.world, first.episode, len(first)) == (
            second.world,
            second.episode,
            len(second),
        )
        assert not np.array_equal(first.observation["board"], second.observation["board"])
        assert 0.5 in first.observation["board"][0] and 0.5 in second.observation["board"][0]


def test_step_agents_recorded_with_the_actions_sent(address, tmp_path):
    with (
        _batch(address, worlds=1) as batch,
        dmr.MultiAgentRecording.for_batch(tmp_path / "run", batch) as recording,
    ):
        recording.add_agents(batch.reset_agents())
        sent: list[tuple[int, int]] = []
        for step in range(30):
            moves = (step % 3 - 1, 1 - step % 3)
            steps = batch.step_agents(
                {
                    "agent_0": {"paddle": np.array([moves[0]], np.int8)},
                    "agent_1": [{"paddle": moves[1]}],
                }
            )
            recording.add_agents(
                steps,
                {
                    "agent_0": {"paddle": np.array([moves[0]], np.int8)},
                    "agent_1": [{"paddle": moves[1]}],
                },
            )
            sent.append(moves)
    first = next(iter(dmr.iter_agent_episodes(tmp_path / "run")))
    length = len(first["agent_0"])
    assert length >= 3
    assert first["agent_0"].action["paddle"].tolist() == [m[0] for m in sent[:length]]
    assert first["agent_1"].action["paddle"].tolist() == [m[1] for m in sent[:length]]
    # The rewards are each agent's own: the episode's last reward is per agent.
    assert {first["agent_0"].reward[-1], first["agent_1"].reward[-1]} <= {-1.0, 0.0, 0.5, 1.0}
    # A single agent's file reads with the single-agent loader.
    one = sorted((tmp_path / "run" / "agent_1").glob("episode_*.npz"))[0]
    assert dmr.load_episode(one).action["paddle"].tolist() == [m[1] for m in sent[:length]]


def test_an_unfinished_episode_is_saved_truncated_for_every_agent(tmp_path):
    with serve(lambda s: Paddles(**s)) as server, _batch(server.address, worlds=1) as batch:
        recording = dmr.MultiAgentRecording.for_batch(tmp_path / "run", batch)
        recording.add_agents(batch.reset_agents())
        actions: dict[str, Any] = {name: [{"paddle": 0}] for name in batch.agents}
        recording.add_agents(batch.step_agents(actions), actions)
        recording.close()
        recording.close()  # idempotent
    (joined,) = list(dmr.iter_agent_episodes(tmp_path / "run"))
    assert all(e.truncated and len(e) == 1 for e in joined.values())
    assert recording.truncated == 2


def test_bad_folders_and_names_are_refused(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(dmr.RecordingError, match="already holds"):
        dmr.MultiAgentRecording(tmp_path / "full", ["a", "b"], worlds=1)
    with pytest.raises(dmr.ArgumentValueError, match="cannot name a folder"):
        dmr.MultiAgentRecording(tmp_path / "r1", ["a", "../b"], worlds=1)
    with pytest.raises(dmr.ArgumentValueError, match="given twice"):
        dmr.MultiAgentRecording(tmp_path / "r2", ["a", "a"], worlds=1)
    with pytest.raises(dmr.RecordingError, match="not a MultiAgentRecording"):
        dmr.iter_agent_episodes(tmp_path / "full")


def test_minari_reads_each_agents_dataset(tmp_path):
    minari = pytest.importorskip("minari")
    pytest.importorskip("pyarrow", reason="Minari's arrow storage: the minari extra")
    from dm_env_rpc_client.integrations.minari import MinariWriter

    with serve(lambda s: Paddles(**s)) as server, _batch(server.address, worlds=1) as batch:

        def writer(agent: str, folder):
            slot = batch.agents.index(agent)
            return MinariWriter.for_environment(
                folder, batch.envs[slot], dataset_id=f"paddles-{agent.replace('_', '')}-v0"
            )

        with dmr.MultiAgentRecording.for_batch(tmp_path / "run", batch, writer=writer) as record:
            dmr.collect(batch, steps=2 * 30, seed=0, record=record)
    for agent in ("agent_0", "agent_1"):
        dataset = minari.load_dataset(str(tmp_path / "run" / agent))
        assert dataset.total_episodes >= 3
        episode = next(dataset.iterate_episodes())
        assert episode.observations["board"].shape[1:] == (10, 5)
        assert len(episode.actions["paddle"]) == len(episode.rewards)
