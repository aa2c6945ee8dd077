"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request is a chat generation in Anthropic's shape: its body becomes the chat
request Sluice runs (`server.anthropic.messages`), made a `GenerationRun` by the same
`Generations` (tenants, scheduler, timeline, access log: api "messages"), and answered by a
reader of that run's log that renders Anthropic's message, or its stream's events, and its
errors in Anthropic's error shape with Sluice's statuses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from server.anthropic.messages import parse_count_tokens, parse_messages
from server.anthropic.replies import MessageStream, error_body, message_reply
from server.core.errors import SluiceError
from server.core.ids import public_id
from server.generations.log import Kind
from server.generations.run import GenerationRun
from server.http.edge import context_of
from server.http.replies import JSONResponse, error_response, read_json
from server.http.run_response import RunResponse
from server.http.services import Services


def anthropic_error(error: SluiceError, request_id: str | None = None) -> JSONResponse:
    """`error` in Anthropic's shape, with its status (and Retry-After where it has one)."""
    return error_response(error, request_id, error_body(error))


async def messages(services: Services, request: Request) -> ASGIApp:
    timeline = services.timeline_of(request, "messages")
    try:
        body = await read_json(request, services.edge.max_body_bytes)
        request_body, chat, parsed = parse_messages(body)
        services.note_ignored("messages", request.url.path, request_body)
        run, replayed = await services.generations.generate(
            parsed,
            body,
            timeline,
            context_of(request),
            request.headers.get("idempotency-key"),
            stream=parsed.stream,
            request=chat,
        )
    except SluiceError as error:
        timeline.fail(error)
        return anthropic_error(error, timeline.request_id)
    return MessageResponse(services, run, replayed=replayed)


async def count_tokens(services: Services, request: Request) -> Response:
    """The prompt's tokens after the chat template (tools included), without generating."""
    try:
        planner = services.planner
        tenant = planner.tenant_of(context_of(request))
        body, _, parsed = parse_count_tokens(await read_json(request, services.edge.max_body_bytes))
        services.note_ignored("messages", request.url.path, body)
        planner.check_model(parsed.model, tenant)
        assert parsed.messages is not None
        tools = planner.plan_output(parsed).tools
        tokens = planner.render_chat(parsed.messages, tools, parsed.template_kwargs)
    except SluiceError as error:
        return anthropic_error(error)
    return JSONResponse({"input_tokens": len(tokens)})


def _ping() -> bytes:
    return b'event: ping\ndata: {"type": "ping"}\n\n'


class MessageResponse(RunResponse):
    """ASGI response: one reader of a chat run, answering in Anthropic's shape (its
    lifecycle is `RunResponse`'s: refusals before dispatch are HTTP statuses, a failure after
    the stream began ends it with an `error` event)."""

    ping = staticmethod(_ping)

    def __init__(self, services: Services, run: GenerationRun, *, replayed: bool) -> None:
        super().__init__(services, run, replayed=replayed)
        self.message_id = public_id("message", run.shape.response_id)

    def error(self, error: SluiceError) -> Response:
        return anthropic_error(error, self.run.timeline.request_id)

    def whole(self, body: dict[str, Any]) -> Response:
        return JSONResponse(message_reply(body, self.message_id), headers=self.headers)

    async def _events(self) -> AsyncIterator[bytes]:
        """Every event of the run as Anthropic's, all that are ready in one write."""
        run = self.run
        stream = MessageStream(self.message_id, run.shape.model, run.timeline.prompt_tokens)
        parsed = run.shape.new_parser is not None  # a parser's fields, else the text itself
        yield stream.start()
        async for _, batch in run.log.batches(0):
            out = b""
            for event in batch:
                if event.kind is Kind.PIECE:
                    if not parsed:
                        out += stream.text(event.text)
                    elif event.fields:
                        out += stream.fields(event.fields)
                elif event.kind is Kind.FINISH and event.final is not None:
                    final = event.final
                    out += stream.finish(
                        final["finish_reason"],
                        final.get("stop_reason"),
                        final["usage"],
                    )
                elif event.kind is Kind.FAILED and event.error is not None:
                    out += stream.error(event.error)
            if out:
                yield out
