"""Opening a batch for ``BatchedEnvironment.connect``: one loop, streams, worlds, the watchdog.

Every world gets its own stream on one background event loop; streams to the
same address share a channel, at most ``max_streams_per_connection`` streams to
a channel (``_batch.channels``), so a server or proxy that limits the streams
of one HTTP/2 connection takes all the worlds. ``open_worlds`` opens the streams and creates
(or joins) the worlds all at once on the loop, up to ``OPENING_PER_SERVER`` at a
time per server, so connecting takes about as long as the slowest server needs
for its share, not one round trip per world after another. Worlds whose specs
are alike share one adaptor's spec machinery (``_adaptor_like``). The loop,
channels and streams come from ``_batch.streams.start_streams``. All or nothing: on any failure every world made so
far is left and destroyed (a joined named world only left), then every stream
is shut down, before the error is raised; a world whose CreateWorldRequest went
out is waited for (within ``timeout``) rather than cancelled, so its name is
known and it can be destroyed.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from .. import errors, tensors
from .._adaptor.core import pack_settings
from .._adaptor.stacked import StackedDecoder
from .._base import checks as _checks
from .._base import collector
from .._fastpath.step_encoder import StepEncoder
from .._proto import dm_env_rpc_pb2
from .._transport.loop import LoopConnection, LoopThread
from ..environment import DmEnvAdaptor
from ..launch import LaunchedServers
from . import restart as _restart
from .balance import Balancer
from .channels import DEFAULT_STREAMS_PER_CONNECTION, Slot
from .closing import shut_down
from .core import BatchCore
from .options import ConnectionOptions
from .outcomes import _NAMES_COUNT, _SEED_TWICE, _WORLD_FAILED
from .restart import RestartPolicy
from .streams import OPENING_PER_SERVER, start_streams
from .undo import Made, ask, undo_worlds

Batch = TypeVar("Batch", bound=BatchCore)
_NO_ADDRESS = "addresses is empty: give at least one server address, e.g. ['127.0.0.1:50051']."
_STREAM_LIMIT = (
    "{error} ({answered} other streams on the same HTTP/2 connection to {address} were "
    "answered, so the server is up but this stream was not taken: the server, or a proxy in "
    "front of it, likely allows at most {answered} streams at once per connection (its HTTP/2 "
    "SETTINGS_MAX_CONCURRENT_STREAMS: 100 behind Google front ends, 128 with nginx or AWS ALB). "
    "Pass max_streams_per_connection={answered} or lower (run --max-streams-per-connection) "
    "so the worlds spread over more connections. If the server serves only that many streams "
    "in all (a sync gRPC server as many as its thread pool's max_workers, the SDK's server "
    "its --max-workers), start it with room for {wanted} or spread the worlds over more "
    "servers.)"
)
_SERVER_FULL = (
    "{error} (the server at {address} is full: it refused a world after making {answered} of "
    "the {wanted} asked of it. Free worlds there, start it with room for more, or spread the "
    "worlds over more servers.)"
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
    max_streams_per_connection: int | None = DEFAULT_STREAMS_PER_CONNECTION,
    max_response_bytes: int | None = None,
) -> Batch:
    """``BatchedEnvironment.connect`` (its arguments and errors are documented there)."""
    _restart.check_policy(on_world_failure)
    if isinstance(requested_observations, str):
        raise ValueError(_ONE_NAME.format(name=requested_observations))
    requested = None if requested_observations is None else tuple(requested_observations)
    servers = addresses if isinstance(addresses, LaunchedServers) else None
    if isinstance(addresses, LaunchedServers):
        # Launched servers hand over what reaches them (dmr.launch's token and credentials).
        metadata = addresses.metadata if metadata is None else metadata
        credentials = addresses.credentials if credentials is None else credentials
        addresses = addresses.addresses
    elif isinstance(addresses, str):
        addresses = [addresses]
    for address in addresses:
        _checks.check_address(address, "addresses")
    if num_envs is not None:
        _checks.check_count(num_envs, "num_envs")
    _checks.check_seconds(timeout)
    # Checked once, here, by packing them (before anything opens): open_worlds sends these.
    packed = (
        pack_settings(create_world_settings, "create_world_settings"),
        pack_settings(join_world_settings, "join_world_settings"),
    )
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
    connection = ConnectionOptions(
        credentials,
        options,
        insecure,
        metadata,
        wait_for_ready,
        max_streams_per_connection,
        max_response_bytes,
    )
    runner, channels, open_stream = start_streams(
        "dm_env_rpc_client-batched", addresses, count, timeout, connection
    )
    connections: list[LoopConnection] = []
    made: dict[int, Made] = {}
    try:
        # The collector is off until the batch is whole: its collections would scan every
        # world's objects, in vain; they then go to the oldest generation (``keep``).
        with collector.paused(keep=True):
            opened = open_worlds(
                runner,
                open_stream,
                connections,
                addresses,
                count,
                (create_world_settings, join_world_settings, world_names, requested),
                packed,
                timeout,
                seed,
                seed_setting,
                made,
            )
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
    except BaseException:
        undo_worlds(runner, made, timeout)
        shut_down(runner, connections, channels)
        raise
    collector.raise_young_threshold()  # until close (_base.collector says why)
    batch._raised_threshold = True
    return batch


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
        batch._plan = batch._decoder.plan  # its layout: answers' states read on the loop
        batch._encoder = StepEncoder(envs[0])
    batch._open_stream = open_stream


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
    packed: tuple[dict[str, dm_env_rpc_pb2.Tensor], dict[str, dm_env_rpc_pb2.Tensor]],
    timeout: float | None,
    seed: int | None,
    seed_setting: str | None,
    made_worlds: dict[int, Made],
) -> tuple[list[DmEnvAdaptor], list[str], list[_restart.WorldRecipe], list[int | None]]:
    """Creates (or joins) the batch's worlds, all at once; returns envs, addresses, recipes, seeds.

    World ``i`` goes to ``addresses[i % len(addresses)]``. Every stream opened is
    put in ``connections`` (in world order once all are open; as opened if one
    fails), so the caller can close them all if a world fails; every world
    created or joined is put in ``made_worlds``, so the caller can undo it
    (``undo_worlds``). Once one world fails, the worlds whose CreateWorldRequest
    has not gone out are cancelled; the others are let finish (each call is
    bounded by ``timeout``), so that no world is made whose name is not known.

    ``settings_of`` is (create settings, join settings, world names, requested observations);
    ``packed`` the create and join settings as ``pack_settings`` gave them (checked there).

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
    on_channel: dict[str, int] = {}  # the same, per channel (``Slot.key``)
    channel_of: list[str | None] = [None] * count
    packed_create, join_request = packed  # the create settings: only the seed differs per world
    opened: list[LoopConnection | None] = [None] * count

    def create_request(index: int) -> dm_env_rpc_pb2.CreateWorldRequest:
        settings = dict(create_settings or {})
        seeds[index] = None
        if seed_setting is not None and seed is not None and not refused:
            settings[seed_setting] = seeds[index] = seed + index
            made[index] = settings
            seeded = {**packed_create, seed_setting: tensors.pack_tensor(seed + index)}
            return dm_env_rpc_pb2.CreateWorldRequest(settings=seeded)
        made[index] = settings
        return dm_env_rpc_pb2.CreateWorldRequest(settings=packed_create)

    async def open_one(index: int, gate: asyncio.Semaphore) -> tuple[str, Any]:
        async with gate:
            conn = opened[index] = await open_stream(where[index], first=True)
            slot: Slot | None = getattr(conn, "slot", None)
            channel_of[index] = None if slot is None else slot.key
            stream = conn.async_connection
            record = made_worlds[index] = Made(conn)  # from here on, never cancelled
            if world_names is not None:
                name = world_names[index]
            else:
                try:
                    name = (await ask(stream, create_request(index), timeout)).world_name
                except errors.InvalidArgumentError as exc:
                    if seeds[index] is None or repr(seed_setting) not in str(exc):
                        raise
                    refused.append(exc)
                    name = (await ask(stream, create_request(index), timeout)).world_name
                record.created = name
            request = dm_env_rpc_pb2.JoinWorldRequest(world_name=name, settings=join_request)
            record.joining = True
            joined = await ask(stream, request, timeout)
            answered[where[index]] += 1
            if slot is not None:
                on_channel[slot.key] = on_channel.get(slot.key, 0) + 1
            return name, joined.specs

    async def open_all() -> list[Any]:
        gates = {address: asyncio.Semaphore(OPENING_PER_SERVER) for address in answered}
        tasks = [asyncio.ensure_future(open_one(i, gates[where[i]])) for i in range(count)]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for index, task in enumerate(tasks):
            if index not in made_worlds:  # nothing asked of the server yet: safe to cancel
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
        key = channel_of[failed]
        on_its_channel = 0 if key is None else on_channel.get(key, 0)
        raise _open_error(failed, where, outcomes[failed], (answered, on_its_channel), count)
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


def _open_error(
    index: int,
    where: Sequence[str],
    error: BaseException,
    answered: tuple[Mapping[str, int], int],
    count: int,
) -> errors.WorldError:
    """The ``WorldError`` for world ``index`` that could not be opened.

    ``answered`` is (worlds made per server, worlds made on the failed world's
    connection). A timeout on a connection that answered other streams says what
    most likely hit: a limit of streams per connection; a RESOURCE_EXHAUSTED
    says the server is full, and how many worlds it made."""
    address = where[index]
    text = str(error)
    per_server, on_channel = answered
    wanted = sum(1 for other in where[:count] if other == address)
    if isinstance(error, errors.RequestTimeoutError) and on_channel:
        text = _STREAM_LIMIT.format(error=text, answered=on_channel, address=address, wanted=wanted)
    elif getattr(error, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED:
        text = _SERVER_FULL.format(
            error=text, address=address, answered=per_server[address], wanted=wanted
        )
    world_error = errors.WorldError(
        _WORLD_FAILED.format(index=index, address=address, error=text), index, address
    )
    world_error.__cause__ = error
    return world_error
