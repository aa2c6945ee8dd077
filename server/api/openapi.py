"""`/openapi.json`: the document made of the operations the endpoints declare, each beside its
handler in its API's package (`server.<api>.endpoints`, joined in `server.api.routes`); it
lists those the app serves. Every body that is a model's schema (`server.http.operations.Schema`)
is lifted into `components`, and the batched chat request's schema is derived from the chat
request's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from server.http.operations import Operation, Schema
from server.openai_wire.chat import NOT_IN_BATCH, ChatCompletionRequest


def _schemas(node: Any, found: dict[tuple[type[BaseModel], JsonSchemaMode], None]) -> None:
    if isinstance(node, Schema):
        found[node.model, node.mode] = None
    elif isinstance(node, dict):
        for value in node.values():
            _schemas(value, found)
    elif isinstance(node, list):
        for value in node:
            _schemas(value, found)


def _resolved(node: Any, refs: Mapping[tuple[Any, JsonSchemaMode], Any]) -> Any:
    if isinstance(node, Schema):
        return refs[node.model, node.mode]
    if isinstance(node, dict):
        return {key: _resolved(value, refs) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolved(value, refs) for value in node]
    return node


def document(
    endpoints: Iterable[tuple[str, str, Callable[[], Operation]]], version: str
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `endpoints` (method, path, its operation's builder)."""
    paths: dict[str, dict[str, Operation]] = {}
    for method, path, build in endpoints:
        paths.setdefault(path, {})[method.lower()] = build()
    found: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {
        (ChatCompletionRequest, "validation"): None  # the batched request's own
    }
    _schemas(paths, found)
    refs, schema = models_json_schema(list(found), ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = schema["$defs"]
    chat_ref = refs[ChatCompletionRequest, "validation"]["$ref"]
    schemas["BatchedChatCompletionRequest"] = _batched(schemas[chat_ref.rsplit("/", 1)[1]])
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sluice",
            "version": version,
            "description": "OpenAI-compatible streaming token server with a scheduler",
        },
        "paths": _resolved(paths, refs),
        "components": {"schemas": schemas},
    }


def _batched(chat: dict[str, Any]) -> dict[str, Any]:
    """vLLM's batched chat request: a chat request whose `messages` are conversations."""
    batched = copy.deepcopy(chat)
    for name in (*NOT_IN_BATCH, "stream_options"):  # stream_options: only with stream
        batched["properties"].pop(name)
    batched["properties"]["messages"] = {
        "type": "array",
        "minItems": 1,
        "items": chat["properties"]["messages"],
        "description": "conversations: one choice each, in order",
    }
    batched["title"] = "BatchedChatCompletionRequest"
    return batched
