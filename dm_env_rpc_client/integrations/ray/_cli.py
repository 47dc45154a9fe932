"""``dm-env-rpc-client run --ray [auto|ADDRESS|local] --num-shards K``: the run, sharded on Ray.

``cli.run`` hands over here when ``--ray`` is given (importing this module
needs the ``ray`` extra). The run keeps what a local run prints: the progress
bar, then the same summary, from the shards' ``RunStats`` merged (latency
percentiles over every step of every shard). Without ``--address`` the worlds
go to a ``ServerFleet`` of embedded Catch servers, one per shard. ``local``
starts a Ray of this machine with enough CPUs for the servers and shards
(each reserves one); ``auto`` or an address joins a cluster. Ctrl-C stops every
shard between steps; the summary then covers what they did.

``--on-failure`` reaches every shard's ``BatchedEnvironment`` as a local run's
does (``restart`` by default): the summary lists the restarts of every shard
(worlds named by their index in the whole run) and the worlds lost, and the
exit code is 3 when a world was lost.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import ray

from ..._base.cli_args import UsageError, check_launch_flags, tls_credentials, token
from ...server.catch import Catch
from ...specs import unflatten
from ...stepping import RunStats
from ._api import init_ray
from ._fleet import ServerFleet
from ._shards import run_sharded

LOCAL = "local"
_MIN_WORKERS = 64  # streams each fleet server serves at least
_NO_WORLDS = "--ray creates its worlds; it cannot join existing ones (--world). Drop one of them."
_NO_WATCH = "--watch watches a run stepped in this process; it does not go with --ray."
_TOO_MANY_SHARDS = "--num-shards {shards} is more than the {worlds} worlds; give at most {worlds}."


def _make_catch(settings: dict[str, Any]) -> Catch:
    return Catch(**settings)


def run_on_ray(
    args: argparse.Namespace,
    channel_kwargs: dict[str, Any],
    stop: threading.Event,
    progress: Any,
) -> RunStats:
    """Runs ``args`` (the ``run`` command's) on Ray; returns the merged stats.

    Args:
      args: the parsed ``run`` arguments, with ``ray`` and ``num_shards``.
      channel_kwargs: ``credentials`` / ``insecure`` / ``options`` from the TLS flags.
      stop: set on Ctrl-C: every shard ends between steps.
      progress: the progress bar (``update(n)``).

    Raises:
      UsageError: flags that do not go with ``--ray``.
      FleetError, ShardError: from the fleet or a shard (they name what failed).
    """
    worlds, servers, cpus = _check(args)
    started = _init(args.ray, cpus)
    fleet: ServerFleet | None = None
    try:
        launched = None
        if args.launch:  # each shard launches its own servers, on its node
            source: Any = ["(launched by the shard)"]
            launched = (args.launch, args.num_servers or 1, token(args))
        elif args.address:
            source = list(args.address)
        else:
            fleet = ServerFleet(
                _make_catch,
                servers,
                max_workers=max(_MIN_WORKERS, worlds),
                timeout=max(60.0, args.timeout),
                token=token(args),
            )
            source = fleet
        seen = [0]

        def advance(total: int) -> None:
            progress.update(total - seen[0])
            seen[0] = total

        run = run_sharded(
            source,
            num_worlds=worlds,
            num_shards=args.num_shards,
            steps=args.steps,
            pipeline=args.pipeline,
            seed=args.seed,
            record=args.record,
            create_world_settings=unflatten(dict(args.create_setting or ())),
            join_world_settings=unflatten(dict(args.join_setting or ())),
            timeout=args.timeout,
            credentials=tls_credentials(args),  # credential objects do not pickle
            insecure=bool(channel_kwargs["insecure"]) or fleet is not None,
            connect_options={
                "seed_setting": args.seed_setting or None,
                "options": channel_kwargs["options"],
                "metadata": channel_kwargs["metadata"],
                # As a local run: a world whose server dies or stalls is made again
                # (or the run stops, with raise); a stall is --timeout without a step.
                "on_world_failure": args.on_failure,
                "step_timeout": args.timeout,
                "max_streams_per_connection": args.max_streams_per_connection,
                **({"launch": launched} if launched else {}),
            },
            progress=advance,
            stop=stop,
        )
    finally:
        if fleet is not None:
            fleet.close()
        if started:
            ray.shutdown()
    return run.stats


def _check(args: argparse.Namespace) -> tuple[int, int, int]:
    """The ``--ray`` flags checked (``UsageError``); the run's worlds, fleet servers and CPUs."""
    if args.world:
        raise UsageError(_NO_WORLDS)
    if getattr(args, "watch", False):
        raise UsageError(_NO_WATCH)
    check_launch_flags(args)
    worlds = args.num_envs or 4
    if args.num_shards > worlds:
        raise UsageError(_TOO_MANY_SHARDS.format(shards=args.num_shards, worlds=worlds))
    servers = 0 if args.address or args.launch else args.num_shards
    return worlds, servers, max(os.cpu_count() or 1, args.num_shards + servers)


@contextlib.contextmanager
def ray_first(args: argparse.Namespace) -> Iterator[None]:
    """Ray started (or joined) before this process opens any gRPC channel or server.

    ``ray.init`` starts its processes with a ``preexec_fn`` (Python run in the forked
    child), which can hang on a lock that a gRPC thread of this process held at the fork:
    Ray then times out waiting for its ``gcs_server_port`` file. ``cli.run`` therefore
    enters this before it checks addresses or opens a recording's template world; the
    flags are checked first (``UsageError`` before anything starts). ``run_on_ray`` then
    finds Ray initialized and leaves its shutdown to this block.
    """
    _, _, cpus = _check(args)
    started = _init(args.ray, cpus)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _init(target: str, cpus: int) -> bool:
    """Starts (``local``) or joins Ray; True when this call started it."""
    if target == LOCAL:
        return init_ray(LOCAL, num_cpus=cpus, log_to_driver=False)
    return init_ray(target, log_to_driver=False)
