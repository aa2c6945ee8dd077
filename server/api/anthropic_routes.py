"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request is a chat generation in Anthropic's shape: its body becomes the chat
request Sluice runs (`server.anthropic.messages`), made a `GenerationRun` by the same
`Generations` (tenants, scheduler, timeline, access log: api "messages"), and answered by a
reader of that run's log that renders Anthropic's message, or its stream's events, and its
errors in Anthropic's error shape with Sluice's statuses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.anthropic.messages import parse_count_tokens, parse_messages
from server.anthropic.replies import MessageStream, error_body, message_reply
from server.api.edge import context_of, request_id_from, unless_gone
from server.api.openai_routes import GuardedEventSourceResponse, JSONResponse, read_json
from server.api.services import Services
from server.core.errors import SluiceError
from server.generations.log import Kind
from server.generations.run import GenerationRun
from server.generations.timeline import RequestTimeline


def anthropic_error(error: SluiceError, request_id: str | None = None) -> JSONResponse:
    """`error` in Anthropic's shape, with its status (and Retry-After where it has one)."""
    headers = error.headers()
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


async def messages(services: Services, request: Request) -> ASGIApp:
    timeline = RequestTimeline(
        request_id=request_id_from(request.headers.get("x-request-id")),
        model=services.served_model,
        api="messages",
        metrics=services.metrics,
    )
    try:
        body = await read_json(request, services.edge.max_body_bytes)
        _, chat, parsed = parse_messages(body)
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
        timeline.finish(error.outcome, status=error.status, error=error)
        return anthropic_error(error, timeline.request_id)
    return MessageResponse(services, run, replayed=replayed)


async def count_tokens(services: Services, request: Request) -> Response:
    """The prompt's tokens after the chat template (tools included), without generating."""
    try:
        planner = services.planner
        planner.tenant_of(context_of(request))
        _, parsed = parse_count_tokens(await read_json(request, services.edge.max_body_bytes))
        planner.check_model(parsed.model)
        assert parsed.messages is not None
        tools = planner.plan_output(parsed).tools
        tokens = planner.render_chat(parsed.messages, tools, parsed.template_kwargs)
    except SluiceError as error:
        return anthropic_error(error)
    return JSONResponse({"input_tokens": len(tokens)})


def _ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data='{"type": "ping"}')


class MessageResponse:
    """ASGI response: one reader of a chat run, answering in Anthropic's shape. As
    `RunResponse`: it waits (watching for the client leaving) for the run's dispatch (a
    stream) or end (a whole message); refusals before dispatch are HTTP statuses, a failure
    after the stream began ends it with an `error` event."""

    def __init__(self, services: Services, run: GenerationRun, *, replayed: bool) -> None:
        self.services = services
        self.run = run
        self.message_id = "msg_" + run.shape.response_id
        self.headers = {"X-Request-Id": run.timeline.request_id}
        if replayed:
            self.headers["Idempotent-Replayed"] = "true"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        run, edge = self.run, self.services.edge
        with run.reading():
            stream = run.shape.stream
            if not await unless_gone(run.started() if stream else run.until_ended(), receive):
                return  # the client left (the run is cancelled if it was the last reader)
            failure = run.failure
            if failure is not None:
                await anthropic_error(failure, run.timeline.request_id)(scope, receive, send)
                return
            if stream:
                await GuardedEventSourceResponse(
                    self._events(),
                    headers=self.headers,
                    ping=edge.ping_seconds,
                    ping_message_factory=_ping,
                )(scope, receive, edge.send_guard.wrap(send))
                return
            last = run.log[-1]
            response = (
                anthropic_error(last.error, run.timeline.request_id)
                if last.error is not None
                else JSONResponse(
                    message_reply(last.body or {}, self.message_id), headers=self.headers
                )
            )
            await response(scope, receive, send)

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
                        final["usage"]["completion_tokens"],
                    )
                elif event.kind is Kind.FAILED and event.error is not None:
                    out += stream.error(event.error)
            if out:
                yield out
