"""`GET /openapi.json`: the API as OpenAPI 3.1, its request bodies built from the request parser.

Every field `server.openai_requests` accepts has its JSON Schema in `PARAMETERS`; building the
document fails if the two ever disagree, so a field cannot be accepted without being documented
or documented without being accepted. The schemas describe what is well-formed; what the
engine then accepts (a tool choice needing a parser, logprobs on an engine without them) is
answered with a 400 naming the field, as everywhere else.
"""

from __future__ import annotations

import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.openai_routes import JSONResponse
from server.api.tokenizer_routes import TOKENIZE_CHAT, TOKENIZE_TEXT, VERSION
from server.openai_requests import MAX_CHOICES, MAX_LOGPROBS, REASONING_EFFORTS, accepted_fields

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_OBJ = {"type": "object"}
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": _STR},
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
        "name": _STR,
        "tool_calls": {"type": "array", "items": _OBJ},
        "tool_call_id": _STR,
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _STR, "description": _STR, "parameters": _OBJ, "strict": _BOOL},
        },
    },
}


def _between(schema: dict[str, Any], lo: float, hi: float | None = None) -> dict[str, Any]:
    return {**schema, "minimum": lo, **({} if hi is None else {"maximum": hi})}


PARAMETERS: dict[str, dict[str, Any]] = {
    "model": _STR,
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "prompt": {
        "anyOf": [
            _STR,
            {**_TOKENS, "minItems": 1},
            {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": [_STR, _TOKENS]},
                "description": "several prompts: one choice (or n) each, in order",
            },
        ]
    },
    "prompt_embeds": {
        "anyOf": [_STR, {"type": "array", "items": _STR}],
        "description": "vLLM's: base64 of a tensor saved by torch.save, "
        "(positions, hidden size); with --engine-arg enable_prompt_embeds=true; "
        "each one a prompt of its own, before those of `prompt`",
    },
    "stream": _BOOL,
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": _BOOL, "continuous_usage_stats": _BOOL},
    },
    "max_tokens": _between(_INT, 1),
    "max_completion_tokens": _between(_INT, 1),
    "n": _between(_INT, 1, MAX_CHOICES),
    "temperature": _between(_NUM, 0, 2),
    "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
    "top_k": _between(_INT, -1),
    "min_p": _between(_NUM, 0, 1),
    "min_tokens": _between(_INT, 0),
    "presence_penalty": _between(_NUM, -2, 2),
    "frequency_penalty": _between(_NUM, -2, 2),
    "repetition_penalty": {**_NUM, "exclusiveMinimum": 0, "maximum": 10},
    "seed": _between(_INT, -(2**63), 2**63 - 1),
    "stop": {"anyOf": [_STR, {"type": "array", "maxItems": 16, "items": _STR}]},
    "stop_token_ids": _TOKENS,
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL,
    "logit_bias": {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": _NUM,
    },
    "allowed_token_ids": {
        **_TOKENS,
        "minItems": 1,
        "description": "vLLM's: only these tokens may be generated",
    },
    "bad_words": {
        "type": "array",
        "items": {**_STR, "minLength": 1},
        "description": "vLLM's: words never generated",
    },
    "logprobs": {
        "anyOf": [_BOOL, _between(_INT, 0, MAX_LOGPROBS)],
        "description": "chat: a boolean; completions: how many top tokens (0-20)",
    },
    "top_logprobs": _between(_INT, 0, MAX_LOGPROBS),
    "prompt_logprobs": {
        **_between(_INT, 0, MAX_LOGPROBS),
        "description": "vLLM's: each prompt token's and the k likeliest (not with `stream`)",
    },
    "add_special_tokens": _BOOL,
    "return_token_ids": _BOOL,
    "return_tokens_as_token_ids": {
        **_BOOL,
        "description": "vLLM's: logprobs name tokens 'token_id:N'",
    },
    "service_tier": {"enum": ["auto", "default", "flex", "priority"]},
    "response_format": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "properties": {"name": _STR, "schema": _OBJ, "strict": _BOOL},
            },
        },
    },
    "structured_outputs": {
        "type": "object",
        "description": "vLLM's: one of json, regex, choice, grammar, json_object, structural_tag",
    },
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"]},
        ]
    },
    "parallel_tool_calls": _BOOL,
    "include_reasoning": _BOOL,
    "chat_template_kwargs": {
        **_OBJ,
        "description": "vLLM's: extra variables for the chat template (enable_thinking, ...)",
    },
    "reasoning_effort": {
        "enum": list(REASONING_EFFORTS),
        "description": "given to the chat "
        "template; also its enable_thinking, unless chat_template_kwargs sets "
        "it",
    },
    "documents": {
        "type": "array",
        "items": {"type": "object", "additionalProperties": _STR},
        "description": "vLLM's: documents for a RAG chat template",
    },
    "use_beam_search": {
        **_BOOL,
        "description": "vLLM's: the n best of n beams, answered "
        "when all are done (completions: not with `stream`)",
    },
    "length_penalty": {
        **_NUM,
        "description": "vLLM's: with beam search, a beam's score is "
        "its log-probability over its length ** length_penalty",
    },
    "echo": {
        **_BOOL,
        "description": "completions: the prompt first; chat: the last message's "
        "content first, if the assistant's",
    },
    "add_generation_prompt": _BOOL,
    "continue_final_message": _BOOL,
    "truncate_prompt_tokens": _between(_INT, -1),
    "truncation_side": {"enum": ["left", "right"]},
    # Accepted at their defaults only (another value is a 400 unsupported_parameter).
    "best_of": {"const": 1},
    "functions": {"const": []},
    "function_call": {"enum": ["none", "auto"]},
    "suffix": {"const": ""},
    # Accepted, with no effect on generation.
    "user": _STR,
    "metadata": _OBJ,
    "store": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "request_id": _STR,
    "priority": _INT,
    "kv_transfer_params": {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {"prompt_token_ids": {**_TOKENS, "minItems": 1}},
        "description": "vLLM's; only prompt_token_ids (used verbatim as "
        "the prompt): this server runs no KV connector",
    },
}

