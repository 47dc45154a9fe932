"""The ``run`` command's dataset flags: ``--record DIR --format npz|minari|rlds`` and friends.

``add_flags`` adds them to the ``run`` parser; ``open_recording`` makes the
``Recording`` for a batch: ``.npz`` files (no extra needed), a Minari dataset
(``integrations.minari``, the ``minari`` extra) or an RLDS dataset
(``integrations.rlds``, the ``rlds`` extra). The integrations are imported only
when their format is asked for. The run's settings go in the dataset's metadata.

On Ray (``sharded``), every shard records its worlds' episodes as ``.npz``
parts, which come back to the driver (``ray._shards``); the driver then writes
them, world by world and episode by episode, into one dataset in ``DIR``. The
spaces and specs come from one world made on the first server (or on an
embedded Catch, which the fleet runs) before the run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import pathlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .. import errors
from ..batched import BatchedEnvironment
from ..connection import connect
from ..environment import create_and_join_world
from ..recording import NpzWriter, Recording, iter_episodes, prepare_folder
from ..server import serve
from ..server.catch import Catch
from ..stepping import RunStats

FORMATS = ("npz", "minari", "rlds")
NPZ_EPISODES_PER_FILE = 16
"""``--format npz`` keeps 16 of a world's episodes per file: creating a file is most of
what writing one costs (``_tools.npz_chunks``)."""
_NO_EXTRA = "--format {format} needs the {format} extra: pip install 'dm_env_rpc_client[{format}]'."


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds ``--format`` and the Minari metadata flags to the ``run`` parser."""
    group = parser.add_argument_group("datasets (with --record)")
    group.add_argument(
        "--format",
        choices=FORMATS,
        default="npz",
        help="npz: .npz files, 16 episodes of a world each (default, no extra); minari: a "
        "Minari dataset (minari extra); rlds: an RLDS dataset written by envlogger (rlds extra)",
    )
    group.add_argument(
        "--dataset-id",
        metavar="ID",
        help="Minari's dataset id, NAME-vN (default: the folder's name, -v0 added)",
    )
    group.add_argument(
        "--algorithm-name",
        metavar="TEXT",
        help="Minari's algorithm_name (default: uniform random actions)",
    )
    group.add_argument("--author", metavar="NAME", help="Minari's author (default: your login)")
    group.add_argument("--author-email", metavar="EMAIL", help="Minari's author_email")


def settings(args: argparse.Namespace, addresses: Sequence[str]) -> dict[str, Any]:
    """The run's settings, as the dataset's metadata keeps them."""
    try:
        version = importlib.metadata.version("dm_env_rpc_client")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "dm_env_rpc_client_version": version,
        "addresses": list(addresses),
        "num_envs": args.num_envs,
        "steps": args.steps,
        "pipeline": args.pipeline,
        "seed": args.seed,
        "seed_setting": args.seed_setting,
        "create_settings": [list(map(str, pair)) for pair in args.create_setting or ()],
        "join_settings": [list(map(str, pair)) for pair in args.join_setting or ()],
        "policy": "uniform random actions, world i from default_rng((seed + i, 1))",
    }


def open_recording(
    args: argparse.Namespace, batch: BatchedEnvironment, create_settings: dict[str, Any]
) -> Recording | None:
    """The ``Recording`` of ``--record DIR`` in ``--format`` (None without ``--record``).

    Raises:
      RecordingError: the format's extra is missing, the folder is not empty, or
        a tensor cannot be stored in the format (named, before any step).
    """
    if not args.record:
        return None
    addresses = [str(a) for a in dict.fromkeys(batch.addresses)]
    writer = open_writer(args, batch, settings(args, addresses), create_settings)
    if writer is None:  # npz
        folder = prepare_folder(args.record)
        writer = NpzWriter(folder, episodes_per_file=NPZ_EPISODES_PER_FILE)
    return Recording(
        args.record, len(batch), batch.world_seeds, writer=writer, background="process"
    )


def open_writer(
    args: argparse.Namespace,
    env: Any,
    run_settings: dict[str, Any],
    create_settings: dict[str, Any],
) -> Any:
    """The ``EpisodeWriter`` of ``--format`` for the worlds of ``env`` (None for npz)."""
    if args.format == "npz":
        return None
    try:
        if args.format == "minari":
            from ..integrations.minari import DEFAULT_ALGORITHM, MinariWriter

            env_kwargs = {
                "address": run_settings["addresses"][0],
                "create_world_settings": create_settings,
            }
            return MinariWriter.for_environment(
                args.record,
                env,
                dataset_id=args.dataset_id,
                env_kwargs=env_kwargs,
                algorithm_name=args.algorithm_name or DEFAULT_ALGORITHM,
                author=args.author,
                author_email=args.author_email,
                settings=run_settings,
            )
        from ..integrations.rlds import RldsWriter

        return RldsWriter.for_environment(args.record, env, settings=run_settings)
    except ImportError as exc:
        raise errors.RecordingError(_NO_EXTRA.format(format=args.format)) from exc


@contextlib.contextmanager
def _template_world(
    args: argparse.Namespace, channel: dict[str, Any], create_settings: dict[str, Any]
) -> Iterator[tuple[Any, str]]:
    """One world of the run's kind, for its specs: on the first server, or an embedded Catch."""
    with contextlib.ExitStack() as stack:
        if args.address:
            address = args.address[0]
        else:
            address = stack.enter_context(serve(lambda settings: Catch(**settings))).address
        connection = stack.enter_context(connect(address, timeout=args.timeout, **channel))
        env, _ = create_and_join_world(connection, create_world_settings=create_settings)
        stack.callback(env.close)
        yield env, address


def sharded(
    args: argparse.Namespace,
    channel: dict[str, Any],
    create_settings: dict[str, Any],
    run_on_ray: Callable[..., RunStats],
    *run_args: Any,
) -> RunStats:
    """``run_on_ray(args, channel, *run_args)`` (recording ``.npz`` parts), then its parts as
    one ``--format`` dataset.

    Raises:
      RecordingError: as ``open_recording``, before the run.
    """

    def run() -> RunStats:
        return run_on_ray(args, channel, *run_args)

    if not args.record or args.format == "npz":
        return run()
    final = args.record
    with (
        _template_world(args, channel, create_settings) as (env, address),
        tempfile.TemporaryDirectory(prefix="dm_env_rpc_parts-") as parts,
    ):
        addresses = list(args.address or [address])
        writer = open_writer(args, env, settings(args, addresses), create_settings)
        try:
            args.record = str(pathlib.Path(parts, "episodes"))
            stats = run()
            for episode in iter_episodes(args.record):  # by world, then episode
                writer.write(episode)
        finally:
            args.record = final
            writer.close()
    stats.recorded = final
    return stats
