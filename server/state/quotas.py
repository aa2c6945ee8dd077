"""Tenant quotas held across replicas, in Redis.

Each replica's scheduler still checks a tenant's limits against what that replica holds
(`server.scheduler.quotas`). With a shared backend, an admitted request must also take a lease
on one of the tenant's slots in Redis, while it waits in the queue, so that the limits hold for
the service as a whole:

- `max_concurrent`: a sorted set per tenant of leases, one per request in flight, scored by
  when each expires. A replica renews its leases every third of `state.lease_seconds`; one that
  dies stops renewing, and its leases expire by themselves.
- `tokens_per_minute`: a sorted set per tenant of admissions (`lease:tokens`, scored by time)
  and their running total, trimmed to the last minute.

Both are checked and taken by one Lua script, atomically, on Redis' clock. Releasing a lease
is sent without waiting for the answer.

If Redis does not answer (down, or slower than `state.timeout_ms`), the replica enforces
1/replicas of each limit by itself (at least 1), and probes Redis every second until it answers
again. Against that share it counts every request it admitted, through Redis or not: one that
holds a Redis lease from before the outage is still in flight on this replica, and the tokens it
was admitted for are still in its minute, so an outage never admits more than the share on top
of them. Requests admitted or running through the outage are not counted in Redis again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_adapters.protocol import GenerationRequest
from server.core.config import TenantConfig
from server.core.errors import TenantQuotaExceeded
from server.scheduler.attainment import SloWatch
from server.scheduler.quotas import TenantQuotas
from server.scheduler.types import Admission, Dispatcher, Ticket
from server.state.backend import RedisState, StateUnavailable

KEY_TTL_MS = 120_000  # a tenant's token window outlives its last admission by this

# KEYS: the tenant's leases, admissions, admitted total. ARGV: lease, lease ms,
# max_concurrent, tokens_per_minute (-1: no limit), tokens. -> {1} or {0, limit, n}: n the
# leases held ("concurrent") or the milliseconds until the tokens fit ("tokens").
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, lease_ms = ARGV[1], tonumber(ARGV[2])
local max_concurrent, per_minute = tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if max_concurrent >= 0 then
  local active = redis.call('ZCARD', KEYS[1])
  if active >= max_concurrent then return {0, 'concurrent', active} end
end
if per_minute >= 0 then
  local cutoff = now - 60000
  local total = tonumber(redis.call('GET', KEYS[3]) or '0')
  local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)
  if #gone > 0 then
    for _, entry in ipairs(gone) do total = total - tonumber(string.match(entry, ':(%d+)$')) end
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cutoff)
    redis.call('SET', KEYS[3], total, 'KEEPTTL')
  end
  if total + tokens > per_minute then
    local excess, wait = total + tokens - per_minute, 60000
    local window = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    for i = 1, #window, 2 do
      excess = excess - tonumber(string.match(window[i], ':(%d+)$'))
      if excess <= 0 then
        wait = tonumber(window[i + 1]) + 60000 - now
        break
      end
    end
    return {0, 'tokens', wait}
  end
  redis.call('ZADD', KEYS[2], now, lease .. ':' .. tokens)
  redis.call('SET', KEYS[3], total + tokens, 'PX', ARGV[6])
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
redis.call('ZADD', KEYS[1], now + lease_ms, lease)
redis.call('PEXPIRE', KEYS[1], lease_ms * 3)
return {1}
"""


@dataclass(frozen=True, slots=True)
class Hold:
    """What an admitted request holds: a lease in Redis, or a slot of the local fallback."""

    ticket: Ticket
    lease: str | None  # None: counted by the fallback, in process


def _keys(tenant: str) -> list[str]:
    tag = "{" + tenant + "}"  # one hash slot per tenant (Redis Cluster)
    return [
        f"sluice:quota:{tag}:leases",
        f"sluice:quota:{tag}:admitted",
        f"sluice:quota:{tag}:total",
    ]


