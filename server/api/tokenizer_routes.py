"""vLLM's tokenizer endpoints and `/version`, so tools written for vLLM's server find them.

`POST /tokenize` takes a text `prompt` (with `add_special_tokens`, default true) or chat
`messages` (through the chat template, generation prompt included) and answers
`{count, max_model_len, tokens, token_strs}` (`token_strs` null unless `return_token_strs`);
`POST /detokenize` takes `tokens` and answers `{prompt}`. Both use the engine's own tokenizer
and never reach the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.edge import context_of
from server.api.openai_routes import JSONResponse, read_json
from server.api.services import Services
from server.core.errors import InvalidRequest, UnsupportedParameter
from server.generations.planner import check_in_vocabulary
from server.openai_requests import boolean_from, messages_from, token_ids_from

TOKENIZE_TEXT = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT = {"model", "messages", "add_generation_prompt", "return_token_strs"}


def _version() -> str:
    try:
        return metadata.version("sluice-server")
    except metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def _body(
    services: Services, request: Request, allowed: Callable[[dict[str, Any]], set[str]]
) -> dict[str, Any]:
    """The authenticated JSON body; `allowed(body)` names the keys it may have."""
    services.planner.tenant_of(context_of(request))
    body = await read_json(request, services.edge.max_body_bytes)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(body.keys() - allowed(body))
    if unknown:
        raise UnsupportedParameter(f"unsupported parameter '{unknown[0]}'", param=unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    services.planner.check_model(model)
    return body


async def tokenize(services: Services, request: Request) -> Response:
    body = await _body(
        services, request, lambda body: TOKENIZE_CHAT if "messages" in body else TOKENIZE_TEXT
    )
    if "messages" in body:
        generation_prompt = boolean_from(body, "add_generation_prompt") is not False
        tokens = services.planner.render_chat(
            messages_from(body), template_kwargs={"add_generation_prompt": generation_prompt}
        )
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' must be a string", param="prompt")
        tokens = services.engine.tokenize(
            prompt, boolean_from(body, "add_special_tokens") is not False
        )
    strings = (
        services.engine.token_strings(tokens) if boolean_from(body, "return_token_strs") else None
    )
    return JSONResponse(
        {
            "count": len(tokens),
            "max_model_len": services.engine.model.max_model_len,
            "tokens": tokens,
            "token_strs": strings,
        }
    )


async def detokenize(services: Services, request: Request) -> Response:
    body = await _body(services, request, lambda body: {"model", "tokens"})
    tokens = token_ids_from(body, "tokens")
    if tokens is None:
        raise InvalidRequest("'tokens' is required", param="tokens")
    check_in_vocabulary(tokens, services.engine.model.vocab_size, "tokens")
    return JSONResponse({"prompt": services.engine.detokenize(tokens)})
