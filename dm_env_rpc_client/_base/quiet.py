"""Keeps gRPC's C-core log lines off the terminal of the command line programs.

gRPC reads ``GRPC_VERBOSITY`` once, when ``grpc`` is imported, and importing
this package imports grpc before any command runs. So ``quiet_grpc_logs()``
(called by the programs' entry points, never by the library) sets
``GRPC_VERBOSITY=NONE`` for child processes, and points this process's file
descriptor 2, where the C core writes, at ``/dev/null``, while Python's
``sys.stderr`` moves to a duplicate of the real standard error: everything
Python prints (errors, warnings, the progress bar) still shows.

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

import os
import sys
from collections.abc import Sequence


def quiet_grpc_logs(argv: Sequence[str]) -> bool:
    """Silences gRPC's C-core logs for this program and its children.

    Args:
      argv: the program's arguments; ``--debug`` among them keeps the logs.

    Returns:
      Whether the logs were silenced.
    """
    # GRPC_VERBOSITY=NONE (inherited from a parent that silenced itself) still silences: gRPC's
    # absl logging prints a bind failure's E line whatever the level, so stderr goes too.
    if "--debug" in argv or os.environ.get("GRPC_VERBOSITY", "NONE").upper() != "NONE":
        return False
    os.environ["GRPC_VERBOSITY"] = "NONE"
    try:
        sys.stderr.flush()
        real = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):
        return False  # no usable standard error: nothing to keep clean
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = open(  # noqa: SIM115 - lives as long as the program
        real, "w", buffering=1, encoding="utf-8", errors="backslashreplace"
    )
    return True


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
