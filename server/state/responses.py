"""Ended responses of the Responses API in Redis, so that any replica finds them (a retrieve,
a next request's `previous_response_id`): the `ResponseStore` port.

- `sluice:resp:{tenant}:ID` holds a response's JSON, and expires `responses.retention_seconds`
  after it ended.
- `sluice:resp:{tenant}:index` is the tenant's responses by the time each ended (a sorted
  set), `…:sizes` their sizes (a hash) and `…:bytes` their sum: what the bound in bytes is
  kept by. They expire with the tenant's last response.

A tenant's keys share a hash slot (`{tenant}`), so each script touches one. Writing a response
is one script; then what `evictions` says of the tenant's index, read oldest first a page at a
time, is dropped by another, which counts each response's bytes out once, however many
replicas drop it at the same time. Every call may raise `StateUnavailable` (the caller keeps
the response on its host instead).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from server.generations.ports import StoredResponse
from server.generations.registry import evictions, past_retention
from server.state.backend import RedisState, tenant_key

PAGE = 128  # index entries read at a time by eviction

# KEYS: response, index, sizes, bytes. ARGV: body, id, ended at, size, retention ms.
# -> the tenant's bytes.
PUT = """
local old = redis.call('HGET', KEYS[3], ARGV[2])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
local total = redis.call('INCRBY', KEYS[4], ARGV[4])
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
return total
"""

# KEYS: index, sizes, bytes, then the responses. ARGV: their ids. -> the tenant's bytes.
DROP = """
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    local size = redis.call('HGET', KEYS[2], ARGV[i])
    if size then redis.call('DECRBY', KEYS[3], size) end
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
  redis.call('DEL', KEYS[i + 3])
end
return tonumber(redis.call('GET', KEYS[3]) or '0')
"""


def response_key(tenant: str, response_id: str) -> str:
    return tenant_key("resp", tenant, response_id)


def index_keys(tenant: str) -> list[str]:
    """The tenant's index, sizes and bytes."""
    return [tenant_key("resp", tenant, name) for name in ("index", "sizes", "bytes")]


class _Entry(NamedTuple):
    """A response as eviction reads it from the index."""

    response_id: str
    ended_at: float
    size: int


class RedisResponses:
    """See the module's docstring."""

    def __init__(
        self,
        state: RedisState,
        retention_seconds: float,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.retention_seconds = retention_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._put: Any = None
        self._drop: Any = None

    async def start(self) -> None:
        await self.state.start()
        self._put = self.state.script(PUT)
        self._drop = self.state.script(DROP)

    async def put(self, response: StoredResponse) -> None:
        keys = [response_key(response.tenant, response.response_id), *index_keys(response.tenant)]
        total = await self.state.call(
            "keep",
            self._put(
                keys=keys,
                args=[
                    response.body,
                    response.response_id,
                    repr(response.ended_at),
                    response.size,
                    int(self.retention_seconds * 1000),
                ],
            ),
        )
        await self._sweep(response.tenant, int(total))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        client = self.state.client
        key = response_key(tenant, response_id)
        body, ended_at = await self.state.call(
            "find",
            client.pipeline(transaction=False)
            .get(key)
            .zscore(index_keys(tenant)[0], response_id)
            .execute(),
        )
        if body is None or ended_at is None:
            return None
        stored = StoredResponse(tenant, response_id, body.encode(), float(ended_at))
        if past_retention(stored, self._clock(), self.retention_seconds):
            return None  # (its key expires by itself, on Redis' clock)
        return stored

    async def _sweep(self, tenant: str, total: int) -> None:
        """Drop the tenant's responses past their retention (their keys expired by
        themselves; their entries go), then its oldest while they hold more than the bound."""
        index, sizes, _ = keys = index_keys(tenant)
        client = self.state.client
        while True:
            page = await self.state.call("find", client.zrange(index, 0, PAGE - 1, withscores=True))
            if not page:
                return
            ids = [response_id for response_id, _ in page]
            found = await self.state.call("find", client.hmget(sizes, ids))
            entries = [
                _Entry(response_id, float(ended_at), int(size or 0))
                for (response_id, ended_at), size in zip(page, found, strict=True)
            ]
            dropped = [
                entry.response_id
                for entry in evictions(
                    entries, total, self._clock(), self.retention_seconds, self.max_bytes
                )
            ]
            if not dropped:
                return
            total = int(
                await self.state.call(
                    "keep",
                    self._drop(
                        keys=[*keys, *(response_key(tenant, i) for i in dropped)], args=dropped
                    ),
                )
            )
            if len(dropped) < len(page):
                return
