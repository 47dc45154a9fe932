"""Opening a batch for ``BatchedEnvironment.connect``: one loop, streams, worlds, the watchdog.

Every world gets its own stream on one background event loop; streams to the
same address share one channel. The worlds are created (or joined) by
``_batch_core.open_worlds``; on any failure everything opened so far is shut
down before the error is raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from dm_env_rpc_client import _checks, _restart, errors
from dm_env_rpc_client._batch_core import (
    _NAMES_COUNT,
    _SEED_TWICE,
    BatchCore,
    _shut_down,
    open_worlds,
)
from dm_env_rpc_client._loop import LoopConnection, LoopThread
from dm_env_rpc_client._restart import RestartPolicy
from dm_env_rpc_client._stacked import StackedDecoder
from dm_env_rpc_client._step_encoder import StepEncoder
from dm_env_rpc_client.connection import create_channel

Batch = TypeVar("Batch", bound=BatchCore)
_NO_ADDRESS = "addresses is empty: give at least one server address, e.g. ['127.0.0.1:50051']."
_ONE_NAME = (
    "requested_observations takes a list of observation names, not the string {name!r}: "
    "pass [{name!r}]."
)


def open_batch(
    cls: type[Batch],
    addresses: str | Sequence[str],
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
    if isinstance(addresses, str):
        addresses = [addresses]
    for address in addresses:
        _checks.check_address(address, "addresses")
    if num_envs is not None:
        _checks.check_count(num_envs, "num_envs")
    _checks.check_seconds(timeout)
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
    runner = LoopThread(name="dm_env_rpc_client-batched")
    channels: dict[str, grpc.aio.Channel] = {}

    async def open_stream(
        address: str, wait: float | None = timeout, *, first: bool = False
    ) -> LoopConnection:
        """A stream to ``address``; a world's first (``first``) fails at once on a refusing port
        unless ``wait_for_ready``; a restart's waits for its server to come back."""
        channel = channels.get(address)
        if channel is None:
            channel = channels[address] = create_channel(
                address, credentials=credentials, options=options, insecure=insecure, aio=True
            )
        return await LoopConnection.open(
            runner,
            address,
            channel=channel,
            timeout=wait,
            metadata=metadata,
            wait_for_ready=wait_for_ready or not first,
        )

    connections: list[LoopConnection] = []
    try:
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
        _shut_down(runner, connections, channels)
        raise
    envs, used, recipes, seeds = opened
    batch = cls(envs, used, connections=connections)
    batch.world_seeds = seeds
    if seed is not None:
        batch._actions_rng = np.random.default_rng(seed)
    batch._runner, batch._channels = runner, channels
    batch._streams = [conn.async_connection for conn in connections]
    batch._joined_specs = [env._wire_specs for env in envs]
    if all(specs == batch._joined_specs[0] for specs in batch._joined_specs):
        batch._decoder = StackedDecoder(envs[0])
        batch._encoder = StepEncoder(envs[0])
    batch._policy = on_world_failure
    batch._restart_policy = restart or RestartPolicy()
    batch._step_timeout = step_timeout
    batch._recipes = recipes
    batch._open_stream = open_stream
    if step_timeout is not None:
        runner.call(batch._watch)
    return batch
