"""`GET /v1/ws`: many generations multiplexed over one WebSocket.

Client → server: `{"type": "generate", "id": ID, "request": {chat-completion body},
"traffic_class"?: "interactive"|"bulk", "timeout_ms"?: N, "idempotency_key"?: KEY,
"traceparent"?: W3C, "tracestate"?: W3C}` (each absent field: the upgrade request's header),
`{"type": "resume", "id": ID, "generation": GENERATION-ID, "after"?: N}` and
`{"type": "cancel", "id": ID}`.
Server → client: `{"type": "delta", "id", "seq", "text", "tokens"}` (with "logprobs" when
asked, "tool_calls" / "reasoning" as in a chat chunk's delta when the output is parsed, the
choice's "index" when n > 1, "token_ids" with vLLM's return_token_ids, and "generation", the id
to resume it by, when it is resumable), exactly one `{"type": "final", "id", "seq",
"finish_reason", "stop_reason", "usage", "timings"}` (and "choices": [{"index", "finish_reason"}]
when n > 1)
or `{"type": "error", "id", "error": {...}}` per generate or resume that passed validation
(finish_reason "cancelled" after a cancel), and errors with id null for a message that could
not be attributed. `seq` numbers the generation's events as the `id:` of its SSE events does.
docs/api/websocket.md documents the protocol.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.websockets import WebSocket

from server.core.errors import (
    GenerationCancelled,
    InvalidRequest,
    ResourceNotFound,
    SluiceError,
)
from server.generations.planner import RequestContext
from server.generations.reading import coalesced, mergeable
from server.generations.run import Event, GenerationRun, Kind
from server.generations.usage import usage
from server.http.edge import api_key_from, timeout_from, traffic_class_from
from server.http.services import Services
from server.http.websocket_session import WebSocketSession
from server.observability.tracing import TraceParent
from server.openai_wire.logprobs import chat_logprobs
from server.openai_wire.requests import parse_request

MAX_GENERATIONS_PER_CONNECTION = 256
_NOT_FINGERPRINTED = ("type", "id", "idempotency_key", "traceparent", "tracestate")


def ws_message(local_id: str, seq: int, group: Sequence[Event], run: GenerationRun) -> bytes | None:
    """The WebSocket message for a group of a run's events (`coalesced`: one
    event, or pieces of one choice's text merged), rendered once (None: it has none)."""
    event = group[0]
    if event.kind is Kind.PIECE and mergeable(run):  # text alone: no dict per token
        text = "".join(e.text for e in group) if len(group) > 1 else event.text
        tokens = sum(e.tokens for e in group)
        index = b',"index":%d' % event.index if run.shape.parsed.n > 1 else b""
        generation = b',"generation":' + orjson.dumps(run.shape.public_id) if run.resumable else b""
        return b'{"type":"delta","id":%b,"seq":%d,"text":%b,"tokens":%d%b%b}' % (
            orjson.dumps(local_id),
            seq,
            orjson.dumps(text),
            tokens,
            index,
            generation,
        )
    message = _message(local_id, seq, event, run)
    return None if message is None else orjson.dumps(message)


def _message(local_id: str, seq: int, event: Event, run: GenerationRun) -> dict[str, Any] | None:
    message: dict[str, Any]
    if event.kind is Kind.PIECE:
        message = {
            "type": "delta",
            "id": local_id,
            "seq": seq,
            "text": event.text,
            "tokens": event.tokens,
        }
        if run.shape.parsed.n > 1:
            message["index"] = event.index
        if run.shape.new_parser is not None:  # the parsed content is the text
            fields = dict(event.fields or {})
            message["text"] = fields.pop("content", "")
            message.update(fields)
        if event.logprobs is not None:
            message["logprobs"] = chat_logprobs(event.logprobs)
        if run.shape.parsed.return_token_ids:
            message["token_ids"] = list(event.token_ids)
    elif event.kind is Kind.FINISH and event.final is not None:
        message = {"type": "final", "id": local_id, "seq": seq, **event.final}
    elif event.kind is Kind.FAILED and isinstance(event.error, GenerationCancelled):
        timeline = run.timeline
        message = {
            "type": "final",
            "id": local_id,
            "seq": seq,
            "finish_reason": "cancelled",
            "usage": usage(
                timeline.prompt_tokens, timeline.generated_tokens, timeline.cached_tokens or 0
            ),
            "timings": timeline.timings(),
        }
    elif event.kind is Kind.FAILED and event.error is not None:
        if event.local:  # handed over: not an event of the generation (resume after seq - 1)
            return {
                "type": "error",
                "id": local_id,
                **event.error.to_body(),
                "generation": run.shape.public_id,
            }
        return {"type": "error", "id": local_id, "seq": seq, **event.error.to_body()}
    else:
        return None
    if run.resumable:
        message["generation"] = run.shape.public_id
    return message


