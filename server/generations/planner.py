"""From a parsed request to what runs it: the caller's tenant, the prompt's tokens, the output's
plan, the scheduler's ticket and the engine's request; and the shape of the answer."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapters.protocol import (
    PLAIN_TEXT,
    EngineClient,
    EngineRequestError,
    GenerationRequest,
    OutputPlan,
    OutputRequest,
    PromptEmbeds,
    SamplingOptions,
    token_id_name,
)
from server.core.errors import (
    ContextLengthExceeded,
    EngineUnavailable,
    InvalidRequest,
    ModelNotFound,
    UnsupportedParameter,
)
from server.generations.choices import Echo
from server.generations.parsed import ParsedRequest
from server.generations.run import engine_failure
from server.generations.shape import RunWire, Shape
from server.generations.timeline import RequestTimeline
from server.observability.metrics import OTHER_MODEL
from server.scheduler.types import Dispatcher, Ticket, TrafficClass
from server.tenancy.tenants import Tenant, TenantDirectory


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


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """What the engine runs for a request: its output's plan, its prompt (token ids, or
    embeddings and no ids) and their count, and the tokens it may generate."""

    output: OutputPlan
    ids: list[int]
    embeds: PromptEmbeds | None
    tokens: int
    max_tokens: int

    def sampling(self, parsed: ParsedRequest) -> SamplingOptions:
        return parsed.sampling_options(self.max_tokens, self.output.constraint)


def _salted(tenant: str | None, request: str | None) -> str | None:
    """The prefix cache's salt: the tenant's (its own cache), and a request's within it."""
    if request is None:
        return tenant
    return request if tenant is None else f"{tenant}:{request}"


def check_in_vocabulary(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """A 400 naming the first token id at or above `vocab_size` (0: the engine did not say),
    in vLLM's words ("out of vocabulary": clients match on them)."""
    if vocab_size:
        bad = next((t for t in token_ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"Token id {bad} in '{param}' is out of vocabulary (size {vocab_size})",
                param=param,
            )


@dataclass(slots=True)
class Planner:
    """Checks a request against the engine and the caller's tenant, and plans it: nothing is
    held when it refuses one."""

    engine: EngineClient
    tenants: TenantDirectory
    dispatcher: Dispatcher
    served_model: str
    stream_interval: int = 1  # the server's tokens per streamed chunk (a request may raise it)
    wire: RunWire = field(kw_only=True)  # what runs' logs are written in (the Chat API's)

    def tenant_of(self, context: RequestContext) -> Tenant:
        """The caller's tenant (401 for a missing or wrong key, 429 after too many)."""
        if context.tenant is not None:
            return context.tenant
        return self.tenants.authenticate(context.api_key, context.client)

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
        try:
            adapter = self.check_model(parsed.model, tenant)
        except ModelNotFound:
            timeline.model = OTHER_MODEL  # (a label per name a client sends would be unbounded)
            raise
        timeline.model = adapter or self.served_model
        prompt = self.plan_prompt(parsed)
        timeline.prompt_tokens, timeline.n, timeline.max_tokens = (
            prompt.tokens,
            parsed.n,
            prompt.max_tokens,
        )
        ticket = self.tenants.make_ticket(
            tenant=tenant,
            request_id=timeline.request_id,
            model=self.served_model,
            service_tier=parsed.service_tier,
            asked_class=context.traffic_class,
            timeout_s=context.timeout_s,
            prompt_tokens=prompt.tokens,
            max_tokens=prompt.max_tokens,
            open_ended=parsed.max_tokens is None,
            arrival=timeline.arrival,
            # A constrained generation resumed as a continuation would restart its grammar;
            # one of several choices (or beams) cannot resume alone; embeddings cannot be
            # continued with token ids.
            preemptible=(
                prompt.output.constraint is None
                and parsed.n == 1
                and prompt.embeds is None
                and not parsed.sampling.get("beam_search")
            ),
            n=parsed.n,
            adapter=adapter,
        )
        watch = self.dispatcher.slo(ticket)
        if watch is not None:
            timeline.slo, timeline.meter = watch
        request = GenerationRequest(
            request_id=timeline.request_id,
            prompt_token_ids=prompt.ids,
            sampling=prompt.sampling(parsed),
            prompt_embeds=prompt.embeds,
            adapter=adapter,
            cache_salt=_salted(tenant.cache_salt, parsed.cache_salt),
        )
        timeline.sampling = request.sampling
        return ticket, request, prompt.output

    def plan_prompt(self, parsed: ParsedRequest) -> PromptPlan:
        """What the engine would run for a request of a model served (`check_model`): its
        output's plan, its prompt, and the tokens it may generate, each checked (a 400
        otherwise). What `prepare` plans with, and what the render endpoints answer."""
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
        self.check_token_ids(parsed)
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
        return PromptPlan(plan, prompt_ids, embeds, prompt_tokens, max_tokens)

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

    def check_model(self, model: str | None, tenant: Tenant | None = None) -> str | None:
        """The LoRA adapter a request for `model` runs on (None: the base model); a model not
        served, or not the tenant's, is a 404 naming those that are. A request that names none
        gets the tenant's default model."""
        if model is None:
            model = tenant.config.default_model if tenant is not None else None
            if model is None:
                model = self.served_model
        usable = self.models(tenant)
        if model not in usable:
            served = ", ".join(f"'{name}'" for name in usable) or "none"
            raise ModelNotFound(
                f"the model '{model}' does not exist; this server serves {served}", param="model"
            )
        return None if model == self.served_model else model

    def models(self, tenant: Tenant | None) -> list[str]:
        """The served model, then its adapters, that `tenant` may use (every one: None)."""
        served = [self.served_model, *self.engine.model.adapters]
        allowed = None if tenant is None else tenant.config.models
        return served if allowed is None else [name for name in served if name in allowed]

    def check_token_ids(self, parsed: ParsedRequest) -> None:
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

    def shape(
        self,
        parsed: ParsedRequest,
        engine_request: GenerationRequest,
        plan: OutputPlan,
        *,
        stream: bool,
        response_id: str,
        first_index: int = 0,
        created: int | None = None,
        chunks: bool = True,
    ) -> Shape:
        prompt_ids = engine_request.prompt_token_ids
        return Shape(
            parsed=parsed,
            model=engine_request.adapter or self.served_model,
            stream=stream,
            response_id=response_id,
            first_index=first_index,
            created=created,
            new_parser=None if plan.parser is None else functools.partial(plan.parser, prompt_ids),
            prompt_token_ids=prompt_ids if parsed.return_token_ids else None,
            echo=self._echo(parsed, prompt_ids),
            stream_interval=max(self.stream_interval, parsed.stream_interval or 1),
            chunks=chunks,
            wire=self.wire,
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
