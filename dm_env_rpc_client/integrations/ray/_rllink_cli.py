"""``dm-env-rpc-client run --rllib-server HOST:PORT ...``: the run, for an RLlib learner.

``cli.run`` hands over here when ``--rllib-server`` is given (importing this
module needs the ``rllib`` extra). The worlds are those of a plain ``run``
(``--address``, or the embedded Catch server; ``--num-envs``, ``--seed``,
``--create-setting``, ``--on-failure``); ``run_rllink`` steps them for the
learners at the ``--rllib-server`` ports (``--rllib-agents N``: multi-agent
worlds, one policy shared by their agents). ``--rllib-policy random`` or
``MODULE:FUNCTION`` acts with that policy (off-policy episodes) instead of the
learner's RLModule (``--rllib-paced``: a round per training iteration).
``--rllib-lockstep`` waits for each round's weights before stepping on.
Progress notes (rounds shipped, waits for the learner) go to stderr unless
``--quiet``; the summary to stdout (``--json``: one object).

Exit codes: 0 when the rounds are done or the learner is gone for good (the
summary says which), 1 on an error (a learner never reached, spaces that do
not fit), 130/143 when Ctrl-C/SIGTERM stopped it (summary printed first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import threading
from collections.abc import Callable
from typing import Any

from ..._base.cli_args import UsageError
from ._rllink import RANDOM, RLlinkStats, run_rllink

_BAD_POLICY = (
    "--rllib-policy {value!r} is neither 'random' nor MODULE:FUNCTION (a policy(timestep) -> "
    "actions importable from the current directory or PYTHONPATH)."
)


def _policy(value: str | None) -> Any:
    if value is None or value == RANDOM:
        return value
    module, _, name = value.partition(":")
    if not module or not name:
        raise UsageError(_BAD_POLICY.format(value=value))
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"{_BAD_POLICY.format(value=value)} ({exc})") from exc


def rllink_command(
    args: argparse.Namespace,
    addresses: list[str],
    channel_kwargs: dict[str, Any],
    create_settings: dict[str, Any],
    join_settings: dict[str, Any],
    stop: threading.Event,
    say: Callable[[str], None],
) -> RLlinkStats:
    """Runs ``args`` (the ``run`` command's, with ``rllib_server``) through ``run_rllink``.

    Raises:
      UsageError: flags that do not go with ``--rllib-server``.
      LearnerUnreachableError, SpaceMismatchError, WorldError: from ``run_rllink``.
    """
    if args.world:
        raise UsageError("--rllib-server creates its worlds; it cannot join --world ones.")
    return run_rllink(
        addresses,
        args.rllib_server,
        num_envs=args.num_envs,
        num_agents=args.rllib_agents,
        policy=_policy(args.rllib_policy),
        rounds=args.rllib_rounds,
        seed=args.seed,
        seed_setting=args.seed_setting or None,
        on_world_failure=args.on_failure,
        timeout=args.timeout,
        wait=args.rllib_wait,
        learner_timeout=args.rllib_learner_timeout,
        steps_per_send=args.rllib_steps_per_send,
        lockstep=args.rllib_lockstep,
        paced=args.rllib_paced,
        stop=stop,
        say=say,
        create_world_settings=create_settings,
        join_world_settings=join_settings,
        **channel_kwargs,
    )


def print_rllink_summary(stats: RLlinkStats, *, as_json: bool) -> None:
    """Prints the run's summary: a table, or one JSON object."""
    data = stats.summary()
    if as_json:
        print(json.dumps(data), flush=True)
        return
    rows = [
        ("worlds", data["worlds"]),
        ("agents/world", data["agents"]),
        ("acted by", data["behavior"]),
        ("steps", data["steps"]),
        ("steps/s", data["steps_per_second"]),
        ("CPU µs/step", data["cpu_us_per_step"]),
        ("episodes", data["episodes"]),
        ("return mean", data["return_mean"]),
        ("rounds shipped", data["rounds"]),
        ("steps shipped", data["steps_shipped"]),
        ("unconfirmed", data["unconfirmed_steps"]),
        ("unshipped", data["unshipped_steps"]),
        ("weight updates", data["weight_updates"]),
        ("lagged steps", data["lagged_steps"]),
        ("cut by failures", data["truncated_by_failure"]),
        ("reconnects", len(data["reconnects"])),
        ("restarts", len(data["restarts"])),
        ("worlds lost", data["worlds_lost"]),
        ("ended", data["stop_reason"]),
    ]
    print("\n".join(f"{label:<16}{'n/a' if v is None else v}" for label, v in rows), flush=True)
