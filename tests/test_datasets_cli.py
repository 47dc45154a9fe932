"""``run --record DIR --format minari|rlds``: reproducible, and safe against SIGKILL.

Needs the ``minari`` and ``rlds`` extras (skipped without them; ``.ci/run``
installs both and runs this file).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import run_child, wait_for

from dm_env_rpc_client.cli import main
from dm_env_rpc_client.server._subprocess import server_subprocess

minari = pytest.importorskip("minari")
envlogger = pytest.importorskip("envlogger")

RUN = ["run", "--in-process", "--quiet", "--num-envs", "3", "--steps", "200", "--seed", "4"]


def _minari_episodes(folder: pathlib.Path) -> dict[tuple[int, int], tuple]:
    dataset = minari.MinariDataset(folder / "data")
    metas = dataset.storage.get_episode_metadata(range(dataset.total_episodes))
    return {
        (m["world"], m["episode"]): (
            m["end"],
            m["seed"],
            ep.observations["board"].tobytes(),
            ep.actions["paddle"].tobytes(),
            ep.rewards.tobytes(),
        )
        for m, ep in zip(metas, dataset.iterate_episodes(), strict=True)
    }


def _rlds_episodes(folder: pathlib.Path) -> dict[tuple[int, int], tuple]:
    with envlogger.Reader(str(folder)) as reader:
        return {
            (int(m["world"]), int(m["episode"])): (
                m["end"],
                int(m["seed"]),
                [int(s.timestep.step_type) for s in ep],
                [s.timestep.reward for s in ep],
                [s.timestep.discount for s in ep],
                np.stack([s.timestep.observation["board"] for s in ep]).tobytes(),
                [None if s.action is None else int(s.action["paddle"]) for s in ep],
            )
            for m, ep in zip(reader.episode_metadata(), reader.episodes, strict=True)
        }


def test_the_same_command_twice_gives_the_same_episodes(tmp_path, capsys) -> None:
    for fmt, read in (("minari", _minari_episodes), ("rlds", _rlds_episodes)):
        runs = []
        for attempt in range(2):
            folder = tmp_path / f"{fmt}{attempt}"
            args = [*RUN, "--json", "--record", str(folder), "--format", fmt]
            assert main(args) == 0
            summary = json.loads(capsys.readouterr().out)
            runs.append(read(folder))
            assert len(runs[-1]) == summary["recorded_episodes"] > 0
        assert runs[0] == runs[1]
        ends = {value[0] for value in runs[0].values()}
        assert ends == {"terminated", "cut"}
        assert {seed for (_, seed, *_) in runs[0].values()} == {4, 5, 6}


def test_minari_metadata_from_the_command_line(tmp_path, capsys) -> None:
    folder = tmp_path / "catch"
    args = [*RUN, "--record", str(folder), "--format", "minari", "--dataset-id", "catch-mine-v2"]
    args += ["--author", "Ada", "--author-email", "ada@example.org", "--algorithm-name", "rand"]
    assert main(args) == 0
    capsys.readouterr()
    dataset = minari.MinariDataset(folder / "data")
    assert dataset.spec.dataset_id == "catch-mine-v2"
    metadata = dataset.storage.metadata
    assert metadata["author"] == {"Ada"} and metadata["author_email"] == {"ada@example.org"}
    assert metadata["algorithm_name"] == "rand"
    settings = metadata["dm_env_rpc_client"]
    assert settings["steps"] == 200 and settings["seed"] == 4 and settings["num_envs"] == 3


def _spawn(folder: pathlib.Path, fmt: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "dm_env_rpc_client", *RUN[:-4], "--seed", "1"]
    command += ["--steps", "100000000", "--record", str(folder), "--format", fmt]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the run's writer process)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def _kill_when(  # type: ignore[no-untyped-def]
    child: subprocess.Popen[str], ready, timeout: float = 60.0, *, its_writer: bool = False
) -> object:
    """SIGKILLs ``child`` once ``ready()``; with ``its_writer``, its writer process at once too
    (as the OOM killer or a kill of the process group would); alone, the writer process
    commits what it has and exits."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            value = ready()
            if value:
                for pid in _children(child.pid) if its_writer else ():
                    os.kill(pid, signal.SIGKILL)
                os.kill(child.pid, signal.SIGKILL)
                child.wait(10)
                return value
            assert child.poll() is None, child.communicate()
            time.sleep(0.05)  # polling a file with a deadline, not waiting for a condition
        pytest.fail("the run committed nothing in time")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def _minari_committed(folder: pathlib.Path) -> int:
    try:
        meta = json.loads((folder / "data" / "metadata.json").read_text())
    except (OSError, ValueError):
        return 0
    return meta["total_episodes"] if meta["total_episodes"] >= 30 else 0


