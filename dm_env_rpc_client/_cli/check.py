"""The ``check`` command: checks a server against the protocol and prints the report.

``add_check_command(commands, connection_flags, settings_flags, channel_kwargs,
check_address)`` adds the subcommand, its handler ``check_command`` (the helpers
come from ``cli``, which owns them);
``check_command(args, channel_kwargs, check_address)`` runs it on
``args.address`` and returns the exit code: 0 when the server conforms, 1 when
it does not. A caller that starts the server first (``--launch``) sets
``args.address`` to the address of what it started: ``check --launch "CMD {port}"``
starts one server with ``launch.launch`` (no relaunch: a server that dies is a finding),
checks it, and stops it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..conformance import DEFAULT_CHECK_TIMEOUT, check_server
from ..launch import launch
from .args import UsageError, positive_float, positive_int

CONFORMS, DOES_NOT_CONFORM = 0, 1
_WORLD_CREATE = "--world joins an existing world: --create-setting does not apply to it."
_ONE_TARGET = (
    'check takes a server ADDRESS or --launch "COMMAND {{port}}", not {given}: '
    "pass exactly one of them."
)

DESCRIPTION = (
    "Checks a dm_env_rpc server against the protocol: the lifecycle (create, join, step, "
    "reset, reset world, leave, destroy), the specs, pipelined requests, bad requests, two "
    "clients at once, two agents in one world (skipped for one agent per world), episode "
    "boundaries, and step latency. Prints one line per rule. "
    "Exit code 0 when the server conforms, 1 when it does not."
)


def add_check_command(
    commands: Any,
    connection_flags: Callable[[argparse.ArgumentParser], None],
    settings_flags: Callable[[argparse.ArgumentParser], None],
    channel_kwargs: Callable[[argparse.Namespace], dict[str, Any]],
    check_address: Callable[[str, dict[str, Any], float, bool], None],
) -> argparse.ArgumentParser:
    """Adds ``check`` to the CLI's subparsers, handled by ``check_command``; returns its parser.

    ``channel_kwargs(args)`` makes ``dmr.connect``'s keyword arguments from the TLS flags,
    and ``check_address`` fails fast on an address that cannot work (both ``cli``'s).
    """
    parser: argparse.ArgumentParser = commands.add_parser(
        "check", help="check a server against the protocol", description=DESCRIPTION
    )
    parser.add_argument("address", metavar="HOST:PORT", nargs="?", help="the server")
    parser.add_argument(
        "--launch",
        metavar="COMMAND",
        help='start this server command ("{port}" is replaced) and check it (docs/launching.md)',
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--world", metavar="NAME", help="join this existing world instead of creating worlds"
    )
    parser.add_argument(
        "--latency-steps",
        type=positive_int,
        default=200,
        help="single steps timed for the latency (default: 200)",
    )
    parser.add_argument(
        "--episode-steps",
        type=positive_int,
        default=1000,
        help="steps to wait for an episode to end (default: 1000)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the random actions (default: 0)")
    settings_flags(parser)
    connection_flags(parser)
    for action in parser._actions:  # the check's own default: a hang is found sooner
        if action.dest == "timeout":
            action.type = positive_float
            action.help = (
                f"seconds any one request may take; a server that takes longer breaks the "
                f"rule being checked (default: {DEFAULT_CHECK_TIMEOUT:g})"
            )
    parser.set_defaults(timeout=DEFAULT_CHECK_TIMEOUT)
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    parser.set_defaults(handler=lambda a: check_command(a, channel_kwargs(a), check_address))
    return parser


def check_command(
    args: argparse.Namespace,
    channel_kwargs: dict[str, Any],
    check_address: Callable[[str, dict[str, Any], float, bool], None],
) -> int:
    """Runs the checks on ``args.address`` and prints the report; 0 if it conforms, else 1.

    ``check_address(address, channel_kwargs, timeout, quiet)`` first fails fast on an
    address that cannot work (``cli.check_address``).
    """
    if args.world is not None and args.create_setting:
        raise UsageError(_WORLD_CREATE)
    if (args.address is None) == (args.launch is None):
        raise UsageError(_ONE_TARGET.format(given="both" if args.address else "neither"))
    if args.launch is not None:
        with launch(args.launch, 1, relaunch=None) as servers:
            args.address = servers[0]
            return _check(args, channel_kwargs, check_address)
    return _check(args, channel_kwargs, check_address)


def _check(
    args: argparse.Namespace,
    channel_kwargs: dict[str, Any],
    check_address: Callable[[str, dict[str, Any], float, bool], None],
) -> int:
    """``check_command`` on ``args.address``, once there is one."""
    check_address(args.address, channel_kwargs, args.timeout, True)
    report = check_server(
        args.address,
        timeout=args.timeout,
        create_world_settings=dict(args.create_setting or ()),
        join_world_settings=dict(args.join_setting or ()),
        latency_steps=args.latency_steps,
        episode_steps=args.episode_steps,
        seed=args.seed,
        world_name=args.world,
        **channel_kwargs,
    )
    print(report.to_json() if args.json else report.text())
    return CONFORMS if report.conforms else DOES_NOT_CONFORM
