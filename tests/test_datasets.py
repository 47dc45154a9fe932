"""Minari and RLDS datasets read back by the libraries' own readers, every step checked.

Needs the ``minari`` and ``rlds`` extras (skipped without them; ``.ci/run``
installs both and runs this file).
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib

import numpy as np
import pytest

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from tests.datasets_helpers import INTERRUPTED, Stepped, record, same

minari = pytest.importorskip("minari")
envlogger = pytest.importorskip("envlogger")
from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv  # noqa: E402
from dm_env_rpc_client.integrations.minari import MinariWriter  # noqa: E402
from dm_env_rpc_client.integrations.rlds import RldsWriter  # noqa: E402
from tests.variable_env import make as make_variable  # noqa: E402


def _end(episode: Stepped) -> str:
    if episode.cut:
        return "cut"
    return "interrupted" if episode.state == INTERRUPTED else "terminated"


def check_minari(dataset, tap) -> None:  # type: ignore[no-untyped-def]
    """Every episode of ``dataset`` is the stepped one of the same world and number."""
    stepped = tap.by_key()
    metas = list(dataset.storage.get_episode_metadata(range(dataset.total_episodes)))
    assert dataset.total_episodes == len(stepped) == len(metas)
    assert dataset.total_steps == sum(len(e.actions) for e in stepped.values())
    for meta, data in zip(metas, dataset.iterate_episodes(), strict=True):
        episode = stepped[(meta["world"], meta["episode"])]
        assert meta["seed"] == episode.seed
        assert meta["end"] == _end(episode)
        transitions = len(episode.actions)
        assert len(data) == transitions
        boards = np.stack([episode.observation(t)["board"] for t in range(transitions + 1)])
        assert same(data.observations["board"], boards)
        paddles = np.stack([a["paddle"] for a in episode.actions])
        assert same(data.actions["paddle"], paddles)
        rewards = [episode.steps[t].reward for t in range(1, transitions + 1)]
        assert np.array_equal(data.rewards, rewards)
        flags = np.zeros(transitions, bool)
        assert np.array_equal(data.terminations[:-1], flags[:-1])
        assert np.array_equal(data.truncations[:-1], flags[:-1])
        assert bool(data.terminations[-1]) == (_end(episode) == "terminated")
        assert bool(data.truncations[-1]) == (_end(episode) != "terminated")


def check_rlds(reader, tap) -> None:  # type: ignore[no-untyped-def]
    stepped = tap.by_key()
    metas = list(reader.episode_metadata())
    assert len(reader.episodes) == len(stepped) == len(metas)
    for meta, data in zip(metas, reader.episodes, strict=True):
        episode = stepped[(int(meta["world"]), int(meta["episode"]))]
        assert int(meta["seed"]) == episode.seed
        assert meta["end"] == _end(episode)
        assert len(data) == len(episode.steps)
        for t, (step, expected) in enumerate(zip(data, episode.steps, strict=True)):
            assert step.timestep.step_type == expected.step_type
            assert step.timestep.reward == expected.reward
            assert step.timestep.discount == expected.discount
            assert same(step.timestep.observation["board"], expected.observation["board"])
            if t == 0:
                assert step.action is None
            else:
                assert same(step.action["paddle"], episode.actions[t - 1]["paddle"])


@pytest.mark.parametrize("background", [False, "process"])
def test_minari_round_trip(catch_server, tmp_path, monkeypatch, background) -> None:
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    address = catch_server.address
    tap = record(
        address,
        lambda batch: MinariWriter.for_environment(
            tmp_path / "catch-random-v0", batch, env_kwargs={"address": address}, commit_every=0
        ),
        background=background,
    )
    assert any(e.cut for e in tap.stepped) and any(not e.cut for e in tap.stepped)
    dataset = minari.load_dataset("catch-random-v0")
    check_minari(dataset, tap)
    assert dataset.spec.dataset_id == "catch-random-v0"
    assert dataset.storage.metadata["jpeg_encoding"] is False
    env = dataset.recover_environment()
    try:
        assert isinstance(env.unwrapped, GymnasiumEnv)
        assert env.observation_space == dataset.observation_space
        assert env.action_space == dataset.action_space
        observation, _ = env.reset(seed=7)
        assert dataset.observation_space.contains(observation)
        env.step(dataset.action_space.sample())
    finally:
        env.close()


def test_minari_keeps_interrupted_apart_from_terminated(catch_server, tmp_path) -> None:
    tap = record(
        catch_server.address,
        lambda batch: MinariWriter.for_environment(tmp_path / "cut", batch),
        max_steps=4,
    )
    assert any(e.state == INTERRUPTED for e in tap.stepped)
    dataset = minari.MinariDataset(tmp_path / "cut" / "data")
    check_minari(dataset, tap)
    assert dataset.total_episodes and not any(ep.terminations.any() for ep in dataset)


@pytest.mark.parametrize("background", [False, "process"])
def test_rlds_round_trip_with_interrupted_episodes(catch_server, tmp_path, background) -> None:
    for name, settings in (("plain", {}), ("interrupted", {"max_steps": 4})):
        tap = record(
            catch_server.address,
            lambda batch, name=name: RldsWriter.for_environment(
                tmp_path / name, batch, settings={"run": name}, commit_every=0
            ),
            background=background,
            **settings,
        )
        with envlogger.Reader(str(tmp_path / name)) as reader:
            check_rlds(reader, tap)
            assert reader.metadata()["dm_env_rpc_client"] == {"run": name}
            spec = reader.observation_spec()["board"]
            assert spec.shape == (10, 5) and spec.dtype == np.float32
        assert not (tmp_path / name / ".staging").exists()
    assert any(e.state == INTERRUPTED for e in tap.stepped)


def test_minari_refuses_a_variable_shape_observation_before_any_step(tmp_path) -> None:
    with dmr.serve(make_variable) as server, dmr.connect(server.address) as connection:
        env, _ = dmr.create_and_join_world(connection, create_world_settings={})
        with pytest.raises(errors.RecordingError, match=r"'echo' is of variable shape") as caught:
            MinariWriter.for_environment(tmp_path / "variable", env)
        env.close()
    assert "--format npz" in str(caught.value)
    assert not (tmp_path / "variable").exists()


def test_a_single_adaptor_records_through_the_same_writer(catch_server, tmp_path) -> None:
    with dmr.connect(catch_server.address) as connection:
        env, _ = dmr.create_and_join_world(connection, create_world_settings={"seed": 3})
        writer = RldsWriter.for_environment(tmp_path / "one", env)
        with dmr.Recording(tmp_path / "one", 1, [3], writer=writer) as recording:
            rng = np.random.default_rng(0)
            recording.add(0, None, env.reset())
            for _ in range(25):
                action = {"paddle": np.int8(rng.integers(-1, 2))}
                recording.add(0, action, env.step(action))
        env.close()
    with envlogger.Reader(str(tmp_path / "one")) as reader:
        assert len(reader.episodes) == recording.episodes >= 2
        assert [int(m["seed"]) for m in reader.episode_metadata()] == [3] * recording.episodes


def test_writers_refuse_a_folder_that_holds_files(tmp_path, catch_server) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(errors.RecordingError, match="already holds"):
        RldsWriter(tmp_path / "full")
    from gymnasium import spaces

    with pytest.raises(errors.RecordingError, match="already holds"):
        MinariWriter(tmp_path / "full", spaces.Dict({}), spaces.Dict({}))
    assert pathlib.Path(tmp_path / "full" / "x").exists()


def test_minari_refuses_a_string_observation_by_name(tmp_path) -> None:
    from gymnasium import spaces

    observations = spaces.Dict({"camera": spaces.Dict({"caption": spaces.Text(8)})})
    with pytest.raises(errors.RecordingError, match=r"'camera.caption'.*--format npz"):
        MinariWriter(tmp_path / "text", observations, spaces.Dict({}))
    assert not (tmp_path / "text").exists()


def _episode_rows(lengths: list[int]):  # type: ignore[no-untyped-def]
    """A record batch of episodes of ``lengths`` rows (an image, a vector, a Discrete action)."""
    from gymnasium import spaces

    from dm_env_rpc_client.integrations.minari import _arrow as _minari_arrow

    rng = np.random.default_rng(0)
    observations = spaces.Dict(
        {"pixels": spaces.Box(0, 255, (6, 5, 3), np.uint8), "v": spaces.Box(-1, 1, (3,))}
    )
    actions = spaces.Dict({"move": spaces.Discrete(4)})
    episodes = [
        (
            {
                "pixels": rng.integers(0, 255, (n, 6, 5, 3)).astype(np.uint8),
                "v": rng.random((n, 3)).astype(np.float32),
            },
            {"move": rng.integers(0, 4, n - 1)},
            rng.random(n - 1),
            bool(i % 2),
        )
        for i, n in enumerate(lengths)
    ]
    return _minari_arrow.episodes_batch(observations, actions, episodes)


def test_minari_episode_files_are_pyarrows_own_bytes() -> None:
    """``IpcFiles`` (files assembled from a template) writes what ``pa.ipc.new_file`` writes."""
    import pyarrow as pa

    from dm_env_rpc_client.integrations.minari._arrow import IpcFiles

    batch, starts = _episode_rows([2, 11, 3, 40, 2, 7])
    files = IpcFiles()
    for start, stop in itertools.pairwise(starts):
        piece = batch.slice(start, stop - start)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, piece.schema) as file:
            file.write_batch(piece)
        made = b"".join(bytes(part) for part in files.parts(piece))
        assert made == sink.getvalue().to_pybytes(), (start, stop)
        assert pa.ipc.open_file(pa.py_buffer(made)).read_all().to_batches()[0].equals(piece)
    assert files._template is not None  # the template was used, not pyarrow's writer throughout


def test_minari_episode_files_fall_back_to_pyarrow_when_the_template_does_not_match(
    monkeypatch,
) -> None:
    import pyarrow as pa

    from dm_env_rpc_client.integrations.minari import _arrow as _minari_arrow

    real = _minari_arrow._template

    def wrong(own, batch):  # type: ignore[no-untyped-def]
        head, before, after = real(own, batch)  # type: ignore[misc]
        return head, before, after + b"\0"  # as if this pyarrow wrote its footer otherwise

    monkeypatch.setattr(_minari_arrow, "_template", wrong)
    batch, starts = _episode_rows([3, 5, 4, 9])
    files = _minari_arrow.IpcFiles()
    for start, stop in itertools.pairwise(starts):
        piece = batch.slice(start, stop - start)
        made = b"".join(bytes(part) for part in files.parts(piece))
        assert pa.ipc.open_file(pa.py_buffer(made)).read_all().to_batches()[0].equals(piece)
    assert files._template is None  # the second file's check turned the template off


def _as_proto(data):  # type: ignore[no-untyped-def]
    """A step from ``StepEncoder``: a proto, or its bytes (``SerializedData``) parsed."""
    from envlogger.proto import storage_pb2

    return storage_pb2.Data.FromString(data.SerializeToString())


def test_rlds_steps_are_envloggers_own_encoding_for_every_dtype() -> None:
    """The reused templates of ``rlds._steps`` give the protos ``codec.encode`` gives."""
    from envlogger.converters import codec

    from dm_env_rpc_client.integrations.rlds._steps import SerializedData, StepEncoder, step

    rng = np.random.default_rng(0)
    rows = 5
    observation = {
        "f32": rng.random((rows, 2, 3)).astype(np.float32),
        "f32_scalar": rng.random(rows).astype(np.float32),
        "u8": rng.integers(0, 255, (rows, 4, 4, 3)).astype(np.uint8),
        "i8_scalar": np.arange(rows, dtype=np.int8) - 2,
        "i16": rng.integers(-300, 300, (rows, 3)).astype(np.int16),
        "u16_scalar": np.arange(rows, dtype=np.uint16) + 255,
        "f64": rng.random((rows, 2)),
        "f64_scalar": rng.random(rows),
        "i32": np.arange(rows * 2, dtype=np.int32).reshape(rows, 2),
        "i64_scalar": np.arange(rows, dtype=np.int64) - 10**12,
        "u32_scalar": np.arange(rows, dtype=np.uint32),
        "u64": np.ones((rows, 2), np.uint64) * 2**63,
        "bools": rng.random((rows, 3)) > 0.5,
        "bool_scalar": rng.random(rows) > 0.5,
        "empty": np.zeros((rows, 0, 2), np.float32),
        "nested": {"x": np.arange(rows, dtype=np.int8)},
        "ragged": [np.arange(i, dtype=np.int32) for i in range(1, rows + 1)],
        "text": np.array(["a", "bc", "d", "ee", "f"]),
    }
    action = {"paddle": np.arange(rows - 1, dtype=np.int8), "v": rng.random((rows - 1, 2))}
    episode = dmr.Episode(
        step_type=np.array([0, 1, 1, 1, 2], np.uint8),
        reward=np.array([np.nan, 0.5, np.nan, 1.0, 2.0]),
        discount=np.array([np.nan, 1.0, 1.0, 1.0, 0.0]),
        observation=observation,
        action=action,
    )
    fixed = ("f32", "f32_scalar", "u8", "i8_scalar", "i16", "u16_scalar", "f64", "f64_scalar")
    fixed += ("bools", "bool_scalar", "empty", "nested")  # a fixed width on the wire: as bytes
    packable = dataclasses.replace(episode, observation={k: observation[k] for k in fixed})
    encoder = StepEncoder()
    for each, as_bytes in ((episode, False), (packable, True), (episode, False)):
        for t, data in enumerate(encoder.steps(each)):  # a second time: templates reused
            assert isinstance(data, SerializedData) == as_bytes, t
            assert _as_proto(data) == codec.encode(step(each, t)), t  # field for field
    for end in ("cut", "terminated", "cut"):
        meta = {"world": np.int64(3), "episode": np.int64(9), "seed": np.int64(-1), "end": end}
        assert _as_proto(encoder.metadata(meta)) == codec.encode(meta)
    for number in (-3, 7):  # other scalar types, each set again with a new value
        more = {"i16": np.int16(number), "f32": np.float32(number / 2), "u8": np.uint8(number % 9)}
        more |= {"flag": np.bool_(number > 0), "f": number / 4, "u64": np.uint64(abs(number))}
        assert _as_proto(encoder.metadata(more)) == codec.encode(more)