def test_minari_dataset_survives_sigkill(tmp_path) -> None:
    folder = tmp_path / "killed-v0"
    committed = _kill_when(_spawn(folder, "minari"), lambda: _minari_committed(folder))
    dataset = minari.MinariDataset(folder / "data")
    assert dataset.total_episodes >= committed
    metas = list(dataset.storage.get_episode_metadata(range(dataset.total_episodes)))
    for meta, episode in zip(metas, dataset.iterate_episodes(), strict=True):
        assert len(episode) == meta["total_steps"] == len(episode.observations["board"]) - 1
        assert meta["end"] == "terminated" and episode.terminations[-1]
    assert dataset.total_steps == sum(m["total_steps"] for m in metas)


def _rlds_shards(folder: pathlib.Path) -> int:
    if not folder.is_dir():
        return 0
    shards = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return len(shards) if len(shards) >= 2 else 0


def test_rlds_dataset_survives_sigkill(tmp_path) -> None:
    folder = tmp_path / "killed"
    _kill_when(_spawn(folder, "rlds"), lambda: _rlds_shards(folder), its_writer=True)
    assert (folder / ".staging").exists()  # a shard was open at the kill, and stays unseen
    with envlogger.Reader(str(folder)) as reader:
        metas = list(reader.episode_metadata())
        assert len(reader.episodes) == len(metas) > 10
        for meta, episode in zip(metas, reader.episodes, strict=True):
            types = [int(step.timestep.step_type) for step in episode]
            assert types[0] == 0 and types[-1] == 2 and set(types[1:-1]) <= {1}
            assert meta["end"] == "terminated"


