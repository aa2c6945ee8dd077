"""Thin routes for the OpenAI-compatible API: parse, hand to the scheduler, shape the reply."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import orjson
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_adapters.protocol import (
    EngineDeadError,
    EngineError,
    EngineRequestError,
    OutputParser,
    token_id_name,
)
from server.choices import Choices
from server.errors import (
    EngineUnavailable,
    GenerationFailed,
    InvalidRequest,
    PayloadTooLarge,
    SluiceError,
    UnsupportedParameter,
)
from server.generation import Sluice, admit_unless_gone, receive_disconnect, request_id_from
from server.openai_requests import ParsedRequest, boolean_from, parse_request, prompts_of
from server.openai_responses import DONE, ChunkEncoder, Echo, usage, whole_response
from server.scheduler.types import Admission, Generation
from server.timeline import RequestTimeline, outcome_for

logger = logging.getLogger("sluice.server")


class GuardedEventSourceResponse(EventSourceResponse):
    """sse-starlette's response (pings, disconnect listener, one task group per stream) whose
    sends are bounded by the server-wide SendGuard, so no cancel scope is built per token.

    Overrides sse-starlette's per-send hook (`_send_with_timeout`, sse-starlette 3.x).
    """

    async def _send_with_timeout(self, send: Send, message: Any) -> None:
        await send(message)


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: SluiceError, request_id: str | None = None) -> JSONResponse:
    headers = error.headers()
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(error.to_body(), status_code=error.status, headers=headers)


def engine_failure(exc: EngineError) -> SluiceError:
    if isinstance(exc, EngineDeadError):
        return EngineUnavailable("the engine stopped while generating; retry shortly",
                                 retry_after=5)
    if isinstance(exc, EngineRequestError):
        return InvalidRequest(str(exc), param=exc.param)
    return GenerationFailed(f"generation failed: {exc}")


async def read_json(request: Request, limit: int) -> Any:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise InvalidRequest("the request body must be sent as 'Content-Type: application/json'")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


async def chat_completions(request: Request) -> ASGIApp:
    return await _generate(request, "chat")


async def completions(request: Request) -> ASGIApp:
    return await _generate(request, "completion")


async def invocations(request: Request) -> ASGIApp:
    """`POST /invocations` (SageMaker's), as vLLM's server has it: a chat body (`messages`)
    or a completion body (`prompt`), answered as its own endpoint would."""
    return await _generate(request, None)


async def _generate(request: Request, kind: str | None) -> ASGIApp:
    """An error response at once, or a GenerationResponse that waits, then streams/replies.
    `kind` None: "chat" or "completion" by what the body holds."""
    sluice: Sluice = request.app.state.sluice
    timeline = RequestTimeline(
        request_id=request_id_from(request.headers.get("x-request-id")),
        model=sluice.served_model,
        api="chat" if kind == "chat" else "completions",
    )
    try:
        body = await read_json(request, sluice.max_body_bytes)
        if kind is None:
            kind = "chat" if isinstance(body, dict) and "messages" in body else "completion"
            timeline.api = "chat" if kind == "chat" else "completions"
        prompts = prompts_of(body) if kind == "completion" else None
        if prompts is not None:  # several: one generation each, choices in prompt order
            if boolean_from(body, "stream"):
                raise UnsupportedParameter("several prompts in one request are answered "
                                           "whole: send one prompt per stream", param="stream")
            return await _batch(sluice, request.headers, timeline.request_id, timeline, kind,
                                [{**body, "prompt": prompt} for prompt in prompts])
        return _admitted(sluice, parse_request(body, kind), timeline, request.headers)
    except SluiceError as error:
        timeline.finish(outcome_for(error), status=error.status, error=error)
        return error_response(error, timeline.request_id)


def _admitted(sluice: Sluice, parsed: ParsedRequest, timeline: RequestTimeline,
              headers: Mapping[str, str]) -> GenerationResponse:
    """Prepared and admitted (refusals are decided here, before anything awaits)."""
    ticket, engine_request, plan = sluice.prepare(parsed, timeline, headers)
    admission = sluice.dispatcher.generation(ticket, engine_request)
    prompt_ids = engine_request.prompt_token_ids
    new_parser = None if plan.parser is None else functools.partial(plan.parser, prompt_ids)
    echo = None
    if parsed.echo and parsed.messages is not None:  # vLLM's: what the answer continues
        last = parsed.messages[-1]
        content = last.get("content") if last["role"] == "assistant" else None
        echo = Echo(content if isinstance(content, str) else "", (), "", prompt_only=False)
    elif parsed.echo:
        text = parsed.prompt if isinstance(parsed.prompt, str) else sluice.engine.detokenize(
            prompt_ids)
        first = (token_id_name(prompt_ids[0]) if parsed.sampling.get("tokens_as_ids")
                 else sluice.engine.detokenize(prompt_ids[:1]))
        echo = Echo(text, prompt_ids, first, prompt_only=parsed.max_tokens == 0)
    return GenerationResponse(sluice, parsed, timeline, admission, new_parser,
                              prompt_ids if parsed.return_token_ids else None, echo)


async def chat_completions_batch(request: Request) -> ASGIApp:
    """vLLM's `POST /v1/chat/completions/batch`: a chat body whose `messages` is a list of
    conversations, answered whole with one choice per conversation (index i for the i-th).
    Each conversation is a generation of its own in the scheduler; like vLLM's, no streaming,
    no tools and n = 1."""
    sluice: Sluice = request.app.state.sluice
    request_id = request_id_from(request.headers.get("x-request-id"))
    timeline = RequestTimeline(request_id=request_id, model=sluice.served_model, api="chat")
    try:
        body = await read_json(request, sluice.max_body_bytes)
        conversations = body.get("messages") if isinstance(body, dict) else None
        if not (isinstance(conversations, list) and conversations
                and all(isinstance(c, list) and c for c in conversations)):
            raise InvalidRequest("'messages' must be a non-empty list of conversations, each "
                                 "a non-empty list of messages", param="messages")
        for key, allowed in (("stream", (None, False)), ("n", (None, 1)), ("tools", (None,))):
            if body.get(key) not in allowed:
                raise UnsupportedParameter(f"'{key}' is not supported on the batch endpoint",
                                           param=key)
    except SluiceError as error:
        timeline.finish(outcome_for(error), status=error.status, error=error)
        return error_response(error, request_id)
    return await _batch(sluice, request.headers, request_id, timeline, "chat",
                        [{**body, "messages": conversation} for conversation in conversations])


async def _batch(sluice: Sluice, headers: Mapping[str, str], request_id: str,
                 timeline: RequestTimeline, kind: str, bodies: list[dict[str, Any]]
                 ) -> ASGIApp:
    """A BatchResponse over one generation per body, each admitted (or, if one is refused,
    none: those before it are let go and the refusal is the answer)."""
    admitted: list[GenerationResponse] = []
    try:
        for i, body in enumerate(bodies):
            parsed = parse_request(body, kind)
            one = RequestTimeline(request_id=f"{request_id}-{i}", model=sluice.served_model,
                                  api=timeline.api)
            try:
                admitted.append(_admitted(sluice, parsed, one, headers))
            except SluiceError as error:
                one.finish(outcome_for(error), status=error.status, error=error)
                raise
    except SluiceError as error:
        for response in admitted:
            await response.admission.leave()
            response.timeline.finish("cancelled", status=499)
        if not admitted:
            timeline.finish(outcome_for(error), status=error.status, error=error)
        return error_response(error, request_id)
    return BatchResponse(request_id, kind, admitted)


class BatchResponse:
    """ASGI response: the batch's generations run side by side; one reply when all are done
    (an error response if any failed), or all cancelled when the client leaves."""

    def __init__(self, request_id: str, kind: str, parts: list[GenerationResponse]) -> None:
        self.request_id = request_id
        self.kind = kind
        self.parts = parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts = [asyncio.ensure_future(part.whole_body()) for part in self.parts]
        leaving = asyncio.ensure_future(receive_disconnect(receive)())
        waiting: set[asyncio.Future[Any]] = {*parts, leaving}
        try:
            while not leaving.done() and not all(part.done() for part in parts):
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if any(not f.cancelled() and f.exception() for f in done if f is not leaving):
                    break  # one failed: the batch has failed
        finally:
            for future in (*parts, leaving):
                future.cancel()
            await asyncio.gather(*parts, leaving, return_exceptions=True)
        if leaving.done() and not leaving.cancelled():
            return  # the client left; each part finished as cancelled
        failed = next((p.exception() for p in parts if not p.cancelled() and p.exception()),
                      None)
        if isinstance(failed, SluiceError):
            await error_response(failed, self.request_id)(scope, receive, send)
            return
        if failed is not None:
            raise failed
        bodies = [part.result() for part in parts]
        choices = [{**choice, "index": i} for i, choice in enumerate(
            choice for body in bodies for choice in body["choices"])]
        totals = {key: sum(body["usage"][key] for body in bodies)
                  for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        reply = {**bodies[0], "id": prefix + self.request_id, "choices": choices,
                 "usage": totals}
        per_part = ("timings", "prompt_logprobs", "prompt_token_ids") if self.kind == "chat" else (
            "timings",)  # (a completion's prompt fields are in its choices already)
        for key in per_part:
            each = [body[key] for body in bodies]
            reply[key] = each if any(value is not None for value in each) else None
        await JSONResponse(reply, headers={"X-Request-Id": self.request_id})(
            scope, receive, send)


class GenerationResponse:
    """ASGI response: wait in the queue (watching for the client leaving), then stream or reply.

    Refusals before dispatch are real HTTP statuses (401/429/503/504 with Retry-After);
    failures after the stream started end it with an error event and `[DONE]`.
    """

    def __init__(
        self, sluice: Sluice, parsed: ParsedRequest, timeline: RequestTimeline,
        admission: Admission[Any], new_parser: Callable[[], OutputParser] | None = None,
        prompt_token_ids: Sequence[int] | None = None, echo: Echo | None = None,
    ) -> None:
        self.sluice = sluice
        self.parsed = parsed
        self.timeline = timeline
        self.admission = admission
        self.new_parser = new_parser  # one per choice, when the engine parses the output
        self.prompt_token_ids = prompt_token_ids  # with vLLM's return_token_ids
        self.echo = echo  # a completion's prompt, to come first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeline = self.timeline
        try:
            generation = await admit_unless_gone(self.admission, receive_disconnect(receive))
        except SluiceError as error:
            timeline.finish(outcome_for(error), status=error.status, error=error)
            await error_response(error, timeline.request_id)(scope, receive, send)
            return
        if generation is None:
            timeline.finish("cancelled", status=499)
            return
        timeline.dispatched(generation)
        try:
            if self.parsed.stream:
                response: Response = GuardedEventSourceResponse(
                    self._events(generation),
                    headers={"X-Request-Id": timeline.request_id},
                    ping=self.sluice.ping_seconds,
                )
                send = self.sluice.send_guard.wrap(send)
            else:
                response = await self._whole(generation, receive)
            await response(scope, receive, send)
        finally:
            await self.admission.leave()
            if not timeline.ended:  # the stream was cut before its generator ran
                timeline.finish("cancelled", status=499)

    async def whole_body(self) -> dict[str, Any]:
        """Queue, generate and collect the whole response body, without watching the
        connection (the caller does). Raises the SluiceError that ended it."""
        timeline = self.timeline
        try:
            async with self.admission as generation:
                timeline.dispatched(generation)
                choices = await self._collect(generation)
        except SluiceError as error:
            timeline.finish(outcome_for(error), status=error.status, error=error)
            raise
        except asyncio.CancelledError:
            timeline.finish("cancelled", status=499)
            raise
        body = self._body(choices)
        timeline.finish("completed")
        return body

    def _body(self, choices: Choices) -> dict[str, Any]:
        timeline = self.timeline
        return whole_response(
            self.parsed.kind, timeline.request_id, self.sluice.served_model,
            choices, timeline.prompt_tokens, timeline.generated_tokens,
            timeline.timings(), self.prompt_token_ids, self.echo,
        )

    async def _whole(self, generation: Generation, receive: Receive) -> Response:
        timeline = self.timeline
        collecting = asyncio.ensure_future(self._collect(generation))
        leaving = asyncio.ensure_future(receive_disconnect(receive)())
        try:
            await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not collecting.done():
                collecting.cancel()
        try:
            choices = await collecting
        except asyncio.CancelledError:
            timeline.finish("cancelled", status=499)
            return Response(status_code=499)
        except SluiceError as error:
            timeline.finish(outcome_for(error), status=error.status, error=error)
            return error_response(error, timeline.request_id)
        finally:
            # A failed task keeps its error, whose traceback holds this frame, which holds the
            # task: a reference cycle that would keep the request's connection, timeline and
            # ticket alive until the next full GC pass (under overload, thousands of them).
            del collecting
        body = self._body(choices)
        timeline.finish("completed")
        return JSONResponse(body, headers={"X-Request-Id": timeline.request_id})

    def _choices(self, *, keep: bool) -> Choices:
        return Choices(self.parsed.n, self.new_parser, keep=keep,
                       logprobs=self.parsed.sampling.get("logprobs") is not None)

    async def _collect(self, generation: Generation) -> Choices:
        choices = self._choices(keep=True)
        try:
            async for delta in generation:
                self.timeline.wrote_tokens(len(delta.token_ids))
                choices.add(delta)
        except EngineError as exc:
            raise engine_failure(exc) from exc
        choices.check_all_finished()
        return choices

    async def _events(self, generation: Generation) -> AsyncIterator[bytes]:
        timeline, parsed = self.timeline, self.parsed
        encoder = ChunkEncoder(parsed.kind, timeline.request_id, self.sluice.served_model,
                               parsed.include_usage, parsed.continuous_usage,
                               timeline.prompt_tokens, self.prompt_token_ids)
        ids = self.prompt_token_ids is not None  # each chunk carries its token ids
        echo = self.echo
        answer = echo is None or not echo.prompt_only  # whether the text generated is sent
        choices = self._choices(keep=False)
        outcome, status, failure = "cancelled", 499, None
        try:
            for index in range(choices.n):
                if parsed.kind == "chat":
                    yield encoder.role(index)
                if echo is not None and echo.text:
                    yield encoder.text(echo.text, 0, None, index)
            last = None  # the choice that finishes last: its chunk ends the stream
            try:
                async for delta in generation:
                    if delta.token_ids:
                        timeline.wrote_tokens(len(delta.token_ids))
                    choice, fields = choices.add(delta)
                    if choices.parsed:
                        if fields or delta.logprobs or (ids and delta.token_ids):
                            yield encoder.delta(fields or {}, timeline.generated_tokens,
                                                delta.logprobs, choice.index, delta.token_ids)
                    elif answer and (delta.text or delta.logprobs or (ids and delta.token_ids)):
                        yield encoder.text(delta.text, timeline.generated_tokens,
                                           delta.logprobs, choice.index, delta.token_ids)
                    if delta.finish_reason is None:
                        continue
                    if choices.left:  # not the last to finish: its own finishing chunk now
                        yield encoder.finish(Choices.finish_reason(choice), choice.stop_reason,
                                             None, timeline.generated_tokens, choice.index)
                    else:
                        last = choice
            except EngineError as exc:
                raise engine_failure(exc) from exc
            choices.check_all_finished()
            assert last is not None
            finish_reason = Choices.finish_reason(last)
            summary = {
                "usage": usage(timeline.prompt_tokens, timeline.generated_tokens),
                "timings": timeline.timings(),
            }
            generated = timeline.generated_tokens
            if parsed.include_usage:
                yield encoder.finish(finish_reason, last.stop_reason, None, generated,
                                     last.index)
                yield encoder.usage_chunk(summary)
            else:
                yield encoder.finish(finish_reason, last.stop_reason,
                                     {"timings": summary["timings"]}, generated, last.index)
            yield DONE
            outcome, status = "completed", 200
        except SluiceError as error:
            outcome, status, failure = outcome_for(error), error.status, error
            yield encoder.error(error.to_body())
            yield DONE
        finally:
            timeline.finish(outcome, status=status, error=failure)
            del failure  # its traceback holds this frame (see _whole)
