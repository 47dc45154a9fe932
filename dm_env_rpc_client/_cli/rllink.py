"""``run --rllib-server HOST:PORT``: the run's flags and entry for RLlib learners over RLlink.

The flags live here, so that ``cli.py`` only adds them; ``run_rllink`` imports
the RLlink client (``integrations.ray._rllink_cli``, the ``rllib`` extra) only
when ``--rllib-server`` is given, and says which extra to install if it is missing.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from typing import Any

from .. import specs
from .._base.cli_args import positive_float, positive_int


def add_rllib_flags(
    parser: argparse.ArgumentParser,
    addresses: Callable[..., Any],
    stop_on_signals: Callable[[], Any],
    channel_kwargs: Callable[[argparse.Namespace], dict[str, Any]],
) -> None:
    """Adds ``run``'s RLlink flags (``--rllib-server`` and its options) to ``parser``.

    Given ``--rllib-server``, the parsed arguments' ``handler`` becomes ``run_rllink``
    (with the three ``cli`` helpers bound), so ``cli.run`` needs no branch for it.

    Args:
      parser: the ``run`` command's parser.
      addresses: ``cli._addresses`` (the servers, or the embedded one).
      stop_on_signals: ``cli._stop_on_signals``.
      channel_kwargs: ``cli._channel_kwargs`` (TLS and ``--insecure``).
    """

    def handler(args: argparse.Namespace) -> int:
        create = specs.unflatten(dict(args.create_setting or ()))
        return run_rllink(args, channel_kwargs(args), create, addresses, stop_on_signals)

    class _Servers(argparse._AppendAction):
        def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
            super().__call__(parser, namespace, values, option)
            namespace.handler = handler

    group = parser.add_argument_group("RLlib learners over RLlink (docs/rllink.md; rllib extra)")
    group.add_argument(
        "--rllib-server",
        action=_Servers,
        metavar="HOST:PORT",
        help="step the worlds for the RLlib EnvRunnerServerForExternalInference at HOST:PORT "
        "(repeat for several runners); ships episodes, takes weights",
    )
    group.add_argument(
        "--rllib-policy",
        metavar="random|MODULE:FUNCTION",
        help="act with this policy(timestep) -> actions (off-policy episodes) instead of the "
        "learner's RLModule",
    )
    group.add_argument(
        "--rllib-agents",
        type=positive_int,
        default=1,
        metavar="N",
        help="the worlds are multi-agent, N agents each (e.g. serve --game paddles); one "
        "policy acts for every agent, each agent's episodes its own (default: 1)",
    )
    group.add_argument(
        "--rllib-rounds", type=positive_int, help="ship this many batches of episodes, then stop"
    )
    group.add_argument(
        "--rllib-steps-per-send",
        type=positive_int,
        help="env steps per round over all ports (default: the learner's train batch)",
    )
    group.add_argument(
        "--rllib-lockstep",
        action="store_true",
        help="wait for the weights trained on a round before stepping the next (default: "
        "step it while the learner trains, with weights at most one round old)",
    )
    group.add_argument(
        "--rllib-paced",
        action="store_true",
        help="with --rllib-policy: one round in flight, at the learner's pace (a round per "
        "training iteration) instead of shipping as fast as the worlds step",
    )
    group.add_argument(
        "--rllib-wait",
        type=positive_float,
        default=120.0,
        help="seconds to keep retrying a learner port that refuses or hung up (default: 120)",
    )
    group.add_argument(
        "--rllib-learner-timeout",
        type=positive_float,
        default=600.0,
        help="seconds to wait for new weights after shipping (default: 600)",
    )


def run_rllink(
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    create: dict[str, Any],
    addresses: Callable[..., Any],
    stop_on_signals: Callable[[], Any],
) -> int:
    """``run --rllib-server``: the worlds stepped for RLlib learners; returns the exit code.

    Args:
      args: the ``run`` command's arguments.
      kwargs: the channel arguments (TLS, ``insecure``).
      create: the create settings.
      addresses: ``cli._addresses`` (the servers, or the embedded one).
      stop_on_signals: ``cli._stop_on_signals``.
    """
    try:
        from ..integrations.ray import _rllink_cli as rllink
    except ImportError as exc:
        print(
            f"error: --rllib-server needs RLlib: pip install 'dm_env_rpc_client[rllib]' ({exc})",
            file=sys.stderr,
        )
        return 1
    quiet = args.quiet or args.json

    def say(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    with addresses(args, kwargs) as found, stop_on_signals() as (stop, received):
        stats = rllink.rllink_command(
            args, found, kwargs, create, specs.unflatten(dict(args.join_setting or ())), stop, say
        )
    rllink.print_rllink_summary(stats, as_json=args.json)
    if stats.stop_reason == "stopped" and received:
        return 143 if signal.SIGTERM in received else 130
    return 0
