"""The SSE response every stream is sent with, on Starlette's public `StreamingResponse`.

The client leaving cancels the stream, as a disconnect must stop the generation behind it:
the stream runs inside the response's `ClientWatch` (one task per response besides the
request's own, opened here unless the response holds one already). Keep-alive pings are a
timer, not a task: every `ping_seconds` one comment (or the API's own ping event) is sent, from
a task made for that send alone. Every send is bounded by the server-wide `SendGuard` (no cancel
scope per token): a stalled client's stream is cancelled like one that left.

A stream's chunks may be written from another task than the request's (`write`: a run only
this reader reads writes its events itself, `GenerationRun.written`); the request's task then
waits in the content iterator for the run to end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.http.leaving import ClientWatch
from server.http.send_guard import SendGuard

PING = b": ping\n\n"  # a comment: every SSE client skips it
HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}  # no proxy buffers it


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        guard: SendGuard,
        *,
        headers: Mapping[str, str] | None = None,
        ping_seconds: float,
        ping: Callable[[], bytes] | None = None,
    ) -> None:
        super().__init__(content, headers={**HEADERS, **(headers or {})})
        self._guard = guard
        self._ping_seconds = ping_seconds
        self._ping = ping
        self._chunk: Send | None = None
        self._ping_send: Send | None = None
        self._ended = False
        self._pinged: asyncio.Task[None] | None = None  # the ping being sent, if any
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunk = self._chunk = self._guard.wrap(send)
        self._ping_send = self._guard.wrap(send)  # its own watch: it may overlap a chunk
        with ClientWatch(receive):
            await self._stream(chunk)

    async def _stream(self, chunk: Send) -> None:
        try:
            await chunk(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            self._arm()
            async for body in self.body_iterator:
                await chunk({"type": "http.response.body", "body": body, "more_body": True})
            if not self._ended:  # (`write` sent the last chunk and ended the body with it)
                await chunk({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._disarm()

    def write(self, chunk: bytes, *, final: bool = False) -> Awaitable[None]:
        """Send `chunk` now, from whichever task (a run's own: `GenerationRun.written`);
        `final`: the last, which ends the body in the same write (no ping after it)."""
        assert self._chunk is not None, "the response has begun"
        if final:
            self._disarm()
        return self._chunk({"type": "http.response.body", "body": chunk, "more_body": not final})

    def _arm(self) -> None:
        if not self._ended:
            self._timer = asyncio.get_running_loop().call_later(self._ping_seconds, self._ping_now)

    def _disarm(self) -> None:
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
        if self._pinged is not None:
            self._pinged.cancel()

    def _ping_now(self) -> None:
        self._pinged = asyncio.ensure_future(self._send_ping())

    async def _send_ping(self) -> None:
        body = PING if self._ping is None else self._ping()
        with contextlib.suppress(Exception):  # a failed ping ends nothing: the stream's send will
            assert self._ping_send is not None
            await self._ping_send({"type": "http.response.body", "body": body, "more_body": True})
        self._arm()
