"""Catch: a small, deterministic ``dm_env.Environment`` to try the protocol on.

A ball falls from a random column of the top row, one row a step; the agent
moves a paddle along the bottom row. When the ball reaches the bottom row the
episode ends with reward ``+1`` if the paddle is under it and ``-1`` otherwise
(``discount`` 0, so the server reports TERMINATED).

- Observation ``board``: float32 ``[rows, columns]``, 1.0 at the ball and the paddle.
- Action ``paddle``: int8 in ``[-1, 1]``: move left, stay, move right.
- Settings: ``rows`` (default 10), ``columns`` (default 5), ``seed`` (default 0),
  and ``max_steps`` (default none): when set, an episode that runs that many steps
  is truncated (``discount`` 1, so the server reports INTERRUPTED).
- Reset settings (ResetRequest / ResetWorldRequest): ``seed`` re-seeds the ball's
  random column from the next sequence on, so the same seed replays the same episodes.

Properties (see ``dm_env_rpc_client.server.Property``): ``rows``, ``columns``,
``seed`` and ``stats.episodes`` are read-only; ``stats.catch_reward`` and
``stats.miss_reward`` are writable float32 scalars.
"""

from __future__ import annotations

import functools
from typing import Any

import dm_env
import numpy as np
from dm_env import specs

from .properties import Property

_BAD_SETTING = "{game} setting {name!r} must be {what}, got {value!r}."


def _int_setting(name: str, value: Any, minimum: int, game: str = "Catch") -> int:
    number: int | None
    if isinstance(value, np.integer) or (type(value) is int and -(2**63) <= value < 2**63):
        number = int(value)  # what np.asarray(value) below would hold, without making it
    else:
        array = np.asarray(value)
        number = int(array) if array.shape == () and array.dtype.kind in "iu" else None
    if number is None or number < minimum:
        raise ValueError(
            _BAD_SETTING.format(game=game, name=name, what=f"an integer >= {minimum}", value=value)
        )
    return number


def reset_seed(settings: dict[str, Any], game: str) -> int | None:
    """The ``seed`` of a game's reset settings, or None without one.

    Raises:
      TypeError: for a setting other than ``seed``.
      ValueError: for a seed that is not an integer >= 0.
    """
    unknown = sorted(set(settings) - {"seed"})
    if unknown:
        raise TypeError(f"{game} takes only the reset setting 'seed', not {unknown}.")
    return _int_setting("seed", settings["seed"], 0, game) if "seed" in settings else None


class SeedResetHook:
    """The reset-settings hook of a game whose only reset setting is ``seed`` (Catch, Paddles).

    A ResetRequest's or ResetWorldRequest's ``seed`` re-seeds the game's random
    generator (``_rng``, from ``_seed``) from the next episode on, so the same seed
    replays the same episodes. A game names itself in ``_GAME`` (for the messages)
    and may do more in ``_reseeded``.
    """

    _GAME = "Catch"
    _seed: int
    _rng: np.random.Generator

    def dm_env_rpc_reset_settings(self, settings: dict[str, Any]) -> None:
        """The reset-settings hook of the embedded server: ``seed`` re-seeds the game.

        Args:
          settings: the request's settings, unpacked.

        Raises:
          TypeError: for a setting other than ``seed``.
          ValueError: for a seed that is not an integer >= 0.
        """
        seed = reset_seed(settings, self._GAME)
        if seed is not None:
            self._seed = seed
            self._rng = np.random.default_rng(self._seed)
            self._reseeded()

    def _reseeded(self) -> None:
        """What the game does beyond re-seeding (nothing here)."""


@functools.lru_cache(maxsize=64)
def _specs(rows: int, columns: int) -> tuple[specs.Array, ...]:
    """The board, paddle, reward and discount specs of one board size, made once.

    dm_env's specs are immutable, and making them is most of making a Catch (a
    server makes one per world), so every Catch of a size shares one set; two worlds
    with the same objects are seen alike at a glance.
    """
    return (
        specs.BoundedArray((rows, columns), np.float32, 0.0, 1.0, name="board"),
        specs.BoundedArray((), np.int8, -1, 1, name="paddle"),
        specs.Array((), np.float32, name="reward"),
        specs.BoundedArray((), np.float32, 0.0, 1.0, name="discount"),
    )


