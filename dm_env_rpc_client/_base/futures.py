"""A Future whose ``result(timeout)`` and ``exception(timeout)`` raise the SDK's timeout error.

``concurrent.futures.Future.result(timeout)`` raises a bare, empty
``TimeoutError()``; ``TimedFuture`` raises ``RequestTimeoutError`` with a
message that names the request and says it is still in flight (it is also a
``concurrent.futures.TimeoutError``, so ``except`` of that keeps working).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from .. import errors

RESULT_TIMEOUT = (
    "No response to the {what} within {timeout} s of waiting for its result; it is still in "
    "flight: call result() again to wait longer, or close the environment to give it up."
)


class TimedFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A ``concurrent.futures.Future`` whose waits time out with ``RequestTimeoutError``."""

    what = "request"

    def result(self, timeout: float | None = None) -> Any:
        """As ``Future.result``.

        Raises:
          RequestTimeoutError: no result within ``timeout`` seconds.
        """
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError as exc:
            if isinstance(exc, errors.DmEnvRpcClientError):  # the request's own timeout
                raise
            raise self._timed_out(timeout) from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As ``Future.exception``.

        Raises:
          RequestTimeoutError: not done within ``timeout`` seconds.
        """
        try:
            return super().exception(timeout)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(timeout) from None

    def _timed_out(self, timeout: float | None) -> errors.RequestTimeoutError:
        return errors.RequestTimeoutError(RESULT_TIMEOUT.format(what=self.what, timeout=timeout))
