"""The client's leaving, watched once per response.

uvicorn tells a request that its client left only through `receive` (an ASGI
`http.disconnect`); a send to a client that left is silently dropped (ASGI 2.3). So one task
per response awaits that message, and when it comes cancels the task the response runs in:
whatever it waits for (a dispatch, the next token, a send) ends at once, and the engine request
behind it with it. The cancellation ends at the watch: the response simply returns.

A watch opened while the same task already holds one is that one (no second task), so a
response can wait for its run's dispatch and then stream, inside one watch, through helpers
that each watch when called alone. The request's body must be read before a watch begins.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any

from starlette.types import Receive

_held: ContextVar[ClientWatch | None] = ContextVar("sluice_client_watch", default=None)


class ClientWatch:
    __slots__ = ("_gone", "_held", "_receive", "_task", "left")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.left = False  # the client left while the watch was held (this one, not an outer)
        self._task: asyncio.Task[Any] | None = None
        self._gone: asyncio.Task[None] | None = None
        self._held: Token[ClientWatch | None] | None = None

    def __enter__(self) -> ClientWatch:
        task = asyncio.current_task()
        outer = _held.get()
        if outer is not None and outer._task is task:
            return self  # the outer watch stands for this one
        self._task = task
        self._held = _held.set(self)
        self._gone = asyncio.ensure_future(_disconnect(self._receive))
        self._gone.add_done_callback(self._client_left)
        return self

    def _client_left(self, gone: asyncio.Future[None]) -> None:
        if gone.cancelled():
            return  # the block ended first
        gone.exception()  # (a `receive` that failed: the connection is gone all the same)
        if self._held is not None:  # (a callback run after the block: nothing to stop)
            self.left = True
            assert self._task is not None
            self._task.cancel()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if self._held is None:
            return False  # an inner watch: the outer one ends the cancellation
        _held.reset(self._held)
        self._held = None  # first, with no await before it: `_client_left` cancels no more
        assert self._gone is not None and self._task is not None
        self._gone.cancel()
        if self.left and kind is not None and issubclass(kind, asyncio.CancelledError):
            self._task.uncancel()
            return True  # the client left: the response simply ends
        return False


async def unless_gone(waiting: Awaitable[Any], receive: Receive) -> bool:
    """Await `waiting` unless the client leaves first; whether it finished. (Inside a watch
    the task holds already, a client that leaves ends that watch's block instead.)"""
    with ClientWatch(receive) as watch:
        await waiting
    return not watch.left


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
