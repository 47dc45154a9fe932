"""Opening a batch for ``BatchedEnvironment.connect``: one loop, streams, worlds, the watchdog.

Every world gets its own stream on one background event loop; streams to the
same address share one channel. ``open_worlds`` opens the streams and creates
(or joins) the worlds all at once on the loop, up to ``OPENING_PER_SERVER`` at a
time per server, so connecting takes about as long as the slowest server needs
for its share, not one round trip per world after another. Worlds whose specs
are alike share one adaptor's spec machinery (``_adaptor_like``). Before
anything is opened, ``check_descriptors`` makes sure the process may open a
connection to every server. All or nothing: on any failure everything opened so
far is shut down before the error is raised.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from .. import errors, messages, tensors
from .._adaptor.core import pack_settings
from .._adaptor.stacked import StackedDecoder
from .._base import checks as _checks
from .._base import collector
from .._fastpath.step_encoder import StepEncoder
from .._proto import dm_env_rpc_pb2
from .._transport.loop import LoopConnection, LoopThread
from ..aio import AsyncConnection
from ..connection import _REQUEST_TIMEOUT, create_channel
from ..environment import DmEnvAdaptor
from ..launch import LaunchedServers
from . import restart as _restart
from .balance import Balancer
from .closing import shut_down
from .core import _NAMES_COUNT, _SEED_TWICE, _WORLD_FAILED, BatchCore
from .restart import RestartPolicy

try:
    import resource
except ImportError:  # not on Windows: no descriptor limit to check there
    resource = None  # type: ignore[assignment]

Batch = TypeVar("Batch", bound=BatchCore)
_NO_ADDRESS = "addresses is empty: give at least one server address, e.g. ['127.0.0.1:50051']."
OPENING_PER_SERVER = 64  # worlds being opened at once on one server
# File descriptors a connection to one server takes (its socket), and what gRPC and the
# loop need besides (epoll, wake-up pipes, a restart's new connection).
DESCRIPTORS_PER_SERVER = 1
DESCRIPTORS_SPARE = 32
# gRPC's retry machinery keeps state per stream (about 6 KB of a world's 45 at 1,024 worlds); a
# batch never has gRPC retry a stream (its own restart policy deals with a broken world).
_NO_RETRIES = ("grpc.enable_retries", 0)
_TOO_MANY_SERVERS = (
    "Connecting to {servers} servers needs about {needed} file descriptors (one connection "
    "each, and {spare} spare; {open} are open already), but this process may open only "
    "{limit} (RLIMIT_NOFILE; the hard limit is {hard}). Raise it before connecting: "
    "`ulimit -n {suggest}` in the shell, or resource.setrlimit(resource.RLIMIT_NOFILE, "
    "({suggest}, hard)) in Python; or use fewer servers per client."
)
_STREAM_LIMIT = (
    "{error} ({answered} other streams to {address} were answered, so the server is up: it "
    "likely serves at most that many streams at once, one per world; a sync gRPC server as "
    "many as its thread pool's max_workers, the SDK's server its --max-workers. Start it with "
    "room for {wanted} streams, or spread the worlds over more servers.)"
)
_SEED_REFUSED = (
    "The server at {address} refused the create setting {name!r} ({error}); the worlds are "
    "created without it, so only what the client draws is seeded. Pass seed_setting= with "
    "the name the server takes, or seed_setting=None to silence this."
)
_ONE_NAME = (
    "requested_observations takes a list of observation names, not the string {name!r}: "
    "pass [{name!r}]."
)


def open_batch(
    cls: type[Batch],
    addresses: str | Sequence[str] | LaunchedServers,
    num_envs: int | None,
    *,
    create_world_settings: Mapping[str, Any] | None,
    join_world_settings: Mapping[str, Any] | None,
    requested_observations: Sequence[str] | None,
    timeout: float | None,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]] | None,
    insecure: bool,
    metadata: Sequence[tuple[str, str]] | None,
    seed: int | None,
    seed_setting: str | None,
    world_names: Sequence[str] | None,
    on_world_failure: str,
    step_timeout: float | None,
    restart: RestartPolicy | None,
    wait_for_ready: bool = False,
) -> Batch:
    """``BatchedEnvironment.connect`` (its arguments and errors are documented there)."""
    _restart.check_policy(on_world_failure)
    if isinstance(requested_observations, str):
        raise ValueError(_ONE_NAME.format(name=requested_observations))
    requested = None if requested_observations is None else tuple(requested_observations)
    servers = addresses if isinstance(addresses, LaunchedServers) else None
    if isinstance(addresses, LaunchedServers):
        addresses = addresses.addresses
    elif isinstance(addresses, str):
        addresses = [addresses]
    for address in addresses:
        _checks.check_address(address, "addresses")
    if num_envs is not None:
        _checks.check_count(num_envs, "num_envs")
    _checks.check_seconds(timeout)
    _checks.check_settings(create_world_settings, "create_world_settings")
    _checks.check_settings(join_world_settings, "join_world_settings")
    if restart is not None:
        _checks.check_count(restart.attempts, "RestartPolicy.attempts")
        for field in ("total", "connect_timeout", "call_timeout"):
            _checks.check_seconds(getattr(restart, field), f"RestartPolicy.{field}")
    count = len(addresses) if num_envs is None else num_envs
    if world_names is not None:
        count = len(world_names) if num_envs is None else count
        if len(world_names) != count:
            raise ValueError(_NAMES_COUNT.format(names=len(world_names), count=count))
    if not addresses or count < 1:
        raise errors.ArgumentValueError(_NO_ADDRESS)
    if seed is not None and world_names is None and seed_setting is not None:
        if seed_setting in (create_world_settings or {}):
            raise ValueError(_SEED_TWICE.format(name=seed_setting))
    else:
        seed_setting = None
    check_descriptors(addresses)  # before gRPC or the loop open any (gRPC aborts without them)
    runner, channels, open_stream = start_loop(
        "dm_env_rpc_client-batched",
        timeout=timeout,
        credentials=credentials,
        options=options,
        insecure=insecure,
        metadata=metadata,
        wait_for_ready=wait_for_ready,
    )
    connections: list[LoopConnection] = []
    try:
        with collector.paused():  # its collections would scan every world's objects, in vain
            opened = open_worlds(
                runner,
                open_stream,
                connections,
                addresses,
                count,
                (create_world_settings, join_world_settings, world_names, requested),
                timeout,
                seed,
                seed_setting,
            )
    except BaseException:
        shut_down(runner, connections, channels)
        raise
    envs, used, recipes, seeds = opened
    batch = cls(envs, used, connections=connections)
    batch.world_seeds = seeds
    if seed is not None:
        batch._actions_rng = np.random.default_rng(seed)
    equip(batch, runner, channels, connections, open_stream)
    batch._policy = on_world_failure
    batch._restart_policy = restart or RestartPolicy()
    batch._step_timeout = step_timeout
    batch._recipes = recipes
    if servers is not None:
        batch.servers, batch.relaunches = servers, servers.relaunches
    if on_world_failure == _restart.RESTART:
        batch._balancer = Balancer(batch)
        batch.moves = batch._balancer.moves
    if step_timeout is not None:
        runner.call(batch._watch)
    return batch


def start_loop(
    name: str, **opener: Any
) -> tuple[LoopThread, dict[str, grpc.aio.Channel], Callable[..., Coroutine[Any, Any, Any]]]:
    """A batch's background loop (thread ``name``), its channels by address (none yet), and its
    ``open_stream`` (``stream_opener``'s, with ``opener``'s keywords)."""
    runner = LoopThread(name=name)
    channels: dict[str, grpc.aio.Channel] = {}
    return runner, channels, stream_opener(runner, channels, **opener)


def stream_opener(
    runner: LoopThread,
    channels: dict[str, grpc.aio.Channel],
    *,
    timeout: float | None,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]] | None,
    insecure: bool,
    metadata: Sequence[tuple[str, str]] | None,
    wait_for_ready: bool,
) -> Callable[..., Coroutine[Any, Any, LoopConnection]]:
    """The batch's ``open_stream(address, wait=timeout, *, first=False)``: a stream on ``runner``'s
    loop, over one channel per address (made on first use, kept in ``channels``); a world's first
    (``first``) fails at once on a refusing port unless ``wait_for_ready``; a restart's waits for
    its server to come back. gRPC never retries a batch's streams (``_NO_RETRIES``)."""
    batch_options = list(options or ())
    if not any(name == _NO_RETRIES[0] for name, _ in batch_options):
        batch_options.insert(0, _NO_RETRIES)

    async def open_stream(
        address: str, wait: float | None = timeout, *, first: bool = False
    ) -> LoopConnection:
        channel = channels.get(address)
        if channel is None:
            channel = channels[address] = create_channel(
                address, credentials=credentials, options=batch_options, insecure=insecure, aio=True
            )
        if channel.get_state() == grpc.ChannelConnectivity.READY:  # no wait for each stream
            connection = await AsyncConnection.open(channel, metadata)
            connection.address = address
            return LoopConnection(runner, connection)
        return await LoopConnection.open(
            runner,
            address,
            channel=channel,
            timeout=wait,
            metadata=metadata,
            wait_for_ready=wait_for_ready or not first,
        )

    return open_stream


