"""`/v1/responses` as a WebSocket: OpenAI's Responses API over one connection.

Client → server: `{"type": "response.create", ...the create body, "stream_id"?: LANE}`
(OpenAI's), `{"type": "response.cancel", "response_id"}` and `{"type": "response.retrieve",
"response_id", "starting_after"?: N, "stream_id"?: LANE}` (Sluice's). Server → client: each
response's events as `POST /v1/responses` streams them (`sequence_number` 0, 1, 2, …), with
`response_id` and, when it has one, the lane's `stream_id`; exactly one terminal event per
create or retrieve that passed validation (`response.completed`, `.incomplete`, `.failed`,
`.cancelled`, or an `error` when it was refused before it began); `error` (`status`,
`error`) for a message that was refused. Lanes run at once; the messages of one lane run one
after another, in order. docs/api/responses.md documents the protocol."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from starlette.websockets import WebSocket

from server.core.errors import GenerationCancelled, InvalidRequest, SluiceError
from server.generations.reading import reader
from server.generations.run import GenerationRun
from server.http.edge import request_id_from
from server.http.services import Services
from server.http.websocket_session import WebSocketSession
from server.openai_wire.wire import validated
from server.responses_api.service import Responses, replay
from server.responses_api.store import KeptResponse, ResponseRecord
from server.responses_api.wire import CreateResponse, ResponseBuilder, ResponseEvent
from server.responses_api.ws_wire import (
    CancelMessage,
    RetrieveMessage,
    create_message,
    error_event,
    event_message,
    lane_of,
)

MAX_RESPONSES_PER_CONNECTION = 256  # running or waiting for their lane
MAX_LANES_HELD = 64  # lanes whose last response the connection holds
Work = Callable[[asyncio.Task[None] | None], Coroutine[Any, Any, None]]
_TYPES = "'response.create', 'response.retrieve' or 'response.cancel'"


class ResponsesSession(WebSocketSession):
    """One connection's responses: each lane's in order, the lanes at once."""

    def __init__(self, websocket: WebSocket, services: Services, responses: Responses) -> None:
        super().__init__(websocket, services)
        self.responses = responses
        self.tenant = ""
        self.lanes: dict[str | None, asyncio.Task[None]] = {}  # each lane's last task
        self.live: dict[str, ResponseRecord] = {}  # responses created here, still running
        # Each lane's last response, stored or not: a next `previous_response_id` on any lane
        # finds it (as OpenAI's connection-local state).
        self.latest: dict[str | None, ResponseRecord] = {}

    def authenticate(self) -> None:
        self.tenant = self.responses.tenant(self.context)

    def refusal(self, error: SluiceError) -> dict[str, Any]:
        return error_event(error)

    async def handle(self, raw: str) -> None:
        message: Any = None
        try:
            if len(raw) > self.services.edge.max_body_bytes:
                raise InvalidRequest("message too large")
            try:
                message = orjson.loads(raw)
            except orjson.JSONDecodeError:
                message = None
            if not isinstance(message, dict):
                raise InvalidRequest("messages must be JSON objects")
            kind = message.get("type")
            if kind == "response.create":
                self._create(message)
            elif kind == "response.retrieve":
                await self._retrieve(validated(RetrieveMessage, message))
            elif kind == "response.cancel":
                await self._cancel(validated(CancelMessage, message))
            else:
                raise InvalidRequest(f"'type' must be {_TYPES}", param="type")
        except SluiceError as error:
            lane = lane_of(message) if isinstance(message, dict) else None
            await self.send(error_event(error, lane))

    # -- the messages ---------------------------------------------------------------------

    def _create(self, message: dict[str, Any]) -> None:
        try:
            request, lane = create_message(message)
            self.services.note_ignored("responses", "WebSocket /v1/responses", request)
            self._check_room()
        except SluiceError as error:  # a request refused: in the access log, as over HTTP
            timeline = self.services.timeline(request_id_from(None), "responses", self.trace)
            timeline.fail(error)
            raise
        self._queue(lane, lambda before: self._respond(request, lane, before))

    async def _retrieve(self, message: RetrieveMessage) -> None:
        """A background response's events again, after `starting_after`: from its run's log
        when it runs here, from another replica's shared log when it runs there (stored at
        its end here too: that replica may have died), or as they were stored once it ended
        (as `GET /v1/responses/{id}?stream=true` does)."""
        found = await self.responses.find(self.tenant, message.response_id, "response_id")
        if not found.background:
            raise InvalidRequest(
                "only a background response can be streamed again", param="response_id"
            )
        self._check_room()
        after = -1 if message.starting_after is None else message.starting_after
        lane = message.stream_id
        # Each run is taken now: once its response is stored, the record lets go of it, and
        # the lane's task may begin after that.
        if isinstance(found, ResponseRecord):
            here = found.run
            assert here is not None  # (a background response's, running here)
            self._queue(lane, lambda before: self._replay(found, here, after, lane, before))
        elif not found.ended:
            followed = await self.responses.follow(self.context, found)
            there = followed.run
            assert there is not None
            self._queue(
                lane,
                lambda before: self._replay(followed, there, after, lane, before, keeper=True),
            )
        else:
            assert found.events is not None
            events = found.events
            response_id = message.response_id
            self._queue(
                lane, lambda before: self._send_stored(response_id, events, after, lane, before)
            )

    async def _cancel(self, message: CancelMessage) -> None:
        """A response that has ended (or ends meanwhile) changes nothing: its one terminal
        event is sent, or on its way."""
        found = self.live.get(message.response_id) or await self.responses.find(
            self.tenant, message.response_id, "response_id"
        )
        if isinstance(found, KeptResponse):
            if not found.ended:
                raise InvalidRequest(
                    "the response runs on another replica, which alone can cancel it",
                    param="response_id",
                )
            return
        if found.run is not None:
            found.run.cancel(GenerationCancelled("the response was cancelled"))

    def _check_room(self) -> None:
        if len(self.tasks) >= MAX_RESPONSES_PER_CONNECTION:
            raise InvalidRequest(
                f"too many responses on this connection ({MAX_RESPONSES_PER_CONNECTION} at once)"
            )

    def _queue(self, lane: str | None, work: Work) -> None:
        """`work(before)` as the lane's next task: it begins once `before`, the lane's task
        before it, has ended."""
        task = self.spawn(work(self.lanes.get(lane)))
        self.lanes[lane] = task
        task.add_done_callback(lambda done: self._lane_done(lane, done))

    def _lane_done(self, lane: str | None, task: asyncio.Task[None]) -> None:
        if self.lanes.get(lane) is task:
            del self.lanes[lane]

    # -- the tasks ------------------------------------------------------------------------

    async def _respond(
        self, request: CreateResponse, lane: str | None, before: asyncio.Task[None] | None
    ) -> None:
        """A created response's events, to its end; its generation is cancelled if the
        connection ends first, unless it runs in the background."""
        if before is not None:
            await asyncio.wait({before})
        timeline = self.services.timeline(request_id_from(None), "responses", self.trace)
        try:
            held = self._held(request.previous_response_id)
            record = await self.responses.create(request, timeline, self.context, held=held)
        except SluiceError as error:
            timeline.fail(error)
            await self.send(error_event(error, lane))
            return
        run = record.run
        assert run is not None
        owner = not record.background
        if owner:
            self.live[record.response_id] = record
        try:
            # (no await since the run was made: it is never left unread)
            async with reader(run, "dispatched" if owner else None) as failure:
                if failure is not None:  # refused before it began: as over HTTP
                    await self.send(error_event(failure, lane))
                    return
                builder = record.builder if owner else record.builder.fresh()
                await self._send_events(record, run, builder, -1, lane, owner=owner)
        finally:
            if owner:
                del self.live[record.response_id]
                # (its end, if the connection closed before: nothing kept, nothing added)
                await self.responses.ended(record)

    def _held(self, response_id: str | None) -> ResponseRecord | None:
        return next((r for r in self.latest.values() if r.response_id == response_id), None)

    def _hold(self, lane: str | None, record: ResponseRecord) -> None:
        self.latest.pop(lane, None)
        self.latest[lane] = record  # (the newest last)
        if len(self.latest) > MAX_LANES_HELD:
            del self.latest[next(iter(self.latest))]

    async def _replay(
        self,
        record: ResponseRecord,
        run: GenerationRun,
        after: int,
        lane: str | None,
        before: asyncio.Task[None] | None,
        *,
        keeper: bool = False,
    ) -> None:
        try:
            if before is not None:
                await asyncio.wait({before})
            # (followed from another replica: its builder is the one made for it, from its start)
            builder = record.builder if keeper else record.builder.fresh()
            async with reader(run, None):
                await self._send_events(record, run, builder, after, lane, keeper=keeper)
        finally:
            if keeper:
                self.responses.unfollowed(record)

    async def _send_stored(
        self,
        response_id: str,
        events: list[ResponseEvent],
        after: int,
        lane: str | None,
        before: asyncio.Task[None] | None,
    ) -> None:
        if before is not None:
            await asyncio.wait({before})
        for event in events:
            if event["sequence_number"] > after:
                await self.outbox.put(event_message(event, response_id, lane))

    async def _send_events(
        self,
        record: ResponseRecord,
        run: GenerationRun,
        builder: ResponseBuilder,
        after: int,
        lane: str | None,
        *,
        owner: bool = False,
        keeper: bool = False,
    ) -> None:
        """The response's events after sequence number `after`, as `builder` makes them from
        its run's log. `owner`: the connection is the response's one reader, which stores it
        (and holds it for a next `previous_response_id`) before its client sees the end.
        `keeper`: it follows a background response another replica runs, and stores its end
        too (as `ResponseStream` does)."""
        response_id = record.response_id
        async for event in replay(run, builder):
            if keeper:
                record.events.append(event)
            if (owner or keeper) and builder.ended:
                await self.responses.ended(record)
                if owner:
                    self._hold(lane, record)
            if event["sequence_number"] > after:
                await self.outbox.put(event_message(event, response_id, lane))


async def responses_websocket(
    services: Services, responses: Responses, websocket: WebSocket
) -> None:
    await ResponsesSession(websocket, services, responses).run()
