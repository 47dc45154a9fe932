"""Strangers kept out: shared tokens and mutual TLS, through every client path.

Real servers on loopback: ``dmr.serve`` in process, ``dm-env-rpc-client serve``
and ``dmr.launch`` in child processes. Each path meets no token, a wrong
token, a client certificate from another CA or none, and the right ones.
"""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc
import numpy as np
import pytest
import trustme
from conftest import run_child

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client._base import tokens
from dm_env_rpc_client.server.catch import Catch

CLI = [sys.executable, "-m", "dm_env_rpc_client"]
TOKEN = "s3cret-Token_42"
WRONG = "not-the-token"
FAST = 10.0  # seconds a refusal must come within (far below every timeout given: 60 s)


class Pki(NamedTuple):
    """A throwaway CA with a server and a client certificate, and a stranger's client one."""

    ca: trustme.CA
    server: trustme.LeafCert
    client: trustme.LeafCert
    stranger: trustme.LeafCert  # signed by another CA

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.server.private_key_pem.bytes(), self.server.cert_chain_pems[0].bytes())],
            root_certificates=self.ca.cert_pem.bytes(),
            require_client_auth=True,
        )

    def client_credentials(self, cert: trustme.LeafCert | None) -> grpc.ChannelCredentials:
        pair = {}
        if cert is not None:
            pair = {
                "private_key": cert.private_key_pem.bytes(),
                "certificate_chain": cert.cert_chain_pems[0].bytes(),
            }
        return grpc.ssl_channel_credentials(root_certificates=self.ca.cert_pem.bytes(), **pair)


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca = trustme.CA()
    return Pki(
        ca,
        ca.issue_cert("127.0.0.1", "localhost"),
        ca.issue_cert("client@example.com"),
        trustme.CA().issue_cert("client@example.com"),
    )


@pytest.fixture
def token_server() -> Iterator[dmr.Server]:
    with dmr.serve(Catch, token=TOKEN) as server:
        yield server


@pytest.fixture
def mtls_server(pki: Pki) -> Iterator[dmr.Server]:
    with dmr.serve(Catch, credentials=pki.server_credentials(), token=TOKEN) as server:
        yield server


def _one_step(address: str, **connect: Any) -> bool:
    with dmr.connect(address, timeout=60, **connect) as conn:
        env, _ = dmr.create_and_join_world(conn, {"seed": 0}, {}, timeout=60)
        try:
            return bool(env.reset().first() and env.step({"paddle": 1}).mid())
        finally:
            env.close()


# --- the token itself -----------------------------------------------------------------


