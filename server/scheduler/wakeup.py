"""The asyncio shells' one timer: fire at the core's next wake-up time, re-armed only when it
changes. Both runtimes (continuous and batch) ask their core for that time after every
decision and hand it here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class WakeupTimer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self._at: float | None = None

    def arm(self, wake: float | None, now: float) -> None:
        """Fire at `wake` (same clock as `now`); None means no wake-up is needed."""
        if wake == self._at:
            return
        self.cancel()
        self._at = wake
        if wake is not None:
            self._handle = asyncio.get_running_loop().call_later(max(0.0, wake - now), self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._at = None

    def _fire(self) -> None:
        self._handle = None
        self._at = None
        self._callback()
