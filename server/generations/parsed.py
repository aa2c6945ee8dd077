"""A generation request, validated: what the routes, the scheduler and the engine read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_adapters.protocol import SamplingOptions


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """An OpenAI request, validated. `max_tokens` is None when the client set no limit."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    max_tokens: int | None
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    service_tier: str | None
    continuous_usage: bool = False  # usage so far in every chunk (vLLM's continuous_usage_stats)
    add_special_tokens: bool = True  # for a text prompt (chat templates bring their own)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids too
    # Completions: the prompt comes first in the text (and logprobs); chat: the last message's
    # content, if the assistant's (the one it continues).
    echo: bool = False
    template_kwargs: dict[str, Any] | None = None  # chat: vLLM's chat_template_kwargs
    # vLLM's: keep this many prompt tokens (-1: the context's worth), the last or the first.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    output: dict[str, Any] = field(default_factory=dict)  # the output-shaping fields sent
    # vLLM's kv_transfer_params.prompt_token_ids: a prefill stage's prompt, forwarded by a
    # disaggregated-serving router, used verbatim instead of the messages or prompt.
    forwarded_prompt_ids: tuple[int, ...] | None = None
    # Completions: vLLM's prompt_embeds, one tensor's base64 text (then `prompt` is None).
    prompt_embeds: str | None = None
    stream_interval: int | None = None  # vLLM's: tokens per streamed chunk, at least
    cache_salt: str | None = None  # vLLM's: a prefix cache of its own (within the tenant's)
    # The body's fields that change nothing (undeclared, or declared so), by their paths.
    ignored: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        return int(self.sampling.get("n", 1))

    def sampling_options(
        self, max_tokens: int, constraint: object | None = None
    ) -> SamplingOptions:
        return SamplingOptions(max_tokens=max_tokens, constraint=constraint, **self.sampling)
