"""`GET /openapi.json`: the API as OpenAPI 3.1. Every body's schema is its request model's
(`server.openai`), lifted into `components`; what is written here is only which path takes
which model, and what it answers. The schemas describe what is well-formed; what the engine
then accepts (a tool choice needing a parser, logprobs on an engine without them) is answered
with a 400 naming the field, as everywhere else."""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from server.anthropic.messages import CountTokensRequest, MessagesRequest
from server.anthropic.replies import AnthropicErrorBody
from server.api.openai_routes import JSONResponse
from server.api.tokenizer_routes import VERSION
from server.openai.batch import CreateBatch, FileUpload
from server.openai.chat import NOT_IN_BATCH, ChatCompletionRequest
from server.openai.completion import CompletionRequest
from server.openai.error_body import ErrorBody
from server.openai.responses_api import CreateResponse
from server.openai.tokenizer import Detokenize, TokenizeChat, TokenizeText

_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeText,
    TokenizeChat,
    Detokenize,
    CreateBatch,
    FileUpload,
    ErrorBody,
    CreateResponse,
    MessagesRequest,
    CountTokensRequest,
    AnthropicErrorBody,
)
_OBJ = {"type": "object"}
_STR = {"type": "string"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _components() -> dict[str, Any]:
    """Every model's JSON Schema, the models they hold included, by name."""
    _, schema = models_json_schema(
        [(model, "validation") for model in _MODELS], ref_template="#/components/schemas/{model}"
    )
    schemas: dict[str, Any] = schema["$defs"]
    chat = schemas["ChatCompletionRequest"]
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
    schemas["BatchedChatCompletionRequest"] = batched
    return schemas


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


_ERRORS = {
    status: {"description": description, "content": _json(_ref(ErrorBody))}
    for status, description in (
        ("400", "bad input, named in `param`"),
        ("401", "a missing or unknown key"),
        ("404", "an unknown model"),
        ("413", "a body over --max-body-bytes"),
        ("422", "an idempotency key sent again with another body"),
        ("429", "over a quota or the queue's bound (Retry-After)"),
        ("503", "the engine is unavailable (Retry-After)"),
        ("504", "the deadline passed while queued"),
    )
}


def _param(name: str, where: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    """A parameter: required in the path, optional elsewhere."""
    param = {"name": name, "in": where, "required": where == "path", "schema": schema}
    return {**param, "description": description} if description else param


_IDEMPOTENCY_KEY = _param(
    "Idempotency-Key",
    "header",
    {"type": "string", "minLength": 1, "maxLength": 255},
    "makes the generation resumable; the same key and body answer with it again "
    "(Idempotent-Replayed: true), another body gets 422",
)


def _generation(summary: str, body: dict[str, Any], *, idempotent: bool = True) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [_IDEMPOTENCY_KEY] if idempotent else [],
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {
                "200": {
                    "description": "a whole response, or with `stream` an SSE stream",
                    "content": {**_json(_OBJ), "text/event-stream": {"schema": _STR}},
                },
                **_ERRORS,
            },
        }
    }


def _anthropic(
    summary: str, body: type[BaseModel], answer: str, *, generates: bool = False
) -> dict[str, Any]:
    """An Anthropic route: its errors in Anthropic's shape, with Sluice's statuses. One that
    `generates` streams with `stream`, and takes an idempotency key."""
    errors = {
        status: {**spec, "content": _json(_ref(AnthropicErrorBody))}
        for status, spec in _ERRORS.items()
    }
    content = {**_json(_OBJ), **({"text/event-stream": {"schema": _STR}} if generates else {})}
    return {
        "post": {
            "summary": summary,
            "parameters": [_IDEMPOTENCY_KEY] if generates else [],
            "requestBody": {"required": True, "content": _json(_ref(body))},
            "responses": {"200": {"description": answer, "content": content}, **errors},
        }
    }


def _resume(kind: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": f"resume a streamed {kind} sent with an Idempotency-Key",
            "parameters": [
                _param("id", "path", _STR, "the id of the chunks received"),
                _param("Last-Event-ID", "header", {"type": "string", "pattern": "^[0-9]{1,18}$"}),
                _param(
                    "starting_after",
                    "query",
                    {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
                ),
            ],
            "responses": {
                "200": {
                    "description": "the events after the one named, then live",
                    "content": {"text/event-stream": {"schema": _STR}},
                },
                **_ERRORS,
            },
        }
    }


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary}}}}


def _post_json(summary: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {"200": {"description": summary, "content": _json(_OBJ)}, **_ERRORS},
        }
    }


