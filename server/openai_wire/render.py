"""vLLM's render endpoints' answer (`POST /v1/chat/completions/render`,
`/v1/completions/render`, `/v1/responses/render`): a request rendered, without generating,
into what the engine would run, in the shape of vLLM's `GenerateRequest`. vLLM's router asks
for it before it routes a request, for the prompt's token ids (its prefix-cache routing)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, Field

from engine_adapters.protocol import SamplingOptions
from server.generations.parsed import ParsedRequest

# vLLM's RequestOutputKind: a streamed request's outputs are deltas, a whole one's the end.
_DELTA, _FINAL_ONLY = 1, 2
# What vLLM's SamplingParams serialise whatever their values (the rest, when not the default).
_ALWAYS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "bad_words",
)
# SamplingOptions' fields that are not vLLM's SamplingParams' (Sluice's own, or the engine's
# objects), left out.
_NOT_VLLMS = {"constraint", "tokens_as_ids", "beam_search", "length_penalty"}
_DEFAULTS = {f.name: f.default for f in fields(SamplingOptions)}


class RenderReply(BaseModel):
    """vLLM's `GenerateRequest`, as its render endpoints answer: the prompt's `token_ids`
    (after the chat template), the sampling parameters by vLLM's names, and the request's
    own fields. Sluice renders text only, so the multimodal fields are null; it computes no
    character offsets (`token_offsets` null, as vLLM's is for a tokenizer that cannot)."""

    request_id: str
    token_ids: list[int] = Field(min_length=1)
    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: dict[str, Any] = Field(
        description="vLLM's SamplingParams: max_tokens as the context leaves it, and the "
        "sampling parameters the request set (structured outputs left out)"
    )
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


def render_reply(
    request_id: str, parsed: ParsedRequest, token_ids: list[int], options: SamplingOptions
) -> RenderReply:
    """The answer for a request (`parsed`) whose prompt is `token_ids` and whose sampling
    options, max_tokens as planned, are `options`."""
    stream_options = None
    if parsed.stream and (parsed.include_usage or parsed.continuous_usage):
        stream_options = {
            "include_usage": parsed.include_usage,
            "continuous_usage_stats": parsed.continuous_usage,
        }
    return RenderReply(
        request_id=request_id,
        token_ids=token_ids,
        sampling_params=sampling_params(options, stream=parsed.stream),
        model=parsed.model,
        stream=parsed.stream,
        stream_options=stream_options,
        cache_salt=parsed.cache_salt,
    )


def sampling_params(options: SamplingOptions, *, stream: bool) -> dict[str, Any]:
    """`options` as vLLM serialises its SamplingParams (its names; lists for tuples)."""
    params: dict[str, Any] = {}
    for name, default in _DEFAULTS.items():
        value = getattr(options, name)
        if name in _NOT_VLLMS or (name not in _ALWAYS and value == default):
            continue
        params[name] = list(value) if isinstance(value, tuple) else value
    # (vLLM's own, as its render answers them: its engine neither copies the parameters nor
    # skips the prefix cache's reads for them.)
    params.update(
        output_kind=_DELTA if stream else _FINAL_ONLY,
        skip_clone=True,
        skip_reading_prefix_cache=False,
    )
    return params
