"""The ``dm-env-rpc-client`` command line (also ``python -m dm_env_rpc_client``).

Commands:

- ``run``: random-action stepping over one or more worlds, pipelined; with no
  ``--address`` it starts the embedded Catch server itself, in a child process
  (``--in-process`` keeps it in this one). Prints a summary:
  steps, episodes, episode returns, steps per second, round-trip latency.
- ``specs ADDRESS``: prints the action and observation specs of a world.
- ``serve``: serves the embedded Catch game until Ctrl-C.

Exit code 0 means success. A failure prints one paragraph (add ``--debug`` for
the traceback) and exits with 1.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dm_env_rpc_client import errors, specs
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.connection import connect
from dm_env_rpc_client.environment import create_and_join_world, specs_table
from dm_env_rpc_client.random_actions import random_action
from dm_env_rpc_client.recording import Recording
from dm_env_rpc_client.server import serve
from dm_env_rpc_client.server._subprocess import server_subprocess
from dm_env_rpc_client.server.catch import Catch


def parse_setting(text: str) -> tuple[str, Any]:
    """Parses ``key=value``: ints, floats, true/false, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"settings look like key=value, not {text!r}")
    value: Any = raw
    lowered = raw.lower()
    if lowered in ("true", "false"):
        value = lowered == "true"
    else:
        for convert in (int, float):
            try:
                value = convert(raw)
                break
            except ValueError:
                continue
    return key, value


def _settings(pairs: Sequence[tuple[str, Any]] | None) -> dict[str, Any]:
    return specs.unflatten(dict(pairs or ()))


@contextlib.contextmanager
def _addresses(given: Sequence[str] | None, in_process: bool = False) -> Iterator[list[str]]:
    if given:
        yield list(given)
        return
    if in_process:
        with serve(lambda settings: Catch(**settings)) as server:
            yield [server.address]
        return
    # A child process: the server gets a core (and a GIL) of its own, about twice the steps/s.
    with server_subprocess("catch") as server:
        yield [server.address]


def _stack_actions(actions: list[Any]) -> Any:
    first = actions[0]
    if isinstance(first, dict):
        return {key: _stack_actions([a[key] for a in actions]) for key in first}
    return np.stack([np.asarray(a) for a in actions])


def run(args: argparse.Namespace) -> int:
    """The ``run`` command."""
    from tqdm.auto import tqdm

    rng = np.random.default_rng(args.seed)
    with (
        _addresses(args.address, args.in_process) as addresses,
        BatchedEnvironment.connect(
            addresses,
            args.num_envs,
            create_world_settings=_settings(args.create_setting),
            join_world_settings=_settings(args.join_setting),
            timeout=args.timeout,
        ) as batch,
    ):
        count = len(batch)
        spec = batch.action_spec()
        recording = Recording(args.record, count, batch.world_seeds) if args.record else None
        returns: list[float] = []
        running = np.zeros(count)
        episodes_done = 0
        actions_sent: list[list[Any]] = [[] for _ in range(count)]
        started = time.perf_counter()
        sent = received = 0
        window = max(1, args.pipeline)
        with tqdm(total=args.steps, unit="step", disable=args.quiet) as progress:
            while received < args.steps:
                # Top every world up to `window` steps in flight, up to the total asked for.
                while sent < args.steps:
                    ids = [w for w in range(count) if batch.in_flight(w) < window]
                    ids = ids[: args.steps - sent]
                    if not ids:
                        break
                    actions = [random_action(spec, rng) for _ in ids]
                    batch.send(_stack_actions(actions), ids)
                    for world, action in zip(ids, actions, strict=True):
                        actions_sent[world].append(action)
                    sent += len(ids)
                result = batch.recv(1, timeout=args.timeout)
                for position, world in enumerate(result.env_ids):
                    action = actions_sent[world].pop(0)
                    step_type = int(result.step_type[position])
                    if step_type != 0:
                        running[world] += result.reward[position]
                    if step_type == 2:
                        returns.append(float(running[world]))
                        running[world] = 0.0
                        episodes_done += 1
                    if recording is not None:
                        recording.add(
                            world, None if step_type == 0 else action, result.at(position)
                        )
                received += len(result.env_ids)
                progress.update(len(result.env_ids))
        elapsed = time.perf_counter() - started
        if recording is not None:
            recording.close()
        latencies = np.array(batch.latencies) * 1e3
    _print_summary(received, episodes_done, returns, elapsed, latencies, count, args)
    return 0