def equip(
    batch: BatchCore,
    runner: LoopThread,
    channels: dict[str, grpc.aio.Channel],
    connections: Sequence[LoopConnection],
    open_stream: Callable[..., Any],
) -> None:
    """Puts a batch made of opened worlds on its loop: streams, the shared writer pool, and the
    batch-at-once encoder and decoder when every world's specs are alike."""
    envs = batch.envs
    batch._runner, batch._channels = runner, channels
    batch._streams = [conn.async_connection for conn in connections]
    for stream in batch._streams:  # one pool of writer tasks for all (_transport.writers)
        stream._pool = batch._writers
    batch._joined_specs = [env._wire_specs for env in envs]
    if all(specs == batch._joined_specs[0] for specs in batch._joined_specs):
        batch._decoder = StackedDecoder(envs[0])
        batch._encoder = StepEncoder(envs[0])
    batch._open_stream = open_stream


def check_descriptors(addresses: Sequence[str]) -> None:
    """Raises ``DmEnvRpcConnectionError`` if the process may not open a connection per server.

    Streams to one server share its connection, so the worlds do not count,
    only the distinct servers. Checked where the limit can be read (Unix).
    """
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        already = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS): count none open
        already = 0
    servers = len(set(addresses))
    needed = servers * DESCRIPTORS_PER_SERVER + DESCRIPTORS_SPARE
    if already + needed > soft:
        suggest = already + needed if hard == resource.RLIM_INFINITY else hard
        raise errors.DmEnvRpcConnectionError(
            _TOO_MANY_SERVERS.format(
                servers=servers,
                needed=needed,
                spare=DESCRIPTORS_SPARE,
                open=already,
                limit=soft,
                hard="unlimited" if hard == resource.RLIM_INFINITY else hard,
                suggest=max(suggest, already + needed),
            )
        )


