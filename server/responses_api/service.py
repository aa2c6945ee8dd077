"""Responses made, read and cancelled: each one a chat generation (`Generations`, so the
scheduler, tenants, timelines and the access log are the chat's), whose log is read into a
response object and its events by a `ResponseBuilder`.

A response answered whole or streamed has one reader, its client, and ends with it; a
background response has one more, its keeper, which reads it to its end (it runs on without
a client) and stores it with its events, so that a stream of it can start from any event, on
any replica with Redis (`server.responses_api.store`). While it runs, its log replays its
events here, and (its run shared) on another replica from the shared log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from server.conversations_api.service import Conversations, Turn
from server.core.errors import (
    GenerationCancelled,
    InvalidRequest,
    MutuallyExclusiveParameters,
    ResourceNotFound,
    SluiceError,
    StateUnavailable,
    StoreUnavailable,
)
from server.core.ids import new_id
from server.generations.log import Event, Kind
from server.generations.planner import RequestContext
from server.generations.ports import ResponseStore
from server.generations.run import GenerationRun
from server.generations.service import Generations
from server.generations.timeline import RequestTimeline
from server.openai_wire.requests import parse_request
from server.responses_api.store import KeptResponse, ResponseRecord
from server.responses_api.wire import CreateResponse, ResponseBuilder, ResponseEvent

logger = logging.getLogger("sluice.responses")
CANCEL_WAIT_SECONDS = 10.0  # for a cancelled background generation to end
STOP_WAIT_SECONDS = 2.0  # at shutdown, for background responses' ends to be stored
KEPT = ("completed", "incomplete")  # the ends a response is stored with, and adds its items


def feed(builder: ResponseBuilder, event: Event, parsed: bool) -> list[ResponseEvent]:
    """A run's event into the response: the response's events it makes. `parsed`: an output
    parser reads the run's text, and its fields are the output (a piece with none, such as
    the close of a required call's JSON, shows nothing); else the text is."""
    if event.kind is Kind.PIECE:
        fields = event.fields
        if not parsed:
            return builder.text(event.text, event.logprobs) if event.text or event.logprobs else []
        if fields is None:  # (its tokens' logprobs belong to no output text)
            return []
        reasoning = fields.get("reasoning") or fields.get("reasoning_content")
        made = builder.reasoning(reasoning) if reasoning else []
        if fields.get("content"):
            made += builder.text(fields["content"], event.logprobs)
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
    parsed = run.shape.new_parser is not None
    for made in builder.start():
        yield made
    async for _, event in run.events(0):
        for made in feed(builder, event, parsed):
            yield made


async def read_whole(run: GenerationRun, builder: ResponseBuilder) -> SluiceError | None:
    """The run, to its end, into the response (which has not started); the error that ended
    it, if one did."""
    builder.start()
    parsed = run.shape.new_parser is not None
    error = None
    async for _, event in run.events(0):
        feed(builder, event, parsed)
        if event.error is not None and not event.local:
            error = event.error
    return error