def _print_summary(
    steps: int,
    episodes: int,
    returns: list[float],
    elapsed: float,
    latencies: np.ndarray,
    worlds: int,
    args: argparse.Namespace,
) -> None:
    def fmt(values: list[float], reducer: Any) -> str:
        return f"{reducer(values):.3f}" if values else "n/a"

    lines = [
        f"worlds          {worlds}",
        f"steps           {steps}",
        f"episodes        {episodes}",
        f"return mean     {fmt(returns, np.mean)}",
        f"return min      {fmt(returns, min)}",
        f"return max      {fmt(returns, max)}",
        f"steps/s         {steps / elapsed:.1f}" if elapsed > 0 else "steps/s         n/a",
        f"latency p50 ms  {np.percentile(latencies, 50):.3f}" if latencies.size else "",
        f"latency p99 ms  {np.percentile(latencies, 99):.3f}" if latencies.size else "",
    ]
    if args.record:
        lines.append(f"recorded to     {args.record}")
    print("\n".join(line for line in lines if line))


def show_specs(args: argparse.Namespace) -> int:
    """The ``specs`` command."""
    with connect(args.address, timeout=args.timeout) as conn:
        env, _ = create_and_join_world(
            conn, _settings(args.create_setting), _settings(args.join_setting)
        )
        try:
            for title, manager in (
                ("actions", env.action_manager),
                ("observations", env.observation_manager),
            ):
                print(_table(title, specs_table(manager)))
        finally:
            env.close()
    return 0


def _table(title: str, rows: list[tuple[Any, ...]]) -> str:
    header = ("name", "uid", "dtype", "shape", "bounds")
    cells = [header] + [tuple(str(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title]
    for index, row in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dm-env-rpc-client", description="Drive dm_env_rpc environments."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)

    run_parser = commands.add_parser("run", help="random-action stepping over many worlds")
    run_parser.add_argument("--address", nargs="+", help="servers (default: embedded Catch)")
    run_parser.add_argument("--num-envs", type=int, default=4, help="worlds (default 4)")
    run_parser.add_argument("--steps", type=int, default=2000, help="total steps (default 2000)")
    run_parser.add_argument("--pipeline", type=int, default=8, help="steps in flight per world")
    run_parser.add_argument("--seed", type=int, default=0)
    run_parser.add_argument("--create-setting", nargs="*", type=parse_setting, default=[])
    run_parser.add_argument("--join-setting", nargs="*", type=parse_setting, default=[])
    run_parser.add_argument("--record", metavar="DIR", help="write each episode as .npz")
    run_parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    run_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    run_parser.add_argument(
        "--in-process",
        action="store_true",
        help="without --address: run the embedded server in this process, not a child process",
    )
    run_parser.set_defaults(handler=run)

    specs_parser = commands.add_parser("specs", help="print the specs of a world")
    specs_parser.add_argument("address")
    specs_parser.add_argument("--create-setting", nargs="*", type=parse_setting, default=[])
    specs_parser.add_argument("--join-setting", nargs="*", type=parse_setting, default=[])
    specs_parser.add_argument("--timeout", type=float, default=30.0)
    specs_parser.set_defaults(handler=show_specs)

    # Imported here, not at module level: `python -m dm_env_rpc_client.server` must not find
    # its __main__ already imported by the package.
    from dm_env_rpc_client.server import __main__ as server_main

    serve_parser = commands.add_parser("serve", help="serve the embedded Catch game")
    server_main.build_parser(serve_parser)
    serve_parser.set_defaults(handler=lambda a: server_main.run(a.env, a.host, a.port, a.size))
    for sub in (run_parser, specs_parser, serve_parser):
        sub.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    except (errors.DmEnvRpcClientError, OSError, ValueError, TypeError) as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())
        print(f"error: {type(exc).__name__}: {message}", file=sys.stderr)
        print("Run again with --debug for the traceback.", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
