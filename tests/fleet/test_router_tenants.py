"""Tenants through vLLM's router (the real binary) in front of two sim replicas sharing one
Redis: the routes whose headers it forwards (chat, completions, a stored response's GET) keep
the caller's tenant, its traffic class and its quota's honest 429; what it strips of
`Authorization` is refused as any request without a key is (docs/operations.md says where to
send those)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from conftest import RouterProcess, sim_fleet

pytestmark = pytest.mark.system  # the router's and Redis's processes

ACME = {"Authorization": "Bearer acme-key"}
BETA = {"Authorization": "Bearer beta-key"}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, list]]:
    tenants = (
        "tenants:\n"
        "  acme: {api_keys: [acme-key], max_concurrent: 1}\n"
        "  beta: {api_keys: [beta-key]}\n"
    )
    with sim_fleet(tmp_path_factory.mktemp("tenants"), tenants) as fleet:
        yield fleet


def test_a_chat_keeps_its_tenant_and_class_through_the_router(fleet) -> None:  # type: ignore[no-untyped-def]
    router, replicas = fleet
    before = sum(r.metric("sluice_requests_total", traffic_class="bulk") for r in replicas)
    answer = httpx.post(
        router.url + "/v1/chat/completions", json=CHAT, headers={**BETA, "X-Traffic-Class": "bulk"}
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    after = sum(r.metric("sluice_requests_total", traffic_class="bulk") for r in replicas)
    assert after - before == 1
    # A wrong key is the replica's 401, passed back as it is.
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            **CHAT
        )


async def test_a_tenant_over_its_quota_gets_429_with_retry_after_through_the_router(fleet) -> None:  # type: ignore[no-untyped-def]
    """acme may run one request at a time on the whole fleet (its lease in Redis): while one
    streams, the next is refused by both replicas, and the router (which tries the other on a
    429) passes the refusal back with its Retry-After."""
    router, _ = fleet
    long = {**CHAT, "max_tokens": 2000, "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST", router.url + "/v1/chat/completions", json=long, headers=ACME
        ) as holding:
            assert holding.status_code == 200
            lines = holding.aiter_lines()
            await anext(lines)  # it runs, holding acme's one slot
            refused = await client.post(
                router.url + "/v1/chat/completions", json=CHAT, headers=ACME
            )
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "tenant_quota_exceeded"
            assert int(refused.headers["retry-after"]) >= 1
        # The stream left: its slot is free again.
        again = await asyncio.wait_for(
            client.post(router.url + "/v1/chat/completions", json=CHAT, headers=ACME), 60
        )
    assert again.status_code == 200


def test_a_stored_response_is_its_tenants_through_the_router(fleet) -> None:  # type: ignore[no-untyped-def]
    router, replicas = fleet
    # POST /v1/responses reaches a replica without its Authorization through the router: it
    # is sent to a replica directly (the deployments route it so); its GET keeps the header.
    created = httpx.post(
        replicas[0].url + "/v1/responses",
        json={"model": "sim", "input": "hello", "max_output_tokens": 6},
        headers=BETA,
    )
    assert created.status_code == 200
    response_id = created.json()["id"]
    mine = httpx.get(f"{router.url}/v1/responses/{response_id}", headers=BETA)
    assert mine.status_code == 200 and mine.json()["id"] == response_id
    theirs = httpx.get(f"{router.url}/v1/responses/{response_id}", headers=ACME)
    assert theirs.status_code == 404
    # Stripped of its key by the router, a POST /v1/responses is refused as keyless.
    stripped = httpx.post(
        router.url + "/v1/responses", json={"model": "sim", "input": "hi"}, headers=BETA
    )
    assert stripped.status_code == 401
