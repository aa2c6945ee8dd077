"""What Sluice's WebSockets share (`/v1/ws`, and `/v1/responses` as a WebSocket): the key,
taken from a header, a subprotocol or `?api_key=` and checked once before any work; one
writer, whose sends the server's SendGuard bounds; the client's messages handled in order;
and the tasks that answer them, cancelled when the connection ends.

A subclass says what a message means (`handle`) and how a refusal reads (`refusal`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from contextlib import suppress
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from server.core.errors import SluiceError
from server.generations.planner import RequestContext
from server.http.edge import api_key_from, client_address, trace_parent_from
from server.http.services import Services

logger = logging.getLogger("sluice.ws")

OUTBOX_SIZE = 1024
BEARER_PROTOCOL = "sluice.bearer."  # a subprotocol that carries the key: for browsers


class WebSocketSession:
    def __init__(self, websocket: WebSocket, services: Services) -> None:
        self.ws = websocket
        self.services = services
        self.client = client_address(websocket)
        self.headers = {k.lower(): v for k, v in websocket.headers.items()}
        self.trace = trace_parent_from(self.headers)  # the upgrade request's trace context
        # A browser cannot set headers on a WebSocket: its key comes as a subprotocol
        # (`new WebSocket(url, ["sluice.bearer." + key])`), echoed when accepted, or as
        # `?api_key=` (kept working; logs redact it).
        self.subprotocol = next(
            (p for p in websocket.scope.get("subprotocols", ()) if p.startswith(BEARER_PROTOCOL)),
            None,
        )
        if "authorization" not in self.headers:
            key = (
                self.subprotocol[len(BEARER_PROTOCOL) :]
                if self.subprotocol
                else websocket.query_params.get("api_key")
            )
            if key:
                self.headers["authorization"] = "Bearer " + key
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue(OUTBOX_SIZE)
        self.tasks: set[asyncio.Task[None]] = set()  # what answers the client's messages
        self.closing = False  # the connection is ending; the writer's cancellation is ours
        self.stalled = False  # the writer gave up on the client
        self._serving: asyncio.Task[Any] | None = None

    # -- what a subclass says -------------------------------------------------------------

    async def handle(self, raw: str) -> None:
        """One message from the client (its text, not parsed yet)."""
        raise NotImplementedError

    def refusal(self, error: SluiceError) -> dict[str, Any]:
        """The message that answers `error` when it belongs to no request."""
        raise NotImplementedError

    # -- the connection -------------------------------------------------------------------

    @property
    def context(self) -> RequestContext:
        """The connection's key and address."""
        return RequestContext(api_key_from(self.headers), client=self.client)

    async def run(self) -> None:
        """Authenticate once, so that a bad key is refused before any work; then serve."""
        try:
            self.authenticate()
        except SluiceError as error:
            await self.ws.accept(subprotocol=self.subprotocol)
            await self.ws.send_text(orjson.dumps(self.refusal(error)).decode())
            await self.ws.close(code=1008)
            return
        await self._serve()

    def authenticate(self) -> None:
        """Raise the SluiceError that refuses the connection's key, if one does."""
        self.services.planner.tenant_of(self.context)

    async def _serve(self) -> None:
        await self.ws.accept(subprotocol=self.subprotocol)
        serving = asyncio.current_task()
        assert serving is not None
        self._serving = serving
        writer = asyncio.create_task(self._write())
        try:
            while True:
                try:
                    message = await self.ws.receive()
                except (WebSocketDisconnect, RuntimeError):
                    return
                except asyncio.CancelledError:
                    # The writer gave up on a stalled client: end the connection's work now,
                    # without waiting for a client that no longer reads.
                    if self.stalled and serving.uncancel() == 0:
                        return
                    raise
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text")
                if raw is None:  # a binary frame: JSON in UTF-8 is as good
                    try:
                        raw = message["bytes"].decode()
                    except UnicodeDecodeError:
                        await self.ws.close(1007, "a message is JSON, in UTF-8")
                        return
                await self.handle(raw)
        finally:
            self.closing = True
            for task in self.tasks:
                task.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)
            writer.cancel()
            with suppress(asyncio.CancelledError):
                await writer

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task that answers a message, cancelled (and awaited) when the connection ends."""
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _write(self) -> None:
        """The connection's one writer. Its sends are bounded by the server's SendGuard (one
        watchdog, no timer per message); a stalled client gets the connection closed."""
        send = self.services.edge.send_guard.wrap(self.ws.send)
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

    async def send(self, message: dict[str, Any]) -> None:
        await self.outbox.put(orjson.dumps(message))