class Catch(SeedResetHook, dm_env.Environment):
    """The Catch game. See the module docstring."""

    _GAME = "Catch"

    def __init__(
        self, rows: int = 10, columns: int = 5, seed: int = 0, max_steps: int | None = None
    ) -> None:
        self._rows = _int_setting("rows", rows, 2)
        self._columns = _int_setting("columns", columns, 1)
        self._seed = _int_setting("seed", seed, 0)
        self._max_steps = None if max_steps is None else _int_setting("max_steps", max_steps, 1)
        self._rng = np.random.default_rng(self._seed)
        self._board = np.zeros((self._rows, self._columns), np.float32)
        self._ball = (0, 0)
        self._paddle = self._columns // 2
        self._steps = 0
        self._episodes = 0
        self._catch_reward = np.float32(1.0)
        self._miss_reward = np.float32(-1.0)
        self._reset_next = True

    def _observation(self) -> dict[str, np.ndarray]:
        self._board.fill(0.0)
        self._board[self._ball] = 1.0
        self._board[self._rows - 1, self._paddle] = 1.0
        return {"board": self._board.copy()}

    def reset(self) -> dm_env.TimeStep:
        self._ball = (0, int(self._rng.integers(self._columns)))
        self._paddle = self._columns // 2
        self._steps = 0
        self._reset_next = False
        self._episodes += 1
        return dm_env.restart(self._observation())

    def step(self, action: Any) -> dm_env.TimeStep:
        if self._reset_next:
            return self.reset()
        move = int(np.asarray(action["paddle"] if isinstance(action, dict) else action))
        self._paddle = min(max(self._paddle + move, 0), self._columns - 1)
        self._ball = (self._ball[0] + 1, self._ball[1])
        self._steps += 1
        observation = self._observation()
        if self._ball[0] == self._rows - 1:
            self._reset_next = True
            caught = self._ball[1] == self._paddle
            reward = self._catch_reward if caught else self._miss_reward
            return dm_env.termination(np.float32(reward), observation)
        if self._max_steps is not None and self._steps >= self._max_steps:
            self._reset_next = True
            return dm_env.truncation(np.float32(0.0), observation, np.float32(1.0))
        return dm_env.transition(np.float32(0.0), observation, np.float32(1.0))

    def _reseeded(self) -> None:
        """A re-seeded Catch starts a new sequence on its next step."""
        self._reset_next = True

    def observation_spec(self) -> dict[str, specs.Array]:
        return {"board": _specs(self._rows, self._columns)[0]}

    def action_spec(self) -> dict[str, specs.Array]:
        return {"paddle": _specs(self._rows, self._columns)[1]}

    def reward_spec(self) -> specs.Array:
        return _specs(self._rows, self._columns)[2]

    def discount_spec(self) -> specs.BoundedArray:
        return _specs(self._rows, self._columns)[3]  # type: ignore[return-value]

    def _set_catch_reward(self, value: Any) -> None:
        self._catch_reward = np.float32(value)

    def _set_miss_reward(self, value: Any) -> None:
        self._miss_reward = np.float32(value)

    def dm_env_rpc_properties(self) -> dict[str, Property]:
        """The properties hook of the embedded server."""
        scalar_int = specs.Array((), np.int64)
        scalar_float = specs.Array((), np.float32)
        return {
            "rows": Property(scalar_int, lambda: np.int64(self._rows), description="Board rows."),
            "columns": Property(
                scalar_int, lambda: np.int64(self._columns), description="Board columns."
            ),
            "seed": Property(scalar_int, lambda: np.int64(self._seed), description="RNG seed."),
            "stats.episodes": Property(
                scalar_int, lambda: np.int64(self._episodes), description="Episodes started."
            ),
            "stats.catch_reward": Property(
                scalar_float,
                lambda: self._catch_reward,
                self._set_catch_reward,
                description="Reward for a catch.",
            ),
            "stats.miss_reward": Property(
                scalar_float,
                lambda: self._miss_reward,
                self._set_miss_reward,
                description="Reward for a miss.",
            ),
        }