def test_token_metadata_and_the_checks_that_keep_tokens_out_of_messages() -> None:
    assert dmr.token_metadata(TOKEN) == (("authorization", f"Bearer {TOKEN}"),)
    assert dmr.TOKEN_ENV == "DMR_TOKEN"
    for bad in ("", "has space", "line\nbreak", "naïve"):
        with pytest.raises(errors.ArgumentValueError, match="printable ASCII") as info:
            dmr.token_metadata(bad)
        assert bad not in str(info.value) or not bad
    with pytest.raises(errors.ArgumentTypeError, match="not bytes"):
        dmr.token_metadata(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(errors.ArgumentValueError, match="printable ASCII"):
        dmr.serve(Catch, token="two words")


def test_refusal_says_what_is_missing_or_wrong_and_takes_any_bearer_pair() -> None:
    assert tokens.refusal(dmr.token_metadata(TOKEN), TOKEN) is None
    assert tokens.refusal([("Authorization", f"bearer {TOKEN}")], TOKEN) is None
    # A proxy's own pair before the client's does not lock the client out.
    assert (
        tokens.refusal([("authorization", "Bearer proxy"), *dmr.token_metadata(TOKEN)], TOKEN)
        is None
    )
    assert tokens.refusal(None, TOKEN) == tokens.MISSING
    assert tokens.refusal([("x-other", "1")], TOKEN) == tokens.MISSING
    assert tokens.refusal(dmr.token_metadata(WRONG), TOKEN) == tokens.WRONG
    assert tokens.refusal(dmr.token_metadata(TOKEN[:-1]), TOKEN) == tokens.WRONG  # a prefix
    assert tokens.refusal([("authorization", f"Basic {TOKEN}")], TOKEN) == tokens.NOT_BEARER
    for message in (tokens.MISSING, tokens.WRONG, tokens.NOT_BEARER):
        assert "token_metadata" in message and TOKEN not in message


def test_the_command_line_token_comes_from_the_flag_the_file_or_the_environment(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    environ = {"DMR_TOKEN": "from-env"}
    assert tokens.resolve_token("flag", None, environ) == "flag"
    assert tokens.resolve_token(None, str(path), environ) == TOKEN
    assert tokens.resolve_token(None, None, environ) == "from-env"
    assert tokens.resolve_token(None, None, {}) is None
    with pytest.raises(ValueError, match="not both"):
        tokens.resolve_token("flag", str(path), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        tokens.resolve_token(None, str(tmp_path / "empty"), {})
    with pytest.raises(ValueError, match="Cannot read the token file"):
        tokens.resolve_token(None, str(tmp_path / "missing"), {})


# --- the server and the connection ----------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        (None, "requires a token, and the request carries none"),
        (dmr.token_metadata(WRONG), "is not this server's"),
        ((("authorization", "Basic abc"),), "is not 'Bearer <token>'"),
    ],
    ids=["no-token", "wrong-token", "not-bearer"],
)
def test_a_stranger_is_refused_with_unauthenticated_saying_why(
    token_server: dmr.Server, metadata: Any, says: str
) -> None:
    started = time.monotonic()
    with pytest.raises(dmr.AuthenticationError, match=says) as info:
        _one_step(token_server.address, metadata=metadata)
    assert time.monotonic() - started < FAST
    error = info.value
    assert isinstance(error, errors.ConnectionClosedError)
    assert error.code == grpc.StatusCode.UNAUTHENTICATED
    assert "token_metadata" in str(error) and WRONG not in str(error) and TOKEN not in str(error)

    async def over_asyncio() -> None:
        async with await dmr.connect_async(token_server.address, metadata=metadata) as conn:
            await conn.send(dmr.dm_env_rpc_pb2.CreateWorldRequest(), timeout=60)

    with pytest.raises(dmr.AuthenticationError, match=says):
        asyncio.run(over_asyncio())


def test_the_right_token_gets_in_and_a_tokenless_server_ignores_one(
    token_server: dmr.Server, catch_server: dmr.Server
) -> None:
    assert _one_step(token_server.address, metadata=dmr.token_metadata(TOKEN))
    extra = (("x-trace", "1"), *dmr.token_metadata(TOKEN))
    assert _one_step(token_server.address, metadata=extra)
    assert _one_step(catch_server.address, metadata=dmr.token_metadata(TOKEN))


def test_a_foreign_servers_unauthenticated_says_what_to_pass() -> None:
    error = dmr.connection.closed_error(_Unauthenticated("no credentials"))
    assert isinstance(error, dmr.AuthenticationError)
    assert "no credentials" in str(error) and "dmr.token_metadata(token)" in str(error)


class _Unauthenticated(grpc.RpcError):
    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("client", "says"),
    [
        (None, "requires a client certificate it trusts"),
        ("stranger", "requires a client certificate it trusts"),
        ("untrusting", "TLS handshake with .* failed"),
    ],
    ids=["no-client-cert", "cert-of-another-ca", "server-cert-untrusted"],
)
def test_mutual_tls_refuses_a_wrong_certificate_at_once(
    pki: Pki, mtls_server: dmr.Server, client: str | None, says: str
) -> None:
    if client == "untrusting":  # the client does not trust the server's CA
        credentials = grpc.ssl_channel_credentials(trustme.CA().cert_pem.bytes())
    else:
        credentials = pki.client_credentials(pki.stranger if client else None)
    metadata = dmr.token_metadata(TOKEN)
    started = time.monotonic()
    with pytest.raises(dmr.AuthenticationError, match=says) as info:
        dmr.connect(mtls_server.address, credentials=credentials, metadata=metadata, timeout=60)
    assert time.monotonic() - started < FAST  # not after the 60 s timeout
    assert info.value.code == grpc.StatusCode.UNAVAILABLE

    async def over_asyncio() -> None:
        await dmr.connect_async(mtls_server.address, credentials=credentials, timeout=60)

    with pytest.raises(dmr.AuthenticationError, match=says):
        asyncio.run(over_asyncio())


def test_mutual_tls_and_the_token_let_the_right_client_in(
    pki: Pki, mtls_server: dmr.Server
) -> None:
    credentials = pki.client_credentials(pki.client)
    assert _one_step(
        mtls_server.address, credentials=credentials, metadata=dmr.token_metadata(TOKEN)
    )
    with pytest.raises(dmr.AuthenticationError, match="carries none"):
        _one_step(mtls_server.address, credentials=credentials)  # the certificate alone


# --- the batch, Gymnasium and SB3 -----------------------------------------------------


