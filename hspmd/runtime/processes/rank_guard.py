"""Runs one rank of `hspmd run` and ties its whole process group to the launcher's life.

Usage (by the launcher only): python rank_guard.py LAUNCHER_PID COMMAND...

The launcher starts this guard as the leader of a new session; the guard runs COMMAND (the rank)
in the same process group, so whatever the rank starts is in it too. If the launcher dies without
cleaning up (SIGKILL), the kernel sends the guard PARENT_DIED (prctl PR_SET_PDEATHSIG) and the
guard SIGKILLs the whole group: no rank or grandchild survives. Otherwise the guard waits for the
rank and exits the same way (code or signal). Signals the launcher sends reach the rank directly
(the launcher signals the group); the guard ignores SIGTERM/SIGINT and follows the rank.

This file is run by path and imports nothing from hspmd (starting a guard must stay cheap).
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
PARENT_DIED = signal.SIGUSR2  # a signal the launcher never sends


def _kill_group(*_) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: list) -> int:
    launcher, command = int(argv[0]), argv[1:]
    signal.signal(PARENT_DIED, _kill_group)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, PARENT_DIED)
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        _kill_group()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    cpus = os.environ.get("HSPMD_CPUS")  # `hspmd run --pin-cpus` (hspmd.runtime.processes.affinity)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    rank = subprocess.Popen(command, restore_signals=True,
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT)])
    code = rank.wait()
    if code < 0:  # mirror a death by signal, so the launcher reports it as the rank's
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be caught or reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
