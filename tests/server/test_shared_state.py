"""Tenant quotas shared by replicas through a real `redis-server`: two real Sluice processes
(sim engine), one Redis, the limits holding for both together, and what happens when a replica
dies or Redis stops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import RedisProcess, SluiceProcess, wait_until

pytestmark = pytest.mark.slow

KEY = {"Authorization": "Bearer acme-key"}
LEASE_SECONDS = 2
# The replica killed below takes longer leases, so that "still held" is checked well within
# them on a loaded machine; the leases' length is the taker's.
DOOMED_LEASE_SECONDS = 6


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replicas") / "sluice.yaml"
    path.write_text(f"""
tenants:
  acme: {{api_keys: [acme-key], max_concurrent: 4}}
  beta: {{api_keys: [beta-key], tokens_per_minute: 100}}
state: {{lease_seconds: {LEASE_SECONDS}}}
""")
    return path


@pytest.fixture(scope="module")
def replicas(redis: RedisProcess, config: Path) -> Iterator[list[SluiceProcess]]:
    servers = [_replica(config, redis) for _ in range(2)]
    try:
        for server in servers:
            server.wait_ready(60)
        _count_two(servers)
        yield servers
    finally:
        for server in servers:
            server.stop()


def _replica(config: Path, redis: RedisProcess) -> SluiceProcess:
    return SluiceProcess(["--engine", "sim", "--config", str(config), "--state-url", redis.url],
                         config.parent / f"replica-{time.monotonic_ns()}.log")


def _count_two(replicas: list[SluiceProcess]) -> None:
    wait_until(lambda: all(s.metric("sluice_state_replicas") == 2 for s in replicas),
               DOOMED_LEASE_SECONDS + 3, message="each replica counts two")


async def _hold(client: httpx.AsyncClient, server: SluiceProcess, max_tokens: int
                ) -> tuple[int, httpx.Headers, str]:
    """A streamed chat's status, headers and (refused) body, read to its end."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": True}
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body,
                             headers=KEY) as response:
        text = "".join([line async for line in response.aiter_lines()])
        return response.status_code, response.headers, text


def _eight_at_once(replicas: list[SluiceProcess]) -> list[tuple[int, httpx.Headers, str]]:
    """Eight concurrent chats of the tenant limited to four, four on each replica, each long
    enough (200 tokens of the sim engine's steps) to be in flight while the others arrive."""

    async def send() -> list[tuple[int, httpx.Headers, str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_hold(client, replicas[i % 2], 200)
                                          for i in range(8)))

    return asyncio.run(send())


def test_a_tenant_limit_holds_across_replicas(replicas: list[SluiceProcess]) -> None:
    results = _eight_at_once(replicas)
    assert sorted(status for status, _, _ in results) == [200] * 4 + [429] * 4
    for status, headers, text in results:
        if status == 429:
            assert "across all replicas" in text and int(headers["retry-after"]) >= 1
    # tokens_per_minute too: 100 tokens a minute for two replicas together.
    beta = {"Authorization": "Bearer beta-key"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    statuses = [httpx.post(replicas[i % 2].url + "/v1/chat/completions", json=chat,
                           headers=beta, timeout=30) for i in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert "tokens per minute across all replicas" in statuses[2].text
    assert int(statuses[2].headers["retry-after"]) > 1


def test_a_killed_replicas_holdings_expire(redis: RedisProcess, replicas: list[SluiceProcess],
                                           config: Path) -> None:
    longer = config.with_name("doomed.yaml")
    longer.write_text(config.read_text().replace(f"lease_seconds: {LEASE_SECONDS}",
                                                 f"lease_seconds: {DOOMED_LEASE_SECONDS}"))
    doomed = _replica(longer, redis)
    doomed.wait_ready(60)
    survivor = replicas[1]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def hold_four_then_kill() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            holding = [asyncio.create_task(_hold(client, doomed, 5000)) for _ in range(4)]
            await asyncio.to_thread(
                wait_until, lambda: doomed.metric("sluice_running_requests") == 4, 30,
                message="the four run")
            doomed.proc.kill()  # SIGKILL: nothing released, nothing renewed
            await asyncio.gather(*holding, return_exceptions=True)

    asyncio.run(hold_four_then_kill())
    refused = httpx.post(survivor.url + "/v1/chat/completions", json=chat, headers=KEY,
                         timeout=30)
    assert refused.status_code == 429  # the dead replica's four leases still count
    wait_until(lambda: httpx.post(survivor.url + "/v1/chat/completions", json=chat,
                                  headers=KEY, timeout=30).status_code == 200,
               DOOMED_LEASE_SECONDS + 3, message="the dead replica's leases expired")
    doomed.stop()


def test_redis_stopped_and_started_mid_run(redis: RedisProcess,
                                           replicas: list[SluiceProcess]) -> None:
    _count_two(replicas)  # (the replica killed above no longer counts)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    statuses: list[int] = []

    def chats(count: int) -> None:
        for i in range(count):
            statuses.append(httpx.post(replicas[i % 2].url + "/v1/chat/completions", json=chat,
                                       headers=KEY, timeout=30).status_code)

    chats(10)
    redis.stop()
    chats(20)  # each replica finds Redis gone on its next call, and falls back
    assert all(s.metric("sluice_state_backend_up") == 0 for s in replicas)
    # Without Redis, each replica holds half the limit: 2 + 2 of the eight.
    results = _eight_at_once(replicas)
    assert sorted(status for status, _, _ in results) == [200] * 4 + [429] * 4
    assert all("this replica's share" in text for status, _, text in results if status == 429)
    redis.start()
    chats(10)
    wait_until(lambda: all(s.metric("sluice_state_backend_up") == 1 for s in replicas),
               5, message="both replicas see Redis again")
    chats(10)
    assert statuses == [200] * 50  # no request failed for Redis' sake
    results = _eight_at_once(replicas)
    assert sorted(status for status, _, _ in results) == [200] * 4 + [429] * 4
    assert all("across all replicas" in text for status, _, text in results if status == 429)
