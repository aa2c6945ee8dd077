"""The SSE response every stream is sent with: sse-starlette's (pings, the disconnect
listener, one task group per stream), with its sends bounded by the server-wide `SendGuard`
(no cancel scope per token) and its body chunks written straight to the server.

Starlette's middlewares wrap `send` to watch a response's start (its status, whether it
began); a body chunk only passes through them, three wrappers a token. The app keeps the
server's own `send` in the scope (`RAW_SEND`, set by `SluiceApp`), and a stream's chunks go
there; its start and its end go through the middlewares as every response's do.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.types import Message, Receive, Scope, Send

from server.api.send_guard import SendGuard

RAW_SEND = "sluice.send"  # the scope's key for the server's own send


class SSEResponse(EventSourceResponse):
    def __init__(self, content: Any, guard: SendGuard, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._guard = guard
        self._chunk: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._chunk = self._guard.wrap(scope.get(RAW_SEND, send))
        await super().__call__(scope, receive, self._guard.wrap(send))

    def write(self, chunk: bytes) -> Awaitable[None]:
        """Send `chunk` now, from whichever task (a run's own: `GenerationRun.written`)."""
        assert self._chunk is not None, "the response has begun"
        return self._chunk({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        # sse-starlette's hook for each chunk and ping (its per-send timeout in 3.x): the
        # guard bounds them instead.
        assert self._chunk is not None
        await self._chunk(message)
