"""The connection to the state replicas share (Redis), and this replica's heartbeat.

`RedisState` owns the clients, the replica's id, whether Redis answers (`up`), and one
heartbeat every third of `state.lease_seconds` that marks the replica alive and renews every
lease it holds: tenant quota slots (`server.state.quotas`) and the generations it runs
(`server.state.runs`). A replica that dies stops renewing, and what it held expires by itself.

Every call is timed and bounded by `state.timeout_ms`; one that fails or is slow marks Redis
unavailable (each feature says what it does then) until a probe, every second, answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from server.core.config import StateConfig
from server.core.errors import StateUnavailable, StoreUnavailable
from server.observability.metrics import STATE_OPERATIONS, Metrics

logger = logging.getLogger("sluice.state")
T = TypeVar("T")
PROBE_SECONDS = 1.0  # while Redis is unavailable
REPLICAS_KEY = "sluice:replicas"

# KEYS: the replica set, then the set of each quota lease, then each generation's lease.
# ARGV: replica, lease ms, how many quota leases, then those leases. Marks the replica alive
# and renews its leases (those still there, and still its own). -> the replicas alive.
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replica, lease_ms, quotas = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + lease_ms, replica)
for i = 2, quotas + 1 do
  redis.call('ZADD', KEYS[i], 'XX', now + lease_ms, ARGV[i + 2])
  redis.call('PEXPIRE', KEYS[i], lease_ms * 3)
end
for i = quotas + 2, #KEYS do
  if redis.call('GET', KEYS[i]) == replica then redis.call('PEXPIRE', KEYS[i], lease_ms) end
end
return redis.call('ZCARD', KEYS[1])
"""


class RedisState:
    """See the module's docstring. `quota_leases` (lease -> its sorted set's key) and
    `run_leases` (lease keys) are what the heartbeat renews; their owners add and remove."""

    def __init__(self, config: StateConfig, metrics: Metrics, client: Any = None) -> None:
        self.config = config
        self.metrics = metrics
        self.replica = uuid.uuid4().hex
        self.replicas = config.replicas  # as Redis last counted them
        self.up = False
        self.client: Any = client
        self.reader: Any = None  # for blocking reads, which outlast `timeout_ms`
        self.quota_leases: dict[str, str] = {}
        self.run_leases: set[str] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._renew: Any = None
        self._started = False

    @property
    def lease_ms(self) -> int:
        return int(self.config.lease_s * 1000)

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.client is None:
            assert self.config.url is not None
            # One retry, at once: a connection Redis dropped (a restart) fails its first call.
            self.client = redis.asyncio.from_url(
                self.config.url,
                decode_responses=True,
                socket_timeout=self.config.timeout_s,
                socket_connect_timeout=self.config.timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
        if self.config.url is not None:
            self.reader = redis.asyncio.from_url(
                self.config.url,
                decode_responses=True,
                socket_timeout=None,
                socket_connect_timeout=self.config.timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
        self._renew = self.script(RENEW)
        for operation in STATE_OPERATIONS:  # every series from the start, at zero
            self.metrics.state_errors.labels(operation)
        await self._beat()
        if not self.up:
            logger.warning(
                "the state backend at %s is unavailable: each tenant limit is "
                "divided by %d and generations resume only on their own replica "
                "until it answers",
                self.config.url,
                self.replicas,
            )
        self._heartbeat = asyncio.create_task(self._beating())

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            await self.call("release", self.client.zrem(REPLICAS_KEY, self.replica))
        except StateUnavailable:
            pass
        await self.client.aclose()
        if self.reader is not None:
            await self.reader.aclose()

    def script(self, source: str) -> Any:
        return self.client.register_script(source)

    async def _beating(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3 if self.up else PROBE_SECONDS)
            await self._beat()

    async def _beat(self) -> None:
        """Mark this replica alive and renew its leases; whether Redis answers decides `up`."""
        quotas = list(self.quota_leases.items())
        try:
            self.replicas = int(
                await self.call(
                    "renew",
                    self._renew(
                        keys=[REPLICAS_KEY, *(key for _, key in quotas), *self.run_leases],
                        args=[
                            self.replica,
                            self.lease_ms,
                            len(quotas),
                            *(lease for lease, _ in quotas),
                        ],
                    ),
                )
            )
        except StateUnavailable:
            return
        if not self.up:
            logger.info(
                "the state backend answers: tenant limits are shared by %d replica(s)",
                self.replicas,
            )
        self._set_up(True)
        self.metrics.state_replicas.labels("redis").set(self.replicas)

    def _set_up(self, up: bool) -> None:
        if self.up and not up:
            logger.warning(
                "the state backend stopped answering: each tenant limit is divided "
                "by %d until it answers again",
                self.replicas,
            )
        self.up = up
        self.metrics.state_up.labels("redis").set(1 if up else 0)

    async def call(self, operation: str, call: Awaitable[T], limit_s: float | None = None) -> T:
        """One round trip, timed; StateUnavailable (and `up` false) if it fails or is slower
        than `limit_s` (`state.timeout_ms` by default)."""
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(call, limit_s or self.config.timeout_s)
        except (TimeoutError, OSError, RedisError) as exc:
            self.metrics.state_errors.labels(operation).inc()
            if self.up:
                logger.warning("state backend %s failed: %r", operation, exc)
            self._set_up(False)
            raise StateUnavailable(str(exc)) from None
        self.metrics.state_latency.labels(operation).observe(time.perf_counter() - started)
        return result


def tenant_key(space: str, tenant: str, *parts: str) -> str:
    """A key of `tenant`'s (`sluice:SPACE:{TENANT}:PART…`): a tenant's keys of a space share a
    hash slot, so that one script may touch them all."""
    return ":".join((f"sluice:{space}:{{{tenant}}}", *parts))


class RedisStore:
    """What a store that clients call (the Batch API's, the conversations') shares: each call
    through `state`'s client, counted under `OPERATION`, bounded by `CALL_TIMEOUT_S` (no call
    is on a token's path: each is allowed more than `state.timeout_ms`, which quotas keep), a
    failure answered 503 `store_unavailable` (`NAME`: the store, in its message); its scripts
    registered at first use, once `state` has started."""

    OPERATION = "store"
    NAME = "the store"
    CALL_TIMEOUT_S = 5.0

    def __init__(self, state: RedisState) -> None:
        self.state = state
        self._scripts: dict[str, Any] = {}

    async def close(self) -> None:
        """Nothing of its own: `state`'s connections close with it."""

    async def _call(self, call: Awaitable[T], limit_s: float | None = None) -> T:
        try:
            return await self.state.call(self.OPERATION, call, limit_s or self.CALL_TIMEOUT_S)
        except StateUnavailable as exc:
            raise StoreUnavailable(
                f"{self.NAME} (Redis) did not answer: {exc!r}", retry_after=PROBE_SECONDS
            ) from None

    async def _script(self, source: str, keys: list[str], args: list[Any]) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self._client.register_script(source)
        return await self._call(script(keys=keys, args=args))

    @property
    def _client(self) -> Any:
        return self.state.reader or self.state.client
