"""The ``run`` command's pieces around the stepping loop: its servers and its summary.

The loop itself is the library's (``dmr.collect``, ``_stepping.loop``): ``cli.py``
calls it. ``launched`` starts the servers of ``run --launch``; ``summary`` is the
one dict both the table and ``--json`` print, and ``print_summary`` prints it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .._base.cli_args import check_launch_flags, token
from ..launch import LaunchedServers, launch
from ..stepping import RunStats


def launched(args: Any) -> LaunchedServers | None:
    """The servers of ``run --launch`` (started here; None without ``--launch``).

    Raises:
      UsageError: launch flags that do not go together.
      ServerLaunchError, ValueError: from ``dmr.launch``.
    """
    check_launch_flags(args)
    if not args.launch:
        return None
    return launch(
        args.launch,
        args.num_servers or 1,
        ready_timeout=max(60.0, args.timeout),
        token=token(args),
    )


def summary(stats: RunStats) -> dict[str, Any]:
    """The run's summary as one flat dict (the ``--json`` object; the table shows the same)."""
    returns = stats.returns
    latencies_ms = stats.latencies * 1e3

    def rounded(value: Any, digits: int = 3) -> float | None:
        return None if value is None else round(float(value), digits)

    return {
        "worlds": stats.worlds,
        "steps": stats.steps,
        "episodes": stats.episodes,
        "unfinished_episodes": stats.unfinished,
        "return_mean": rounded(np.mean(returns)) if returns else None,
        "return_min": rounded(min(returns)) if returns else None,
        "return_max": rounded(max(returns)) if returns else None,
        "steps_per_second": rounded(stats.steps / stats.elapsed, 1) if stats.elapsed else None,
        "latency_p50_ms": rounded(np.percentile(latencies_ms, 50)) if latencies_ms.size else None,
        "latency_p99_ms": rounded(np.percentile(latencies_ms, 99)) if latencies_ms.size else None,
        "world_seeds": stats.world_seeds,
        "recorded_to": stats.recorded,
        "recorded_episodes": stats.recorded_episodes,
        "recorded_truncated": stats.recorded_truncated,
        "restarts": stats.restarts,
        "worlds_lost": stats.worlds_lost,
        "relaunches": stats.relaunches,
        "interrupted": stats.interrupted,
    }


def _seeds_text(seeds: list[int | None]) -> str:
    if not seeds or all(seed is None for seed in seeds):
        return "none"
    if all(seed is not None for seed in seeds) and len(seeds) > 1:
        return f"{seeds[0]} to {seeds[-1]} (world i: {seeds[0]} + i)"
    return ", ".join("none" if seed is None else str(seed) for seed in seeds)


def print_summary(stats: RunStats, *, as_json: bool = False) -> None:
    """Prints the summary: a table, or one JSON object with ``as_json``."""
    data = summary(stats)
    if as_json:
        print(json.dumps(data), flush=True)
        return

    def number(key: str, digits: int = 3) -> str:
        value = data[key]
        return "n/a" if value is None else f"{value:.{digits}f}"

    rows = [
        ("worlds", str(data["worlds"])),
        ("steps", str(data["steps"])),
        ("episodes", str(data["episodes"])),
        ("unfinished", str(data["unfinished_episodes"])),
        ("return mean", number("return_mean")),
        ("return min", number("return_min")),
        ("return max", number("return_max")),
        ("steps/s", number("steps_per_second", 1)),
        ("latency p50 ms", number("latency_p50_ms")),
        ("latency p99 ms", number("latency_p99_ms")),
        ("world seeds", _seeds_text(data["world_seeds"])),
    ]
    if data["recorded_to"] is not None:
        rows.append(
            (
                "recorded to",
                f"{data['recorded_to']} ({data['recorded_episodes']} episodes, "
                f"{data['recorded_truncated']} of them truncated)",
            )
        )
    if data["restarts"] or data["worlds_lost"]:
        listed = "; ".join(data["restarts"]) or "none"
        rows.append(("restarts", f"{len(data['restarts'])} ({listed})"))
        rows.append(("worlds lost", str(data["worlds_lost"])))
    if data["relaunches"]:
        rows.append(("relaunches", f"{len(data['relaunches'])} ({'; '.join(data['relaunches'])})"))
    if data["interrupted"]:
        rows.append(("interrupted", "yes (Ctrl-C or SIGTERM)"))
    print("\n".join(f"{label:<16}{value}" for label, value in rows), flush=True)
