"""Episodes recorded for offline learning: one ``.npz`` file per episode.

Layout of ``episode_<world>_<n>.npz`` (``T`` transitions; ``len(episode) == T``):

==============================  ================  =======================================
key                             shape             meaning
==============================  ================  =======================================
``step_type``                   ``[T+1]`` uint8   0 FIRST, 1 MID, 2 LAST (dm_env.StepType)
``reward``                      ``[T+1]`` float64 ``reward[0]`` is NaN (FIRST has none)
``discount``                    ``[T+1]`` float64 ``discount[0]`` is NaN
``observation/<name>``          ``[T+1, ...]``    observation ``t``; dotted names for nesting
``action/<name>``               ``[T, ...]``      the action taken at observation ``t``
``meta/world``                  ``[]`` int64      the world's index in its batch
``meta/episode``                ``[]`` int64      the episode's number in that world, from 1
``meta/seed``                   ``[]`` int64      the world's seed; -1 for none
``meta/truncated``              ``[]`` bool       the recording stopped before the LAST step
``meta/interrupted``            ``[]`` bool       the LAST step was INTERRUPTED, not TERMINATED
==============================  ================  =======================================

A tensor whose shape changes from step to step (a variable-length spec) is
stored as ``ragged/<group>/<name>`` (every step's values, flattened and
concatenated) with ``ragged_shape/<group>/<name>`` (``[steps, ndim]`` int64);
``load_episode`` gives it back as a list of arrays, one per step.

``NpzWriter(episodes_per_file=N)`` (``run --record`` writes 16) puts up to ``N`` of
a world's episodes in one ``episodes_<world>_<first>-<last>.npz``, their arrays
joined along the steps (``_tools.npz_chunks``); ``iter_episodes`` reads both.

Guarantees:

- A file is written under a temporary name and renamed into place, so a
  crash never leaves half an episode behind a real name.
- An episode that has not reached its LAST step when the recording stops
  (end of a run, Ctrl-C, a failed world) is saved with ``truncated`` set, as
  long as it holds one transition or more; its last ``step_type`` is MID.
- ``Recording`` refuses a folder that already holds files, so two runs never
  mix: give every run a folder of its own.

Other formats: ``Recording(..., writer=...)`` hands every finished episode, as
an ``Episode``, to an ``EpisodeWriter`` instead of writing ``.npz`` files:
``integrations.minari.MinariWriter`` and ``integrations.rlds.RldsWriter`` (see
``docs/datasets.md``). ``NpzWriter`` is the default.

Reading back::

    episode = dmr.load_episode("recordings/episode_000_000001.npz")
    episode.observation["board"].shape   # (T+1, rows, columns)
    len(episode), episode.world, episode.truncated
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import dm_env
import numpy as np

from . import errors, specs
from ._base import checks as _checks
from ._tools import npz_chunks as _chunks
from ._tools.background_writer import BackgroundWriter
from ._tools.episode_stream import _UNKNOWN, Block, EpisodeStream
from ._tools.npz_file import save_npz
from ._tools.writer_process import WriterProcess

_NOT_EMPTY = (
    "The recording folder {path} already holds {count} entries (e.g. {example!r}); "
    "recording into it would mix two runs. Give an empty or new folder."
)
_NOT_A_FOLDER = "The recording folder {path} is not a folder; give a folder path."
_CANNOT_CREATE = "Cannot create the recording folder {path}: {error}. Give a writable folder path."
_NO_FOLDER = "There is no recording folder {path}; give the folder a run recorded into."


@dataclasses.dataclass(frozen=True)
class Episode:
    """One recorded episode (see the module docs for the layout).

    ``len(episode)`` is the number of transitions ``T``: actions taken.

    Attributes:
      step_type: ``[T+1]`` uint8 step types.
      reward: ``[T+1]`` float64, NaN first.
      discount: ``[T+1]`` float64, NaN first.
      observation: nested dict of ``[T+1, ...]`` arrays (lists for ragged tensors).
      action: nested dict of ``[T, ...]`` arrays (lists for ragged tensors).
      world: the world's index in its batch (None in files without metadata).
      episode: the episode's number in its world, from 1 (None likewise).
      seed: the world's seed, None for none.
      truncated: True when the recording stopped before the episode's LAST step.
      interrupted: True when the LAST step was INTERRUPTED (the server cut the
        episode short: Gymnasium's ``truncated``), False when TERMINATED or cut.
    """

    step_type: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    observation: dict[str, Any]
    action: dict[str, Any]
    world: int | None = None
    episode: int | None = None
    seed: int | None = None
    truncated: bool = False
    interrupted: bool = False

    def __len__(self) -> int:
        return max(0, len(self.step_type) - 1)


def _number(value: Any) -> float:
    return float("nan") if value is None else float(np.asarray(value))


def _save_atomically(path: pathlib.Path, arrays: dict[str, np.ndarray], compress: bool) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        save_npz(temporary, arrays, compress)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class EpisodeWriter(Protocol):
    """Where finished episodes go: ``.npz`` files, a Minari or an RLDS dataset."""

    def write(self, episode: Episode) -> pathlib.Path | None:
        """Stores one finished (or cut) episode; returns its file, if it has one of its own."""

    def close(self) -> None:
        """Finishes the dataset. Idempotent."""


class NpzWriter:
    """Writes each episode as ``episode_<world>_<n>.npz`` into a folder (created if missing).

    Args:
      directory: the folder.
      compress: deflate the files (``np.savez_compressed``'s format): smaller, and
        several times slower to write; off by default (``np.savez``'s format).
      episodes_per_file: more than 1: each world's episodes are kept until that many
        (or 1 MiB of them) can go into one ``episodes_<world>_<first>-<last>.npz``
        (``_tools.npz_chunks``: creating a file is most of what one costs; ``run
        --record`` writes 16 per file); the rest are written at ``close``.
    """

    def __init__(
        self, directory: str | pathlib.Path, compress: bool = False, episodes_per_file: int = 1
    ) -> None:
        _checks.check_count(episodes_per_file, "episodes_per_file")
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.compress = compress
        self._chunks = _chunks.Chunks(episodes_per_file) if episodes_per_file > 1 else None

    def write(self, episode: Episode) -> pathlib.Path | None:
        """Writes ``episode`` atomically; returns its path (None: kept for a chunk)."""
        if self._chunks is not None:
            for name, arrays in self._chunks.add(episode):
                _save_atomically(self.directory / name, arrays, self.compress)
            return None
        path = self.directory / _chunks.episode_name(episode.world or 0, episode.episode or 0)
        _save_atomically(path, _chunks.episode_arrays(episode), self.compress)
        return path

    def close(self) -> None:
        """Writes the chunks in the making (every file is complete when written)."""
        for name, arrays in self._chunks.drain() if self._chunks is not None else ():
            _save_atomically(self.directory / name, arrays, self.compress)


class EpisodeRecorder:
    """Buffers one world's steps and hands each finished episode to a writer.

    It writes into ``directory`` as it is (use ``Recording`` for a whole run,
    which refuses a folder that already holds files).

    Args:
      directory: the folder to write ``.npz`` files into (created if missing),
        unless ``writer`` is given.
      world: the world's index, in the file names and the metadata.
      seed: the world's seed, for the metadata (None: none).
      writer: where the episodes go (default: an ``NpzWriter`` on ``directory``).

    ``written`` lists the paths written so far (episodes of a writer with no file
    per episode are counted in ``episodes``, not listed).
    """

    def __init__(
        self,
        directory: str | pathlib.Path | None = None,
        world: int = 0,
        *,
        seed: int | None = None,
        writer: EpisodeWriter | None = None,
    ) -> None:
        _checks.check_count(world, "world", low=0)
        if writer is None:
            if directory is None:
                raise TypeError("EpisodeRecorder needs a directory or a writer.")
            writer = NpzWriter(directory)
        self._recording = Recording(directory or "", 1, [seed], first_world=world, writer=writer)

    def add(
        self,
        action: Mapping[str, Any] | None,
        timestep: dm_env.TimeStep,
        state: int | None = None,
    ) -> None:
        """Adds a TimeStep and the action that led to it (None for FIRST).

        A FIRST step while an episode is unfinished saves that one truncated first.

        Args:
          action: the action that led to ``timestep`` (None for FIRST).
          timestep: the step.
          state: the server's ``EnvironmentStateType`` of a LAST step (2 TERMINATED,
            3 INTERRUPTED); None: a LAST step with discount 0 is TERMINATED, else INTERRUPTED.
        """
        self._recording.add(0, action, timestep, state)

    def truncate(self) -> pathlib.Path | None:
        """Saves the unfinished episode marked truncated, and starts afresh.

        Call it when the recording stops before the episode's LAST step (the
        end of a run, Ctrl-C, a world that failed). An episode with no
        transition yet is dropped.

        Returns:
          The file written, or None when there was nothing to save (or the
          writer has no file per episode).
        """
        return self._recording.truncate(0)

    @property
    def written(self) -> list[pathlib.Path]:
        """The paths written so far, in order."""
        return self._recording.written

    @property
    def episodes(self) -> int:
        """Episodes written."""
        return self._recording.episodes

    @property
    def truncated(self) -> int:
        """How many of them are truncated."""
        return self._recording.truncated


class Recording:
    """A whole run's recording: its worlds' episodes, cut from their steps, in one fresh folder.

    Steps come in one world at a time (``add``) or as a batch's ``recv``
    (``add_batch``, what ``run --record`` does: no per-world work while the
    batch steps). ``_tools.episode_stream.EpisodeStream`` cuts them into episodes by
    ``EpisodeRecorder``'s rules, a block of steps at a time: after every
    ``flush_steps`` steps or ``flush_seconds`` seconds, at a FIRST or LAST step
    given to ``add`` without ``background``, and at ``truncate`` and ``close``.

    Args:
      directory: the run's folder: created if missing; refused if it holds anything.
      worlds: how many worlds the run has.
      seeds: each world's seed, for the metadata (None: none).
      first_world: the index of world 0 in file names and metadata (a shard of a
        larger run records its worlds under their indices in the whole run).
      writer: where the episodes go (default: ``.npz`` files in ``directory``);
        a writer made for ``directory`` (``MinariWriter``, ``RldsWriter``) is
        closed with the recording.
      background: cut and write while the batch steps: ``"process"`` in a child
        process (``WriterProcess``, what ``run --record`` does: the stepping side
        only pickles and queues; the writer must be picklable), ``"thread"`` (or
        True) on a thread of the stepping process (``BackgroundWriter``), False
        here and now. In the background, ``episodes`` counts the episodes written
        so far (a child process's: all of them at ``close``), and ``truncate``
        returns None.
      flush_steps: steps held before they are cut into episodes.
      flush_seconds: seconds steps are held at most (checked as steps come in).

    Raises:
      RecordingError: the folder is not empty, not a folder, or cannot be created.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        worlds: int,
        seeds: Sequence[int | None] | None = None,
        *,
        first_world: int = 0,
        writer: EpisodeWriter | None = None,
        background: bool | str = False,
        flush_steps: int = 2048,
        flush_seconds: float = 0.5,
    ) -> None:
        _checks.check_count(worlds, "worlds")
        if writer is None:
            self.directory = prepare_folder(directory)
            writer = NpzWriter(self.directory)
        else:
            self.directory = pathlib.Path(directory)
        self.writer = writer
        if background not in (False, True, "thread", "process"):
            raise errors.ArgumentValueError(
                f"background is False, 'thread' (or True) or 'process', not {background!r}."
            )
        seeds = list(seeds) if seeds is not None else [None] * worlds
        self._background: BackgroundWriter | WriterProcess | None = None
        if background == "process":
            self._background = WriterProcess(
                writer, Episode, worlds, seeds, first_world, directory=self.directory
            )
        elif background:
            self._background = BackgroundWriter(writer)
        self._worlds = worlds
        self._stream = EpisodeStream(worlds, seeds, first_world, self._emit)
        self._blocks: list[Block] = []
        self._rows = 0
        self._flush_steps = flush_steps
        self._flush_seconds = flush_seconds
        self._since = time.monotonic()
        self.written: list[pathlib.Path] = []  # the files written, in order
        self._closed = False
        self.episodes = 0  # episodes written, truncated ones included
        self.truncated = 0  # truncated episodes written

    def _emit(self, **fields: Any) -> None:
        path = self.writer.write(Episode(**fields))
        if path is not None:
            self.written.append(path)
        self.episodes += 1
        self.truncated += fields["truncated"]

    def add(
        self,
        world: int,
        action: Mapping[str, Any] | None,
        timestep: dm_env.TimeStep,
        state: int | None = None,
    ) -> None:
        """Adds world ``world``'s TimeStep and the action that led to it (None for FIRST).

        ``state`` is the server's state of the step (``BatchedTimeStep.state``):
        it tells a TERMINATED LAST step from an INTERRUPTED one.
        """
        step_type = int(timestep.step_type)
        observation = specs.flatten(_as_dict(timestep.observation))
        block = Block(
            step_type=np.array([step_type], np.uint8),
            reward=np.array([_number(timestep.reward)]),
            discount=np.array([_number(timestep.discount)]),
            state=np.array([_UNKNOWN if state is None else state], np.uint8),
            env_ids=np.array([world]),
            observation={name: _one_row(value) for name, value in observation.items()},
            actions=[None if step_type == 0 else dict(action or {})],
        )
        self._add(block, boundary=step_type != 1 and self._background is None)

    def add_batch(self, steps: Any, actions: Sequence[Mapping[str, Any] | None]) -> None:
        """Adds a batch's finished steps (a ``BatchedTimeStep``) and the actions that led to them.

        Args:
          steps: the steps, as ``BatchedEnvironment.recv`` gives them.
          actions: each step's action, in the same order (None for FIRST steps).
        """
        block = Block(
            step_type=steps.step_type,
            reward=steps.reward,
            discount=steps.discount,
            state=steps.state,
            env_ids=steps.env_ids,
            observation=specs.flatten(steps.observation),
            actions=actions,
        )
        self._add(block, boundary=False)

    def _add(self, block: Block, *, boundary: bool) -> None:
        self._blocks.append(block)
        self._rows += len(block.step_type)
        if (
            boundary
            or self._rows >= self._flush_steps
            or time.monotonic() - self._since >= self._flush_seconds
        ):
            self._flush(())

    def _flush(self, worlds: Sequence[int]) -> None:
        blocks, self._blocks, self._rows = self._blocks, [], 0
        self._since = time.monotonic()
        if isinstance(self._background, WriterProcess):
            self._background.cut(blocks, worlds)
        elif self._background is not None:
            self._background.call(self._stream.cut, blocks, worlds)
        else:
            self._stream.cut(blocks, worlds)

    def truncate(self, world: int) -> pathlib.Path | None:
        """Saves world ``world``'s unfinished episode marked truncated (for a failed world).

        Returns:
          The file written, or None when there was nothing to save (or it is
          written in the background, or the writer has no file per episode).
        """
        written = len(self.written)
        self._flush([world])
        return self.written[-1] if len(self.written) > written else None

    def close(self) -> None:
        """Saves every unfinished episode marked truncated, and closes the writer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if isinstance(self._background, WriterProcess):
            blocks, self._blocks, self._rows = self._blocks, [], 0
            self._background.close(blocks, range(self._worlds))
            self.episodes, self.truncated, written = self._background.result
            self.written = [pathlib.Path(path) for path in written]
            return
        try:
            self._flush(range(self._worlds))
        finally:
            (self._background or self.writer).close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def prepare_folder(directory: str | pathlib.Path) -> pathlib.Path:
    """Creates an empty recording folder, or checks that an existing one is empty.

    Returns:
      The folder's path.

    Raises:
      RecordingError: the path is empty, not a folder, holds entries, or
        cannot be created.
    """
    if not str(directory):
        raise errors.RecordingError(_CANNOT_CREATE.format(path="''", error="the path is empty"))
    path = pathlib.Path(directory)
    if path.exists() and not path.is_dir():
        raise errors.RecordingError(_NOT_A_FOLDER.format(path=path))
    try:
        path.mkdir(parents=True, exist_ok=True)
        entries = sorted(entry.name for entry in path.iterdir())
    except OSError as exc:
        raise errors.RecordingError(
            _CANNOT_CREATE.format(path=path, error=exc.strerror or exc)
        ) from exc
    if entries:
        raise errors.RecordingError(
            _NOT_EMPTY.format(path=path, count=len(entries), example=entries[0])
        )
    return path


def _one_row(value: Any) -> np.ndarray:
    """``value`` as a one-row column (an object column when it is not a plain array)."""
    array = np.asarray(value)
    if array.dtype != object:
        return array[np.newaxis]
    column = np.empty(1, object)
    column[0] = array
    return column


def _as_dict(observation: Any) -> dict[str, Any]:
    return dict(observation) if isinstance(observation, Mapping) else {"observation": observation}


_SEVERAL = (
    "{path} holds {count} episodes (NpzWriter's episodes_per_file): read them with "
    "dmr.iter_episodes(its folder)."
)
_A_FOLDER = (
    "path {path} is a folder: pass one of its episode files (.npz), or read them all with "
    "dmr.iter_episodes(folder)."
)


def load_episode(path: str | pathlib.Path) -> Episode:
    """Reads one recorded episode back; observations and actions are nested dicts.

    Raises:
      FileNotFoundError: there is no such file.
      RecordingError: ``path`` is a folder, or a file of several episodes
        (``iter_episodes`` reads a folder).
    """
    _checks.check_type(path, (str, os.PathLike), "path", "an episode file's path (.npz)")
    if pathlib.Path(path).is_dir():
        raise errors.RecordingError(_A_FOLDER.format(path=path))
    episodes = _read(pathlib.Path(path))
    if len(episodes) != 1:
        raise errors.RecordingError(_SEVERAL.format(path=path, count=len(episodes)))
    return episodes[0]


def iter_episodes(directory: str | pathlib.Path) -> Iterator[Episode]:
    """Reads every recorded episode in a folder (episode and chunk files), by world, then episode.

    Raises:
      RecordingError: the folder does not exist (raised by this call, not at
        the first ``next``).
    """
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise errors.RecordingError(_NO_FOLDER.format(path=path))
    files = sorted(path.glob("episode*_*.npz"), key=lambda file: _chunks.order(file.name))
    return (episode for file in files for episode in _read(file))


def _read(path: pathlib.Path) -> list[Episode]:
    with np.load(path, allow_pickle=False) as data:
        return _chunks.read(data, Episode)
