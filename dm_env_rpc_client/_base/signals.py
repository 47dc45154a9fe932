"""Setting a ``threading.Event`` from a signal handler without deadlocking.

A Python signal handler runs on the main thread between two bytecodes, possibly
inside ``event.wait()`` while the main thread holds the event's lock (a plain
``Lock``): ``event.set()`` in the handler then waits for that lock for ever (the
main thread cannot go on until the handler returns). ``set_from_handler`` sets
the event from a new low-level thread instead (``_thread.start_new_thread`` takes
none of the ``threading`` module's locks, which the main thread may hold too),
and the handler returns at once.
"""

from __future__ import annotations

import _thread
import threading


def set_from_handler(event: threading.Event) -> None:
    """Sets ``event`` soon (within a thread switch), safely from a signal handler."""
    _thread.start_new_thread(event.set, ())
