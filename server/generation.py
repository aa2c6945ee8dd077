"""From a parsed request to a running generation: identity, prompt, ticket; admission that
notices a client leaving while it waits.

Shared by the SSE routes and the WebSocket route; routes keep only the wire format.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import Receive

from engine_adapters.protocol import (
    PLAIN_TEXT,
    EngineClient,
    EngineRequestError,
    GenerationRequest,
    OutputPlan,
    OutputRequest,
    PromptEmbeds,
    token_id_name,
)
from server.errors import (
    ContextLengthExceeded,
    EngineUnavailable,
    GenerationFailed,
    IdempotencyKeyReused,
    InvalidRequest,
    ModelNotFound,
    ResourceNotFound,
    ShuttingDown,
    SluiceError,
    UnsupportedParameter,
)
from server.generations.run import GenerationRun, Kind, Shape, engine_failure
from server.generations.store import MAX_KEY_LENGTH, RunStore, fingerprint
from server.metrics import Metrics
from server.openai.parsed import ParsedRequest
from server.openai.requests import parse_request
from server.openai_responses import Echo
from server.scheduler.tenants import Tenant, TenantDirectory
from server.scheduler.types import Admission, Dispatcher, Ticket, TrafficClass
from server.send_guard import SendGuard
from server.state.backend import StateUnavailable
from server.state.runs import Follow, Mirror, RunRecord, SharedRuns
from server.timeline import RequestTimeline

_REQUEST_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def check_in_vocabulary(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """A 400 naming the first token id at or above `vocab_size` (0: the engine did not say)."""
    if vocab_size:
        bad = next((t for t in token_ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} in '{param}' is out of the vocabulary (size {vocab_size})",
                param=param,
            )


def request_id_from(header: str | None) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one."""
    if header and len(header) <= 128 and set(header) <= _REQUEST_ID_CHARS:
        return header
    return uuid.uuid4().hex


