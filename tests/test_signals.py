"""Ctrl-C while the main thread waits on the stop event: the command's handler sets it safely.

``stop.set()`` in a signal handler deadlocks when the signal lands while the main thread
is inside ``stop.wait()`` holding the event's lock (measured: 178 of 300 children like these
hung with it, looping on ``stop.wait(0)``); ``dm-env-rpc-client serve`` once hung on Ctrl-C
so. ``_base.signals.set_from_handler`` sets it from another thread.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    from dm_env_rpc_client.cli import _stop_on_signals
    with _stop_on_signals() as (stop, received):
        print("ready", flush=True)
        while not stop.wait(0):  # as often inside the event's lock as a loop can be
            pass
    print("stopped", received, flush=True)
    """
)


def test_ctrl_c_stops_the_command_while_it_waits_on_the_stop_event_every_time() -> None:
    for _ in range(30):
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n"
            child.send_signal(signal.SIGINT)
            out, _ = child.communicate(timeout=30)  # a deadlocked child: the hang guard
            assert out == f"stopped [{int(signal.SIGINT)}]\n"
        finally:
            child.kill()
            child.wait()
