"""``Recording(background="process")``: episodes cut and written by a child process.

The same files as a recording in the stepping process; the child's errors raised
in the parent by name; a stuck child bounds the stepping side's wait and memory,
and ``close``'s; a SIGKILLed parent leaves a child that commits and exits.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from conftest import wait_for

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client._tools.episode_stream import Block
from dm_env_rpc_client._tools.writer_process import WriterProcess
from tests.datasets_helpers import StuckWriter


class _Both:
    """Hands every step to several recordings (what ``dmr.collect`` calls of one)."""

    def __init__(self, *recordings: dmr.Recording) -> None:
        self.recordings = recordings

    def add_batch(self, steps: Any, actions: Any) -> None:
        for recording in self.recordings:
            recording.add_batch(steps, actions)

    def truncate(self, world: int) -> None:
        for recording in self.recordings:
            recording.truncate(world)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_writer_process_writes_the_same_files_as_the_stepping_process(
    catch_server, tmp_path
) -> None:
    batch = dmr.BatchedEnvironment.connect([catch_server.address], 3, seed=5, timeout=30)
    # Flushed by their steps alone (not also every 0.5 s, which the two would reach at
    # different steps): a flush cuts its episodes world by world, so the files' order is the
    # same only for the same flushes.
    here = dmr.Recording(tmp_path / "here", 3, batch.world_seeds, flush_seconds=3600)
    child = dmr.Recording(
        tmp_path / "child", 3, batch.world_seeds, background="process", flush_seconds=3600
    )
    try:
        both = _Both(here, child)
        dmr.collect(batch, steps=316, pipeline=4, timeout=30, seed=5, record=both)  # type: ignore[arg-type]
        blocks, child._blocks, child._rows = child._blocks, [], 0
        here._flush(())
        assert child._background.sync(blocks) == (here.episodes, 0)  # type: ignore[union-attr]
    finally:
        here.close()
        child.close()
        batch.close()
    assert child.episodes == here.episodes > 20 and child.truncated == here.truncated > 0
    names = [path.name for path in here.written]
    assert [path.name for path in child.written] == names
    for name in names:
        assert (tmp_path / "child" / name).read_bytes() == (tmp_path / "here" / name).read_bytes()
    assert not _alive(child._background.pid)  # type: ignore[union-attr]


def _image_blocks() -> list[Block]:
    """Two worlds' steps in 3 blocks, images of 1.6 kB (sent as the blocks' parts) and a
    small column; episodes span blocks; the first block holds FIRST steps alone."""
    rng = np.random.default_rng(7)
    kinds = [[0, 0], [1, 1, 1, 2, 1], [0, 1, 2, 1, 1, 1]]
    worlds = [[0, 1], [0, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1]]
    blocks = []
    for step_type, env_ids in zip(kinds, worlds, strict=True):
        rows = len(step_type)
        blocks.append(
            Block(
                step_type=np.array(step_type, np.uint8),
                reward=rng.random(rows),
                discount=np.ones(rows),
                state=None,
                env_ids=np.array(env_ids),
                observation={
                    "pixels": rng.integers(0, 255, (rows, 40, 40), np.uint8),
                    "x": rng.random(rows).astype(np.float32),
                },
                actions=[
                    None if k == 0 else {"move": np.int64(k + w)}
                    for k, w in zip(step_type, env_ids, strict=True)
                ],
            )
        )
    return blocks


def test_images_sent_as_parts_give_the_same_files_as_the_stepping_process(tmp_path) -> None:
    from dm_env_rpc_client._tools.episode_stream import EpisodeStream, joined

    blocks = _image_blocks()
    assert isinstance(joined(blocks)[1]["obs/pixels"], list)  # parts, joined by the child
    here = dmr.recording.NpzWriter(tmp_path / "here")
    stream = EpisodeStream(2, [3, 4], 0, lambda **fields: here.write(dmr.Episode(**fields)))
    stream.cut(blocks, [0, 1])
    child = dmr.recording.NpzWriter(tmp_path / "child")
    process = WriterProcess(child, dmr.Episode, 2, [3, 4], 0, directory=tmp_path)
    process.cut(blocks[:2])
    process.close(blocks[2:], [0, 1])
    names = sorted(path.name for path in (tmp_path / "here").iterdir())
    assert len(names) == 3 and process.result[:2] == (3, 1)  # world 1 cut at the close
    assert names == sorted(path.name for path in (tmp_path / "child").iterdir())
    for name in names:
        assert (tmp_path / "child" / name).read_bytes() == (tmp_path / "here" / name).read_bytes()
    episode = dmr.load_episode(tmp_path / "here" / names[0])
    assert episode.observation["pixels"].shape == (len(episode) + 1, 40, 40)


def test_a_failing_writer_process_raises_a_clear_error_in_the_parent(
    catch_server, tmp_path
) -> None:
    folder = tmp_path / "gone"
    batch = dmr.BatchedEnvironment.connect([catch_server.address], 2, seed=1, timeout=30)
    recording = dmr.Recording(folder, 2, background="process", flush_steps=8)
    process = recording._background
    assert isinstance(process, WriterProcess)
    process.wait_ready()
    folder.rmdir()
    folder.write_text("a file where the folder was")  # the child's next file cannot be made
    started = time.monotonic()
    try:
        with pytest.raises(errors.RecordingError) as caught:
            dmr.collect(batch, steps=5000, pipeline=2, timeout=30, seed=1, record=recording)
            recording.close()
    finally:
        recording.close()  # after the error: ends the child, raises nothing more
        batch.close()
    message = str(caught.value)
    assert f"Recording into {folder} failed in its writer process (NpzWriter)" in message
    assert "NotADirectoryError" in message and str(folder) in message
    assert time.monotonic() - started < 60
    assert wait_for(lambda: not _alive(process.pid), timeout=10)


def _episode_block(rows: int, size: int) -> Block:
    """``rows`` steps of world 0, one whole episode, with observations of ``size`` bytes."""
    step_type = np.ones(rows, np.uint8)
    step_type[0], step_type[-1] = 0, 2
    return Block(
        step_type=step_type,
        reward=np.zeros(rows),
        discount=np.ones(rows),
        state=None,
        env_ids=np.zeros(rows, np.int64),
        observation={"pixels": np.zeros((rows, size), np.uint8)},
        actions=[None] + [{"move": np.int64(1)}] * (rows - 1),
    )


def test_a_stuck_writer_process_bounds_the_stepping_sides_wait_memory_and_close(
    tmp_path,
) -> None:
    process = WriterProcess(
        StuckWriter(), dmr.Episode, 1, [None], 0, directory=tmp_path, max_bytes=1 << 20, timeout=1.0
    )
    process.wait_ready()
    block = _episode_block(4, 100_000)  # 400 kB a message; the pipe holds 64 kB
    started = time.monotonic()
    sent = 0
    with pytest.raises(errors.RecordingError, match=r"took no data for 1.0 s") as caught:
        for _ in range(50):
            process.cut([block])
            sent += 1
    assert "(StuckWriter)" in str(caught.value) and str(tmp_path) in str(caught.value)
    assert sent <= 4  # at most 1 MB waited: the rest was refused, not queued
    assert process._queued <= 1 << 20
    process.close()  # after the error: ends the child, raises nothing more
    assert time.monotonic() - started < 30
    assert not _alive(process.pid)


def test_close_of_a_stuck_writer_process_is_bounded(tmp_path) -> None:
    process = WriterProcess(
        StuckWriter(), dmr.Episode, 1, [None], 0, directory=tmp_path, timeout=1.0
    )
    process.cut([_episode_block(3, 10)])  # the child is stuck writing its episode
    started = time.monotonic()
    with pytest.raises(errors.RecordingError, match=r"did not finish within 1.0 s and was killed"):
        process.close()
    assert time.monotonic() - started < 30
    assert not _alive(process.pid)


def test_a_writer_that_cannot_be_pickled_is_refused_with_the_way_out(tmp_path) -> None:
    class Local:
        def write(self, episode: Any) -> None:
            pass

        def close(self) -> None:
            pass

    with pytest.raises(errors.RecordingError, match=r"background='thread'"):
        dmr.Recording(tmp_path / "x", 1, writer=Local(), background="process")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'process'"):
        dmr.Recording(tmp_path / "y", 1, background="processes")


_PARENT = """
import sys
import dm_env_rpc_client as dmr

