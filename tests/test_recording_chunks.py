"""Several episodes per .npz (``NpzWriter(episodes_per_file=N)``, what ``run --record`` writes)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import dm_env
import numpy as np
import pytest

from dm_env_rpc_client import errors, specs
from dm_env_rpc_client._tools import npz_chunks
from dm_env_rpc_client.recording import (
    Episode,
    NpzWriter,
    Recording,
    iter_episodes,
    load_episode,
)


def _observation(t: int, world: int, episode: int) -> dict[str, Any]:
    # "text" is ragged in episodes 2 and 4 (its length changes), of one length elsewhere.
    length = 1 + (t % 3 if episode % 2 == 0 else 0)
    return {
        "board": np.full((2, 3), t + 10 * world, np.float32),
        "arm": {"angle": np.float64(t / 2)},
        "text": np.arange(length, dtype=np.int32) + t,
    }


def _feed(recording: Recording) -> None:
    """Episodes of both worlds, interleaved: ended, interrupted, cut by a FIRST, and running."""
    for episode in range(1, 6):
        for world in (0, 1):
            steps = 2 + (episode + world) % 4
            recording.add(world, None, dm_env.restart(_observation(0, world, episode)))
            for t in range(1, steps + 1):
                action = {"paddle": np.int8(t - 1), "word": np.zeros((t % 2 + 1, 2), np.float32)}
                observation = _observation(t, world, episode)
                if t < steps or episode == 3:  # episode 3: cut by the next FIRST
                    recording.add(world, action, dm_env.transition(0.5, observation, 0.9))
                elif episode == 4:
                    recording.add(world, action, dm_env.truncation(1.0, observation), state=3)
                else:
                    recording.add(world, action, dm_env.termination(float(t), observation))
    recording.add(0, None, dm_env.restart(_observation(0, 0, 6)))
    recording.add(
        0,
        {"paddle": np.int8(1), "word": np.zeros((1, 2), np.float32)},
        dm_env.transition(0.0, _observation(1, 0, 6)),
    )


def _record(folder: pathlib.Path, per: int) -> pathlib.Path:
    writer = NpzWriter(folder, episodes_per_file=per)
    with Recording(folder, 2, seeds=[5, None], writer=writer) as recording:
        _feed(recording)
    return folder


def _assert_same(one: Episode, other: Episode) -> None:
    meta = ("world", "episode", "seed", "truncated", "interrupted")
    assert [getattr(one, k) for k in meta] == [getattr(other, k) for k in meta]
    for key in ("step_type", "reward", "discount"):
        a, b = getattr(one, key), getattr(other, key)
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), key
    for group in ("observation", "action"):
        flat_one = specs.flatten(getattr(one, group))
        flat_other = specs.flatten(getattr(other, group))
        assert flat_one.keys() == flat_other.keys()
        for name, value in flat_one.items():
            assert type(value) is type(flat_other[name]), name  # an array, or a ragged list
            for a, b in zip(list(value), list(flat_other[name]), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name


def test_chunks_hold_the_same_episodes_as_files_of_one(tmp_path: pathlib.Path) -> None:
    singles = list(iter_episodes(_record(tmp_path / "one", 1)))
    folder = _record(tmp_path / "chunks", 3)
    chunked = list(iter_episodes(folder))
    assert [(e.world, e.episode) for e in chunked] == [(e.world, e.episode) for e in singles]
    assert len(singles) == 11  # 5 per world, and world 0's running one, cut at close
    assert {e.truncated for e in singles} == {True, False} and any(e.interrupted for e in singles)
    assert any(isinstance(e.observation["text"], list) for e in singles)
    assert any(isinstance(e.observation["text"], np.ndarray) for e in singles)
    for one, other in zip(singles, chunked, strict=True):
        _assert_same(one, other)
    assert sorted(p.name for p in folder.iterdir()) == [
        "episodes_000_000001-000003.npz",
        "episodes_000_000004-000006.npz",  # the last written at close
        "episodes_001_000001-000003.npz",
        "episodes_001_000004-000005.npz",
    ]
    with np.load(folder / "episodes_000_000001-000003.npz", allow_pickle=False) as data:
        lengths = data["meta/length"]
        assert data["meta/episode"].tolist() == [1, 2, 3] and data["meta/world"] == 0
        assert len(data["step_type"]) == len(data["observation/board"]) == sum(lengths) + 3
        assert len(data["action/paddle"]) == sum(lengths)
    with pytest.raises(errors.RecordingError, match=r"holds 3 episodes.*iter_episodes"):
        load_episode(folder / "episodes_000_000001-000003.npz")


def test_chunk_files_are_the_same_bytes_every_time(tmp_path: pathlib.Path) -> None:
    first, second = (_record(tmp_path / name, 2) for name in ("a", "b"))
    files = [{p.name: p.read_bytes() for p in folder.iterdir()} for folder in (first, second)]
    assert files[0] == files[1] and len(files[0]) == 6


def test_a_chunk_of_one_loads_alone_and_big_episodes_are_not_held(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(npz_chunks, "CHUNK_BYTES", 1)  # every episode is "big": a file of its own
    folder = _record(tmp_path / "run", 16)
    names = sorted(p.name for p in folder.iterdir())
    assert names[:2] == ["episodes_000_000001-000001.npz", "episodes_000_000002-000002.npz"]
    assert len(names) == 11
    singles = list(iter_episodes(_record(tmp_path / "one", 1)))
    for name, single in zip(names, singles, strict=True):
        _assert_same(load_episode(folder / name), single)


def test_old_and_chunked_files_read_together_in_order(tmp_path: pathlib.Path) -> None:
    folder = _record(tmp_path / "run", 4)
    singles = list(iter_episodes(_record(tmp_path / "one", 1)))
    (tmp_path / "one" / "episode_000_000002.npz").rename(folder / "episode_000_000099.npz")
    read = [(e.world, e.episode) for e in iter_episodes(folder)]
    assert read[:6] == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6)]
    assert read[6] == (0, 2) and len(read) == len(singles) + 1  # 099 sorts after the chunks


def test_a_failed_chunk_write_leaves_no_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_write(descriptor: int, parts: Any) -> int:
        os.write(descriptor, b"PK half a chunk")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", half_write)
    writer = NpzWriter(tmp_path / "run", episodes_per_file=2)
    recording = Recording(tmp_path / "run", 2, writer=writer)
    with pytest.raises(OSError, match="No space left"):
        _feed(recording)
    assert list((tmp_path / "run").iterdir()) == []  # neither a chunk nor a temporary file


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_episodes_per_file_is_checked(tmp_path: pathlib.Path, bad: Any) -> None:
    with pytest.raises(
        (errors.ArgumentValueError, errors.ArgumentTypeError), match="episodes_per_file"
    ):
        NpzWriter(tmp_path, episodes_per_file=bad)


def test_an_episode_whose_tensors_differ_starts_a_new_chunk(tmp_path: pathlib.Path) -> None:
    writer = NpzWriter(tmp_path / "run", episodes_per_file=4)
    with Recording(tmp_path / "run", 1, writer=writer) as recording:
        for dtype in (np.float32, np.float32, np.float64, np.float64):
            recording.add(0, None, dm_env.restart({"x": dtype(0)}))
            recording.add(0, {"a": np.int8(1)}, dm_env.termination(1.0, {"x": dtype(1)}))
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["episodes_000_000001-000002.npz", "episodes_000_000003-000004.npz"]
    dtypes = [e.observation["x"].dtype for e in iter_episodes(tmp_path / "run")]
    assert dtypes == [np.float32, np.float32, np.float64, np.float64]


def test_a_held_episode_is_a_copy_not_a_view_of_what_it_came_from(tmp_path: pathlib.Path) -> None:
    """A chunk in the making keeps its own copy: not the whole flush a view would hold, and
    not values changed after ``write`` (the buffer reused)."""
    buffer = np.arange(40, dtype=np.float32).reshape(20, 2)
    writer = NpzWriter(tmp_path, episodes_per_file=2)
    steps = np.array([0, 1, 2], np.uint8)
    reward = np.array([np.nan, 0.0, 1.0])
    episode = Episode(steps, reward, reward, {"x": buffer[:3]}, {"a": buffer[3:5, 0]}, 0, 1)
    assert writer.write(episode) is None and list(tmp_path.iterdir()) == []
    buffer[:] = -1
    writer.close()
    (read,) = iter_episodes(tmp_path)
    assert read.observation["x"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert read.action["a"].tolist() == [6, 8]
