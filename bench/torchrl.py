"""TorchRL collector frames/s over Catch worlds: the batched route against ParallelEnv.

Run: ``python bench/torchrl.py [--worlds N] [--frames F]`` (needs torch, torchrl).
Two SDK server processes hold the worlds (round-robin). One run, every variant
in turn (set up, warmed up with one batch, timed, closed), with a random
policy (``None``: TorchRL samples the action spec) and the same collector
settings:

- (a) TorchRL's ``ParallelEnv`` of N ``GymWrapper(GymnasiumEnv)`` (one worker
  process per world, what TorchRL offers for N environments that are not
  vectorized);
- (b) ``GymWrapper(GymnasiumVectorEnv(autoreset_mode=SAME_STEP))`` over one
  ``BatchedEnvironment``;
- (c) the same with ``DISABLED`` (TorchRL resets ended worlds with ``reset_mask``).

frames/s counts environment steps gathered by a ``torchrl.collectors.Collector``.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time
from typing import Any

# _common first: it sets GRPC_VERBOSITY before grpc is imported.
from _common import print_table, server_processes

# This file is bench/torchrl.py: with bench/ first on sys.path, ``import torchrl`` would
# find it instead of TorchRL. bench/ is left out for TorchRL's imports only (ParallelEnv's
# spawned workers run this file again and need _common).
_HERE = str(pathlib.Path(__file__).resolve().parent)
_PATH = list(sys.path)
sys.path[:] = [entry for entry in sys.path if str(pathlib.Path(entry or ".").resolve()) != _HERE]

# isort: split
import torch  # noqa: E402
from gymnasium.vector import AutoresetMode  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.envs import GymWrapper, ParallelEnv  # noqa: E402

from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv, GymnasiumVectorEnv  # noqa: E402

sys.path[:] = _PATH

PARALLEL = "(a) ParallelEnv of GymWrapper(GymnasiumEnv)"
SAME = "(b) GymWrapper(GymnasiumVectorEnv SAME_STEP)"
DISABLED = "(c) GymWrapper(GymnasiumVectorEnv DISABLED)"


def _single(address: str) -> Any:
    return GymWrapper(GymnasiumEnv(address=address))


def parallel(addresses: list[str], count: int) -> Any:
    makers = [functools.partial(_single, addresses[i % len(addresses)]) for i in range(count)]
    return ParallelEnv(count, makers)


def vector(addresses: list[str], count: int, mode: AutoresetMode) -> Any:
    envs = GymnasiumVectorEnv(
        addresses=addresses, num_envs=count, autoreset_mode=mode, unwrap_single=True
    )
    return GymWrapper(envs)


def frames_per_second(env: Any, frames: int, per_batch: int) -> float:
    """Collects ``frames`` after one warm-up batch; frames/s."""
    env.set_seed(0)
    collector = Collector(env, None, frames_per_batch=per_batch, total_frames=frames + per_batch)
    try:
        batches = iter(collector)
        next(batches)  # warm-up: the first batch pays for set-up
        start, got = time.perf_counter(), 0
        for batch in batches:
            got += batch.numel()
        return got / (time.perf_counter() - start)
    finally:
        collector.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=8)
    parser.add_argument("--frames", type=int, default=8000)
    args = parser.parse_args()
    count, per_batch = args.worlds, args.worlds * 50
    torch.set_num_threads(1)
    with server_processes("sdk") as servers:
        addresses = [server.address for server in servers]
        makers = {
            PARALLEL: lambda: parallel(addresses, count),
            SAME: lambda: vector(addresses, count, AutoresetMode.SAME_STEP),
            DISABLED: lambda: vector(addresses, count, AutoresetMode.DISABLED),
        }
        results = {}
        for name, make in makers.items():
            env = make()
            try:
                results[name] = frames_per_second(env, args.frames, per_batch)
            finally:
                if not getattr(env, "is_closed", False):  # the collector may have closed it
                    env.close()
    base = results[PARALLEL]
    print_table(
        f"TorchRL Collector frames/s, {count} Catch worlds on 2 SDK servers, random policy",
        ["variant", "frames/s", "vs (a)"],
        [[name, value, f"{value / base:.2f}x"] for name, value in results.items()],
    )
    print(f"\nOne run of {args.frames:,} frames per variant (batches of {per_batch}).")


if __name__ == "__main__":
    main()
