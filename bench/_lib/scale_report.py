"""``scale.py``'s rounds, floor-ratio targets and plot.

- ``server_count(worlds)``: 4 servers, 8 from ``WIDE_WORLDS`` (16,384) worlds on, to spare
  the servers' CPU (the client's cost is what is measured).
- ``median_round`` / ``cpu_range`` / ``ratio_text``: a size measured ``--rounds`` times is
  shown by its median round, its ratios by their median and range.
- ``ratio_target`` / ``phase_targets``: PASS/FAIL lines for client CPU per step against the
  raw gRPC stepping floor (``FLOOR_RATIO``, 1.15x, both ``send``/``recv`` and the run loop),
  RSS per world (``RSS_KB``, from 1,024 worlds) and connect and close against the opening floor
  (``_lib/open_floor.py``: wall seconds and the client's CPU).
- ``write_plot(path, points)``: CPU per step against worlds, the SDK (solid), the run loop
  (dotted) and the floor (dashed), one colour per server kind, as an SVG (matplotlib).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

SERVER_COUNT = 4
WIDE_WORLDS = 16_384
WIDE_SERVER_COUNT = 8
FLOOR_RATIO = 1.15  # client CPU per step, connect and close: at most this times the floor's
RSS_KB = 40.0
RSS_FROM_WORLDS = 1024  # RSS per world is held to RSS_KB from this many worlds on


def server_count(worlds: int) -> int:
    """How many servers a size runs on."""
    return WIDE_SERVER_COUNT if worlds >= WIDE_WORLDS else SERVER_COUNT


def servers_text(sizes: Sequence[int]) -> str:
    """'4', or '4 (8 from 16,384 worlds)'."""
    if max(sizes) < WIDE_WORLDS:
        return str(SERVER_COUNT)
    return f"{SERVER_COUNT} ({WIDE_SERVER_COUNT} from {WIDE_WORLDS:,} worlds)"


class PlotPoint(NamedTuple):
    """One size of one server kind, CPU µs per step (NaN: not measured)."""

    server: str
    worlds: int
    client_us: float
    client_range: tuple[float, float]
    floor_us: float = float("nan")
    floor_range: tuple[float, float] = (float("nan"), float("nan"))
    run_us: float = float("nan")


def median_round(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round whose client CPU per step is the median (the lower middle of an even count);
    with no steps (connect only), the first."""
    if "cpu_us" not in results[0]:
        return results[0]
    ordered = sorted(results, key=lambda result: result["cpu_us"])
    return ordered[(len(ordered) - 1) // 2]


def cpu_range(results: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """The least and most CPU µs per step over the rounds."""
    values = [result["cpu_us"] for result in results]
    return min(values), max(values)


def ratio_text(ratios: Sequence[float]) -> str:
    """'1.12x', or with several rounds '1.12x (1.08-1.19)'."""
    text = f"{statistics.median(ratios):.2f}x"
    if len(ratios) > 1:
        text += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return text


def ratio_target(server: str, worlds: int, what: str, ratios: Sequence[float]) -> str:
    """PASS/FAIL: the median round's client CPU per step over the floor's, at most
    ``FLOOR_RATIO``."""
    value = statistics.median(ratios)
    verdict = "PASS" if value <= FLOOR_RATIO else "FAIL"
    return (
        f"{verdict} {server}, {worlds:,} worlds: {what} client CPU per step vs the floor "
        f"{ratio_text(ratios)} (at most {FLOOR_RATIO})"
    )


def phase_targets(
    server: str, worlds: int, result: dict[str, Any], floor: dict[str, Any]
) -> list[str]:
    """PASS/FAIL: connect and close (wall and client CPU) against the opening floor, and RSS
    per world."""
    lines = []
    for phase in ("connect", "close"):
        for measure, name in (("wall", "wall"), ("cpu", "client CPU")):
            value = result[phase][measure] / max(floor[phase][measure], 1e-9)
            verdict = "PASS" if value <= FLOOR_RATIO else "FAIL"
            lines.append(
                f"{verdict} {server}, {worlds:,} worlds: {phase} {name} vs the floor "
                f"{value:.2f}x (at most {FLOOR_RATIO})"
            )
    rss = result["rss_kb"]
    if worlds < RSS_FROM_WORLDS:  # a process's fixed cost over few worlds: not the target
        return lines
    verdict = "PASS" if rss <= RSS_KB else "FAIL"
    lines.append(
        f"{verdict} {server}, {worlds:,} worlds: RSS per world {rss:.0f} KB (at most {RSS_KB:.0f})"
    )
    return lines


def write_plot(path: str, points: Sequence[PlotPoint]) -> None:
    """Writes CPU per step against worlds as an SVG (see the module docs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    servers = list(dict.fromkeys(point.server for point in points))
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for number, server in enumerate(servers):
        mine = sorted((p for p in points if p.server == server), key=lambda p: p.worlds)
        worlds = [p.worlds for p in mine]
        colour = colours[number % len(colours)]
        values = [(p.client_us, p.client_range) for p in mine]
        style = {"color": colour, "marker": "o", "linestyle": "-"}
        _with_ranges(axes, worlds, values, f"BatchedEnvironment send/recv, {server}", style)
        if any(p.run_us == p.run_us for p in mine):  # not all NaN
            axes.plot(
                worlds,
                [p.run_us for p in mine],
                color=colour,
                marker="^",
                linestyle=":",
                label=f"run loop (dmr.collect), {server}",
            )
        if any(p.floor_us == p.floor_us for p in mine):
            values = [(p.floor_us, p.floor_range) for p in mine]
            style = {"color": colour, "marker": "s", "linestyle": "--"}
            _with_ranges(axes, worlds, values, f"bare grpc.aio floor, {server}", style)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted({p.worlds for p in points}))
    axes.set_xticklabels([f"{w:,}" for w in sorted({p.worlds for p in points})])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("worlds in the batch")
    axes.set_ylabel("client CPU per step (µs, all threads)")
    axes.set_title("Client CPU per step against worlds (median round; bars: range)")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})
    plt.close(figure)


def _with_ranges(
    axes: Any,
    worlds: list[int],
    values: list[tuple[float, tuple[float, float]]],
    label: str,
    style: dict[str, str],
) -> None:
    """One line of medians, with bars from each point's least to its most round."""
    low = [median - least for median, (least, _) in values]
    high = [most - median for median, (_, most) in values]
    medians = [median for median, _ in values]
    axes.errorbar(worlds, medians, yerr=[low, high], capsize=3, label=label, **style)
