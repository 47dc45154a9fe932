"""Episode recording: one .npz per episode, read back by load_episode / iter_episodes."""

from __future__ import annotations

import pathlib

import dm_env
import numpy as np

from dm_env_rpc_client.recording import EpisodeRecorder, iter_episodes, load_episode


def test_record_and_read_back(tmp_path: pathlib.Path) -> None:
    recorder = EpisodeRecorder(tmp_path, world=2)
    recorder.add(
        {"paddle": np.int8(1)}, dm_env.transition(0.0, {"x": np.float32(9)})
    )  # mid-episode: skipped
    for episode in range(2):
        recorder.add(None, dm_env.restart({"board": np.zeros((2, 2), np.float32), "arm": {"a": 0}}))
        for t in range(3):
            observation = {"board": np.full((2, 2), t + 1, np.float32), "arm": {"a": t + 1}}
            action = {"paddle": np.int8(t - 1)}
            if t < 2:
                recorder.add(action, dm_env.transition(0.5, observation, 0.9))
            else:
                recorder.add(action, dm_env.termination(float(episode), observation))
    assert [p.name for p in recorder.written] == [
        "episode_002_000001.npz",
        "episode_002_000002.npz",
    ]
    episode = load_episode(recorder.written[1])
    assert episode.step_type.tolist() == [0, 1, 1, 2]
    assert np.isnan(episode.reward[0]) and episode.reward[1:].tolist() == [0.5, 0.5, 1.0]
    assert np.isnan(episode.discount[0]) and episode.discount[-1] == 0.0
    assert episode.observation["board"].shape == (4, 2, 2)
    assert episode.observation["arm"]["a"].tolist() == [0, 1, 2, 3]
    assert episode.action["paddle"].tolist() == [-1, 0, 1]
    assert len(list(iter_episodes(tmp_path))) == 2
