"""The run command's statistics: merging shards and the summary built from them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dm_env_rpc_client._cli.run import print_summary, summary
from dm_env_rpc_client.stepping import RunStats


def test_merging_shards_sums_counts_and_takes_percentiles_over_every_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = np.random.default_rng(0)
    fast, slow = rng.uniform(0.001, 0.002, 900), rng.uniform(0.1, 0.2, 100)
    shards = [
        RunStats(worlds=2, steps=900, episodes=9, unfinished=2, returns=[1.0] * 9,
                 latencies=fast, elapsed=2.0, world_seeds=[0, 1]),
        RunStats(worlds=1, steps=100, episodes=1, unfinished=1, returns=[-1.0],
                 latencies=slow, elapsed=4.0, world_seeds=[2], interrupted=True),
    ]  # fmt: skip
    merged = RunStats.merge(shards)
    data = summary(merged)
    assert (data["worlds"], data["steps"], data["episodes"], data["unfinished_episodes"]) == (
        3, 1000, 10, 3,
    )  # fmt: skip
    assert data["return_mean"] == 0.8 and data["return_min"] == -1.0
    assert data["steps_per_second"] == 250.0  # the shards ran side by side: the longest counts
    everything = np.concatenate([fast, slow]) * 1e3
    assert data["latency_p99_ms"] == round(float(np.percentile(everything, 99)), 3)
    assert data["latency_p99_ms"] > 100  # not an average of the shards' percentiles
    assert data["world_seeds"] == [0, 1, 2] and data["interrupted"] is True
    print_summary(merged, as_json=True)
    assert json.loads(capsys.readouterr().out) == data
    print_summary(merged)
    table = capsys.readouterr().out
    assert "world seeds     0 to 2 (world i: 0 + i)" in table and "interrupted     yes" in table


def test_an_empty_run_has_no_numbers_to_make_up() -> None:
    data = summary(RunStats.merge([RunStats(worlds=1, world_seeds=[None])]))
    assert data["return_mean"] is None and data["latency_p50_ms"] is None
    assert data["steps_per_second"] is None and data["steps"] == 0
