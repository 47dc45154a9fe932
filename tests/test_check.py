"""The conformance checker (``conformance.check_server`` and ``dm-env-rpc-client check``).

It must pass conforming servers (the SDK's, one written on the reference package, a raw-gRPC
one), report each broken rule of a server that breaks exactly one (one raw-gRPC server per
rule, ``check_servers.FAULTS``), and agree with the reference package's compliance suites
where they check the same thing.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import unittest
from typing import Any, ClassVar

import grpc
import pytest
from check_servers import FAULTS, raw_server, reference_server
from multiagent_check_servers import MULTIAGENT_FAULTS, multiagent_server

import dm_env_rpc_client as dmr
from dm_env_rpc_client import cli
from dm_env_rpc_client.conformance import RULES, ConformanceReport, check_server
from dm_env_rpc_client.server import Server, serve
from dm_env_rpc_client.server.paddles import Paddles

# Small limits keep a run near 0.2 s; a fault that hangs costs TIMEOUT once.
TIMEOUT = 3.0
QUICK = {"timeout": TIMEOUT, "latency_steps": 30, "episode_steps": 50}


def _check(address: str) -> ConformanceReport:
    return check_server(address, **QUICK)


def _not_passed(report: ConformanceReport) -> dict[str, str]:
    return {f.rule: f"{f.status}: {f.detail}" for f in report.findings if f.status != "pass"}


MULTIAGENT = [rule for rule in RULES if rule.startswith("multi-agent.")]


def _single_agent(not_passed: dict[str, str]) -> dict[str, str]:
    """``not_passed`` without the multi-agent group, which must be skipped as one agent's."""
    skipped = {rule: not_passed.pop(rule, "pass") for rule in MULTIAGENT}
    assert all(
        why.startswith("skip: one agent per world: a second JoinWorld") for why in skipped.values()
    ), skipped
    return not_passed


def test_the_embedded_server_keeps_every_rule(catch_server: Server) -> None:
    report = _check(catch_server.address)
    assert _single_agent(_not_passed(report)) == {}
    assert report.conforms
    assert [f.rule for f in report.findings] == list(RULES)
    assert report.latency["steps"] == 30
    assert 0 < report.latency["p50_ms"] <= report.latency["p99_ms"]


@pytest.mark.parametrize("server", ["reference package", "raw gRPC"])
def test_foreign_conforming_servers_keep_every_rule(server: str) -> None:
    with reference_server() if server == "reference package" else raw_server() as address:
        report = _check(address)
    assert _single_agent(_not_passed(report)) == {}


@pytest.mark.parametrize("mode", ["lockstep", "turns"])
def test_multi_agent_servers_keep_every_rule_of_the_group_too(mode: str) -> None:
    with serve(Paddles) as server:
        report = check_server(server.address, create_world_settings={"mode": mode}, **QUICK)
    assert _not_passed(report) == {}
    assert report.by_rule()["multi-agent.reset-world"].detail == (
        "both agents INTERRUPTED, then RUNNING"
    )
    with multiagent_server() as address:  # a sync gRPC server whose barrier blocks a thread
        assert _not_passed(_check(address)) == {}