@dataclass(slots=True)
class Responses:
    """Every stored response, and how to make, find and cancel one. A running background
    response is in `running` (its run is this process's); an ended one is in `store` (Redis
    with `state.url`, else SQLite on the host), or in `local` (SQLite) when `store` is Redis
    and Redis did not answer."""

    generations: Generations
    store: ResponseStore
    local: ResponseStore | None = None
    conversations: Conversations | None = None  # a `conversation`'s (None: none are served)
    clock: Callable[[], float] = time.time  # when a response ended, for its retention
    running: dict[tuple[str, str], ResponseRecord] = field(default_factory=dict)
    _keepers: set[asyncio.Task[None]] = field(default_factory=set)

    def tenant(self, context: RequestContext) -> str:
        """The caller's tenant's name (401 for a missing or wrong key)."""
        return self.generations.planner.tenant_of(context).name

    async def create(
        self,
        request: CreateResponse,
        timeline: RequestTimeline,
        context: RequestContext,
        *,
        held: ResponseRecord | None = None,
    ) -> ResponseRecord:
        """The response's record, its generation admitted and started (a background one
        kept running). `held`: a response of the caller's tenant that the caller holds,
        stored or not (a WebSocket's last), found first as `previous_response_id`. Raises a
        SluiceError for anything refused; nothing is held when it does."""
        tenant = self.tenant(context)
        background = bool(request.background)
        if background and request.store is False:
            raise InvalidRequest(  # (the words of vLLM's server, which clients match)
                "background can only be used when `store` is true", param="store"
            )
        conversation = request.conversation_id
        if conversation is not None and request.previous_response_id is not None:
            raise MutuallyExclusiveParameters(  # (OpenAI's words)
                "Mutually exclusive parameters. Ensure you are only providing one of: "
                "'previous_response_id' or 'conversation'."
            )
        earlier: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            earlier = await self._continued(tenant, request.previous_response_id, held)
        turn = None
        if conversation is not None:
            turn = await self._conversations().begin(tenant, conversation, request.items)
            earlier = turn.messages()
        try:
            record = await self._start(request, tenant, earlier, timeline, context)
        except BaseException:
            if turn is not None:
                await self._conversations().finish(turn, None)
            raise
        record.turn = turn
        if background:
            await self._keep_running(record)
        return record

    def _conversations(self) -> Conversations:
        if self.conversations is None:
            raise InvalidRequest("this server keeps no conversations", param="conversation")
        return self.conversations

    async def _continued(
        self, tenant: str, previous_id: str, held: ResponseRecord | None
    ) -> list[dict[str, Any]]:
        """The conversation a response continues: its `previous_response_id`'s (`held`: a
        response the caller holds, stored or not, found first)."""
        previous: ResponseRecord | KeptResponse
        if held is not None and held.tenant == tenant and held.response_id == previous_id:
            previous = held
        else:
            previous = await self.find(tenant, previous_id, "previous_response_id")
        # (a record here is running, but a held one once its conversation has its output)
        ended = (
            previous.ended
            if isinstance(previous, KeptResponse)
            else previous.settled.is_set() and previous.builder.ended
        )
        if not ended:
            raise InvalidRequest(
                f"response '{previous_id}' has not ended yet", param="previous_response_id"
            )
        return previous.conversation

    async def _start(
        self,
        request: CreateResponse,
        tenant: str,
        earlier: list[dict[str, Any]],
        timeline: RequestTimeline,
        context: RequestContext,
    ) -> ResponseRecord:
        """The response's record, its generation admitted and started."""
        background = bool(request.background)
        chat = request.chat_body(earlier)
        parsed = parse_request(chat, "chat")
        if background:
            run = await self.generations.generate_kept(parsed, chat, timeline, context)
        else:
            run, _ = await self.generations.generate(
                parsed, chat, timeline, context, None, stream=True
            )
        builder = ResponseBuilder(
            new_id("response"), run.shape.model, int(time.time()), request.echoed()
        )
        return ResponseRecord(
            tenant, builder, [*earlier, *request.messages()], run, background=background
        )

    async def _keep_running(self, record: ResponseRecord) -> None:
        """A background response, kept running with no client until its end."""
        run = record.run
        assert run is not None
        self.running[(record.tenant, record.response_id)] = record
        run.attach()  # the keeper's: it runs on with no client
        try:
            if run.shared:  # found on any replica from now, until its end replaces it
                await self.store.put(record.kept().stored(record.tenant, self.clock()))
        except StateUnavailable:  # (found here alone until it ends)
            pass
        finally:
            task = asyncio.get_running_loop().create_task(self._keep(record, run))
            self._keepers.add(task)
            task.add_done_callback(self._keepers.discard)

    async def stop(self) -> None:
        """At shutdown, once their runs are ended: let background responses' keepers store
        them, for `STOP_WAIT_SECONDS` at most."""
        if self._keepers:
            await asyncio.wait(list(self._keepers), timeout=STOP_WAIT_SECONDS)

    async def _keep(self, record: ResponseRecord, run: GenerationRun) -> None:
        try:
            async for event in replay(run, record.builder):
                record.events.append(event)
        finally:
            run.detach()
            await self.ended(record)

    async def ended(self, record: ResponseRecord) -> None:
        """A response's generation ended, read to its end by `record.builder` (or left by its
        client before): its turn in a conversation ended first, if it has one, then the
        response stored if it is to be (its conversation then ends with its output)."""
        if record.settled.is_set():
            return
        record.settled.set()
        record.conversation = [*record.conversation, *record.builder.conversation()]
        builder = record.builder
        # A background response not ended was handed over (this replica stops): its
        # generation is another's to continue, and what is stored of it stays as it began.
        kept = builder.echoed["store"] and builder.status in KEPT
        try:
            await self._end_turn(record)
            if builder.ended if record.background else kept:
                await self._put(record)
        finally:
            if record.background:
                self.running.pop((record.tenant, record.response_id), None)
            record.run = None  # (a response's log is its one reader's, a background one's kept)
            record.finished.set()

    async def _end_turn(self, record: ResponseRecord) -> None:
        """The response's input and output added to its conversation if it completed (or
        stopped at `max_output_tokens`); nothing if it failed or was cancelled. A background
        response handed over is left to the replica that continues it."""
        turn, record.turn = record.turn, None
        if turn is None:
            return
        conversations = self._conversations()
        builder = record.builder
        if record.background and not builder.ended:
            conversations.forget(turn)
            return
        try:
            await conversations.finish(turn, builder.output if builder.status in KEPT else None)
        except StoreUnavailable:
            logger.error(
                "the conversations' store did not answer: response %s's items were not added "
                "to conversation %s (its hold lapses by itself)",
                record.response_id,
                turn.conversation_id,
            )

    async def _put(self, record: ResponseRecord) -> None:
        stored = record.kept().stored(record.tenant, self.clock())
        if self.local is not None:
            try:
                await self.store.put(stored)
                return
            except StateUnavailable:
                logger.warning(
                    "the state backend is unavailable: response %s is kept on this replica "
                    "alone (its other replicas answer 404 for it)",
                    record.response_id,
                )
            await self.local.put(stored)
            return
        await self.store.put(stored)

    async def find(
        self, tenant: str, response_id: str, param: str = "id"
    ) -> ResponseRecord | KeptResponse:
        """The tenant's response: running here, or stored (ended, or running on another
        replica); 404: unknown, expired, dropped, or another tenant's."""
        record = self.running.get((tenant, response_id))
        if record is not None and record.builder.ended:
            # Shown ended once its end is kept (its items added to its conversation): read
            # from the store then.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.finished.wait(), CANCEL_WAIT_SECONDS)
            record = self.running.get((tenant, response_id))
        if record is not None:
            return record
        stored = None
        try:
            stored = await self.store.get(tenant, response_id)
        except StateUnavailable:  # (its one warning is the state backend's)
            pass
        if stored is None and self.local is not None:
            stored = await self.local.get(tenant, response_id)
        if stored is None:
            raise ResourceNotFound(f"Response with id '{response_id}' not found.", param=param)
        return KeptResponse.read(stored)

    async def follow(self, context: RequestContext, kept: KeptResponse) -> ResponseRecord:
        """A response running on another replica, read here from its shared run's log."""
        assert kept.run_id is not None
        run = await self.generations.find(context, kept.run_id)
        if run is None:
            raise ResourceNotFound(
                f"response '{kept.response['id']}' no longer runs on any replica", param="id"
            )
        builder = ResponseBuilder.resumed(kept.response)
        record = ResponseRecord(self.tenant(context), builder, kept.conversation, run, True)
        if kept.turn is not None:  # (its hold renewed here too: this replica may end it)
            record.turn = self._conversations().adopt(Turn.read(kept.turn))
        return record

    def unfollowed(self, record: ResponseRecord) -> None:
        """A followed response's reader left before its end: its hold is no longer renewed
        here (the replica that runs it renews it; if none does, it lapses)."""
        if record.turn is not None and not record.settled.is_set():
            self._conversations().forget(record.turn)

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any]:
        """Cancel a background response; the response object once it has ended."""
        found = await self.find(tenant, response_id)
        if not found.background:
            raise InvalidRequest("Cannot cancel a synchronous response.", param="response_id")
        if isinstance(found, KeptResponse):
            if not found.ended:
                raise InvalidRequest(
                    "the response runs on another replica, which alone can cancel it",
                    param="response_id",
                )
            return found.snapshot()
        if found.run is not None:
            found.run.cancel(GenerationCancelled("the response was cancelled"))
        try:
            await asyncio.wait_for(found.finished.wait(), CANCEL_WAIT_SECONDS)
        except TimeoutError:
            raise SluiceError("the response did not stop in time; retry") from None
        return found.snapshot()