def _with_id(operation: dict[str, Any], name: str) -> dict[str, Any]:
    """`operation` on a path naming one of the tenant's objects."""
    return {
        method: {
            **spec,
            "parameters": [_param("id", "path", _STR, name)],
            "responses": {**spec["responses"], **_ERRORS},
        }
        for method, spec in operation.items()
    }


def _batch_api() -> dict[str, Any]:
    upload = {
        "post": {
            "summary": "upload a JSONL file of batch requests",
            "requestBody": {
                "required": True,
                "content": {"multipart/form-data": {"schema": _ref(FileUpload)}},
            },
            "responses": {"200": {"description": "the file object"}, **_ERRORS},
        }
    }
    cancel = {
        "post": {"summary": "cancel a batch", "responses": {"200": {"description": "the batch"}}}
    }
    delete = {
        "delete": {"summary": "delete a file", "responses": {"200": {"description": "deleted"}}}
    }
    return {
        "/v1/files": {**upload, **_get("the tenant's files")},
        "/v1/files/{id}": {
            **_with_id(_get("a file"), "a file id"),
            **_with_id(delete, "a file id"),
        },
        "/v1/files/{id}/content": _with_id(_get("a file's content"), "a file id"),
        "/v1/batches": {
            **_post_json("create a batch", _ref(CreateBatch)),
            **_get("the tenant's batches (after, limit)"),
        },
        "/v1/batches/{id}": _with_id(_get("a batch"), "a batch id"),
        "/v1/batches/{id}/cancel": _with_id(cancel, "a batch id"),
    }


def _responses_api() -> dict[str, Any]:
    retrieve = _get("a stored response, or with `stream` a background response's events")
    retrieve["get"]["parameters"] = [
        _param("stream", "query", {"type": "boolean"}, "a background response's events"),
        _param(
            "starting_after",
            "query",
            {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
            "with `stream`: the events after this sequence number",
        ),
    ]
    cancel = {
        "post": {
            "summary": "cancel a background response",
            "responses": {"200": {"description": "the response", "content": _json(_OBJ)}},
        }
    }
    return {
        "/v1/responses": _generation(
            "OpenAI's Responses API: a response (whole, streamed, or in the background)",
            _ref(CreateResponse),
            idempotent=False,
        ),
        "/v1/responses/{id}": _with_id(retrieve, "a response id"),
        "/v1/responses/{id}/cancel": _with_id(cancel, "a response id"),
    }


@functools.cache
def document(version: str) -> dict[str, Any]:
    """The OpenAPI document (built once per process)."""
    chat, completion = _ref(ChatCompletionRequest), _ref(CompletionRequest)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sluice",
            "version": version,
            "description": "OpenAI-compatible streaming token server with a scheduler",
        },
        "paths": {
            "/v1/chat/completions": _generation("a chat completion", chat),
            "/v1/completions": _generation("a text completion", completion),
            "/invocations": _generation(
                "SageMaker's: a chat or a text completion, by the body",
                {"anyOf": [chat, completion]},
            ),
            "/v1/chat/completions/batch": _generation(
                "vLLM's: one chat completion per conversation (no stream, tools or n)",
                {"$ref": "#/components/schemas/BatchedChatCompletionRequest"},
                idempotent=False,
            ),
            "/v1/messages": _anthropic(
                "Anthropic's Messages API: a chat completion in Anthropic's shape",
                MessagesRequest,
                "a message, or with `stream` Anthropic's SSE events",
                generates=True,
            ),
            "/v1/messages/count_tokens": _anthropic(
                "Anthropic's: the prompt's tokens after the chat template",
                CountTokensRequest,
                "{input_tokens}",
            ),
            "/v1/chat/completions/{id}/stream": _resume("chat completion"),
            "/v1/completions/{id}/stream": _resume("completion"),
            "/v1/models": _get("the served model"),
            "/tokenize": _post_json(
                "token ids of a prompt or chat",
                {"anyOf": [_ref(TokenizeText), _ref(TokenizeChat)]},
            ),
            "/detokenize": _post_json("the text of token ids", _ref(Detokenize)),
            "/version": _get("Sluice's version"),
            "/health": _get("200 while the process is alive"),
            "/ready": _get("200 when the engine is ready, else 503"),
            "/openapi.json": _get("this document"),
            **_batch_api(),
            **_responses_api(),
        },
        "components": {"schemas": _components()},
    }


async def openapi_json(request: Request) -> Response:
    return JSONResponse(document(VERSION))
