"""A generation's token counts, as the summary of its run carries them (`Event.final`) and
every API's reader translates them: in the shape of OpenAI's `usage` object."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """OpenAI's `usage`. `cached_tokens`: of the prompt's, those the engine found in its prefix
    cache, in `prompt_tokens_details` as OpenAI (and vLLM's `--enable-prompt-tokens-details`)
    sends them (None: the engine has not looked the prompt up yet, and they are left out)."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


def cached_tokens(counts: dict[str, Any]) -> int:
    """The prompt tokens found cached that a `usage` counts (0 where it says none)."""
    details = counts.get("prompt_tokens_details")
    return details["cached_tokens"] if details else 0


def summed_usage(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The `usage` of generations answered as one (the prompts of one request)."""
    prompt = completion = cached = 0
    for counts in parts:
        prompt += counts["prompt_tokens"]
        completion += counts["completion_tokens"]
        cached += cached_tokens(counts)
    return usage(prompt, completion, cached)
