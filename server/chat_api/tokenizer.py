"""vLLM's tokenizer endpoints and `/version`, so tools written for vLLM's server find them.

`POST /tokenize` takes a text `prompt` (with `add_special_tokens`, default true) or chat
`messages` (through the chat template as a chat renders them: generation prompt included
unless `add_generation_prompt: false`, `continue_final_message`, `chat_template_kwargs`,
`tools`) and answers
`{count, max_model_len, tokens, token_strs}` (`token_strs` null unless `return_token_strs`);
`POST /detokenize` takes `tokens` and answers `{prompt}`. Both use the engine's own tokenizer
and never reach the scheduler.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.generations.planner import check_in_vocabulary
from server.http.edge import context_of
from server.http.replies import JSONResponse, read_json
from server.http.services import Services
from server.openai_wire.chat import messages_of
from server.openai_wire.models import VersionReply
from server.openai_wire.tokenizer import (
    Detokenize,
    DetokenizeReply,
    TokenizeChat,
    TokenizeReply,
    tokenize_body,
)
from server.openai_wire.wire import validated
from server.tenancy.tenants import Tenant


def _version() -> str:
    try:
        return metadata.version("sluice-server")
    except metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


async def version(services: Services, request: Request) -> Response:
    return JSONResponse(VersionReply(version=VERSION).model_dump())


async def _authorized(services: Services, request: Request) -> tuple[Tenant, Any]:
    """The tenant, and the JSON body of its request (validated by the caller)."""
    tenant = services.planner.tenant_of(context_of(request))
    return tenant, await read_json(request, services.edge.max_body_bytes)


async def tokenize(services: Services, request: Request) -> Response:
    tenant, raw = await _authorized(services, request)
    body = tokenize_body(raw)
    services.note_ignored("tokenizer", request.url.path, body)
    services.planner.check_model(body.model, tenant)
    if isinstance(body, TokenizeChat):
        tokens = services.planner.render_chat(
            messages_of(body.messages), body.tools, body.template_kwargs() or None
        )
    else:
        tokens = services.engine.tokenize(body.prompt, body.add_special_tokens is not False)
    strings = services.engine.token_strings(tokens) if body.return_token_strs else None
    reply = TokenizeReply(
        count=len(tokens),
        max_model_len=services.engine.model.max_model_len,
        tokens=tokens,
        token_strs=strings,
    )
    return JSONResponse(reply.model_dump())


async def detokenize(services: Services, request: Request) -> Response:
    tenant, raw = await _authorized(services, request)
    body = validated(Detokenize, raw)
    services.note_ignored("tokenizer", request.url.path, body)
    services.planner.check_model(body.model, tenant)
    check_in_vocabulary(body.tokens, services.engine.model.vocab_size, "tokens")
    return JSONResponse(
        DetokenizeReply(prompt=services.engine.detokenize(body.tokens)).model_dump()
    )
