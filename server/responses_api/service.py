"""Responses made, read and cancelled: each one a chat generation (`Generations`, so the
scheduler, tenants, timelines and the access log are the chat's), whose log is read into a
response object and its events by a `ResponseBuilder`.

A response answered whole or streamed has one reader, its client, and ends with it; a
background response has one more, its keeper, which reads it to its end (it runs on without
a client), and its log is kept, so that a stream of it can start from any event."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from server.core.errors import (
    GenerationCancelled,
    InvalidRequest,
    ResourceNotFound,
    SluiceError,
)
from server.generations.log import Event, Kind
from server.generations.planner import RequestContext
from server.generations.run import GenerationRun
from server.generations.service import Generations
from server.generations.timeline import RequestTimeline
from server.openai.requests import parse_request
from server.openai.responses_api import CreateResponse, ResponseBuilder
from server.openai.responses_api import Event as ResponseEvent
from server.responses_api.store import ResponseRecord, ResponseStore

CANCEL_WAIT_SECONDS = 10.0  # for a cancelled background generation to end


def feed(builder: ResponseBuilder, event: Event) -> list[ResponseEvent]:
    """A run's event into the response: the response's events it makes."""
    if event.kind is Kind.PIECE:
        fields = event.fields
        if fields is None:
            return builder.text(event.text, event.logprobs) if event.text or event.logprobs else []
        made = builder.text(fields["content"], event.logprobs) if fields.get("content") else []
        if fields.get("tool_calls"):
            made += builder.tool_calls(fields["tool_calls"])
        return made
    if event.final is not None:
        return builder.finish(event.final["finish_reason"], event.final["usage"])
    if event.kind is Kind.FAILED and not event.local and event.error is not None:
        error = event.error
        cancelled = isinstance(error, GenerationCancelled)
        return builder.fail(error.to_body()["error"], cancelled=cancelled)
    return []


async def replay(run: GenerationRun, builder: ResponseBuilder) -> AsyncIterator[ResponseEvent]:
    """The response's events from its first, live to its end, as `builder` makes them."""
    for made in builder.start():
        yield made
    async for _, event in run.events(0):
        for made in feed(builder, event):
            yield made


@dataclass(slots=True)
class Responses:
    """Every stored response, and how to make, find and cancel one."""

    generations: Generations
    store: ResponseStore
    _keepers: set[asyncio.Task[None]] = field(default_factory=set)

    def tenant(self, context: RequestContext) -> str:
        """The caller's tenant's name (401 for a missing or wrong key)."""
        return self.generations.planner.tenant_of(context).name

    async def create(
        self, request: CreateResponse, timeline: RequestTimeline, context: RequestContext
    ) -> ResponseRecord:
        """The response's record, its generation admitted and started (a background one
        stored, and kept running). Raises a SluiceError for anything refused; nothing is held
        when it does."""
        tenant = self.tenant(context)
        earlier: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.find(tenant, request.previous_response_id, "previous_response_id")
            if not previous.builder.ended:
                raise InvalidRequest(
                    f"response '{request.previous_response_id}' has not ended yet",
                    param="previous_response_id",
                )
            earlier = previous.conversation
        background = bool(request.background)
        if background and request.store is False:
            raise InvalidRequest("a background response must be stored", param="store")
        chat = request.chat_body(earlier)
        parsed = parse_request(chat, "chat")
        if background:
            run = self.generations.generate_kept(parsed, timeline, context)
        else:
            run, _ = await self.generations.generate(
                parsed, chat, timeline, context, None, stream=True
            )
        builder = ResponseBuilder(
            "resp_" + uuid.uuid4().hex, run.shape.model, int(time.time()), request.echoed()
        )
        record = ResponseRecord(
            tenant, builder, [*earlier, *request.messages()], run, background=background
        )
        if background:
            self.store.add(record)
            run.attach()  # the keeper's: it runs on with no client
            task = asyncio.get_running_loop().create_task(self._keep(record, run))
            self._keepers.add(task)
            task.add_done_callback(self._keepers.discard)
        return record

    async def _keep(self, record: ResponseRecord, run: GenerationRun) -> None:
        try:
            async for _ in replay(run, record.builder):
                pass
        finally:
            run.detach()
            self.ended(record)

    def ended(self, record: ResponseRecord) -> None:
        """A response's generation ended, read to its end by `record.builder`: kept, if it is
        to be (its conversation then ends with its output)."""
        if record.settled.is_set():
            return
        record.settled.set()
        record.conversation = [*record.conversation, *record.builder.conversation()]
        if record.background:
            self.store.ended(record)
        else:
            record.run = None  # (its log is its one reader's)
            if record.builder.echoed["store"] and record.builder.status in (
                "completed",
                "incomplete",
            ):
                self.store.add(record)
                self.store.ended(record)

    def find(self, tenant: str, response_id: str, param: str = "id") -> ResponseRecord:
        record = self.store.get(tenant, response_id)
        if record is None:
            raise ResourceNotFound(f"no response '{response_id}'", param=param)
        return record

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any]:
        """Cancel a background response; the response object once it has ended."""
        record = self.find(tenant, response_id)
        if not record.background or record.run is None:
            raise InvalidRequest("only a background response can be cancelled", param="response_id")
        record.run.cancel(GenerationCancelled("the response was cancelled"))
        try:
            await asyncio.wait_for(record.settled.wait(), CANCEL_WAIT_SECONDS)
        except TimeoutError:
            raise SluiceError("the response did not stop in time; retry") from None
        return record.builder.snapshot()
