"""Multi-agent episodes recorded per agent: one single-agent recording per agent.

Layout of ``MultiAgentRecording(directory, agents, worlds)``::

    directory/
      agents.json          {"agents": ["agent_0", "agent_1"], "worlds": M, "format": ...}
      agent_0/             agent_0's episodes, exactly as dmr.Recording writes one world's
        episode_000_000001.npz ...
      agent_1/
        episode_000_000001.npz ...

Each agent's folder is an ordinary recording of that agent's view of every world:
its observations, its actions, its reward and discount, one episode per file
(``meta/world`` is the world's index, ``meta/episode`` its episode number in that
world, so agent files of one world's episode share both). The agent is named by its
folder (and listed, in slot order, in ``agents.json``). Why this layout: every
single-agent reader works on it unchanged: ``dmr.iter_episodes(directory /
"agent_0")``, ``dmr.load_episode``, offline learners fed from them, and, with
``writer=`` making a ``MinariWriter`` per agent, Minari's own ``load_dataset``
(Minari has no multi-agent dataset format; a dataset per agent is how its users
train one policy per agent, and a shared policy reads them all). Agents' episodes of
one world are joined back by ``(world, episode)`` (``iter_agent_episodes``).

It takes the calls ``dmr.collect`` makes on a ``Recording`` (``add``, ``add_batch``,
``truncate``) with the slot numbers of a ``MultiAgentBatch`` (slot ``w * N + a`` is
agent ``a`` of world ``w``), so ``dmr.collect(batch, record=MultiAgentRecording.
for_batch(folder, batch))`` records a multi-agent run; ``add_agents`` takes the per-agent
dicts of ``MultiAgentBatch.step_agents`` and the actions sent.

Guarantees are ``Recording``'s, per agent: files written atomically, an unfinished
episode saved ``truncated`` at ``close``/``truncate``, a folder that already holds
anything refused.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import dm_env
import numpy as np

from . import errors
from ._adaptor.stacked import BatchedTimeStep, split_actions
from ._base import checks as _checks
from ._batch.agent_actions import take_rows as _take
from .recording import Episode, EpisodeWriter, Recording, iter_episodes, prepare_folder

AGENTS_FILE = "agents.json"
_BAD_NAME = (
    "Agent name {name!r} cannot name a folder (empty, '.', '..', or with a path separator); "
    "give the agents plain names (join setting 'agent')."
)
_TWICE = "Agent name {name!r} is given twice; every agent needs a folder of its own."
_NOT_MULTI = "There is no {file} in {path}: it is not a MultiAgentRecording's folder."

WriterFactory = Callable[[str, pathlib.Path], EpisodeWriter]


def _checked_agents(agents: Sequence[str]) -> list[str]:
    names = [str(name) for name in agents]
    for name in names:
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise errors.ArgumentValueError(_BAD_NAME.format(name=name))
        if names.count(name) > 1:
            raise errors.ArgumentValueError(_TWICE.format(name=name))
    return names


class MultiAgentRecording:
    """A multi-agent run's recording: a ``Recording`` per agent, in a folder per agent.

    Args:
      directory: the run's folder: created if missing; refused if it holds anything.
      agents: the agents' names, in slot order (``MultiAgentBatch.agents``).
      worlds: how many worlds the run has.
      seeds: each world's seed, for the metadata (None: none).
      writer: ``writer(agent, folder)`` makes agent ``agent``'s ``EpisodeWriter``
        for its folder (e.g. a ``MinariWriter``); None: ``.npz`` files.
      background: each agent's ``Recording``'s ``background``.
      flush_steps: each agent's ``Recording``'s ``flush_steps``.
      flush_seconds: each agent's ``Recording``'s ``flush_seconds``.

    Raises:
      RecordingError: the folder is not empty, not a folder, or cannot be created.
      ArgumentValueError: an agent name that cannot name a folder, or a repeated one.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        agents: Sequence[str],
        worlds: int,
        seeds: Sequence[int | None] | None = None,
        *,
        writer: WriterFactory | None = None,
        background: bool | str = False,
        flush_steps: int = 2048,
        flush_seconds: float = 0.5,
    ) -> None:
        _checks.check_count(worlds, "worlds")
        self.agents = _checked_agents(agents)
        self.directory = prepare_folder(directory)
        self.num_agents = len(self.agents)
        self.recordings: dict[str, Recording] = {}
        try:
            for name in self.agents:
                folder = self.directory / name
                folder.mkdir()
                self.recordings[name] = Recording(
                    folder,
                    worlds,
                    seeds,
                    writer=None if writer is None else writer(name, folder),
                    background=background,
                    flush_steps=flush_steps,
                    flush_seconds=flush_seconds,
                )
        except BaseException:
            for made in self.recordings.values():
                made.close()
            raise
        index = {"agents": self.agents, "worlds": worlds, "layout": "one recording per agent"}
        (self.directory / AGENTS_FILE).write_text(json.dumps(index, indent=1))
        self._closed = False

    @classmethod
    def for_batch(
        cls, directory: str | pathlib.Path, batch: Any, **kwargs: Any
    ) -> MultiAgentRecording:
        """A recording of ``batch``'s (a ``MultiAgentBatch``) agents and worlds.

        Args:
          directory: the run's folder.
          batch: the ``MultiAgentBatch`` (or ``MultiAgentWorld``) that will be recorded.
          **kwargs: ``MultiAgentRecording``'s keyword arguments.
        """
        batch = getattr(batch, "batch", batch)
        return cls(directory, batch.agents, batch.num_worlds, **kwargs)

    def folder(self, agent: str) -> pathlib.Path:
        """Agent ``agent``'s folder (an ordinary recording: ``dmr.iter_episodes`` reads it)."""
        return self.directory / agent

    def add(
        self,
        slot: int,
        action: Mapping[str, Any] | None,
        timestep: dm_env.TimeStep,
        state: int | None = None,
    ) -> None:
        """Adds slot ``slot``'s TimeStep (agent ``slot % N`` of world ``slot // N``) and the
        action that led to it (None for FIRST); ``state`` as for ``Recording.add``."""
        world, agent = divmod(int(slot), self.num_agents)
        self.recordings[self.agents[agent]].add(world, action, timestep, state)

    def add_batch(
        self, steps: BatchedTimeStep, actions: Sequence[Mapping[str, Any] | None]
    ) -> None:
        """Adds a ``MultiAgentBatch``'s steps (``env_ids`` are slots) and their actions."""
        slots = np.asarray(steps.env_ids)
        for agent, name in enumerate(self.agents):
            rows = np.flatnonzero(slots % self.num_agents == agent)
            if len(rows):
                self.recordings[name].add_batch(
                    _take(steps, rows, slots[rows] // self.num_agents),
                    [actions[row] for row in rows.tolist()],
                )

    def add_agents(
        self,
        steps_by_agent: Mapping[str, BatchedTimeStep],
        actions_by_agent: Mapping[str, Any] | None = None,
    ) -> None:
        """Adds ``MultiAgentBatch.step_agents``' (or ``reset_agents``') answers.

        Args:
          steps_by_agent: each agent's steps (``env_ids`` are world indices).
          actions_by_agent: the actions sent for those steps, as ``step_agents`` took
            them (stacked over the worlds, or one dict per world); None for resets.
        """
        for name, steps in steps_by_agent.items():
            count = len(steps.step_type)
            sent = (
                [None] * count
                if actions_by_agent is None
                else split_actions(actions_by_agent[name], count, ())
            )
            actions = [None if kind == 0 else sent[row] for row, kind in enumerate(steps.step_type)]
            self.recordings[name].add_batch(steps, actions)

    def truncate(self, slot: int) -> None:
        """Saves slot ``slot``'s unfinished episode marked truncated (a failed world's slot)."""
        world, agent = divmod(int(slot), self.num_agents)
        self.recordings[self.agents[agent]].truncate(world)

    @property
    def episodes(self) -> int:
        """Episodes written, over every agent (an episode of N agents counts N)."""
        return sum(recording.episodes for recording in self.recordings.values())

    @property
    def truncated(self) -> int:
        """Truncated episodes written, over every agent."""
        return sum(recording.truncated for recording in self.recordings.values())

    @property
    def written(self) -> list[pathlib.Path]:
        """The files written, agent by agent."""
        return [path for recording in self.recordings.values() for path in recording.written]

    def close(self) -> None:
        """Saves every unfinished episode marked truncated and closes every agent's writer.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        failure: BaseException | None = None
        for recording in self.recordings.values():
            try:
                recording.close()
            except BaseException as exc:  # close every agent's, then raise the first
                failure = failure or exc
        if failure is not None:
            raise failure

    def __enter__(self) -> MultiAgentRecording:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def iter_agent_episodes(directory: str | pathlib.Path) -> Iterator[dict[str, Episode]]:
    """Reads a ``MultiAgentRecording``'s ``.npz`` episodes back, one world's episode at a time:
    ``{agent: Episode}`` for each ``(world, episode)``, by world, then episode.

    Raises:
      RecordingError: ``directory`` is not a multi-agent recording's folder.
    """
    path = pathlib.Path(directory)
    if not (path / AGENTS_FILE).is_file():
        raise errors.RecordingError(_NOT_MULTI.format(file=AGENTS_FILE, path=path))
    agents = json.loads((path / AGENTS_FILE).read_text())["agents"]
    joined: dict[tuple[Any, Any], dict[str, Episode]] = {}
    for name in agents:
        for episode in iter_episodes(path / name):
            joined.setdefault((episode.world, episode.episode), {})[name] = episode
    return (joined[key] for key in sorted(joined))
