"""``serve`` / ``python -m dm_env_rpc_client.server``, and the ``run`` command's child server."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
from conftest import process_gone, wait_for

CLI = [sys.executable, "-m", "dm_env_rpc_client"]
SERVER = [sys.executable, "-m", "dm_env_rpc_client.server"]


def _start(command: list[str]) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("Serving catch on 127.0.0.1:"), line
    return process, line.split()[3]


@pytest.mark.parametrize(
    ("command", "stop", "code"),
    [
        ([*CLI, "serve"], signal.SIGTERM, 0),
        ([*CLI, "serve"], signal.SIGINT, 130),
        (SERVER, signal.SIGINT, 130),
    ],
)
def test_serve_prints_the_address_and_stops(command: list[str], stop: int, code: int) -> None:
    process, _ = _start([*command, "--env", "catch", "--port", "0"])
    try:
        process.send_signal(stop)
        stdout, stderr = process.communicate(timeout=60)  # a hang guard
        assert (process.returncode, stderr) == (code, "")  # no gRPC log lines ("Got goaway")
        assert "Stopped." in stdout
    finally:
        process.kill()
        process.wait()


def test_a_port_in_use_is_one_line_from_both_commands() -> None:
    process, address = _start([*CLI, "serve"])
    port = address.rsplit(":", 1)[1]
    # As a user's shell would start them: without the GRPC_VERBOSITY=NONE that a command run
    # in this test process (cli.main) leaves in os.environ for its own children.
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    try:
        results = [
            subprocess.run(
                [*command, "--port", port], capture_output=True, text=True, timeout=60, env=env
            )
            for command in ([*CLI, "serve"], SERVER)
        ]
        debug = subprocess.run(
            [*SERVER, "--port", port, "--debug"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    finally:
        process.kill()
        process.wait()
    for result in results:
        assert result.returncode == 1
        assert (
            result.stderr
            == f"error: Cannot bind the dm_env_rpc server to '127.0.0.1:{port}'; pick another port.\n"
        )
    assert results[0].stderr == results[1].stderr
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "add_port.cc" in debug.stderr


def test_serve_checks_its_environment_at_start() -> None:
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent)}
    factory = "variable_env:needs_settings"
    refused = subprocess.run(
        [*CLI, "serve", "--env", factory], capture_output=True, text=True, timeout=60, env=env
    )
    assert refused.returncode == 2
    assert f"error: the {factory} environment refused its flags" in refused.stderr
    assert "give the seed setting" in refused.stderr and "--skip-check" in refused.stderr
    # A class is called with the settings as keyword arguments, as dmr.serve(cls) does.
    process = subprocess.Popen(
        [*CLI, "serve", "--env", "dm_env_rpc_client.server.envs:LargeObservation"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("Serving dm_env_rpc_client.server.envs:")
    finally:
        process.kill()
        process.wait()


def _children(pid: int) -> list[int]:
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_the_child_server_dies_with_run(stop: int) -> None:
    # Ctrl-C as in a terminal: a process started in the background by a shell (`cmd &`, as a
    # CI script may run pytest) inherits SIGINT ignored, and Python then leaves it ignored.
    interruptible = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'dm_env_rpc_client'; runpy.run_module('dm_env_rpc_client', run_name='__main__')"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", interruptible, "run", "--steps", "100000000", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_for(lambda: bool(_children(process.pid)), timeout=60)
        (child,) = _children(process.pid)
        assert wait_for(lambda: process.poll() is None and not process_gone(child), timeout=5)
        process.send_signal(stop)
        process.wait(timeout=60)
        assert wait_for(lambda: process_gone(child), timeout=30), f"server {child} outlived run"
    finally:
        process.kill()
        process.wait()


def test_an_unreadable_tls_file_names_its_flag(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dm_env_rpc_client import cli

    missing = str(tmp_path / "missing.pem")
    assert cli.main(["serve", "--certificate", missing, "--private-key", missing]) == 2
    assert "error: cannot read the --private-key file" in capsys.readouterr().err
    run = ["run", "--address", "127.0.0.1:1", "--root-certificates", missing]
    assert cli.main(run) == 2
    assert "cannot read the --root-certificates file" in capsys.readouterr().err
