"""Tensor codec benchmark: this SDK vs the reference ``dm-env-rpc`` package vs a NumPy copy.

Run ``python bench/codec.py`` (``--repeat N`` for more timing rounds). One run prints,
for each case, the best-of-N time to pack and to unpack with this SDK, with the
reference package's ``tensor_utils``, and of a plain ``arr.copy()`` (the floor), and
the ratios ``ref/ours`` (how many times faster this SDK is) and ``ours/numpy`` (how far
above a memory copy). Machines here are shared: min-of-N timings, compare ratios.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from dm_env_rpc.v1 import tensor_utils as reference

from dm_env_rpc_client import tensors

CASES: list[tuple[str, np.ndarray]] = [
    ("float32[1e6]", np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)),
    ("float64[1e6]", np.random.default_rng(1).standard_normal(1_000_000)),
    (
        "int32[1e6]",
        np.random.default_rng(2).integers(-(2**31), 2**31, 1_000_000, dtype=np.int32),
    ),
    # Not one of the required cases: typical small integers (1-2 varint bytes each).
    ("int32[1e6] 0..999", np.random.default_rng(5).integers(0, 1000, 1_000_000, dtype=np.int32)),
    ("uint8[84,84,3]", np.random.default_rng(3).integers(0, 256, (84, 84, 3), dtype=np.uint8)),
    ("bool[1e5]", np.random.default_rng(4).random(100_000) < 0.5),
]


def best_of(function: Callable[[], Any], repeat: int, budget: float = 2.0) -> float:
    """The minimum wall time of ``function()`` over up to ``repeat`` runs (within ``budget`` s)."""
    best = float("inf")
    start = time.perf_counter()
    for index in range(repeat):
        begin = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - begin)
        if index >= 2 and time.perf_counter() - start > budget:
            break
    return best


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="timing rounds (min is kept)")
    args = parser.parse_args()

    header = (
        f"{'case':<18} {'op':<7} {'ours ms':>9} {'ref ms':>9} {'numpy ms':>9} "
        f"{'ref/ours':>9} {'ours/np':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, array in CASES:
        ours_tensor = tensors.pack_tensor(array)
        ref_tensor = reference.pack_tensor(array)
        assert ours_tensor.SerializeToString() == ref_tensor.SerializeToString(), name
        assert np.array_equal(tensors.unpack_tensor(ref_tensor), array), name
        copy = best_of(array.copy, args.repeat)
        rows = [
            (
                "pack",
                best_of(lambda a=array: tensors.pack_tensor(a), args.repeat),
                best_of(lambda a=array: reference.pack_tensor(a), max(3, args.repeat // 10)),
            ),
            (
                "unpack",
                best_of(lambda t=ours_tensor: tensors.unpack_tensor(t), args.repeat),
                best_of(lambda t=ref_tensor: reference.unpack_tensor(t), max(3, args.repeat // 10)),
            ),
        ]
        for op, ours, ref in rows:
            print(
                f"{name:<18} {op:<7} {_ms(ours)} {_ms(ref)} {_ms(copy)} "
                f"{ref / ours:8.1f}x {ours / copy:7.2f}x"
            )


if __name__ == "__main__":
    main()
