"""`/v1/responses` lines of OpenAI's Batch API: each a `POST /v1/responses` body, answered whole
(its output line's body the response object), on its conversation where it names one. The
Batch API's runner, below this package, runs them through `ResponseLines`, as it runs its chat
lines; lines on one conversation run one after another (their `key`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.batch_api.lines import LineRun, no_stream
from server.core.errors import SluiceError
from server.generations.planner import RequestContext
from server.generations.reading import reader
from server.generations.run import GenerationRun
from server.generations.timeline import RequestTimeline
from server.observability.access_log import Api
from server.openai_wire.requests import parse_request
from server.openai_wire.wire import validated
from server.responses_api.service import Responses, read_whole
from server.responses_api.store import ResponseRecord
from server.responses_api.wire import CreateResponse


@dataclass(frozen=True, slots=True)
class ResponseRun:
    """A line's response, started: read whole, then ended as a response sent whole is (its
    items added to its conversation, if it completed; stored, unless `store: false`)."""

    responses: Responses
    record: ResponseRecord
    run: GenerationRun

    async def outcome(self) -> dict[str, Any] | SluiceError:
        try:
            async with reader(self.run, None):
                error = await read_whole(self.run, self.record.builder)
        finally:  # (cancelled with its batch: nothing kept, nothing added, the hold let go)
            await self.responses.ended(self.record)
        return self.record.snapshot() if error is None else error


@dataclass(frozen=True, slots=True)
class ResponseLines:
    """The Batch API's `LineEndpoint` for `/v1/responses`."""

    responses: Responses
    api: Api = "responses"

    def check(self, body: dict[str, Any]) -> None:
        request = validated(CreateResponse, body)
        no_stream(("stream", "background"), request)
        parse_request(request.chat_body([]), "chat")

    def key(self, body: dict[str, Any]) -> str | None:
        """The line's conversation (its body was checked whole when the batch was made: read
        here as it is, each time the runner looks at the line)."""
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        return conversation if isinstance(conversation, str) else None

    async def start(
        self, body: dict[str, Any], timeline: RequestTimeline, context: RequestContext
    ) -> LineRun:
        record = await self.responses.create(validated(CreateResponse, body), timeline, context)
        assert record.run is not None
        return ResponseRun(self.responses, record, record.run)
