"""A tenant's limits when Redis stops answering: each replica keeps to its share, counting what
it admitted before the outage. Two `SharedQuotas` (two replicas) on one real `redis-server`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from conftest import RedisProcess

from server.core.config import StateConfig, TenantConfig
from server.core.errors import TenantQuotaExceeded
from server.observability.metrics import Metrics
from server.scheduler.types import Ticket, TrafficClass
from server.state.backend import RedisState
from server.state.quotas import SharedQuotas

pytestmark = pytest.mark.system

TENANTS = {
    "acme": TenantConfig(name="acme", max_concurrent=4),
    "beta": TenantConfig(name="beta", tokens_per_minute=1000),
}


@pytest.fixture
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    with RedisProcess(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _ticket(i: int, tenant: str = "acme", max_tokens: int = 10) -> Ticket:
    return Ticket(f"r{i}", tenant, TrafficClass.INTERACTIVE, "m", 0.0, 1e9, 10, max_tokens)


async def _replicas(redis: RedisProcess) -> list[SharedQuotas]:
    """Two replicas, each having counted both: the first counted only itself as it started,
    so it starts again once the second has."""
    config = StateConfig(url=redis.url, timeout_ms=1000)
    quotas = [SharedQuotas(RedisState(config, Metrics()), TENANTS) for _ in range(2)]
    for q in quotas:
        await q.start()
    await quotas[0].state.stop()
    await quotas[0].state.start()
    assert [q.state.replicas for q in quotas] == [2, 2]
    return quotas


async def _stop(quotas: list[SharedQuotas]) -> None:
    for q in quotas:
        await q.stop()
        await q.state.stop()


def test_an_outage_counts_what_a_replica_admitted_before_it(redis: RedisProcess) -> None:
    async def run() -> None:
        first, second = await _replicas(redis)
        # Up: three of acme's four on the first replica, one on the second, through Redis.
        held = [await first.acquire(_ticket(i)) for i in range(3)]
        assert all(h is not None and h.lease is not None for h in held)
        assert await second.acquire(_ticket(3)) is not None
        with pytest.raises(TenantQuotaExceeded, match="across all replicas"):
            await second.acquire(_ticket(4))

        redis.stop()
        # Down: a share of 4 / 2 each. The first already runs three: nothing more there; the
        # second runs one, and takes one more. Four in all, not 4 + 2 + 2.
        with pytest.raises(TenantQuotaExceeded, match="this replica's share"):
            await first.acquire(_ticket(5))
        assert not first.up
        extra = await second.acquire(_ticket(6))
        assert extra is not None and extra.lease is None
        with pytest.raises(TenantQuotaExceeded, match="this replica's share"):
            await second.acquire(_ticket(7))

        # Requests admitted through Redis end during the outage: their places free up here.
        for hold in held[:2]:
            assert hold is not None
            first.release(hold)
        local = await first.acquire(_ticket(8))
        assert local is not None and local.lease is None
        with pytest.raises(TenantQuotaExceeded, match="this replica's share"):
            await first.acquire(_ticket(9))
        await _stop([first, second])

    asyncio.run(run())


def test_an_outage_counts_the_tokens_a_replica_was_admitted_for_this_minute(
    redis: RedisProcess,
) -> None:
    async def run() -> None:
        first, second = await _replicas(redis)
        # 600 of beta's 1,000 tokens a minute through the first replica, and ended.
        hold = await first.acquire(_ticket(0, "beta", max_tokens=590))
        assert hold is not None and hold.lease is not None
        first.release(hold)

        redis.stop()
        # Its share is 500 a minute, and it already used 600 of them this minute.
        with pytest.raises(TenantQuotaExceeded, match="this replica's share"):
            await first.acquire(_ticket(1, "beta", max_tokens=10))
        assert await second.acquire(_ticket(2, "beta", max_tokens=490)) is not None
        await _stop([first, second])

    asyncio.run(run())
