"""Thin routes for the OpenAI-compatible API: parse, hand to the scheduler, shape the reply."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.chat_api.chunks import DONE, ChunkEncoder
from server.core.errors import (
    GenerationCancelled,
    InvalidRequest,
    ResourceNotFound,
    SluiceError,
    UnsupportedParameter,
)
from server.core.ids import public_id
from server.generations.planner import RequestContext
from server.generations.reading import reader
from server.generations.run import Event, GenerationRun, Kind
from server.generations.timeline import RequestTimeline
from server.generations.usage import summed_usage
from server.http.edge import context_of
from server.http.leaving import ClientWatch, unless_gone
from server.http.replies import JSONResponse, error_response, read_json
from server.http.run_response import RunResponse
from server.http.services import Services
from server.openai_wire.chat import NOT_IN_BATCH
from server.openai_wire.completion import split_prompts
from server.openai_wire.requests import parse_request

logger = logging.getLogger("sluice.server")


async def chat_completions(services: Services, request: Request) -> ASGIApp:
    return await _generate(services, request, "chat")


async def completions(services: Services, request: Request) -> ASGIApp:
    return await _generate(services, request, "completion")


async def invocations(services: Services, request: Request) -> ASGIApp:
    """`POST /invocations` (SageMaker's), as vLLM's server has it: a chat body (`messages`)
    or a completion body (`prompt`), answered as its own endpoint would."""
    return await _generate(services, request, None)


async def _generate(services: Services, request: Request, kind: str | None) -> ASGIApp:
    """An error response at once, or a RunResponse that waits, then streams/replies.
    `kind` None: "chat" or "completion" by what the body holds."""
    timeline = services.timeline_of(request, "chat" if kind == "chat" else "completions")
    key = request.headers.get("idempotency-key")
    try:
        body = await read_json(request, services.edge.max_body_bytes)
        if kind is None:
            kind = "chat" if isinstance(body, dict) and "messages" in body else "completion"
            timeline.api = "chat" if kind == "chat" else "completions"
        prompts = split_prompts(body) if kind == "completion" else None
        if prompts is not None:  # several: one generation each, choices in prompt order
            if key is not None:
                raise UnsupportedParameter(
                    "a request with several prompts cannot be "
                    "idempotent: send one prompt per request",
                    param="Idempotency-Key",
                )
            return await _batch(
                services,
                context_of(request),
                timeline.request_id,
                timeline,
                kind,
                prompts,
                stream=body.get("stream") is True,
                endpoint=request.url.path,
            )
        parsed = parse_request(body, kind)
        services.note_ignored(timeline.api, request.url.path, parsed)
        # A keyed stream sent again resumes after the event the client names, as a GET of its
        # stream does: the one way to resume through a router that forwards a POST's headers
        # but not a GET's (vLLM's: docs/operations.md).
        after = _after(request) if key is not None and parsed.stream else 0
        run, replayed = await services.generations.generate(
            parsed, body, timeline, context_of(request), key, stream=parsed.stream
        )
    except SluiceError as error:
        timeline.fail(error)
        return error_response(error, timeline.request_id)
    return RunResponse(services, run, replayed=replayed, after=after if replayed else 0)


async def resume_chat_completion(services: Services, request: Request) -> ASGIApp:
    return await _resume(services, request, "chat")


async def resume_completion(services: Services, request: Request) -> ASGIApp:
    return await _resume(services, request, "completion")


async def _resume(services: Services, request: Request, kind: str) -> ASGIApp:
    """`GET /v1/{chat/}completions/{id}/stream`: a resumable generation's stream, after the
    event named by `Last-Event-ID` or `?starting_after=N` (from the first without either)."""
    public_id = request.path_params["id"]
    try:
        run = await services.generations.find(context_of(request), public_id)
        if run is None or run.shape.parsed.kind != kind:
            raise ResourceNotFound(f"no generation '{public_id}' to resume", param="id")
        if not run.shape.stream:
            raise InvalidRequest(
                "this generation is answered whole, not streamed: send the "
                "request again with its Idempotency-Key for the answer",
                param="id",
            )
        after = _after(request)
    except SluiceError as error:
        return error_response(error)
    return RunResponse(services, run, after=after)


def _after(request: Request) -> int:
    """The last event the client has: `Last-Event-ID`, else `?starting_after=N`; 0: none."""
    for name, value in (
        ("Last-Event-ID", request.headers.get("last-event-id")),
        ("starting_after", request.query_params.get("starting_after")),
    ):
        if value is not None:
            value = value.strip()
            if not value.isdigit() or len(value) > 18:
                raise InvalidRequest(f"'{name}' must be an event id (an integer >= 0)", param=name)
            return int(value)
    return 0


async def chat_completions_batch(services: Services, request: Request) -> ASGIApp:
    """vLLM's `POST /v1/chat/completions/batch`: a chat body whose `messages` is a list of
    conversations, answered whole with one choice per conversation (index i for the i-th).
    Each conversation is a generation of its own in the scheduler; like vLLM's, no streaming,
    no tools and n = 1."""
    timeline = services.timeline_of(request, "chat")
    request_id = timeline.request_id
    try:
        body = await read_json(request, services.edge.max_body_bytes)
        conversations = body.get("messages") if isinstance(body, dict) else None
        if not (
            isinstance(conversations, list)
            and conversations
            and all(isinstance(c, list) and c for c in conversations)
        ):
            raise InvalidRequest(
                "'messages' must be a non-empty list of conversations, each "
                "a non-empty list of messages",
                param="messages",
            )
        for key, allowed in NOT_IN_BATCH.items():
            if body.get(key) not in allowed:
                raise UnsupportedParameter(
                    f"'{key}' is not supported on the batch endpoint", param=key
                )
        if "idempotency-key" in request.headers:
            raise UnsupportedParameter(
                "the batch endpoint is not idempotent", param="Idempotency-Key"
            )
        context = context_of(request)
    except SluiceError as error:
        timeline.fail(error)
        return error_response(error, request_id)
    return await _batch(
        services,
        context,
        request_id,
        timeline,
        "chat",
        [{**body, "messages": conversation} for conversation in conversations],
        endpoint=request.url.path,
    )


async def _batch(
    services: Services,
    context: RequestContext,
    request_id: str,
    timeline: RequestTimeline,
    kind: str,
    bodies: list[dict[str, Any]],
    stream: bool = False,
    *,
    endpoint: str,
) -> ASGIApp:
    """A BatchResponse (or, streamed, a StreamedBatchResponse) over one generation per body,
    each admitted (or, if one is refused, none: those before it are cancelled and the
    refusal is the answer)."""
    runs: list[GenerationRun] = []
    try:
        first_index = 0
        for i, body in enumerate(bodies):
            parsed = parse_request(body, kind)
            if i == 0:  # (the other bodies hold the same fields)
                services.note_ignored(timeline.api, endpoint, parsed)
            one = services.timeline(f"{request_id}-{i}", timeline.api, timeline.trace)
            try:
                runs.append(
                    services.generations.generate_part(
                        parsed,
                        one,
                        context,
                        stream=stream,
                        response_id=request_id,
                        first_index=first_index,
                    )
                )
                first_index += parsed.n
            except SluiceError as error:
                one.fail(error)
                raise
    except SluiceError as error:
        for run in runs:
            run.cancel(GenerationCancelled("another part of the batch was refused"))
        if not runs:
            timeline.fail(error)
        return error_response(error, request_id)
    if stream:
        return StreamedBatchResponse(services, request_id, runs)
    return BatchResponse(request_id, kind, runs)


async def _each(
    runs: list[GenerationRun],
    wait: Callable[[GenerationRun], Awaitable[Any]],
    failed: Callable[[GenerationRun], bool],
) -> None:
    """Until `wait` has returned for every run, or one run has `failed`."""
    pending = {asyncio.ensure_future(wait(run)) for run in runs}
    try:
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(failed(run) for run in runs):
                return
    finally:
        for future in pending:
            future.cancel()


@asynccontextmanager
async def _reading(runs: list[GenerationRun]) -> AsyncIterator[None]:
    """A reader of every run while the block runs (each entered at once: none is left
    unread while another is entered)."""
    async with AsyncExitStack() as reading:
        for run in runs:
            await reading.enter_async_context(reader(run, None))
        yield


def _settled(runs: list[GenerationRun]) -> Awaitable[None]:
    """Until every run has ended, or one has failed."""
    return _each(
        runs, GenerationRun.until_ended, lambda run: run.ended and run.log[-1].kind is Kind.FAILED
    )


class StreamedBatchResponse:
    """ASGI response: a completion of several prompts, streamed as vLLM's server streams it:
    each part's chunks as they come (one response id, choices numbered across the parts),
    then one usage chunk with the totals (with `include_usage`) and one `[DONE]`.

    As with one run: a refusal before the stream began is the HTTP answer; a part failing
    later ends the stream with its error event; the client leaving cancels every part."""

    def __init__(self, services: Services, request_id: str, runs: list[GenerationRun]) -> None:
        self.services = services
        self.request_id = request_id
        self.runs = runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with ClientWatch(receive):
            async with _reading(self.runs):
                await _each(self.runs, GenerationRun.started, lambda run: run.failure is not None)
                failure = next((run.failure for run in self.runs if run.failure), None)
                if failure is not None:
                    await error_response(failure, self.request_id)(scope, receive, send)
                    return
                await self.services.edge.sse(self._events(), {"X-Request-Id": self.request_id})(
                    scope, receive, send
                )

    async def _events(self) -> AsyncIterator[bytes]:
        arrived: asyncio.Queue[Event] = asyncio.Queue()  # (each run's log holds them anyway)

        async def forward(run: GenerationRun) -> None:
            async for _, event in run.events():
                arrived.put_nowait(event)

        forwarding = [asyncio.ensure_future(forward(run)) for run in self.runs]
        usages: list[dict[str, Any]] = []
        timings: list[dict[str, Any]] = []
        done = 0
        try:
            while done < len(self.runs):
                event = await arrived.get()
                if event.kind is Kind.DONE:
                    done += 1
                    continue
                if event.kind is Kind.USAGE:
                    continue  # one for all, below
                if event.final is not None:
                    usages.append(event.final["usage"])
                    timings.append(event.final["timings"])
                yield event.sse
                if event.kind is Kind.FAILED:
                    break
        finally:
            for task in forwarding:
                task.cancel()
        shape = self.runs[0].shape
        if shape.parsed.include_usage and done == len(self.runs):
            yield ChunkEncoder(shape.parsed.kind, shape.response_id, shape.model, True).usage_chunk(
                {"usage": summed_usage(usages), "timings": timings}
            )
        yield DONE


class BatchResponse:
    """ASGI response: the batch's generations run side by side; one reply when all are done
    (an error response if any failed), or all cancelled when the client leaves."""

    def __init__(self, request_id: str, kind: str, runs: list[GenerationRun]) -> None:
        self.request_id = request_id
        self.kind = kind
        self.runs = runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with _reading(self.runs):
            if not await unless_gone(_settled(self.runs), receive):
                return  # the client left: each part is cancelled as its reader leaves
        failed = next(
            (run.log[-1].error for run in self.runs if run.log and run.log[-1].kind is Kind.FAILED),
            None,
        )
        if failed is not None:
            await error_response(failed, self.request_id)(scope, receive, send)
            return
        bodies = [run.log[-1].body or {} for run in self.runs]
        choices = [
            {**choice, "index": i}
            for i, choice in enumerate(choice for body in bodies for choice in body["choices"])
        ]
        totals = summed_usage(body["usage"] for body in bodies)
        reply = {
            **bodies[0],
            "id": public_id(self.kind, self.request_id),
            "choices": choices,
            "usage": totals,
        }
        per_part = (
            ("timings", "prompt_logprobs", "prompt_token_ids")
            if self.kind == "chat"
            else ("timings",)
        )  # (a completion's prompt fields are in its choices already)
        for key in per_part:
            each = [body[key] for body in bodies]
            reply[key] = each if any(value is not None for value in each) else None
        await JSONResponse(reply, headers={"X-Request-Id": self.request_id})(scope, receive, send)