def _adaptor_like(
    template: DmEnvAdaptor, connection: LoopConnection, world_name: str
) -> DmEnvAdaptor:
    """A fresh adaptor for another world with the template's specs and settings.

    It shares the template's spec machinery (spec managers, observation plan,
    action encoder: made once, never changed per world), which is most of an
    adaptor's making and memory; its own are the connection, name and state.
    The template must not have stepped yet.
    """
    env = copy.copy(template)
    env._connection = connection
    env.world_name = world_name
    env._lock = threading.Lock()
    env._closed = False
    env._last_state = None
    env._properties = None
    env._owns_connection = False
    return env


def open_worlds(
    runner: LoopThread,
    open_stream: Callable[..., Coroutine[Any, Any, LoopConnection]],
    connections: list[LoopConnection],
    addresses: Sequence[str],
    count: int,
    settings_of: tuple[
        Mapping[str, Any] | None,
        Mapping[str, Any] | None,
        Sequence[str] | None,
        tuple[str, ...] | None,
    ],
    timeout: float | None,
    seed: int | None,
    seed_setting: str | None,
) -> tuple[list[DmEnvAdaptor], list[str], list[_restart.WorldRecipe], list[int | None]]:
    """Creates (or joins) the batch's worlds, all at once; returns envs, addresses, recipes, seeds.

    World ``i`` goes to ``addresses[i % len(addresses)]``. Every stream opened is
    put in ``connections`` (in world order once all are open; as opened if one
    fails), so the caller can close them all if a world fails.

    ``settings_of`` is (create settings, join settings, world names, requested observations).

    Raises:
      WorldError: naming the world that could not be created or joined (the
        lowest index of those that failed).
      UnknownNameError: a requested observation the world does not have.
    """
    create_settings, join_settings, world_names, requested = settings_of
    where = [addresses[index % len(addresses)] for index in range(count)]
    seeds: list[int | None] = [None] * count
    made: list[dict[str, Any] | None] = [None] * count
    refused: list[BaseException] = []  # the seed setting's refusal, once it came
    answered = dict.fromkeys(where, 0)  # streams per server whose world was made
    join_request = pack_settings(join_settings)
    opened: list[LoopConnection | None] = [None] * count
    packed = pack_settings(create_settings)  # once: only the seed differs per world

    def create_request(index: int) -> dm_env_rpc_pb2.CreateWorldRequest:
        settings = dict(create_settings or {})
        seeds[index] = None
        if seed_setting is not None and seed is not None and not refused:
            settings[seed_setting] = seeds[index] = seed + index
            made[index] = settings
            seeded = {**packed, seed_setting: tensors.pack_tensor(seed + index)}
            return dm_env_rpc_pb2.CreateWorldRequest(settings=seeded)
        made[index] = settings
        return dm_env_rpc_pb2.CreateWorldRequest(settings=packed)

    async def open_one(index: int, gate: asyncio.Semaphore) -> tuple[str, Any]:
        async with gate:
            conn = opened[index] = await open_stream(where[index], first=True)
            stream = conn.async_connection
            if world_names is not None:
                name = world_names[index]
            else:
                try:
                    name = (await _ask(stream, create_request(index), timeout)).world_name
                except errors.InvalidArgumentError as exc:
                    if seeds[index] is None or repr(seed_setting) not in str(exc):
                        raise
                    refused.append(exc)
                    name = (await _ask(stream, create_request(index), timeout)).world_name
            request = dm_env_rpc_pb2.JoinWorldRequest(world_name=name, settings=join_request)
            joined = await _ask(stream, request, timeout)
            answered[where[index]] += 1
            return name, joined.specs

    async def open_all() -> list[Any]:
        gates = {address: asyncio.Semaphore(OPENING_PER_SERVER) for address in answered}
        tasks = [asyncio.ensure_future(open_one(i, gates[where[i]])) for i in range(count)]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        outcomes = runner.run(open_all())
    finally:
        connections.extend(conn for conn in opened if conn is not None)
    failed = next(
        (i for i, o in enumerate(outcomes) if isinstance(o, errors.DmEnvRpcClientError)), None
    )
    if failed is not None:
        raise _open_error(failed, where, outcomes[failed], answered, count)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):  # cancelled, or not the SDK's: as it is
            raise outcome
    if refused:
        address = where[0]
        warnings.warn(
            _SEED_REFUSED.format(address=address, name=seed_setting, error=refused[0]),
            stacklevel=3,
        )
    connections[:] = [conn for conn in opened if conn is not None]
    adaptor_kwargs = {"timeout": timeout, "requested_observations": requested}
    envs: list[DmEnvAdaptor] = []
    template: DmEnvAdaptor | None = None
    for index, (name, specs) in enumerate(outcomes):
        conn = connections[index]
        if template is not None and specs == template._wire_specs:
            envs.append(_adaptor_like(template, conn, name))
            continue
        env = DmEnvAdaptor(
            conn,
            specs,
            world_name=name,
            destroy_on_close=world_names is None,
            **adaptor_kwargs,  # type: ignore[arg-type]
        )
        template = template or env
        envs.append(env)
    recipes = [
        _restart.WorldRecipe(
            made[index],
            join_settings,
            None if world_names is None else world_names[index],
            timeout,
            requested,
        )
        for index in range(count)
    ]
    return envs, where, recipes, seeds


