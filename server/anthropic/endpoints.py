"""Anthropic's Messages API's endpoints: each one's method, path, handler and OpenAPI
operation, its errors in Anthropic's shape with Sluice's statuses."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.anthropic.messages import CountTokensRequest, MessagesRequest
from server.anthropic.replies import AnthropicErrorBody
from server.anthropic.routes import count_tokens, messages
from server.http.endpoints import Endpoint
from server.http.operations import (
    IDEMPOTENCY_KEY,
    Operation,
    Schema,
    errors,
    json_content,
    reply,
    request,
)


def _anthropic(summary: str, body: type[BaseModel], answer: Any, *, generates: bool) -> Operation:
    """An Anthropic route: its errors in Anthropic's shape, with Sluice's statuses. One that
    `generates` streams with `stream`, and takes an idempotency key."""
    return {
        "summary": summary,
        "parameters": [IDEMPOTENCY_KEY] if generates else [],
        "requestBody": {"required": True, "content": json_content(request(body))},
        "responses": {
            "200": reply(summary, answer, stream=generates),
            **errors(AnthropicErrorBody),
        },
    }


def _messages() -> Operation:
    from anthropic.types import Message

    return _anthropic(
        "Anthropic's Messages API: a message, or with `stream` Anthropic's SSE events",
        MessagesRequest,
        Schema(Message),
        generates=True,
    )


def _count_tokens() -> Operation:
    from anthropic.types import MessageTokensCount

    return _anthropic(
        "Anthropic's: the prompt's tokens after the chat template",
        CountTokensRequest,
        Schema(MessageTokensCount),
        generates=False,
    )


ENDPOINTS: tuple[Endpoint[None], ...] = (
    Endpoint("POST", "/v1/messages", messages, _messages),
    Endpoint("POST", "/v1/messages/count_tokens", count_tokens, _count_tokens),
)
