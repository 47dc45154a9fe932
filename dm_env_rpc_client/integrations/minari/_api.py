"""Minari datasets from recorded runs: ``MinariWriter``, an ``EpisodeWriter`` for ``Recording``.

Needs the ``minari`` extra (``pip install 'dm_env_rpc_client[minari]'``: Minari
with its Arrow storage)::

    writer = MinariWriter.for_environment("datasets/catch-random-v0", batch)
    with Recording("datasets/catch-random-v0", len(batch), batch.world_seeds, writer=writer):
        ...                                   # or: dm-env-rpc-client run --record DIR --format minari
    dataset = minari.MinariDataset("datasets/catch-random-v0/data")

- Layout: ``DIR/data/metadata.json`` plus one Arrow folder per episode (Minari's
  ``arrow`` storage; ``minari._arrow`` has the columns). Record into
  ``$MINARI_DATASETS_PATH/<dataset id>`` (default ``~/.minari/datasets``) and
  ``minari.load_dataset(<dataset id>)`` finds it.
- Spaces: the Gymnasium bridge's (``spaces_from_specs``), so
  ``dataset.recover_environment()`` makes a ``GymnasiumEnv`` with the same spaces
  (pass ``address=`` when the recorded server has gone). A tensor the format
  cannot hold (a string, a variable shape) is refused when the writer is made,
  by name, before any step.
- Episodes: ``terminations`` from TERMINATED, ``truncations`` from INTERRUPTED
  and from episodes the recording cut (restart, end of run, Ctrl-C). Minari has
  no discount: ``terminations`` carries it. Each episode's metadata holds
  ``seed`` (its world's seed), ``world``, ``episode`` (its number in the world)
  and ``end`` (``"terminated"``, ``"interrupted"`` or ``"cut"``).
- Crash safety: episodes are committed every ``commit_every`` seconds (and at
  ``close``): their Arrow files first, then ``metadata.json`` replaced
  atomically. A process killed at any moment leaves a dataset Minari opens, with
  every episode committed before the kill (at most ``commit_every`` seconds of
  episodes are lost; ``commit_every=0`` commits each episode as it ends).
- Not Minari's ``update_episodes``: it rescans the whole folder for every
  episode (quadratic), and rewrites ``metadata.json`` in place, not atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

try:
    import minari
    import pyarrow  # noqa: F401  (the arrow storage: _minari_arrow needs it)
    from gymnasium import spaces
    from gymnasium.envs.registration import EnvSpec
    from minari.serialization import serialize_space
except ImportError as exc:  # pragma: no cover - exercised in a venv without minari
    raise ImportError(
        "dm_env_rpc_client.integrations.minari needs minari with its arrow storage: "
        "pip install 'dm_env_rpc_client[minari]'"
    ) from exc

from ... import errors, recording, specs
from ..._tools.npz_file import write_parts
from ..gymnasium._spaces import spaces_from_specs
from . import _arrow as _minari_arrow

METADATA = "metadata.json"
ENTRY_POINT = "dm_env_rpc_client.integrations.gymnasium:GymnasiumEnv"
DEFAULT_ALGORITHM = "uniform random actions (dm-env-rpc-client run)"
_VARIABLE = (
    "{error} A Minari dataset cannot hold it either: leave it out, or record with "
    "--format npz or --format rlds, which keep it."
)


def _write_json(path: pathlib.Path, data: Mapping[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(data, file)
    os.replace(temporary, path)


def _space(tensor_specs: Any, names: Sequence[str], kind: str) -> spaces.Dict:
    try:
        space = spaces_from_specs(tensor_specs, names=names, kind=kind)
    except errors.SpecError as exc:
        raise errors.RecordingError(_VARIABLE.format(error=exc)) from exc
    _minari_arrow.check_space(space, kind)
    return space


class MinariWriter:
    """Writes episodes into a Minari dataset (``arrow`` storage) at ``directory``.

    Args:
      directory: the dataset's folder (``directory/data`` holds the data); new or empty.
      observation_space: the observations' space (a ``Dict`` keyed like the SDK's
        nested observations).
      action_space: the actions' space, likewise.
      dataset_id: Minari's id, ``name-vN`` (default: the folder's name, plus
        ``-v0`` when it has no version).
      env_kwargs: ``GymnasiumEnv`` keyword arguments for ``recover_environment``
        (``address``, ``create_world_settings``, ...); None: no env spec.
      algorithm_name: Minari's ``algorithm_name``.
      author: Minari's ``author``; None: the user's login name.
      author_email: Minari's ``author_email``; None: left out.
      code_permalink: Minari's ``code_permalink``; None: left out.
      description: Minari's ``description``.
      settings: the run's settings, stored under ``dm_env_rpc_client`` in the metadata.
      commit_every: seconds between commits (see the module docs); 0 commits every episode.

    Raises:
      RecordingError: the folder is not new or empty, or a space cannot be stored.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        *,
        dataset_id: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        algorithm_name: str = DEFAULT_ALGORITHM,
        author: str | None = None,
        author_email: str | None = None,
        code_permalink: str | None = None,
        description: str = "Episodes recorded from dm_env_rpc worlds by dm-env-rpc-client.",
        settings: Mapping[str, Any] | None = None,
        commit_every: float = 1.0,
    ) -> None:
        _minari_arrow.check_space(observation_space, "observation")
        _minari_arrow.check_space(action_space, "action")
        root = recording.prepare_folder(directory)
        self.directory = root
        self.data = root / "data"
        self.data.mkdir()
        self.observation_space = observation_space
        self.action_space = action_space
        self.dataset_id = dataset_id or default_dataset_id(root)
        self._commit_every = commit_every
        self._pending: list[tuple[Any, dict[str, Any]]] = []
        self._files = _minari_arrow.IpcFiles()
        self._last_commit = time.monotonic()
        self._closed = False
        self.episodes = 0  # committed
        self.steps = 0
        self._bytes = 0
        metadata: dict[str, Any] = {
            "dataset_id": self.dataset_id,
            "total_episodes": 0,
            "total_steps": 0,
            "data_format": "arrow",
            "jpeg_encoding": False,  # lossless: images stay as recorded
            "observation_space": serialize_space(observation_space),
            "action_space": serialize_space(action_space),
            "algorithm_name": algorithm_name,
            "author": [author or _login()],
            "description": description,
            "minari_version": minari.__version__,
            "dataset_size": 0.0,
            "dm_env_rpc_client": dict(settings or {}),
        }
        if author_email:
            metadata["author_email"] = [author_email]
        if code_permalink:
            metadata["code_permalink"] = code_permalink
        if env_kwargs is not None:
            spec = EnvSpec(
                id=self.dataset_id.rsplit("/", 1)[-1].split("-v")[0] + "-dm-env-rpc-v0",
                entry_point=ENTRY_POINT,
                nondeterministic=True,
                kwargs=dict(env_kwargs),
            )
            metadata["env_spec"] = spec.to_json()
        self._metadata = metadata
        _write_json(self.data / METADATA, metadata)

    @classmethod
    def for_environment(
        cls, directory: str | pathlib.Path, env: Any, **kwargs: Any
    ) -> MinariWriter:
        """A writer whose spaces are those of ``env``'s observations and actions.

        Args:
          directory: the dataset's folder.
          env: a ``DmEnvAdaptor`` or a ``BatchedEnvironment``.
          **kwargs: ``MinariWriter``'s keyword arguments.

        Raises:
          RecordingError: a tensor cannot be stored (named, with what to do).
        """
        template = env.envs[0] if hasattr(env, "envs") else env
        wire = template._wire_specs
        observations = _space(
            wire.observations, list(specs.flatten(template.observation_spec())), "observation"
        )
        actions = _space(wire.actions, list(specs.flatten(template.action_spec())), "action")
        return cls(directory, observations, actions, **kwargs)

    def write(self, episode: recording.Episode) -> None:
        """Adds one episode; commits when ``commit_every`` seconds have passed."""
        transitions = len(episode)
        end = "cut" if episode.truncated else "interrupted" if episode.interrupted else "terminated"
        meta: dict[str, Any] = {
            "id": self.episodes + len(self._pending),
            "total_steps": transitions,
            "world": episode.world,
            "episode": episode.episode,
            "end": end,
        }
        if episode.seed is not None:
            meta["seed"] = episode.seed
        rows = (episode.observation, episode.action, episode.reward[1:], end == "terminated")
        self._pending.append((rows, meta))
        if time.monotonic() - self._last_commit >= self._commit_every:
            self.commit()

    def commit(self) -> None:
        """Writes the pending episodes, then the metadata that makes them part of the dataset."""
        self._last_commit = time.monotonic()
        if not self._pending:
            return
        batch, starts = _minari_arrow.episodes_batch(
            self.observation_space, self.action_space, [rows for rows, _ in self._pending]
        )
        data = str(self.data)
        for (_, meta), start, stop in zip(self._pending, starts, starts[1:], strict=False):
            # Not atomic, and need not be: no reader looks at an episode's folder before the
            # dataset's metadata.json counts it. Three inodes an episode (a folder and two
            # files) is what Minari's reader asks for; each is written in one call.
            folder = f"{data}/{meta['id']}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder)
            arrow = self._files.parts(batch.slice(start, stop - start))
            text = json.dumps(meta).encode()
            self._bytes += write_parts(f"{folder}/part-0.arrow", arrow, 0o666) + write_parts(
                f"{folder}/{METADATA}", [text], 0o666
            )
            self.steps += meta["total_steps"]
        self.episodes += len(self._pending)
        self._pending = []
        self._metadata.update(
            total_episodes=self.episodes,
            total_steps=self.steps,
            dataset_size=round(self._bytes / 1e6, 1),
        )
        _write_json(self.data / METADATA, self._metadata)

    def close(self) -> None:
        """Commits what is pending. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.commit()


def default_dataset_id(directory: pathlib.Path) -> str:
    """The folder's name, with ``-v0`` added unless it ends in a version (``-v3``)."""
    name = directory.resolve().name
    head, _, version = name.rpartition("-v")
    return name if head and version.isdigit() else f"{name}-v0"


def _login() -> str:
    try:
        return os.getlogin()
    except OSError:
        return os.environ.get("USER", "unknown")


__all__ = ["DEFAULT_ALGORITHM", "MinariWriter", "default_dataset_id"]
