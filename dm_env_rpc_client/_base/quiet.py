"""Keeps gRPC's C-core log lines off the terminal of the command line programs.

gRPC reads ``GRPC_VERBOSITY`` once, when ``grpc`` is imported, and importing
this package imports grpc before any command runs. So ``quiet_grpc_logs()``
(entered by the programs' entry points, never by the library) sets
``GRPC_VERBOSITY=NONE`` for child processes, and points this process's file
descriptor 2, where the C core writes, at ``/dev/null``, while Python's
``sys.stderr`` moves to a duplicate of the real standard error: everything
Python prints (errors, warnings, the progress bar) still shows. It is a context
manager: when the entry point returns, the variable, descriptor 2 and
``sys.stderr`` are as they were, so a program's ``main`` called from Python
leaves its caller's process as it found it.

Nothing is silenced with ``--debug``, or when ``GRPC_VERBOSITY`` is already set.

Library use: importing this module (the package's ``__init__`` does, before
anything else) loads grpc with ``GRPC_VERBOSITY=ERROR`` when the user has not
set the variable and grpc is not loaded yet, then takes the variable away again
(child processes see the environment as it was). gRPC's INFO lines, such as
``chttp2_transport.cc ... Got goaway`` at exit when a script's server stopped
while a connection was open, stay off a script's terminal; its ERROR lines
still show. Set ``GRPC_VERBOSITY`` (e.g. ``INFO``) to see everything.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def quiet_grpc_logs(argv: Sequence[str]) -> Iterator[bool]:
    """Silences gRPC's C-core logs for this program and its children, until the block ends.

    Args:
      argv: the program's arguments; ``--debug`` among them keeps the logs.

    Yields:
      Whether the logs are silenced. On leaving, ``GRPC_VERBOSITY``, file
      descriptor 2 and ``sys.stderr`` are put back as they were.
    """
    # GRPC_VERBOSITY=NONE (inherited from a parent that silenced itself) still silences: gRPC's
    # absl logging prints a bind failure's E line whatever the level, so stderr goes too.
    before = os.environ.get("GRPC_VERBOSITY")
    if "--debug" in argv or (before or "NONE").upper() != "NONE":
        yield False
        return
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield False  # no usable standard error: nothing to keep clean
        return
    python_stderr = sys.stderr
    os.environ["GRPC_VERBOSITY"] = "NONE"
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    ours = open(real, "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    sys.stderr = ours
    try:
        yield True
    finally:
        with contextlib.suppress(OSError, ValueError):
            ours.flush()
        os.dup2(real, 2)
        if sys.stderr is ours:
            sys.stderr = python_stderr
        ours.close()  # closes ``real``
        if before is None:
            os.environ.pop("GRPC_VERBOSITY", None)
        else:
            os.environ["GRPC_VERBOSITY"] = before


LIBRARY_VERBOSITY = "ERROR"  # gRPC's level in library use: its errors show, its chatter not


def _library_log_level() -> bool:
    """Loads grpc at ``LIBRARY_VERBOSITY`` unless the user chose a level or grpc is loaded.

    Returns:
      Whether this set the level.
    """
    if "grpc" in sys.modules or "GRPC_VERBOSITY" in os.environ:
        return False
    os.environ["GRPC_VERBOSITY"] = LIBRARY_VERBOSITY
    try:
        import grpc  # noqa: F401 - gRPC reads GRPC_VERBOSITY now, once
    finally:
        del os.environ["GRPC_VERBOSITY"]
    return True


_library_log_level()
