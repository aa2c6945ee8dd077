"""The Batch API's store in Redis (`BatchStore`), with `state.url`: every replica using the
Redis serves the same files and batches, and the replica that claims a batch runs it.

Keys (none expires: a file is kept until deleted and a batch for good, as in SQLite):

- `sluice:bfile:{TENANT}:ID`: a file's hash (its object's fields, and `content`; a batch's
  output or error file has `batch` and `states` instead, and is read from the batch's
  results), listed in `sluice:bfiles:{TENANT}` (a sorted set, by `created_at`).
- `sluice:batch:ID`: a hash of the batch's JSON (`body`, `Batch.to_row`) and its lines'
  counts (`completed`, `failed`, which stand for the JSON's); the tenant's batches in
  `sluice:batches:{TENANT}` (by a sequence, `sluice:batches:seq`); every batch's status in the
  hash `sluice:batches:status`; the active ones in the set `sluice:batches:active`.
- `sluice:batch:ID:lines` (index -> `[custom_id, body]`), `…:pending` (a sorted set of the
  pending indices), `…:done`, `…:failed`, `…:expired` (index -> result).
- `sluice:batch:ID:claim`: the replica that runs it, for `state.lease_seconds`; the runner
  renews it (`BatchRunner`), and once it lapses another replica claims the batch.

A line's result is written by one script with its count, once: its index leaves `…:pending`
as it is written. A change to a batch's JSON (a cancel, its end) is computed here, by the same
code as SQLite's, and applied by a script only if the JSON is still what was read (else it is
read again): each change is atomic.
Each call is bounded by `RedisStore.CALL_TIMEOUT_S` (a file's content by `FILE_TIMEOUT_S`); Redis
unavailable, the Batch API answers 503 `store_unavailable` and runners try again at their next
beat. Batches outlive a restart of Redis only if it persists (AOF or RDB).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

from redis.asyncio.client import NEVER_DECODE

from server.batch_api.store import (
    ACTIVE,
    CANCELLABLE,
    PAGE_LINES,
    RESULT_FILES,
    Batch,
    Line,
    file_object,
    finished,
    one_chunk,
    result_files,
)
from server.core.errors import StoreUnavailable
from server.core.ids import new_id
from server.state.backend import RedisStore, tenant_key
from server.state.runs import LET_GO

FILE_TIMEOUT_S = 30.0  # a file's content (up to --max-file-bytes), or a page of a batch's results
ATTEMPTS = 8  # compare-and-set rounds before a change gives up (another writes as often)
STATUSES_KEY = "sluice:batches:status"
ACTIVE_KEY = "sluice:batches:active"
SEQUENCE_KEY = "sluice:batches:seq"
FILE_FIELDS = ("id", "bytes", "created_at", "filename", "purpose")
BATCH_FIELDS = ("body", "completed", "failed")

# KEYS: batch, statuses, active, claim. ARGV: the JSON read, the new JSON, id, status, "1":
# the batch has ended (no longer active; its claim dropped). -> 1; 0: the JSON had changed.
SAVE = """
if redis.call('HGET', KEYS[1], 'body') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'body', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
if ARGV[5] == '1' then
  redis.call('SREM', KEYS[3], ARGV[3])
  redis.call('DEL', KEYS[4])
end
return 1
"""

# KEYS: batch, pending, the results of the line's state. ARGV: index, result, the count it
# adds to ("completed" or "failed"). A line no longer pending is left as it is. -> the batch.
FINISH = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
end
return redis.call('HMGET', KEYS[1], 'body', 'completed', 'failed')
"""

# KEYS: the results of each state a file holds. -> their bytes, each result a line.
RESULTS_SIZE = """
local total = 0
for _, key in ipairs(KEYS) do
  for _, index in ipairs(redis.call('HKEYS', key)) do
    total = total + redis.call('HSTRLEN', key, index) + 1
  end
end
return total
"""

# KEYS: claim, active, batch. ARGV: owner, lease ms, id. -> the batch, now held by `owner`;
# nil: it has ended, or another owner's lease is live.
CLAIM = """
if redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 0 then return false end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return false end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('HMGET', KEYS[3], 'body', 'completed', 'failed')
"""

# KEYS: statuses, then each batch's claim. ARGV: owner, lease ms, then each batch's id.
# -> id, status, … for each claim still the owner's (renewed).
RENEW = """
local held = {}
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    held[#held + 1] = ARGV[i + 1]
    held[#held + 1] = redis.call('HGET', KEYS[1], ARGV[i + 1]) or ''
  end
end
return held
"""


def _file_key(tenant: str, file_id: str) -> str:
    return tenant_key("bfile", tenant, file_id)


def _files_key(tenant: str) -> str:
    return tenant_key("bfiles", tenant)


def _batches_key(tenant: str) -> str:
    return tenant_key("batches", tenant)


def _batch_key(batch_id: str, suffix: str = "") -> str:
    return f"sluice:batch:{batch_id}{suffix}"


