"""What recording costs a batched run: npz, Minari and RLDS against no recording.

Run: ``python bench/record.py [--steps N] [--rounds R]`` (needs the ``minari`` and
``rlds`` extras). Part 1: 16 Catch worlds on two server processes, stepped by
the ``run`` command's loop (``dmr.collect``, 8 in flight per world) with each
recording (``--record --format``, written by a child process, ``Recording(background=
"process")``; ``--background thread`` for the writer thread) and without, interleaved
in rounds; a run is timed until the child has written every episode its steps ended
(``WriterProcess.sync``), and its CPU is the "writer process" column; steps/s
are medians over the rounds and each format's ratio to no recording is the
median of per-round ratios. Part 2: the same over 4 worlds of an in-process
server whose observation is one uint8 84x84x3 image (episodes of 50 steps), to
see what large observations cost. MB per 1,000 steps is the folder's size after
the run (warm-up included) over the steps recorded. Part 3: each writer alone (no
stepping) on 400 recorded Catch episodes, CPU µs per step, and envlogger's own
``add_step`` alone on the same steps (protos encoded beforehand): the part of RLDS's
cost that is the library's.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import tempfile
import time
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    DEFAULT_ROUNDS,
    measure_interleaved,
    print_table,
    process_cpu_seconds,
    server_processes,
)

# isort: split
import dm_env
import numpy as np
from dm_env import specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client._cli.record import NPZ_EPISODES_PER_FILE
from dm_env_rpc_client.integrations.minari import MinariWriter
from dm_env_rpc_client.integrations.rlds import RldsWriter
from dm_env_rpc_client.server.catch import Catch

FORMATS = ("none", "npz", "minari", "rlds")
BACKGROUND = "process"  # --background
WINDOW = 8
# Deleted when the benchmark ends, not after each run: on ext4 without a journal (this
# machine's) the kernel skips every inode deleted in the last minutes when it allocates one
# (ext4's recently_deleted), so deleting one run's thousands of files would make the next
# run's file creation the costlier (Minari's most: three inodes an episode). Others' deletions
# count too: set TMPDIR to a folder where nothing was deleted lately (docs/datasets.md).
_FOLDERS: list[pathlib.Path] = []


class Frames(dm_env.Environment):
    """84x84x3 uint8 frames (a moving gradient), episodes of 50 steps."""

    def __init__(self, seed: int = 0) -> None:
        self._t = seed * 0
        self._frame = np.zeros((84, 84, 3), np.uint8)

    def reset(self) -> dm_env.TimeStep:
        self._t = 0
        return dm_env.restart({"pixels": self._draw()})

    def step(self, action: Any) -> dm_env.TimeStep:
        self._t += 1
        if self._t >= 50:
            return dm_env.termination(1.0, {"pixels": self._draw()})
        return dm_env.transition(0.0, {"pixels": self._draw()})

    def _draw(self) -> np.ndarray:
        self._frame[:] = (np.arange(84, dtype=np.uint8)[:, None, None] + self._t) % 251
        return self._frame

    def observation_spec(self) -> dict[str, specs.Array]:
        return {"pixels": specs.BoundedArray((84, 84, 3), np.uint8, 0, 255, name="pixels")}

    def action_spec(self) -> dict[str, specs.Array]:
        return {"move": specs.DiscreteArray(4, name="move")}


def _sizes() -> dict[str, list[float]]:
    return {name: [] for fmt in FORMATS for name in (fmt, f"{fmt} child")}


def _folder_mb(path: pathlib.Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def _variants(addresses: list[str], worlds: int, sizes: dict[str, list[float]]) -> dict[str, Any]:
    def factory(fmt: str) -> Any:
        def make() -> Any:
            batch = dmr.BatchedEnvironment.connect(addresses, worlds, seed=0, timeout=30)
            root = pathlib.Path(tempfile.mkdtemp(prefix="bench_record-"))
            folder = root / "data-v0"
            writer: Any = None
            if fmt.startswith("minari"):  # minari@0.1: commit_every=0.1
                every = float(fmt.partition("@")[2] or 1.0)
                writer = MinariWriter.for_environment(folder, batch, commit_every=every)
            elif fmt.startswith("npz"):  # npz@1: a file per episode
                per = int(fmt.partition("@")[2] or NPZ_EPISODES_PER_FILE)
                writer = dmr.recording.NpzWriter(folder, episodes_per_file=per)
            elif fmt == "rlds":
                writer = RldsWriter.for_environment(folder, batch)
            recording = (
                None
                if fmt == "none"
                else dmr.Recording(
                    folder, worlds, batch.world_seeds, writer=writer, background=BACKGROUND
                )
            )
            done = [0, 0]
            child = getattr(getattr(recording, "_background", None), "pid", None)
            if child:  # its imports are a one-off cost, not the run's
                recording._background.wait_ready()  # type: ignore[union-attr]

            def run(steps: int) -> None:
                cpu = process_cpu_seconds(child) if child else 0.0
                dmr.collect(batch, steps, pipeline=WINDOW, timeout=60, seed=0, record=recording)
                if child:  # timed until every episode ended so far is written
                    blocks, recording._blocks = recording._blocks, []  # type: ignore[union-attr]
                    recording._rows = 0  # type: ignore[union-attr]
                    recording._background.sync(blocks)  # type: ignore[union-attr]
                done[0] += steps
                done[1] += 1
                if done[1] == 2:  # the timed run (the first is the warm-up)
                    used = process_cpu_seconds(child) - cpu if child else 0.0
                    sizes[f"{fmt} child"].append(used / steps * 1e6)

            def close() -> None:
                if recording is not None:
                    recording.close()
                    sizes[fmt].append(_folder_mb(folder) / done[0] * 1000)
                batch.close()
                _FOLDERS.append(root)

            return run, close

        return make

    return {fmt: factory(fmt) for fmt in FORMATS}


def _report(title: str, rounds: Any, sizes: dict[str, list[float]]) -> None:
    rows = []
    for fmt in FORMATS:
        mb = np.median(sizes[fmt]) if sizes[fmt] else 0.0
        child = np.median(sizes[f"{fmt} child"]) if sizes[f"{fmt} child"] else 0.0
        rows.append(
            (
                fmt,
                rounds.median(fmt),
                f"{rounds.ratio(fmt, 'none'):.3f}",
                f"{rounds.median(fmt, 'cpu_us_per_step'):.1f}",
                f"{child:.1f}",
                f"{rounds.median(fmt, 'server_cpu_us_per_step'):.1f}",
                f"{mb:.3f}",
            )
        )
    header = (
        "recording",
        "steps/s",
        "ratio to none",
        "client CPU µs/step",
        "writer process CPU µs/step",
        "servers CPU µs/step",
        "MB / 1,000 steps",
    )
    print_table(title, header, rows)


def _writers_alone(episodes: list[Any], spaces_of: Any) -> None:
    from envlogger.converters import codec

    from dm_env_rpc_client.integrations import rlds
    from dm_env_rpc_client.integrations.rlds import _steps as _rlds_steps

    steps = sum(len(e.step_type) for e in episodes)
    rows = []

    def timed(name: str, write: Any, close: Any) -> None:
        started = time.process_time()
        for episode in episodes:
            write(episode)
        close()
        cpu = (time.process_time() - started) / steps * 1e6
        rows.append((name, f"{cpu:.1f}", f"{1e6 / cpu:,.0f}"))

    for fmt in ("npz", "minari", "rlds"):
        root = pathlib.Path(tempfile.mkdtemp(prefix="bench_record-"))
        writer: Any
        if fmt == "npz":
            writer = dmr.recording.NpzWriter(root / "npz", episodes_per_file=NPZ_EPISODES_PER_FILE)
        elif fmt == "minari":
            writer = MinariWriter(root / "m-v0", *spaces_of)
        else:
            writer = RldsWriter(root / "rlds")
        timed(f"{fmt} writer", writer.write, writer.close)
        shutil.rmtree(root, ignore_errors=True)
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_record-"))
    protos = [
        (codec.encode(_rlds_steps.step(e, t)), t == 0)
        for e in episodes
        for t in range(len(e.step_type))
    ]
    shard = rlds._open(root, {}, rlds.WRITER_OPTIONS)
    started = time.process_time()
    for data, first in protos:
        shard.add_step(data, first)
    shard.close()
    cpu = (time.process_time() - started) / steps * 1e6
    rows.append(("envlogger add_step alone", f"{cpu:.1f}", f"{1e6 / cpu:,.0f}"))
    shutil.rmtree(root, ignore_errors=True)
    header = ("writer", "CPU µs/step", "steps/s of one core")
    print_table(f"Writers alone: {len(episodes)} Catch episodes, {steps} steps", header, rows)


def _catch_episodes(address: str) -> tuple[list[Any], Any]:
    batch = dmr.BatchedEnvironment.connect([address], 16, seed=0, timeout=30)
    kept: list[Any] = []

    class Keep:
        def write(self, episode: Any) -> None:
            kept.append(episode)

        def close(self) -> None:
            pass

    with dmr.Recording("unused", 16, writer=Keep()) as recording:
        dmr.collect(batch, 4400, pipeline=WINDOW, timeout=60, seed=0, record=recording)
    writer = MinariWriter.for_environment(pathlib.Path(tempfile.mkdtemp()) / "spaces-v0", batch)
    batch.close()
    episodes = [e for e in kept if not e.truncated][:400]
    return episodes, (writer.observation_space, writer.action_space)


def main() -> None:
    global BACKGROUND, FORMATS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=16000)
    parser.add_argument("--only-writers", action="store_true", help="part 3 alone")
    parser.add_argument("--image-steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument(
        "--background", choices=("process", "thread"), default="process", help="Recording's"
    )
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="e.g. none,minari,minari@0.1 (commit_every),npz@1 (episodes per file)",
    )
    parser.add_argument("--catch-only", action="store_true", help="part 1 alone")
    args = parser.parse_args()
    FORMATS = tuple(args.formats.split(","))
    BACKGROUND = args.background
    try:
        _main(args)
    finally:
        for root in _FOLDERS:
            shutil.rmtree(root, ignore_errors=True)


def _main(args: argparse.Namespace) -> None:
    sizes: dict[str, list[float]] = _sizes()
    if args.only_writers:
        with dmr.serve(lambda settings: Catch(**settings)) as server:
            _writers_alone(*_catch_episodes(server.address))
        return
    with server_processes("sdk", 2) as servers:
        rounds = measure_interleaved(
            _variants([s.address for s in servers], 16, sizes),
            args.steps,
            rounds=args.rounds,
            warmup=1600,
            server_pid=[s.pid for s in servers],
        )
    _report(f"16 Catch worlds, {args.steps} steps per run, {rounds.rounds} rounds", rounds, sizes)
    if args.catch_only:
        return
    sizes = _sizes()
    with dmr.serve(Frames) as server:
        rounds = measure_interleaved(
            _variants([server.address], 4, sizes), args.image_steps, rounds=args.rounds, warmup=200
        )
    _report(
        f"4 worlds of uint8 84x84x3 frames (in-process server), {args.image_steps} steps per run",
        rounds,
        sizes,
    )
    with dmr.serve(lambda settings: Catch(**settings)) as server:
        episodes, spaces_of = _catch_episodes(server.address)
    _writers_alone(episodes, spaces_of)


if __name__ == "__main__":
    main()