_NOT_IN_BATCH = {"stream", "stream_options", "n", "tools", "kv_transfer_params"}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _body(kind: str, required: list[str]) -> dict[str, Any]:
    fields = accepted_fields(kind)
    missing, extra = fields - PARAMETERS.keys(), required and set(required) - fields
    if missing or extra:
        raise RuntimeError(f"the {kind} request schema and parser disagree: {missing or extra}")
    return {
        "type": "object",
        "required": required,
        "additionalProperties": False,
        "properties": {name: PARAMETERS[name] for name in sorted(fields)},
    }


_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    "description": "makes the generation resumable; the same key and body answer with it "
    "again (Idempotent-Replayed: true), another body gets 422",
}


def _generation(summary: str, body: dict[str, Any], *, idempotent: bool = True) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [_IDEMPOTENCY_KEY] if idempotent else [],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "a whole response, or with `stream` an SSE stream",
                    "content": {
                        "application/json": {"schema": _OBJ},
                        "text/event-stream": {"schema": _STR},
                    },
                },
                **_ERRORS,
            },
        }
    }


_ERRORS = {
    status: {"description": description, "content": {"application/json": {"schema": _ERROR}}}
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


def _resume(kind: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": f"resume a streamed {kind} sent with an Idempotency-Key",
            "parameters": [
                {
                    "name": "id",
                    "in": "path",
                    "required": True,
                    "schema": _STR,
                    "description": "the id of the chunks received",
                },
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"},
                },
                {
                    "name": "starting_after",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
                },
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


def _with_id(operation: dict[str, Any], name: str) -> dict[str, Any]:
    """`operation` on a path naming one of the tenant's objects."""
    return {
        method: {
            **spec,
            "parameters": [
                {"name": "id", "in": "path", "required": True, "schema": _STR, "description": name}
            ],
            "responses": {**spec["responses"], **_ERRORS},
        }
        for method, spec in operation.items()
    }


_BATCH = {
    "type": "object",
    "required": ["input_file_id", "endpoint", "completion_window"],
    "additionalProperties": False,
    "properties": {
        "input_file_id": _STR,
        "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]},
        "completion_window": {"const": "24h"},
        "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": _STR},
    },
}
_UPLOAD = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}},
}


def _batch_api() -> dict[str, Any]:
    upload = {
        "post": {
            "summary": "upload a JSONL file of batch requests",
            "requestBody": {
                "required": True,
                "content": {"multipart/form-data": {"schema": _UPLOAD}},
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
            **_post_json("create a batch", _BATCH),
            **_get("the tenant's batches (after, limit)"),
        },
        "/v1/batches/{id}": _with_id(_get("a batch"), "a batch id"),
        "/v1/batches/{id}/cancel": _with_id(cancel, "a batch id"),
    }


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary}}}}


def _post_json(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": summary, "content": {"application/json": {"schema": _OBJ}}},
                **_ERRORS,
            },
        }
    }


@functools.cache
def document(version: str) -> dict[str, Any]:
    """The OpenAPI document (built once per process)."""
    chat, completion = _body("chat", ["messages"]), _body("completion", ["prompt"])
    fields = {**PARAMETERS, "prompt": _STR, "return_token_strs": _BOOL}
    tokenize = {
        "anyOf": [
            {
                "type": "object",
                "required": [required],
                "additionalProperties": False,
                "properties": {name: fields[name] for name in sorted(accepted)},
            }
            for required, accepted in (("prompt", TOKENIZE_TEXT), ("messages", TOKENIZE_CHAT))
        ]
    }
    detokenize = {
        "type": "object",
        "required": ["tokens"],
        "additionalProperties": False,
        "properties": {"model": _STR, "tokens": _TOKENS},
    }
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
                {
                    **chat,
                    "properties": {
                        **{k: v for k, v in chat["properties"].items() if k not in _NOT_IN_BATCH},
                        "messages": {
                            "type": "array",
                            "minItems": 1,
                            "items": PARAMETERS["messages"],
                        },
                    },
                },
                idempotent=False,
            ),
            "/v1/chat/completions/{id}/stream": _resume("chat completion"),
            "/v1/completions/{id}/stream": _resume("completion"),
            "/v1/models": _get("the served model"),
            "/tokenize": _post_json("token ids of a prompt or chat", tokenize),
            "/detokenize": _post_json("the text of token ids", detokenize),
            "/version": _get("Sluice's version"),
            "/health": _get("200 while the process is alive"),
            "/ready": _get("200 when the engine is ready, else 503"),
            "/openapi.json": _get("this document"),
            **_batch_api(),
        },
    }


async def openapi_json(request: Request) -> Response:
    return JSONResponse(document(VERSION))
