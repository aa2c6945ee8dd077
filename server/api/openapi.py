"""`/openapi.json`'s operations, one builder per endpoint, and the document made of them.

The route table (`server.api.routes.ENDPOINTS`) names each endpoint's builder; the document
lists those the app serves. Every body is a model's schema, lifted into `components`: a request
body is its request model's (`server.openai_wire`, `server.anthropic`); a reply is the model its
API's own SDK declares (`openai.types`, `anthropic.types`: the wire formats as their makers
maintain them; Sluice's replies add fields, such as `timings`, that clients ignore), or
Sluice's own (`server.openai_wire.models`) for what no SDK describes. The SDKs are imported when
the document is first built, not when the server starts. The schemas describe what is
well-formed; what the engine then accepts (a tool choice needing a parser, logprobs on an
engine without them) is answered with a 400 naming the field, as everywhere else.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from server.anthropic.messages import CountTokensRequest, MessagesRequest
from server.anthropic.replies import AnthropicErrorBody
from server.batch_api.wire import CreateBatch, FileUpload
from server.openai_wire.chat import NOT_IN_BATCH, ChatCompletionRequest
from server.openai_wire.completion import CompletionRequest
from server.openai_wire.error_body import ErrorBody
from server.openai_wire.models import (
    LoadLoRAAdapter,
    ModelList,
    Ready,
    Status,
    UnloadLoRAAdapter,
    VersionReply,
)
from server.openai_wire.render import RenderReply
from server.openai_wire.tokenizer import (
    Detokenize,
    DetokenizeReply,
    TokenizeChat,
    TokenizeReply,
    TokenizeText,
)
from server.responses_api.wire import CreateResponse

Operation = dict[str, Any]  # an OpenAPI operation (the route table names its method)


@dataclass(frozen=True, slots=True)
class Schema:
    """A model's JSON Schema in a body: the document replaces it with its `$ref`."""

    model: type[BaseModel]
    mode: JsonSchemaMode = "serialization"


def _request(model: type[BaseModel]) -> Schema:
    return Schema(model, "validation")


_STR = {"type": "string"}
_BATCHED = {"$ref": "#/components/schemas/BatchedChatCompletionRequest"}


def _json(schema: Any) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _list(item: Schema) -> dict[str, Any]:
    """An OpenAI list object of `item`s."""
    return {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "has_more": {"type": "boolean"},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
        },
    }


def _errors(body: type[BaseModel] = ErrorBody) -> dict[str, Any]:
    return {
        status: {"description": description, "content": _json(Schema(body))}
        for status, description in (
            ("400", "bad input, named in `param`"),
            ("401", "a missing or unknown key"),
            ("404", "an unknown model or object"),
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
_SSE = {"text/event-stream": {"schema": _STR}}
_SEQUENCE = {"type": "integer", "minimum": 0, "maximum": 10**18 - 1}


def _reply(description: str, body: Any, *, stream: bool = False) -> dict[str, Any]:
    return {"description": description, "content": {**_json(body), **(_SSE if stream else {})}}


def _generation(
    summary: str, body: Any, answer: Any, *, idempotent: bool = True, stream: bool = True
) -> Operation:
    return {
        "summary": summary,
        "parameters": [_IDEMPOTENCY_KEY] if idempotent else [],
        "requestBody": {"required": True, "content": _json(body)},
        "responses": {
            "200": _reply(
                "a whole response, or with `stream` an SSE stream" if stream else "a response",
                answer,
                stream=stream,
            ),
            **_errors(),
        },
    }


def _get(summary: str, answer: Any) -> Operation:
    return {"summary": summary, "responses": {"200": _reply(summary, answer)}}


def _post(summary: str, body: Any, answer: Any) -> Operation:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(body)},
        "responses": {"200": _reply(summary, answer), **_errors()},
    }


