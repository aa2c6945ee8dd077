"""vLLM's tokenizer endpoints and `/version`, so tools written for vLLM's server find them.

`POST /tokenize` takes a text `prompt` (with `add_special_tokens`, default true) or chat
`messages` (through the chat template, generation prompt included) and answers
`{count, max_model_len, tokens, token_strs}` (`token_strs` null unless `return_token_strs`);
`POST /detokenize` takes `tokens` and answers `{prompt}`. Both use the engine's own tokenizer
and never reach the scheduler.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.generation import RequestContext, Sluice, check_in_vocabulary
from server.openai.chat import messages_of
from server.openai.tokenizer import Detokenize, TokenizeChat, tokenize_body
from server.openai.wire import validated
from server.openai_routes import JSONResponse, read_json


def _version() -> str:
    try:
        return metadata.version("sluice-server")
    except metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def _authorized(request: Request) -> tuple[Sluice, Any]:
    """The authenticated tenant's server and the JSON body (validated by the caller)."""
    sluice: Sluice = request.app.state.sluice
    sluice.tenant_of(RequestContext.of(request))
    return sluice, await read_json(request, sluice.max_body_bytes)


async def tokenize(request: Request) -> Response:
    sluice, raw = await _authorized(request)
    body = tokenize_body(raw)
    sluice.check_model(body.model)
    if isinstance(body, TokenizeChat):
        tokens = sluice.render_chat(
            messages_of(body.messages),
            template_kwargs={"add_generation_prompt": body.add_generation_prompt is not False},
        )
    else:
        tokens = sluice.engine.tokenize(body.prompt, body.add_special_tokens is not False)
    strings = sluice.engine.token_strings(tokens) if body.return_token_strs else None
    return JSONResponse(
        {
            "count": len(tokens),
            "max_model_len": sluice.engine.model.max_model_len,
            "tokens": tokens,
            "token_strs": strings,
        }
    )


async def detokenize(request: Request) -> Response:
    sluice, raw = await _authorized(request)
    body = validated(Detokenize, raw)
    sluice.check_model(body.model)
    check_in_vocabulary(body.tokens, sluice.engine.model.vocab_size, "tokens")
    return JSONResponse({"prompt": sluice.engine.detokenize(body.tokens)})
