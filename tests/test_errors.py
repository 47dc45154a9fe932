"""The exception tree: built-in bases, status mapping, pickling."""

from __future__ import annotations

import pickle

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import status_pb2

from dm_env_rpc_client import errors


def _status(code: grpc.StatusCode, message: str = "boom") -> status_pb2.Status:
    detail = any_pb2.Any(type_url="type.googleapis.com/x.Y", value=b"\x08\x01")
    return status_pb2.Status(code=code.value[0], message=message, details=[detail])


def _sdk_type(error: BaseException) -> type:
    """The SDK class of an error (not the subclass that also derives from the reference's)."""
    return getattr(type(error), "_sdk_class", type(error))


@pytest.mark.parametrize(
    ("code", "cls", "builtin"),
    [
        (grpc.StatusCode.NOT_FOUND, errors.NotFoundError, KeyError),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDeniedError, PermissionError),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError, ValueError),
        (grpc.StatusCode.INTERNAL, errors.DmEnvRpcError, errors.DmEnvRpcClientError),
    ],
)
def test_from_status_picks_the_specific_class(
    code: grpc.StatusCode, cls: type, builtin: type
) -> None:
    error = errors.DmEnvRpcError.from_status(_status(code, "no such key 'a.b'"))
    assert _sdk_type(error) is cls
    assert isinstance(error, builtin)
    assert isinstance(error, errors.DmEnvRpcError)
    # An ErrorCode: equal to the grpc.StatusCode and to the reference's int (issue 24).
    assert error.code == code and error.code == code.value[0] and code == error.code
    assert str(error) == f"{code.name}: no such key 'a.b'"
    assert error.details[0].type_url == "type.googleapis.com/x.Y"


def test_server_errors_pickle_with_code_message_and_details() -> None:
    error = errors.DmEnvRpcError.from_status(_status(grpc.StatusCode.NOT_FOUND))
    clone = pickle.loads(pickle.dumps(error))
    assert _sdk_type(clone) is errors.NotFoundError
    assert (clone.code, clone.message) == (grpc.StatusCode.NOT_FOUND, "boom")
    assert clone.details == error.details


def test_unknown_numeric_code_maps_to_unknown() -> None:
    error = errors.DmEnvRpcError(12345, "odd")
    assert error.code == grpc.StatusCode.UNKNOWN and error.code == 2


def test_transport_and_world_errors_pickle() -> None:
    closed = errors.ConnectionClosedError("gone", grpc.StatusCode.UNAVAILABLE, "socket closed")
    clone = pickle.loads(pickle.dumps(closed))
    assert isinstance(clone, ConnectionError)
    assert (clone.code, clone.details, str(clone)) == (
        grpc.StatusCode.UNAVAILABLE,
        "socket closed",
        "gone",
    )
    world = pickle.loads(pickle.dumps(errors.WorldError("world 2 died", 2, "127.0.0.1:1")))
    assert (world.index, world.address, str(world)) == (2, "127.0.0.1:1", "world 2 died")


def test_builtin_bases() -> None:
    assert issubclass(errors.ConnectTimeoutError, TimeoutError)
    assert issubclass(errors.RequestTimeoutError, TimeoutError)
    assert issubclass(errors.UnsupportedDtypeError, TypeError)
    assert issubclass(errors.RaggedArrayError, ValueError)
    assert issubclass(errors.UnknownNameError, ValueError)
    for name in dir(errors):
        obj = getattr(errors, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, Exception)
            and obj.__module__ == errors.__name__
        ):
            assert issubclass(obj, errors.DmEnvRpcClientError), name
            assert name in errors.__doc__, f"{name} is missing from the tree in the docstring"