class Connection(WebSocketSession):
    """`/v1/ws`: generations, each under the client's id."""

    def __init__(self, websocket: WebSocket, services: Services) -> None:
        super().__init__(websocket, services)
        self.readers: dict[str, asyncio.Task[None]] = {}  # by the client's id
        self.runs: dict[str, GenerationRun] = {}

    def refusal(self, error: SluiceError) -> dict[str, Any]:
        return {"type": "error", "id": None, **error.to_body()}

    async def _error(self, gen_id: Any, error: SluiceError) -> None:
        await self.send({"type": "error", "id": gen_id, **error.to_body()})

    async def handle(self, raw: str) -> None:
        if len(raw) > self.services.edge.max_body_bytes:
            await self._error(None, InvalidRequest("message too large"))
            return
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            message = None
        if not isinstance(message, dict):
            await self._error(None, InvalidRequest("messages must be JSON objects"))
            return
        gen_id = message.get("id")
        if not isinstance(gen_id, str) or not gen_id or len(gen_id) > 128:
            await self._error(
                gen_id if isinstance(gen_id, str | int) else None,
                InvalidRequest("'id' must be a non-empty string", param="id"),
            )
            return
        kind = message.get("type")
        if kind == "cancel":
            # A cancel for a generation that has ended (or never was) changes nothing: its one
            # final or error is sent (or on its way) already.
            run = self.runs.get(gen_id)
            if run is not None:
                run.cancel(GenerationCancelled("the client cancelled the generation"))
            return
        if kind not in ("generate", "resume"):
            await self._error(
                gen_id,
                InvalidRequest("'type' must be 'generate', 'resume' or 'cancel'", param="type"),
            )
            return
        if gen_id in self.readers:
            await self._error(
                gen_id, InvalidRequest(f"id {gen_id!r} is already in use", param="id")
            )
            return
        if len(self.readers) >= MAX_GENERATIONS_PER_CONNECTION:
            await self._error(gen_id, InvalidRequest("too many generations on this connection"))
            return
        try:
            run, after = await (
                self._generate(gen_id, message) if kind == "generate" else self._resume(message)
            )
        except SluiceError as error:
            await self._error(gen_id, error)
            return
        # The reader counts from now, so a connection that closes before its task runs still
        # lets the run go (the task's end detaches it, however it ends).
        run.attach()
        self.runs[gen_id] = run
        task = self.spawn(self._read(gen_id, run, after))
        self.readers[gen_id] = task
        task.add_done_callback(functools.partial(self._forget, gen_id))

    def _forget(self, gen_id: str, _task: asyncio.Task[None]) -> None:
        self.readers.pop(gen_id, None)
        run = self.runs.pop(gen_id, None)
        if run is not None:
            run.detach()

    def _context(self, message: dict[str, Any]) -> RequestContext:
        """The connection's key; the message's class and timeout, else its headers'."""

        def field(name: str, header: str) -> str | None:
            value = message.get(name)
            return self.headers.get(header) if value is None else str(value)

        return RequestContext(
            api_key_from(self.headers),
            traffic_class_from(field("traffic_class", "x-traffic-class")),
            timeout_from(field("timeout_ms", "x-request-timeout-ms")),
            self.client,
        )

    def _trace(self, message: dict[str, Any]) -> TraceParent | None:
        """The message's trace context, else the connection's (its upgrade request's)."""
        if "traceparent" not in message:
            return self.trace
        return TraceParent.of(message["traceparent"], message.get("tracestate"))

    async def _generate(self, gen_id: str, message: dict[str, Any]) -> tuple[GenerationRun, int]:
        services = self.services
        timeline = services.timeline(f"ws-{id(self):x}-{gen_id}"[:128], "ws", self._trace(message))
        try:
            request_body = message.get("request")
            if isinstance(request_body, dict) and request_body.get("stream") is False:
                raise InvalidRequest("WebSocket generations always stream", param="stream")
            parsed = parse_request(request_body, "chat")
            services.note_ignored("chat", "WebSocket /v1/ws", parsed)
            # What only a whole response carries; a WebSocket generation always streams.
            for name, asked in (
                ("prompt_logprobs", "prompt_logprobs" in parsed.sampling),
                ("echo", parsed.echo),
            ):
                if asked:
                    raise InvalidRequest(
                        f"'{name}' is not available over the WebSocket", param=name
                    )
            key = message.get("idempotency_key")
            if key is not None and not isinstance(key, str):
                raise InvalidRequest("'idempotency_key' must be a string", param="idempotency_key")
            fingerprinted = {k: v for k, v in message.items() if k not in _NOT_FINGERPRINTED}
            run, _ = await services.generations.generate(
                parsed,
                fingerprinted,
                timeline,
                self._context(message),
                key,
                stream=True,
                request=request_body,
            )
        except SluiceError as error:
            timeline.fail(error)
            raise
        return run, 0

    async def _resume(self, message: dict[str, Any]) -> tuple[GenerationRun, int]:
        public_id, after = message.get("generation"), message.get("after", 0)
        if not isinstance(public_id, str):
            raise InvalidRequest("'generation' must be the id of a generation", param="generation")
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidRequest("'after' must be an event number (an integer >= 0)", param="after")
        run = await self.services.generations.find(self.context, public_id)
        if run is None or not run.shape.stream:
            raise ResourceNotFound(f"no generation '{public_id}' to resume", param="generation")
        return run, after

    async def _read(self, gen_id: str, run: GenerationRun, after: int) -> None:
        """The run's events as messages to the connection's writer: all that are ready when
        the reader wakes (merged where they can be: `Edge.coalesce`). A run only this reader
        can read hands them over itself, as it logs them (`GenerationRun.written`)."""
        merge = self.services.edge.coalesce

        async def deliver(last: int, batch: list[Event], final: bool = False) -> None:
            for seq, group in coalesced(run, last, batch, merge):
                message = ws_message(gen_id, seq, group, run)
                if message is not None:
                    await self.outbox.put(message)

        if run.writable and after == 0:
            await run.written(deliver)
            return
        async for last, batch in run.log.batches(after):
            await deliver(last, batch)


async def websocket_endpoint(services: Services, websocket: WebSocket) -> None:
    await Connection(websocket, services).run()
