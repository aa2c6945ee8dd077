"""Bound every send to a client with one watchdog for the whole server.

A stalled client (its socket buffer full, its reader gone quiet) must not hold a stream, and
the engine request behind it, forever. A timer per send would cost a cancel scope per token;
instead each response's `send` is wrapped to note when its current send began, and one task
checks all of them every `interval` seconds, cancelling the task of any send that has been
blocked longer than `timeout`. A cancelled stream ends like a disconnect: its engine request
is aborted and its budgets released.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger("sluice.server")

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _InFlight:
    __slots__ = ("__weakref__", "since", "task")

    def __init__(self) -> None:
        self.since: float | None = None  # loop time the current send began, while in flight
        self.task: asyncio.Task[Any] | None = None


class SendGuard:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.interval = max(0.05, min(1.0, timeout / 4))
        self._streams: weakref.WeakSet[_InFlight] = weakref.WeakSet()
        self.stalled = 0

    def wrap(self, send: Send) -> Send:
        """`send` with its time in flight watched; the watch ends with the wrapper."""
        state = _InFlight()
        self._streams.add(state)
        loop = asyncio.get_running_loop()
        current_task = asyncio.current_task

        async def guarded(message: MutableMapping[str, Any]) -> None:
            state.since = loop.time()
            state.task = current_task()
            try:
                await send(message)
            finally:
                state.since = None

        return guarded

    def check(self, now: float) -> int:
        """Cancel sends in flight for longer than the timeout; return how many."""
        cancelled = 0
        for state in list(self._streams):
            since = state.since
            if since is not None and now - since > self.timeout and state.task is not None:
                state.task.cancel()
                state.since = None
                cancelled += 1
        self.stalled += cancelled
        return cancelled

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            if self.check(loop.time()):
                logger.info("dropped stalled client(s): no bytes accepted for %.1fs", self.timeout)