async def _ask(stream: AsyncConnection, request: Any, timeout: float | None) -> Any:
    """``stream.send(request, timeout)`` with less around it (no shield: the future is
    the request's own, and a request that timed out leaves its answer unread)."""
    data, expected = messages.envelope(request)
    try:
        return await asyncio.wait_for(stream._submit(data, expected), timeout)
    except asyncio.TimeoutError as exc:
        if isinstance(exc, errors.DmEnvRpcClientError):  # the request's own error: keep it
            raise
        name = type(request).__name__
        raise errors.RequestTimeoutError(
            _REQUEST_TIMEOUT.format(expected=name, timeout=timeout)
        ) from None


def _open_error(
    index: int,
    where: Sequence[str],
    error: BaseException,
    answered: Mapping[str, int],
    count: int,
) -> errors.WorldError:
    """The ``WorldError`` for world ``index`` that could not be opened; a timeout on a server
    that answered other streams says what most likely hit: the server's stream limit."""
    address = where[index]
    text = str(error)
    if isinstance(error, errors.RequestTimeoutError) and answered[address]:
        wanted = sum(1 for other in where[:count] if other == address)
        text = _STREAM_LIMIT.format(
            error=text, answered=answered[address], address=address, wanted=wanted
        )
    world_error = errors.WorldError(
        _WORLD_FAILED.format(index=index, address=address, error=text), index, address
    )
    world_error.__cause__ = error
    return world_error
