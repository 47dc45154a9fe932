"""dm_env_rpc_client: a fast, dependable client SDK for dm_env_rpc environments.

::

    import dm_env_rpc_client as dmr

    with dmr.connect("127.0.0.1:50051", timeout=10) as conn:
        env, world_name = dmr.create_and_join_world(conn, {}, {})
        timestep = env.reset()

See the guide in ``docs/`` for tensors, connections, environments, batching,
the command line and the embedded server.
"""

# First: loads grpc with its INFO lines off, unless GRPC_VERBOSITY is set (see _base.quiet).
from ._base import quiet as _quiet  # noqa: F401 (imported for what importing it does)
from ._batch.options import ConnectionOptions, FailurePolicy
from ._batch.restart import RestartPolicy, WorldFailure
from ._proto import dm_env_rpc_pb2, dm_env_rpc_pb2_grpc, properties_pb2
from ._transport.foreign import ForeignConnection
from .aio import AsyncConnection, connect_async
from .aio_environment import (
    AsyncDmEnvAdaptor,
    create_and_join_world_async,
    create_world_async,
    destroy_world_async,
    join_world_async,
    leave_world_async,
    reset_world_async,
)
from .batched import BatchedEnvironment, BatchedTimeStep
from .cli import main as cli_main
from .conformance import ConformanceReport, check_server
from .connection import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    FAST_KEEPALIVE_DETECTION_S,
    FAST_KEEPALIVE_OPTIONS,
    KEEPALIVE_DETECTION_S,
    TOKEN_ENV,
    Connection,
    ConnectionLike,
    ConnectionType,
    Metadata,
    connect,
    create_secure_channel_and_connect,
    token_metadata,
)
from .display import show
from .environment import (
    CreateAndJoinResult,
    DmEnvAdaptor,
    create_and_join_world,
    create_world,
    destroy_world,
    join_world,
    leave_world,
    reset_world,
)
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    AuthenticationError,
    BoundsError,
    ConnectionClosedError,
    ConnectRefusedError,
    ConnectTimeoutError,
    DmEnvRpcClientError,
    DmEnvRpcConnectionError,
    DmEnvRpcError,
    DuplicateNameError,
    EmptyTensorError,
    ErrorCode,
    IntegerRangeError,
    InvalidArgumentError,
    NotFoundError,
    ObservationError,
    PermissionDeniedError,
    ProtocolError,
    RaggedArrayError,
    RecordingError,
    RequestTimeoutError,
    ResponseTooLargeError,
    ServerLaunchError,
    ShapeError,
    SpecError,
    SpecValidationError,
    TensorError,
    TensorTypeError,
    TensorValueError,
    UnknownNameError,
    UnknownUidError,
    UnsupportedDtypeError,
    WorldError,
    WorldTimeoutError,
)
from .launch import LaunchedServer, LaunchedServers, Relaunch, RelaunchPolicy, launch
from .multiagent import MultiAgentBatch, MultiAgentWorld
from .multiagent_recording import MultiAgentRecording, iter_agent_episodes
from .properties import PropertiesExtension, PropertySpec
from .random_actions import random_action, random_batch
from .recording import Episode, EpisodeRecorder, Recording, iter_episodes, load_episode
from .server import Property, Server, serve
from .specs import (
    Bounds,
    SpecManager,
    bounds,
    dm_env_spec_to_tensor_spec,
    set_bounds,
    tensor_spec_to_dm_env_spec,
)
from .stepping import RunEvent, RunObserver, RunStats, collect
from .tensors import (
    DATA_TYPE_TO_NUMPY,
    NUMPY_TO_DATA_TYPE,
    DataType,
    data_type_to_np_type,
    get_tensor_type,
    np_type_to_data_type,
    pack_tensor,
    unpack_tensor,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "AsyncConnection",
    "AsyncDmEnvAdaptor",
    "AuthenticationError",
    "BatchedEnvironment",
    "BatchedTimeStep",
    "Bounds",
    "BoundsError",
    "ConformanceReport",
    "ConnectRefusedError",
    "ConnectTimeoutError",
    "Connection",
    "ConnectionClosedError",
    "ConnectionLike",
    "ConnectionOptions",
    "ConnectionType",
    "CreateAndJoinResult",
    "DATA_TYPE_TO_NUMPY",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DataType",
    "DmEnvAdaptor",
    "DmEnvRpcClientError",
    "DmEnvRpcConnectionError",
    "DmEnvRpcError",
    "DuplicateNameError",
    "EmptyTensorError",
    "Episode",
    "EpisodeRecorder",
    "ErrorCode",
    "FAST_KEEPALIVE_DETECTION_S",
    "FAST_KEEPALIVE_OPTIONS",
    "FailurePolicy",
    "ForeignConnection",
    "IntegerRangeError",
    "InvalidArgumentError",
    "KEEPALIVE_DETECTION_S",
    "LaunchedServer",
    "LaunchedServers",
    "Metadata",
    "MultiAgentBatch",
    "MultiAgentRecording",
    "MultiAgentWorld",
    "NUMPY_TO_DATA_TYPE",
    "NotFoundError",
    "ObservationError",
    "PermissionDeniedError",
    "PropertiesExtension",
    "Property",
    "PropertySpec",
    "ProtocolError",
    "RaggedArrayError",
    "Recording",
    "RecordingError",
    "Relaunch",
    "RelaunchPolicy",
    "RequestTimeoutError",
    "ResponseTooLargeError",
    "RestartPolicy",
    "RunEvent",
    "RunObserver",
    "RunStats",
    "Server",
    "ServerLaunchError",
    "ShapeError",
    "SpecError",
    "SpecManager",
    "SpecValidationError",
    "TOKEN_ENV",
    "TensorError",
    "TensorTypeError",
    "TensorValueError",
    "UnknownNameError",
    "UnknownUidError",
    "UnsupportedDtypeError",
    "WorldError",
    "WorldFailure",
    "WorldTimeoutError",
    "bounds",
    "check_server",
    "cli_main",
    "collect",
    "connect",
    "connect_async",
    "create_and_join_world",
    "create_and_join_world_async",
    "create_secure_channel_and_connect",
    "create_world",
    "create_world_async",
    "data_type_to_np_type",
    "destroy_world",
    "destroy_world_async",
    "dm_env_rpc_pb2",
    "dm_env_rpc_pb2_grpc",
    "dm_env_spec_to_tensor_spec",
    "get_tensor_type",
    "iter_agent_episodes",
    "iter_episodes",
    "join_world",
    "join_world_async",
    "launch",
    "leave_world",
    "leave_world_async",
    "load_episode",
    "np_type_to_data_type",
    "pack_tensor",
    "properties_pb2",
    "random_action",
    "random_batch",
    "reset_world",
    "reset_world_async",
    "serve",
    "set_bounds",
    "show",
    "tensor_spec_to_dm_env_spec",
    "token_metadata",
    "unpack_tensor",
]
