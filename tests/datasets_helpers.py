"""Shared by the dataset tests: a recording that keeps what was stepped, and episodes from it."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import dm_env
import numpy as np

import dm_env_rpc_client as dmr
from dm_env_rpc_client import specs

INTERRUPTED = 3


@dataclasses.dataclass
class Stepped:
    """One episode as it was stepped: raw TimeSteps, the actions and the last state."""

    world: int
    number: int
    seed: int | None
    steps: list[dm_env.TimeStep]
    actions: list[dict[str, Any]]
    state: int | None = None
    cut: bool = False

    def observation(self, t: int) -> dict[str, Any]:
        return specs.flatten(dict(self.steps[t].observation))


class Tap(dmr.Recording):
    """A ``Recording`` that also keeps every step it was given, raw, grouped into episodes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        seeds = list(args[2]) if len(args) > 2 else [None] * args[1]
        self.seeds = seeds
        self.open: dict[int, Stepped] = {}
        self.counts: dict[int, int] = {}
        self.stepped: list[Stepped] = []

    def add(self, world, action, timestep, state=None) -> None:  # type: ignore[no-untyped-def]
        super().add(world, action, timestep, state)
        self._keep(world, action, timestep, state)

    def add_batch(self, steps, actions) -> None:  # type: ignore[no-untyped-def]
        super().add_batch(steps, actions)
        for position, world in enumerate(steps.env_ids):
            state = None if steps.state is None else int(steps.state[position])
            self._keep(int(world), actions[position], steps.at(position), state)

    def _keep(self, world, action, timestep, state) -> None:  # type: ignore[no-untyped-def]
        if timestep.first():
            self._cut(world)
            self.counts[world] = self.counts.get(world, 0)
            self.open[world] = Stepped(world, 0, self.seeds[world], [timestep], [])
            return
        episode = self.open.get(world)
        if episode is None:
            return
        episode.steps.append(timestep)
        episode.actions.append(specs.flatten(dict(action or {})))
        if timestep.last():
            episode.state = state
            self._finish(world)

    def _finish(self, world: int) -> None:
        episode = self.open.pop(world)
        self.counts[world] += 1
        episode.number = self.counts[world]
        self.stepped.append(episode)

    def _cut(self, world: int) -> None:
        episode = self.open.get(world)
        if episode is None:
            return
        if len(episode.steps) < 2:
            del self.open[world]
            return
        episode.cut = True
        self._finish(world)

    def truncate(self, world: int) -> Any:
        self._cut(world)
        return super().truncate(world)

    def close(self) -> None:
        for world in list(self.open):
            self._cut(world)
        super().close()

    def by_key(self) -> dict[tuple[int, int], Stepped]:
        return {(e.world, e.number): e for e in self.stepped}


def record(
    address: str,
    writer_for: Any,
    worlds: int = 3,
    steps: int = 130,
    background: bool | str = False,
    **settings: Any,
) -> Tap:
    """Steps ``worlds`` Catch worlds with random actions into ``writer_for(batch)`` (written
    by a child process with ``background="process"``)."""
    batch = dmr.BatchedEnvironment.connect(
        [address], worlds, seed=7, create_world_settings=settings, timeout=30
    )
    try:
        writer = writer_for(batch)
        tap = Tap("unused", worlds, batch.world_seeds, writer=writer, background=background)
        try:
            dmr.collect(batch, steps=steps, pipeline=4, timeout=30, seed=7, record=tap)
        finally:
            tap.close()
    finally:
        batch.close()
    return tap


def same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


class StuckWriter:
    """An ``EpisodeWriter`` whose ``write`` never returns (a writer process stuck on a disk)."""

    def write(self, episode: Any) -> None:
        threading.Event().wait()

    def close(self) -> None:
        pass
