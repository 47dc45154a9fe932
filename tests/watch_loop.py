"""A thin stepping loop that calls run observers as ``dmr.collect`` does (CONTRACTS.md 1).

Used by the watcher's tests and benchmark: random actions, one step in flight
per world, each batch received handed to ``on_steps`` before its next actions
are chosen, and the batch's failures to ``on_event``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dm_env_rpc_client import RestartPolicy, errors
from dm_env_rpc_client._watch.events import FailureEvents

# Restarts that give up fast, as in test_faults.py.
FAST = RestartPolicy(attempts=6, total=20.0, backoff=0.05, max_backoff=0.5, connect_timeout=1.0)


def watched_run(
    batch: Any,
    steps: int,
    observers: Sequence[Any] = (),
    *,
    stop: threading.Event | None = None,
    seed: int = 0,
    timeout: float = 30.0,
) -> int:
    """Steps ``batch`` until ``steps`` steps came back or ``stop`` is set; returns the steps."""
    stop = stop or threading.Event()
    rng = np.random.default_rng(seed)
    events = FailureEvents(batch)
    ids = list(batch.live_ids)
    if ids:
        batch.send(batch.random_actions(rng, env_ids=ids), ids)
    taken = 0
    deadline = time.monotonic() + timeout
    while taken < steps and not stop.is_set():
        try:
            result = batch.recv(1, timeout=0.25)
        except errors.RequestTimeoutError:
            if time.monotonic() > deadline:
                raise
            continue
        except errors.WorldError:
            continue  # a world removed with steps in flight: the others go on
        finally:
            for event in events.new():
                for observer in observers:
                    observer.on_event(event)
        deadline = time.monotonic() + timeout
        for observer in observers:
            observer.on_steps(result)
        taken += len(result.env_ids)
        ids = [w for w in result.env_ids.tolist() if w in batch.live_ids]
        if ids:
            batch.send(batch.random_actions(rng, env_ids=ids), ids)
    return taken
