"""The Chat Completions and Completions APIs' endpoints, vLLM's tokenizer and render endpoints
and `/version`: each one's method, path, handler and OpenAPI operation."""

from __future__ import annotations

from collections.abc import Callable

from server.chat_api.render import render_chat, render_completion
from server.chat_api.routes import (
    chat_completions,
    chat_completions_batch,
    completions,
    invocations,
    resume_chat_completion,
    resume_completion,
)
from server.chat_api.tokenizer import detokenize, tokenize, version
from server.http.endpoints import Endpoint
from server.http.operations import (
    SEQUENCE,
    SSE,
    STR,
    Operation,
    Schema,
    errors,
    generation,
    get,
    param,
    post,
    request,
)
from server.openai_wire.chat import ChatCompletionRequest
from server.openai_wire.completion import CompletionRequest
from server.openai_wire.models import VersionReply
from server.openai_wire.render import RenderReply
from server.openai_wire.tokenizer import (
    Detokenize,
    DetokenizeReply,
    TokenizeChat,
    TokenizeReply,
    TokenizeText,
)

# vLLM's batched chat request: the document derives it from the chat request's schema.
BATCHED = {"$ref": "#/components/schemas/BatchedChatCompletionRequest"}


def _chat() -> Operation:
    from openai.types.chat import ChatCompletion

    return generation("a chat completion", request(ChatCompletionRequest), Schema(ChatCompletion))


def _completion() -> Operation:
    from openai.types import Completion

    return generation("a text completion", request(CompletionRequest), Schema(Completion))


def _invocations() -> Operation:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    return generation(
        "SageMaker's: a chat or a text completion, by the body",
        {"anyOf": [request(ChatCompletionRequest), request(CompletionRequest)]},
        {"anyOf": [Schema(ChatCompletion), Schema(Completion)]},
    )


def _chat_batch() -> Operation:
    from openai.types.chat import ChatCompletion

    return generation(
        "vLLM's: one chat completion per conversation (no stream, tools or n)",
        BATCHED,
        Schema(ChatCompletion),
        idempotent=False,
        stream=False,
    )


def _resume(kind: str) -> Callable[[], Operation]:
    def build() -> Operation:
        return {
            "summary": f"resume a streamed {kind} sent with an Idempotency-Key",
            "parameters": [
                param("id", "path", STR, "the id of the chunks received"),
                param("Last-Event-ID", "header", {"type": "string", "pattern": "^[0-9]{1,18}$"}),
                param("starting_after", "query", SEQUENCE),
            ],
            "responses": {
                "200": {
                    "description": "the events after the one named, then live",
                    "content": SSE,
                },
                **errors(),
            },
        }

    return build


def _version() -> Operation:
    return get("Sluice's version", Schema(VersionReply))


def _tokenize() -> Operation:
    texts = {"anyOf": [request(TokenizeText), request(TokenizeChat)]}
    return post("token ids of a prompt or chat", texts, Schema(TokenizeReply))


def _detokenize() -> Operation:
    return post("the text of token ids", request(Detokenize), Schema(DetokenizeReply))


def _render_chat() -> Operation:
    return post(
        "vLLM's: the chat rendered into what the engine would run (its prompt's token ids), "
        "without generating",
        request(ChatCompletionRequest),
        Schema(RenderReply),
    )


def _render_completion() -> Operation:
    return post(
        "vLLM's: the completion rendered into what the engine would run, one per prompt",
        request(CompletionRequest),
        {"type": "array", "items": Schema(RenderReply)},
    )


# The generation endpoints first: Starlette tries each route in turn (a regex per miss), and
# these take nearly every request.
ENDPOINTS: tuple[Endpoint[None], ...] = (
    Endpoint("POST", "/v1/chat/completions", chat_completions, _chat),
    Endpoint("POST", "/v1/completions", completions, _completion),
    Endpoint("GET", "/version", version, _version),
    Endpoint("POST", "/tokenize", tokenize, _tokenize),
    Endpoint("POST", "/v1/chat/completions/render", render_chat, _render_chat),
    Endpoint("POST", "/v1/completions/render", render_completion, _render_completion),
    Endpoint("POST", "/detokenize", detokenize, _detokenize),
    Endpoint("POST", "/invocations", invocations, _invocations),
    Endpoint("POST", "/v1/chat/completions/batch", chat_completions_batch, _chat_batch),
    Endpoint(
        "GET",
        "/v1/chat/completions/{id}/stream",
        resume_chat_completion,
        _resume("chat completion"),
    ),
    Endpoint("GET", "/v1/completions/{id}/stream", resume_completion, _resume("completion")),
)