def with_id(operation: Callable[[], Operation], name: str) -> Callable[[], Operation]:
    """`operation` on a path naming one of the tenant's objects (`{id}`: `name`)."""

    def build() -> Operation:
        spec = operation()
        return {
            **spec,
            "parameters": [_param("id", "path", _STR, name), *spec.get("parameters", [])],
            "responses": {**spec["responses"], **_errors()},
        }

    return build


# --- the builders, each named in the route table ---------------------------------------------


def health() -> Operation:
    return _get("200 while the process is alive", Schema(Status))


def ready() -> Operation:
    return _get("200 when the engine is ready, else 503", Schema(Ready))


def models() -> Operation:
    return _get("the served model and its LoRA adapters", Schema(ModelList))


def load_lora_adapter() -> Operation:
    return _admin(
        "load a LoRA adapter, served as a model (an admin key's)",
        LoadLoRAAdapter,
        {  # as vLLM's server answers
            "404": "no adapter at `lora_path`",
            "500": "an adapter the engine cannot load (`adapter_load_failed`, with its reason)",
        },
    )


def unload_lora_adapter() -> Operation:
    return _admin(
        "unload a LoRA adapter (an admin key's); its running requests finish",
        UnloadLoRAAdapter,
        {"404": "no adapter of that name is loaded"},
    )


def _admin(summary: str, body: type[BaseModel], errors: dict[str, str]) -> Operation:
    """An operation only an admin key may call (403 for any other), answered in plain text,
    with its own error answers beside every operation's."""
    operation = _post(summary, _request(body), {"type": "string"})
    own = {"403": "a key that is not an admin's", **errors}
    responses = {
        status: {"description": description, "content": _json(Schema(ErrorBody))}
        for status, description in own.items()
    }
    return {**operation, "responses": {**operation["responses"], **responses}}


def version() -> Operation:
    return _get("Sluice's version", Schema(VersionReply))


def itself() -> Operation:
    return _get("this document", {"type": "object"})


def tokenize() -> Operation:
    texts = {"anyOf": [_request(TokenizeText), _request(TokenizeChat)]}
    return _post("token ids of a prompt or chat", texts, Schema(TokenizeReply))


def detokenize() -> Operation:
    return _post("the text of token ids", _request(Detokenize), Schema(DetokenizeReply))


def chat() -> Operation:
    from openai.types.chat import ChatCompletion

    return _generation("a chat completion", _request(ChatCompletionRequest), Schema(ChatCompletion))


def completion() -> Operation:
    from openai.types import Completion

    return _generation("a text completion", _request(CompletionRequest), Schema(Completion))


def invocations() -> Operation:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    return _generation(
        "SageMaker's: a chat or a text completion, by the body",
        {"anyOf": [_request(ChatCompletionRequest), _request(CompletionRequest)]},
        {"anyOf": [Schema(ChatCompletion), Schema(Completion)]},
    )


def render_chat() -> Operation:
    return _post(
        "vLLM's: the chat rendered into what the engine would run (its prompt's token ids), "
        "without generating",
        _request(ChatCompletionRequest),
        Schema(RenderReply),
    )


def render_completion() -> Operation:
    return _post(
        "vLLM's: the completion rendered into what the engine would run, one per prompt",
        _request(CompletionRequest),
        {"type": "array", "items": Schema(RenderReply)},
    )


def render_response() -> Operation:
    return _post(
        "vLLM's: the response's chat rendered into what the engine would run (stateless: "
        "no previous_response_id)",
        _request(CreateResponse),
        Schema(RenderReply),
    )


def chat_batch() -> Operation:
    from openai.types.chat import ChatCompletion

    return _generation(
        "vLLM's: one chat completion per conversation (no stream, tools or n)",
        _BATCHED,
        Schema(ChatCompletion),
        idempotent=False,
        stream=False,
    )


