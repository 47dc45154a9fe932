"""Python's cyclic garbage collector held off while a batch opens or closes its worlds.

Opening or closing thousands of worlds makes hundreds of thousands of short-lived
objects (futures, tasks, gRPC calls, answers), and every 700 of them start a
collection; every tenth of those, and every hundredth, scans more of what the
process holds, which with thousands of worlds open is itself hundreds of
thousands of objects. Measured closing 4,096 worlds: about 240 collections, 1.0 s
of the close's 2.0 s, none of which found anything to free. ``paused()`` turns
the collector off for the duration (reference counting still frees everything
at once; only reference cycles wait) and back on after, if it was on. It nests
(two batches opening or closing at once on two threads), and every pause it
covers is bounded by the operation's own timeout. A pause that keeps what it made
(``paused(keep=True)``: a batch's connect, whose worlds live until its close) ends by
putting everything tracked straight into the oldest generation, so no collection scans
the new worlds' objects on their way there (see ``paused``).

While a batch is open and steps, ``raise_young_threshold()`` raises the
young generation's threshold to ``STEPPING_THRESHOLD`` (if it is lower), and
``restore_young_threshold()`` (the batch's close) puts it back. A batch keeps
thousands of steps in flight, each holding a few tracked objects (gRPC's
write and read operations, the step's receiver) until it is answered: every
young collection scans all of them, and with a threshold of 700 one ran every
few hundred steps, measured at 1,024 worlds 6 µs of CPU per step against 0.3 µs
on bare ``grpc.aio``. A higher threshold runs proportionally fewer of them,
each scanning about as much. Reference counting still frees everything at once;
only reference cycles wait a little longer. Nested and counted like
``paused()``; the threshold is restored only if nobody changed it meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0  # pauses under way
_resume = False  # whether the first of them found the collector on
_keep = False  # whether one of them keeps what it made (``paused(keep=True)``)
# The young generation's threshold while a batch is open (Python's default is 700).
STEPPING_THRESHOLD = 50_000
_raisers = 0  # open batches holding the threshold raised
_saved: tuple[int, ...] | None = None  # the thresholds found by the first, if it raised them


@contextlib.contextmanager
def paused(keep: bool = False) -> Iterator[None]:
    """The collector off within the ``with`` block; as it was found after the last one ends.

    ``keep``: what the block makes lives on (a batch's worlds, until its close). Made with the
    collector off, it is all in the young generation, so the first collection after would
    scan every world's objects, and a later one again, before they reach the oldest
    generation, where they belong: 0.16 s of a 2.8 s connect of 4,096 worlds. With ``keep``,
    when the last pause ends with the collector back on, everything tracked goes straight
    to the oldest generation instead (``gc.freeze()`` and ``gc.unfreeze()``, which scan
    nothing), unless the process holds frozen objects of its own (``gc.get_freeze_count()``),
    which unfreezing would release, or the block raised. A reference cycle among young
    objects then waits for the next full collection.
    """
    global _holders, _resume, _keep
    with _lock:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    kept = False
    try:
        yield
        kept = keep  # a block that failed keeps nothing
    finally:
        with _lock:
            _holders -= 1
            _keep = _keep or kept
            if _holders == 0:
                if _resume and _keep and gc.get_freeze_count() == 0:
                    gc.freeze()  # every generation into the permanent one, the young count to 0
                    gc.unfreeze()  # and all of it back into the oldest
                _keep = False
                if _resume:
                    gc.enable()


def raise_young_threshold() -> None:
    """Raises the young generation's threshold to ``STEPPING_THRESHOLD`` (see the module);
    each call is undone by one ``restore_young_threshold()``."""
    global _raisers, _saved
    with _lock:
        if _raisers == 0:
            thresholds = gc.get_threshold()
            _saved = None
            if 0 < thresholds[0] < STEPPING_THRESHOLD:  # 0: collections are off, leave it
                _saved = thresholds
                gc.set_threshold(STEPPING_THRESHOLD, *thresholds[1:])
        _raisers += 1


def restore_young_threshold() -> None:
    """Undoes one ``raise_young_threshold()``; the last puts the threshold back as it was
    found, unless it was changed meanwhile."""
    global _raisers, _saved
    with _lock:
        if _raisers == 0:
            return
        _raisers -= 1
        if _raisers == 0 and _saved is not None:
            if gc.get_threshold()[0] == STEPPING_THRESHOLD:
                gc.set_threshold(*_saved)
            _saved = None
