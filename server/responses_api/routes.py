"""Thin routes for OpenAI's Responses API: `POST /v1/responses` (whole, streamed or in the
background), `GET /v1/responses/{id}` (the object, or a background response's events after
`starting_after`) and `POST /v1/responses/{id}/cancel`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.core.errors import InvalidRequest, SluiceError, UnsupportedParameter
from server.core.ids import public_id
from server.generations.reading import reader
from server.generations.run import GenerationRun
from server.http.edge import context_of
from server.http.leaving import ClientWatch, unless_gone
from server.http.rendering import render_request, rendered
from server.http.replies import JSONResponse, error_response, read_json
from server.http.services import Services
from server.openai_wire.requests import parse_request
from server.openai_wire.wire import validated
from server.responses_api.service import Responses, read_whole, replay
from server.responses_api.store import KeptResponse, ResponseRecord
from server.responses_api.wire import CreateResponse, ResponseBuilder, ResponseEvent, sse


async def create_response(services: Services, responses: Responses, request: Request) -> ASGIApp:
    timeline = services.timeline_of(request, "responses")
    try:
        if "idempotency-key" in request.headers:
            raise UnsupportedParameter(
                "responses are not idempotent here: make one with 'background': true and read "
                "it again with GET /v1/responses/{id}",
                param="Idempotency-Key",
            )
        body = validated(CreateResponse, await read_json(request, services.edge.max_body_bytes))
        services.note_ignored("responses", request.url.path, body)
        record = await responses.create(body, timeline, context_of(request))
    except SluiceError as error:
        timeline.fail(error)
        return error_response(error, timeline.request_id)
    headers = {"X-Request-Id": timeline.request_id}
    if record.background:
        if body.stream:
            return ResponseStream(services, responses, record, record.builder.fresh(), after=-1)
        return JSONResponse(record.builder.snapshot(), headers=headers)
    if body.stream:
        return ResponseStream(services, responses, record, record.builder, after=-1, owner=True)
    return WholeResponse(responses, record)


async def render_response(services: Services, responses: Responses, request: Request) -> Response:
    """vLLM's `POST /v1/responses/render` (`server.http.rendering`): the response's chat
    rendered, without generating. Stateless, as vLLM's: no `previous_response_id`, no
    `conversation`, and no response of `responses` read."""
    tenant, raw, request_id = await render_request(services, request)
    body = validated(CreateResponse, raw)
    services.note_ignored("responses", request.url.path, body)
    for stateful in ("previous_response_id", "conversation"):
        if getattr(body, stateful) is not None:  # (vLLM's words)
            raise InvalidRequest(
                f"{stateful} is not supported by the stateless render endpoint.", param=stateful
            )
    chat = {**body.chat_body([]), "stream": bool(body.stream)}
    reply = rendered(
        services, tenant, parse_request(chat, "chat"), public_id("response", request_id)
    )
    kv = body.kv_transfer_params
    reply.kv_transfer_params = None if kv is None else kv.model_dump(exclude_none=True)
    return JSONResponse(reply.model_dump())


async def get_response(
    services: Services, responses: Responses, request: Request
) -> Response | ASGIApp:
    try:
        tenant = responses.tenant(context_of(request))
        found = await responses.find(tenant, request.path_params["id"])
        stream = _flag(request, "stream")
        after = _starting_after(request)
        if not stream:
            return JSONResponse(found.snapshot())
        if not found.background:
            raise InvalidRequest("only a background response can be streamed again", param="stream")
        if isinstance(found, KeptResponse) and not found.ended:
            followed = await responses.follow(context_of(request), found)
            return ResponseStream(
                services, responses, followed, followed.builder, after=after, keeper=True
            )
    except SluiceError as error:
        return error_response(error)
    if isinstance(found, KeptResponse):
        assert found.events is not None
        return StoredStream(services, found.events, after=after)
    return ResponseStream(services, responses, found, found.builder.fresh(), after=after)


async def cancel_response(services: Services, responses: Responses, request: Request) -> Response:
    try:
        tenant = responses.tenant(context_of(request))
        return JSONResponse(await responses.cancel(tenant, request.path_params["id"]))
    except SluiceError as error:
        return error_response(error)


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").strip().lower()
    if value not in ("true", "false"):
        raise InvalidRequest(f"'{name}' must be true or false", param=name)
    return value == "true"


def _starting_after(request: Request) -> int:
    value = request.query_params.get("starting_after")
    if value is None:
        return -1
    value = value.strip()
    if not value.isdigit() or len(value) > 18:
        raise InvalidRequest(
            "'starting_after' must be an event's sequence number (an integer >= 0)",
            param="starting_after",
        )
    return int(value)


class WholeResponse:
    """ASGI response: the response object once its generation ended (an error response if it
    was refused or failed); nothing if the client left first (the generation is cancelled)."""

    def __init__(self, responses: Responses, record: ResponseRecord) -> None:
        self.responses = responses
        self.record = record
        self.error: SluiceError | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record, run = self.record, self.record.run
        assert run is not None
        request_id = run.timeline.request_id
        async with reader(run, None):
            read = await unless_gone(self._read(run), receive)
        await self.responses.ended(record)  # (a client that left: nothing kept, nothing added)
        if not read:
            return
        if self.error is not None:
            await error_response(self.error, request_id)(scope, receive, send)
            return
        headers = {"X-Request-Id": request_id}
        await JSONResponse(record.builder.snapshot(), headers=headers)(scope, receive, send)

    async def _read(self, run: GenerationRun) -> None:
        self.error = await read_whole(run, self.record.builder)


class ResponseStream:
    """ASGI response: a response's events after sequence number `after`, as `builder` makes
    them from its run's log. `owner`: the stream is the response's one reader, answering a
    refusal with its HTTP status and storing the response at its end; else it replays a
    background response's kept log (which its keeper reads to the end). `keeper`: it follows
    a background response another replica runs, and stores its end too (that replica may
    have died, its generation continued here)."""

    def __init__(
        self,
        services: Services,
        responses: Responses,
        record: ResponseRecord,
        builder: ResponseBuilder,
        *,
        after: int,
        owner: bool = False,
        keeper: bool = False,
    ) -> None:
        assert record.run is not None
        self.services = services
        self.responses = responses
        self.record = record
        self.run = record.run
        self.builder = builder
        self.after = after
        self.owner = owner
        self.keeper = keeper

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        run = self.run
        request_id = run.timeline.request_id
        try:
            with ClientWatch(receive):
                async with reader(run, "dispatched" if self.owner else None) as failure:
                    if failure is not None:
                        await error_response(failure, request_id)(scope, receive, send)
                        return
                    await self.services.edge.sse(self._events(), {"X-Request-Id": request_id})(
                        scope, receive, send
                    )
        finally:
            if self.owner:  # (its end, if its client left before: nothing kept, nothing added)
                await self.responses.ended(self.record)
            elif self.keeper:
                self.responses.unfollowed(self.record)

    async def _events(self) -> AsyncIterator[bytes]:
        stores = self.owner or self.keeper
        async for event in replay(self.run, self.builder):
            if self.keeper:
                self.record.events.append(event)
            if stores and self.builder.ended:  # stored before its client sees the end
                await self.responses.ended(self.record)
            if event["sequence_number"] > self.after:
                yield sse(event)


class StoredStream:
    """ASGI response: an ended background response's events after sequence number `after`,
    as they were stored with it."""

    def __init__(self, services: Services, events: list[ResponseEvent], *, after: int) -> None:
        self.services = services
        self.events = events
        self.after = after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.services.edge.sse(self._events())(scope, receive, send)

    async def _events(self) -> AsyncIterator[bytes]:
        for event in self.events[self.after + 1 :]:
            yield sse(event)
