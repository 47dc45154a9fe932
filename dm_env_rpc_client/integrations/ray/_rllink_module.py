"""The learner's RLModule on the client: built from its config, weights loaded, one forward pass.

``ModuleActor`` builds the inference-only RLModule that RLlib's
``EnvRunnerServerForExternalInference`` keeps (``config.get_rl_module_spec(
inference_only=True)``), loads each ``SET_STATE``'s weights (a
``SpaceMismatchError`` naming both spaces if they do not fit), and ``act(obs)``
runs ``forward_exploration`` once over a whole batch of observations. A module
that samples itself (``actions`` in its output, e.g. an epsilon-greedy Q module)
gives its actions; otherwise they are sampled from the module's exploration
action distribution, and each row keeps ``action_logp`` and
``action_dist_inputs`` (what PPO's learner needs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._rllink_spaces import SpaceBridge
from ._rllink_wire import SpaceMismatchError

_BAD_WEIGHTS = (
    "The learner's weights do not fit the RLModule its config builds for the worlds' spaces "
    "(observation space {obs}, action space {act}): {error}. Check that the learner's "
    "observation_space and action_space are the ones it trained with."
)


class ModuleActor:
    """The learner's RLModule, built here from its config, acting on a batch at once.

    Args:
      config: the learner's ``AlgorithmConfig`` (its ``GET_CONFIG``).
      bridge: the worlds' spaces against the learner's (named in errors).
      torch_threads: ``torch.set_num_threads`` for this process (None: leave it). One
        thread, as Ray gives its EnvRunners: small forward passes gain nothing from more,
        and on a busy machine their threads wait on each other (tens of ms a pass).
    """

    def __init__(self, config: Any, bridge: SpaceBridge, torch_threads: int | None = 1) -> None:
        import torch

        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        from ray.rllib.core.columns import Columns

        self._torch, self._columns, self._bridge = torch, Columns, bridge
        spec = config.get_rl_module_spec(inference_only=True)
        self.module = spec.build()
        self._dist = self.module.get_exploration_action_dist_cls()

    def load(self, state: Mapping[str, Any]) -> None:
        """Loads the weights of a ``SET_STATE``.

        Raises:
          SpaceMismatchError: they do not fit the module (the message names both spaces).
        """
        weights = state.get("rl_module", state)
        if isinstance(weights, Mapping) and "default_policy" in weights:
            weights = weights["default_policy"]
        try:
            self.module.set_state(weights)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise SpaceMismatchError(
                _BAD_WEIGHTS.format(
                    obs=self._bridge.observation_space, act=self._bridge.action_space, error=exc
                )
            ) from exc

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """Actions (learner space) for ``obs`` ``[B, ...]``, one forward pass; their outputs."""
        torch, columns = self._torch, self._columns
        with torch.no_grad():
            out = self.module.forward_exploration({columns.OBS: torch.from_numpy(obs)})
            if columns.ACTIONS in out:  # the module sampled (an epsilon-greedy Q module)
                actions = out[columns.ACTIONS]
                logp = out.get(columns.ACTION_LOGP)
                inputs = None
            else:
                inputs = out[columns.ACTION_DIST_INPUTS]
                dist = self._dist.from_logits(inputs)
                actions = dist.sample()
                logp = dist.logp(actions)
        actions_np = actions.numpy()
        logp_np = None if logp is None else logp.numpy().astype(np.float32)
        inputs_np = None if inputs is None else inputs.numpy()
        extras = []
        for row in range(len(actions_np)):
            extra: dict[str, Any] = {}
            if logp_np is not None:
                extra[columns.ACTION_LOGP] = logp_np[row]
            if inputs_np is not None:
                extra[columns.ACTION_DIST_INPUTS] = inputs_np[row]
            extras.append(extra)
        return actions_np, extras