def test_the_batch_passes_token_and_client_certificate_to_every_world(
    pki: Pki, mtls_server: dmr.Server
) -> None:
    right = pki.client_credentials(pki.client)
    with dmr.BatchedEnvironment.connect(
        mtls_server.address, 3, credentials=right, metadata=dmr.token_metadata(TOKEN), timeout=60
    ) as batch:
        batch.reset()
        assert len(batch.step({"paddle": np.zeros(3, np.int8)}).env_ids) == 3
    for credentials, metadata, cause, says in (
        (right, None, "carries none", dmr.AuthenticationError),
        (right, dmr.token_metadata(WRONG), "not this server's", dmr.AuthenticationError),
        (
            pki.client_credentials(pki.stranger),
            dmr.token_metadata(TOKEN),
            "client certificate",
            None,
        ),
    ):
        started = time.monotonic()
        with pytest.raises(errors.WorldError, match=cause) as info:
            dmr.BatchedEnvironment.connect(
                mtls_server.address, 2, credentials=credentials, metadata=metadata, timeout=60
            )
        assert time.monotonic() - started < FAST
        assert isinstance(info.value.__cause__, dmr.AuthenticationError), says


def test_gymnasium_and_sb3_pass_the_token_through_connect_kwargs(
    token_server: dmr.Server,
) -> None:
    gym = pytest.importorskip("dm_env_rpc_client.integrations.gymnasium")
    right = {"metadata": dmr.token_metadata(TOKEN)}
    with pytest.raises(dmr.AuthenticationError, match="carries none"):
        gym.GymnasiumEnv(address=token_server.address, timeout=60)
    with pytest.raises(dmr.AuthenticationError, match="not this server's"):
        gym.GymnasiumEnv(
            address=token_server.address, connect_kwargs={"metadata": dmr.token_metadata(WRONG)}
        )
    env = gym.GymnasiumEnv(address=token_server.address, timeout=60, connect_kwargs=right)
    try:
        env.reset(seed=0)
        env.step(env.action_space.sample())
    finally:
        env.close()
    with pytest.raises(errors.WorldError) as info:
        gym.GymnasiumVectorEnv(addresses=[token_server.address], num_envs=2)
    assert isinstance(info.value.__cause__, dmr.AuthenticationError)
    vector = gym.GymnasiumVectorEnv(
        addresses=[token_server.address], num_envs=2, connect_kwargs=right
    )
    vector.reset(seed=0)
    vector.close()
    pytest.importorskip("stable_baselines3", reason="the sb3 extra (with torch) is not installed")
    sb3 = pytest.importorskip("dm_env_rpc_client.integrations.sb3")
    with pytest.raises(errors.WorldError) as info:
        sb3.BatchedVecEnv(addresses=token_server.address, num_envs=2)
    assert isinstance(info.value.__cause__, dmr.AuthenticationError)
    vec = sb3.BatchedVecEnv(addresses=token_server.address, num_envs=2, connect_kwargs=right)
    try:
        assert vec.reset().shape[0] == 2
    finally:
        vec.close()


# --- launched servers and the command line --------------------------------------------


def _serve_command(*extra: str) -> list[str]:
    return [*CLI, "serve", "--port", "{port}", *extra]


