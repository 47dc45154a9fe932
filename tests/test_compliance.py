"""The reference package's compliance suites, run against the embedded server (test-only peer)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_rpc_pb2 as ref_pb2
from dm_env_rpc.v1 import tensor_utils
from dm_env_rpc.v1.compliance import create_destroy_world, join_leave_world, reset, reset_world
from dm_env_rpc.v1.compliance import step as step_compliance

from dm_env_rpc_client.server import serve
from dm_env_rpc_client.server.catch import Catch

_server: Any = None


@pytest.fixture(scope="module", autouse=True)
def _module_server() -> Iterator[None]:
    global _server
    with serve(lambda settings: Catch(**settings)) as _server:
        yield


class _Connected:
    """Opens a reference Connection to the module's server for each test."""

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self._channel = grpc.insecure_channel(_server.address)
        self._connection = reference_connection.Connection(self._channel)

    def tearDown(self) -> None:
        super().tearDown()  # type: ignore[misc]
        self._connection.close()

    @property
    def connection(self) -> Any:
        return self._connection


class TestCreateDestroyWorld(_Connected, create_destroy_world.CreateDestroyWorld):
    @property
    def required_world_settings(self) -> dict[str, Any]:
        return {}

    @property
    def invalid_world_settings(self) -> dict[str, Any]:
        return {
            "rows": tensor_utils.pack_tensor(1),
            "columns": tensor_utils.pack_tensor("wide"),
            "nonsense": tensor_utils.pack_tensor(3),
        }

    @property
    def has_multiple_world_support(self) -> bool:
        return True


class _WithWorld(_Connected):
    def setUp(self) -> None:
        super().setUp()
        response = self.connection.send(ref_pb2.CreateWorldRequest())
        self._world_name = response.world_name

    def tearDown(self) -> None:
        self.connection.send(ref_pb2.LeaveWorldRequest())
        self.connection.send(ref_pb2.DestroyWorldRequest(world_name=self._world_name))
        super().tearDown()

    @property
    def world_name(self) -> str:
        return self._world_name


class TestJoinLeaveWorld(_WithWorld, join_leave_world.JoinLeaveWorld):
    @property
    def invalid_join_settings(self) -> dict[str, Any]:
        return {"team": tensor_utils.pack_tensor(1)}


class TestReset(_WithWorld, reset.Reset):
    def join_world(self) -> Any:
        return self.connection.send(ref_pb2.JoinWorldRequest(world_name=self.world_name)).specs


class TestResetWorld(_WithWorld, reset_world.ResetWorld):
    pass


class TestStep(_WithWorld, step_compliance.Step):
    def setUp(self) -> None:
        super().setUp()
        response = self.connection.send(ref_pb2.JoinWorldRequest(world_name=self.world_name))
        self._specs = response.specs

    @property
    def specs(self) -> Any:
        return self._specs