class SharedQuotas:
    """Tenant limits across replicas (see the module's docstring)."""

    def __init__(self, state: RedisState, tenants: Mapping[str, TenantConfig]) -> None:
        self.state = state
        self.tenants = {
            name: t
            for name, t in tenants.items()
            if t.max_concurrent is not None or t.tokens_per_minute is not None
        }
        self._admitted = TenantQuotas(self.tenants)  # by this replica, through Redis or not
        self._releases: set[asyncio.Task[None]] = set()
        self._acquire: Any = None

    @property
    def up(self) -> bool:
        return self.state.up

    async def start(self) -> None:
        """(Starts the state's connection if no one has yet; stopping it is its owner's.)"""
        await self.state.start()
        self._acquire = self.state.script(ACQUIRE)

    async def stop(self) -> None:
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    async def acquire(self, ticket: Ticket) -> Hold | None:
        """A hold on the tenant's share, or TenantQuotaExceeded; None: the tenant has no
        limits."""
        tenant = self.tenants.get(ticket.tenant)
        if tenant is None:
            return None
        state = self.state
        if state.up:
            lease = uuid.uuid4().hex
            try:
                answer = await state.call(
                    "acquire",
                    self._acquire(
                        keys=_keys(tenant.name),
                        args=[
                            lease,
                            state.lease_ms,
                            _limit(tenant.max_concurrent),
                            _limit(tenant.tokens_per_minute),
                            ticket.reserved_tokens,
                            KEY_TTL_MS,
                        ],
                    ),
                )
            except StateUnavailable:
                pass  # counted by the fallback below
            else:
                if answer[0] == 1:
                    state.quota_leases[lease] = _keys(tenant.name)[0]
                    self._admitted.admitted(ticket, time.monotonic())
                    return Hold(ticket, lease)
                raise _refusal(tenant, answer[1], int(answer[2]))
        return self._hold_locally(ticket)

    def release(self, hold: Hold) -> None:
        self._admitted.ended(hold.ticket)
        if hold.lease is None:
            return
        key = self.state.quota_leases.pop(hold.lease, None)
        if key is None or not self.state.up:
            return  # (its lease expires by itself)
        task = asyncio.create_task(self._release(key, hold.lease))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, key: str, lease: str) -> None:
        try:
            await self.state.call("release", self.state.client.zrem(key, lease))
        except StateUnavailable:
            pass

    def _hold_locally(self, ticket: Ticket) -> Hold:
        now = time.monotonic()
        refusal = self._admitted.check(ticket, now, share=max(1, self.state.replicas))
        if refusal is not None:
            raise TenantQuotaExceeded(
                f"{refusal.message} (this replica's share: the shared state is unavailable)",
                retry_after=refusal.retry_after,
            )
        self._admitted.admitted(ticket, now)
        return Hold(ticket, None)


def _limit(value: int | None) -> int:
    return -1 if value is None else value


def _refusal(tenant: TenantConfig, limit: str, amount: int) -> TenantQuotaExceeded:
    if limit == "concurrent":
        return TenantQuotaExceeded(
            f"tenant {tenant.name!r} has {amount} requests in flight across all replicas, "
            f"its limit is {tenant.max_concurrent}",
            retry_after=1.0,
        )
    return TenantQuotaExceeded(
        f"tenant {tenant.name!r} exceeded {tenant.tokens_per_minute} tokens per minute "
        "across all replicas",
        retry_after=max(1.0, amount / 1000.0),
    )


class SharedQuotaDispatcher:
    """A Dispatcher whose admissions also hold the tenant's shared quota: taken while the
    request waits in the queue (a refusal ends it before dispatch, as a local one would),
    released when it leaves."""

    def __init__(self, inner: Dispatcher, quotas: SharedQuotas) -> None:
        self.inner = inner
        self.quotas = quotas

    async def start(self) -> None:
        await self.quotas.start()
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()
        await self.quotas.stop()

    def slo(self, ticket: Ticket) -> SloWatch | None:
        return self.inner.slo(ticket)

    def queued(self) -> int:
        return self.inner.queued()

    def adapter_loaded(self, name: str) -> None:
        self.inner.adapter_loaded(name)

    def generation(self, ticket: Ticket, request: GenerationRequest) -> Admission[Any]:
        admission = self.inner.generation(ticket, request)
        hold: Hold | None = None

        async def enter() -> Any:
            nonlocal hold
            hold = await self.quotas.acquire(ticket)
            return await admission.__aenter__()

        async def leave(generation: Any) -> None:
            await admission.leave()
            if hold is not None:
                self.quotas.release(hold)

        return Admission(enter, leave)