def _anthropic(summary: str, body: type[BaseModel], answer: Any, *, generates: bool) -> Operation:
    """An Anthropic route: its errors in Anthropic's shape, with Sluice's statuses. One that
    `generates` streams with `stream`, and takes an idempotency key."""
    return {
        "summary": summary,
        "parameters": [_IDEMPOTENCY_KEY] if generates else [],
        "requestBody": {"required": True, "content": _json(_request(body))},
        "responses": {
            "200": _reply(summary, answer, stream=generates),
            **_errors(AnthropicErrorBody),
        },
    }


def messages() -> Operation:
    from anthropic.types import Message

    return _anthropic(
        "Anthropic's Messages API: a message, or with `stream` Anthropic's SSE events",
        MessagesRequest,
        Schema(Message),
        generates=True,
    )


def count_tokens() -> Operation:
    from anthropic.types import MessageTokensCount

    return _anthropic(
        "Anthropic's: the prompt's tokens after the chat template",
        CountTokensRequest,
        Schema(MessageTokensCount),
        generates=False,
    )


def resume(kind: str) -> Callable[[], Operation]:
    def build() -> Operation:
        return {
            "summary": f"resume a streamed {kind} sent with an Idempotency-Key",
            "parameters": [
                _param("id", "path", _STR, "the id of the chunks received"),
                _param("Last-Event-ID", "header", {"type": "string", "pattern": "^[0-9]{1,18}$"}),
                _param("starting_after", "query", _SEQUENCE),
            ],
            "responses": {
                "200": {
                    "description": "the events after the one named, then live",
                    "content": _SSE,
                },
                **_errors(),
            },
        }

    return build


def create_response() -> Operation:
    from openai.types.responses import Response

    return _generation(
        "OpenAI's Responses API: a response (whole, streamed, or in the background)",
        _request(CreateResponse),
        Schema(Response),
        idempotent=False,
    )


def get_response() -> Operation:
    from openai.types.responses import Response

    summary = "a stored response, or with `stream` a background response's events"
    return {
        "summary": summary,
        "parameters": [
            _param("stream", "query", {"type": "boolean"}, "a background response's events"),
            _param(
                "starting_after",
                "query",
                _SEQUENCE,
                "with `stream`: the events after this sequence number",
            ),
        ],
        "responses": {"200": _reply(summary, Schema(Response), stream=True)},
    }


def cancel_response() -> Operation:
    from openai.types.responses import Response

    summary = "cancel a background response"
    return {"summary": summary, "responses": {"200": _reply(summary, Schema(Response))}}


def upload() -> Operation:
    from openai.types import FileObject

    return {
        "summary": "upload a JSONL file of batch requests",
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": _request(FileUpload)}},
        },
        "responses": {"200": _reply("the file object", Schema(FileObject)), **_errors()},
    }


def list_files() -> Operation:
    from openai.types import FileObject

    return _get("the tenant's files", _list(Schema(FileObject)))


def file() -> Operation:
    from openai.types import FileObject

    return _get("a file", Schema(FileObject))


def delete_file() -> Operation:
    from openai.types import FileDeleted

    summary = "delete a file"
    return {"summary": summary, "responses": {"200": _reply(summary, Schema(FileDeleted))}}


def file_content() -> Operation:
    summary = "a file's content"
    content = {"application/jsonl": {"schema": _STR}}
    return {"summary": summary, "responses": {"200": {"description": summary, "content": content}}}


def create_batch() -> Operation:
    from openai.types import Batch

    return _post("create a batch", _request(CreateBatch), Schema(Batch))


def list_batches() -> Operation:
    from openai.types import Batch

    operation = _get("the tenant's batches", _list(Schema(Batch)))
    operation["parameters"] = [
        _param("after", "query", _STR, "the batches after this id"),
        _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100}),
    ]
    return operation


def batch() -> Operation:
    from openai.types import Batch

    return _get("a batch", Schema(Batch))


def cancel_batch() -> Operation:
    from openai.types import Batch

    summary = "cancel a batch"
    return {"summary": summary, "responses": {"200": _reply(summary, Schema(Batch))}}


# --- the document ---------------------------------------------------------------------------


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
