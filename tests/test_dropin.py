"""Drop-in: client code written for the reference package runs unchanged after switching imports.

Each pattern below is taken from public client code (the Unity-task loaders, the
reference's examples and tests, gym wrappers) and replayed twice in one run: under
the reference ``dm-env-rpc`` 1.1.7 (a test-only peer) and under this SDK, the code
the same and only the modules switched, as ``docs/index.md`` teaches::

    from dm_env_rpc_client import connection as dm_env_rpc_connection
    from dm_env_rpc_client import environment as dm_env_adaptor
    from dm_env_rpc_client import dm_env_rpc_pb2
    from dm_env_rpc_client import errors as error
    from dm_env_rpc_client import tensors as tensor_utils

The results are compared. Where the SDK deliberately differs (the reference is
wrong there), a test pins the difference. The servers are real: the stand-in Unity
player (``unity_player.py``, written on the reference package, local credentials)
in this process, and the SDK's embedded Catch server for properties.
"""

from __future__ import annotations

import os
import pathlib
import select
import signal
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple
from unittest import mock

import dm_env
import grpc
import numpy as np
import pytest
from conftest import process_gone, wait_for
from dm_env_rpc.v1 import connection as ref_connection
from dm_env_rpc.v1 import dm_env_adaptor as ref_adaptor
from dm_env_rpc.v1 import dm_env_rpc_pb2 as ref_pb2
from dm_env_rpc.v1 import error as ref_error
from dm_env_rpc.v1 import tensor_utils as ref_tensor_utils
from dm_env_rpc.v1.extensions import properties as ref_properties
from unity_player import serve_player

import dm_env_rpc_client as dmr
from dm_env_rpc_client import connection as sdk_connection
from dm_env_rpc_client import environment as sdk_adaptor
from dm_env_rpc_client import errors as sdk_error
from dm_env_rpc_client import properties as sdk_properties
from dm_env_rpc_client import tensors as sdk_tensor_utils
from dm_env_rpc_client._transport.foreign import compatible
from dm_env_rpc_client.server import Server


class Package(NamedTuple):
    """The modules client code imports, under one package."""

    connection: Any
    dm_env_adaptor: Any
    dm_env_rpc_pb2: Any
    error: Any
    tensor_utils: Any
    properties: Any


REFERENCE = Package(
    ref_connection, ref_adaptor, ref_pb2, ref_error, ref_tensor_utils, ref_properties
)
SDK = Package(
    sdk_connection, sdk_adaptor, dmr.dm_env_rpc_pb2, sdk_error, sdk_tensor_utils, sdk_properties
)
PACKAGES = {"reference": REFERENCE, "sdk": SDK}

CREATE = {"seed": 7, "episodeId": 0, "levelName": "spot_diff_train"}
JOIN = {"width": 8, "height": 6, "EpisodeLengthSeconds": 0.1}  # 3 to 5 steps an episode
ACTION = {"MOVE_BACK_FORWARD": 1.0, "STRAFE_LEFT_RIGHT": -0.5, "LOOK_LEFT_RIGHT": 0.0}


