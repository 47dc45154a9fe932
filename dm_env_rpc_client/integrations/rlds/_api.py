"""RLDS datasets from recorded runs: ``RldsWriter``, an ``EpisodeWriter`` for ``Recording``.

Needs the ``rlds`` extra (``pip install 'dm_env_rpc_client[rlds]'``: ``envlogger``
1.2, which writes Riegeli files; 1.3's compiled parts need glibc 2.38)::

    writer = RldsWriter.for_environment("catch-rlds", batch)
    with Recording("catch-rlds", len(batch), batch.world_seeds, writer=writer):
        ...                                   # or: dm-env-rpc-client run --record DIR --format rlds
    with envlogger.Reader("catch-rlds") as reader:
        for episode in reader.episodes: ...

- Layout: ``envlogger``'s: ``DIR/metadata.riegeli`` and one timestamped shard
  folder per commit; ``envlogger.Reader(DIR)`` reads them all, and TFDS's RLDS
  builders read the same files.
- Steps as ``envlogger.EnvLogger`` writes them: ``StepData(timestep, action)``
  where ``action`` led to ``timestep`` (None on FIRST). Rewards and discounts are
  dm_env's (None on FIRST). A TERMINATED episode ends with a LAST step of the
  server's discount (0.0 unless it sends one), an INTERRUPTED one with a LAST
  step (discount 1.0), and an episode the recording cut ends on a MID step.
- Metadata: the dataset's holds ``environment_specs`` (``reader.observation_spec()``
  and the others work) and the run's settings under ``dm_env_rpc_client``; each
  episode's holds ``world``, ``episode``, ``seed`` (-1 for none) and ``end``
  (``"terminated"``, ``"interrupted"`` or ``"cut"``).
- Crash safety: episodes are written into a shard under ``DIR/.staging`` and the
  shard is closed and moved into ``DIR`` every ``commit_every`` seconds (and at
  ``close``). The reader never sees a half-written shard, so a process killed
  at any moment leaves a dataset it opens, with every committed episode.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
from collections.abc import Mapping
from typing import Any

try:
    from envlogger.backends.python import riegeli_dataset_writer
    from envlogger.converters import codec, spec_codec
except ImportError as exc:  # pragma: no cover - exercised in a venv without envlogger
    raise ImportError(
        "dm_env_rpc_client.integrations.rlds needs envlogger: pip install 'dm_env_rpc_client[rlds]'"
    ) from exc

import numpy as np

from ... import recording
from ._steps import StepEncoder

STAGING = ".staging"
WRITER_OPTIONS = "zstd:1,chunk_size:1M"
"""Riegeli's options: zstd level 1. envlogger's own default, ``transpose,brotli:6``, writes
uint8 84x84x3 steps about 4x slower (2.4 ms a step against 0.6 ms, measured here)."""
_METADATA = "metadata.riegeli"
_NO_SEED = -1


class _Specs:
    """What ``spec_codec.encode_environment_specs`` asks of an environment."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def observation_spec(self) -> Any:
        return self._env.observation_spec()

    def action_spec(self) -> Any:
        return self._env.action_spec()

    def reward_spec(self) -> Any:
        return self._env.reward_spec()

    def discount_spec(self) -> Any:
        return self._env.discount_spec()


def _open(directory: pathlib.Path, metadata: Mapping[str, Any], options: str) -> Any:
    directory.mkdir(exist_ok=True)
    writer = riegeli_dataset_writer.RiegeliDatasetWriter()
    writer.init(
        data_dir=str(directory),
        metadata=codec.encode(dict(metadata)),
        max_episodes_per_shard=0,
        writer_options=options,
    )
    return writer


class RldsWriter:
    """Writes episodes as an RLDS dataset (``envlogger``'s Riegeli files) into ``directory``.

    Args:
      directory: the dataset's folder; new or empty.
      env: a ``DmEnvAdaptor`` (or anything with dm_env's four spec methods) whose
        specs go in the metadata; None: none.
      settings: the run's settings, stored under ``dm_env_rpc_client`` in the metadata.
      commit_every: seconds between commits (see the module docs); 0 commits every episode.
      writer_options: Riegeli writer options (compression, chunk size).

    Raises:
      RecordingError: the folder is not new or empty.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        env: Any = None,
        *,
        settings: Mapping[str, Any] | None = None,
        commit_every: float = 1.0,
        writer_options: str = WRITER_OPTIONS,
    ) -> None:
        self.directory = recording.prepare_folder(directory)
        self._staging = self.directory / STAGING
        self._options = writer_options
        self._commit_every = commit_every
        metadata: dict[str, Any] = {"dm_env_rpc_client": dict(settings or {})}
        if env is not None:
            metadata["environment_specs"] = spec_codec.encode_environment_specs(_Specs(env))
        _open(self.directory, metadata, writer_options).close()
        for shard in self.directory.iterdir():  # the empty shard the root writer left
            if shard.is_dir():
                shutil.rmtree(shard)
        self._writer: Any = None
        self._encoder = StepEncoder()
        self._last_commit = time.monotonic()
        self._pending = 0
        self._closed = False
        self.episodes = 0  # committed

    @classmethod
    def for_environment(cls, directory: str | pathlib.Path, env: Any, **kwargs: Any) -> RldsWriter:
        """A writer with the specs of ``env``: a ``DmEnvAdaptor`` or a ``BatchedEnvironment``."""
        return cls(directory, env.envs[0] if hasattr(env, "envs") else env, **kwargs)

    def write(self, episode: recording.Episode) -> None:
        """Adds one episode; commits when ``commit_every`` seconds have passed."""
        if self._writer is None:
            self._writer = _open(self._staging, {}, self._options)
        for t, data in enumerate(self._encoder.steps(episode)):
            if not self._writer.add_step(data, t == 0):
                raise RuntimeError(f"envlogger refused a step of episode {episode.episode}.")
        end = "cut" if episode.truncated else "interrupted" if episode.interrupted else "terminated"
        meta = {
            "world": np.int64(episode.world or 0),
            "episode": np.int64(episode.episode or 0),
            "seed": np.int64(_NO_SEED if episode.seed is None else episode.seed),
            "end": end,
        }
        self._writer.set_episode_metadata(self._encoder.metadata(meta))
        self._pending += 1
        if time.monotonic() - self._last_commit >= self._commit_every:
            self.commit()

    def commit(self) -> None:
        """Closes the open shard and moves it into the dataset, where the reader sees it."""
        self._last_commit = time.monotonic()
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        for shard in sorted(self._staging.iterdir()):
            if shard.is_dir():
                os.replace(shard, self.directory / shard.name)
        self.episodes += self._pending
        self._pending = 0

    def close(self) -> None:
        """Commits what is pending and removes the staging folder. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.commit()
        shutil.rmtree(self._staging, ignore_errors=True)


__all__ = ["RldsWriter"]