def test_every_rule_but_connect_has_a_server_that_breaks_it() -> None:
    assert sorted(FAULTS + MULTIAGENT_FAULTS) == sorted(set(RULES) - {"connect"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", FAULTS + MULTIAGENT_FAULTS)
def test_a_server_that_breaks_one_rule_fails_exactly_that_rule(rule: str) -> None:
    faulty = multiagent_server if rule in MULTIAGENT_FAULTS else raw_server
    with faulty(rule) as address:
        report = _check(address)
    failed = {f.rule: f.detail for f in report.failures}
    assert list(failed) == [rule], report.text()
    assert failed[rule]  # says what the server did
    hang = ("multi-client.concurrent", "latency.step", "multi-agent.join", "multi-agent.leave")
    if rule in hang:  # these servers hang: a finding
        assert f"no answer within {TIMEOUT:g} s" in failed[rule]
    assert not report.conforms
    # The rules it could not check say why; everything else passed.
    skipped = [f for f in report.findings if f.status == "skip"]
    assert all(f.detail for f in skipped)


def test_a_server_that_refuses_a_second_client_with_an_error_conforms() -> None:
    with raw_server("one-world-at-a-time") as address:
        report = _check(address)
    finding = report.by_rule()["multi-client.concurrent"]
    assert finding.status == "skip"
    assert "refused a second client" in finding.detail
    assert "RESOURCE_EXHAUSTED" in finding.detail
    assert report.conforms


def test_a_given_world_is_joined_not_made(catch_server: Server) -> None:
    with dmr.connect(catch_server.address, timeout=10) as conn:
        name = dmr.create_world(conn, {"rows": 6})
        report = check_server(catch_server.address, world_name=name, **QUICK)
        skipped = _single_agent(_not_passed(report))
        # The embedded server lets one connection at a time join a world: a refusal, a skip.
        assert skipped.pop("multi-client.concurrent").startswith(
            "skip: the server refused a second client: FAILED_PRECONDITION"
        )
        assert skipped == {
            "lifecycle.create": f"skip: the world {name!r} is given: not made here",
            "lifecycle.destroy": f"skip: the world {name!r} is given: not made here",
        }
        dmr.destroy_world(conn, name)  # still there: the checks left it, and did not destroy it


def test_check_command_world_and_create_settings_contradict(capsys) -> None:
    assert cli.main(["check", "127.0.0.1:1", "--world", "w", "--create-setting", "rows=5"]) == 2
    assert "--world joins an existing world" in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_nothing_listening_fails_connect_and_skips_the_rest() -> None:
    report = check_server(f"127.0.0.1:{_closed_port()}", timeout=0.5)
    by_rule = report.by_rule()
    assert by_rule["connect"].status == "fail"
    assert "Nothing accepts connections" in by_rule["connect"].detail
    assert {f.status for f in report.findings[1:]} == {"skip"}
    assert report.latency == {}


@pytest.mark.parametrize(
    "kwargs", [{"timeout": 0}, {"latency_steps": 0}, {"episode_steps": -1}], ids=str
)
def test_bad_limits_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        check_server("127.0.0.1:1", **kwargs)


def test_the_report_in_json_and_text(catch_server: Server) -> None:
    report = _check(catch_server.address)
    data = json.loads(report.to_json())
    assert data["address"] == catch_server.address and data["conforms"] is True
    assert [item["rule"] for item in data["findings"]] == list(RULES)
    assert data["findings"][0]["rule_text"] == RULES["connect"]
    text = report.text()
    assert text.splitlines()[-1].endswith("conforms: 24 passed, 0 failed, 4 skipped.")
    assert all(rule in text for rule in RULES)


# --- the command line ---------------------------------------------------------------------


def test_check_command_exit_code_0_for_a_conforming_server(catch_server: Server, capsys) -> None:
    code = cli.main(["check", catch_server.address, "--latency-steps", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert "PASS  errors.unknown-world" in out
    assert out.rstrip().endswith("0 failed, 4 skipped.")  # the multi-agent group: one agent


def test_check_command_exit_code_1_and_json_for_a_broken_server(capsys) -> None:
    with raw_server("errors.wrong-dtype") as address:
        code = cli.main(["check", address, "--json", "--timeout", "3", "--latency-steps", "20"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    assert data["conforms"] is False
    failed = [item for item in data["findings"] if item["status"] == "fail"]
    assert [item["rule"] for item in failed] == ["errors.wrong-dtype"]


def test_check_command_passes_world_settings(catch_server: Server, capsys) -> None:
    code = cli.main(["check", catch_server.address, "--create-setting", "rows=5"])
    assert code == 0
    code = cli.main(["check", catch_server.address, "--create-setting", "rows=-3"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL  lifecycle.create" in out and "rows" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["check"],
        ["check", "127.0.0.1:1", "--timeout", "0"],
        ["check", "not an address"],
        ["check", "127.0.0.1:1", "--launch", "server --port {port}"],
    ],
    ids=["no address", "zero timeout", "bad address", "address and launch"],
)
def test_check_command_usage_errors_exit_2(argv: list[str], capsys) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    assert code == 2
    assert capsys.readouterr().err


def test_check_command_nothing_listening_exits_1_saying_so(capsys) -> None:
    code = cli.main(["check", f"127.0.0.1:{_closed_port()}"])
    assert code == 1
    assert "Nothing accepts connections" in capsys.readouterr().err


def test_check_launch_starts_checks_and_stops_the_server(tmp_path, capsys) -> None:
    command = f"{sys.executable} -m dm_env_rpc_client.server --port {{port}} --env catch"
    code = cli.main(
        ["check", "--launch", f"{command} --skip-check", "--latency-steps", "20", "--seed", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS  lifecycle.destroy" in out


def test_check_launch_names_a_command_that_does_not_exist(capsys) -> None:
    code = cli.main(["check", "--launch", "/nonexistent/player --port {port}"])
    assert code == 1
    assert "/nonexistent/player" in capsys.readouterr().err


# --- agreement with the reference package's compliance suites --------------------------------

# Each rule of ours that a reference compliance test also checks, and those tests (by name).
# specs.shapes and specs.bounds are one reference check (_check_tensor_spec): compared together.
OVERLAP = {
    "lifecycle.create": ["test_can_create_and_destroy_world"],
    "lifecycle.join": ["test_can_join"],
    "lifecycle.leave": ["test_can_leave_world_after_joining"],
    "lifecycle.reset": ["test_reset_resends_the_specs"],
    "lifecycle.reset-world": ["test_can_reset_world_when_joined_to_it"],
    "specs.unique-names": [
        "test_action_specs_have_unique_names",
        "test_observation_specs_have_unique_names",
    ],
    "specs.shapes+bounds": [
        "test_action_specs_for_consistency",
        "test_observation_specs_for_consistency",
    ],
    "step.observations": [
        "test_no_observations_returned_if_not_requested",
        "test_requested_observations_are_returned",
        "test_all_observation_dtypes_match_spec_dtypes",
    ],
    "step.first-ignores-actions": ["test_first_step_actions_are_ignored"],
    "errors.reset-before-join": ["test_cannot_reset_if_not_joined_to_world"],
    "errors.unknown-world": ["test_cannot_join_with_wrong_world_name"],
    "errors.unknown-uid": ["test_cannot_send_invalid_action_uid"],
    "errors.wrong-dtype": ["test_cannot_send_wrong_numeric_type_action"],
}


def _reference_verdicts(address: str) -> dict[str, tuple[str, str]]:
    """Runs the reference's compliance suites on ``address``: {test name: (status, why)}.

    A test whose world could not be made is skipped (as our checker skips a rule then).
    """
    from dm_env_rpc.v1 import compliance
    from dm_env_rpc.v1 import connection as reference_connection
    from dm_env_rpc.v1 import dm_env_rpc_pb2 as ref

    class Connected:
        def setUp(self) -> None:
            super().setUp()  # type: ignore[misc]
            self._channel = grpc.insecure_channel(address)
            self._connection = reference_connection.Connection(self._channel)
            # Closed even when a setUp fails (tearDown is not called then): an open stream
            # holds one of the server's worker threads.
            self.addCleanup(self._channel.close)  # type: ignore[attr-defined]
            self.addCleanup(self._connection.close)  # type: ignore[attr-defined]

        @property
        def connection(self) -> Any:
            return self._connection

    class WithWorld(Connected):
        def setUp(self) -> None:
            super().setUp()
            try:
                self._world_name = self.connection.send(ref.CreateWorldRequest()).world_name
            except Exception as exc:  # the harness has no world: not run, as our SKIP
                self.skipTest(f"no world: {exc}")  # type: ignore[attr-defined]

        def tearDown(self) -> None:
            for request in (
                ref.LeaveWorldRequest(),
                ref.DestroyWorldRequest(world_name=self._world_name),
            ):
                with contextlib.suppress(Exception):  # the harness's cleanup, not a verdict
                    self.connection.send(request)
            super().tearDown()

        @property
        def world_name(self) -> str:
            return self._world_name

    class CreateDestroy(Connected, compliance.CreateDestroyWorld):
        required_world_settings: ClassVar[dict[str, Any]] = {}
        invalid_world_settings: ClassVar[dict[str, Any]] = {}
        has_multiple_world_support = True

    class JoinLeave(WithWorld, compliance.JoinLeaveWorld):
        pass

    class Reset(WithWorld, compliance.Reset):
        def join_world(self) -> Any:
            return self.connection.send(ref.JoinWorldRequest(world_name=self.world_name)).specs

    class ResetWorld(WithWorld, compliance.ResetWorld):
        pass

    class Step(WithWorld, compliance.Step):
        def setUp(self) -> None:
            super().setUp()
            join = ref.JoinWorldRequest(world_name=self.world_name)
            try:
                self._specs = self.connection.send(join).specs
            except Exception as exc:
                self.skipTest(f"cannot join: {exc}")  # type: ignore[attr-defined]

        @property
        def specs(self) -> Any:
            return self._specs

    wanted = {name for names in OVERLAP.values() for name in names}
    suite = unittest.TestSuite()
    for case in (CreateDestroy, JoinLeave, Reset, ResetWorld, Step):
        for name in unittest.TestLoader().getTestCaseNames(case):
            if name in wanted:
                suite.addTest(case(name))
    result = unittest.TestResult()
    suite.run(result)
    assert result.testsRun == len(wanted)
    verdicts = {name: ("pass", "") for name in wanted}
    for test, reason in result.skipped:
        verdicts[test._testMethodName] = ("skip", reason)
    for test, trace in result.failures + result.errors:
        # A failed subTest is reported as its own _SubTest: its test_case is the test.
        name = getattr(test, "test_case", test)._testMethodName
        verdicts[name] = ("fail", trace.strip().splitlines()[-1])
    return verdicts


def _our_verdicts(report: ConformanceReport) -> dict[str, tuple[str, str]]:
    ours = {f.rule: (f.status, f.detail) for f in report.findings}
    shapes, bounds = ours["specs.shapes"], ours["specs.bounds"]
    ours["specs.shapes+bounds"] = shapes if shapes[0] != "pass" else bounds
    return ours


COMPARED = ["embedded", "reference package", "raw gRPC"] + [
    rule for rule in FAULTS if rule in OVERLAP or rule in ("specs.shapes", "specs.bounds")
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", COMPARED)
def test_verdicts_agree_with_the_reference_compliance_suites(server: str, catch_server) -> None:
    if server == "embedded":
        address_context: Any = _Given(catch_server.address)
    elif server == "reference package":
        address_context = reference_server()
    else:
        address_context = raw_server(None if server == "raw gRPC" else server)
    with address_context as address:
        ours = _our_verdicts(_check(address))
        theirs = _reference_verdicts(address)
    compared, disagreements = [], {}
    for rule, names in OVERLAP.items():
        statuses = {theirs[name][0] for name in names}
        if ours[rule][0] == "skip" or "skip" in statuses:
            continue  # one side could not check it (no world to check it on)
        compared.append(rule)
        if (ours[rule][0] == "fail") != ("fail" in statuses):
            disagreements[rule] = {"ours": ours[rule], **{n: theirs[n] for n in names}}
    if server == "lifecycle.leave":
        # The reference's join, reset-world and spec tests leave the world as they finish
        # (JoinLeaveWorld.tearDown, ResetWorld's finally), so a refused LeaveWorld fails them
        # too; ours blames lifecycle.leave alone. Every such difference is that refusal.
        for rule, seen in list(disagreements.items()):
            failures = [v for k, v in seen.items() if k != "ours" and v[0] == "fail"]
            if all("cannot leave" in why for _, why in failures):
                del disagreements[rule]
    assert disagreements == {}
    if server in FAULTS:  # both saw the fault
        broken = "specs.shapes+bounds" if server in ("specs.shapes", "specs.bounds") else server
        assert broken in compared
        assert ours[broken][0] == "fail"
    else:
        assert compared == list(OVERLAP)


class _Given:
    """An address already served, as a context manager."""

    def __init__(self, address: str) -> None:
        self.address = address

    def __enter__(self) -> str:
        return self.address

    def __exit__(self, *exc_info: object) -> None:
        pass