address, folder, fmt = sys.argv[1:4]
batch = dmr.BatchedEnvironment.connect([address], 4, seed=1, timeout=30)
writer = None
if fmt == "minari":
    from dm_env_rpc_client.integrations.minari import MinariWriter

    writer = MinariWriter.for_environment(folder, batch, commit_every=0)
elif fmt == "npz-chunks":  # run --record's layout: 16 episodes of a world per file
    writer = dmr.recording.NpzWriter(folder, episodes_per_file=16)
recording = dmr.Recording(
    folder, 4, batch.world_seeds, writer=writer, background="process", flush_steps=64
)
print(recording._background.pid, flush=True)
dmr.collect(batch, steps=10**8, pipeline=4, timeout=60, seed=1, record=recording)
"""


def _committed(folder: pathlib.Path, fmt: str) -> int:
    if fmt == "npz":
        return len(list(folder.glob("episode_*.npz")))
    if fmt == "npz-chunks":
        return len(list(dmr.iter_episodes(folder))) if folder.is_dir() else 0
    minari = pytest.importorskip("minari")
    try:
        return int(minari.MinariDataset(folder / "data").total_episodes)
    except Exception:  # not there yet
        return 0


@pytest.mark.parametrize("fmt", ["npz", "npz-chunks", "minari"])
def test_a_sigkilled_parent_leaves_a_child_that_commits_and_exits(
    catch_server, tmp_path, fmt
) -> None:
    if fmt == "minari":  # the [minari] extra: minari and its arrow storage
        pytest.importorskip("minari")
        pytest.importorskip("pyarrow", reason="needs the minari extra: pip install -e '.[minari]'")
    folder = tmp_path / "orphan-v0"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, catch_server.address, str(folder), fmt],
        stdout=subprocess.PIPE,
        text=True,
        cwd=pathlib.Path(__file__).parent.parent,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert wait_for(lambda: _committed(folder, fmt) >= 20, timeout=60)
        before = _committed(folder, fmt)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert wait_for(lambda: not _alive(child), timeout=30), "the writer outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)
    assert _committed(folder, fmt) >= before
    if fmt.startswith("npz"):
        episodes = list(dmr.iter_episodes(folder))
        assert len(episodes) >= before and not list(folder.glob(".*.tmp"))
        for episode in episodes:
            assert episode.step_type[0] == 0 and episode.step_type[-1] == 2
            assert not episode.truncated and len(episode.action["paddle"]) == len(episode)
        return
    import minari

    dataset = minari.MinariDataset(folder / "data")
    metas = list(dataset.storage.get_episode_metadata(range(dataset.total_episodes)))
    for meta, episode in zip(metas, dataset.iterate_episodes(), strict=True):
        assert len(episode) == meta["total_steps"] == len(episode.observations["board"]) - 1
        assert meta["end"] == "terminated" and episode.terminations[-1]
    assert dataset.total_steps == sum(m["total_steps"] for m in metas)
