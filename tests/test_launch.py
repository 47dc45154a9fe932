"""dmr.launch: server processes started from a command template, on a stand-in server binary.

The stand-in (``stand_in_server.py``) is built on the reference ``dm-env-rpc``
package and takes its port from its arguments; ``--misbehave`` turns it into each
bad server a launcher must report. Every test checks that nothing it started is
left running, by the unique ``--tag`` on each command line.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
from conftest import run_child, wait_for

import dm_env_rpc_client as dmr

STAND_IN = pathlib.Path(__file__).resolve().parent / "stand_in_server.py"


def _tag() -> str:
    return uuid.uuid4().hex


def _command(tag: str, *extra: str) -> list[str]:
    return [sys.executable, str(STAND_IN), "--port", "{port}", "--tag", tag, *extra]


def _running(tag: str) -> list[int]:
    """The pids of live (not zombie) processes whose command line holds ``tag``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if tag.encode() not in cmdline.read():
                    continue
            with open(f"/proc/{entry}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _none_left(tag: str) -> bool:
    return wait_for(lambda: not _running(tag), timeout=15)


def test_launched_servers_serve_connect_and_batches_and_stop_on_close(tmp_path):
    tag = _tag()
    # A binary run by its path: a script with a shebang, as a compiled player would be.
    binary = tmp_path / "player"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {STAND_IN} "$@"\n')
    binary.chmod(0o755)
    servers = dmr.launch(f"{binary} --port {{port}} --tag {tag}", 2, log_dir=str(tmp_path / "l"))
    try:
        assert len(set(servers.addresses)) == 2
        assert all(a.startswith("127.0.0.1:") for a in servers.addresses)
        with dmr.connect(servers.addresses[0], timeout=10) as conn:
            env, _ = dmr.create_and_join_world(conn, {}, {})
            assert env.reset().first()
            env.close()
        with dmr.BatchedEnvironment.connect(servers.addresses, num_envs=4) as envs:
            assert envs.reset().observation["board"].shape[0] == 4
        gymnasium_bridge = pytest.importorskip("dm_env_rpc_client.integrations.gymnasium")
        gym_env = gymnasium_bridge.GymnasiumEnv(address=servers.addresses[1])
        try:
            observation, _ = gym_env.reset(seed=0)
            assert gym_env.observation_space.contains(observation)
        finally:
            gym_env.close()
        for server in servers.servers:  # each its own log file, holding its own output
            assert server.log_path.startswith(str(tmp_path / "l"))
            assert f"serving on {server.address}" in pathlib.Path(server.log_path).read_text()
        assert len(_running(tag)) == 2
    finally:
        servers.close()
    assert _none_left(tag)
    servers.close()  # idempotent


def test_leaving_the_context_stops_a_server_that_ignores_sigterm_with_sigkill():
    tag = _tag()
    with dmr.launch(_command(tag, "--ignore-sigterm"), 1, grace=0.5) as servers:
        process = servers.servers[0].process
        assert servers.alive(0)
    assert process.returncode == -signal.SIGKILL
    assert _none_left(tag)


def test_a_server_that_accepts_before_it_serves_is_waited_for():
    tag = _tag()
    servers = dmr.launch(_command(tag, "--misbehave", "slow-start"), 1, ready_timeout=30)
    with servers, dmr.connect(servers.addresses[0], timeout=5) as conn:
        env, _ = dmr.create_and_join_world(conn, {}, {})
        assert env.reset().first()
        env.close()
    assert _none_left(tag)


def test_a_server_that_dies_is_relaunched_on_its_port_and_recorded():
    tag = _tag()
    policy = dmr.RelaunchPolicy(attempts=3, backoff=0.1)
    with dmr.launch(_command(tag), 2, relaunch=policy) as servers:
        first = servers.servers[1].pid
        os.kill(first, signal.SIGKILL)
        assert wait_for(
            lambda: [r.outcome for r in servers.relaunches] == ["relaunched"], timeout=30
        )
        relaunch = servers.relaunches[0]
        assert relaunch.index == 1 and relaunch.outcome == "relaunched"
        assert relaunch.address == servers.addresses[1]
        assert "killed by SIGKILL" in relaunch.reason and relaunch.downtime > 0
        assert servers.servers[1].pid != first and servers.alive(1)
        with dmr.connect(servers.addresses[1], timeout=5) as conn:
            env, _ = dmr.create_and_join_world(conn, {}, {})
            env.close()
    assert _none_left(tag)


# --- bad input: a clear error naming the thing, and nothing left running --------------------


def test_a_command_that_does_not_exist():
    with pytest.raises(dmr.ServerLaunchError, match="no_such_player_binary"):
        dmr.launch("no_such_player_binary --port {port}", 2)


def test_a_command_that_exits_at_once_names_its_code_output_and_log():
    tag = _tag()
    with pytest.raises(dmr.ServerLaunchError) as caught:
        dmr.launch(_command(tag, "--misbehave", "exit"), 2)
    message = str(caught.value)
    assert "exited with code 3" in message and "refusing to start" in message
    assert "stand_in_server.py" in message and "server-0.log" in message
    assert _none_left(tag)


@pytest.mark.parametrize("mode", ["never-listen", "garbage"])
def test_a_server_that_never_answers_the_protocol(mode):
    tag = _tag()
    with pytest.raises(dmr.ServerLaunchError) as caught:
        dmr.launch(_command(tag, "--misbehave", mode), 1, ready_timeout=2, grace=1)
    message = str(caught.value)
    assert "did not answer the dm_env_rpc protocol" in message and "within 2 s" in message
    assert "server-0.log" in message
    if mode == "never-listen":
        assert "loading forever" in message
    assert _none_left(tag)


def test_a_port_already_taken():
    tag = _tag()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(dmr.ServerLaunchError, match=f"Port {port} .* already in use"):
            dmr.launch(_command(tag), 1, ports=[port])
    assert not _running(tag)


def test_a_template_without_port_and_no_servers():
    with pytest.raises(ValueError, match=r"no \{port\}"):
        dmr.launch("my_player --port 5000", 1)
    with pytest.raises(ValueError, match="num_servers must be at least 1, not 0"):
        dmr.launch("my_player --port {port}", 0)
    with pytest.raises(ValueError, match="one port per server"):
        dmr.launch("my_player --port {port}", 2, ports=[5000])


# --- the parent goes away ------------------------------------------------------------------

_PARENT = textwrap.dedent(
    """
    import sys, threading
    import dm_env_rpc_client as dmr
    servers = dmr.launch({command!r}, 2, grace=1.0)
    print(" ".join(str(s.pid) for s in servers.servers), flush=True)
    if sys.argv[1] != "exit":
        threading.Event().wait(60)
    """
)


@pytest.mark.parametrize("how", ["exit", "SIGTERM", "SIGINT", "SIGKILL"])
def test_no_launched_server_outlives_its_parent(how):
    tag = _tag()
    extra = ("--ignore-sigterm",) if how == "SIGKILL" else ()
    script = _PARENT.format(command=_command(tag, *extra))
    if how == "exit":  # the interpreter exits with the servers still open: atexit stops them
        result = run_child([sys.executable, "-c", script, how], timeout=60)
        assert result.returncode == 0, result.stderr
        assert _none_left(tag)
        return
    parent = subprocess.Popen(
        [sys.executable, "-c", script, how], stdout=subprocess.PIPE, text=True
    )
    try:
        line = parent.stdout.readline()
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 2 and set(pids) <= set(_running(tag))
        os.kill(parent.pid, getattr(signal, how))
        parent.wait(timeout=30)
        assert _none_left(tag), f"orphans after {how}: {_running(tag)}"
    finally:
        parent.kill()
        parent.wait()


_CLI_ARGS = ("--num-servers", "2", "--num-envs", "4", "--steps", "10000000", "--json")


def test_the_run_command_launches_relaunches_and_lists_the_relaunch():
    tag = _tag()
    command = " ".join(_command(tag))
    run = subprocess.Popen(
        [sys.executable, "-m", "dm_env_rpc_client", "run", "--launch", command, *_CLI_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def servers_up() -> dict[int, str]:
            """The servers, by their output: their own log files (not a copy of the CLI that
            is forking, nor a process mid-exec, which may not show its command line)."""
            found = {}
            for pid in _running(tag):
                try:
                    out = os.readlink(f"/proc/{pid}/fd/1")
                except OSError:
                    continue
                if pid != run.pid and out.endswith(".log"):
                    found[pid] = out
            return found

        assert wait_for(lambda: len(servers_up()) == 2, timeout=60)
        servers, logs = map(list, zip(*sorted(servers_up().items()), strict=True))

        def created() -> int:
            return sum(pathlib.Path(log).read_text().count("world stepping") for log in logs)

        if not wait_for(lambda: created() == 4, timeout=60):  # the run is stepping its worlds
            run.kill()
            pytest.fail(f"no worlds: {servers} {logs} {run.communicate()} {created()}")
        victim, log = servers[0], logs[0]
        os.kill(victim, signal.SIGKILL)

        # Relaunched: the log holds a second "serving" line, from the new process.
        def relaunched() -> bool:
            return pathlib.Path(log).read_text().count("serving on") == 2

        wait_for(lambda: relaunched() or run.poll() is not None, 90)
        assert relaunched(), (pathlib.Path(log).read_text(), run.poll(), run.stderr.read())
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, err
    summary = __import__("json").loads(out)
    assert len(summary["relaunches"]) == 1, summary
    assert "killed by SIGKILL" in summary["relaunches"][0]
    assert summary["worlds_lost"] == 0
    assert _none_left(tag)


def test_the_run_command_takes_its_steps_across_a_relaunch(tmp_path):
    """Issue 37 defect 7 through the command line: one of two launched servers dies (SIGKILL,
    by itself after 300 step requests, with steps in flight) mid-run; it is relaunched, its two
    worlds are made again (on the other server: the test does not wait on how fast the
    relaunch starts), the steps in flight to it are made up: ``--steps 2000`` takes exactly
    2000 steps, and the summary lists the relaunch and the restarts."""
    tag = _tag()
    dies = tmp_path / "died"
    command = " ".join(_command(tag, "--die-after", "300", "--die-once", str(dies)))
    argv = ["run", "--launch", command, "--num-servers", "2", "--num-envs", "4"]
    argv += ["--steps", "2000", "--json"]
    result = run_child([sys.executable, "-m", "dm_env_rpc_client", *argv], timeout=240)
    assert result.returncode == 0, result.stderr
    assert dies.exists()  # the server did die mid-run
    summary = __import__("json").loads(result.stdout)
    assert summary["steps"] == 2000, summary
    assert len(summary["relaunches"]) == 1 and "killed by SIGKILL" in summary["relaunches"][0]
    assert len(summary["restarts"]) == 2 and summary["worlds_lost"] == 0, summary
    assert not summary["interrupted"]
    assert _none_left(tag)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--launch", "x --port {port}", "--num-servers", "0"],
            "--num-servers: must be at least 1",
        ),
        (["--num-servers", "2"], "--num-servers goes with --launch"),
        (["--launch", "x {port}", "--address", "127.0.0.1:1"], "--launch or --address"),
    ],
)
def test_the_run_command_refuses_launch_flags_that_do_not_fit(argv, message, capsys):
    try:
        code = dmr.cli_main(["run", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_run_command_names_a_launch_that_fails(capsys):
    assert dmr.cli_main(["run", "--launch", "no_such_player_binary --port {port}"]) == 1
    assert "no_such_player_binary' does not exist" in capsys.readouterr().err
    assert dmr.cli_main(["run", "--launch", "my_player --port 5000"]) == 1
    assert "has no {port}" in capsys.readouterr().err
