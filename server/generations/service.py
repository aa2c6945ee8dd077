"""The generations this replica runs: made (once per idempotency key, on any replica with
shared state), found again, continued when another replica dies, and drained.

Shared by the SSE routes, the WebSocket route and the Batch API; transports only read a run's
log."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from engine_adapters.protocol import (
    GenerationRequest,
)
from server.core import ids
from server.core.errors import (
    GenerationFailed,
    IdempotencyKeyReused,
    InvalidRequest,
    ResourceNotFound,
    ShuttingDown,
    SluiceError,
    StateUnavailable,
)
from server.generations.parsed import ParsedRequest
from server.generations.planner import Planner, RequestContext
from server.generations.ports import LogMirror, RunRecord, SharedRuns
from server.generations.registry import MAX_KEY_LENGTH, RunStore, fingerprint
from server.generations.run import GenerationRun, Kind
from server.generations.timeline import RequestTimeline
from server.observability.access_log import Api
from server.observability.metrics import Metrics
from server.observability.tracing import TraceParent, Tracing
from server.scheduler.types import Admission, Dispatcher, Ticket, TrafficClass

CHUNK_APIS = ("chat", "completions")  # whose readers speak the wire's chunks (`RunWire`)


@dataclass(slots=True)
class Generations:
    """Every generation that is running or can be found again, and how to make one."""

    planner: Planner
    dispatcher: Dispatcher
    store: RunStore
    metrics: Metrics
    shared: SharedRuns | None = None  # with `state.url`: the runs replicas share
    grace_seconds: float = 30.0  # a resumable generation's life without a reader
    tracing: Tracing | None = None  # the app's tracer, with tracing on
    draining: bool = False  # SIGTERM: new generations are refused, running ones finish
    live: set[GenerationRun] = field(default_factory=set)
    _idle: asyncio.Event | None = None

    def timeline(
        self,
        request_id: str,
        api: Api,
        trace: TraceParent | None = None,
        *,
        recorded: bool = True,
    ) -> RequestTimeline:
        """A request's stopwatch, from now, recording into the app's metrics (and with tracing
        on, its span into the app's tracer, a child of `trace`'s)."""
        return RequestTimeline(
            request_id=request_id,
            model=self.planner.served_model,
            api=api,
            metrics=self.metrics,
            trace=trace,
            tracing=self.tracing,
            recorded=recorded,
        )

    async def generate(
        self,
        parsed: ParsedRequest,
        body: Any,
        timeline: RequestTimeline,
        context: RequestContext,
        key: str | None,
        *,
        stream: bool,
        request: Any = None,
    ) -> tuple[GenerationRun, bool]:
        """The run that answers this request, and whether it is an earlier one replayed.

        With an idempotency `key`, the tenant's run made under that key with the same `body`
        is the answer, on this replica or (with shared state) another; a new one is made (and
        kept, resumable) if there is none. `request`: what `parsed` was parsed from, if not
        `body`. Raises a SluiceError for anything refused; nothing is held when it does.
        """
        if key is None:
            return self._open(parsed, timeline, context, stream=stream, resumable=False), False
        if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
            raise InvalidRequest(
                f"an idempotency key is 1 to {MAX_KEY_LENGTH} printable characters",
                param="Idempotency-Key",
            )
        tenant = self.planner.tenant_of(context).name
        request_print = fingerprint(parsed.kind, body)
        found = self.store.by_key(tenant, key)
        if found is None and self.shared is not None and self.shared.up:
            answer = await self._generate_shared(
                parsed,
                body if request is None else request,
                timeline,
                context,
                tenant,
                key,
                request_print,
                stream=stream,
            )
            if answer is not None:
                if answer[1]:
                    timeline.unused()
                return answer
        if found is not None:
            replayed = _same_body(found, request_print)
            timeline.unused()
            return replayed, True
        run = self._open(parsed, timeline, context, stream=stream, resumable=True)
        self.store.add(tenant, key, request_print, run)
        return run, False

    async def _generate_shared(
        self,
        parsed: ParsedRequest,
        request: Any,
        timeline: RequestTimeline,
        context: RequestContext,
        tenant: str,
        key: str,
        request_print: str,
        *,
        stream: bool,
    ) -> tuple[GenerationRun, bool] | None:
        """`generate` with the key recorded in the shared state: the generation made under it
        on any replica, or a new one, recorded first (the key is taken once across replicas).
        None: the shared state did not answer (the generation is to be this replica's
        alone)."""
        assert self.shared is not None
        response_id = ids.own_id()
        record = RunRecord(
            tenant,
            ids.public_id(parsed.kind, response_id),
            parsed.kind,
            request,
            stream,
            timeline.request_id,
            int(time.time()),
            None if context.traffic_class is None else str(context.traffic_class),
            context.timeout_s,
            key,
            request_print,
        )
        try:
            earlier = await self.shared.open(record, key, request_print)
        except StateUnavailable:
            return None
        if earlier is not None:
            public_id, earlier_print = earlier
            if earlier_print != request_print:
                raise _key_reused()
            found = self.store.by_key(tenant, key)
            followed = found[0] if found is not None else await self._find_shared(tenant, public_id)
            if followed is None:  # (expired between the two reads)
                raise ResourceNotFound(
                    "the generation made with this idempotency key has "
                    "expired; send the request with a new key",
                    param="Idempotency-Key",
                )
            return followed, True
        try:
            run = self._open(
                parsed,
                timeline,
                context,
                stream=stream,
                resumable=True,
                response_id=response_id,
                created=record.created,
                mirror=self.shared.mirror(record),
            )
        except SluiceError:
            await self.shared.forget(record)  # refused: the key is free for a retry
            raise
        self.store.add(tenant, key, request_print, run)
        return run, False

    def generate_part(
        self,
        parsed: ParsedRequest,
        timeline: RequestTimeline,
        context: RequestContext,
        *,
        stream: bool,
        response_id: str,
        first_index: int,
    ) -> GenerationRun:
        """One prompt's run of a request with several: its chunks carry the request's
        `response_id`, its choices are numbered from `first_index`."""
        return self._open(
            parsed,
            timeline,
            context,
            stream=stream,
            resumable=False,
            response_id=response_id,
            first_index=first_index,
        )

    async def generate_kept(
        self, parsed: ParsedRequest, body: Any, timeline: RequestTimeline, context: RequestContext
    ) -> GenerationRun:
        """A streamed run whose log is kept whole (resumable) without an idempotency key: its
        owner (a background response) reads it to its end and finds it again itself. With
        shared state, it is recorded there too, and its log written there, so that any
        replica follows it (`find` by its public id); if the shared state does not answer,
        it is this replica's alone."""
        if self.shared is None or not self.shared.up:
            return self._open(parsed, timeline, context, stream=True, resumable=True)
        response_id = ids.own_id()
        record = RunRecord(
            self.planner.tenant_of(context).name,
            ids.public_id("chat", response_id),
            parsed.kind,
            body,
            True,
            timeline.request_id,
            int(time.time()),
            None if context.traffic_class is None else str(context.traffic_class),
            context.timeout_s,
        )
        try:
            await self.shared.record(record)
        except StateUnavailable:
            return self._open(parsed, timeline, context, stream=True, resumable=True)
        try:
            return self._open(
                parsed,
                timeline,
                context,
                stream=True,
                resumable=True,
                response_id=response_id,
                created=record.created,
                mirror=self.shared.mirror(record),
            )
        except SluiceError:
            await self.shared.forget(record)
            raise

    async def find(self, context: RequestContext, public_id: str) -> GenerationRun | None:
        """The caller's tenant's resumable run with this id, on this replica or (with shared
        state) another (None: unknown, expired, or another tenant's)."""
        tenant = self.planner.tenant_of(context).name
        run = self.store.by_id(tenant, public_id)
        if run is None and self.shared is not None and self.shared.up:
            run = await self._find_shared(tenant, public_id)
        return run

    async def _find_shared(self, tenant: str, public_id: str) -> GenerationRun | None:
        """A run that follows the generation another replica runs (or ran): see
        `server.generations.ports`."""
        assert self.shared is not None
        try:
            record = await self.shared.find(tenant, public_id)
        except StateUnavailable:
            return None
        if record is None:
            return None
        run = self.store.by_id(tenant, public_id)  # (another reader's, made meanwhile)
        if run is not None:
            return run
        if self.draining:
            raise ShuttingDown(
                "the server is shutting down; retry on another replica", retry_after=1
            )
        parsed = self.planner.wire.parse(record.request, record.kind)
        timeline = self.timeline(
            record.request_id, "chat" if record.kind == "chat" else "completions", recorded=False
        )
        timeline.generation_id = record.public_id
        context = RequestContext(
            traffic_class=None
            if record.traffic_class is None
            else TrafficClass(record.traffic_class),
            timeout_s=record.timeout_s,
            tenant=self.planner.tenants.tenant(tenant),
        )
        ticket, engine_request, plan = self.planner.prepare(parsed, timeline, context)
        shape = self.planner.shape(
            parsed,
            engine_request,
            plan,
            stream=record.stream,
            response_id=ids.own_part(record.public_id),
            created=record.created,
        )
        run = GenerationRun(
            shape,
            timeline,
            None,
            resumable=True,
            grace_seconds=self.grace_seconds,
            on_end=self._ended,
            follow=self.shared.follow(record),
            takeover=functools.partial(self._takeover, ticket, engine_request),
        )
        self.store.add(tenant, record.key, record.fingerprint, run)
        self.live.add(run)
        run.start()
        return run

    def _takeover(
        self, ticket: Ticket, request: GenerationRequest, run: GenerationRun
    ) -> Admission[Any]:
        """The admission that continues a followed run here, its replica having died: from
        the tokens its log holds (as a preempted generation is continued), or from the start
        when none was sent."""
        generated = [
            token for event in run.log if event.kind is Kind.PIECE for token in event.token_ids
        ]
        if generated:
            if not ticket.preemptible:
                raise GenerationFailed(
                    "the replica running this generation stopped, and a generation with "
                    "several choices, beams, prompt embeddings or structured output cannot "
                    "be continued on another: send the request again with a new idempotency "
                    "key"
                )
            ticket = ticket.continued(len(generated))
            request = request.continued(generated, f"{request.request_id}~takeover")
        self.metrics.state_takeovers.labels("continued" if generated else "afresh").inc()
        run.timeline.recorded = True
        return self.dispatcher.generation(ticket, request)

    def _open(
        self,
        parsed: ParsedRequest,
        timeline: RequestTimeline,
        context: RequestContext,
        *,
        stream: bool,
        resumable: bool,
        response_id: str | None = None,
        first_index: int = 0,
        created: int | None = None,
        mirror: LogMirror | None = None,
    ) -> GenerationRun:
        """Prepared, admitted (refusals are decided here, before anything awaits), started."""
        if self.draining:
            raise ShuttingDown(
                "the server is shutting down; retry on another replica", retry_after=1
            )
        ticket, engine_request, plan = self.planner.prepare(parsed, timeline, context)
        submitted = timeline.clock()
        admission = self.dispatcher.generation(ticket, engine_request)
        timeline.queued_at = submitted  # (it may be dispatched before the call returns)
        shape = self.planner.shape(
            parsed,
            engine_request,
            plan,
            stream=stream,
            first_index=first_index,
            # A resumable generation's id is found again by it: never the client's.
            response_id=response_id or (ids.own_id() if resumable else timeline.request_id),
            created=created,
            # OpenAI's chunks, for the APIs that speak them, and for any transport that may
            # come back for a resumable run by its id; the other APIs' readers render their own.
            chunks=resumable or timeline.api in CHUNK_APIS,
        )
        timeline.generation_id = shape.public_id
        run = GenerationRun(
            shape,
            timeline,
            admission,
            resumable=resumable,
            grace_seconds=self.grace_seconds,
            on_end=self._ended,
            mirror=mirror,
        )
        self.live.add(run)
        run.start()
        return run

    def _ended(self, run: GenerationRun) -> None:
        self.live.discard(run)
        if run.resumable:
            self.store.ended(run)
        if not self.live and self._idle is not None:
            self._idle.set()

    async def drain(self, seconds: float) -> None:
        """Refuse new generations; let running ones finish for up to `seconds`; end the rest
        with `shutting_down` (their streams get an error event, then `[DONE]`)."""
        self.draining = True
        self._idle = asyncio.Event()
        if self.live:
            try:
                await asyncio.wait_for(self._idle.wait(), seconds)
            except TimeoutError:
                self.cut()
                await self._idle.wait()

    def cut(self) -> None:
        """End every running generation now with `shutting_down` (a drain's end, or a
        second signal): each stream gets its error event, then `[DONE]`."""
        for run in list(self.live):
            if run.shared:  # another replica takes it over at once
                run.cancel(
                    ShuttingDown(
                        "the server is shutting down; resume the generation (with its "
                        "last event id), or retry with its idempotency key: another "
                        "replica continues it",
                        retry_after=1,
                    ),
                    hand_over=True,
                )
            else:
                run.cancel(ShuttingDown("the server is shutting down; retry", retry_after=1))


def _same_body(found: tuple[GenerationRun, str], request_print: str) -> GenerationRun:
    """The run made under an idempotency key, if this request's body is the one it was made
    with (else a 422)."""
    run, earlier_print = found
    if earlier_print != request_print:
        raise _key_reused()
    return run


def _key_reused() -> IdempotencyKeyReused:
    return IdempotencyKeyReused(
        "this idempotency key was used with a different request body", param="Idempotency-Key"
    )
