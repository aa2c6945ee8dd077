"""OpenAI's chat logprobs, as the chat chunks, the Responses API and Sluice's WebSocket
messages carry them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_adapters.protocol import TokenLogprob


def chat_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content` entries."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode()),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top
            ],
        }
        for e in entries
    ]
