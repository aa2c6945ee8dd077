"""One entry for the generation routes: a decoded JSON body, validated, as a ParsedRequest."""

from __future__ import annotations

from typing import Any

from server.generations.parsed import ParsedRequest
from server.openai_wire.chat import ChatCompletionRequest
from server.openai_wire.completion import CompletionRequest
from server.openai_wire.wire import validated

REQUEST_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
}


def parse_request(body: Any, kind: str) -> ParsedRequest:
    """Validate a decoded JSON body for `kind` ("chat" or "completion")."""
    return validated(REQUEST_MODELS[kind], body).to_parsed()
