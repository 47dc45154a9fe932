"""TorchRL over the gymnasium bridge, with TorchRL's own GymWrapper, checker and collector."""

from __future__ import annotations

from typing import Any

import pytest
from gymnasium.vector import AutoresetMode

from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv, GymnasiumVectorEnv
from dm_env_rpc_client.server import Server

pytestmark = pytest.mark.training


def _torchrl() -> Any:
    torchrl = pytest.importorskip("torchrl")
    pytest.importorskip("torchrl.envs")
    return torchrl


def test_gym_wrapper_of_one_world_with_the_default_spaces(catch_server: Server) -> None:
    _torchrl()
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    env = GymWrapper(GymnasiumEnv(address=catch_server.address, create_world_settings={"rows": 5}))
    try:
        env.set_seed(0)
        check_env_specs(env)  # steps with a Dict action it sends unwrapped, the scalar as [1]
        rollout = env.rollout(10)  # stops at the first done: Catch of 5 rows ends on step 4
        assert rollout["next", "done"].sum().item() == 1 and rollout.batch_size[0] == 4
        assert abs(rollout["next", "reward"].sum().item()) == 1.0
    finally:
        env.close()


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_gym_wrapper_of_a_vector_env_and_a_collector(catch_server: Server, mode: Any) -> None:
    _torchrl()
    import torch
    from torchrl.collectors import Collector
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    envs = GymnasiumVectorEnv(
        addresses=catch_server.address,
        num_envs=4,
        create_world_settings={"rows": 5},
        autoreset_mode=mode,
        unwrap_single=True,  # TorchRL batches a Box action spec, not a Dict one
    )
    env = GymWrapper(envs)
    try:
        assert env.batch_size == torch.Size([4])
        env.set_seed(0)
        check_env_specs(env)
        collector = Collector(env, None, frames_per_batch=40, total_frames=120)
        frames, dones, rewards = 0, 0, 0.0
        for batch in collector:
            frames += batch.numel()
            dones += int(batch["next", "done"].sum())
            rewards += float(batch["next", "reward"].abs().sum())
            # A world that ended starts again: its next row's observation has the ball on top.
            ends = batch["next", "done"].squeeze(-1)[:, :-1]
            after = batch["observation"][:, 1:][ends]
            assert bool((after[:, 0].amax(dim=-1) == 1.0).all())
        collector.shutdown()
        # 30 steps per world of four-step episodes: every world ended at least six times,
        # and each ended episode had its +-1 reward.
        assert frames == 120 and dones >= 24 and rewards == dones
    finally:
        env.close()


def test_the_docs_torchrl_example_runs() -> None:
    """docs/gymnasium.md's TorchRL example (its ```python3 block) runs as it is."""
    _torchrl()
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "gymnasium.md").read_text()
    (block,) = re.findall(r"^```python3\n(.*?)^```", page, re.M | re.S)
    namespace: dict[str, Any] = {"__name__": "docs_gymnasium_torchrl"}
    exec(compile(block, "gymnasium.md[torchrl]", "exec"), namespace)
    assert namespace["frames"] == 640
    assert namespace["rollout"]["next", "done"].sum().item() == 1


def _dqn_block() -> str:
    """docs/gymnasium.md's TorchRL DQN example: its ```python block that needs torch, torchrl."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "gymnasium.md").read_text()
    (block,) = re.findall(r"^```python\n(# needs: torch torchrl\n.*?)^```", page, re.M | re.S)
    return block


@pytest.mark.timeout(300)  # about 20 s alone on 2 cores; more on a machine shared with others
def test_dqn_trains_on_remote_catch_and_beats_random() -> None:
    """TorchRL's DQN (its modules, loss, collector, buffer) learns Catch over the vector route.

    docs/gymnasium.md's example as it is (SAME_STEP; TorchRL's reset_mask path under DISABLED is
    checked with a collector above). Seeded; the random return is measured first, on the same
    balls as the trained policy's.
    """
    _torchrl()
    namespace: dict[str, Any] = {"__name__": "docs_gymnasium_dqn"}
    exec(compile(_dqn_block(), "gymnasium.md[dqn]", "exec"), namespace)
    random_return, trained_return = namespace["random_return"], namespace["trained_return"]
    assert -0.9 < random_return < -0.3  # Catch of 5 columns: a random paddle catches ~1 in 5
    assert trained_return > random_return + 1.0, (random_return, trained_return)
    assert namespace["env"].is_closed  # the collector's shutdown closed it