class RedisBatchStore(RedisStore):
    """`BatchStore` (`server.batch_api.store`) in the Redis of `state` (see the module's
    docstring)."""

    OPERATION = "batches"  # every call's label in the state backend's metrics
    NAME = "the batch store"

    # -- files ------------------------------------------------------------------------------

    async def add_file(
        self, tenant: str, purpose: str, filename: str, content: bytes
    ) -> dict[str, Any]:
        file = file_object(new_id("file"), len(content), int(time.time()), filename, purpose)
        pipe = self._client.pipeline(transaction=True)
        _add_file(pipe, tenant, file, content=content)
        await self._call(pipe.execute(), FILE_TIMEOUT_S)
        return file

    async def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        values = await self._call(self._client.hmget(_file_key(tenant, file_id), FILE_FIELDS))
        return _file(values)

    async def files(self, tenant: str, purpose: str | None = None) -> list[dict[str, Any]]:
        ids = await self._call(self._client.zrevrange(_files_key(tenant), 0, -1))
        pipe = self._client.pipeline(transaction=False)
        for file_id in ids:
            pipe.hmget(_file_key(tenant, file_id), FILE_FIELDS)
        found = [_file(values) for values in await self._call(pipe.execute())] if ids else []
        return [
            file
            for file in found
            if file is not None and (purpose is None or file["purpose"] == purpose)
        ]

    async def file_content(self, tenant: str, file_id: str) -> AsyncIterator[bytes] | None:
        content, batch_id, states = await self._call(
            self._client.execute_command(
                "HMGET",
                _file_key(tenant, file_id),
                "content",
                "batch",
                "states",
                **{NEVER_DECODE: True},
            ),
            FILE_TIMEOUT_S,
        )
        if content is not None:
            return one_chunk(bytes(content))
        if batch_id is None:
            return None
        return self._results(batch_id.decode(), json.loads(states))

    async def _results(self, batch_id: str, states: list[str]) -> AsyncIterator[bytes]:
        keys = [_batch_key(batch_id, f":{state}") for state in states]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hkeys(key)
        found = await self._call(pipe.execute(), FILE_TIMEOUT_S)
        lines = sorted(
            (int(i), key) for key, indices in zip(keys, found, strict=True) for i in indices
        )
        for start in range(0, len(lines), PAGE_LINES):
            pipe = self._client.pipeline(transaction=False)
            for index, key in lines[start : start + PAGE_LINES]:
                pipe.hget(key, index)
            results = await self._call(pipe.execute(), FILE_TIMEOUT_S)
            yield "".join(result + "\n" for result in results).encode()

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(_file_key(tenant, file_id))
        pipe.zrem(_files_key(tenant), file_id)
        deleted, _ = await self._call(pipe.execute())
        return bool(deleted)

    # -- batches ----------------------------------------------------------------------------

    async def add_batch(self, batch: Batch, lines: list[Line]) -> None:
        seq = await self._call(self._client.incr(SEQUENCE_KEY))
        pipe = self._client.pipeline(transaction=True)
        if lines:
            pipe.hset(
                _batch_key(batch.id, ":lines"),
                mapping={
                    str(line.index): json.dumps([line.custom_id, line.body]) for line in lines
                },
            )
            pipe.zadd(
                _batch_key(batch.id, ":pending"), {str(line.index): line.index for line in lines}
            )
        counts = batch.request_counts
        pipe.hset(
            _batch_key(batch.id),
            mapping={"body": batch.to_row(), **{n: counts[n] for n in BATCH_FIELDS[1:]}},
        )
        pipe.hset(STATUSES_KEY, batch.id, batch.status)
        if batch.status in ACTIVE:
            pipe.sadd(ACTIVE_KEY, batch.id)
        pipe.zadd(_batches_key(batch.tenant), {batch.id: seq})
        await self._call(pipe.execute(), FILE_TIMEOUT_S)

    async def batch(self, tenant: str | None, batch_id: str) -> Batch | None:
        return _batch(await self._read(batch_id), tenant)

    async def _read(self, batch_id: str) -> list[str | None]:
        """The batch's hash: its JSON, and its counts."""
        return list(await self._call(self._client.hmget(_batch_key(batch_id), BATCH_FIELDS)))

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        key, top = _batches_key(tenant), "+inf"
        if after is not None:
            seq = await self._call(self._client.zscore(key, after))
            top = "+inf" if seq is None else f"({int(seq)}"
        ids = await self._call(
            self._client.zrevrangebyscore(key, top, "-inf", start=0, num=limit + 1)
        )
        pipe = self._client.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hmget(_batch_key(batch_id), BATCH_FIELDS)
        rows = await self._call(pipe.execute()) if ids else []
        found = [batch for batch in (_batch(row, tenant) for row in rows) if batch is not None]
        return found[:limit], len(ids) > limit

    async def statuses(self) -> list[str]:
        return list(await self._call(self._client.hvals(STATUSES_KEY)))

    async def cancel(self, tenant: str, batch_id: str, now: int) -> Batch | None:
        for _ in range(ATTEMPTS):
            row = await self._read(batch_id)
            batch = _batch(row, tenant)
            if batch is None or batch.status not in CANCELLABLE:
                return batch
            batch.status, batch.times["cancelling"] = "cancelling", now
            if await self._save(row[0], batch, ended=False):
                return batch
        raise StoreUnavailable(f"batch {batch_id} changed too often to be cancelled")

    async def _save(self, row: str | None, batch: Batch, *, ended: bool) -> bool:
        keys = [_batch_key(batch.id), STATUSES_KEY, ACTIVE_KEY, _batch_key(batch.id, ":claim")]
        args = [row, batch.to_row(), batch.id, batch.status, "1" if ended else ""]
        return bool(await self._script(SAVE, keys, args))

    # -- claims -----------------------------------------------------------------------------

    async def claimable(self, owner: str) -> list[str]:
        ids = sorted(await self._call(self._client.smembers(ACTIVE_KEY)))
        if not ids:
            return []
        holders = await self._call(self._client.mget([_batch_key(i, ":claim") for i in ids]))
        return [i for i, holder in zip(ids, holders, strict=True) if holder in (None, owner)]

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> Batch | None:
        keys = [_batch_key(batch_id, ":claim"), ACTIVE_KEY, _batch_key(batch_id)]
        row = await self._script(CLAIM, keys, [owner, int(lease_s * 1000), batch_id])
        return _batch(row, None)

    async def renew(self, owner: str, batch_ids: Collection[str], lease_s: float) -> dict[str, str]:
        ids = list(batch_ids)
        if not ids:
            return {}
        keys = [STATUSES_KEY, *(_batch_key(i, ":claim") for i in ids)]
        held = await self._script(RENEW, keys, [owner, int(lease_s * 1000), *ids])
        return dict(zip(held[::2], held[1::2], strict=True))

    async def release(self, batch_id: str, owner: str) -> None:
        await self._script(LET_GO, [_batch_key(batch_id, ":claim")], [owner])

    # -- lines ------------------------------------------------------------------------------

    async def pending(self, batch_id: str, limit: int, skip: Collection[int] = ()) -> list[Line]:
        indices = [
            int(i)
            for i in await self._call(
                self._client.zrange(_batch_key(batch_id, ":pending"), 0, limit + len(skip) - 1)
            )
            if int(i) not in skip
        ][:limit]
        if not indices:
            return []
        rows = await self._call(self._client.hmget(_batch_key(batch_id, ":lines"), indices))
        lines = []
        for index, row in zip(indices, rows, strict=True):
            custom_id, body = json.loads(row)
            lines.append(Line(index, custom_id, body))
        return lines

    async def finish_line(
        self, batch_id: str, index: int, state: str, result: dict[str, Any]
    ) -> Batch:
        keys = [
            _batch_key(batch_id),
            _batch_key(batch_id, ":pending"),
            _batch_key(batch_id, f":{state}"),
        ]
        count = "completed" if state == "done" else "failed"
        batch = _batch(await self._script(FINISH, keys, [index, json.dumps(result), count]), None)
        assert batch is not None
        return batch

    async def finalize(self, batch_id: str, status: str, now: int) -> Batch:
        for _ in range(ATTEMPTS):
            row = await self._read(batch_id)
            batch = _batch(row, None)
            assert batch is not None
            if batch.status not in ACTIVE:
                return batch
            sizes = [
                await self._script(
                    RESULTS_SIZE, [_batch_key(batch_id, f":{state}") for state in states], []
                )
                for _, _, states in RESULT_FILES
            ]
            files = result_files(batch, sizes, now)
            finished(batch, status, now)
            # The files first: a batch that names them never lacks them (a round lost to a
            # change made meanwhile leaves them unnamed, and deletes them).
            pipe = self._client.pipeline(transaction=True)
            for file, states in files:
                _add_file(pipe, batch.tenant, file, batch=batch_id, states=json.dumps(states))
            await self._call(pipe.execute(), FILE_TIMEOUT_S)
            if await self._save(row[0], batch, ended=True):
                return batch
            for file, _ in files:
                await self.delete_file(batch.tenant, file["id"])
        raise StoreUnavailable(f"batch {batch_id} changed too often to be finalized")


def _add_file(pipe: Any, tenant: str, file: dict[str, Any], **fields: str | bytes) -> None:
    """`fields`: its `content`, or a batch's result file's `batch` and `states`."""
    pipe.hset(_file_key(tenant, file["id"]), mapping={**file, **fields})
    pipe.zadd(_files_key(tenant), {file["id"]: file["created_at"]})


def _file(values: list[str | None]) -> dict[str, Any] | None:
    file_id, size, created_at, filename, purpose = values
    if file_id is None:
        return None
    return file_object(file_id, int(size or 0), int(created_at or 0), filename or "", purpose or "")


def _batch(row: list[str | None] | None, tenant: str | None) -> Batch | None:
    """The batch its hash holds (`BATCH_FIELDS`), if it is `tenant`'s (any, None)."""
    if row is None or row[0] is None:
        return None
    batch = Batch.from_row(row[0])
    for name, count in zip(BATCH_FIELDS[1:], row[1:], strict=True):
        batch.request_counts[name] = int(count or 0)
    return batch if tenant is None or batch.tenant == tenant else None
