"""The ranks' process groups and the launcher's stop signals (hspmd.runtime.processes.launcher):
every rank leads a process group of its own (a session), so stopping it stops whatever it started;
a signal to the launcher is turned into a request its loop polls, never an interruption half-way
through starting or cleaning up the ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Sequence

POLL_S = 0.05
KILL_WAIT_S = 5.0  # after SIGKILL, how long the rest of a rank's group may take to go


def stop_groups(processes: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every process's group (each rank leads one), SIGKILL what is left after `grace`
    seconds, reap all. Groups of ranks that already exited are signalled too, so nothing they
    started outlives the job."""
    for process in processes:
        signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(group_alive(p.pid) for p in processes):
        for process in processes:
            process.poll()
        time.sleep(POLL_S)
    for process in processes:
        signal_group(process.pid, signal.SIGKILL)
        process.wait()
    # a rank is the guard's child: once the guard is reaped, wait (bounded) for the rest of each group
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and any(group_alive(p.pid) for p in processes):
        time.sleep(POLL_S)


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid`; a group already gone (or no longer ours) is left be."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """True while a process of group `pgid` runs (zombies, dead but not yet reaped, do not count)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


class StopRequest:
    """Set by a signal handler; polled by the launcher loop, so a signal never interrupts the
    start-up or the clean-up of the ranks half-way."""

    signal: str | None = None


def install_stop_handlers(stop: StopRequest) -> dict[int, object]:
    """Turn SIGINT / SIGTERM / SIGHUP into a clean stop of all ranks (only possible from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def request(signum, frame):
        stop.signal = stop.signal or signal.Signals(signum).name

    return {sig: signal.signal(sig, request) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def restore_handlers(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


__all__ = ["KILL_WAIT_S", "POLL_S", "StopRequest", "group_alive", "install_stop_handlers", "restore_handlers", "signal_group",
           "stop_groups"]
