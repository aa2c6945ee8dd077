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
1/replicas of each limit by itself (at least 1), counting in process as with one replica, and
probes Redis every second until it answers again. Requests admitted or running through the
outage are not counted in Redis again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from engine_adapters.protocol import GenerationRequest
from server import metrics
from server.config import StateConfig, TenantConfig
from server.errors import TenantQuotaExceeded
from server.scheduler.quotas import TenantQuotas
from server.scheduler.types import Admission, Dispatcher, SloTargets, Ticket, TrafficClass

logger = logging.getLogger("sluice.state")
T = TypeVar("T")
PROBE_SECONDS = 1.0  # while Redis is unavailable
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

# KEYS: the replica set, then the leases set of each lease in ARGV. ARGV: replica, lease ms,
# then the leases. Marks the replica alive and renews its leases (those still there).
# -> the replicas alive.
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_ms = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[1])
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', now + lease_ms, ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], lease_ms * 3)
end
return redis.call('ZCARD', KEYS[1])
"""


class StateUnavailable(Exception):
    """Redis did not answer in time, or refused the connection."""


@dataclass(frozen=True, slots=True)
class Hold:
    """What an admitted request holds: a lease in Redis, or a slot of the local fallback."""

    ticket: Ticket
    lease: str | None  # None: counted by the fallback, in process


def _keys(tenant: str) -> list[str]:
    tag = "{" + tenant + "}"  # one hash slot per tenant (Redis Cluster)
    return [f"sluice:quota:{tag}:leases", f"sluice:quota:{tag}:admitted",
            f"sluice:quota:{tag}:total"]


REPLICAS_KEY = "sluice:replicas"


class SharedQuotas:
    """Tenant limits across replicas (see the module's docstring)."""

    def __init__(self, config: StateConfig, tenants: Mapping[str, TenantConfig],
                 client: Any = None) -> None:
        self.config = config
        self.tenants = {name: t for name, t in tenants.items()
                        if t.max_concurrent is not None or t.tokens_per_minute is not None}
        self.replica = uuid.uuid4().hex
        self.replicas = config.replicas  # as Redis last counted them
        self.up = False
        self._client = client
        self._held: dict[str, str] = {}  # lease -> tenant
        self._fallback: TenantQuotas | None = None
        self._fallback_holds = 0
        self._heartbeat: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Task[None]] = set()
        self._acquire: Any = None
        self._renew: Any = None

    async def start(self) -> None:
        if self._client is None:
            assert self.config.url is not None
            # One retry, at once: a connection Redis dropped (a restart) fails its first call.
            self._client = redis.asyncio.from_url(
                self.config.url, decode_responses=True, socket_timeout=self.config.timeout_s,
                socket_connect_timeout=self.config.timeout_s, retry=Retry(NoBackoff(), 1))
        self._acquire = self._client.register_script(ACQUIRE)
        self._renew = self._client.register_script(RENEW)
        for operation in metrics.STATE_OPERATIONS:  # every series from the start, at zero
            metrics.STATE_ERRORS.labels(operation)
        await self._beat()
        if not self.up:
            logger.warning("the state backend at %s is unavailable: each tenant limit is "
                           "divided by %d until it answers", self.config.url, self.replicas)
        self._heartbeat = asyncio.create_task(self._beating())

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
        if self._client is not None:
            try:
                await self._call("release", self._client.zrem(REPLICAS_KEY, self.replica))
            except StateUnavailable:
                pass
            await self._client.aclose()

    async def acquire(self, ticket: Ticket) -> Hold | None:
        """A hold on the tenant's share, or TenantQuotaExceeded; None: the tenant has no
        limits."""
        tenant = self.tenants.get(ticket.tenant)
        if tenant is None:
            return None
        if self.up:
            lease = uuid.uuid4().hex
            try:
                answer = await self._call("acquire", self._acquire(keys=_keys(tenant.name), args=[
                    lease, int(self.config.lease_s * 1000), _limit(tenant.max_concurrent),
                    _limit(tenant.tokens_per_minute), ticket.reserved_tokens, KEY_TTL_MS]))
            except StateUnavailable:
                pass  # counted by the fallback below
            else:
                if answer[0] == 1:
                    self._held[lease] = tenant.name
                    return Hold(ticket, lease)
                raise _refusal(tenant, answer[1], int(answer[2]))
        return self._hold_locally(ticket)

    def release(self, hold: Hold) -> None:
        if hold.lease is None:
            assert self._fallback is not None
            self._fallback.ended(hold.ticket)
            self._fallback_holds -= 1
            return
        tenant = self._held.pop(hold.lease, None)
        if tenant is None or not self.up:
            return  # (its lease expires by itself)
        task = asyncio.create_task(self._release(tenant, hold.lease))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, tenant: str, lease: str) -> None:
        try:
            await self._call("release", self._client.zrem(_keys(tenant)[0], lease))
        except StateUnavailable:
            pass

    def _hold_locally(self, ticket: Ticket) -> Hold:
        if self._fallback is None or not self._fallback_holds:
            share = max(1, self.replicas)
            self._fallback = TenantQuotas({name: replace(
                t, max_concurrent=_share(t.max_concurrent, share),
                tokens_per_minute=_share(t.tokens_per_minute, share))
                for name, t in self.tenants.items()})
        now = time.monotonic()
        refusal = self._fallback.check(ticket, now)
        if refusal is not None:
            raise TenantQuotaExceeded(
                f"{refusal.message} (this replica's share: the shared state is unavailable)",
                retry_after=refusal.retry_after)
        self._fallback.admitted(ticket, now)
        self._fallback_holds += 1
        return Hold(ticket, None)

    async def _beating(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3 if self.up else PROBE_SECONDS)
            await self._beat()

    async def _beat(self) -> None:
        """Mark this replica alive and renew its leases; whether Redis answers decides `up`."""
        held = list(self._held.items())
        try:
            self.replicas = int(await self._call("renew", self._renew(
                keys=[REPLICAS_KEY, *(_keys(tenant)[0] for _, tenant in held)],
                args=[self.replica, int(self.config.lease_s * 1000),
                      *(lease for lease, _ in held)])))
        except StateUnavailable:
            if self.up:
                logger.warning("the state backend stopped answering: each tenant limit is "
                               "divided by %d until it answers again", self.replicas)
            self._set_up(False)
            return
        if not self.up:
            logger.info("the state backend answers: tenant limits are shared by %d "
                        "replica(s)", self.replicas)
        self._set_up(True)
        metrics.STATE_REPLICAS.labels("redis").set(self.replicas)

    def _set_up(self, up: bool) -> None:
        self.up = up
        metrics.STATE_UP.labels("redis").set(1 if up else 0)

    async def _call(self, operation: str, call: Awaitable[T]) -> T:
        """One round trip, timed; StateUnavailable (and `up` false) if it fails or is slow."""
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(call, self.config.timeout_s)
        except (TimeoutError, OSError, RedisError) as exc:
            return self._failed(operation, exc)
        metrics.STATE_LATENCY.labels(operation).observe(time.perf_counter() - started)
        return result

    def _failed(self, operation: str, exc: BaseException) -> Any:
        metrics.STATE_ERRORS.labels(operation).inc()
        if self.up:
            logger.warning("state backend %s failed: %r", operation, exc)
        self._set_up(False)
        raise StateUnavailable(str(exc)) from None


def _limit(value: int | None) -> int:
    return -1 if value is None else value


def _share(limit: int | None, replicas: int) -> int | None:
    return None if limit is None else max(1, limit // replicas)


def _refusal(tenant: TenantConfig, limit: str, amount: int) -> TenantQuotaExceeded:
    if limit == "concurrent":
        return TenantQuotaExceeded(
            f"tenant {tenant.name!r} has {amount} requests in flight across all replicas, "
            f"its limit is {tenant.max_concurrent}", retry_after=1.0)
    return TenantQuotaExceeded(
        f"tenant {tenant.name!r} exceeded {tenant.tokens_per_minute} tokens per minute "
        "across all replicas", retry_after=max(1.0, amount / 1000.0))


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

    def slo_targets(self, traffic_class: TrafficClass) -> SloTargets | None:
        return self.inner.slo_targets(traffic_class)

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
