"""What vLLM's render endpoints share, each API's route for its own body: a request rendered
into what the engine would run, without running it (`server.openai_wire.render`'s answer).

The prompt, the model's checks and max_tokens are a generation's own (`Planner.plan_prompt`:
the same chat template, tools and truncation), so the token ids are those a generation of the
same body runs on. As `/tokenize`, a render authenticates the caller and checks its models,
and never reaches the scheduler. As vLLM's, beam search is refused."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from server.core.errors import InvalidRequest
from server.generations.parsed import ParsedRequest
from server.http.edge import context_of, request_id_from
from server.http.replies import read_json
from server.http.services import Services
from server.openai_wire.render import RenderReply, render_reply
from server.tenancy.tenants import Tenant


async def render_request(services: Services, request: Request) -> tuple[Tenant, Any, str]:
    """The caller's tenant (401 otherwise), its JSON body, and the id its answer is named
    by (X-Request-Id's, else a fresh one), before the API's prefix."""
    tenant = services.planner.tenant_of(context_of(request))
    body = await read_json(request, services.edge.max_body_bytes)
    return tenant, body, request_id_from(request.headers.get("x-request-id"))


def rendered(
    services: Services, tenant: Tenant, parsed: ParsedRequest, request_id: str
) -> RenderReply:
    """`parsed` rendered for `tenant`: a 400 or 404 for what a generation of it would get."""
    if parsed.sampling.get("beam_search"):  # (vLLM's words)
        raise InvalidRequest(
            "Beam search is not supported by the render endpoint", param="use_beam_search"
        )
    planner = services.planner
    planner.check_model(parsed.model, tenant)
    prompt = planner.plan_prompt(parsed)
    if prompt.embeds is not None:
        raise InvalidRequest("prompt_embeds have no token ids to render", param="prompt_embeds")
    return render_reply(request_id, parsed, prompt.ids, prompt.sampling(parsed))
