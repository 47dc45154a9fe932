"""The garbage collector's young threshold while a batch is open (``_base.collector``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest

import dm_env_rpc_client as dmr
from dm_env_rpc_client._base import collector
from dm_env_rpc_client.server import Server


@pytest.fixture(autouse=True)
def default_thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_an_open_batch_raises_the_young_threshold_and_close_restores_it(
    catch_server: Server,
) -> None:
    with dmr.BatchedEnvironment.connect(catch_server.address, 2, timeout=10) as envs:
        assert gc.get_threshold() == (collector.STEPPING_THRESHOLD, 10, 10)
        envs.reset()
        assert envs.step({"paddle": np.zeros(2, np.int8)}).env_ids.tolist() == [0, 1]
    assert gc.get_threshold() == (700, 10, 10)
    envs.close()  # a second close changes nothing
    assert gc.get_threshold() == (700, 10, 10)


def test_two_batches_restore_it_when_the_last_closes(catch_server: Server) -> None:
    first = dmr.BatchedEnvironment.connect(catch_server.address, 1, timeout=10)
    second = dmr.BatchedEnvironment.connect(catch_server.address, 1, timeout=10)
    first.close()
    assert gc.get_threshold()[0] == collector.STEPPING_THRESHOLD  # the second is open
    second.close()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_threshold_changed_meanwhile_or_set_higher_is_left_alone(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(catch_server.address, 1, timeout=10):
        gc.set_threshold(1234, 5, 5)  # the user's own, while the batch is open
    assert gc.get_threshold() == (1234, 5, 5)
    gc.set_threshold(10 * collector.STEPPING_THRESHOLD, 10, 10)
    with dmr.BatchedEnvironment.connect(catch_server.address, 1, timeout=10):
        assert gc.get_threshold()[0] == 10 * collector.STEPPING_THRESHOLD
    assert gc.get_threshold()[0] == 10 * collector.STEPPING_THRESHOLD


def test_a_batch_leaves_a_collector_that_was_off_alone(catch_server: Server) -> None:
    gc.set_threshold(0)  # collections off by threshold
    with dmr.BatchedEnvironment.connect(catch_server.address, 1, timeout=10):
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold()[0] == 0


def oldest(thing: object) -> bool:
    """Whether ``thing`` is in the collector's oldest generation."""
    return any(other is thing for other in gc.get_objects(generation=2))


def test_connect_puts_its_worlds_in_the_oldest_generation(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(catch_server.address, 3, timeout=10) as envs:
        assert all(oldest(stream) for stream in envs._streams)
        assert gc.isenabled() and gc.get_freeze_count() == 0


def test_connect_leaves_objects_the_caller_froze_frozen(catch_server: Server) -> None:
    mine = [object()]
    gc.freeze()
    try:
        with dmr.BatchedEnvironment.connect(catch_server.address, 2, timeout=10) as envs:
            assert gc.get_freeze_count() > 0  # not released by the connect
            assert not oldest(mine) and not oldest(envs._streams[0])
    finally:
        gc.unfreeze()
