"""The `sluice serve` process's last step: `os._exit` once every atexit handler has run.

With triton loaded (vLLM imports it), the interpreter's teardown of the objects still alive
makes triton's nanobind bindings call each of theirs a leak (~30 lines on stderr at every
stop: a few `ir.attribute`s that live as long as the process, and every type and function of
the module). Nothing after the atexit handlers is worth that: threads have been joined (the
interpreter waits for them before it runs atexit), children ended (multiprocessing's own
handler), logs flushed here.

atexit runs its handlers last registered first, so `install` registers this one before any
library can (at the top of the `sluice` command): it runs after all of theirs, and ends the
process only if `exit_after_handlers` asked it to and triton is loaded; otherwise it returns to
a normal exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys


class _LastExit:
    def __init__(self) -> None:
        self.status: int | None = None

    def __call__(self) -> None:
        if self.status is None or "triton._C.libtriton" not in sys.modules:
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.status)


_LAST = _LastExit()


def install() -> None:
    """Register the last handler (once; call before anything registers its own)."""
    atexit.unregister(_LAST)
    atexit.register(_LAST)


def exit_after_handlers(status: int) -> None:
    """End the process with `status` once every atexit handler has run."""
    _LAST.status = status