def both(pattern: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``pattern(package, *args)`` under each package, by package name."""
    return {name: pattern(package, *args) for name, package in PACKAGES.items()}


def plain(value: Any) -> Any:
    """A value made comparable across packages: TimeSteps, dicts and arrays as lists and
    tuples (with dtypes), messages as their bytes."""
    if isinstance(value, dm_env.TimeStep):
        return ("TimeStep", *map(plain, value))
    if isinstance(value, dict):
        return {key: plain(item) for key, item in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return (str(value.dtype), np.shape(value), np.asarray(value).tolist())
    if hasattr(value, "SerializeToString"):
        return (type(value).__name__, value.SerializeToString(deterministic=True))
    return value


def assert_same_results(results: dict[str, Any]) -> None:
    assert plain(results["sdk"]) == plain(results["reference"])


@pytest.fixture
def player() -> Iterator[str]:
    """The stand-in Unity player in this process (local credentials, loopback); its address."""
    server, port = serve_player()
    yield f"localhost:{port}"
    server.stop(grace=None).wait(5)


def local_connection(package: Package, address: str) -> Any:
    """As the Unity loaders connect: a local-credentials channel, then ``Connection(channel)``."""
    channel = grpc.secure_channel(address, grpc.local_channel_credentials())
    grpc.channel_ready_future(channel).result(timeout=10)
    return package.connection.Connection(channel), channel


# --- 1. the start-up probe: DmEnvRpcError means ready, grpc.RpcError means retry ----------


def _can_send_message(package: Package, connection: Any) -> bool:
    """The loaders' probe, as they write it."""
    try:
        connection.send(package.dm_env_rpc_pb2.StepRequest())
    except package.error.DmEnvRpcError:
        return True
    except grpc.RpcError:
        return False
    raise AssertionError("the probe's StepRequest got an answer")


def probe(package: Package, address: str, unavailable: bool) -> Any:
    server, port = serve_player(address, unavailable_streams=1 if unavailable else 0)
    try:
        connection, channel = local_connection(package, f"localhost:{port}")
        ready = _can_send_message(package, connection)
        connection.close()
        channel.close()
        if ready:
            return ready, None
        try:  # what such code reads of the grpc.RpcError: code() and details()
            connection2, channel2 = local_connection(package, f"localhost:{port}")
            connection2.send(package.dm_env_rpc_pb2.StepRequest())
        except grpc.RpcError:
            raise AssertionError("the second stream was refused too") from None
        except package.error.DmEnvRpcError as exc:
            return ready, int(exc.code)
        finally:
            connection2.close()
            channel2.close()
    finally:
        server.stop(grace=None).wait(5)


def unavailable_code(package: Package) -> Any:
    """The grpc.RpcError of a stream the server refuses: its code() and details()."""
    server, port = serve_player("127.0.0.1:0", unavailable_streams=1)
    try:
        connection, channel = local_connection(package, f"localhost:{port}")
        try:
            connection.send(package.dm_env_rpc_pb2.StepRequest())
        except grpc.RpcError as exc:
            return exc.code(), exc.details()  # type: ignore[attr-defined]
        finally:
            connection.close()
            channel.close()
    finally:
        server.stop(grace=None).wait(5)


@pytest.mark.parametrize("unavailable", [False, True], ids=["ready", "unavailable"])
def test_start_up_probe_retries_on_unavailable(unavailable: bool) -> None:
    results = both(probe, "127.0.0.1:0", unavailable)
    assert_same_results(results)
    # Ready: the server's FAILED_PRECONDITION. Unavailable: False (retry), and the retry
    # then gets FAILED_PRECONDITION (9).
    assert results["sdk"] == ((True, None) if not unavailable else (False, 9))


def test_a_refused_stream_is_a_grpc_rpc_error_with_code_and_details() -> None:
    results = both(unavailable_code)
    assert results["sdk"] == results["reference"]
    assert results["sdk"] == (grpc.StatusCode.UNAVAILABLE, "the player is still starting")
    # One exception root still: the SDK's error is a DmEnvRpcClientError too.
    assert issubclass(dmr.ConnectionClosedError, (dmr.DmEnvRpcClientError, grpc.RpcError))


# --- 2. send replaced on the instance: it sees every request -------------------------------


def patched_send(package: Package, address: str) -> Any:
    """The loaders' wrapper: ``connection.send = lambda request: wrap(original_send(request))``."""
    connection, channel = local_connection(package, address)
    seen: list[str] = []
    original_send = connection.send

    def _wrap_send(send: Callable[[], Any]) -> Any:
        try:
            return send()
        except ValueError as e:
            e.args = ["reformatted"]
            raise

    def wrapper(request: Any) -> Any:
        seen.append(type(request).__name__)
        return _wrap_send(lambda: original_send(request))

    connection.send = wrapper
    world_name = connection.send(
        package.dm_env_rpc_pb2.CreateWorldRequest(
            settings={k: package.tensor_utils.pack_tensor(v) for k, v in CREATE.items()}
        )
    ).world_name
    join = {k: package.tensor_utils.pack_tensor(v) for k, v in JOIN.items()}
    specs = connection.send(
        package.dm_env_rpc_pb2.JoinWorldRequest(world_name=world_name, settings=join)
    ).specs
    env = package.dm_env_adaptor.DmEnvAdaptor(connection, specs, ["AvatarPosition", "Score"])
    steps = [env.reset()]
    while not steps[-1].last():
        steps.append(env.step(ACTION))
    steps.append(env.reset())
    env.close()
    connection.close()
    channel.close()
    return seen, steps


def test_a_replaced_send_sees_every_request(player: str) -> None:
    results = both(patched_send, player)
    assert_same_results(results)
    seen, steps = results["sdk"]
    assert seen[:3] == ["CreateWorldRequest", "JoinWorldRequest", "ResetRequest"]
    assert seen.count("StepRequest") == len(steps) and seen[-1] == "LeaveWorldRequest"
    assert [s.step_type for s in steps[:2]] == [dm_env.StepType.FIRST, dm_env.StepType.MID]


def test_a_replaced_send_sees_pipelined_steps_and_a_restored_one_the_fast_path(
    player: str,
) -> None:
    """SDK only: step_async and step_iter go through a replaced send too (one at a time);
    once it is removed, the steps go the fast byte path again."""
    with dmr.connect(player, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, CREATE, JOIN)
        seen: list[str] = []
        original = conn.send
        conn.send = lambda request: seen.append(type(request).__name__) or original(request)  # type: ignore[method-assign]
        env.reset()
        env.step_async(ACTION).result(timeout=10)
        list(env.step_iter([ACTION] * 2, in_flight=2))
        assert seen == ["ResetRequest"] + ["StepRequest"] * 4
        assert type(compatible(conn)).__name__ == "ForeignConnection"
        del conn.send
        assert compatible(conn) is conn
        submit = dmr.Connection._submit_bytes
        with mock.patch.object(
            dmr.Connection, "_submit_bytes", autospec=True, side_effect=submit
        ) as fast:
            env.step(ACTION)
        assert fast.call_count == 1  # the step went as bytes
        assert seen == ["ResetRequest"] + ["StepRequest"] * 4  # and not through the lambda
        env.close()


class _OverridingConnection(dmr.Connection):
    """A subclass that overrides send, as wrappers in the wild do."""

    seen: ClassVar[list[str]] = []

    def send(self, request: Any, timeout: float | None = 60.0, **kwargs: Any) -> Any:
        self.seen.append(type(request).__name__)
        return super().send(request, timeout, **kwargs)


def test_a_subclass_overriding_send_sees_every_request(player: str) -> None:
    channel = grpc.secure_channel(player, grpc.local_channel_credentials())
    conn = _OverridingConnection(channel)
    env, _ = dmr.create_and_join_world(conn, CREATE, JOIN)
    env.reset()
    env.step_async(ACTION).result(timeout=10)
    env.close()
    conn.close()
    channel.close()
    assert _OverridingConnection.seen == [
        "CreateWorldRequest",
        "JoinWorldRequest",
        "ResetRequest",
        "StepRequest",
        "StepRequest",
        "LeaveWorldRequest",
        "DestroyWorldRequest",
    ]


# --- 3. reference names ----------------------------------------------------------------------


def reference_names(package: Package, address: str) -> Any:
    """A module written against the reference's names, defined (annotations evaluated) and run."""
    namespace: dict[str, Any] = {
        "dm_env_rpc_connection": package.connection,
        "dm_env_adaptor": package.dm_env_adaptor,
        "dm_env_rpc_pb2": package.dm_env_rpc_pb2,
        "grpc": grpc,
    }
    exec(
        "def connect(address: str, metadata: dm_env_rpc_connection.Metadata = ()) "
        "-> dm_env_adaptor.dm_env_rpc_connection.Connection:\n"
        "    channel = grpc.secure_channel(address, grpc.local_channel_credentials())\n"
        "    return dm_env_rpc_connection.Connection(channel, metadata)\n",
        namespace,
    )
    connection = namespace["connect"](address, [("x-client", "dropin")])
    world = connection.send(package.dm_env_rpc_pb2.CreateWorldRequest()).world_name
    connection.close()
    return world


def test_reference_names_metadata_and_the_adaptors_connection_module(player: str) -> None:
    results = both(reference_names, player)
    assert results["sdk"] == results["reference"] == "unity_world"


def test_a_public_grpc_module_serves_and_calls_like_the_references() -> None:
    # Servers and tests import dm_env_rpc_pb2_grpc: the SDK's has the same service names.
    grpc_module = dmr.dm_env_rpc_pb2_grpc
    ref_grpc = pytest.importorskip("dm_env_rpc.v1.dm_env_rpc_pb2_grpc")
    names = ("EnvironmentStub", "EnvironmentServicer", "add_EnvironmentServicer_to_server")
    assert all(hasattr(grpc_module, name) and hasattr(ref_grpc, name) for name in names)
    server, port = serve_player()  # a reference servicer, called through the SDK's stub
    try:
        channel = grpc.secure_channel(f"localhost:{port}", grpc.local_channel_credentials())
        stub = grpc_module.EnvironmentStub(channel)
        request = dmr.dm_env_rpc_pb2.EnvironmentRequest(
            create_world=dmr.dm_env_rpc_pb2.CreateWorldRequest()
        )
        (response,) = stub.Process(iter([request]), timeout=10)
        assert response.create_world.world_name == "unity_world"
        channel.close()
    finally:
        server.stop(grace=None).wait(5)


def test_compliance_is_deliberately_not_offered() -> None:
    """The reference's compliance suites test a server, and the switch leaves servers alone:
    ``from dm_env_rpc.v1 import compliance`` stays as it is (tests/test_compliance.py runs
    them against the SDK's server), as docs/index.md says."""
    assert not hasattr(dmr, "compliance")
    with pytest.raises(ImportError):
        exec("from dm_env_rpc_client import compliance", {})


# --- 4. destroying the world after ``with env:`` ---------------------------------------------


def destroy_after_close(package: Package, address: str) -> Any:
    """The reference's examples: create_and_join_world, ``with env:``, then DestroyWorldRequest."""
    connection, channel = local_connection(package, address)
    env, world_name = package.dm_env_adaptor.create_and_join_world(connection, CREATE, JOIN)
    with env:
        steps = [env.reset(), env.step(ACTION)]
    connection.send(package.dm_env_rpc_pb2.DestroyWorldRequest(world_name=world_name))
    try:  # the world is really gone
        connection.send(package.dm_env_rpc_pb2.JoinWorldRequest(world_name=world_name))
    except package.error.DmEnvRpcError as exc:
        gone = int(exc.code)
    connection.close()
    channel.close()
    return steps, gone


def test_destroying_the_world_after_close_works_as_on_the_reference(player: str) -> None:
    results = both(destroy_after_close, player)
    assert_same_results(results)
    assert results["sdk"][1] == 5  # NOT_FOUND: destroyed


def test_a_reference_connection_under_the_sdks_helpers_only_leaves_on_close(player: str) -> None:
    """Over a reference connection, the code around it is the reference's: it destroys the
    world itself, so the SDK's env.close() only leaves, as the reference's does."""
    connection, channel = local_connection(REFERENCE, player)
    env, world_name = dmr.create_and_join_world(connection, CREATE, JOIN)
    env.reset()
    env.close()
    connection.send(ref_pb2.DestroyWorldRequest(world_name=world_name))
    connection.close()
    channel.close()


def test_a_second_destroy_after_close_and_a_new_world_of_the_same_name_reach_the_server(
    player: str,
) -> None:
    with dmr.connect(player, timeout=10) as conn:
        env, world_name = dmr.create_and_join_world(conn, CREATE, JOIN)
        env.close()
        dmr.destroy_world(conn, world_name)  # answered as done: close() destroyed it
        with pytest.raises(dmr.NotFoundError):
            dmr.destroy_world(conn, world_name)
        env, again = dmr.create_and_join_world(conn, CREATE, JOIN)
        assert again == world_name  # the player gives one name: the note is forgotten
        dmr.leave_world(conn)
        dmr.destroy_world(conn, again)  # this one reaches the server and destroys it
        with pytest.raises(dmr.NotFoundError):
            dmr.join_world(conn, again)


# --- 5. subclasses reading the reference's specs attribute ----------------------------------


def subclass(package: Package, address: str) -> Any:
    """dm_construction-style overrides of action_spec and reset reading _dm_env_rpc_specs."""

    class Adaptor(package.dm_env_adaptor.DmEnvAdaptor):  # type: ignore[misc,name-defined]
        def action_spec(self) -> Any:
            names = [spec.name for spec in self._dm_env_rpc_specs.actions.values()]
            full = super().action_spec()
            return {name: full[name] for name in sorted(names)[:2]}

        def reset(self) -> Any:
            self.observation_names = sorted(
                spec.name for spec in self._dm_env_rpc_specs.observations.values()
            )
            return super().reset()

    connection, channel = local_connection(package, address)
    world = package.dm_env_adaptor.create_world(connection, CREATE)
    specs = connection.send(
        package.dm_env_rpc_pb2.JoinWorldRequest(
            world_name=world,
            settings={k: package.tensor_utils.pack_tensor(v) for k, v in JOIN.items()},
        )
    ).specs
    env = Adaptor(connection, specs)
    first = env.reset()
    result = (sorted(env.action_spec()), env.observation_names, first, env._dm_env_rpc_specs)
    env.close()
    connection.close()
    channel.close()
    return result


def test_subclasses_read_the_specs_attribute(player: str) -> None:
    results = both(subclass, player)
    assert_same_results(results)
    assert results["sdk"][0] == ["LOOK_DOWN_UP", "LOOK_LEFT_RIGHT"]


# --- 6. 0.0.0.0 with default credentials ------------------------------------------------------


def any_address(package: Package, port: int) -> Any:
    connection = package.connection.create_secure_channel_and_connect(f"0.0.0.0:{port}", timeout=10)
    world = connection.send(package.dm_env_rpc_pb2.CreateWorldRequest()).world_name
    connection.close()
    return world


def test_the_unspecified_address_connects_with_default_local_credentials(player: str) -> None:
    port = int(player.rsplit(":", 1)[1])
    assert both(any_address, port) == {"reference": "unity_world", "sdk": "unity_world"}


def test_a_remote_host_still_needs_credentials() -> None:
    with pytest.raises(dmr.DmEnvRpcConnectionError, match="Refusing a plaintext connection"):
        dmr.create_secure_channel_and_connect("192.0.2.1:1", timeout=1)


# --- 7. properties, extensions=, a mock connection --------------------------------------------


def properties_and_extensions(package: Package, address: str, adaptor: Any) -> Any:
    """``extensions={...}`` on the adaptor, as the reference's examples pass the properties
    extension; ``adaptor`` is the DmEnvAdaptor module to use (the SDK's over a reference
    connection too)."""
    connection = package.connection.Connection(grpc.insecure_channel(address))
    env, _ = adaptor.create_and_join_world(connection, {"seed": 3}, {})
    props = package.properties.PropertiesExtension(connection)
    extended = adaptor.DmEnvAdaptor(connection, env._dm_env_rpc_specs, extensions={"props": props})
    values = [extended.props["stats.episodes"], extended.props["rows"]]
    extended.props["stats.catch_reward"] = np.float32(2.0)
    values.append(extended.props["stats.catch_reward"])
    extended.close()
    values.append(extended.props)  # released on close
    env.close()
    connection.close()
    return values


def test_extensions_and_properties(catch_server: Server) -> None:
    results = {
        "reference": properties_and_extensions(REFERENCE, catch_server.address, ref_adaptor),
        "sdk": properties_and_extensions(SDK, catch_server.address, sdk_adaptor),
    }
    assert_same_results(results)
    assert results["sdk"][1] == 10 and results["sdk"][2] == 2.0 and results["sdk"][3] is None


def test_env_properties_over_a_reference_connection(catch_server: Server) -> None:
    connection = ref_connection.Connection(grpc.insecure_channel(catch_server.address))
    env, _ = dmr.create_and_join_world(connection, {"seed": 3}, {})
    ref_props = ref_properties.PropertiesExtension(connection)
    assert env.properties["rows"] == ref_props["rows"] == 10
    env.properties["stats.catch_reward"] = 3.0
    assert ref_props["stats.catch_reward"] == 3.0
    assert "stats.episodes" in env.properties
    env.close()
    connection.close()


def test_extensions_properties_takes_the_place_of_env_properties(catch_server: Server) -> None:
    with dmr.connect(catch_server.address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, {}, {})
        props = dmr.PropertiesExtension(conn)
        extended = dmr.DmEnvAdaptor(conn, env._dm_env_rpc_specs, extensions={"properties": props})
        assert extended.properties is props
        with pytest.raises(ValueError, match="already has attribute 'reset'"):
            dmr.DmEnvAdaptor(conn, env._dm_env_rpc_specs, extensions={"reset": props})
        env.close()


_MOCK_SPECS = {
    "actions": {1: ("a", "INT32")},
    "observations": {1: ("x", "FLOAT"), 2: ("reward", "DOUBLE"), 3: ("y", "INT32")},
}


def _specs(package: Package) -> Any:
    pb2 = package.dm_env_rpc_pb2
    specs = pb2.ActionObservationSpecs()
    for kind, entries in _MOCK_SPECS.items():
        for uid, (name, dtype) in entries.items():
            getattr(specs, kind)[uid].name = name
            getattr(specs, kind)[uid].dtype = pb2.DataType.Value(dtype)
    return specs


def mocked(package: Package) -> Any:
    """The reference's own adaptor tests: a MagicMock connection, send.assert_called_once_with."""
    pb2, pack = package.dm_env_rpc_pb2, package.tensor_utils.pack_tensor
    connection = mock.MagicMock()
    env = package.dm_env_adaptor.DmEnvAdaptor(connection, _specs(package))
    running = pb2.StepResponse(
        state=pb2.EnvironmentStateType.RUNNING,
        observations={1: pack(np.float32(0.5)), 2: pack(1.5), 3: pack(np.int32(4))},
    )
    connection.send = mock.MagicMock(
        side_effect=[pb2.ResetResponse(specs=_specs(package)), running]
    )
    first = env.reset()
    assert connection.send.call_args_list == [
        mock.call(pb2.ResetRequest()),
        mock.call(pb2.StepRequest(requested_observations=[1, 2, 3])),
    ]
    connection.send = mock.MagicMock(return_value=running)
    mid = env.step({"a": 3})
    connection.send.assert_called_once_with(
        pb2.StepRequest(requested_observations=[1, 2, 3], actions={1: pack(np.int32(3))})
    )
    connection.send = mock.MagicMock(return_value=pb2.LeaveWorldResponse())
    env.close()
    connection.send.assert_called_once_with(pb2.LeaveWorldRequest())
    return first, mid


def test_a_mock_connection_sees_the_references_requests() -> None:
    results = both(mocked)
    assert_same_results(results)
    assert results["sdk"][1].reward == 1.5


# --- 8. error.code: the reference's int and grpc.StatusCode -----------------------------------


def error_code(package: Package, address: str) -> Any:
    connection, channel = local_connection(package, address)
    try:
        connection.send(package.dm_env_rpc_pb2.StepRequest())
    except package.error.DmEnvRpcError as e:
        result = (e.code == 9, e.code != 9, int(e.code), e.message, isinstance(e.code, int))
    connection.close()
    channel.close()
    return result


def test_error_code_equals_the_references_int(player: str) -> None:
    results = both(error_code, player)
    assert results["sdk"] == results["reference"] == (True, False, 9, "no world is joined", True)


def test_error_code_also_equals_the_grpc_status_code() -> None:
    code = dmr.ErrorCode(grpc.StatusCode.FAILED_PRECONDITION)
    assert (
        code == grpc.StatusCode.FAILED_PRECONDITION and grpc.StatusCode.FAILED_PRECONDITION == code  # noqa: SIM300 (the reflected side)
    )
    assert code != grpc.StatusCode.NOT_FOUND and code != 5 and code == 9
    assert (code.name, code.value, code(), code.status) == (
        "FAILED_PRECONDITION",
        (9, "failed precondition"),
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    # Deliberate: it hashes as the grpc.StatusCode (it cannot as both), and `is` never holds.
    assert code in {grpc.StatusCode.FAILED_PRECONDITION} and code not in {9}
    assert code is not grpc.StatusCode.FAILED_PRECONDITION
    assert dmr.ErrorCode(9) == code
    with pytest.raises(dmr.ArgumentTypeError, match=r"ErrorCode takes a grpc.StatusCode or its"):
        dmr.ErrorCode("FAILED_PRECONDITION")  # type: ignore[arg-type]


# --- where the SDK deliberately differs ---------------------------------------------------------


def test_differences_pinned_a_closed_connection_and_auto_observations(player: str) -> None:
    """The reference raises ValueError for a send after close(); the SDK raises
    ConnectionClosedError (a ConnectionError and a grpc.RpcError): catch that instead.
    The SDK takes no AutoObservations flags: pass a list of names, or None."""
    results = {}
    for name, package in PACKAGES.items():
        connection, channel = local_connection(package, player)
        connection.close()
        try:
            connection.send(package.dm_env_rpc_pb2.StepRequest())
        except Exception as exc:
            results[name] = exc
        channel.close()
    assert type(results["reference"]) is ValueError
    assert isinstance(results["sdk"], dmr.ConnectionClosedError)
    assert isinstance(results["sdk"], grpc.RpcError) and not isinstance(results["sdk"], ValueError)
    assert not hasattr(sdk_adaptor, "AutoObservations")


# --- the real loader: dm-memorytasks 1.0.3, its five import lines switched -------------------

# The five lines, as docs/index.md teaches them.
SWITCH = {
    "from dm_env_rpc.v1 import connection as dm_env_rpc_connection": (
        "from dm_env_rpc_client import connection as dm_env_rpc_connection"
    ),
    "from dm_env_rpc.v1 import dm_env_adaptor": (
        "from dm_env_rpc_client import environment as dm_env_adaptor"
    ),
    "from dm_env_rpc.v1 import dm_env_rpc_pb2": "from dm_env_rpc_client import dm_env_rpc_pb2",
    "from dm_env_rpc.v1 import error": "from dm_env_rpc_client import errors as error",
    "from dm_env_rpc.v1 import tensor_utils": "from dm_env_rpc_client import tensors as tensor_utils",
}
_NO_LOADER = (
    "needs the dm-memorytasks 1.0.3 loader, a test-only peer installed without its "
    "dependencies (it pins dm-env-rpc<1.1.0): pip install --no-deps dm-memorytasks==1.0.3 "
    "(the README's test command does)"
)


def loaders() -> dict[str, types.ModuleType]:
    """The loader as published (on the reference package) and with its imports switched."""
    try:
        from dm_memorytasks import _load_environment as published
    except ImportError as exc:  # the loader, or what it imports (docker, portpicker)
        pytest.skip(f"{_NO_LOADER} ({exc})")
    assert published.__file__ is not None
    with open(published.__file__, encoding="utf-8") as source_file:
        source = source_file.read()
    for old, new in SWITCH.items():
        assert source.count(old + "\n") == 1, old  # whole lines, each once
        source = source.replace(old + "\n", new + "\n")
    assert "dm_env_rpc.v1" not in source
    switched = types.ModuleType("dm_memorytasks_switched")
    switched.__file__ = published.__file__
    exec(compile(source, published.__file__ + " (imports switched)", "exec"), switched.__dict__)
    return {"reference": published, "sdk": switched}


@pytest.fixture
def player_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A folder as load_from_disk wants it: an executable Linux64Player (the stand-in) and
    the OSMesa library it checks for (empty: the stand-in renders nothing)."""
    player = tmp_path / "Linux64Player"
    script = pathlib.Path(__file__).with_name("unity_player.py")
    player.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    player.chmod(0o755)
    (tmp_path / "external_libosmesa_llvmpipe.so").write_bytes(b"")
    # The loader sets these in os.environ; monkeypatch puts them back afterwards.
    monkeypatch.setenv("UNITY_RENDERER", "")
    monkeypatch.setenv("UNITY_OSMESA_PATH", "")
    # Its one NumPy 2 incompatibility (np.product, removed in NumPy 2.0), not the SDK's: its
    # step() computes the discount with it. Patched here only, to the function it named.
    monkeypatch.setattr(np, "product", np.prod, raising=False)
    return tmp_path


def _play(
    loader: types.ModuleType, path: Any, log: Any, repeats: int, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """Four episodes through ``load_from_disk``: the TimeSteps, the requests the player saw,
    and whether close() ended it. With one action repeat, the first stream is refused."""
    log.write_text("")
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setenv("STAND_IN_UNAVAILABLE_STREAMS", "1" if repeats == 1 else "0")
    settings = loader.EnvironmentSettings(
        seed=11,
        level_name="spot_diff_train",
        width=12,
        height=9,
        episode_length_seconds=0.2,  # 6 to 8 steps: with 3 repeats, ends at every position
        num_action_repeats=repeats,
    )
    env = loader.load_from_disk(str(path), settings)
    process = env._process
    episodes = []
    try:
        for episode in range(4):
            steps = [env.reset()]
            while not steps[-1].last():
                move = 1.0 if (len(steps) + episode) % 2 else 0.25
                steps.append(env.step({"MOVE_BACK_FORWARD": move, "LOOK_LEFT_RIGHT": -0.5}))
            episodes.append(steps)
    finally:
        env.close()
    ended = process.poll() is not None  # close() waited for it
    return episodes, log.read_text().split(), ended


def _check_episodes(episodes: list[list[dm_env.TimeStep]]) -> None:
    """Each episode starts FIRST (reward and discount None), ends LAST, is MID between."""
    assert len(episodes) == 4
    for steps in episodes:
        kinds = [step.step_type for step in steps]
        assert kinds[0] == dm_env.StepType.FIRST and kinds[-1] == dm_env.StepType.LAST
        assert set(kinds[1:-1]) <= {dm_env.StepType.MID}
        assert steps[0].reward is None and steps[0].discount is None
        assert steps[0].observation["RGB_INTERLEAVED"].shape == (9, 12, 3)
    assert sum(step.reward for steps in episodes for step in steps[1:]) > 0


def _server_steps(episodes: int) -> int:
    """The steps the player takes: the probe's, then per episode a first step and its
    length, 6 + episode % 3 (unity_player.py)."""
    return 1 + sum(1 + 6 + index % 3 for index in range(episodes))


def test_the_unity_loader_runs_unchanged_after_switching_its_imports(
    player_dir: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = {
        name: _play(loader, player_dir, tmp_path / f"{name}.log", 1, monkeypatch)
        for name, loader in loaders().items()
    }
    assert_same_results(results)  # TimeSteps, requests seen, player ended: all identical
    episodes, requests, ended = results["sdk"]
    assert ended  # close() ended the player
    # The first stream was refused (UNAVAILABLE): the probe retried on a new one.
    assert requests[:4] == ["refused", "step", "create_world", "join_world"]
    assert requests[-1] == "leave_world" and requests.count("reset") == 4
    assert requests.count("step") == _server_steps(4)
    _check_episodes(episodes)


def test_with_action_repeats_every_episode_starts_first_and_ends_last(
    player_dir: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deliberate difference. The reference's reset() takes its first step with
    ``self.step({})``, the loader's override that repeats it: so on the reference every
    episode starts with MID (three steps summed). The SDK's reset() takes one step of its
    own, FIRST; the loader's step() then repeats as it did."""
    results = {
        name: _play(loader, player_dir, tmp_path / f"{name}.log", 3, monkeypatch)
        for name, loader in loaders().items()
    }
    episodes, requests, ended = results["sdk"]
    assert ended
    _check_episodes(episodes)
    assert requests.count("step") == _server_steps(4)  # ends within repeats cut them short
    assert [len(steps) for steps in episodes] == [1 + -(-(6 + i % 3) // 3) for i in range(4)]
    reference_episodes = results["reference"][0]
    assert {steps[0].step_type for steps in reference_episodes} == {dm_env.StepType.MID}
    assert all(steps[-1].last() for steps in reference_episodes)


# The loader in a process of its own: it starts the player (its subprocess.Popen), connects
# through the SDK (imports switched), prints the player's pid, then waits to be killed.
_LOADER_PROCESS = """
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_dropin
np.product = np.prod  # the loader's NumPy 2 incompatibility (the player_dir fixture says why)
loader = test_dropin.loaders()["sdk"]
settings = loader.EnvironmentSettings(
    seed=11, level_name="spot_diff_train", width=12, height=9, episode_length_seconds=0.2
)
env = loader.load_from_disk(sys.argv[2], settings)
env.reset()
print(env._process.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_the_player_does_not_outlive_a_sigkilled_loader(player_dir: Any) -> None:
    """The project's rule for every process started on the SDK's behalf: the process that
    started the player (the loader's, on the SDK) is SIGKILLed, so no close() runs; the
    player must exit on its own, within a deadline."""
    loaders()  # skips here, not in the child, without the loader
    tests = str(pathlib.Path(__file__).parent)
    process = subprocess.Popen(
        [sys.executable, "-c", _LOADER_PROCESS, tests, str(player_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "the loader did not start the player within 60 s"
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.strip().isdigit(), f"the loader failed: {line!r} {process.stderr.read()!r}"
        player = int(line)
        assert not process_gone(player)  # serving: the loader's reset() was answered
        process.kill()
        process.wait(timeout=10)
        assert wait_for(lambda: process_gone(player), timeout=10), (
            f"the player (pid {player}) outlived the SIGKILLed loader"
        )
    finally:
        process.kill()
        process.wait()
        if "player" in locals() and not process_gone(player):
            os.kill(player, signal.SIGKILL)
