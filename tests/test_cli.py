"""The command line end to end, as subprocesses."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import pytest

from dm_env_rpc_client.recording import iter_episodes
from dm_env_rpc_client.server._subprocess import server_subprocess

CLI = [sys.executable, "-m", "dm_env_rpc_client"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_run_against_the_embedded_server_and_record(tmp_path: pathlib.Path) -> None:
    result = _run(
        "run",
        "--steps",
        "300",
        "--num-envs",
        "2",
        "--seed",
        "3",
        "--record",
        str(tmp_path),
        "--create-setting",
        "rows=4",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    summary = dict(line.split(None, 1) for line in result.stdout.splitlines() if "  " in line)
    assert "steps           300" in result.stdout
    for key in ("episodes", "steps/s", "latency"):
        assert key in result.stdout
    episodes = list(iter_episodes(tmp_path))
    assert episodes and all(e.step_type[0] == 0 for e in episodes)
    assert all((e.step_type[-1] == 2) != e.truncated for e in episodes)
    assert sum(e.truncated for e in episodes) <= 2  # at most one unfinished per world
    assert episodes[0].observation["board"].shape[1:] == (4, 5)
    assert len(episodes[0].action["paddle"]) == len(episodes[0].step_type) - 1
    assert summary
    assert result.stderr == ""  # no progress bar, and no gRPC log lines at shutdown


def test_run_with_the_server_in_process() -> None:
    result = _run("run", "--in-process", "--steps", "100", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "steps           100" in result.stdout


def test_a_server_subprocess_that_cannot_start_is_a_clear_error() -> None:
    with (
        pytest.raises(OSError, match="embedded nosuchenv server process did not start") as info,
        server_subprocess("nosuchenv", timeout=30),
    ):
        pass
    assert "invalid choice" in str(info.value)  # the child's own error output is included


def test_run_and_specs_against_an_address() -> None:
    with server_subprocess() as server:
        result = _run("run", "--address", server.address, "--steps", "100", "--quiet")
        assert result.returncode == 0, result.stderr
        specs = _run("specs", server.address, "--create-setting", "rows=6")
        assert specs.returncode == 0, specs.stderr
        assert "paddle" in specs.stdout and "[-1, 1]" in specs.stdout and "int8" in specs.stdout
        assert "(6, 5)" in specs.stdout and "board" in specs.stdout


def test_errors_are_one_paragraph_without_traceback() -> None:
    result = _run("run", "--address", "127.0.0.1:1", "--timeout", "0.5", "--steps", "10")
    assert result.returncode == 1
    assert "error: WorldError: World 0 at 127.0.0.1:1 failed" in result.stderr
    assert "Traceback" not in result.stderr and "--debug" in result.stderr
    debug = _run("--debug", "run", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    bad = _run("run", "--create-setting", "colour=red", "--steps", "5", "--quiet")
    assert bad.returncode == 1 and "'colour'" in bad.stderr


def test_serve_prints_the_address_and_stops_on_sigterm() -> None:
    process = subprocess.Popen(
        [*CLI, "serve", "--env", "catch", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("Serving catch on 127.0.0.1:")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert "Stopped." in process.stdout.read()
    finally:
        process.kill()
        process.wait()
