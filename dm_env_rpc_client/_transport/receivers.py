"""A pending request's receiver that takes its response in place of a Future (``_Callback``).

``AsyncConnection._submit_callback`` queues a request whose response the loop
consumes itself (a batch's steps): the reader hands the response's bytes to the
receiver (``answer``) as it reads them, with no Future, no done callbacks and
no loop turn in between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class _Callback:
    """A pending request's receiver that calls ``callback(result, error)`` at once.

    It stands in for the request's Future where the loop itself consumes the
    response (``_submit_callback``): no Future, no done callbacks, and no loop
    turn between reading a response and handling it. An exception of the
    callback goes to the loop's exception handler, never into the reader. A
    subclass may override ``_run`` instead of holding a callback (a batch's
    receiver holds the step's own few values: one object per step in flight,
    not a callback, a bound method and a partial that the GC would scan). It is
    its own pending item (``messages.PendingLike``: ``future`` is itself), so no
    ``Pending`` is made for it either.
    """

    __slots__ = ("_callback", "decode")

    expected = ""  # a pending item's other fields (messages.PendingLike)
    response_type: type | None = None

    def __init__(self, callback: Callable[[Any, BaseException | None], None]) -> None:
        self._callback = callback
        self.decode: Callable[[bytes], Any] | None = None

    @property
    def future(self) -> _Callback:
        return self

    def done(self) -> bool:
        return False  # each pending request is completed once

    def set_result(self, result: Any) -> None:
        self._call(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._call(None, error)

    def _run(self, result: Any, error: BaseException | None) -> None:
        self._callback(result, error)

    def _call(self, result: Any, error: BaseException | None) -> None:
        try:
            self._run(result, error)
        except Exception as exc:
            _callback_failed(exc)

    def answer(self, data: bytes) -> None:
        """Takes the response's bytes (the reader's call): ``decode(data)``, or its error,
        to the callback; what ``PendingQueue.complete`` does, in one call. A subclass may
        override it to take the bytes itself (a batch's step decodes them as it files them)."""
        assert self.decode is not None
        try:
            result = self.decode(data)
        except Exception as exc:  # its own errors, as they are (as PendingQueue.complete)
            self._call(None, exc)
        else:
            self._call(result, None)


def _callback_failed(exc: Exception) -> None:
    """A response callback raised: the loop's exception handler has it (never the reader)."""
    asyncio.get_running_loop().call_exception_handler(
        {"message": "dm_env_rpc_client: a response callback failed", "exception": exc}
    )
