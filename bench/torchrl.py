"""TorchRL collector frames/s over Catch worlds: the batched route against ParallelEnv.

Run: ``python bench/torchrl.py [--worlds N] [--frames F] [--rounds R]`` (needs torch, torchrl).
Two SDK server processes hold the worlds (round-robin). Every variant is timed
once per round, rounds interleaved in a shuffled order (``bench/_lib/common.py``'s
``measure_interleaved``, unpinned: ParallelEnv's workers may use every CPU), each
run set up, warmed up with one batch, timed for F frames and closed, with a
random policy (``None``: TorchRL samples the action spec) and the same collector
settings (batches of 50 steps per world):

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
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import measure_interleaved, print_table, server_processes

# This file is bench/torchrl.py: with bench/ first on sys.path, ``import torchrl`` would
# find it instead of TorchRL. bench/ is left out for TorchRL's imports only (ParallelEnv's
# spawned workers run this file again and need _lib.common).
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


def collecting(make: Any, per_batch: int) -> Any:
    """(run, close): ``run(frames)`` gathers at least ``frames`` frames with one Collector."""
    env = make()
    env.set_seed(0)
    collector = Collector(env, None, frames_per_batch=per_batch, total_frames=-1)
    batches = iter(collector)

    def run(frames: int) -> None:
        got = 0
        while got < frames:
            got += next(batches).numel()

    def close() -> None:
        collector.shutdown()  # closes the env too
        if not getattr(env, "is_closed", True):
            env.close()

    return run, close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=8)
    parser.add_argument("--frames", type=int, default=8000, help="frames per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    count, per_batch = args.worlds, args.worlds * 50
    frames = -(-args.frames // per_batch) * per_batch  # whole batches: the same for every variant
    torch.set_num_threads(1)
    with server_processes("sdk") as servers:
        addresses = [server.address for server in servers]
        makers = {
            PARALLEL: lambda: parallel(addresses, count),
            SAME: lambda: vector(addresses, count, AutoresetMode.SAME_STEP),
            DISABLED: lambda: vector(addresses, count, AutoresetMode.DISABLED),
        }
        rounds = measure_interleaved(
            {name: functools.partial(collecting, make, per_batch) for name, make in makers.items()},
            frames,
            rounds=args.rounds,
            warmup=per_batch,
        )
    print_table(
        f"TorchRL Collector frames/s, {count} Catch worlds on 2 SDK servers, random policy",
        ["variant", "frames/s", "vs (a)"],
        [[name, rounds.median(name), f"{rounds.ratio(name, PARALLEL):.2f}x"] for name in makers],
    )
    print(
        f"\nMedians over {args.rounds} interleaved rounds of {frames:,} frames per variant "
        f"(batches of {per_batch}, after a one-batch warm-up); ratios within each round."
    )


if __name__ == "__main__":
    main()
