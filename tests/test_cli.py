"""The command line end to end, as subprocesses (argument checks also in-process)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trustme
from conftest import run_child, sigstop, wait_for

import dm_env_rpc_client as dmr
from dm_env_rpc_client import cli
from dm_env_rpc_client.recording import iter_episodes
from dm_env_rpc_client.server._subprocess import server_subprocess

CLI = [sys.executable, "-m", "dm_env_rpc_client"]
TESTS = pathlib.Path(__file__).resolve().parent
TIMING = ("steps_per_second", "latency_p50_ms", "latency_p99_ms")


def _run(*args: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return run_child([*CLI, *args], timeout, **kwargs)


def _summary(stdout: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(stdout)
    return data


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
    assert "steps           300" in result.stdout
    for key in ("episodes", "unfinished", "steps/s", "latency", "world seeds     3 to 4"):
        assert key in result.stdout
    episodes = list(iter_episodes(tmp_path))
    assert episodes and all(e.step_type[0] == 0 for e in episodes)
    assert all((e.step_type[-1] == 2) != e.truncated for e in episodes)
    assert {e.world for e in episodes} == {0, 1} and {e.seed for e in episodes} == {3, 4}
    assert episodes[0].observation["board"].shape[1:] == (4, 5)
    assert len(episodes[0].action["paddle"]) == len(episodes[0])
    assert f"recorded to     {tmp_path} ({len(episodes)} episodes" in result.stdout
    assert result.stderr == ""  # no progress bar, and no gRPC log lines at shutdown


def test_the_same_command_twice_gives_the_same_run(tmp_path: pathlib.Path) -> None:
    runs = []
    for name in ("a", "b"):
        args = ["run", "--seed", "7", "--num-envs", "3", "--steps", "301", "--json"]
        result = _run(*args, "--record", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        runs.append(_summary(result.stdout))
    for run in runs:
        for key in TIMING:
            run.pop(key)
        run.pop("recorded_to")
    assert runs[0] == runs[1]
    assert runs[0]["world_seeds"] == [7, 8, 9] and runs[0]["steps"] == 301
    first, second = (list(iter_episodes(tmp_path / name)) for name in ("a", "b"))
    assert len(first) == len(second) == runs[0]["recorded_episodes"]
    for one, other in zip(first, second, strict=True):
        assert (one.world, one.episode, one.truncated) == (
            other.world,
            other.episode,
            other.truncated,
        )
        np.testing.assert_array_equal(one.observation["board"], other.observation["board"])
        np.testing.assert_array_equal(one.action["paddle"], other.action["paddle"])
    files = [{f.name: f.read_bytes() for f in (tmp_path / n).iterdir()} for n in ("a", "b")]
    assert files[0] == files[1] and all(name.startswith("episodes_") for name in files[0])
    # Each world plays its own game: the worlds' first boards differ.
    boards = {e.world: e.observation["board"][0].tobytes() for e in first if e.episode == 1}
    assert len(set(boards.values())) > 1


def test_run_with_the_server_in_process() -> None:
    result = _run("run", "--in-process", "--steps", "100", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "steps           100" in result.stdout


def test_more_worlds_than_a_default_server_serves() -> None:
    # The embedded server is sized for the worlds (a default server serves 64 streams).
    result = _run("run", "--num-envs", "70", "--steps", "140", "--pipeline", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert _summary(result.stdout)["worlds"] == 70


def test_a_server_subprocess_that_cannot_start_is_a_clear_error() -> None:
    with (
        pytest.raises(OSError, match="embedded nosuchenv server process did not start") as info,
        server_subprocess("nosuchenv", timeout=30),
    ):
        pass
    assert "neither a built-in environment" in str(info.value)  # the child's own error output


def test_run_and_specs_against_an_address() -> None:
    with server_subprocess() as server:
        result = _run("run", "--address", server.address, "--steps", "100", "--quiet")
        assert result.returncode == 0, result.stderr
        # Repeated settings flags all count, and none swallows the address after it.
        specs = _run(
            "specs", "--create-setting", "rows=6", "--create-setting", "columns=3", server.address
        )
        assert specs.returncode == 0, specs.stderr
        assert "paddle" in specs.stdout and "[-1, 1]" in specs.stdout and "int8" in specs.stdout
        assert "(6, 3)" in specs.stdout
        names = [line.split()[0] for line in specs.stdout.split("observations")[1].splitlines()[3:]]
        assert names == sorted(names) == ["board", "discount", "reward"]


def test_errors_are_one_paragraph_without_traceback() -> None:
    with server_subprocess() as server:
        sigstop(server.process)  # accepts connections, never answers
        try:
            result = _run("run", "--address", server.address, "--timeout", "0.5", "--steps", "10")
            debug = _run("--debug", "run", "--address", server.address, "--timeout", "0.5")
        finally:
            server.process.send_signal(signal.SIGCONT)
    assert result.returncode == 1
    assert f"error: WorldError: World 0 at {server.address} failed" in result.stderr
    assert "Traceback" not in result.stderr and "--debug" in result.stderr
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    bad = _run("run", "--create-setting", "colour=red", "--steps", "5", "--quiet")
    assert bad.returncode == 1 and "'colour'" in bad.stderr


@pytest.mark.parametrize("program", ["dm-env-rpc-client", "server"])
def test_main_as_the_program_puts_the_process_back_when_it_returns(
    program: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    # main() reads sys.argv and silences gRPC's C core while it runs (GRPC_VERBOSITY=NONE for
    # children, descriptor 2 on /dev/null, sys.stderr on a copy of the real one); called from
    # Python (a notebook, a test) it must leave none of that behind.
    from dm_env_rpc_client.server import __main__ as server_main

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    seen: list[tuple[str | None, bool, bool]] = []
    stderr, descriptor = sys.stderr, os.fstat(2)

    def state() -> tuple[str | None, bool, bool]:
        same_fd = os.path.samestat(os.fstat(2), descriptor)
        return os.environ.get("GRPC_VERBOSITY"), sys.stderr is stderr, same_fd

    missing = str(tmp_path / "missing.pem")
    if program == "server":
        argv, main, code, said = ["--certificate", missing], server_main.main, 2, "error: "
        inner = server_main.serve_command
        monkeypatch.setattr(
            server_main, "serve_command", lambda *a: (seen.append(state()), inner(*a))[1]
        )
        argv += ["--private-key", missing]
    else:
        with socket.socket() as unused:  # a port nothing listens on
            unused.bind(("127.0.0.1", 0))
            refused = f"127.0.0.1:{unused.getsockname()[1]}"
        argv, main, code = ["specs", refused, "--timeout", "5"], cli.main, 1
        said = f"Nothing accepts connections at {refused}"
        inner_parser = cli.build_parser
        monkeypatch.setattr(cli, "build_parser", lambda: (seen.append(state()), inner_parser())[1])
    monkeypatch.setattr(sys, "argv", [program, *argv])
    assert main() == code
    assert seen == [("NONE", False, False)]  # silenced while it ran
    assert state() == (None, True, True)  # and put back
    assert said in capfd.readouterr().err  # what Python printed meanwhile reached stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--steps", "0"], "argument --steps: must be at least 1, not 0"),
        (["run", "--steps", "-5"], "argument --steps: must be at least 1, not -5"),
        (["run", "--pipeline", "0"], "argument --pipeline: must be at least 1"),
        (["run", "--pipeline", "-1"], "argument --pipeline: must be at least 1"),
        (["run", "--num-envs", "0"], "argument --num-envs: must be at least 1"),
        (["run", "--timeout", "0"], "argument --timeout: must be a finite number above 0"),
        (["run", "--timeout", "-1"], "argument --timeout: must be a finite number above 0"),
        (["serve", "--port", "-1"], "argument --port: a port is 0 to 65535"),
        (["serve", "--port", "70000"], "argument --port: a port is 0 to 65535"),
        (["serve", "--max-workers", "0"], "argument --max-workers: must be at least 1"),
        (["serve", "--size", "10"], "--size applies to --env large only"),
        (["serve", "--env", "nosuch"], "neither a built-in environment"),
        (["serve", "--env", "nosuchmodule:make"], "cannot load the factory"),
        (["serve", "--certificate", "x.pem"], "--certificate and --private-key go together"),
        (["run", "--record", ""], "argument --record: Cannot create the recording folder ''"),
        (["run", "--record", "/proc/foo"], "argument --record: Cannot create"),
        (["run", "--world", "a", "b", "--num-envs", "3"], "give one name per world"),
        (["run", "--world", "a", "--create-setting", "rows=3"], "--create-setting does not apply"),
        (["run", "--create-setting", "rows"], "settings look like key=value"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_record_refuses_a_file_and_a_folder_in_use(tmp_path: pathlib.Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = _run("run", "--record", str(afile))
    assert result.returncode == 2
    assert f"argument --record: The recording folder {afile} is not a folder" in result.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "episode_000_000001.npz").write_bytes(b"")
    result = _run("run", "--record", str(tmp_path / "used"))
    assert result.returncode == 2 and "would mix two runs" in result.stderr


def test_addresses_are_checked_before_waiting(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{unused.getsockname()[1]}"
    cases = [
        (["run", "--address", "garbage"], 2, "'garbage' is not host:port"),
        (["run", "--address", "nosuchhost.invalid:50051"], 1, "'nosuchhost.invalid' of"),
        (["specs", "nosuchhost.invalid:50051"], 1, "The host 'nosuchhost.invalid' of"),
        (["run", "--address", refused], 1, f"Nothing accepts connections at {refused}"),
        (["run", "--address", "192.0.2.2:43495"], 2, "pass --insecure"),
        (["run", "--insecure", "--tls", "--address", "192.0.2.2:1"], 2, "contradict"),
    ]
    for args, code, message in cases:
        assert cli.main([*args, "--timeout", "20"]) == code, args
        assert message in capsys.readouterr().err, args


def _free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def served() -> Iterator[Any]:
    """Starts ``serve`` subprocesses; yields start(*args, env=None) -> (process, address)."""
    processes: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> tuple[Any, str]:
        process = subprocess.Popen(
            [*CLI, "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        processes.append(process)
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("Serving "), process.stderr.read() if process.stderr else line
        return process, line.split()[3]

    yield start
    for process in processes:
        process.kill()
        process.wait()


def test_tls_and_mutual_tls_end_to_end(tmp_path: pathlib.Path, served: Any) -> None:
    authority = trustme.CA()
    server_cert = authority.issue_cert("localhost")
    client_cert = authority.issue_cert("client@example.com")
    files = {
        "ca": authority.cert_pem,
        "server.pem": server_cert.cert_chain_pems[0],
        "server.key": server_cert.private_key_pem,
        "client.pem": client_cert.cert_chain_pems[0],
        "client.key": client_cert.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(tmp_path / name))
    _, address = served(
        "--host", "localhost", "--certificate", str(tmp_path / "server.pem"),
        "--private-key", str(tmp_path / "server.key"), "--client-ca", str(tmp_path / "ca"),
    )  # fmt: skip
    client = ["--certificate", str(tmp_path / "client.pem")]
    client += ["--private-key", str(tmp_path / "client.key")]
    ca = ["--root-certificates", str(tmp_path / "ca")]
    result = _run("run", "--address", address, *ca, *client, "--steps", "50", "--json")
    assert result.returncode == 0, result.stderr
    assert _summary(result.stdout)["steps"] == 50
    specs = _run("specs", address, *ca, *client)
    assert specs.returncode == 0 and "board" in specs.stdout, specs.stderr
    # Without a client certificate the server refuses the handshake: at once, saying why.
    refused = _run("run", "--address", address, *ca, "--timeout", "2", "--quiet")
    assert refused.returncode == 1 and "requires a client certificate it trusts" in refused.stderr
    missing = _run("run", "--address", address, "--root-certificates", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "cannot read the --root-certificates file" in missing.stderr


def test_insecure_reaches_a_remote_address(served: Any) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("198.51.100.1", 9))  # no packet is sent: this picks the outgoing interface
            remote = udp.getsockname()[0]
        except OSError:
            remote = "127.0.0.1"
    if remote.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    _, address = served("--host", "0.0.0.0")
    target = f"{remote}:{address.rsplit(':', 1)[1]}"
    refused = _run("run", "--address", target, "--steps", "20")
    assert refused.returncode == 2 and "pass --insecure" in refused.stderr
    result = _run("run", "--address", target, "--insecure", "--steps", "20", "--json")
    assert result.returncode == 0, result.stderr
    assert "Connecting to" not in result.stderr  # --json: only the JSON object


def test_variable_length_specs_run_and_record(tmp_path: pathlib.Path, served: Any) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    _, address = served("--env", "variable_env:make", env=env)
    args = ["run", "--address", address, "--num-envs", "2", "--steps", "40", "--json"]
    result = _run(*args, "--record", str(tmp_path / "rec"))
    assert result.returncode == 0, result.stderr
    episodes = list(iter_episodes(tmp_path / "rec"))
    assert episodes and not any(e.truncated for e in episodes if e.step_type[-1] == 2)
    episode = next(e for e in episodes if not e.truncated)
    assert len(episode.action["word"]) == len(episode) == 3
    assert [len(w) for w in episode.action["word"]] == episode.observation["length"][1:].tolist()
    assert _summary(result.stdout)["world_seeds"] == [0, 1]


def test_run_joins_existing_worlds() -> None:
    with server_subprocess() as server, dmr.connect(server.address, timeout=20) as owner:
        names = [dmr.create_world(owner, {"rows": 3}) for _ in range(2)]
        result = _run(
            "run", "--address", server.address, "--world", *names, "--steps", "30", "--json"
        )
        assert result.returncode == 0, result.stderr
        summary = _summary(result.stdout)
        assert summary["worlds"] == 2 and summary["world_seeds"] == [None, None]
        assert summary["episodes"] == 10  # 3 rows: every episode is 3 steps, FIRST included
        specs = _run("specs", server.address, "--world", names[0])
        assert specs.returncode == 0 and "(3, 5)" in specs.stdout, specs.stderr
        assert dmr.join_world(owner, names[1]).reset().observation["board"].shape == (3, 5)


def _wait_for_file(folder: pathlib.Path) -> None:
    assert wait_for(lambda: any(folder.glob("episode*_*.npz")), timeout=60)


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_prints_the_summary(tmp_path: pathlib.Path, stop: int, code: int) -> None:
    record = tmp_path / "rec"
    process = subprocess.Popen(
        [*CLI, "run", "--steps", "100000000", "--json", "--record", str(record)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_file(record)
        process.send_signal(stop)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == code, stderr
    summary = _summary(stdout)
    assert summary["interrupted"] is True and summary["steps"] > 0
    episodes = list(iter_episodes(record))
    assert summary["recorded_episodes"] == len(episodes) > 0
    assert summary["recorded_truncated"] == sum(e.truncated for e in episodes)
    assert ".cc:" not in stderr and "Traceback" not in stderr  # no gRPC log lines


def test_a_stalled_server_fails_within_the_timeout_naming_the_world(
    tmp_path: pathlib.Path,
) -> None:
    with server_subprocess() as server:
        record = tmp_path / "rec"
        args = ["run", "--address", server.address, "--steps", "100000000", "--timeout", "2"]
        process = subprocess.Popen(
            [*CLI, *args, "--quiet", "--record", str(record)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait_for_file(record)
            sigstop(server.process)
            _, stderr = process.communicate(timeout=30)  # a hang guard, not a speed check
        finally:
            server.process.send_signal(signal.SIGCONT)
            process.kill()
    assert process.returncode == 1
    assert "No step finished within 2.0 s" in stderr
    assert f"world 0 at {server.address}" in stderr and "--timeout" in stderr


def test_help_and_version() -> None:
    version = _run("--version")
    assert (
        version.returncode == 0 and version.stdout.strip() == f"dm-env-rpc-client {dmr.__version__}"
    )
    run_help = _run("run", "--help").stdout
    for text in ("steps in flight per world (default: 8)", "seed + i", "dotted keys nest"):
        assert text in " ".join(run_help.split()), text
    specs_help = " ".join(_run("specs", "--help").stdout.split())
    assert "a CreateWorld setting: KEY=VALUE" in specs_help and "--root-certificates" in specs_help
    serve_help = " ".join(_run("serve", "--help").stdout.split())
    assert "(default: 127.0.0.1)" in serve_help and "0 picks a free port (default: 0)" in serve_help
    module_help = _run("--help", timeout=60)
    assert module_help.returncode == 0
    server_help = subprocess.run(
        [sys.executable, "-m", "dm_env_rpc_client.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "``" not in server_help and "package.module:factory" in server_help


def test_specs_into_a_closed_pipe_is_quiet() -> None:
    with server_subprocess() as server:
        process = subprocess.Popen(
            [*CLI, "specs", server.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        process.stdout.close()  # like `| head` that has already exited
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0 and stderr == ""


def _run_and_kill(first: Any, second: Any, record: pathlib.Path, *extra: str) -> Any:
    """``run`` over both servers; the second is SIGKILLed mid-run (once episodes are saved)."""
    command = [*CLI, "run", "--address", first.address, second.address, "--num-envs", "4"]
    command += ["--timeout", "5", "--record", str(record), "--json", *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: len(list(record.glob("*.npz"))) >= 4, timeout=60)
        second.kill()
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, stdout, stderr


def test_run_restarts_the_worlds_of_a_killed_server(tmp_path: pathlib.Path) -> None:
    with server_subprocess() as first, server_subprocess() as second:
        code, stdout, stderr = _run_and_kill(first, second, tmp_path / "rec", "--steps", "20000")
    assert code == 0, stderr
    summary = _summary(stdout)
    assert 20000 - 2 * 8 <= summary["steps"] <= 20000 and summary["worlds_lost"] == 0
    restarted = sorted(line.split(":")[0] for line in summary["restarts"])
    assert restarted == ["world 1", "world 3"]  # the worlds of the killed server
    assert all(f"{second.address} -> {first.address}" in r for r in summary["restarts"])
    # The episodes the failure cut are kept, marked truncated; none is dropped. Only a cut
    # episode that had no transition yet (its FIRST step alone) has nothing to save: one step
    # at most per restart, and per world at the end of the run. (The killed worlds often sit
    # at an episode boundary together: Catch's episodes all have one length.)
    episodes = list(iter_episodes(tmp_path / "rec"))
    recorded = sum(len(e.step_type) for e in episodes)
    assert summary["steps"] - 2 - 4 <= recorded <= summary["steps"], (recorded, summary)
    cut = [e for e in episodes if e.truncated and e.world in (1, 3)]
    assert all(e.step_type[-1] != 2 for e in cut)
    assert len(cut) == summary["recorded_truncated"] - sum(
        e.truncated and e.world not in (1, 3) for e in episodes
    ), summary


def test_run_with_on_failure_raise_stops(tmp_path: pathlib.Path) -> None:
    with server_subprocess() as first, server_subprocess() as second:
        code, _, stderr = _run_and_kill(
            first, second, tmp_path / "rec", "--steps", "1000000", "--on-failure", "raise"
        )
    assert code == 1 and f"at {second.address} failed" in stderr


def test_tls_flags_make_a_credentials_factory_that_pickles(tmp_path: pathlib.Path) -> None:
    """What run --ray hands its shards: a function of the PEM bytes, since credentials
    do not pickle; None without TLS flags, and an unreadable file names its flag."""
    import argparse
    import pickle

    import grpc

    from dm_env_rpc_client._base.cli_args import UsageError, tls_credentials

    def flags(**given: Any) -> argparse.Namespace:
        names = ("tls", "root_certificates", "certificate", "private_key")
        return argparse.Namespace(**{name: given.get(name) for name in names})

    assert tls_credentials(flags()) is None
    authority = trustme.CA()
    root = tmp_path / "root.pem"
    authority.cert_pem.write_to_path(str(root))
    make = pickle.loads(pickle.dumps(tls_credentials(flags(root_certificates=str(root)))))
    assert isinstance(make(), grpc.ChannelCredentials)
    with pytest.raises(UsageError, match="--private-key"):
        tls_credentials(flags(certificate=str(root), private_key=str(tmp_path / "missing.pem")))