def test_an_unknown_format_is_refused(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main([*RUN, "--record", str(tmp_path / "x"), "--format", "bogus"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_ray_shards_give_one_dataset_matching_a_single_process_run(tmp_path, capsys) -> None:
    """Each shard records .npz parts; the driver writes one dataset: the same episodes."""
    pytest.importorskip("ray", reason="needs the ray extra")
    common = ["run", "--num-envs", "4", "--steps", "300", "--seed", "2", "--quiet", "--json"]
    for fmt, read, shards in (("minari", _minari_episodes, 3), ("rlds", _rlds_episodes, 2)):
        assert (
            main([*common, "--in-process", "--record", str(tmp_path / fmt), "--format", fmt]) == 0
        )
        capsys.readouterr()
        folder = tmp_path / f"{fmt}-ray"
        ray_flags = ["--ray", "local", "--num-shards", str(shards)]
        record = ["--record", str(folder), "--format", fmt]
        command = [sys.executable, "-m", "dm_env_rpc_client", *common, *ray_flags, *record]
        child = run_child(command, timeout=100)
        assert child.returncode == 0, child.stderr
        summary = json.loads(child.stdout)
        single, sharded = read(tmp_path / fmt), read(folder)
        assert sharded == single and len(sharded) == summary["recorded_episodes"] > 0
        assert summary["recorded_to"] == str(folder)
        assert {world for world, _ in sharded} == {0, 1, 2, 3}


def _run_and_kill_a_server(folder: pathlib.Path, fmt: str, committed) -> dict:  # type: ignore[no-untyped-def]
    """``run`` over two servers into ``--format fmt``; the second server is SIGKILLed once
    ``committed()`` holds, and its worlds (1 and 3) restart on the first. The run has far
    more steps than it takes: once ``committed()`` has grown again after the kill (the
    restarted worlds have written episodes), SIGTERM ends it, as Ctrl-C would. (A run of
    a fixed length raced the writer: on a fast machine it finished before the first commit
    and the kill came after its last step.)"""
    with server_subprocess() as first, server_subprocess() as second:
        command = [sys.executable, "-m", "dm_env_rpc_client", "run", "--quiet", "--json"]
        command += ["--address", first.address, second.address, "--num-envs", "4"]
        command += ["--timeout", "5", "--steps", "100000000", "--seed", "3"]
        # Episodes of 39 steps: a world killed right at an episode's start (its FIRST step
        # alone, which is not kept) or end has no cut episode, which is rarer the longer they are.
        command += ["--create-setting", "rows=40"]
        command += ["--record", str(folder), "--format", fmt]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert wait_for(committed, timeout=60), "nothing committed in time"
            second.kill()
            at_kill = committed()
            assert wait_for(lambda: committed() > at_kill, timeout=60), "nothing after the kill"
            child.send_signal(signal.SIGTERM)
            stdout, stderr = child.communicate(timeout=120)
        finally:
            child.kill()
    summary = json.loads(stdout)
    assert summary["interrupted"], stderr
    assert sorted(line.split(":")[0] for line in summary["restarts"]) == ["world 1", "world 3"]
    return summary


def _check_cut_then_whole(episodes: dict[tuple[int, int], tuple[str, list[int]]]) -> None:
    """The restarted worlds' episodes cut (not terminated) by the kill; the next one is whole."""
    # Catch's episodes all have one length: every terminated episode has it, none is cut short.
    assert len({len(types) for end, types in episodes.values() if end == "terminated"}) == 1
    cuts = []
    for world in (1, 3):
        numbers = sorted(n for w, n in episodes if w == world)
        cuts += [(world, n) for n in numbers if episodes[world, n][0] == "cut" and n != numbers[-1]]
    ends = {
        w: [episodes[w, n][0] for n in sorted(n for v, n in episodes if v == w)] for w in (1, 3)
    }
    assert cuts, f"no killed world was cut mid-episode: {ends}"  # both at a boundary: rare
    whole = 0
    for world, n in cuts:
        assert episodes[world, n][1][-1] == 1  # ends on a MID step: no LAST
        following = episodes[world, n + 1]
        if following[0] in ("cut", "interrupted") and (world, n + 2) not in episodes:
            continue  # the run's end (SIGTERM) interrupted it
        assert following[0] == "terminated"
        assert following[1][0] == 0 and following[1][-1] == 2
        assert set(following[1][1:-1]) <= {1}
        whole += 1
    assert whole, "no restarted world finished an episode after its cut one"


def test_a_restarted_world_through_minari(tmp_path) -> None:
    folder = tmp_path / "restart-v0"
    _run_and_kill_a_server(folder, "minari", lambda: _minari_committed(folder))
    dataset = minari.MinariDataset(folder / "data")
    metas = dataset.storage.get_episode_metadata(range(dataset.total_episodes))
    episodes = {}
    for meta, episode in zip(metas, dataset.iterate_episodes(), strict=True):
        terminated, truncated = bool(episode.terminations[-1]), bool(episode.truncations[-1])
        assert not episode.terminations[:-1].any() and not episode.truncations[:-1].any()
        assert terminated != truncated  # one or the other, on the last transition
        assert truncated == (meta["end"] in ("cut", "interrupted"))
        # Step types as the episode ends: Minari has none; its flags say it.
        types = [0] + [1] * (len(episode) - 1) + ([2] if terminated else [1])
        episodes[meta["world"], meta["episode"]] = (meta["end"], types)
    _check_cut_then_whole(episodes)


def test_a_restarted_world_through_rlds(tmp_path) -> None:
    folder = tmp_path / "restart"
    _run_and_kill_a_server(folder, "rlds", lambda: _rlds_shards(folder))
    with envlogger.Reader(str(folder)) as reader:
        episodes = {
            (int(m["world"]), int(m["episode"])): (
                m["end"],
                [int(step.timestep.step_type) for step in episode],
            )
            for m, episode in zip(reader.episode_metadata(), reader.episodes, strict=True)
        }
    _check_cut_then_whole(episodes)
