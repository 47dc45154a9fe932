"""Episodes recorded for offline learning: one compressed ``.npz`` file per episode.

Layout of ``episode_<world>_<n>.npz`` (``T`` is the number of transitions):

==========================  ================  =========================================
key                         shape             meaning
==========================  ================  =========================================
``step_type``               ``[T+1]`` uint8   0 FIRST, 1 MID, 2 LAST (dm_env.StepType)
``reward``                  ``[T+1]`` float64 ``reward[0]`` is NaN (FIRST has none)
``discount``                ``[T+1]`` float64 ``discount[0]`` is NaN
``observation/<name>``      ``[T+1, ...]``    observation ``t``; dotted names for nesting
``action/<name>``           ``[T, ...]``      the action taken at observation ``t``
==========================  ================  =========================================

An episode runs from a FIRST step to a LAST step; ``load_episode`` reads one
back and ``iter_episodes`` reads a folder in order::

    episode = dmr.load_episode("recordings/episode_000_000001.npz")
    episode.observation["board"].shape   # (T+1, rows, columns)
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import dm_env
import numpy as np

from dm_env_rpc_client import specs


class Episode(NamedTuple):
    """One recorded episode (see the module docs for the layout)."""

    step_type: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    observation: dict[str, Any]
    action: dict[str, Any]


def _number(value: Any) -> float:
    return float("nan") if value is None else float(np.asarray(value))


class EpisodeRecorder:
    """Buffers one world's steps and writes an ``.npz`` file at every LAST step.

    Args:
      directory: the folder to write into (created if missing).
      world: the world's index, part of the file names.
    """

    def __init__(self, directory: str | pathlib.Path, world: int = 0) -> None:
        self._directory = pathlib.Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)
        self._world = world
        self._count = 0
        self._steps: list[dm_env.TimeStep] = []
        self._actions: list[Mapping[str, Any]] = []
        self.written: list[pathlib.Path] = []

    def add(self, action: Mapping[str, Any] | None, timestep: dm_env.TimeStep) -> None:
        """Adds a TimeStep and the action that led to it (None for FIRST)."""
        if timestep.first():
            self._steps, self._actions = [timestep], []
            return
        if not self._steps:
            return  # joined mid-episode: wait for the next FIRST
        self._steps.append(timestep)
        self._actions.append(action or {})
        if timestep.last():
            self._write()

    def _write(self) -> None:
        self._count += 1
        arrays: dict[str, np.ndarray] = {
            "step_type": np.array([int(s.step_type) for s in self._steps], np.uint8),
            "reward": np.array([_number(s.reward) for s in self._steps]),
            "discount": np.array([_number(s.discount) for s in self._steps]),
        }
        observations = [specs.flatten(_as_dict(s.observation)) for s in self._steps]
        for name in observations[0]:
            arrays[f"observation/{name}"] = np.stack([np.asarray(o[name]) for o in observations])
        actions = [specs.flatten(dict(a)) for a in self._actions]
        for name in actions[0] if actions else ():
            arrays[f"action/{name}"] = np.stack([np.asarray(a[name]) for a in actions])
        path = self._directory / f"episode_{self._world:03d}_{self._count:06d}.npz"
        np.savez_compressed(path, **arrays)  # type: ignore[arg-type]
        self.written.append(path)
        self._steps, self._actions = [], []


def _as_dict(observation: Any) -> dict[str, Any]:
    return dict(observation) if isinstance(observation, Mapping) else {"observation": observation}


def load_episode(path: str | pathlib.Path) -> Episode:
    """Reads one recorded episode back; observations and actions are nested dicts."""
    with np.load(path, allow_pickle=False) as data:
        groups: dict[str, dict[str, Any]] = {"observation": {}, "action": {}}
        for key in data.files:
            group, _, name = key.partition("/")
            if name:
                groups[group][name] = data[key]
        return Episode(
            step_type=data["step_type"],
            reward=data["reward"],
            discount=data["discount"],
            observation=specs.unflatten(groups["observation"]),
            action=specs.unflatten(groups["action"]),
        )


def iter_episodes(directory: str | pathlib.Path) -> Iterator[Episode]:
    """Reads every recorded episode in a folder, in file-name order."""
    for path in sorted(pathlib.Path(directory).glob("episode_*.npz")):
        yield load_episode(path)
