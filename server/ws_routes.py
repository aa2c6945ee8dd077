"""`GET /v1/ws`: many generations multiplexed over one WebSocket.

Client → server: `{"type": "generate", "id": ID, "request": {chat-completion body},
"traffic_class"?: "interactive"|"bulk", "timeout_ms"?: N}` and `{"type": "cancel", "id": ID}`.
Server → client: `{"type": "delta", "id", "text", "tokens"}` (with "logprobs" when asked,
"tool_calls" / "reasoning" as in a chat chunk's delta when the output is parsed, the
choice's "index" when n > 1, and "token_ids" with vLLM's return_token_ids), exactly one
`{"type": "final", "id", "finish_reason", "usage", "timings"}` (and "choices": [{"index",
"finish_reason"}] when n > 1) per generation that started
(finish_reason "cancelled" after a cancel), and `{"type": "error", "id", "error": {...}}`
(id null for a message that could not be attributed). The README documents the protocol.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import suppress
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine_adapters.protocol import EngineError
from server.choices import Choices
from server.errors import InvalidRequest, SluiceError
from server.generation import Sluice, api_key_from
from server.openai_requests import parse_request
from server.openai_responses import chat_logprobs, usage
from server.openai_routes import engine_failure
from server.timeline import RequestTimeline, outcome_for

logger = logging.getLogger("sluice.ws")

MAX_GENERATIONS_PER_CONNECTION = 256
OUTBOX_SIZE = 1024


class Connection:
    def __init__(self, websocket: WebSocket, sluice: Sluice) -> None:
        self.ws = websocket
        self.sluice = sluice
        self.headers = {k.lower(): v for k, v in websocket.headers.items()}
        if "authorization" not in self.headers and websocket.query_params.get("api_key"):
            self.headers["authorization"] = "Bearer " + websocket.query_params["api_key"]
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue(OUTBOX_SIZE)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.cancelled: set[str] = set()
        self.closing = False  # the connection is ending; the writer's cancellation is ours
        self.stalled = False  # the writer gave up on the client
        self._serving: asyncio.Task[Any] | None = None

    async def serve(self) -> None:
        await self.ws.accept()
        serving = asyncio.current_task()
        assert serving is not None
        self._serving = serving
        writer = asyncio.create_task(self._write())
        try:
            while True:
                try:
                    raw = await self.ws.receive_text()
                except (WebSocketDisconnect, KeyError, RuntimeError):
                    return
                except asyncio.CancelledError:
                    # The writer gave up on a stalled client: end the connection's work now,
                    # without waiting for a client that no longer reads.
                    if self.stalled and serving.uncancel() == 0:
                        return
                    raise
                self._handle(raw)
        finally:
            self.closing = True
            for task in self.tasks.values():
                task.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            writer.cancel()
            with suppress(asyncio.CancelledError):
                await writer

    async def _write(self) -> None:
        """The connection's one writer. Its sends are bounded by the server's SendGuard (one
        watchdog, no timer per message); a stalled client gets the connection closed."""
        send = self.sluice.send_guard.wrap(self.ws.send)
        try:
            while True:
                message = await self.outbox.get()
                await send({"type": "websocket.send", "text": message.decode()})
        except asyncio.CancelledError:
            if self.closing:
                raise
            logger.info("websocket client stopped reading; dropping it")  # SendGuard's cancel
        except (WebSocketDisconnect, RuntimeError, OSError):
            logger.info("websocket client gone; dropping it")
        self.stalled = True
        if self._serving is not None and not self.closing:
            self._serving.cancel()

    def _post(self, message: dict[str, Any]) -> None:
        try:
            self.outbox.put_nowait(orjson.dumps(message))
        except asyncio.QueueFull:
            pass  # the writer is stalled; it will close the connection

    async def _send(self, message: dict[str, Any]) -> None:
        await self.outbox.put(orjson.dumps(message))

    def _error(self, gen_id: Any, error: SluiceError) -> None:
        self._post({"type": "error", "id": gen_id, **error.to_body()})

    def _handle(self, raw: str) -> None:
        if len(raw) > self.sluice.max_body_bytes:
            self._error(None, InvalidRequest("message too large"))
            return
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._error(None, InvalidRequest("messages must be JSON objects"))
            return
        if not isinstance(message, dict):
            self._error(None, InvalidRequest("messages must be JSON objects"))
            return
        gen_id = message.get("id")
        if not isinstance(gen_id, str) or not gen_id or len(gen_id) > 128:
            self._error(gen_id if isinstance(gen_id, str | int) else None,
                        InvalidRequest("'id' must be a non-empty string", param="id"))
            return
        kind = message.get("type")
        if kind == "cancel":
            task = self.tasks.get(gen_id)
            if task is None:
                self._error(gen_id, InvalidRequest(f"no running generation with id {gen_id!r}",
                                                   param="id"))
            else:
                self.cancelled.add(gen_id)
                task.cancel()
            return
        if kind != "generate":
            self._error(gen_id, InvalidRequest("'type' must be 'generate' or 'cancel'",
                                               param="type"))
            return
        if gen_id in self.tasks:
            self._error(gen_id, InvalidRequest(f"id {gen_id!r} is already in use", param="id"))
            return
        if len(self.tasks) >= MAX_GENERATIONS_PER_CONNECTION:
            self._error(gen_id, InvalidRequest("too many generations on this connection"))
            return
        task = asyncio.create_task(self._generate(gen_id, message))
        self.tasks[gen_id] = task
        task.add_done_callback(functools.partial(self._forget, gen_id))

    def _forget(self, gen_id: str, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(gen_id, None)
        self.cancelled.discard(gen_id)

    def _headers_for(self, message: dict[str, Any]) -> dict[str, str]:
        headers = dict(self.headers)
        if message.get("traffic_class") is not None:
            headers["x-traffic-class"] = str(message["traffic_class"])
        if message.get("timeout_ms") is not None:
            headers["x-request-timeout-ms"] = str(message["timeout_ms"])
        return headers

    async def _generate(self, gen_id: str, message: dict[str, Any]) -> None:
        sluice = self.sluice
        timeline = RequestTimeline(request_id=f"ws-{id(self):x}-{gen_id}"[:128],
                                   model=sluice.served_model, api="ws")
        outcome, status, failure = "cancelled", 499, None
        try:
            request_body = message.get("request")
            if isinstance(request_body, dict) and request_body.get("stream") is False:
                raise InvalidRequest("WebSocket generations always stream", param="stream")
            parsed = parse_request(request_body, "chat")
            # What only a whole response carries; a WebSocket generation always streams.
            for key, asked in (("prompt_logprobs", "prompt_logprobs" in parsed.sampling),
                               ("echo", parsed.echo)):
                if asked:
                    raise InvalidRequest(f"'{key}' is not available over the WebSocket",
                                         param=key)
            ticket, engine_request, plan = sluice.prepare(
                parsed, timeline, self._headers_for(message)
            )
            choices = Choices(parsed.n, None if plan.parser is None else functools.partial(
                plan.parser, engine_request.prompt_token_ids), keep=False,
                logprobs="logprobs" in parsed.sampling)
            async with sluice.dispatcher.generation(ticket, engine_request) as generation:
                timeline.dispatched(generation)
                try:
                    async for delta in generation:
                        if delta.token_ids:
                            timeline.wrote_tokens(len(delta.token_ids))
                        choice, fields = choices.add(delta)
                        if not (delta.token_ids or fields):
                            continue
                        message = {"type": "delta", "id": gen_id, "text": delta.text,
                                   "tokens": len(delta.token_ids)}
                        if choices.n > 1:
                            message["index"] = choice.index
                        if choices.parsed:  # the parsed content is the text
                            fields = dict(fields or {})
                            message["text"] = fields.pop("content", "")
                            message.update(fields)
                        if delta.logprobs is not None:
                            message["logprobs"] = chat_logprobs(delta.logprobs)
                        if parsed.return_token_ids:
                            message["token_ids"] = list(delta.token_ids)
                        await self._send(message)
                except EngineError as exc:
                    raise engine_failure(exc) from exc
                choices.check_all_finished()
            outcome, status = "completed", 200
            ended = [(c.index, Choices.finish_reason(c)) for c in choices.in_order()]
            final: dict[str, Any] = {"type": "final", "id": gen_id, "finish_reason": ended[0][1]}
            if choices.n > 1:
                final["choices"] = [{"index": i, "finish_reason": r} for i, r in ended]
            await self._send({
                **final, "usage": usage(timeline.prompt_tokens, timeline.generated_tokens),
                "timings": timeline.timings(),
            })
        except SluiceError as error:
            outcome, status, failure = outcome_for(error), error.status, error
            self._error(gen_id, error)
        except asyncio.CancelledError:
            if gen_id in self.cancelled:  # the client's cancel, not the connection closing
                self._post({
                    "type": "final", "id": gen_id, "finish_reason": "cancelled",
                    "usage": usage(timeline.prompt_tokens, timeline.generated_tokens),
                    "timings": timeline.timings(),
                })
                return
            raise
        finally:
            timeline.finish(outcome, status=status, error=failure)
            del failure  # its traceback holds this frame: no reference cycle, freed at once


async def websocket_endpoint(websocket: WebSocket) -> None:
    sluice: Sluice = websocket.app.state.sluice
    connection = Connection(websocket, sluice)
    try:
        # Authenticate once per connection, so a bad key is refused before any work.
        sluice.tenants.authenticate(api_key_from(connection.headers))
    except SluiceError as error:
        await websocket.accept()
        await websocket.send_text(orjson.dumps({"type": "error", "id": None,
                                                **error.to_body()}).decode())
        await websocket.close(code=1008)
        return
    await connection.serve()
