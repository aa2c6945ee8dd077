"""vLLM's render endpoints for chat and completions (`server.http.rendering`): the request
rendered into what the engine would run, in vLLM's `GenerateRequest` shape. vLLM's router
asks for it before it routes each request, for the prompt's token ids."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from server.core.ids import public_id
from server.http.rendering import render_request, rendered
from server.http.replies import JSONResponse
from server.http.services import Services
from server.openai_wire.completion import split_prompts
from server.openai_wire.requests import parse_request


async def render_chat(services: Services, request: Request) -> Response:
    tenant, body, request_id = await render_request(services, request)
    parsed = parse_request(body, "chat")
    services.note_ignored("chat", request.url.path, parsed)
    reply = rendered(services, tenant, parsed, public_id("chat", request_id))
    return JSONResponse(reply.model_dump())


async def render_completion(services: Services, request: Request) -> Response:
    """A list: one rendered request per prompt, as vLLM answers (ids `-0`, `-1`, ... for
    several)."""
    tenant, body, request_id = await render_request(services, request)
    bodies = split_prompts(body) or [body]
    name = public_id("completion", request_id)
    replies = []
    for i, one in enumerate(bodies):
        parsed = parse_request(one, "completion")
        if i == 0:  # (the others hold the same fields)
            services.note_ignored("completions", request.url.path, parsed)
        part = name if len(bodies) == 1 else f"{name}-{i}"
        replies.append(rendered(services, tenant, parsed, part).model_dump())
    return JSONResponse(replies)
