"""Episode recording: one .npz per episode, read back by load_episode / iter_episodes."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import dm_env
import numpy as np
import pytest

from dm_env_rpc_client.errors import RecordingError
from dm_env_rpc_client.recording import EpisodeRecorder, Recording, iter_episodes, load_episode


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


def _episode(recording: Recording, world: int, steps: int, *, last: bool = True) -> None:
    recording.add(world, None, dm_env.restart({"x": np.float32(0)}))
    for t in range(1, steps + 1):
        observation = {"x": np.float32(t)}
        if last and t == steps:
            recording.add(world, {"a": np.int8(t)}, dm_env.termination(1.0, observation))
        else:
            recording.add(world, {"a": np.int8(t)}, dm_env.transition(0.0, observation))


def test_metadata_len_and_truncated_episodes(tmp_path: pathlib.Path) -> None:
    with Recording(tmp_path / "run", 2, seeds=[7, 8]) as recording:
        _episode(recording, 0, 3)
        _episode(recording, 1, 2, last=False)
        _episode(recording, 0, 1, last=False)
        _episode(recording, 0, 2)  # its FIRST saves the unfinished one before it
        _episode(recording, 1, 1, last=False)  # likewise; and this one is saved at close
        assert recording.episodes == 4 and recording.truncated == 2
    assert recording.episodes == 5 and recording.truncated == 3
    episodes = list(iter_episodes(tmp_path / "run"))
    summary = [(e.world, e.episode, e.seed, e.truncated, len(e)) for e in episodes]
    assert summary == [
        (0, 1, 7, False, 3),
        (0, 2, 7, True, 1),
        (0, 3, 7, False, 2),
        (1, 1, 8, True, 2),
        (1, 2, 8, True, 1),
    ]
    assert episodes[3].step_type.tolist() == [0, 1, 1]
    assert len(episodes[3].action["a"]) == len(episodes[3]) == 2
    recording.close()  # idempotent: nothing written twice
    assert len(list((tmp_path / "run").iterdir())) == 5
    with Recording(tmp_path / "first_only", 1) as recording:
        recording.add(0, None, dm_env.restart({"x": np.float32(0)}))  # no transition: dropped
    assert recording.episodes == 0 and list((tmp_path / "first_only").iterdir()) == []


def test_a_recording_refuses_a_folder_that_is_not_empty(tmp_path: pathlib.Path) -> None:
    (tmp_path / "old.npz").write_bytes(b"")
    with pytest.raises(RecordingError, match=r"already holds 1 entries \(e.g. 'old.npz'\)"):
        Recording(tmp_path, 1)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(RecordingError, match="is not a folder"):
        Recording(afile, 1)
    with pytest.raises(RecordingError, match="the path is empty"):
        Recording("", 1)
    with pytest.raises(RecordingError, match="Cannot create the recording folder /proc/nope"):
        Recording("/proc/nope/run", 1)
    assert isinstance(RecordingError("x"), OSError)


def test_iter_episodes_on_a_missing_folder_raises(tmp_path: pathlib.Path) -> None:
    with pytest.raises(RecordingError, match="There is no recording folder"):
        iter_episodes(tmp_path / "missing")


def test_writes_are_atomic(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_write(descriptor: int, parts: Any) -> int:
        os.write(descriptor, b"PK half an episode")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", half_write)  # the one call _npz_file writes a file with
    recording = Recording(tmp_path / "run", 1)
    with pytest.raises(OSError, match="No space left"):
        _episode(recording, 0, 2)
    assert list((tmp_path / "run").iterdir()) == []  # neither the episode nor a temporary file
    # Written on a thread, the error comes back at the next write or at close.
    recording = Recording(tmp_path / "background", 1, background=True)
    _episode(recording, 0, 2)
    with pytest.raises(RecordingError, match="Writing an episode failed.*No space left"):
        recording.close()
    assert list((tmp_path / "background").iterdir()) == []


def test_variable_length_tensors_are_kept_per_step(tmp_path: pathlib.Path) -> None:
    recorder = EpisodeRecorder(tmp_path)
    recorder.add(None, dm_env.restart({"text": np.arange(1, dtype=np.int32)}))
    for length in (3, 2):
        recorder.add(
            {"word": np.zeros((length, 2), np.float32)},
            dm_env.transition(0.0, {"text": np.arange(length, dtype=np.int32)}),
        )
    recorder.add({"word": np.zeros((1, 2))}, dm_env.termination(1.0, {"text": np.arange(4)}))
    episode = load_episode(recorder.written[0])
    assert [t.tolist() for t in episode.observation["text"]] == [
        [0],
        [0, 1, 2],
        [0, 1],
        [0, 1, 2, 3],
    ]
    assert [w.shape for w in episode.action["word"]] == [(3, 2), (2, 2), (1, 2)]
    assert len(episode) == 3


def test_truncate_one_world_for_a_failed_world(tmp_path: pathlib.Path) -> None:
    recording = Recording(tmp_path / "run", 2, seeds=[4, None])
    _episode(recording, 1, 2, last=False)
    path = recording.truncate(1)
    assert path is not None and path.name == "episode_001_000001.npz"
    assert recording.truncate(1) is None  # nothing left to save
    assert recording.truncate(0) is None  # world 0 never started an episode
    episode = load_episode(path)
    assert episode.truncated and episode.world == 1 and episode.seed is None and len(episode) == 2
    _episode(recording, 1, 1)  # the world's replacement records on, numbering on
    recording.close()
    assert [e.episode for e in iter_episodes(tmp_path / "run")] == [1, 2]


def test_npz_files_stored_or_deflated_load_with_numpy(tmp_path: pathlib.Path) -> None:
    """``_tools.npz_file`` lays zips out by hand: numpy and zipfile read both kinds."""
    import zipfile

    from dm_env_rpc_client._tools.npz_file import save_npz

    arrays = {
        "a": np.arange(10, dtype=np.int64),
        "b/c": np.ones((3, 4, 2), np.float32).T,  # not C-ordered
        "scalar": np.array(3),
        "text": np.array(["ab", "c"]),
        "empty": np.zeros((0, 3)),
        "big_endian": np.arange(3, dtype=">i4"),
        "flag": np.array(True),
    }
    sizes = {}
    for compress in (False, True):
        path = tmp_path / f"{compress}.npz"
        save_npz(path, arrays, compress)
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None
        with np.load(path, allow_pickle=False) as data:
            assert sorted(data.files) == sorted(arrays)
            for key, value in arrays.items():
                assert data[key].dtype == value.dtype and data[key].shape == value.shape, key
                assert np.array_equal(data[key], value), key
        sizes[compress] = path.stat().st_size
    assert sizes[True] < sizes[False]
    save_npz(tmp_path / "again.npz", arrays)
    assert (tmp_path / "again.npz").read_bytes() == (tmp_path / "False.npz").read_bytes()
    with pytest.raises(ValueError, match="'objects' is an object array"):
        save_npz(tmp_path / "no.npz", {"objects": np.array([None])})