def api_key_from(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def traffic_class_from(value: str | None) -> TrafficClass | None:
    """X-Traffic-Class, or None when absent."""
    if value is None or not value.strip():
        return None
    try:
        return TrafficClass(value.strip().lower())
    except ValueError:
        raise InvalidRequest(
            "X-Traffic-Class must be 'interactive' or 'bulk'", param="X-Traffic-Class"
        ) from None


def timeout_from(value: str | None) -> float | None:
    """X-Request-Timeout-Ms in seconds, or None when absent."""
    if value is None or not value.strip():
        return None
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = -1.0
    if not milliseconds > 0 or milliseconds == float("inf"):
        raise InvalidRequest(
            "X-Request-Timeout-Ms must be a positive number of milliseconds",
            param="X-Request-Timeout-Ms",
        )
    return milliseconds / 1000.0


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the edge read from the transport (HTTP headers, a WebSocket's), typed: who is
    asking, the class asked for, and the client's timeout. Past the edge nothing reads
    headers."""

    api_key: str | None = None
    traffic_class: TrafficClass | None = None
    timeout_s: float | None = None
    client: str | None = None  # the peer's address (failed authentications are counted by it)
    tenant: Tenant | None = None  # already known (Sluice's own work, e.g. a batch's lines)

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], client: str | None = None) -> RequestContext:
        return cls(
            api_key_from(headers),
            traffic_class_from(headers.get("x-traffic-class")),
            timeout_from(headers.get("x-request-timeout-ms")),
            client=client,
        )

    @classmethod
    def of(cls, connection: HTTPConnection) -> RequestContext:
        """An HTTP request's or a WebSocket's."""
        return cls.from_headers(connection.headers, client_address(connection))


def client_address(connection: HTTPConnection) -> str | None:
    return connection.client.host if connection.client is not None else None


@dataclass(slots=True)
class Sluice:
    """What every route needs: the engine (for tokenizing), the scheduler, the tenants, and
    the generations that are running or can be found again."""

    engine: EngineClient
    dispatcher: Dispatcher
    tenants: TenantDirectory
    served_model: str
    send_guard: SendGuard
    store: RunStore
    metrics: Metrics
    shared: SharedRuns | None = None  # with `state.url`: the runs replicas share
    ping_seconds: float = 15.0
    max_body_bytes: int = 1 << 20
    grace_seconds: float = 30.0  # a resumable generation's life without a reader
    draining: bool = False  # SIGTERM: new generations are refused, running ones finish
    live: set[GenerationRun] = field(default_factory=set)
    _idle: asyncio.Event | None = None

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
        tenant = self.tenant_of(context).name
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
                return answer
        if found is not None:
            return _same_body(found, request_print), True
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
        """`generate` with the key recorded in Redis: the generation made under it on any
        replica, or a new one, recorded first (the key is taken once across replicas). None:
        Redis did not answer (the generation is to be this replica's alone)."""
        assert self.shared is not None
        response_id = uuid.uuid4().hex
        record = RunRecord(
            tenant,
            ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + response_id,
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
                mirror=Mirror(self.shared, record),
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

    def tenant_of(self, context: RequestContext) -> Tenant:
        """The caller's tenant (401 for a missing or wrong key, 429 after too many)."""
        if context.tenant is not None:
            return context.tenant
        return self.tenants.authenticate(context.api_key, context.client)

    async def find(self, context: RequestContext, public_id: str) -> GenerationRun | None:
        """The caller's tenant's resumable run with this id, on this replica or (with shared
        state) another (None: unknown, expired, or another tenant's)."""
        tenant = self.tenant_of(context).name
        run = self.store.by_id(tenant, public_id)
        if run is None and self.shared is not None and self.shared.up:
            run = await self._find_shared(tenant, public_id)
        return run

    async def _find_shared(self, tenant: str, public_id: str) -> GenerationRun | None:
        """A run that follows the generation another replica runs (or ran): see
        `server.state.runs`."""
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
        parsed = parse_request(record.request, record.kind)
        timeline = RequestTimeline(
            request_id=record.request_id,
            model=self.served_model,
            api="chat" if record.kind == "chat" else "completions",
            metrics=self.metrics,
            recorded=False,
        )
        context = RequestContext(
            traffic_class=None
            if record.traffic_class is None
            else TrafficClass(record.traffic_class),
            timeout_s=record.timeout_s,
            tenant=self.tenants.tenant(tenant),
        )
        ticket, engine_request, plan = self.prepare(parsed, timeline, context)
        shape = self._shape(
            parsed,
            engine_request,
            plan,
            stream=record.stream,
            response_id=record.public_id.partition("-")[2],
            created=record.created,
        )
        run = GenerationRun(
            shape,
            timeline,
            None,
            resumable=True,
            grace_seconds=self.grace_seconds,
            on_end=self._ended,
            follow=Follow(self.shared, record),
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
        mirror: Mirror | None = None,
    ) -> GenerationRun:
        """Prepared, admitted (refusals are decided here, before anything awaits), started."""
        if self.draining:
            raise ShuttingDown(
                "the server is shutting down; retry on another replica", retry_after=1
            )
        ticket, engine_request, plan = self.prepare(parsed, timeline, context)
        admission = self.dispatcher.generation(ticket, engine_request)
        shape = self._shape(
            parsed,
            engine_request,
            plan,
            stream=stream,
            first_index=first_index,
            # A resumable generation's id is found again by it: never the client's.
            response_id=response_id or (uuid.uuid4().hex if resumable else timeline.request_id),
            created=created,
        )
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

    def _shape(
        self,
        parsed: ParsedRequest,
        engine_request: GenerationRequest,
        plan: OutputPlan,
        *,
        stream: bool,
        response_id: str,
        first_index: int = 0,
        created: int | None = None,
    ) -> Shape:
        prompt_ids = engine_request.prompt_token_ids
        return Shape(
            parsed=parsed,
            model=self.served_model,
            stream=stream,
            response_id=response_id,
            first_index=first_index,
            created=created,
            new_parser=None if plan.parser is None else functools.partial(plan.parser, prompt_ids),
            prompt_token_ids=prompt_ids if parsed.return_token_ids else None,
            echo=self._echo(parsed, prompt_ids),
        )

    def _echo(self, parsed: ParsedRequest, prompt_ids: Sequence[int]) -> Echo | None:
        if parsed.echo and parsed.messages is not None:  # vLLM's: what the answer continues
            last = parsed.messages[-1]
            content = last.get("content") if last["role"] == "assistant" else None
            return Echo(content if isinstance(content, str) else "", (), "", prompt_only=False)
        if not parsed.echo:
            return None
        text = (
            parsed.prompt
            if isinstance(parsed.prompt, str)
            else self.engine.detokenize(list(prompt_ids))
        )
        first = (
            token_id_name(prompt_ids[0])
            if parsed.sampling.get("tokens_as_ids")
            else self.engine.detokenize(list(prompt_ids[:1]))
        )
        return Echo(text, prompt_ids, first, prompt_only=parsed.max_tokens == 0)

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
                        run.cancel(
                            ShuttingDown("the server is shutting down; retry", retry_after=1)
                        )
                await self._idle.wait()

    def prepare(
        self, parsed: ParsedRequest, timeline: RequestTimeline, context: RequestContext
    ) -> tuple[Ticket, GenerationRequest, OutputPlan]:
        """Authenticate, check the model, plan the output, count the prompt and build the
        ticket.

        Raises a SluiceError for anything wrong; nothing is held when it does.
        """
        tenant = self.tenant_of(context)
        if not self.engine.is_healthy:
            raise EngineUnavailable("the engine is not available", retry_after=5)
        timeline.tenant = tenant.name
        timeline.tenant_label = tenant.metric_label if tenant.configured else None
        timeline.traffic_class = str(
            self.tenants.traffic_class(tenant, parsed.service_tier, context.traffic_class)
        )
        self.check_model(parsed.model)
        for key in ("logprobs", "prompt_logprobs"):
            if key in parsed.sampling and not self.engine.model.logprobs:
                raise UnsupportedParameter(
                    f"the {self.engine.model.engine} engine does not return logprobs", param=key
                )
        if parsed.n > 1 and not self.engine.model.choices:
            raise UnsupportedParameter(
                f"the {self.engine.model.engine} engine samples one choice only", param="n"
            )
        if parsed.sampling.get("beam_search") and not self.engine.model.beam_search:
            raise UnsupportedParameter(
                f"the {self.engine.model.engine} engine does not search beams",
                param="use_beam_search",
            )
        plan = self.plan_output(parsed)
        if parsed.sampling.get("beam_search") and plan.constraint is not None:
            raise UnsupportedParameter(
                "beam search does not follow structured outputs or a required tool call",
                param="use_beam_search",
            )
        self._check_token_ids(parsed)
        prompt_ids, embeds = self._prompt(parsed, plan)
        prompt_tokens = len(prompt_ids) if embeds is None else embeds.length
        max_len = self.engine.model.max_model_len
        room = max_len - prompt_tokens
        if room < 1:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_len} tokens; the prompt has "
                f"{prompt_tokens}, which leaves no room for an answer",
                param="messages" if parsed.kind == "chat" else "prompt",
            )
        # As vLLM's server: a max_tokens beyond the context left is lowered to what is left.
        # (An echo with max_tokens 0 still generates one token, dropped, as vLLM's does.)
        max_tokens = room if parsed.max_tokens is None else min(max(1, parsed.max_tokens), room)
        timeline.prompt_tokens = prompt_tokens
        ticket = self.tenants.make_ticket(
            tenant=tenant,
            request_id=timeline.request_id,
            model=self.served_model,
            service_tier=parsed.service_tier,
            asked_class=context.traffic_class,
            timeout_s=context.timeout_s,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            open_ended=parsed.max_tokens is None,
            arrival=timeline.arrival,
            # A constrained generation resumed as a continuation would restart its grammar;
            # one of several choices (or beams) cannot resume alone; embeddings cannot be
            # continued with token ids.
            preemptible=(
                plan.constraint is None
                and parsed.n == 1
                and embeds is None
                and not parsed.sampling.get("beam_search")
            ),
            n=parsed.n,
        )
        timeline.slo = self.dispatcher.slo_targets(ticket.traffic_class)
        request = GenerationRequest(
            request_id=timeline.request_id,
            prompt_token_ids=prompt_ids,
            sampling=parsed.sampling_options(max_tokens, plan.constraint),
            prompt_embeds=embeds,
        )
        return ticket, request, plan

    def plan_output(self, parsed: ParsedRequest) -> OutputPlan:
        """The engine's plan for the output's shape; what it cannot do is the client's 400."""
        if not parsed.output and parsed.kind != "chat":
            return PLAIN_TEXT
        try:
            return self.engine.plan_output(
                OutputRequest(parsed.kind, parsed.output, parsed.messages, parsed.template_kwargs)
            )
        except EngineRequestError as exc:
            raise engine_failure(exc) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model:
            raise ModelNotFound(
                f"the model '{model}' does not exist; this server serves '{self.served_model}'",
                param="model",
            )

    def _check_token_ids(self, parsed: ParsedRequest) -> None:
        """Token ids from the client must be in the vocabulary: a 400 here, not an engine error."""
        vocab = self.engine.model.vocab_size
        if isinstance(parsed.prompt, list):
            check_in_vocabulary(parsed.prompt, vocab, "prompt")
        check_in_vocabulary(parsed.sampling.get("stop_token_ids", ()), vocab, "stop_token_ids")
        check_in_vocabulary(parsed.sampling.get("logit_bias") or (), vocab, "logit_bias")
        check_in_vocabulary(
            parsed.sampling.get("allowed_token_ids") or (), vocab, "allowed_token_ids"
        )
        check_in_vocabulary(
            parsed.forwarded_prompt_ids or (), vocab, "kv_transfer_params.prompt_token_ids"
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        try:
            return self.engine.render_chat(messages, tools, template_kwargs)
        except Exception as exc:  # template errors are the client's messages' fault
            raise InvalidRequest(
                f"cannot apply the chat template: {exc}", param="messages"
            ) from None

    def _prompt(
        self, parsed: ParsedRequest, plan: OutputPlan
    ) -> tuple[list[int], PromptEmbeds | None]:
        """The prompt's token ids (truncated as asked), or its embeddings (and no ids)."""
        if parsed.prompt_embeds is not None:
            try:
                return [], self.engine.load_prompt_embeds(parsed.prompt_embeds)
            except EngineRequestError as exc:
                raise engine_failure(exc) from None
        if parsed.forwarded_prompt_ids is not None:
            ids = list(parsed.forwarded_prompt_ids)
        elif parsed.messages is not None:
            ids = self.render_chat(parsed.messages, plan.tools, parsed.template_kwargs)
        elif isinstance(parsed.prompt, str):
            ids = self.engine.tokenize(parsed.prompt, parsed.add_special_tokens)
        else:
            assert parsed.prompt is not None
            ids = list(parsed.prompt)
        keep = parsed.truncate_prompt_tokens
        if keep is not None:  # vLLM's truncate_prompt_tokens (-1: the context's worth)
            keep = self.engine.model.max_model_len if keep == -1 else keep
            ids = ids[max(0, len(ids) - keep) :] if parsed.truncation_side == "left" else ids[:keep]
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return ids, None


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


def receive_disconnect(receive: Receive) -> Callable[[], Awaitable[None]]:
    """A waiter for an ASGI http.disconnect (the request body must already be read)."""

    async def wait() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    return wait
