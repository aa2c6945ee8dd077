"""One reader of a generation run, as an ASGI response: OpenAI's wire by default, another
API's by overriding it (Anthropic's), with one lifecycle for all."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.core.errors import SluiceError
from server.generations.reading import reader, sse
from server.generations.run import GenerationRun
from server.http.leaving import ClientWatch
from server.http.replies import JSONResponse, error_response
from server.http.services import Services
from server.http.sse import SSEResponse


class RunResponse:
    """ASGI response: one reader of a run. It waits (watching for the client leaving) for the
    run's dispatch, then streams its events after `after` under their ids; or, answered
    whole, for its end, then replies.

    Refusals before dispatch are real HTTP statuses (401/429/503/504 with Retry-After);
    failures after the stream started end it with an error event and `[DONE]`.

    Another API's reply to a run (Anthropic's) overrides the wire: `error`, `whole`,
    `_events` and `ping`; the reader's lifecycle stays this one.
    """

    ping: Callable[[], bytes] | None = None  # the keep-alive event (None: an SSE comment)

    def __init__(
        self, services: Services, run: GenerationRun, *, after: int = 0, replayed: bool = False
    ) -> None:
        self.services = services
        self.run = run
        self.after = after
        self.headers = {"X-Request-Id": run.timeline.request_id}
        self._response: SSEResponse | None = None  # a stream's, once it has begun
        if replayed:
            self.headers["Idempotent-Replayed"] = "true"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        run, stream = self.run, self.run.shape.stream
        # The client leaving ends the block (the run is cancelled if it was the last reader).
        with ClientWatch(receive):
            async with reader(run, "dispatched" if stream else "ended") as failure:
                if failure is not None:
                    response: Response | SSEResponse = self.error(failure)
                elif stream:
                    response = self._response = self.services.edge.sse(
                        self._events(), self.headers, self.ping
                    )
                else:
                    error = run.log[-1].error
                    body = run.log[-1].body or {}
                    response = self.error(error) if error is not None else self.whole(body)
                await response(scope, receive, send)

    def error(self, error: SluiceError) -> Response:
        return error_response(error, self.run.timeline.request_id)

    def whole(self, body: dict[str, Any]) -> Response:
        return JSONResponse(body, headers=self.headers)

    async def _events(self) -> AsyncIterator[bytes]:
        """The events after `after`: all that are ready when the reader wakes, in one write
        (merged into one chunk where they can be: `Edge.coalesce`). A run only this reader
        can read writes them itself, as it logs them (`GenerationRun.written`)."""
        run, merge = self.run, self.services.edge.coalesce
        if run.writable and self._response is not None:
            write = self._response.write
            await run.written(
                lambda last, batch, final: write(sse(run, last, batch, merge), final=final)
            )
            return
        async for last, batch in run.log.batches(self.after):
            yield sse(run, last, batch, merge)