def _cmdline(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _environ(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode()


def _server_pid(launched: dmr.LaunchedServers) -> int:
    """The pid of the server program (under Linux's exec wrapper, the same process)."""
    return launched.servers[0].pid


def test_launch_hands_the_token_in_the_environment_never_the_command_line() -> None:
    with dmr.launch(_serve_command(), 1, token=TOKEN, ready_timeout=60) as servers:
        pid = _server_pid(servers)
        assert f"DMR_TOKEN={TOKEN}" in _environ(pid).splitlines()
        assert TOKEN not in _cmdline(pid)
        assert servers.metadata == dmr.token_metadata(TOKEN)
        with dmr.BatchedEnvironment.connect(servers, 2, timeout=60) as batch:  # its token
            batch.reset()
        with pytest.raises(errors.WorldError) as info:
            dmr.BatchedEnvironment.connect(
                servers, 1, metadata=dmr.token_metadata(WRONG), timeout=60
            )
        assert isinstance(info.value.__cause__, dmr.AuthenticationError)
        with pytest.raises(dmr.AuthenticationError, match="carries none"):
            _one_step(servers[0])


def test_launch_probes_a_mutual_tls_server_with_its_credentials(
    pki: Pki, tmp_path: pathlib.Path
) -> None:
    files = _pem_files(pki, tmp_path)
    command = _serve_command(
        "--certificate", files["server.pem"], "--private-key", files["server.key"],
        "--client-ca", files["ca.pem"],
    )  # fmt: skip
    credentials = pki.client_credentials(pki.client)
    with dmr.launch(command, 1, credentials=credentials, ready_timeout=60) as servers:
        assert _one_step(servers[0], credentials=credentials)
        with dmr.BatchedEnvironment.connect(servers, 2, timeout=60) as batch:  # its credentials
            batch.reset()


def _pem_files(pki: Pki, folder: pathlib.Path) -> dict[str, str]:
    blobs = {
        "ca.pem": pki.ca.cert_pem,
        "server.pem": pki.server.cert_chain_pems[0],
        "server.key": pki.server.private_key_pem,
        "client.pem": pki.client.cert_chain_pems[0],
        "client.key": pki.client.private_key_pem,
        "stranger.pem": pki.stranger.cert_chain_pems[0],
        "stranger.key": pki.stranger.private_key_pem,
    }
    for name, blob in blobs.items():
        blob.write_to_path(str(folder / name))
    return {name: str(folder / name) for name in blobs}


@pytest.fixture
def cli_server(pki: Pki, tmp_path: pathlib.Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``dm-env-rpc-client serve`` with mutual TLS and a token file; yields its address and
    the PEM and token files."""
    files = _pem_files(pki, tmp_path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "wrong").write_text(WRONG + "\n")
    files.update(token=str(tmp_path / "token"), wrong=str(tmp_path / "wrong"))
    process = subprocess.Popen(
        [*CLI, "serve", "--host", "localhost", "--token-file", files["token"],
         "--certificate", files["server.pem"], "--private-key", files["server.key"],
         "--client-ca", files["ca.pem"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("Serving catch on localhost:"), process.stderr
        assert line.rstrip().endswith("(mutual TLS) (token)"), line
        assert TOKEN not in _cmdline(process.pid)
        yield line.split()[3], files
    finally:
        process.kill()
        process.wait()


def test_the_command_line_passes_token_and_client_certificate(
    cli_server: tuple[str, dict[str, str]],
) -> None:
    address, files = cli_server
    tls = ["--root-certificates", files["ca.pem"]]
    mine = [*tls, "--certificate", files["client.pem"], "--private-key", files["client.key"]]
    for command in (
        ["run", "--address", address, "--steps", "40", "--json"],
        ["specs", address],
        ["check", address, "--latency-steps", "5", "--episode-steps", "50"],
    ):
        ok = run_child([*CLI, *command, *mine, "--token-file", files["token"]], 90)
        assert ok.returncode == 0, (command, ok.stdout[-2000:], ok.stderr[-2000:])
    run = ["run", "--address", address, "--steps", "20", "--quiet", "--timeout", "60"]
    no_token = run_child([*CLI, *run, *mine], 90)
    assert no_token.returncode == 1 and "refused this client" in no_token.stderr
    assert "requires a token" in no_token.stderr
    wrong = run_child([*CLI, *run, *mine, "--token-file", files["wrong"]], 90)
    assert wrong.returncode == 1 and "is not this server's" in wrong.stderr
    assert WRONG not in wrong.stderr and TOKEN not in wrong.stderr
    by_env = run_child([*CLI, *run, *mine], 90, env={**_env(), "DMR_TOKEN": TOKEN})
    assert by_env.returncode == 0, by_env.stderr
    by_flag = run_child([*CLI, *run, *mine, "--token", TOKEN], 90)
    assert by_flag.returncode == 0, by_flag.stderr
    stranger = ["--certificate", files["stranger.pem"], "--private-key", files["stranger.key"]]
    for client in ([], stranger):  # no client certificate, or one from another CA
        started = time.monotonic()
        refused = run_child([*CLI, *run, *tls, *client, "--token-file", files["token"]], 90)
        assert refused.returncode == 1, refused.stderr
        assert "requires a client certificate it trusts" in refused.stderr
        assert time.monotonic() - started < 30  # at once, not after --timeout 60
    both = run_child([*CLI, *run, *mine, "--token", TOKEN, "--token-file", files["token"]], 90)
    assert both.returncode == 2 and "not both" in both.stderr


def _env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key != "DMR_TOKEN"}


def test_run_launch_gives_the_launched_servers_the_token(tmp_path: pathlib.Path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    launch = f"{sys.executable} -m dm_env_rpc_client serve --port {{port}}"
    result = run_child(
        [*CLI, "run", "--launch", launch, "--token-file", str(tmp_path / "token"),
         "--steps", "40", "--json"],
        90,
        env=_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert '"steps": 40' in result.stdout


def test_serve_refuses_a_bad_token_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "empty").write_text("")
    result = run_child([*CLI, "serve", "--token-file", str(tmp_path / "empty")], 60)
    assert result.returncode == 2 and "is empty" in result.stderr
