"""`sluice serve` in a terminal: Ctrl-C for Sluice alone, so that it drains.

A terminal sends Ctrl-C's SIGINT to every process of its foreground process group, and vLLM's
engine processes are in it: each stops at once on its own handler, and the streams Sluice was
draining end with `engine_unavailable`. So, in a terminal, `sluice serve` runs the server in a
child process with a process group of its own (its engine's processes join that group), and
forwards the signals it gets to that child alone: the first Ctrl-C drains, a second stops at
once, as without a terminal. The child gets SIGTERM if this process dies (`PR_SET_PDEATHSIG`),
so a killed terminal leaves nothing behind. Outside a terminal (an orchestrator, a test, a
benchmark) the server is the process itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

SUPERVISED = "SLUICE_SUPERVISED"  # set in the child: it serves, never supervises again
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_PR_SET_PDEATHSIG = 1


def in_terminal() -> bool:
    """Whether this process is in its terminal's foreground process group (and not already
    the supervised server)."""
    if os.environ.get(SUPERVISED):
        return False
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):  # no terminal on stdin (or no stdin)
        return False


def supervise(argv: Sequence[str]) -> int:
    """Run `sluice <argv>` in a child in its own process group; forward the signals this
    process gets to it; its exit status (128 + the signal that killed it, as a shell says)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "server.cli", *argv],
        env={**os.environ, SUPERVISED: "1"},
        process_group=0,
    )

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = child.wait()  # (a signal's handler runs, and the wait goes on)
    return 128 - status if status < 0 else status


def die_with_parent() -> None:
    """In the supervised child: SIGTERM when the supervisor dies (Linux; elsewhere nothing)."""
    if not os.environ.get(SUPERVISED):
        return
    terminate_with_parent()
    if os.getppid() == 1:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def terminate_with_parent() -> None:
    """This process gets SIGTERM when its parent dies, however (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
