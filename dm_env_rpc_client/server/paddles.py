"""Paddles: several paddles compete for one falling ball; a small multi-agent game.

A ball falls from a random column of the top row, one row a step; each agent
moves its own paddle along the bottom row (paddles may share a cell). When the
ball reaches the bottom row the episode ends for every agent: the paddles under
the ball share a reward of +1 (each gets ``1 / k`` for ``k`` of them), the
others get 0; when no paddle is under it, every agent gets -1 (``discount`` 0,
so the server reports TERMINATED).

- Agents: ``agent_0`` ... ``agent_{n-1}``; paddle ``i`` starts at column
  ``round((i + 1) * (columns - 1) / (n + 1))``.
- Observation (each agent's own) ``board``: float32 ``[rows, columns]`` in
  [0, 1]: 1.0 at the ball and at the agent's own paddle, 0.5 at other paddles.
- Action ``paddle``: int8 in ``[-1, 1]``: move left, stay, move right. An agent
  that does not act (not joined) keeps its paddle where it is.
- Settings: ``num_agents`` (2 to 4, default 2), ``mode`` (``"lockstep"``, the
  default: all paddles move, then the ball falls; or ``"turns"``: one paddle
  moves, then the ball falls), ``seed`` (default 0), ``rows`` (default 10),
  ``columns`` (default 5).
- Reset settings (ResetWorldRequest): ``seed`` re-seeds the ball's column from
  the next episode on, so the same seed replays the same episodes.

Served with ``dm-env-rpc-client serve --game paddles`` or ``dmr.serve(Paddles)``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import dm_env
import numpy as np
from dm_env import specs

from .catch import SeedResetHook, _int_setting
from .multiagent import LOCKSTEP, TURNS, Mode, MultiAgentEnvironment

MIN_AGENTS, MAX_AGENTS = 2, 4
_BAD_MODE = "Paddles setting 'mode' must be 'lockstep' or 'turns', got {value!r}."
_BAD_COUNT = "Paddles setting 'num_agents' must be {low} to {high}, got {value!r}."
_OTHER_PADDLE = 0.5


@functools.lru_cache(maxsize=64)
def _specs(rows: int, columns: int) -> tuple[specs.Array, ...]:
    """The board, paddle, reward and discount specs of one board size, made once."""
    return (
        specs.BoundedArray((rows, columns), np.float32, 0.0, 1.0, name="board"),
        specs.BoundedArray((), np.int8, -1, 1, name="paddle"),
        specs.Array((), np.float32, name="reward"),
        specs.BoundedArray((), np.float32, 0.0, 1.0, name="discount"),
    )


class Paddles(SeedResetHook, MultiAgentEnvironment):
    """The Paddles game. See the module docstring."""

    _GAME = "Paddles"

    def __init__(
        self,
        num_agents: int = 2,
        mode: str = LOCKSTEP,
        seed: int = 0,
        rows: int = 10,
        columns: int = 5,
    ) -> None:
        count = _int_setting("num_agents", num_agents, 1, "Paddles")
        if not MIN_AGENTS <= count <= MAX_AGENTS:
            raise ValueError(_BAD_COUNT.format(low=MIN_AGENTS, high=MAX_AGENTS, value=num_agents))
        mode = str(mode)
        if mode not in (LOCKSTEP, TURNS):
            raise ValueError(_BAD_MODE.format(value=mode))
        self.mode: Mode = LOCKSTEP if mode == LOCKSTEP else TURNS
        self._rows = _int_setting("rows", rows, 2, "Paddles")
        self._columns = _int_setting("columns", columns, 1, "Paddles")
        self._seed = _int_setting("seed", seed, 0, "Paddles")
        self._rng = np.random.default_rng(self._seed)
        self._names = tuple(f"agent_{index}" for index in range(count))
        self._start = [
            round((index + 1) * (self._columns - 1) / (count + 1)) for index in range(count)
        ]
        self._paddles = list(self._start)
        self._ball = (0, 0)

    def agent_names(self) -> tuple[str, ...]:
        return self._names

    def _observations(self) -> dict[str, dict[str, np.ndarray]]:
        board = np.zeros((self._rows, self._columns), np.float32)
        bottom = self._rows - 1
        for column in self._paddles:
            board[bottom, column] = _OTHER_PADDLE
        board[self._ball] = 1.0
        found = {}
        for name, column in zip(self._names, self._paddles, strict=True):
            own = board.copy()
            own[bottom, column] = 1.0
            found[name] = {"board": own}
        return found

    def reset(self) -> dict[str, dm_env.TimeStep]:
        self._ball = (0, int(self._rng.integers(self._columns)))
        self._paddles = list(self._start)
        return {name: dm_env.restart(obs) for name, obs in self._observations().items()}

    def step(self, actions: Mapping[str, Any]) -> dict[str, dm_env.TimeStep]:
        for name, action in actions.items():
            index = self._names.index(name)
            move = int(np.asarray(action["paddle"] if isinstance(action, Mapping) else action))
            self._paddles[index] = min(max(self._paddles[index] + move, 0), self._columns - 1)
        self._ball = (self._ball[0] + 1, self._ball[1])
        observations = self._observations()
        if self._ball[0] < self._rows - 1:
            zero, one = np.float32(0.0), np.float32(1.0)
            return {name: dm_env.transition(zero, obs, one) for name, obs in observations.items()}
        catchers = [column == self._ball[1] for column in self._paddles]
        share = 1.0 / sum(catchers) if any(catchers) else 0.0
        rewards = [share if caught else (0.0 if any(catchers) else -1.0) for caught in catchers]
        return {
            name: dm_env.termination(np.float32(reward), observations[name])
            for name, reward in zip(self._names, rewards, strict=True)
        }

    def action_spec(self) -> dict[str, dict[str, specs.Array]]:
        return {name: {"paddle": _specs(self._rows, self._columns)[1]} for name in self._names}

    def observation_spec(self) -> dict[str, dict[str, specs.Array]]:
        return {name: {"board": _specs(self._rows, self._columns)[0]} for name in self._names}

    def reward_spec(self) -> dict[str, specs.Array]:
        return dict.fromkeys(self._names, _specs(self._rows, self._columns)[2])

    def discount_spec(self) -> dict[str, specs.BoundedArray]:
        spec = _specs(self._rows, self._columns)[3]
        return dict.fromkeys(self._names, spec)  # type: ignore[arg-type]
